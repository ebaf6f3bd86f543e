"""Errors partita raises.

Every error for a problem a user can fix says what went wrong, where (module, node, stage, rank), and what to
do about it. An InternalError is partita's own bug. A RankError carries an error from one rank to the others
as data (its type's name and its message), so that every rank can raise the same error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class PartitaError(RuntimeError):
    """Base class of every error partita raises on purpose."""


class CaptureError(PartitaError):
    """torch.export could not capture the model's graph."""


class PlanError(PartitaError):
    """A plan is invalid, does not fit the model or the world, or no plan fits."""


class BatchError(PartitaError):
    """The inputs of a call do not fit the plan (batch size, device, structure)."""


class ModelError(PartitaError):
    """The model as given cannot be built on the ranks: a meta module nothing initializes, tensors on another
    rank's device."""


class LaunchError(PartitaError):
    """Processes could not be started or could not find each other."""


class CheckpointError(PartitaError):
    """A checkpoint could not be written, found, trusted or applied to this model."""


class SettingsError(PartitaError):
    """A PARTITA_* environment variable has a value partita cannot use."""


class InternalError(PartitaError):
    """A bug in partita, not a problem with the model, the inputs or the settings: partita found its own
    state inconsistent. The message says what was inconsistent; please report it to partita's maintainers
    with that message (and, if you can, the model and the command that raised it)."""


# partita's error classes by name: the kinds a RankError can name and rebuild
KINDS: dict[str, type[PartitaError]] = {c.__name__: c for c in (
    PartitaError, CaptureError, PlanError, BatchError, ModelError, LaunchError, CheckpointError, SettingsError, InternalError)}


def as_partita(exc: BaseException) -> PartitaError:
    """`exc` itself if it is a PartitaError; any other exception becomes a PartitaError "TypeName: message"
    (`describe`)."""
    if isinstance(exc, PartitaError):
        return exc
    return PartitaError(describe(exc))


def describe(exc: BaseException) -> str:
    r""""TypeName: message". An error whose message is empty or starts on a new line, raised from another (torch's
    pipeline stage wraps the model's error so, in a message of debugging details), is shown with its first line
    and the error it came from: its own first line alone would be a bare "RuntimeError:".

    >>> try:
    ...     raise RuntimeError("\n    [Stage 1] failed to run forward:\n    args: ...") from ValueError("bad row")
    ... except RuntimeError as e:
    ...     describe(e)
    'RuntimeError: [Stage 1] failed to run forward:, from ValueError: bad row'
    """
    text = str(exc)
    if exc.__cause__ is None or (text.strip() and not text[:1].isspace()):
        return f"{type(exc).__name__}: {text}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first + ', ' if first else ''}from {describe(exc.__cause__)}"


@dataclass(frozen=True)
class RankError:
    """An error raised on rank `rank`, as data that crosses ranks (picklable, plain strings): `kind` is the
    name of one of partita's error classes (KINDS), `message` the error's message.

    A rank that failed sends `RankError.of(rank, e)`; every rank then raises `first_error(received, world)`
    (or one error's `.error()`), so all of them stop with the same typed error naming the failing rank."""

    rank: int
    kind: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> RankError:
        """`exc`, raised on `rank`, as data. A PartitaError keeps the name of its class (of the nearest of
        partita's classes, for a subclass defined elsewhere) and its message; any other exception becomes kind
        PartitaError with message "TypeName: message"."""
        error = as_partita(exc)
        kind = next(c.__name__ for c in type(error).__mro__ if KINDS.get(c.__name__) is c)
        return cls(rank, kind, str(error))

    @property
    def cause(self) -> tuple[str, str]:
        """(kind, message): what failed, without the rank. Ranks that failed alike have equal causes."""
        return self.kind, self.message

    def error(self, named: bool = True, failed_while: str = "") -> PartitaError:
        """The error to raise: an instance of the class `kind` names (PartitaError if partita has no class of
        that name). Its message is `message` after "rank r: " ("rank r failed while {failed_while}: " when
        `failed_while` is given); with `named` false, without the rank ("failed while {failed_while}: ")."""
        cls = KINDS.get(self.kind, PartitaError)
        who = f"rank {self.rank} " if named else ""
        if failed_while:
            return cls(f"{who}failed while {failed_while}: {self.message}")
        return cls(f"{who.rstrip()}: {self.message}" if named else self.message)


def first_error(errors: Iterable[RankError | None], world: int, failed_while: str = "") -> PartitaError | None:
    """The error every rank raises after hearing the ranks' `errors` (None for a rank that did not fail): the
    lowest rank's, named after that rank, or not named when all `world` ranks failed alike; None if no rank
    failed."""
    failed = sorted((e for e in errors if e is not None), key=lambda e: e.rank)
    if not failed:
        return None
    alike = len(failed) == world and len({e.cause for e in failed}) == 1
    return failed[0].error(named=not alike, failed_while=failed_while)
