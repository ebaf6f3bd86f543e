"""Ranks say what they are about to do before they do it together.

A collective waits for every rank. A rank that raised, passes inputs of another structure, or stopped
calling the model would leave the others waiting until the process group times out (300 s by default),
ending in gloo's bare "Timed out waiting". So every call of a parallelized model starts with one small
all-reduce that tells whether every rank says the same: what it is doing (calling, leaving, failing), its local
rows and its call's structure. `partita.shutdown()` takes part too, once this process parallelized a model: a
rank that stops early is found at the others' next call. Each step of partita's other collective calls
(partita.save, partita.load, a model's state_dict(), get_param(), get_param_grad(), clip_grad_norm_():
`state_step`) is a statement too, saying where the rank is: a rank that saves while another calls the model
(`if rank == 0: partita.save(...)`) is found at once, rather than each waiting in a
collective the other never joins. Anything but agreement leads to one more exchange, of every rank's whole
statement (with how many calls it made), and every rank raises the same error naming the rank and the cause,
or, for rows that differ, gets every rank's rows.

A pipeline's run ends with a statement too (`end_of_pipeline`): a stage that raised mid-run cannot say so
before its peers wait for its messages, so it sends them zeros and says so at the end, and every rank raises its
error. After such an error (or one a rank had alone, `failed_alone`) the ranks' groups may hold collectives only
some ranks joined: the process refuses any further statement, naming itself, rather than meet a collective of
another size (gloo aborts the process then).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from partita import settings
from partita.capture.export import CallSignature, Modes
from partita.errors import BatchError, PartitaError, RankError, as_partita, describe, first_error

log = logging.getLogger("partita")

class State(enum.IntEnum):
    CALLING = 0
    LEAVING = 1
    FAILING = 2


MODEL_CALL = "a call of the model"
SHUTDOWN = "partita.shutdown()"
BARRIER = "partita.barrier()"
STOP_CHECK = "partita.elastic's check for a stop between steps"
# where a rank is while it trains: ranks found in different ones left the training loop at different steps
_TRAINING = frozenset([MODEL_CALL, SHUTDOWN, STOP_CHECK])
EVERY_RANK_STOPS = ("Every rank must call the model the same number of times: give each rank the same number of "
                    "batches (a DistributedSampler does), and stop every rank at the same step (in partita.elastic's "
                    "loop too)")


@dataclass(frozen=True)
class _Said:
    """What one rank said."""

    state: State
    calls: int
    rows: int
    text: str  # what it is doing, or, failing, its error's text
    error: RankError | None = None  # failing: its error, as data
    where: str = MODEL_CALL  # the collective call it is in: the model's, partita.shutdown() or a step of another


_calls = 0  # calls of parallelized models this process made: the step count a rank that leaves reports
# why this process may join no collective call of partita any more (an error that stopped a step mid-way), under
# the default group it happened in (a process may make a new one, and start over there)
_failed_in: tuple[dist.ProcessGroup | None, str] = (None, "")
PIPELINE_END = "the end of a pipeline's run"


def _single() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def serves_cpu(backend: str) -> bool:
    """Whether a group of `backend` (as torch.distributed.get_backend names it) has a backend for CPU tensors.

    >>> serves_cpu("gloo"), serves_cpu("cpu:gloo,cuda:nccl"), serves_cpu("nccl")
    (True, True, False)
    """
    return "cpu" in BackendConfig(dist.Backend(backend)).get_device_backend_map()


# (the default group, the group cpu_group() chose beside it): chosen anew for a new default group
_cpu_group_of: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None)


def cpu_group() -> dist.ProcessGroup | None:
    """The group of every rank for partita's own small exchanges, which sum CPU tensors: the default group
    (None) where it has a backend for them, as the groups partita creates have (launch.env.backend_for), else,
    made once per default group, a gloo group beside it. A group of NCCL alone, which Ray Train or the user's
    script may have created before partita adopted it, has none ("No backend type associated with device type
    cpu"). Made at the first statement, which every rank makes at the same point of the job, as creating a
    group needs."""
    global _cpu_group_of
    world = dist.group.WORLD
    if _cpu_group_of[0] is not world:
        beside = None if serves_cpu(dist.get_backend()) else \
            dist.new_group(backend="gloo", timeout=timedelta(seconds=settings.timeout_s()))
        _cpu_group_of = (world, beside)
    return _cpu_group_of[1]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


@dataclass(frozen=True)
class _Posted:
    """A statement whose all-reduce is under way."""

    state: State
    rows: int
    text: str
    error: RankError | None
    where: str
    calls: int  # the calls of parallelized models this process had made
    extremes: torch.Tensor
    work: dist.Work


def _post(state: State, rows: int, text: str, error: RankError | None = None, where: str = MODEL_CALL) -> _Posted:
    """Start telling every rank this statement. The common case (every rank says the same) costs one all-reduce
    of two int64s: the largest and the negated smallest digest of (state, rows, where, text) are equal only if
    every rank's is the same. (gloo's all-gather of four int64s took 4 ms on 4 ranks sharing 2 cores, this
    1.1 ms.) A process whose job failed mid-step (`failure`) refuses, naming itself."""
    if failure() is not None:
        raise PartitaError(f"rank {dist.get_rank()} went on after {failure()}. The job cannot go on from there: end "
                           "the script at that error on every rank (do not catch it and call partita again) and start "
                           "the job again, from its last checkpoint (partita.elastic; partita run --max-restarts N "
                           "restarts it by itself)")
    word = _digest(f"{int(state)} {rows} {where} {text}")
    extremes = torch.tensor([word, -word], dtype=torch.int64)
    return _Posted(state, rows, text, error, where, _calls, extremes,
                   dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=cpu_group(), async_op=True))


def _said(posted: _Posted) -> list[_Said]:
    """Every rank's statement: once the all-reduce of `_post` ends, or, where statements differ, after one more
    exchange, of every rank's whole statement."""
    posted.work.wait()
    if int(posted.extremes[0]) == -int(posted.extremes[1]):
        return [_Said(posted.state, -1, posted.rows, posted.text, posted.error, posted.where)] * dist.get_world_size()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (int(posted.state), posted.calls, posted.rows, posted.text, posted.error,
                                   posted.where), group=cpu_group())
    return [_Said(State(s), calls, r, t, e, w) for s, calls, r, t, e, w in every]


