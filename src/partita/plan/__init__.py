"""Deciding the layout: pure Python over numbers, no process group and no model needed."""

from partita.plan.auto import auto_plan
from partita.plan.plan import Plan, StagePlan

__all__ = ["Plan", "StagePlan", "auto_plan"]
