"""Sharded checkpoints: save on any world size and plan, load on any other.

    partita.save(model, optimizer, "ckpt", step=step, extra={"batch": i})   # ckpt/step-000123, ckpt/latest
    if partita.latest_checkpoint("ckpt"):
        info = partita.load(model, optimizer, "ckpt")                         # info.step, info.extra
    partita export ckpt model.pt                                              # one plain state-dict file

Each rank writes the tensors it trains with torch.distributed.checkpoint, under the model's original names;
a save becomes visible all at once (temporary directory, rename, `latest`); loading never runs pickled code.
Modules: layout (directories, `latest`, pruning), manifest (manifest.json), holding (which rank writes and
reads what), keys (names inside the DCP data), optimizer and rng (their state as data), unpickling (DCP files
read without running code), collective (one error on every rank), saving, loading, exporting.
"""

from importlib import import_module

# torch loads on first use of what needs it; `latest_checkpoint` (and the layout and manifest modules) do not
_LAZY = {"save": "saving", "load": "loading", "CheckpointInfo": "loading", "export": "exporting",
         "Exported": "exporting", "latest_checkpoint": "layout"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f"partita.checkpoint.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'partita.checkpoint' has no attribute {name!r}")


def __dir__():
    return __all__
