"""Schedules as data: the Action text form, the size rules, and the invariants of every generated order."""

import pytest

from partita.schedule.catalog import SCHEDULES, SINGLE_STAGE_SCHEDULES, stage_to_pipeline_rank
from partita.schedule import (Action, check_sizes, micro_batches_in_flight, orders, peak_activation_bytes,
                              validate_orders)


def text(order):
    return " ".join(map(str, order))


# (schedule, stages, pipeline size, micro-batches): sizes torch accepts
TABLE = (
    [("GPipe", s, s, m) for s in (1, 2, 4) for m in (1, 3, 8)]
    + [("1F1B", s, s, m) for s in (1, 2, 4, 5) for m in (5, 8, 13)]
    + [(name, k * p, p, m) for name in ("LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble")
       for k in (1, 2, 3) for p in (1, 2, 4) for m in (1, 2, 4, 6, 8, 12)]
    + [("ZBVZeroBubble", 2 * p, p, m) for p in (1, 2, 3, 4) for m in (1, 3, 7, 8, 16)]
    + [("DualPipeV", 2 * p, p, m) for p in (1, 2, 3, 4) for m in (2 * p, 2 * p + 1, 16)]
)


# ---- Action ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", [Action(0, "F", 0), Action(2, "F", 3), Action(13, "B", 107), Action(1, "I", 4),
                                    Action(5, "W", 0)])
def test_action_text_round_trip(action):
    assert Action.parse(str(action)) == action
    assert str(Action.parse(f" {action} ")) == str(action)


def test_action_text_form_is_torchs():
    assert str(Action(2, "F", 3)) == "2F3"
    assert Action.parse("10B2") == (10, "B", 2)


@pytest.mark.parametrize("bad", ["", "F3", "2F", "2X3", "2F3x", "-1F0", "2 F 3", "2UNSHARD"])
def test_action_parse_rejects_other_text(bad):
    with pytest.raises(ValueError, match="is not an action"):
        Action.parse(bad)


# ---- sizes torch accepts ------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (("Zigzag", 2, 2, 4), "unknown schedule 'Zigzag'; choose one of GPipe, 1F1B"),
    (("GPipe", 2, 2, 0), "micro_batches must be at least 1"),
    (("GPipe", 4, 2, 4), r"GPipe runs one stage per rank: num_stages \(4\) must equal pipeline_size \(2\)"),
    (("1F1B", 4, 4, 3), "1F1B needs at least as many micro-batches as stages: 3 < 4. Use micro_batches=4"),
    (("LoopedBFS", 5, 2, 4), r"num_stages \(5\) must be a multiple of pipeline_size \(2\), e.g. 4"),
    (("Interleaved1F1B", 8, 4, 9), r"2 equal rounds, so micro_batches \(9\) must be a multiple of 2; use "
                                   r"micro_batches=8"),
    (("InterleavedZeroBubble", 8, 4, 13), "use micro_batches=12"),
    (("ZBVZeroBubble", 6, 2, 8), r"exactly two stages on each rank: num_stages \(6\) must be 2 x pipeline_size"),
    (("DualPipeV", 4, 2, 3), "DualPipeV needs at least as many micro-batches as stages: 3 < 4"),
])
def test_sizes_torch_rejects_raise_with_rule_and_fix(args, message):
    with pytest.raises(ValueError, match=message):
        orders(*args)


@pytest.mark.parametrize("micro_batches", range(1, 40))
@pytest.mark.parametrize("pipeline_size", [2, 3, 4, 8])
def test_interleaved_suggestion_is_accepted(pipeline_size, micro_batches):
    try:
        check_sizes("Interleaved1F1B", 2 * pipeline_size, pipeline_size, micro_batches)
    except ValueError as error:
        suggested = int(str(error).rsplit("=", 1)[1].rstrip("."))
        check_sizes("Interleaved1F1B", 2 * pipeline_size, pipeline_size, suggested)


# ---- invariants of every generated order --------------------------------------------------------------
@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", TABLE)
def test_orders_are_complete_and_well_ordered(schedule, num_stages, pipeline_size, micro_batches):
    result = orders(schedule, num_stages, pipeline_size, micro_batches)
    assert len(result) == pipeline_size
    validate_orders(result, num_stages, micro_batches)
    for rank, order in enumerate(result):
        assert {a.stage for a in order} == {s for s in range(num_stages)
                                            if stage_to_pipeline_rank(schedule, s, pipeline_size) == rank}
    # each stage runs its forwards in micro-batch order (the runtime feeds inputs in that order)
    for order in result:
        for stage in {a.stage for a in order}:
            forwards = [a.micro_batch for a in order if a.stage == stage and a.op == "F"]
            assert forwards == list(range(micro_batches))


