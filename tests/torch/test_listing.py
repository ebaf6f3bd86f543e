"""The whole captured graph's digest (capture/listing.py), which every rank of a job must share: the same model
captured twice gives the same one; any operation's order, target or arguments change it, where the blocks'
fingerprint (what saved plans are matched against) does not."""

import torch
from torch import nn

from partita.capture.export import capture
from partita.capture.listing import Order, different_graphs, node_lines, reordered
from partita.capture.model_graph import model_graph


class Kinds(nn.Module):
    """Builds one table per kind, in the order given (a set's order, in a model: the process's hash seed)."""

    def __init__(self, order=("local", "global"), subtract=False, op=torch.cos):
        super().__init__()
        self.order, self.subtract, self.op = order, subtract, op
        torch.manual_seed(0)
        self.frequency_local = nn.Parameter(torch.rand(4))
        self.frequency_global = nn.Parameter(torch.rand(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        tables = {kind: self.op(x * getattr(self, f"frequency_{kind}")) for kind in self.order}
        x = self.layers[0](x) * tables["local"]
        x = self.layers[1](x) * tables["global"]
        return tables["local"] - x if self.subtract else x - tables["local"]


def graph_of(model):
    return model_graph(capture(model, (torch.randn(3, 4),), {}, source_lines=False))


def test_the_same_model_captured_twice_has_one_digest():
    a, b = graph_of(Kinds()), graph_of(Kinds())
    assert a.digest == b.digest and a.fingerprint == b.fingerprint


def test_another_order_of_the_same_operations_changes_the_digest_not_the_fingerprint():
    a, b = graph_of(Kinds(("local", "global"))), graph_of(Kinds(("global", "local")))
    assert a.digest != b.digest
    assert a.fingerprint == b.fingerprint  # why the blocks' fingerprint could not see it


def test_an_operation_s_arguments_or_target_change_the_digest():
    base = graph_of(Kinds()).digest
    assert graph_of(Kinds(subtract=True)).digest != base  # x - t against t - x
    assert graph_of(Kinds(op=torch.sin)).digest != base


def test_the_difference_names_the_first_operation_and_each_rank_s_hash_seed():
    model = Kinds()
    one = node_lines(capture(model, (torch.randn(3, 4),), {}, source_lines=False).gm)
    other = node_lines(capture(Kinds(("global", "local")), (torch.randn(3, 4),), {}, source_lines=False).gm)
    text = different_graphs([("0", one), ("1", other), ("0", one)])
    index = next(i for i, (a, b) in enumerate(zip(one, other)) if a != b)
    assert f"rank 1 captured a graph that first differs from rank 0's at operation {index}" in text
    assert f"rank 0 has `{one[index]}`, rank 1 `{other[index]}`" in text
    assert "rank 0 runs with PYTHONHASHSEED=0; rank 1 runs with PYTHONHASHSEED=1; rank 2" in text
    assert "so the ranks iterate in different orders" in text
    same_seed = different_graphs([("0", one), ("0", other)])
    assert "so the cause is elsewhere" in same_seed
    assert "no PYTHONHASHSEED (a random hash seed of its own)" in different_graphs([(None, one), (None, other)])


def test_a_capture_in_another_order_rebuilt_in_rank_0_s_order_is_rank_0_s_graph_and_computes_the_same():
    x = torch.randn(3, 4)
    first = capture(Kinds(("local", "global")), (x,), {}, source_lines=False)
    model = Kinds(("global", "local"))
    other = capture(model, (x,), {}, source_lines=False)
    rebuilt = reordered(other, Order.of(first.gm))
    assert node_lines(rebuilt.gm) == node_lines(first.gm) != node_lines(other.gm)
    assert model_graph(rebuilt).digest == model_graph(first).digest
    held = {name: model.get_parameter(fqn) for name, fqn in rebuilt.fqn_of.items()}
    inputs = [x if n.name in rebuilt.user_inputs else held[n.name] for n in rebuilt.gm.graph.nodes
              if n.op == "placeholder"]
    assert torch.equal(rebuilt.gm(*inputs)[0], model(x))


def test_a_capture_of_other_operations_is_not_rebuilt():
    x = torch.randn(3, 4)
    first = capture(Kinds(), (x,), {}, source_lines=False)
    other = capture(Kinds(op=torch.sin), (x,), {}, source_lines=False)
    assert reordered(other, Order.of(first.gm)) is None


def test_the_examples_in_the_docstrings():
    import doctest

    from partita.capture import listing
    from partita.runtime import same_start

    for module in (listing, same_start):
        assert doctest.testmod(module).failed == 0, module.__name__
