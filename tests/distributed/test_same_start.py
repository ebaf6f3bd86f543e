"""Every rank starts from the same software, plan, stage boundaries and initial weights, or every rank gets the
same error naming what differs and on which ranks (issue 30: the class of point 1)."""

import pytest


@pytest.mark.parametrize("differing, named", [
    ("plan", "plan: rank 0 / rank 1"),
    ("boundaries", "stage boundaries: rank 0 / rank 1"),
    ("weights", "the initial values of '0.weight': rank 0 / rank 1"),
])
def test_ranks_that_start_differently_are_refused_on_every_rank(pools, differing, named):
    errors = pools.run(2, "support.start_cases:start", differing)
    assert errors[0] == errors[1] and errors[0] is not None
    assert "the ranks would start training from different states" in errors[0]
    assert named in errors[0] and "install the same versions" in errors[0]


def test_a_tensor_one_rank_does_not_hold_is_compared_among_its_holders_only(pools):
    assert pools.run(2, "support.start_cases:start", "meta") == [None, None]
    assert pools.run(2, "support.start_cases:start", "nothing") == [None, None]
