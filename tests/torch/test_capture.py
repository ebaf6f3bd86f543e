"""Capture and split in one process: the stage chain computes what the model computes."""

import contextlib
import copy

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from partita.capture.model_graph import model_graph
from partita.capture.export import Modes, capture, flatten_call
from partita.capture.split import carry_stages, cuts_between_views_and_writes, split, units
from partita.errors import BatchError, CaptureError, InternalError, PlanError
from support.zoo import CASES


def run_stages(cap, stages, args, kwargs):
    tensors, _ = flatten_call(args, kwargs)
    env = dict(zip(cap.user_inputs, tensors))
    for st in stages:
        env.update(zip(st.outputs, st.module(*[env[n] for n in st.inputs])))
    leaves = [env[o.name] if isinstance(o, torch.fx.Node) else o for o in cap.outputs]
    return pytree.tree_unflatten(leaves, cap.out_spec)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stage_chain_equals_model(name, num_stages):
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make().eval()
    args, kwargs, _ = case.batch(4, torch.Generator().manual_seed(0))
    cap = capture(model, args, kwargs)
    n = len(units(cap))
    # stage boundaries spread over the cuts the splitter takes (none between a view and a write into it)
    allowed = sorted(set(range(n - 1)) - cuts_between_views_and_writes(cap))
    chosen = [allowed[(j + 1) * len(allowed) // num_stages] for j in range(num_stages - 1)]
    stages = split(cap, [sum(k < i for k in chosen) for i in range(n)], num_stages)
    got, want = run_stages(cap, stages, args, kwargs), model(*args, **kwargs)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_stage_boundary_between_a_view_and_a_write_into_it():
    """`head = h[:, :4]` ... `head.add_(...)`, then h read: the blocks keep the view with the write, and the
    splitter refuses a boundary between them (a stage would write into a copy of the view, not into h)."""
    model = CASES["write_into_view"].make()
    cap = capture(model, (torch.randn(4, 16),), {})
    cuts = cuts_between_views_and_writes(cap)
    assert cuts
    graph = model_graph(cap)
    assert not {b.units[1] - 1 for b in graph.blocks[:-1]} & cuts
    k = min(cuts)
    with pytest.raises(InternalError, match="between a view of a tensor and an in-place write"):
        split(cap, [0] * (k + 1) + [1] * (len(units(cap)) - k - 1), 2)


def test_parameters_are_the_users_own_tensors():
    model = CASES["tied_embedding"].make()
    cap = capture(model, (torch.randint(0, 50, (2, 6)),), {})
    stages = split(cap, [0] * 3 + [1] * (len(units(cap)) - 3), 2)
    owned = {id(p) for s in stages for p in s.module.parameters()}
    assert id(model.emb.weight) in owned and id(model.mid[0].weight) in owned
    # the tied weight is registered in both stages that read it
    assert sum(id(model.emb.weight) in {id(p) for p in s.module.parameters()} for s in stages) == 2


def test_flops_of_linear_layers_are_counted_exactly():
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 32))
    graph = model_graph(capture(model, (torch.randn(4, 64),), {}))
    linear = [b for b in graph.blocks if b.params]
    assert [b.fwd_flops.lines for b in linear] == [((0.0, 2 * 64 * 128),), ((0.0, 2 * 128 * 32),)]
    assert graph.param_bytes_of(0, graph.num_blocks) == 4 * (64 * 128 + 128 + 128 * 32 + 32)


def test_eval_graph_maps_onto_the_training_plan():
    model = CASES["batchnorm"].make()
    x = torch.randn(4, 16)
    train = capture(model.train(), (x,), {})
    stage_of_node = {}
    groups = units(train)
    for i, g in enumerate(groups):
        for node in g:
            stage_of_node[node.name] = 0 if i < len(groups) // 2 else 1
    evaluation = capture(model.eval(), (x,), {})
    stages = carry_stages(evaluation, stage_of_node, {})
    assert stages == sorted(stages) and set(stages) == {0, 1}
    out = run_stages(evaluation, split(evaluation, stages, 2), (x,), {})
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


