"""`partita.elastic`: a training loop that survives stops, failures and resizes, and stays a plain loop.

    job = partita.elastic(model, opt, "ckpt", global_batch=256, save_every=100)
    for step in job.steps(10_000):              # starts where the last checkpoint left off
        x, y = dataset.batch(step)[job.rows]    # this rank's rows of global batch `step`
        opt.zero_grad(); model(x, y).backward(); opt.step()

On start it loads the latest checkpoint under the path, if any (model, optimizer, step, RNG states, `extra`); every
rank must see the same one there (a filesystem all nodes share), or every rank stops at once with an error. A
checkpoint that cannot be loaded (damaged: a file changed since it was saved) is skipped for the one saved before it,
and so on; rank 0 logs which and why, and renames each skipped one aside (`step-N.skipped-<hex>`), so that later saves
neither replace it nor prune good ones in its place. If none can be loaded, every rank stops with a CheckpointError
that lists them, and nothing is renamed or deleted.
The world may have changed since: the model is re-planned for the world it finds on its first call, and the
global batch stays the same (each rank's share is `job.local_batch` rows). If the world has not changed, the
checkpoint's plan is used again, so a resumed run computes exactly what an uninterrupted one would.

Between steps it saves every `save_every` steps and after the last one, and it stops when any rank was asked
to: SIGTERM or SIGUSR1 (or the stop file of a `partita slurm` job near its time limit) make every rank save at
the next step boundary and exit with status RESUME_EXIT_CODE. Run the same command again to continue;
`partita run --max-restarts`, `partita slurm` (requeue) and `partita.ray.run(max_failures=...)` do it for you.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from partita import checkpoint, settings
from partita.checkpoint import layout, owner
from partita.checkpoint.collective import from_rank0, stop_asked_anywhere, together
from partita.checkpoint.manifest import read_manifest
from partita.elasticity.stop import RESUME_EXIT_CODE, StopRequest
from partita.errors import CheckpointError, PartitaError
from partita.launch import env

log = logging.getLogger("partita")


class Elastic:
    """The state of an elastic training loop; made by `partita.elastic`."""

    def __init__(self, model, optimizer, path: str | os.PathLike, *, global_batch: int | None, save_every: int | None,
                 keep: int):
        if save_every is not None and save_every < 1:
            raise PartitaError(f"save_every must be a positive number of steps or None, got {save_every}")
        world = env.init()
        self.model, self.optimizer, self.path = model, optimizer, os.fspath(path)
        self.global_batch, self.save_every, self.keep = global_batch, save_every, keep
        self.rank, self.world_size = world.rank, world.world_size
        self.local_batch: int | None = None
        self.step = 0
        self.extra: dict = {}
        self.resumed_from: checkpoint.CheckpointInfo | None = None
        self.stop_request = StopRequest().install()
        try:
            # every rank finds the same problem; leaving together spares a rank still joining a reset connection
            self.local_batch = _local_batch(global_batch, world.world_size) if global_batch is not None else None
            # before reading: a live job's checkpoints are its run, not this job's to resume
            from_rank0(lambda: (owner.claim(Path(self.path)), owner.held_for_resuming(Path(self.path))),
                       f"partita.elastic(path={self.path!r})")
            env.before_leaving(owner.release_all)
            self._resume_from_newest_usable()
        except CheckpointError:
            self._leave()
            raise
        self.start_step = self.step  # where this run began: 0, or the step of the checkpoint it resumed from

    @property
    def rows(self) -> slice:
        """This rank's rows of a global batch (global batch = every rank's rows, in rank order)."""
        if self.local_batch is None:
            raise PartitaError("job.rows needs the global batch: partita.elastic(..., global_batch=N)")
        return slice(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)

    def steps(self, total: int | None = None) -> Iterator[int]:
        """The step numbers from the resumed step up to `total` (forever if None). Between two steps it saves
        when due and stops (save, exit RESUME_EXIT_CODE) when asked to."""
        try:
            while total is None or self.step < total:
                yield self.step
                self.step += 1
                reason = self._agreed_stop_reason()
                finished = total is not None and self.step >= total
                if reason or finished or (self.save_every and self.step % self.save_every == 0):
                    saved = self.save()
                if reason:
                    self._stop_for_resume(reason, saved)
        except CheckpointError:  # a save that failed, on every rank at once
            self._leave()
            raise
        finally:
            self.stop_request.uninstall()

    def save(self) -> str:
        """Save a checkpoint of the current step now (collective)."""
        return checkpoint.save(self.model, self.optimizer, self.path, step=self.step, extra=self.extra, keep=self.keep)

    # ---- internals -----------------------------------------------------------------------------
    def _resume_from_newest_usable(self) -> None:
        """Load the latest checkpoint, or else the newest one that loads; every rank tries the same ones in the same
        order (rank 0's list) and fails or succeeds with each together (`checkpoint.load` is collective)."""
        latest = _agreed_latest_checkpoint(self.path)
        if latest is None:
            return
        what = f"partita.elastic(path={self.path!r})"
        order = [latest, *(c for c in from_rank0(lambda: layout.newest_first(self.path), what) if c != latest)]
        skipped: list[tuple[str, CheckpointError]] = []
        for candidate in order:
            try:
                info = checkpoint.load(self.model, self.optimizer, candidate)
            except CheckpointError as e:
                self._log(logging.WARNING, "cannot resume from %s (%s)%s", candidate, e,
                          "; trying the one saved before it" if candidate != order[-1] else "")
                skipped.append((candidate, e))
                continue
            if skipped:
                self._set_aside([path for path, _ in skipped], what)
            self._resumed(info)
            return
        listed = "; ".join(f"{path}: {str(e).rstrip('.')}" for path, e in skipped)
        raise CheckpointError(
            f"{what}: none of its {len(skipped)} checkpoint(s) can be resumed from, so the job stops (nothing was "
            f"renamed or deleted): {listed}. Restore one from a copy, or move them away to start again from step 0.")

    def _set_aside(self, paths: list[str], what: str) -> None:
        """Rename the checkpoints skipped for an older one out of the way (rank 0), so that saving the same steps
        again neither replaces them nor prunes good ones while they count among the last `keep`."""
        aside = from_rank0(lambda: [str(layout.set_aside(Path(p))) for p in paths], what)
        for path, moved in zip(paths, aside):
            self._log(logging.WARNING, "kept %s, which could not be resumed from, as %s: nothing is deleted, and later "
                      "saves neither replace it nor count it among the last %d; inspect it, then delete it", path,
                      moved, self.keep)

    def _log(self, level: int, message: str, *args) -> None:
        if self.rank == 0:
            env.log_to_stderr()
            log.log(level, message, *args)

    def _leave(self) -> None:
        """Leave the process group before an error that every rank raises together ends the process: gloo's threads
        still running at interpreter exit abort it ("terminate called without an active exception", SIGABRT),
        and the launcher then reports the abort instead of the error."""
        self.stop_request.uninstall()
        env.shutdown()

    def _resumed(self, info: checkpoint.CheckpointInfo) -> None:
        self.step, self.extra, self.resumed_from = info.step, dict(info.extra), info
        same_world = info.world_size == self.world_size
        if same_world and info.plan is not None:
            # the same plan computes bit for bit what the interrupted run would have; a new one might split the
            # batch into other micro-batches (another order of summation)
            adopt = getattr(self.model, "adopt_plan", None)
            if adopt is not None:
                adopt(info.plan)
        batch = (f"; global batch {self.global_batch} = {self.world_size} rank(s) x {self.local_batch} rows"
                 if self.global_batch is not None else "")
        if same_world:
            self._log(logging.INFO, "resumed from %s at step %d (same world of %d rank(s), same plan)%s", info.path,
                      info.step, self.world_size, batch)
        else:
            self._log(logging.INFO, "resumed from %s at step %d: the world changed from %d to %d rank(s), so the model "
                      "is planned again%s", info.path, info.step, info.world_size, self.world_size, batch)

    def _agreed_stop_reason(self) -> str | None:
        """A reason to stop if any rank has one (signals may reach only some ranks), the same on every rank."""
        reason = self.stop_request.reason()
        # a statement of the call agreement: a rank that left the loop (and shuts down, or calls the model) is an
        # error that names it on every rank, not a collective of another size
        if not stop_asked_anywhere(reason is not None):
            return None
        return reason or "another rank was asked to stop"

    def _stop_for_resume(self, reason: str, saved: str) -> None:
        if self.rank == 0:
            env.log_to_stderr()
            log.info("stopping at step %d (%s) after saving %s; exit status %d: run the job again to resume",
                     self.step, reason, saved, RESUME_EXIT_CODE)
            # tells a launcher that can restart the job (the batch script of `partita slurm`) that it may
            resume_file = settings.resume_file()
            if resume_file:
                with open(resume_file, "w") as f:
                    f.write(saved)
        env.shutdown()
        raise SystemExit(RESUME_EXIT_CODE)


def _agreed_latest_checkpoint(path: str) -> str | None:
    """The checkpoint to resume from, once every rank has found the same one under `path` (None: none has one).

    Ranks that each decided for themselves could disagree (a path on each node's own disk), and then some would
    load (a collective) while the others train: both would wait until the process-group timeout. Here every rank
    compares what all of them see and raises the same error at once."""
    what = f"partita.elastic(path={path!r})"
    mine = together(lambda: _latest_seen(path), what)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None if mine is None else mine[0]
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if any(view != seen[0] for view in seen):
        raise CheckpointError(f"{what}: the ranks do not see the same latest checkpoint there: {_views(seen)}. Every "
                              "rank reads and writes the same checkpoints: put the path on a filesystem that all "
                              "nodes share (NFS, Lustre, ...), not on a disk of each node.")
    return None if mine is None else mine[0]


def _latest_seen(path: str) -> tuple[str, float] | None:
    """The latest checkpoint this rank sees under `path` and when it was saved (the same name on two nodes' own
    disks may hold different checkpoints)."""
    found = checkpoint.latest_checkpoint(path)
    return None if found is None else (found, read_manifest(Path(found)).saved_at)


def _views(seen: list) -> str:
    """'rank 0 sees ckpt/step-000004 (saved 2025-06-01 12:00:05); ranks 1, 2 see none': one group per view."""
    groups: dict = {}
    for rank, view in enumerate(seen):
        groups.setdefault(view, []).append(rank)
    parts = []
    for view, ranks in groups.items():
        who = f"rank {ranks[0]} sees" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} see"
        parts.append(f"{who} {'none' if view is None else f'{view[0]} (saved {_clock(view[1])})'}")
    return "; ".join(parts)


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _local_batch(global_batch: int, world_size: int) -> int:
    if global_batch < 1 or global_batch % world_size:
        fits = [w for w in range(1, min(global_batch, 4 * world_size) + 1) if global_batch % w == 0]
        raise CheckpointError(
            f"the global batch of {global_batch} rows does not split evenly over {world_size} ranks. Run on a "
            f"world size that divides it (e.g. {', '.join(map(str, fits[-6:]))}) or choose a global batch that "
            f"{world_size} divides (e.g. {max(1, global_batch // world_size) * world_size})."
        )
    return global_batch // world_size


