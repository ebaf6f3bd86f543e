"""What a job's first call measures for the planner beyond its blocks: its own optimizer's step
(profile/optimizer_rate.py), on rank 0, which plans; partita's own costs, on probes that leave nothing behind."""


def test_the_first_call_times_the_jobs_own_optimizer(pools):
    """torch's Adam makes more passes over the parameters than SGD with momentum: its rate is lower."""
    rank0, rank1 = pools.run(2, "support.cases:optimizer_rates")
    assert rank1 == {"adam": None, "sgd": None}
    assert rank0["sgd"] > rank0["adam"] > 0, rank0


def test_the_probes_that_time_partitas_own_costs_leave_no_process_group_behind(pools):
    """Each probe's runtime makes groups (pipelines, gradient sums); under NCCL each would hold GPU memory for
    the job's life."""
    for rank, r in enumerate(pools.run(2, "support.cases:groups_around_measuring_overheads")):
        assert r["fitted"] == (rank == 0)
        assert r["after"] == r["before"], f"rank {rank}: {r}"
