"""Moving a parallelized model to another plan in the middle of training, through partita's own checkpoint.

When the job switches to a faster layout (`planning.agreed_switch`), every rank saves what it holds into a
temporary directory (partita.save), drops its part of the model (every tensor becomes meta, the optimizer's state
goes, and what the old runtime set on the optimizer is undone), builds its part under the new plan reading its
tensors from the checkpoint (as `weights=` does) and loads the optimizer state of the parameters it trains now
(partita.load). The user's optimizer then steps the new parameters, and training goes on exactly as if it had
started under the new plan from that state. The directory, on one node (every rank sees it), is deleted after.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partita.checkpoint.collective import from_rank0
from partita.checkpoint.loading import load
from partita.checkpoint.saving import save
from partita.checkpoint.weights import model_weights
from partita.errors import CheckpointError, PartitaError
from partita.plan.explain import seconds
from partita.runtime import agreement
from partita.runtime.materialize import Initial, unmaterialize
from partita.runtime.run import Runtime

log = logging.getLogger("partita")

SWITCHING = "switching to the faster layout"


def relayout(model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer | None, runtime: Runtime,
             install: Callable[[Initial], Runtime]) -> Runtime:
    """Collective: move the parallelized `model` (of the user's `module`) and the optimizer's state from
    `runtime` to the one `install` builds under the new plan from the initial values it is given, and makes the
    model use. Returns the runtime in use after: the new one, or `runtime` where saving failed (then nothing
    changed, and rank 0 says why). A failure after that raises the same error on every rank, naming the
    checkpoint that holds the state at the switch."""
    started = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    directory: Path | None = None
    try:
        directory = Path(from_rank0(lambda: tempfile.mkdtemp(prefix="partita-switch-"), SWITCHING))
        saved = save(model, optimizer, directory, step=0, keep=1)
    except CheckpointError as e:
        if rank == 0:
            log.warning("partita: %s; the job keeps its layout", e)
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        return runtime
    try:
        unsaved = runtime.unsaved_state()
        with agreement.together(SWITCHING):
            runtime.release(optimizer)
            unmaterialize(module, optimizer, unsaved)
            weights = model_weights(saved, module, strict=True)
        new = install(Initial(weights=weights))
        load(model, optimizer, saved)
        runtime.close()
    except Exception as e:
        raise PartitaError(f"{SWITCHING} failed after the ranks dropped their part of the model ({e}). The state "
                           f"at the switch is saved in {saved}: load it with partita.load into a job started with "
                           "PARTITA_SWITCH_LAYOUT=off (or with the arguments rank 0 named).") from e
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        log.info("partita: switched layouts in %s (saved, rebuilt and loaded through %s); the model's parameters "
                 "are new tensors (the optimizer steps them; a list of them taken before is stale): %s",
                 seconds(time.perf_counter() - started), directory, new.plan.explain())
    return new