def elastic(model, optimizer, path: str | os.PathLike, *, global_batch: int | None = None,
            save_every: int | None = 100, keep: int = 3) -> Elastic:
    """A training loop that resumes from the latest checkpoint under `path` and survives stops and resizes.

    Collective: every rank calls it, after `parallelize`. `global_batch` (rows per optimizer step over all
    ranks) stays fixed when the world size changes: `job.local_batch` is each rank's share and `job.rows`
    its slice of a global batch. Saves every `save_every` steps (None: only when stopping and at the end),
    keeping the last `keep` checkpoints. Put anything else your loop needs to resume (a data loader's
    position, an LR scheduler's state_dict()) in `job.extra`, a dict saved with each checkpoint.

    A checkpoint that cannot be loaded is skipped for the newest one that can (and renamed aside, see the module's
    docstring). When no checkpoint can be loaded, or a save fails, every rank raises the same CheckpointError
    after leaving the process group (`partita.shutdown()`), so that the process ends with that error.

    >>> import tempfile, torch, partita
    >>> net = partita.parallelize(torch.nn.Linear(4, 2), loss_fn=torch.nn.MSELoss())
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> root = tempfile.mkdtemp()
    >>> job = partita.elastic(net, opt, root, global_batch=8, save_every=2)
    >>> for step in job.steps(3):
    ...     x, y = torch.randn(8, 4)[job.rows], torch.randn(8, 2)[job.rows]
    ...     opt.zero_grad(); net(x, y).backward(); opt.step()
    >>> partita.elastic(net, opt, root, global_batch=8).step     # a new run resumes after the last step
    3
    """
    return Elastic(model, optimizer, path, global_batch=global_batch, save_every=save_every, keep=keep)