def test_a_capture_keeps_each_modules_own_mode():
    """A frozen BatchNorm in a training model (bn1.eval()) is captured in eval mode, and the capture's modes,
    the key its runtime engine is kept under, say so."""
    model = CASES["batchnorm"].make().train()
    model.bn1.eval()
    x = torch.randn(4, 16)
    cap = capture(model, (x,), {})
    modules = list(model.modules())
    assert cap.modes == Modes.of(modules) == Modes(True, (modules.index(model.bn1),))
    assert Modes.of(list(model.train().modules())) == Modes(True) != cap.modes
    model.bn1.eval()
    want = copy.deepcopy(model)(x)
    out = run_stages(cap, split(cap, [0] * len(units(cap)), 1), (x,), {})
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_graphs_record_the_users_lines_unless_counted_only_for_planning():
    """A stage's graph knows the user's line of each op (a stage that fails shows it); a capture only counted
    for planning (`partita plan`) skips recording them, and is the same graph otherwise."""
    model = CASES["tied_embedding"].make()
    args = (torch.randint(0, 50, (2, 6)),)
    lines, bare = capture(model, args, {}), capture(model, args, {}, source_lines=False)
    ops = [n for n in lines.gm.graph.nodes if n.op == "call_function"]
    assert ops and all("zoo.py" in n.meta.get("stack_trace", "") for n in ops)

    def graph(cap):
        return [(n.op, str(n.target)) for n in cap.gm.graph.nodes]

    assert graph(bare) == graph(lines)
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        return  # torch 2.11 has no switch for it: the lines are recorded all the same
    assert not any(n.meta.get("stack_trace") for n in bare.gm.graph.nodes)
    assert not torch.fx.config.do_not_emit_stack_traces  # the switch is torch's own, set back


def test_block_signatures_do_not_depend_on_the_ranks_gpu_index():
    """Ranks share out measuring blocks by signature: an op that makes a tensor on the inputs' device (the GPT's
    arange) must give the same signature on cuda:0 as on cuda:1."""
    case = CASES["gpt"]
    args, kwargs, _ = case.batch(2, torch.Generator().manual_seed(0))
    cap = capture(case.make(), args, kwargs)
    placed = [n for n in cap.gm.graph.nodes if "device" in n.kwargs]
    assert placed

    def signatures(index: int) -> list[str]:
        for n in placed:
            n.kwargs = {**n.kwargs, "device": torch.device("cuda", index)}
        return [b.signature for b in model_graph(cap).blocks]

    assert signatures(0) == signatures(1)


