"""Training across processes equals training in one process (fp32, rtol 1e-5, atol 1e-6)."""

import dataclasses
import json

import pytest

from partita.plan.plan import Plan
from partita.schedule.catalog import FORWARDS_FIRST_SCHEDULES

TRAINED = ("loss", "grad", "param", "optimizer", "state_dict")  # what every training run compares


def check(results: list[dict], *also: str, expect: tuple[str, ...] = TRAINED) -> dict:
    """Every rank compared every kind of quantity expected (`expect` and `also`), each within tolerance, and
    got the same global losses bit for bit; return rank 0's report. A kind never compared fails: a comparison
    that silently stops happening must not pass."""
    for rank, r in enumerate(results):
        missing = sorted(set(expect + also) - set(r["diffs"]))
        assert not missing, f"rank {rank}: nothing of kind {missing} was compared"
        for kind, v in r["diffs"].items():
            assert v["excess"] <= 0, \
                f"rank {rank}: {kind} differs beyond tolerance at {v['worst']} (by {v['excess']:.3g})"
        assert not r.get("warnings"), f"rank {rank} warned: {r['warnings']}"
        assert r["losses"] == results[0]["losses"], \
            f"the global loss differs between rank 0 and rank {rank}: {results[0]['losses']} vs {r['losses']}"
    return results[0]


def fidelity(pools, world: int, name: str, *also: str, expect: tuple[str, ...] = TRAINED, **options) -> dict:
    """support.cases.fidelity on every rank of a `world`-rank pool, checked (see check)."""
    return check(pools.run(world, "support.cases:fidelity", name, **options), *also, expect=expect)


def returned(style: str) -> tuple[str, ...]:
    """What a run compares beyond TRAINED because of its call style: the outputs, when they come back."""
    return ("output",) if style == "outputs" else ()


