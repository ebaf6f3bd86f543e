"""Per-block costs: measured on a real device, or estimated from a device preset. Numbers only."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from partita.graph.graph import Fit, ModelGraph


@dataclass(frozen=True)
class BlockCost:
    fwd_s: Fit  # forward seconds for a micro-batch of `rows`
    bwd_s: Fit  # backward seconds (input and weight gradients)
    activation_bytes: Fit  # what autograd keeps from the forward for the backward


@dataclass(frozen=True)
class Profile:
    source: str  # "measured on cpu, torch 2.13.0" / "estimated for A100-40GB (roofline)"
    blocks: tuple[BlockCost, ...]  # one per ModelGraph block, same order
    # bytes per second of an elementwise pass over memory the size of the model's parameters, starting out of
    # cache as in a step (adding one micro-batch's gradients, an optimizer step); 0: not measured, the device's
    # memory bandwidth stands. It depends on the size: a small model's gradients fit a CPU's last-level cache.
    param_stream_bps: float = 0.0
    # bytes of parameters per second that the job's optimizer steps (its own step, timed); 0: not measured, the
    # step is modelled as passes at param_stream_bps
    optimizer_bps: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        data = json.loads(text)
        fit = lambda d: Fit(tuple(tuple(line) for line in d["lines"]))  # noqa: E731
        return cls(data["source"], tuple(BlockCost(fit(b["fwd_s"]), fit(b["bwd_s"]), fit(b["activation_bytes"]))
                                          for b in data["blocks"]), data.get("param_stream_bps", 0.0),
                   data.get("optimizer_bps", 0.0))


def roofline_profile(graph: ModelGraph, device, dtype: str = "float32") -> Profile:
    """Estimated costs on a device preset: each block's forward is the slower of its FLOPs at the achievable
    matmul rate and its memory traffic at the memory bandwidth, plus a launch cost per op; the backward
    does twice the work of the forward (gradients of inputs and of weights)."""
    flops_per_s = device.peak_flops(dtype) * device.matmul_efficiency
    blocks = []
    for b in graph.blocks:
        launch = b.num_ops * device.op_overhead_s
        compute = [(f / flops_per_s + launch, p / flops_per_s) for f, p in b.fwd_flops.lines]
        memory = [(f / device.mem_bandwidth_bps + launch, p / device.mem_bandwidth_bps) for f, p in b.fwd_bytes.lines]
        fwd = Fit(tuple(compute + memory))
        blocks.append(BlockCost(fwd_s=fwd, bwd_s=fwd.scaled(2.0), activation_bytes=b.activation_bytes))
    return Profile(source=f"estimated for {device.name} ({dtype}, roofline)", blocks=tuple(blocks))
