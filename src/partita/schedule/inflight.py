"""How many micro-batches each stage holds activations for at once: the schedule's part of peak memory."""

from __future__ import annotations

from collections.abc import Sequence

from partita.schedule.action import BACKWARD_INPUT, FORWARD, Action


def micro_batches_in_flight(orders: Sequence[Sequence[Action]], num_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward has run and whose backward has not yet finished.

    A stage keeps a micro-batch's saved activations from its F until its B, or until its W when the backward
    is split: W still reads the layer inputs that I leaves behind, so this counts the micro-batch until W
    (an upper bound for split backwards).

    >>> from partita.schedule import orders
    >>> micro_batches_in_flight(orders("1F1B", 4, 4, 8), 4)
    (4, 3, 2, 1)
    """
    peak = [0] * num_stages
    for order in orders:
        held = [0] * num_stages
        for stage, op, _ in order:
            if op == FORWARD:
                held[stage] += 1
                peak[stage] = max(peak[stage], held[stage])
            elif op != BACKWARD_INPUT:  # B or W frees the micro-batch
                held[stage] -= 1
    return tuple(peak)


def peak_activation_bytes(orders: Sequence[Sequence[Action]], activation_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the most bytes of saved activations held at once, given each stage's bytes per micro-batch.

    On a rank with several stages (looped, V-shaped) their peaks need not coincide, so this is at most the
    sum of `micro_batches_in_flight` x bytes over the rank's stages.

    >>> from partita.schedule import orders
    >>> peak_activation_bytes(orders("Interleaved1F1B", 4, 2, 4), [10.0, 10.0, 1.0, 1.0])
    (41.0, 30.0)
    """
    peaks = []
    for order in orders:
        held = peak = 0.0
        for stage, op, _ in order:
            if op == FORWARD:
                held += activation_bytes[stage]
                peak = max(peak, held)
            elif op != BACKWARD_INPUT:
                held -= activation_bytes[stage]
        peaks.append(peak)
    return tuple(peaks)
