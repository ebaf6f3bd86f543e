"""Errors partita raises for problems a user can fix.

Every message says what went wrong, where (module, node, stage, rank), and what to do about it.
"""


class PartitaError(RuntimeError):
    """Base class of every error partita raises on purpose."""


class CaptureError(PartitaError):
    """torch.export could not capture the model's graph."""


class PlanError(PartitaError):
    """A plan is invalid, does not fit the model or the world, or no plan fits."""


class BatchError(PartitaError):
    """The inputs of a call do not fit the plan (batch size, device, structure)."""


class LaunchError(PartitaError):
    """Processes could not be started or could not find each other."""


class CheckpointError(PartitaError):
    """A checkpoint could not be written, found, trusted or applied to this model."""


class SettingsError(PartitaError):
    """A PARTITA_* environment variable has a value partita cannot use."""
