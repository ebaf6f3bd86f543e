"""partita on one GPU against plain PyTorch, in one table.

    PYTHONPATH=src python3 bench/gpu.py [--steps 20]      # any CUDA machine; needs only torch
    PYTHONPATH=src python3 bench/gpu.py --cpu-smoke       # the same code on the CPU with tiny models

One process, one rank, in this order:
- a GPT-2-small-shaped model (12 layers, width 768, 12 heads, vocabulary 50257, 1024 tokens, batch 8; SmallGPT
  of examples/models.py), AdamW: a step through partita / a step of plain PyTorch (goal <= 1.03), blocks of
  steps alternating between the two; the plan's estimated step / the measured one (goal within 10 %); the same
  with the device preset's estimate (`PARTITA_PROFILE=estimate`, nothing measured); the plan's predicted
  peak of tensor memory (its peak less the process's fixed overhead) / `torch.cuda.max_memory_allocated`
  over three steps run before plain PyTorch's copy and the preset's reach the GPU (the counter counts every
  tensor of the process; goal within 15 %);
- the seed's 2.5 B MLP (100 x nn.Linear(5000, 5000), 10 GB of float32 weights, 40 GB with gradients and
  Adam's two moments) built on the meta device, Adam, batch 64: does it fit one GPU through partita, and
  its samples/s / plain PyTorch's (the model moved to the GPU with .cuda()).
Block costs are measured into a fresh cache folder, so that the plan is made from this GPU's measurements.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import partita  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from models import SmallGPT, lm_loss  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """The models' shapes: the real ones on a GPU, tiny ones for --cpu-smoke."""

    vocab: int
    dim: int
    heads: int
    layers: int
    context: int
    batch: int
    mlp_width: int
    mlp_layers: int
    mlp_batch: int


GPU = Sizes(vocab=50257, dim=768, heads=12, layers=12, context=1024, batch=8, mlp_width=5000, mlp_layers=100,
            mlp_batch=64)