def _exchange(state: State, rows: int, text: str, error: RankError | None = None,
              where: str = MODEL_CALL) -> list[_Said]:
    return _said(_post(state, rows, text, error, where))


def _elsewhere(said: list[_Said], rank: int) -> str | None:
    """Why the job cannot go on when ranks are in different collective calls (a model call against a shutdown
    is `_left_early`'s case)."""
    places = {s.where for s in said}
    if len(places) == 1 or places == {MODEL_CALL, SHUTDOWN}:
        return None
    groups: dict[str, list[int]] = {}
    for r, s in enumerate(said):
        at = f"call {s.calls + 1} of the model" if s.where == MODEL_CALL else \
            f"{s.where} after {s.calls} calls of the model"
        groups.setdefault(at, []).append(r)
    detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} in {at}"
                       for at, rs in groups.items())
    found = f"the ranks are in different collective calls: {detail} (seen on rank {rank})"
    if places <= _TRAINING:
        return f"{found}. The ranks left the training loop at different steps. {EVERY_RANK_STOPS}"
    return (f"{found}. partita.save, partita.load, partita.barrier and the model's state_dict(), get_param(), "
            "get_param_grad() and clip_grad_norm_() are collective, as a call of the model is: call them on every "
            "rank, at the same point of the script and with the same arguments, not under `if rank == 0:` (each "
            "rank holds, writes and reads its share of the model)")


def state_step(where: str, problem: BaseException | None) -> list[RankError | None]:
    """A step of partita's own collective calls (partita.save, partita.load, a parallelized model's whole-model
    reads: state_dict, get_param, ...) that every rank takes: each says it
    is at `where` and whether it failed there (`problem`). Returns every rank's error (None for a rank that did
    not fail) once all ranks are at `where`; a rank elsewhere (calling the model, in another step, leaving)
    makes every rank raise the same PartitaError at once."""
    if _single():
        return [None if problem is None else RankError.of(0, problem)]
    rank = dist.get_rank()
    if problem is None:
        said = _exchange(State.CALLING, 0, "", None, where)
    else:
        # the failing rank's text names it: ranks that failed alike still exchange their errors, each with its rank
        error = RankError.of(rank, problem)
        said = _exchange(State.FAILING, 0, f"rank {rank}: {error.kind}: {error.message}", error, where)
    why = _elsewhere(said, rank)
    if why is not None:
        raise PartitaError(why) from problem
    return [s.error for s in said]


