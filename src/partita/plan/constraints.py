"""`Constraints`: what the user fixed of a plan, one value from `parallelize` to `choose_plan`.

Each field left None is the planner's to choose. A later parallelism adds its field here (and its keyword to
`parallelize`); nothing between the two changes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from partita.plan.plan import FSDP_LEVELS, Plan, fsdp_schedule_problem
from partita.schedule.catalog import FORWARDS_FIRST_SCHEDULES, SPLIT_BACKWARD_SCHEDULES


@dataclass(frozen=True)
class Constraints:
    stages: int | None = None
    replicas: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    recompute: bool | None = None
    sharding: str | None = None  # one of plan.SHARDING_LEVELS, for every stage
    precision: str = "fp32"  # plan.PRECISIONS: what the user asked for (the profile measures in it)
    # the user's code computes the loss from the outputs partita returns (parallelize without loss_fn), so
    # every micro-batch's forward ends before the first backward starts: only schedules that run in that
    # order (FORWARDS_FIRST_SCHEDULES) can be what runs
    user_loss: bool = False

    def choices(self) -> dict:
        """The fields the user fixed, by name (for messages and for comparing with a plan)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("user_loss", "precision") and getattr(self, f.name) is not None}

    def allows(self, plan: Plan) -> bool:
        """Whether `plan` honours every choice fixed here (a plan saved earlier, offered instead of planning)."""
        chosen = {"stages": plan.num_stages, "replicas": plan.num_replicas, "micro_batches": plan.micro_batches,
                  "schedule": plan.schedule}
        if any(chosen[key] != value for key, value in self.choices().items() if key in chosen):
            return False
        if self.recompute is not None and any(s.recompute != self.recompute for s in plan.stages):
            return False
        if self.sharding is not None and any(s.sharding != self.sharding for s in plan.stages):
            return False
        if plan.precision != self.precision:
            return False
        return self.allows_schedule(plan.schedule)

    def allows_schedule(self, schedule: str) -> bool:
        if self.schedule is not None and schedule != self.schedule:
            return False
        return self.schedule_problem(schedule) is None

    def schedule_problem(self, schedule: str) -> str | None:
        """Why `schedule` cannot run under these constraints, and the fix; None where it can."""
        if self.user_loss and schedule not in FORWARDS_FIRST_SCHEDULES:
            return (f"{schedule} starts backwards before the last forward, but without loss_fn the loss is computed "
                    f"by your code after partita returns the outputs of every micro-batch, so only "
                    f"{' or '.join(FORWARDS_FIRST_SCHEDULES)} can run. Pass loss_fn=... to parallelize to use "
                    f"{schedule}, or choose {' or '.join(FORWARDS_FIRST_SCHEDULES)}.")
        if self.sharding in FSDP_LEVELS and schedule in SPLIT_BACKWARD_SCHEDULES:
            return fsdp_schedule_problem(schedule, self.sharding)
        return None

