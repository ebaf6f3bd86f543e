"""The step clock: training calls of the planned size, from a call to the last end of its step, after the
warm-up calls; the median once."""

import pytest

from partita.runtime.step_clock import MEASURED_STEPS, WARM_UP_CALLS, StepClock

ROWS = (4, 4)


def run(clock: StepClock, steps: list[tuple[tuple[int, int], bool, float]]) -> list[float | None]:
    """Each step: its rows, whether it trains, and how long from its call to its end; calls 1 s apart."""
    said, now = [], 0.0
    for rows, training, took in steps:
        said.append(clock.called(rows, training, now))
        clock.ended(now + took)
        now += 1.0
    return said


def test_the_median_of_the_steps_after_the_warm_up_once():
    clock = StepClock(ROWS)
    durations = [9.0] * WARM_UP_CALLS + [0.1, 0.3, 0.2, 0.5, 0.4] + [0.9] * 3
    said = run(clock, [(ROWS, True, d) for d in durations])
    # a step is known at the next call: the fifth measured step ends at call WARM_UP_CALLS + 5
    assert said[WARM_UP_CALLS + MEASURED_STEPS] == pytest.approx(0.3)
    assert [s for k, s in enumerate(said) if k != WARM_UP_CALLS + MEASURED_STEPS] == [None] * (len(said) - 1)


def test_evaluation_calls_and_short_batches_are_no_steps():
    clock = StepClock(ROWS)
    steps = [(ROWS, True, 0.2)] * WARM_UP_CALLS
    for k in range(MEASURED_STEPS):
        steps += [(ROWS, True, 0.2), (ROWS, False, 5.0), ((4, 2), True, 5.0)]
    said = run(clock, steps + [(ROWS, True, 0.2)])
    assert [s for s in said if s is not None] == [pytest.approx(0.2)]


def test_a_step_without_an_end_is_not_counted():
    """Nothing reached partita's part (no backward, no optimizer): no step to measure."""
    clock = StepClock(ROWS)
    for k in range(WARM_UP_CALLS + 2 * MEASURED_STEPS):
        assert clock.called(ROWS, True, float(k)) is None
