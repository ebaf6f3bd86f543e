"""The plan: a plain value that says which blocks run on which ranks, and how.

A plan is the only thing that passes from deciding (plan/) to doing (runtime/). It round-trips through
readable JSON, so it can be printed, saved, loaded, diffed and applied to another run of the same model.

Stage `s`, replica `j` runs on rank `stages[s].ranks[j]`. Schedules that put several stages on one rank
(interleaved, V-shaped) list the same ranks on each of those stages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from partita.errors import PlanError

VERSION = 1

# Schedules the runtime runs, by how they place stages on the ranks of one pipeline.
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES


@dataclass(frozen=True)
class StagePlan:
    index: int
    blocks: tuple[int, int]  # [start, stop) in the model graph's block order
    first_node: str
    last_node: str
    ranks: tuple[int, ...]  # one per replica
    num_params: int = 0
    param_bytes: int = 0
    fwd_flops_per_sample: float = 0.0
    memory_bytes: int = 0  # estimated peak per rank

    @property
    def num_blocks(self) -> int:
        return self.blocks[1] - self.blocks[0]


@dataclass(frozen=True)
class Plan:
    world_size: int
    num_microbatches: int
    schedule: str
    stages: tuple[StagePlan, ...]
    fingerprint: str = ""  # of the model graph the plan was made for
    num_blocks: int = 0
    local_batch: int = 0  # the local batch the plan was made for (0: any)
    device_memory_bytes: int = 0
    reasons: tuple[str, ...] = field(default=())  # why the planner chose this
    version: int = VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        return len(self.stages[0].ranks)

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
        if self.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be at least 1, got {self.num_microbatches}")
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
        every = sorted({r for st in self.stages for r in st.ranks})
        if every != list(range(self.world_size)):
            raise PlanError(f"the plan must use ranks 0..{self.world_size - 1} each, got {every}")
        self._validate_placement()
        self._validate_microbatches()
        return self

    def _validate_microbatches(self) -> None:
        """The schedules' own rules on the number of micro-batches (torch raises them later, less clearly)."""
        m, stages, p = self.num_microbatches, self.num_stages, self.pipeline_size
        if self.schedule in ("1F1B", "DualPipeV") and m < stages:
            raise PlanError(f"{self.schedule} needs at least as many micro-batches as stages: {m} < {stages}. "
                            f"Use micro_batches >= {stages}, or schedule='GPipe'.")
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and p > 1:
            rounds = max(1, m // p)
            if m % rounds:
                raise PlanError(f"{self.schedule} needs the micro-batches ({m}) to be a multiple of the "
                                f"pipeline ranks ({p}) or fewer than them; use micro_batches={p * rounds}.")

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

    # ---- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        try:
            stages = tuple(
                StagePlan(**{**s, "blocks": tuple(s["blocks"]), "ranks": tuple(s["ranks"])})
                for s in data["stages"]
            )
            return cls(**{**data, "stages": stages, "reasons": tuple(data.get("reasons", ()))})
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

    def with_ranks(self, layout: list[list[int]]) -> "Plan":
        return replace(self, stages=tuple(replace(s, ranks=tuple(r)) for s, r in zip(self.stages, layout)))

    def explain(self) -> str:
        from partita.plan.explain import explain

        return explain(self)


def stage_to_pipeline_rank(schedule: str, stage: int, pipeline_size: int) -> int:
    """Position, within one pipeline replica, of the rank that runs `stage` under `schedule`."""
    if schedule in V_SCHEDULES:
        return stage if stage < pipeline_size else 2 * pipeline_size - 1 - stage
    return stage % pipeline_size


def rank_layout(schedule: str, num_stages: int, num_replicas: int) -> list[list[int]]:
    """Ranks of each stage when replica j uses the consecutive ranks j*P .. j*P+P-1."""
    if schedule in V_SCHEDULES:
        pipeline_size = num_stages // 2
    elif schedule in LOOPED_SCHEDULES:
        pipeline_size = _looped_pipeline_size(num_stages)
    else:
        pipeline_size = num_stages
    return [[j * pipeline_size + stage_to_pipeline_rank(schedule, s, pipeline_size) for j in range(num_replicas)]
            for s in range(num_stages)]


def _looped_pipeline_size(num_stages: int) -> int:
    # two stages per rank: the smallest loop that still interleaves
    if num_stages % 2:
        raise PlanError(f"interleaved schedules need an even number of stages, got {num_stages}")
    return num_stages // 2
