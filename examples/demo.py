"""partita demo: automatic partitioning and training on local CPU processes.

Run with `make demo` (4 ranks), or `partita run -n 4 examples/demo.py`.
1. The RaNNC tutorial's model (a stack of Linear(512, 512)).
2. A small GPT (causal attention, LayerNorm, GELU, tied embedding / LM head) with Adam, planned as if each
   rank had only a little memory, so that the planner has to split it into a pipeline.
Each part shows the plan (partita logs it on rank 0 when it plans), a progress bar with the loss, and the
throughput.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import partita  # noqa: E402
from models import SmallGPT, TutorialMLP, lm_loss  # noqa: E402


def say(*args) -> None:
    if partita.get_rank() == 0:
        print(*args, flush=True)


def bar(step: int, total: int, loss: float, width: int = 30) -> None:
    """One progress line every few steps (the launcher shows rank output line by line)."""
    if partita.get_rank() == 0 and (step % 5 == 0 or step in (1, total)):
        done = width * step // total
        print(f"  [{'#' * done}{'.' * (width - done)}] step {step:3d}/{total}  loss {loss:.4f}", flush=True)


def process_bytes() -> int:
    """Memory this process uses now (resident set)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train(model, optimizer, batches, steps: int) -> tuple[float, float]:
    """Train `steps` steps; return (seconds after the first step, last loss)."""
    start, loss = None, float("nan")
    for step in range(1, steps + 1):
        x, y = batches(step)
        optimizer.zero_grad()
        out = model(x, y)
        out.backward()
        optimizer.step()
        loss = out.item()
        bar(step, steps, loss)
        if step == 1:
            start = time.perf_counter()  # the first step captures, plans and warms up
    return time.perf_counter() - start, loss


def mlp_part(world: int, rank: int) -> None:
    hidden, layers, local_batch, steps = 512, 10, 64, 30
    torch.manual_seed(0)
    model = TutorialMLP(hidden, layers)
    params = sum(p.numel() for p in model.parameters())
    say(f"\n[1/2] RaNNC tutorial model: {layers} x Linear({hidden}, {hidden}), {params / 1e6:.2f} M parameters, "
        f"local batch {local_batch}, Adam")
    target_net = torch.nn.Linear(hidden, hidden)  # a fixed random linear map to learn

    def batches(step):
        g = torch.Generator().manual_seed(step * world + rank)  # each rank loads its own rows
        x = torch.randn(local_batch, hidden, generator=g)
        with torch.no_grad():
            return x, target_net(x)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss())
    x, y = batches(0)
    model(x, y).backward()  # the first call captures the graph and plans
    opt.zero_grad()
    seconds, loss = train(model, opt, batches, steps)
    say(f"  throughput: {(steps - 1) * local_batch * world / seconds:.0f} samples/s "
        f"(global batch {local_batch * world}, final loss {loss:.4f})")


def gpt_part(world: int, rank: int) -> None:
    vocab, dim, layers, context, local_batch, steps = 128, 128, 4, 64, 8, 30
    torch.manual_seed(0)
    model = SmallGPT(vocab=vocab, dim=dim, heads=4, layers=layers, context=context)
    params = sum(p.numel() for p in model.parameters())
    free = 32 * 2**20  # one stage would need more (weights, grads, 2 Adam moments, activations), two fit
    os.environ["PARTITA_MEMORY_LIMIT"] = str(process_bytes() + free)
    say(f"\n[2/2] small GPT: {layers} layers, d={dim}, tied embedding/LM head, {params / 1e6:.2f} M parameters, "
        f"local batch {local_batch} x {context} tokens, Adam; planning as if each rank had only "
        f"{free / 2**20:.0f} MiB free beyond what its process uses (PARTITA_MEMORY_LIMIT)")

    def batches(step):
        g = torch.Generator().manual_seed(1000 + step * world + rank)
        start = torch.randint(0, vocab, (local_batch, 1), generator=g)
        stride = torch.randint(1, 4, (local_batch, 1), generator=g)
        seq = (start + stride * torch.arange(context + 1)) % vocab  # learnable: arithmetic progressions
        return seq[:, :-1], seq[:, 1:]

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model = partita.parallelize(model, opt, loss_fn=lm_loss)
    x, y = batches(0)
    model(x, y).backward()
    opt.zero_grad()
    seconds, loss = train(model, opt, batches, steps)
    samples = (steps - 1) * local_batch * world
    say(f"  throughput: {samples / seconds:.0f} samples/s, {samples * context / seconds:.0f} tokens/s "
        f"(global batch {local_batch * world}, final loss {loss:.4f})")
    del os.environ["PARTITA_MEMORY_LIMIT"]


def main() -> None:
    w = partita.init()
    say(f"partita demo: {w.world_size} ranks ({w.launcher}), {w.device.type}, "
        f"backend {torch.distributed.get_backend()}")
    mlp_part(w.world_size, w.rank)
    gpt_part(w.world_size, w.rank)
    partita.shutdown()


if __name__ == "__main__":
    main()