MATRIX = [  # world, stages, schedule, micro-batches: more than one wherever there is a pipeline to fill
    (1, 1, None, 1), (2, 1, None, 1), (4, 1, None, 1),
    (2, 2, "GPipe", 4), (2, 2, "1F1B", 4),
    (4, 2, "GPipe", 4), (4, 2, "1F1B", 4),
    (4, 4, "GPipe", 4), (4, 4, "1F1B", 4),
]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
@pytest.mark.parametrize("world,stages,schedule,micro_batches", MATRIX)
def test_mlp_matrix(pools, world, stages, schedule, micro_batches, style, optimizer):
    if style == "outputs" and schedule not in (None, *FORWARDS_FIRST_SCHEDULES):
        # the user's loss comes after every forward: a schedule that interleaves backwards cannot be what runs
        for r in pools.run(world, "support.cases:bad_input", "schedule_needs_loss_fn"):
            assert r["error"] == "PlanError" and "Pass loss_fn=... to parallelize to use 1F1B" in r["message"], r
        return
    r = fidelity(pools, world, "mlp", *returned(style), style=style, optimizer=optimizer, stages=stages,
                 schedule=schedule, micro_batches=micro_batches)
    stages_, replicas, micro_batches_, schedule_ = r["plan"]
    assert (stages_, replicas, micro_batches_) == (stages, world // stages, micro_batches)
    assert schedule is None or schedule_ == schedule
    if style == "loss_fn":
        assert len(r["losses"]) == 3  # one global loss per step, the same bits on every rank (check)


ZOO = ["lenet", "forkjoin", "shared_input", "shared_linear", "tied_embedding", "keywords", "embedding", "gpt",
       "hf_gpt2", "hf_bert", "hf_llama"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_two_stages(pools, name):
    """Each model split in two stages (world 2), trained with the loss computed by partita."""
    r = fidelity(pools, 2, name, "eval", stages=2, eval_batch=4)
    assert r["plan"][0] == 2


@pytest.mark.parametrize("name", ["shared_linear", "tied_embedding", "gpt", "forkjoin"])
def test_zoo_stages_and_replicas(pools, name):
    """Two stages x two replicas (world 4), outputs returned to the caller, SGD with momentum."""
    fidelity(pools, 4, name, "output", stages=2, replicas=2, style="outputs", optimizer="sgd")


@pytest.mark.parametrize("world,stages,schedule", [(2, 2, "1F1B"), (4, 4, "GPipe"), (4, 4, "1F1B")])
def test_writes_into_views_across_stages(pools, world, stages, schedule):
    """Writes in place into views of a value an earlier layer made (`h[:, 8:] += ...`; `head = h[:, :4]` ...
    `head.add_(...)`, then h read), in a model split into as many stages as it has blocks: as one process."""
    r = fidelity(pools, world, "write_into_view", "eval", stages=stages, micro_batches=4, schedule=schedule,
                 eval_batch=4)
    assert r["plan"][:2] == (stages, world // stages)


def test_hf_model_output_comes_back_whole(pools):
    """Without loss_fn, an HF ModelOutput comes back with its type, keys and nesting (logits and a tuple of
    hidden states), each tensor this rank's rows of the reference's."""
    fidelity(pools, 2, "hf_gpt2", "output", stages=2, style="outputs", steps=1,
             call_kwargs={"output_hidden_states": True})


def test_batchnorm_buffers_match_one_process(pools):
    """BatchNorm sees the whole batch (one replica, one micro-batch): running stats equal one process's."""
    r = fidelity(pools, 2, "batchnorm", "eval", stages=2, replicas=1, micro_batches=1, eval_batch=4)
    assert r["diffs"]["state_dict"]["checked"] >= 6  # running_mean, running_var, num_batches_tracked x 2


def test_batchnorm_replicas_keep_one_set_of_statistics(pools):
    """2 stages x 2 replicas: each replica normalizes by its own rows' statistics, and every replica takes
    replica 0's running statistics (DDP's rule). The reference computes exactly that in one process; the
    statistics of the whole batch would differ."""
    r = fidelity(pools, 4, "batchnorm", "output", "eval", stages=2, replicas=2, micro_batches=1,
                 schedule="GPipe", style="outputs", optimizer="sgd", statistics_replicas=2, eval_batch=4)
    assert r["plan"][:3] == (2, 2, 1)


@pytest.mark.parametrize("stages,eval_from,style", [(2, 0, "loss_fn"), (2, 1, "loss_fn"), (2, 1, "outputs"),
                                                     (1, 1, "loss_fn")])  # a pipeline; DDP
def test_a_submodule_in_eval_mode_stays_in_it(pools, stages, eval_from, style):
    """A frozen BatchNorm (bn1.eval() in a training model) normalizes by its running statistics and leaves
    them as they are, as in one process, put in eval mode before the first call (which captures and plans)
    or after a training step; the other BatchNorm goes on training (on each replica's rows); then a call in
    eval mode."""
    r = fidelity(pools, 2, "batchnorm", "eval", *returned(style), stages=stages, replicas=2 // stages,
                 micro_batches=1, schedule="GPipe", style=style, eval_modules=("bn1",), eval_from=eval_from,
                 eval_batch=4, statistics_replicas=2 // stages)
    assert r["plan"][:3] == (stages, 2 // stages, 1)


@pytest.mark.parametrize("stages,micro_batches,schedule,style", [(2, 2, "1F1B", "loss_fn"), (2, 2, "GPipe", "outputs"),
                                                                  (1, 1, None, "loss_fn")])  # pipelines; DDP
def test_training_in_eval_mode(pools, stages, micro_batches, schedule, style):
    """model.eval() changes what BatchNorm computes (its running statistics, which stay as they are), not
    whether gradients flow: trained in eval mode, as in one process."""
    r = fidelity(pools, 2, "batchnorm", *returned(style), stages=stages, replicas=2 // stages,
                 micro_batches=micro_batches, schedule=schedule, style=style, eval_modules=("",))
    assert r["plan"][:3] == (stages, 2 // stages, micro_batches)


@pytest.mark.parametrize("stages", [2, 1])  # a pipeline; DDP
def test_model_that_returns_its_loss(pools, stages):
    """The loss comes back as the global batch's mean; the inputs' gradients are of each rank's own loss, as under
    DDP, with a pipeline too."""
    fidelity(pools, 2, "loss_out", "eval", "input_grad", stages=stages, style="outputs", eval_batch=4,
             input_grad=True)


def test_model_without_parameters(pools):
    """No parameters: the outputs and the input gradients must still match."""
    fidelity(pools, 2, "no_params", "output", "input_grad", expect=("loss",), stages=2, style="outputs",
             input_grad=True)


@pytest.mark.parametrize("stages,replicas,micro_batches", [(2, 2, 2), (1, 4, 1)])  # a pipeline; DDP
def test_input_gradients_with_loss_fn(pools, stages, replicas, micro_batches):
    fidelity(pools, 4, "mlp", "input_grad", stages=stages, replicas=replicas, micro_batches=micro_batches,
             input_grad=True)


@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
def test_gradient_accumulation(pools, style):
    """Two forward/backward calls per optimizer step."""
    fidelity(pools, 4, "mlp", *returned(style), stages=2, replicas=2, style=style, accumulate=2)


@pytest.mark.parametrize("style,schedule", [("loss_fn", "1F1B"), ("outputs", "GPipe")])
def test_no_grad_and_eval_run_forward_only_under_the_same_plan(pools, style, schedule):
    """torch.no_grad() in train mode, then eval(), each at another batch size than training: outputs (or the
    loss) equal the reference's, nothing requires grad, and the plan object stays the one in use."""
    fidelity(pools, 2, "mlp", "no_grad", "eval", *returned(style), style=style, steps=1, stages=2,
             micro_batches=2, schedule=schedule, no_grad_batch=4, eval_batch=2)


@pytest.mark.parametrize("lr_schedule,optimizer", [("StepLR", "sgd"), ("LambdaLR", "adam")])
def test_lr_scheduler_keeps_working(pools, lr_schedule, optimizer):
    """The user's LR scheduler steps the optimizer partita patched, on a pipelined plan."""
    r = fidelity(pools, 2, "mlp", lr_schedule=lr_schedule, optimizer=optimizer, stages=2, micro_batches=2,
                 schedule="1F1B")
    assert r["lr_factor"] == 0.5 ** 3


RELOADED = ("reload param", "reload optimizer")


def test_state_dict_round_trip_into_another_plan(pools):
    """Model and optimizer state saved under 2 stages x 2 replicas load into a fresh 4-stage run."""
    r = fidelity(pools, 4, "gpt", *RELOADED, stages=2, replicas=2, roundtrip={"stages": 4, "replicas": 1})
    assert r["plan"][:2] == (2, 2) and r["reload_plan"][:2] == (4, 1)


DDP = {"stages": 1, "micro_batches": 1}
PIPELINE = {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("before,after", [(DDP, PIPELINE), (PIPELINE, DDP)], ids=["ddp-to-pipeline",
                                                                                  "pipeline-to-ddp"])
def test_optimizer_state_round_trip_between_ddp_and_pipeline(pools, optimizer, before, after):
    """SGD's momentum and Adam's moments and step count, saved under one plan, load into a fresh optimizer of
    a fresh parallelize call under the other; training goes on as in one process."""
    r = fidelity(pools, 2, "mlp", *RELOADED, optimizer=optimizer, steps=1, roundtrip=after, **before)
    assert r["plan"][:3] == (before["stages"], 2 // before["stages"], before["micro_batches"])
    assert r["reload_plan"][:3] == (after["stages"], 2 // after["stages"], after["micro_batches"])


def test_plan_given_as_an_object(pools):
    """plan= takes a Plan object, used as given: a 2-micro-batch run's plan changed to 4 micro-batches, which
    no planner call made."""
    made = Plan.from_json(pools.run(2, "support.cases:fidelity", "mlp", steps=1, stages=2, micro_batches=2,
                                    schedule="GPipe")[0]["plan_json"])
    given = dataclasses.replace(made, micro_batches=4)
    r = fidelity(pools, 2, "mlp", steps=1, plan=given)
    assert Plan.from_json(r["plan_json"]) == given


@pytest.mark.parametrize("schedule,stages", [("Interleaved1F1B", 4), ("LoopedBFS", 4),
                                             ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4),
                                             ("DualPipeV", 4)])
def test_more_schedules(pools, schedule, stages):
    """Schedules that put two stages on each rank (world 2)."""
    r = fidelity(pools, 2, "mlp", stages=stages, schedule=schedule)
    assert r["plan"][3] == schedule


def test_looped_breadth_first_with_the_users_own_loss(pools):
    """LoopedBFS (two stages per rank) when the user computes the loss from the outputs."""
    r = fidelity(pools, 2, "mlp", *returned("outputs"), style="outputs", stages=4, schedule="LoopedBFS",
                 micro_batches=2)
    assert r["plan"][3] == "LoopedBFS"


@pytest.mark.parametrize("world,stages,micro_batches", [(2, 1, 1), (4, 1, 1), (2, 2, 4), (4, 2, 2)])
def test_summed_loss(pools, world, stages, micro_batches):
    """A loss that sums over rows: the global batch's sum, and its gradients (DDP averages over ranks)."""
    r = fidelity(pools, world, "mlp", reduction="sum", stages=stages, micro_batches=micro_batches)
    assert r["plan"][:3] == (stages, world // stages, micro_batches)


@pytest.mark.parametrize("world,stages,micro_batches", [(2, 1, 1), (2, 2, 2), (4, 2, 2)])
def test_a_plain_function_that_sums_is_found_summing(pools, world, stages, micro_batches):
    """A plain loss function says nothing of how it combines rows: the first call's values show that it sums,
    and partita combines the micro-batches and ranks so (taken as a mean, the loss and gradients would be off by
    their number)."""
    r = fidelity(pools, world, "mlp", reduction="plain sum", stages=stages, micro_batches=micro_batches)
    assert r["plan"][:3] == (stages, world // stages, micro_batches)


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 2)])
def test_a_plain_function_that_sums_is_found_summing_in_an_evaluation_first(pools, stages, micro_batches):
    """The first call an evaluation (under torch.no_grad()): the loss is the global batch's sum all the same."""
    for r in pools.run(2, "support.cases:plain_sum_evaluated_first", stages=stages, micro_batches=micro_batches):
        assert r["plan"][:3] == (stages, 2 // stages, micro_batches)
        assert r["loss"] == pytest.approx(r["one_process"], rel=1e-5)


@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
@pytest.mark.parametrize("world", [2, 4])
def test_batches_of_different_sizes_under_data_parallel(pools, world, style):
    """A last short batch that is not equally short everywhere: each rank's mean weighs by its rows (with
    loss_fn, the global batch's loss and gradients; without, DDP's average of each rank's own loss)."""
    r = fidelity(pools, world, "mlp", *returned(style), style=style, extra_rows=3, stages=1)
    assert r["plan"][:3] == (1, world, 1)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("stages,replicas,micro_batches", [(2, 1, 2), (1, 2, 1)])  # a pipeline; DDP
def test_clip_grad_norm_as_one_process(pools, norm_type, stages, replicas, micro_batches):
    """clip_grad_norm_ returns the whole model's norm and clips as torch.nn.utils.clip_grad_norm_ does in one
    process, the infinity norm (the largest magnitude) included."""
    for r in pools.run(2, "support.cases:clipped", norm_type, stages=stages, replicas=replicas,
                       micro_batches=micro_batches):
        assert r["plan"][:3] == (stages, replicas, micro_batches), r["plan"]
        for got, want in r["norms"]:
            assert got == pytest.approx(want, rel=1e-5), r["norms"]
        assert r["worst"] < 1e-6, r["worst"]


@pytest.mark.parametrize("stages,replicas,micro_batches", [(1, 2, 1), (2, 1, 2)])  # DDP; a pipeline
def test_a_loss_read_by_one_rank_after_its_step_is_the_global_loss(pools, stages, replicas, micro_batches):
    """The loss a call returns is the global batch's whenever it is read: rank 0 alone reading each loss after
    the optimizer's step neither waits for the others nor sees its own rows' loss, and every rank reading them
    all at the end gets the same values (a guard for any change that would defer the loss's sum)."""
    results = pools.run(2, "support.cases:losses_read_late", stages=stages, replicas=replicas,
                        micro_batches=micro_batches)
    for r in results:
        assert r["plan"][:3] == (stages, replicas, micro_batches), r["plan"]
        assert r["late"] == results[0]["late"] and r["late_type"] == "Tensor"
        assert r["late"] == pytest.approx(r["want"], rel=1e-5)
    assert results[0]["early"] == results[0]["late"]


@pytest.mark.parametrize("stages,replicas,micro_batches", [(2, 1, 2), (1, 2, 1), (1, 2, 2)])  # pipeline; DDP
def test_a_parameter_unfrozen_after_the_first_call_trains_as_in_one_process(pools, stages, replicas,
                                                                            micro_batches):
    for r in pools.run(2, "support.cases:unfrozen", stages=stages, replicas=replicas, micro_batches=micro_batches):
        assert r["plan"][:3] == (stages, replicas, micro_batches), r["plan"]
        assert max(r["worst"]) < 1e-6, r["worst"]


@pytest.mark.parametrize("sharding", ["optimizer", "gradients", "parameters"])
def test_a_parameter_unfrozen_after_the_first_call_trains_as_in_one_process_when_sharded(pools, sharding):
    """Sharded state is laid out when parallelized: a parameter frozen then must still get its share of it."""
    for r in pools.run(2, "support.cases:unfrozen", stages=1, replicas=2, micro_batches=1, sharding=sharding):
        assert r["sharding"] == [sharding], r["sharding"]
        assert max(r["worst"]) < 1e-6, r["worst"]


@pytest.mark.parametrize("stages,replicas,micro_batches", [(1, 2, 1), (2, 1, 2)])  # DDP; a pipeline
def test_state_dict_is_the_same_on_every_rank_with_batchnorm_statistics(pools, stages, replicas, micro_batches):
    """Each replica's BatchNorm statistics come from its own rows; state_dict() gives the first replica's (as
    DDP uses them) on every rank."""
    results = pools.run(2, "support.cases:state_after_training", "batchnorm", stages=stages, replicas=replicas,
                        micro_batches=micro_batches)
    assert results[0]["plan"][:3] == (stages, replicas, micro_batches), results[0]["plan"]
    assert results[0]["state"] == results[1]["state"]


@pytest.mark.parametrize("load_at,build", [(0, "cpu"), (1, "cpu"), (0, "meta")],
                         ids=["before-the-first-call", "mid-training", "meta-built-before-the-first-call"])
@pytest.mark.parametrize("plan", [{"stages": 1, "micro_batches": 1}, {"stages": 2, "micro_batches": 2},
                                  {"stages": 1, "micro_batches": 1, "sharding": "parameters"}],
                         ids=["ddp", "2stages", "fsdp"])
def test_load_state_dict_with_assign_copies_into_the_tensors_partita_holds(pools, plan, load_at, build):
    """model.load_state_dict(sd, assign=True), the idiom for models built on the meta device, loads what one
    process loading sd does: partita copies into the tensors its runtime and the optimizer hold (a tensor
    still meta before the first call takes its value when the first call makes it), and training follows."""
    loaded = ("loaded param",) if build == "cpu" else ("initial",)
    r = fidelity(pools, 2, "mlp", *loaded, load_at=load_at, assign=True, build=build, **plan)
    assert r["plan"][:3] == (plan["stages"], 2 // plan["stages"], plan["micro_batches"])


@pytest.mark.parametrize("name,world,options", [
    ("gpt", 2, {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}),
    ("hf_gpt2", 4, {"stages": 2, "micro_batches": 2, "schedule": "GPipe"}),
    ("hf_llama", 2, {"stages": 2, "micro_batches": 4, "schedule": "Interleaved1F1B"}),
])
def test_recomputed_stages_equal_one_process(pools, name, world, options):
    """Every stage runs its forward again in the backward (what a measured plan chooses under memory pressure),
    rotary and attention-mask buffers included."""
    r = fidelity(pools, world, name, recompute=True, **options)
    assert all(s["recompute"] for s in json.loads(r["plan_json"])["stages"])


@pytest.mark.parametrize("name,world,options", [
    ("hf_gpt2", 2, {"stages": 2, "micro_batches": 2, "schedule": "InterleavedZeroBubble"}),
    ("hf_bert", 2, {"stages": 2, "micro_batches": 2, "schedule": "ZBVZeroBubble"}),
    ("hf_gpt2", 2, {"stages": 4, "micro_batches": 2, "schedule": "InterleavedZeroBubble"}),
    ("gpt", 4, {"stages": 4, "micro_batches": 4, "schedule": "ZBVZeroBubble"}),
    ("hf_llama", 2, {"stages": 4, "micro_batches": 4, "schedule": "DualPipeV"}),
    ("forkjoin", 2, {"stages": 4, "micro_batches": 2, "schedule": "InterleavedZeroBubble"}),
], ids=["gpt2-inputs-without-gradient", "bert-inputs-without-gradient", "gpt2-views-sent-on", "gpt-replicated",
        "llama-dualpipev", "strided-input-gradients"])
def test_zero_bubble_schedules_on_models_nobody_here_wrote(pools, name, world, options):
    """Schedules that split each backward into its input and weight halves. The first two plans give stage 0
    only the reshaping of the token ids (no parameters): stage 1's inputs need no gradient, and torch's weight
    half found none of its weights' gradients (they stayed None); the others send views and outputs that their
    ops saved on to the next stage, which torch's input half detaches in place (autograd refused); the fork-join
    model's input gradients come back strided, which a send refuses."""
    r = fidelity(pools, world, name, **options)
    planned = json.loads(r["plan_json"])
    assert planned["schedule"] == options["schedule"]
    if name != "gpt" and options["stages"] == 2:
        assert planned["stages"][0]["num_params"] == 0