def test_every_schedule_the_planner_knows_is_generated():
    for schedule in SCHEDULES:
        pipeline_size = 4 if schedule in SINGLE_STAGE_SCHEDULES else 2
        validate_orders(orders(schedule, 4, pipeline_size, 8), num_stages=4, micro_batches=8)


# ---- hand-checked small cases -------------------------------------------------------------------------
def test_gpipe_runs_every_forward_then_every_backward():
    assert [text(o) for o in orders("GPipe", 2, 2, 3)] == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_1f1b_warms_up_num_stages_minus_stage_forwards():
    assert [text(o) for o in orders("1F1B", 3, 3, 4)] == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_looped_bfs_runs_backwards_in_reverse():
    assert [text(o) for o in orders("LoopedBFS", 4, 2, 2)] == ["0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0",
                                                               "1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0"]


def test_interleaved_1f1b_goes_depth_first_in_rounds():
    assert [text(o) for o in orders("Interleaved1F1B", 4, 2, 4)] == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_interleaved_zero_bubble_lags_weights_by_rank():
    assert [text(o) for o in orders("InterleavedZeroBubble", 4, 2, 2)] == [
        "0F0 0F1 2F0 2F1 2I0 2W0 2I1 2W1 0I0 0W0 0I1 0W1",
        "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1",
    ]


def test_v_shaped_orders_on_one_rank():
    assert text(orders("ZBVZeroBubble", 2, 1, 2)[0]) == "0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1"
    assert text(orders("DualPipeV", 2, 1, 2)[0]) == "0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1"


# ---- validation ---------------------------------------------------------------------------------------
def parse_orders(*rows):
    return [[Action.parse(a) for a in row.split()] for row in rows]


@pytest.mark.parametrize("rows,message", [
    (("0B0 0F0",), "rank 0, position 0: 0B0 runs before its forward 0F0"),
    (("0F0 0W0 0I0",), "rank 0, position 1: 0W0 runs before its input-gradient backward 0I0"),
    (("0F0 0F0 0B0",), "rank 0, position 1: 0F0 runs twice"),
    (("0F0",), "stage 0, micro-batch 0 runs F; it needs F and B, or F, I and W"),
    (("0F0 0I0 0B0",), "stage 0, micro-batch 0 runs BFI"),
    (("0F0 0B0 1F0", "1B0"), "rank 1, position 0: 1B0: stage 1 also runs on rank 0"),
    (("0F0 0B0 2F0 2B0",), "rank 0, position 2: 2F0 is outside the schedule: stages 0..1"),
    (("0F0 0B0 0F1 0B1",), "0F1 is outside the schedule"),
])
def test_validate_names_the_broken_rule(rows, message):
    with pytest.raises(ValueError, match=message):
        validate_orders(parse_orders(*rows), num_stages=2 if len(rows) > 1 or "2F0" in rows[0] else 1,
                        micro_batches=1)


# ---- memory-relevant facts ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_stages,micro_batches", [(1, 1), (4, 4), (4, 16), (8, 9)])
def test_in_flight_gpipe_holds_all_1f1b_holds_stages_to_go(num_stages, micro_batches):
    gpipe = micro_batches_in_flight(orders("GPipe", num_stages, num_stages, micro_batches), num_stages)
    assert gpipe == (micro_batches,) * num_stages
    one_f_one_b = micro_batches_in_flight(orders("1F1B", num_stages, num_stages, micro_batches), num_stages)
    assert one_f_one_b == tuple(num_stages - s for s in range(num_stages))


def test_peak_activation_bytes_counts_a_ranks_stages_together():
    result = orders("Interleaved1F1B", 4, 2, 4)
    assert peak_activation_bytes(result, [1.0] * 4) == (5.0, 3.0)
    in_flight = micro_batches_in_flight(result, 4)
    assert in_flight == (4, 3, 2, 1)  # rank 0: 4 + 2 > 5, the peaks of its two stages do not coincide


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("action", "generate", "interleaved", "v_shaped", "validate", "inflight", "lockstep"):
        module = importlib.import_module(f"partita.schedule.{name}")
        assert doctest.testmod(module).failed == 0, name


def test_forwards_first_schedules_are_those_whose_ranks_run_every_forward_before_any_backward():
    from partita.schedule.catalog import FORWARDS_FIRST_SCHEDULES, SCHEDULES, stages_per_rank

    def forwards_first(schedule):
        for pipeline_size in (2, 3):
            stages = pipeline_size * stages_per_rank(schedule)
            for order in orders(schedule, stages, pipeline_size, 2 * stages):
                ops = [a.op for a in order]
                if "F" in ops[ops.index(next(o for o in ops if o != "F")):]:
                    return False
        return True

    assert tuple(s for s in SCHEDULES if forwards_first(s)) == FORWARDS_FIRST_SCHEDULES