def any_rank_says(where: str, flag: bool) -> bool:
    """Whether `flag` holds on any rank, at `where`: a step every rank takes (as `state_step`), such as
    partita.elastic's check for a stop between two steps (signals may reach only some ranks). A rank elsewhere
    makes every rank raise the same PartitaError at once. Costs one all-reduce where every rank says the same,
    and one more exchange where the flags differ."""
    if _single():
        return flag
    said = _exchange(State.CALLING, int(flag), "", None, where)
    why = _elsewhere(said, dist.get_rank())
    if why is not None:
        raise PartitaError(why)
    return any(s.rows for s in said)


_tellers: list[Callable[[str, bool], None]] = []


def tell_failures_with(hook: Callable[[str, bool], None]) -> None:
    """Run `hook(message, raised)` when this rank fails in a step (`failing`: `raised` false until the end of the
    run raises it) or raises a failure there (`end_of_pipeline`, `failed_alone`): the API registers the launcher's
    way of telling ranks that may be held in a collective the failing rank never joins (FSDP's, inside a stage's
    compute), which no statement reaches."""
    if hook not in _tellers:
        _tellers.append(hook)


def _tell(message: str, raised: bool) -> None:
    for hook in _tellers:
        hook(message, raised)


def failing(problem: Exception, failed_while: str) -> None:
    """This rank's stage raised `problem` while `failed_while`, in a run of a pipeline: tell it at once (see
    `tell_failures_with`); the run ends in `end_of_pipeline`."""
    if not _single():
        rank = dist.get_rank()
        _tell(f"rank {rank} failed while {failed_while}: {RankError.of(rank, problem).message}", False)


def failure() -> str | None:
    """The error after which this process may join no collective call of partita any more, if one ended a step
    mid-way (`end_of_pipeline`, `failed_alone`)."""
    group, why = _failed_in
    return why if why and group is dist.group.WORLD else None


def _fail(why: str) -> None:
    global _failed_in
    if failure() is None:
        _failed_in = (dist.group.WORLD, why)


def failed_alone(problem: BaseException) -> None:
    """This rank's call of the model raised `problem` in its own computation, after the call's agreement: the
    other ranks go on to the collectives after it (a backward's sums of gradients) and wait there for this one,
    which must join no other collective call (it would meet theirs: gloo aborts on collectives of different
    sizes), and refuses to."""
    if not _single():
        _fail(f"its own error in its call {_calls} of the model ({describe(problem)}), which the other ranks did not "
              "have: they went on to the collectives after the call and wait there for this rank")
        _tell(f"rank {dist.get_rank()}'s call {_calls} of the model raised on that rank alone: {describe(problem)}",
              True)


