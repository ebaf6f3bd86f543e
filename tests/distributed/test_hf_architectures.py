"""A fixed few of transformers' causal language models, tiny (support.hf_architectures), trained under data
parallelism and a 2 x 2 pipeline against one process; tests/hf_architectures.py runs them all."""

import pytest

from test_fidelity import check

# a mixture of experts with grouped-query attention, a parallel attention and MLP block with partial rotary
# embeddings (Gemma 3, under two hash seeds, is in launch/test_hash_seed.py)
SAMPLE = ["qwen3_moe", "gpt_neox"]


@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, {"stages": 1, "micro_batches": 1}),
                                        (4, {"stages": 2, "micro_batches": 2, "schedule": "1F1B"})],
                         ids=["data-parallel", "2x2"])
@pytest.mark.parametrize("model_type", SAMPLE)
def test_hf_architecture_trains_as_one_process(pools, model_type, world, plan):
    results = pools.run(world, "support.hf_architectures:fidelity", model_type, steps=2, optimizer="sgd",
                        **plan)
    r = check(results)
    assert r["plan"][:2] == (plan["stages"], world // plan["stages"])
