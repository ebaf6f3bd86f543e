"""What the call agreement tells ranks found in different collective calls: the advice fits the cause."""

from partita.runtime.agreement import MODEL_CALL, SHUTDOWN, STOP_CHECK, State, _elsewhere, _Said

COLLECTIVE = "not under `if rank == 0:`"
SAME_STEPS = "Every rank must call the model the same number of times"


def said(*places: str) -> list[_Said]:
    return [_Said(State.LEAVING if where == SHUTDOWN else State.CALLING, 2, 0, "", None, where) for where in places]


def test_a_save_on_one_rank_is_a_collective_called_on_one_rank_even_when_the_other_shuts_down():
    for other in (MODEL_CALL, SHUTDOWN):
        message = _elsewhere(said("partita.save(path='ckpt', step=2)", other), 0)
        assert COLLECTIVE in message and SAME_STEPS not in message, message


def test_a_rank_that_left_partita_elastic_s_loop_is_told_to_stop_every_rank_at_the_same_step():
    for other in (SHUTDOWN, MODEL_CALL):
        message = _elsewhere(said(STOP_CHECK, other), 0)
        assert SAME_STEPS in message and COLLECTIVE not in message, message
        assert "rank 0 in partita.elastic's check for a stop between steps after 2 calls" in message, message


def test_ranks_in_the_same_place_or_a_call_against_a_shutdown_are_not_this_error():
    assert _elsewhere(said(STOP_CHECK, STOP_CHECK), 0) is None
    assert _elsewhere(said(MODEL_CALL, SHUTDOWN), 0) is None  # _left_early's case, with its step counts