def test_capture_error_names_module_op_and_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.gate = Gate()

        def forward(self, x):
            return self.gate(self.inner(x))

    class Gate(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(CaptureError) as e:
        capture(Branchy(), (torch.randn(3, 4),), {})
    msg = str(e.value)
    assert "'gate' (Gate)" in msg and "if x.sum() > 0" in msg and "test_capture.py" in msg
    assert "torch.where" in msg


def test_scalar_tensor_input_is_refused():
    with pytest.raises(BatchError, match="0-dim"):
        flatten_call((torch.tensor(1.0),), {})


def test_more_stages_than_blocks():
    cap = capture(nn.Linear(4, 4), (torch.randn(2, 4),), {})
    with pytest.raises(PlanError, match="no operations"):
        split(cap, [0] * len(units(cap)) + [], 2)


def _measure_each_block(model: nn.Module, case, rows: int = 2) -> list:
    """(block, forward seconds, bytes kept for the backward) of every block of `model`, each measured alone
    at `rows` rows as the profiler does."""
    from partita.profile.block_times import measure_block

    args, kwargs, _ = case.batch(4, torch.Generator().manual_seed(0))
    cap = capture(model, args, kwargs)
    graph = model_graph(cap)
    measured = []
    for block in graph.blocks:
        fwd, _, kept = measure_block(cap, graph, block, rows, torch.device("cpu"))
        measured.append((block, fwd, kept))
    return measured


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_block_alone_runs(name):
    """Cutting any single block out gives a runnable module that takes time, and a block with parameters
    keeps something for their gradients (its input at least)."""
    torch.manual_seed(0)
    model = CASES[name].make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for block, fwd, kept in _measure_each_block(model, CASES[name]):
        assert fwd > 0, block.name
        assert kept > 0 or not block.params, f"{block.name} keeps nothing for its parameters' gradients"
    assert all(p.grad is None for p in model.parameters())  # measuring leaves no gradients behind
    for k, v in model.state_dict().items():  # nor changed weights or BatchNorm statistics
        assert torch.equal(v, before[k]), k


def test_kept_bytes_are_what_the_backward_reads():
    """A Linear(32, 32) block keeps exactly its input (for its weight's gradient; the weight itself is the
    model's and not counted); blocks whose gradients nothing needs keep nothing."""
    rows = 2
    for block, _, kept in _measure_each_block(CASES["mlp"].make(), CASES["mlp"], rows):
        assert kept == rows * 32 * 4, block.name
    for block, _, kept in _measure_each_block(CASES["no_params"].make(), CASES["no_params"], rows):
        assert kept == 0, block.name



class _TwoOutputs(nn.Module):
    """`a` on the float input; `b` on `a`'s output and an embedding of the token ids, returned apart (or,
    `joined`, added); the embedding frozen if `frozen`; both in an autocast region if `region`."""

    def __init__(self, joined: bool = False, frozen: bool = False, region: bool = False):
        super().__init__()
        self.a, self.b, self.e = nn.Linear(4, 4), nn.Linear(4, 4), nn.Embedding(10, 4)
        self.e.weight.requires_grad_(not frozen)
        self.joined, self.region = joined, region

    def forward(self, x, ids):
        h = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.region else contextlib.nullcontext():
            u, v = self.b(h), self.e(ids) * 2
        return u.float() + v.float() if self.joined else (u.float(), v.float())


@pytest.mark.parametrize("model,meets", [
    (_TwoOutputs(), False),  # the embedding's path reaches an output without meeting `a`'s output
    (_TwoOutputs(joined=True), True),  # ... it meets it in the sum
    (_TwoOutputs(frozen=True), True),  # ... a frozen embedding has no gradient to lose
    (_TwoOutputs(region=True), False),  # ... inside one autocast region, which is one node of the graph
])
def test_a_stage_knows_whether_its_weights_paths_meet_its_inputs(model, meets):
    """torch's split backward (zero-bubble schedules) finds a stage's weight gradients only where their paths
    meet those of inputs needing gradients: stage 1 (everything after `a`) must say where they do not."""
    cap = capture(model, (torch.randn(2, 4), torch.randint(0, 10, (2,))), {})
    stages = split(cap, [0] + [1] * (len(units(cap)) - 1), 2)
    assert stages[1].inputs == ["tensors_1", "linear"] and stages[1].parameters
    assert stages[1].weights_meet_inputs is meets


class _TokensFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

    def forward(self, ids):
        return self.lin(self.e(ids.flip(0)))


def test_a_stage_whose_inputs_need_no_gradient_says_its_weights_miss_them():
    """As HF GPT-2 and BERT planned with the token ids' reshaping alone in stage 0: stage 1's inputs need no
    gradient, so no path of its weights meets them."""
    cap = capture(_TokensFirst(), (torch.randint(0, 10, (2, 3)),), {})
    n = len(units(cap))
    stages = split(cap, [0] + [1] * (n - 1), 2)  # stage 0: the flip
    assert not any(cap.requires_grad.get(name, False) for name in stages[1].inputs)
    assert stages[1].weights_meet_inputs is False
    stages = split(cap, [0, 0] + [1] * (n - 2), 2)  # stage 1 receives the embedding's output
    assert stages[1].weights_meet_inputs is True
