"""What a job's first call measures for the planner beyond its blocks: its own optimizer's step
(profile/optimizer_rate.py), on rank 0, which plans."""


def test_the_first_call_times_the_jobs_own_optimizer(pools):
    """torch's Adam makes more passes over the parameters than SGD with momentum: its rate is lower."""
    rank0, rank1 = pools.run(2, "support.cases:optimizer_rates")
    assert rank1 == {"adam": None, "sgd": None}
    assert rank0["sgd"] > rank0["adam"] > 0, rank0
