"""Pipeline schedules as data: per-rank orders of compute actions, equal to what torch's schedule classes run.

Pure Python; torch is never imported here.
"""

from partita.schedule.action import Action
from partita.schedule.generate import check_sizes, orders
from partita.schedule.inflight import micro_batches_in_flight, peak_activation_bytes
from partita.schedule.validate import validate_orders

__all__ = ["Action", "check_sizes", "micro_batches_in_flight", "orders", "peak_activation_bytes", "validate_orders"]
