"""The plan: a plain value that says which blocks run on which ranks, and how.

A plan is the only thing that passes from deciding (plan/) to doing (runtime/). It round-trips through
readable JSON, so it can be printed, saved, loaded, diffed and applied to another run of the same model.

Stage `s`, replica `j` runs on rank `stages[s].ranks[j]`. Schedules that put several stages on one rank
(interleaved, V-shaped) list the same ranks on each of those stages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from partita.errors import BatchError, PlanError
from partita.schedule.generate import check_sizes
from partita.schedule.catalog import (LOOPED_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES,
                                      V_SCHEDULES, stage_to_pipeline_rank, stages_per_rank)

# 2: the micro-batch count is `micro_batches` (version 1 called it `num_microbatches`)
# 3: each stage says how its replicas shard their state (`sharding`; earlier plans shard nothing), and the plan
#    what its stages compute in (`precision`; earlier plans: fp32)
VERSION = 3

# What the replicas of a stage split among themselves instead of each holding it whole (ZeRO's levels):
# nothing, the optimizer's state (ZeRO-1), + the gradients (ZeRO-2), + the parameters (ZeRO-3)
SHARDING_LEVELS = ("none", "optimizer", "gradients", "parameters")
# the levels torch's FSDP2 runs (partita.runtime.fully_sharded), under partita's pipelined runtime only
FSDP_LEVELS = ("gradients", "parameters")
# what the stages compute in: float32, or bfloat16 / float16 under autocast with float32 weights and state;
# by the name torch gives each dtype
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PRECISIONS = tuple(PRECISION_DTYPES)


@dataclass(frozen=True)
class StagePlan:
    index: int
    blocks: tuple[int, int]  # [start, stop) in the model graph's block order
    first_node: str
    last_node: str
    ranks: tuple[int, ...]  # one per replica
    num_params: int = 0
    param_bytes: int = 0
    recompute: bool = False  # run the forward again in the backward instead of keeping activations
    sharding: str = "none"  # one of SHARDING_LEVELS: what its replicas split among themselves
    fwd_s: float = 0.0  # estimated seconds per micro-batch
    bwd_s: float = 0.0  # including the recomputed forward
    send_s: float = 0.0  # its outputs to the next stage, per micro-batch
    allreduce_s: float = 0.0  # its gradients over its replicas, per step
    memory: dict = field(default_factory=dict)  # estimated bytes per rank by kind: params, grads, optimizer, ...
    memory_bytes: int = 0  # estimated peak per rank

    @property
    def num_blocks(self) -> int:
        return self.blocks[1] - self.blocks[0]


@dataclass(frozen=True)
class Estimate:
    """What the planner predicts for one training step, and how sure its search is."""

    step_s: float
    pipeline_s: float  # until the pipeline drains; the rest is gradient all-reduce and optimizer step
    bubble_fraction: float
    samples_per_s: float
    peak_memory_bytes: int
    memory_per_rank_bytes: int
    global_batch: int
    cluster: str
    profile: str  # where the block costs came from (measured, or a device preset)
    proven_optimal: bool
    lower_bound_s: float
    layouts_searched: int = 0
    layouts_considered: int = 0
    search_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    world_size: int
    micro_batches: int
    schedule: str
    stages: tuple[StagePlan, ...]
    fingerprint: str = ""  # of the model graph the plan was made for
    num_blocks: int = 0
    local_batch: int = 0  # the local batch the plan was made for (0: any)
    device_memory_bytes: int = 0
    reasons: tuple[str, ...] = field(default=())  # why the planner chose this
    precision: str = "fp32"  # one of PRECISIONS
    estimate: Estimate | None = None
    version: int = VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        return len(self.stages[0].ranks)

    @property
    def runs_under_ddp(self) -> bool:
        """One stage of replicas and one micro-batch, its parameters whole: torch's DDP runs it (every other
        plan, partita's pipelined runtime)."""
        return self.num_stages == 1 and self.micro_batches == 1 and \
            not any(s.sharding in FSDP_LEVELS for s in self.stages)

    @property
    def layout(self) -> tuple:
        """What the planner decides, without its estimates: stages, blocks, ranks, schedule, micro-batches,
        recomputation and sharding."""
        return (self.micro_batches, self.schedule, self.precision,
                tuple((s.blocks, s.ranks, s.recompute, s.sharding) for s in self.stages))

    @property
    def pipeline_size(self) -> int:
        """Ranks in one pipeline replica."""
        return len(self.replica_ranks(0))

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of one pipeline replica, in rank order; their local batches are its rows."""
        return tuple(sorted({s.ranks[replica] for s in self.stages}))

    def replica_of(self, rank: int) -> int:
        for j in range(self.num_replicas):
            if rank in self.replica_ranks(j):
                return j
        raise PlanError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s.index for s in self.stages if rank in s.ranks)

    def stage_of_block(self) -> list[int]:
        return [s.index for s in self.stages for _ in range(*s.blocks)]

    # ---- checks -----------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None) -> "Plan":
        """Raise PlanError unless the plan is runnable as written; return it."""
        if self.version != VERSION:
            raise PlanError(f"plan version {self.version} is not {VERSION}; make the plan again")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"the plan is for {self.world_size} ranks but this job has {world_size}. Launch "
                f"{self.world_size} ranks, or let partita plan for {world_size} (drop plan=...)."
            )
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        if self.micro_batches < 1:
            raise PlanError(f"micro_batches must be at least 1, got {self.micro_batches}")
        widths = {len(s.ranks) for s in self.stages}
        if len(widths) != 1:
            raise PlanError(f"every stage needs the same number of replicas; got {sorted(widths)}")
        expect = 0
        for s, stage in enumerate(self.stages):
            if stage.index != s:
                raise PlanError(f"stage {s} is labelled {stage.index}")
            if stage.blocks[0] != expect or stage.blocks[1] <= stage.blocks[0]:
                raise PlanError(f"stage {s} covers blocks {stage.blocks}; stages must cover consecutive, "
                                f"non-empty block ranges starting at 0")
            expect = stage.blocks[1]
        if self.num_blocks and expect != self.num_blocks:
            raise PlanError(f"the stages cover {expect} blocks but the model has {self.num_blocks}")
        for stage in self.stages:
            check_sharding(stage.sharding)
            if stage.sharding in FSDP_LEVELS and self.schedule in SPLIT_BACKWARD_SCHEDULES:
                raise PlanError(f"stage {stage.index}: {fsdp_schedule_problem(self.schedule, stage.sharding)}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        every = sorted({r for st in self.stages for r in st.ranks})
        if every != list(range(self.world_size)):
            raise PlanError(f"the plan must use ranks 0..{self.world_size - 1} each, got {every}")
        self._validate_placement()
        self._validate_microbatches()
        return self

    def _validate_placement(self) -> None:
        per_rank = self.num_stages // self.pipeline_size if self.pipeline_size else 0
        if self.num_stages % self.pipeline_size:
            raise PlanError(f"{self.num_stages} stages do not spread evenly over {self.pipeline_size} ranks")
        if self.schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
            raise PlanError(
                f"{self.schedule} runs one stage per rank, but this plan puts {per_rank} stages on each "
                f"rank. Use an interleaved schedule ({', '.join(LOOPED_SCHEDULES)}) or one stage per rank."
            )
        if self.schedule in V_SCHEDULES and per_rank != 2:
            raise PlanError(f"{self.schedule} needs exactly two stages per rank, this plan has {per_rank}")
        for j in range(self.num_replicas):
            ranks = self.replica_ranks(j)
            for stage in self.stages:
                expected = ranks[stage_to_pipeline_rank(self.schedule, stage.index, len(ranks))]
                if stage.ranks[j] != expected:
                    raise PlanError(
                        f"{self.schedule} places stage {stage.index} of replica {j} on rank {expected}, "
                        f"the plan says {stage.ranks[j]}"
                    )

    def _validate_microbatches(self) -> None:
        """The schedules' own rules on stages and micro-batches (torch raises them later, less clearly)."""
        try:
            check_sizes(self.schedule, self.num_stages, self.pipeline_size, self.micro_batches)
        except ValueError as e:
            raise PlanError(str(e)) from None

    # ---- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        data = upgrade(data)
        try:
            stages = tuple(
                StagePlan(**{**s, "blocks": tuple(s["blocks"]), "ranks": tuple(s["ranks"])})
                for s in data["stages"]
            )
            estimate = Estimate(**data["estimate"]) if data.get("estimate") else None
            return cls(**{**data, "stages": stages, "reasons": tuple(data.get("reasons", ())), "estimate": estimate})
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a partita plan ({e}); make one with partita.plan or Plan.save") from e

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"the plan is not valid JSON: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        p = Path(path)
        if not p.exists():
            raise PlanError(f"no plan file at {p}")
        return cls.from_json(p.read_text())

    def explain(self) -> str:
        from partita.plan.explain import explain

        return explain(self)