WIDTH = 72  # of the table's first column
SMOKE = Sizes(vocab=256, dim=32, heads=4, layers=2, context=32, batch=4, mlp_width=64, mlp_layers=4, mlp_batch=8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_fn(model, opt, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    return step


def _timed(steps: dict, count: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Median seconds per step of each, in `rounds` blocks of `count` steps taking turns."""
    for step in steps.values():
        step()  # the first call captures, plans and builds (partita), or warms up (plain)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(count):
                step()
            _sync(device)
            samples[name].append((time.perf_counter() - start) / count)
    return {name: statistics.median(s) for name, s in samples.items()}


def _tensor_peak(step, count: int, device: torch.device) -> int:
    """Most bytes of tensors held at once over `count` steps (max_memory_allocated; resident memory on a CPU
    has no such counter: 0)."""
    if device.type != "cuda":
        return 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(count):
        step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device)


def _predicted_tensor_bytes(plan) -> int:
    """The plan's peak per rank less the process's fixed overhead it adds: what its tensors take."""
    return plan.estimate.peak_memory_bytes - plan.stages[0].memory["overhead"]


def gpt(sizes: Sizes, steps: int, device: torch.device) -> list[tuple[str, str, str]]:
    torch.manual_seed(0)
    net = SmallGPT(sizes.vocab, sizes.dim, sizes.heads, sizes.layers, sizes.context)
    plain, preset = copy.deepcopy(net), copy.deepcopy(net)
    tokens = torch.randint(0, sizes.vocab, (sizes.batch, sizes.context), device=device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ours = partita.parallelize(net, opt, loss_fn=lm_loss)
    steps_of = {"partita": _step_fn(ours, opt, tokens, tokens)}
    steps_of["partita"]()  # captures, plans and builds
    # before the other two copies take GPU memory: max_memory_allocated counts every tensor of the process
    peak = _tensor_peak(steps_of["partita"], 3, device)
    plain.to(device)
    steps_of["plain"] = _step_fn(lambda x, y: lm_loss(plain(x), y), torch.optim.AdamW(plain.parameters(), lr=1e-4),
                                 tokens, tokens)
    os.environ["PARTITA_PROFILE"] = "estimate"
    try:
        preset_opt = torch.optim.AdamW(preset.parameters(), lr=1e-4)
        estimated = partita.parallelize(preset, preset_opt, loss_fn=lm_loss)
        steps_of["preset"] = _step_fn(estimated, preset_opt, tokens, tokens)
        steps_of["preset"]()  # plans from the preset now, while PARTITA_PROFILE says so
    finally:
        del os.environ["PARTITA_PROFILE"]
    rounds = 5
    measured = _timed(steps_of, max(1, steps // rounds), rounds, device)
    predicted = _predicted_tensor_bytes(ours.plan)
    return [
        ("GPT-2 small: partita step / plain PyTorch step", f"{measured['partita'] / measured['plain']:.3f}",
         f"<= 1.03 ({measured['partita'] * 1e3:.1f} ms / {measured['plain'] * 1e3:.1f} ms)"),
        ("GPT-2 small: plan's estimated step / measured", f"{ours.plan.estimate.step_s / measured['partita']:.3f}",
         f"0.90-1.10 ({ours.plan.num_stages} stage, {ours.plan.micro_batches} micro-batches)"),
        ("GPT-2 small: preset's estimate / measured (PARTITA_PROFILE=estimate)",
         f"{estimated.plan.estimate.step_s / measured['preset']:.3f}", f"({estimated.plan.estimate.profile})"),
        ("GPT-2 small: predicted / measured peak tensor memory",
         f"{predicted / peak:.3f}" if peak else "n/a on CPU",
         f"0.85-1.15 ({predicted / 2**30:.2f} GiB / {peak / 2**30:.2f} GiB)"),
    ]


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.reset_parameters()


def mlp(sizes: Sizes, steps: int, device: torch.device) -> list[tuple[str, str, str]]:
    """The seed's MLP through partita (built on meta, placed on the GPU), then plain PyTorch (.cuda())."""
    def build():
        return nn.Sequential(*[nn.Linear(sizes.mlp_width, sizes.mlp_width) for _ in range(sizes.mlp_layers)])

    x = torch.randn(sizes.mlp_batch, sizes.mlp_width, device=device)
    per_step: dict[str, float | str] = {}
    with torch.device("meta"):
        net = build()
    opt = torch.optim.Adam(net.parameters(), lr=1e-5)
    model = partita.parallelize(net, opt, loss_fn=nn.MSELoss())
    try:
        per_step["partita"] = _timed({"partita": _step_fn(model, opt, x, x)}, steps, 1, device)["partita"]
    except (torch.cuda.OutOfMemoryError, PartitaError) as e:
        per_step["partita"] = f"out of memory ({str(e).splitlines()[0][:60]})"
    del net, opt, model  # plain PyTorch's copy needs the whole GPU too
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    plain = build().to(device)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-5)
    try:
        per_step["plain"] = _timed({"plain": _step_fn(lambda a, b: nn.functional.mse_loss(plain(a), b), plain_opt, x, x)},
                                   steps, 1, device)["plain"]
    except (torch.cuda.OutOfMemoryError, PartitaError) as e:
        per_step["plain"] = f"out of memory ({str(e).splitlines()[0][:60]})"
    fits = isinstance(per_step["partita"], float)
    both = fits and isinstance(per_step["plain"], float)
    rate = {k: f"{sizes.mlp_batch / v:,.1f} samples/s" if isinstance(v, float) else v for k, v in per_step.items()}
    params = sizes.mlp_layers * sizes.mlp_width * (sizes.mlp_width + 1)
    return [
        (f"seed MLP ({params / 1e9:.2f} B params, Adam): fits one device through partita", "yes" if fits else "no",
         rate["partita"]),
        ("seed MLP: partita samples/s / plain PyTorch's", f"{per_step['plain'] / per_step['partita']:.3f}"
         if both else "n/a", f"plain: {rate['plain']}"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per model (default 20)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU: the code path, no figures")
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench/gpu.py measures partita on a GPU: this machine has no CUDA device (torch "
              f"{torch.__version__}). Run it on a CUDA machine, or with --cpu-smoke to check the code path "
              "on the CPU.", file=sys.stderr)
        return 2
    sizes = SMOKE if args.cpu_smoke else GPU
    steps = 2 if args.cpu_smoke else args.steps
    os.environ.setdefault("PARTITA_CACHE_DIR", tempfile.mkdtemp(prefix="partita-gpu-bench-"))
    os.environ.setdefault("PARTITA_LOG", "off")
    # the step clock's review may switch layouts after the first steps, inside the timed rounds: the figures are
    # those of the plan the job starts with
    os.environ.setdefault("PARTITA_SWITCH_LAYOUT", "off")
    device = partita.init().device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke: tiny models)"
    print(f"bench/gpu.py on {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(f"{'measure':<{WIDTH}}  {'value':>8}  goal / detail", flush=True)
    for section in (gpt, mlp):  # each row as soon as it is measured: a run cut short still shows what it had
        for name, value, detail in section(sizes, steps, device):
            print(f"{name:<{WIDTH}}  {value:>8}  {detail}", flush=True)
    partita.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
