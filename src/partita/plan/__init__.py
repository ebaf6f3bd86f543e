"""Deciding the layout: pure Python over numbers, no process group and no model needed."""

from partita.plan.choose import choose_plan
from partita.plan.constraints import Constraints
from partita.plan.plan import Estimate, Plan, StagePlan

__all__ = ["Constraints", "Estimate", "Plan", "StagePlan", "choose_plan"]