def upgrade(data: dict) -> dict:
    """A plan's JSON fields as this version names them; plans written by earlier versions still load."""
    if data.get("version") == 1 and "num_microbatches" in data:
        data = {k: v for k, v in data.items() if k != "num_microbatches"} | {
            "micro_batches": data["num_microbatches"], "version": 2}
    if data.get("version") == 2:  # stages without `sharding` shard nothing
        data = data | {"version": VERSION}
    return data


def fsdp_schedule_problem(schedule: str, sharding: str) -> str:
    """Why a zero-bubble `schedule` does not run with FSDP's `sharding`, and the fix."""
    return (f"{schedule} splits each backward into the input gradients and, later, the weight gradients, but "
            f"sharding={sharding!r} runs on torch's FSDP, which reduces a block's gradients as soon as its input "
            f"gradients are done. Choose another schedule (not {', '.join(SPLIT_BACKWARD_SCHEDULES)}), or "
            "sharding='optimizer'.")


def check_sharding(level: str) -> None:
    """Raise PlanError unless `level` is a sharding level this version runs."""
    if level not in SHARDING_LEVELS:
        raise PlanError(f"unknown sharding {level!r}; choose one of {', '.join(SHARDING_LEVELS)}")


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def check_batch(rows_per_replica: int, micro_batches: int, num_replicas: int, world_size: int) -> None:
    """Every micro-batch of every replica must get the same whole number of rows."""
    if rows_per_replica % micro_batches:
        local = rows_per_replica * num_replicas // world_size
        depth = world_size // num_replicas
        raise BatchError(
            f"the global batch of {rows_per_replica * num_replicas} rows ({world_size} ranks x {local}) does "
            f"not split into {micro_batches} micro-batches x {num_replicas} replicas: each replica gets "
            f"{rows_per_replica} rows. Use micro_batches from {divisors(rows_per_replica)}, or a local batch "
            f"that makes {depth} x local batch a multiple of {micro_batches}."
        )


def rank_layout(schedule: str, num_stages: int, num_replicas: int) -> list[list[int]]:
    """Ranks of each stage when replica j uses the consecutive ranks j*P .. j*P+P-1."""
    per_rank = stages_per_rank(schedule)
    if num_stages % per_rank:
        raise PlanError(f"{schedule} puts {per_rank} stages on each rank; {num_stages} stages do not divide")
    pipeline_size = num_stages // per_rank
    return [[j * pipeline_size + stage_to_pipeline_rank(schedule, s, pipeline_size) for j in range(num_replicas)]
            for s in range(num_stages)]