# ---- lockstep: the driver's message steps -----------------------------------------------------------
def phases(order_of_ranks):
    """The forwards, then the backwards, of each rank, as partita's driver runs them."""
    return tuple([[a for a in o if (a.op == "F") == forward] for o in order_of_ranks] for forward in (True, False))


def messages(steps):
    """(step, sender, receiver, "F" or "B") of every send, and (step, sender, receiver, what the receiver runs
    with it) of every receive."""
    sent, received = set(), set()
    for rank, rank_steps in enumerate(steps):
        for e in rank_steps:
            if e.sends_to is not None:
                sent.add((e.step, rank, e.sends_to, "F" if e.action.op == "F" else "B", e.action.micro_batch))
            for action, source in zip(e.receives, e.received_from):
                received.add((e.step, source, rank, action))
    return sent, received


def rendezvous_completes(groups_of_ranks) -> bool:
    """NCCL's point-to-point semantics at their strictest: each rank runs its groups of messages in order on one
    stream, and a message (peer, "send" or "recv", what) completes only while the peer's current group holds its
    match. False if the ranks wait on each other forever."""
    heads = [0] * len(groups_of_ranks)
    while True:
        current = [groups[h] if h < len(groups) else frozenset() for groups, h in zip(groups_of_ranks, heads)]
        done = [rank for rank, group in enumerate(current) if group and all(
            (rank, "recv" if kind == "send" else "send", what) in current[peer] for peer, kind, what in group)]
        if not done:
            return all(h == len(groups) for groups, h in zip(groups_of_ranks, heads))
        for rank in done:
            heads[rank] += 1


def lockstep_groups(steps, num_stages):
    groups = []
    for rank_steps in steps:
        mine = []
        for e in rank_steps:
            group = set()
            if e.sends_to is not None:
                group.add((e.sends_to, "send", (e.action.stage, e.action.micro_batch)))
            for action, source in zip(e.receives, e.received_from):
                sender = action.stage - 1 if action.op == "F" else action.stage + 1
                group.add((source, "recv", (sender, action.micro_batch)))
            if group:
                mine.append(frozenset(group))
        groups.append(mine)
    return groups


@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", TABLE)
def test_lockstep_pairs_every_message_in_one_step(schedule, num_stages, pipeline_size, micro_batches):
    from partita.schedule.lockstep import lockstep

    whole = orders(schedule, num_stages, pipeline_size, micro_batches)
    for phase in (whole, *phases(whole)):  # a step, or its forwards and then its backwards
        steps = lockstep(phase, num_stages)
        for rank, order in enumerate(phase):
            ran = [e for e in steps[rank] if e.action is not None]
            assert [e.action for e in ran] == list(order)
            assert all(a.step < b.step for a, b in zip(steps[rank], steps[rank][1:]))
        sent, received = messages(steps)
        assert sent == {(t, src, dst, "F" if a.op == "F" else "B", a.micro_batch) for t, src, dst, a in received}
        arrived = {action: t for t, _, _, action in received}
        for rank_steps in steps:
            for e in rank_steps:
                if e.action in arrived:
                    assert arrived[e.action] < e.step, e
        assert rendezvous_completes(lockstep_groups(steps, num_stages))


def test_posting_each_message_as_its_action_runs_can_wait_forever_on_two_looped_ranks():
    """Why the driver runs in lockstep: LoopedBFS on two ranks, each message posted alone as its rank reaches it
    (the receive just before the action that needs it, the send just after the one that made it), leaves both
    ranks sending to each other; in lockstep the same phase completes."""
    from partita.schedule.lockstep import lockstep

    forward, _ = phases(orders("LoopedBFS", 4, 2, 2))
    where = {a.stage: rank for rank, o in enumerate(forward) for a in o}
    alone = []
    for rank, order in enumerate(forward):
        groups = []
        for a in order:
            if a.stage > 0 and where[a.stage - 1] != rank:
                groups.append(frozenset({(where[a.stage - 1], "recv", (a.stage - 1, a.micro_batch))}))
            if a.stage < 3 and where[a.stage + 1] != rank:
                groups.append(frozenset({(where[a.stage + 1], "send", (a.stage, a.micro_batch))}))
        alone.append(groups)
    assert not rendezvous_completes(alone)
    assert rendezvous_completes(lockstep_groups(lockstep(forward, 4), 4))


def test_lockstep_names_orders_that_wait_on_each_other():
    from partita.schedule.lockstep import lockstep

    with pytest.raises(ValueError, match="wait on each other"):
        lockstep([[Action(1, "F", 0), Action(0, "F", 0)], [Action(2, "F", 0)]], 3)