def end_of_pipeline(problem: Exception | None, failed_while: str = "", step: int = 0) -> None:
    """At the end of every run of a pipeline's steps, on every rank of the job: whether a rank failed in it
    (`problem`, while `failed_while`, in time step `step`). A rank whose stage raised went on sending its
    messages, zeros, so that no rank waits for it; the ranks after it computed on them, and may have failed
    because of them, in a later step. Every rank raises the same error: the earliest step's failure (the
    lowest rank's among those of one step), naming its rank and what it ran. The step's gradients are lost and
    the ranks' groups may hold collectives only some ranks started: the job cannot go on, and any later
    collective call of partita in the process refuses (`_post`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = None
    if problem is not None:
        sent = RankError.of(rank, problem)
        mine = RankError(rank, sent.kind, f"rank {rank} failed while {failed_while}: {sent.message}")
    if _single():
        if mine is not None:
            raise mine.error(named=False) from problem
        return
    said = _exchange(State.FAILING if mine else State.CALLING, step if mine else 0, mine.message if mine else "",
                     mine, PIPELINE_END)
    why = _elsewhere(said, rank)
    if why is not None:
        raise PartitaError(why) from problem
    failed = [(s.rows, s.error.rank, s.error) for s in said if s.error is not None]
    if failed:
        first = min(failed, key=lambda f: f[:2])[2]
        _fail(f"the error every rank raised in its call {_calls} of the model ({first.message})")
        _tell(first.message, True)
        raise first.error(named=False) from problem


def at_barrier() -> None:
    """`partita.barrier()` is a statement too (see `state_step`)."""
    state_step(BARRIER, None)


def _left_early(said: list[_Said], rank: int) -> str | None:
    """Why the job cannot go on when some ranks left while others still call the model."""
    leaving = [r for r, s in enumerate(said) if s.state == State.LEAVING]
    calling = [r for r, s in enumerate(said) if s.state != State.LEAVING]
    if not leaving or not calling:
        return None
    gone = ", ".join(f"rank {r} after {said[r].calls} calls" for r in leaving)
    still = ", ".join(f"rank {r} made call {said[r].calls + 1}" for r in calling)
    return (f"ranks stopped at different steps: partita.shutdown() was called on {gone} of the model, while "
            f"{still} (seen on rank {rank}). {EVERY_RANK_STOPS}")


def agree(description: str, what: str, problem: BaseException | None = None, rows: int = 0) -> tuple[int, ...]:
    """Every rank's local rows, once every rank described what it does the same way; otherwise the same error
    on every rank: a rank's `problem` (raised from it on that rank), a rank that left, or what differs."""
    return start_agreeing(description, what, problem, rows).rows()


def compare(description: str, details) -> list | None:
    """None where every rank's `description` (a digest, say) is the same; where they differ, every rank's
    `details()` (a callable: called and gathered only then, as they may be large), for the caller to say on
    every rank what differs. A rank elsewhere, or one that left, makes every rank raise as `agree` does. Costs
    one all-reduce where every rank says the same."""
    if _single():
        return None
    said = _exchange(State.CALLING, 0, description)
    rank = dist.get_rank()
    why = _elsewhere(said, rank) or _left_early(said, rank)
    if why is not None:
        raise PartitaError(why)
    if len({s.text for s in said}) == 1:
        return None
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, details(), group=cpu_group())
    return every


class Agreement:
    """An agreement under way: this rank's statement is posted, `rows()` waits for every rank's. Until then
    the rank may compute, but must not join another collective: a rank whose statement differs joins the
    exchange of every statement next."""

    def __init__(self, what: str, problem: BaseException | None, rows: int, posted: _Posted | None,
                 counted: bool = False, advice: str = ""):
        self.what, self.problem, self.posted = what, problem, posted
        self.counted = counted  # a call of a parallelized model, counted in `_calls` once agreed
        self.advice = advice or SAME_INPUTS_AND_SIZES  # what to do where statements differ
        self._rows = (rows,) if posted is None else None

    def rows(self) -> tuple[int, ...]:
        """Every rank's local rows; the same error on every rank where they do not agree."""
        global _calls
        if self._rows is None:
            self._rows = self._verdict(_said(self.posted))
            _calls += self.counted
        return self._rows

    def _verdict(self, said: list[_Said]) -> tuple[int, ...]:
        rank = dist.get_rank()
        why = _elsewhere(said, rank)
        error = PartitaError(why) if why else first_error([s.error for s in said], len(said))
        if error is None and (why := _left_early(said, rank)):
            error = PartitaError(why)
        if error is None and len({s.text for s in said}) > 1:
            groups: dict[str, list[int]] = {}
            for r, s in enumerate(said):
                groups.setdefault(s.text, []).append(r)
            detail = "; ".join(f"ranks {rs}: {t}" for t, rs in groups.items())
            error = BatchError(f"ranks disagree on {self.what}: {detail}. {self.advice}")
        if error is not None:
            raise error from self.problem
        return tuple(s.rows for s in said)


