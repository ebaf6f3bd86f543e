"""A discrete-event simulator of pipeline schedules: how long a step takes and where the bubbles are.

Pure Python; torch is never imported here.
"""

from partita.sim.costs import StageCosts
from partita.sim.simulate import simulate
from partita.sim.trace import Event, Trace

__all__ = ["Event", "StageCosts", "Trace", "simulate"]