def start_agreeing(description: str, what: str, problem: BaseException | None = None, rows: int = 0,
                   counted: bool = False, advice: str = "") -> Agreement:
    """Post this rank's statement (see `agree`); a rank with a `problem` waits for the others at once.
    `counted`: a call of a parallelized model (`Agreement.counted`); `advice`: what to do where statements
    differ (`Agreement.advice`)."""
    if _single():
        if problem is not None:
            raise as_partita(problem) from problem
        return Agreement(what, None, rows, None)
    if problem is None:
        return Agreement(what, None, rows, _post(State.CALLING, rows, description), counted, advice)
    failed = RankError.of(dist.get_rank(), problem)
    agreement = Agreement(what, problem, rows, _post(State.FAILING, rows, f"{failed.kind}: {failed.message}", failed),
                          counted, advice)
    agreement.rows()  # raises this rank's problem, as every rank does
    return agreement


def describe_call(tensors: list[torch.Tensor], target: torch.Tensor | None, signature: CallSignature | None, *,
                  same_shapes: bool, modes: Modes) -> str:
    """What every rank must say alike about a call: its structure, dtypes, the modules' train/eval modes and,
    where the runtime needs the same shapes everywhere (a pipeline's stages), every size beyond the batch; under
    data parallelism the ranks' sizes beyond the batch may differ (each pads its own sequences, say), as with
    DDP."""
    shape = (lambda t: tuple(t.shape[1:])) if same_shapes else (lambda t: t.dim())
    shapes = [(shape(t), str(t.dtype), t.requires_grad) for t in tensors]
    if target is not None:
        shapes.append(("target", shape(target), str(target.dtype)))
    structure = signature.key[:2] if signature is not None else None
    return f"{structure} {shapes} {modes} grad={torch.is_grad_enabled()}"


def _same_inputs(what: str, after: str = "") -> str:
    return (f"Every rank must pass inputs of the same {what} (a DistributedSampler with drop_last=True does "
            f"this){after}.")


SAME_INPUTS_AND_SIZES = _same_inputs("structure, shapes and dtypes")


def call_advice(first: bool, same_sizes: bool) -> str:
    """What to do where the ranks' calls differ: besides the same structure and dtypes everywhere, the same
    sizes beyond the batch dimension where the call needs them (`describe_call`'s `same_shapes`)."""
    if first:
        return _same_inputs("structure and dtypes", ", and the first call, which partita captures and plans from, "
                            "the same sizes beyond the batch dimension (later calls may differ where the plan is "
                            "DDP's)")
    if same_sizes:
        return (f"{_same_inputs('structure and dtypes')} This plan also needs the same sizes beyond the batch "
                "dimension on every rank: it runs the model as a pipeline (data parallelism under an FSDP sharding "
                "level runs as one), whose stages are built for them. Pad every rank's inputs to the same sizes, "
                "or train under DDP (stages=1, micro_batches=1, sharding=\"none\"), where each rank's sizes may "
                "differ.")
    return _same_inputs("structure and dtypes")


def start_call(description: str, rows: int, problem: BaseException | None = None, *, first: bool = False,
               same_sizes: bool = True) -> Agreement:
    """`start_agreeing` at the start of a call of a parallelized model, counted once agreed. `first`: the call
    that captures and plans; `same_sizes`: the plan needs the same sizes beyond the batch dimension."""
    return start_agreeing(description, "their inputs", problem, rows, counted=True,
                          advice=call_advice(first, same_sizes))


@contextlib.contextmanager
def together(what: str):
    """Run local work (no collective inside) that may fail on one rank only: if it fails anywhere, every rank
    raises that rank's error at the end of the block instead of waiting for it in the next collective."""
    problem = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every kind must reach the other ranks
        problem = e
    agree(what, what, problem)


def leave() -> bool:
    """At shutdown: tell ranks still calling the model that this one stopped. False when some did (they raise
    an error naming this rank; this one logs it and must not wait for them in a barrier)."""
    if _single():
        return True
    if failure() is not None:  # the ranks' groups may hold collectives only some ranks started
        log.error("partita: rank %d leaves after %s", dist.get_rank(), failure())
        return False
    said = _exchange(State.LEAVING, 0, "leaving", where=SHUTDOWN)
    why = _elsewhere(said, dist.get_rank()) or _left_early(said, dist.get_rank())
    if why is not None:
        log.error("partita: %s", why)
        return False
    return True
