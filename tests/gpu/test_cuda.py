"""partita on CUDA: one rank trains as plain PyTorch does (fp32 to 1e-5, bf16 to 5e-3, fp16 with torch's loss
scaling to 2^-10), measuring runs on the
GPU with CUDA events, a node with more ranks than GPUs stops with partita's error, and a model bigger than one
GPU trains split over the node's GPUs.

Runs only where CUDA is, with nothing but torch, numpy and pytest: `PYTHONPATH=src python3 -m pytest tests/gpu`.
"""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine", allow_module_level=True)

import partita  # noqa: E402
from partita.capture.export import capture  # noqa: E402
from partita.capture.model_graph import model_graph  # noqa: E402
from partita.cluster import DEVICES  # noqa: E402
from partita.profile import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RANKS = Path(__file__).with_name("ranks.py")
STEPS = 3
BF16_TOLERANCE = 5e-3  # |loss - plain PyTorch's loss| under the same autocast: bf16 has 8 bits of mantissa
FP16_TOLERANCE = 2**-10  # the same for fp16 (11 bits): twice its unit roundoff
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Measurements of each test go to a folder of its own, so that every test measures on the GPU."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(autouse=True, scope="module")
def leave_the_job():
    """The tests here join a job of one rank (partita.init); it is left when they are done."""
    yield
    partita.shutdown()


def test_a_step_on_the_gpu_is_timed_by_the_gpu():
    """The step clock's marks: the host returns from queued matrix products long before the GPU ran them;
    the time between two marks is the GPU's."""
    from partita.runtime.step_clock import mark, seconds_between

    device = partita.init().device
    a = torch.tanh(torch.randn(8192, 8192, device=device) @ torch.randn(8192, 8192, device=device))  # warm-up
    torch.cuda.synchronize(device)
    start = mark(device)
    for _ in range(20):
        a = torch.tanh(a @ a)  # about 22 TFLOP in float32: tens of milliseconds on any GPU
    end = mark(device)
    host_s = end[0] - start[0]
    measured = seconds_between(start, end)
    torch.cuda.synchronize(device)
    waited = time.perf_counter() - start[0]
    assert host_s < 0.5 * waited, (host_s, waited)
    assert 0.8 * waited <= measured <= waited + 1e-3, (measured, waited)  # two clocks: a millisecond's slack


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))


def _batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 256, generator=g).to(device), torch.randn(32, 64, generator=g).to(device))
            for _ in range(STEPS)]


def _train(model, opt, batches, precision: str | None = None) -> list[float]:
    """Losses of training `model` (model(x, y) is the loss) or, given a precision, of one process under autocast
    (float16 with torch's loss scaling, from partita's starting scale)."""
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, enabled=precision == "fp16")
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if precision is None:
            loss = model(x, y)
        else:
            with torch.autocast("cuda", dtype=LOW[precision]):
                loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()  # disabled: the loss itself
        scaler.step(opt)  # disabled: opt.step()
        scaler.update()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-5), ("bf16", BF16_TOLERANCE), ("fp16", FP16_TOLERANCE)])
def test_one_rank_trains_as_plain_pytorch(precision, tolerance):
    """The model arrives on the CPU and partita places it on the GPU; inputs are on the GPU."""
    device = partita.init().device
    assert device.type == "cuda"
    net = _net()
    reference = copy.deepcopy(net).to(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = partita.parallelize(net, opt, loss_fn=nn.MSELoss(), precision=precision)
    batches = _batches(device)
    losses = _train(model, opt, batches)
    expected = (_train(lambda x, y: nn.functional.mse_loss(reference(x), y), ref_opt, batches) if precision == "fp32"
                else _train(reference, ref_opt, batches, precision))
    assert losses == pytest.approx(expected, rel=tolerance, abs=tolerance)
    assert {p.device for p in net.parameters()} == {device}
    for name, p in reference.named_parameters():
        assert torch.allclose(model.get_param(name), p.detach(), rtol=tolerance * 10, atol=tolerance), name


def test_measuring_runs_on_the_gpu():
    """Block times between CUDA events: a matrix product no faster than the GPU's datasheet allows (a clock
    around asynchronous kernels would time their launch, far faster). The fixed overhead leaves out what torch's
    allocator holds (what measuring left cached)."""
    device = partita.init().device
    width, rows = 4096, 2048
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    cap = capture(net, (torch.zeros(rows, width, device=device),), {})
    graph = model_graph(cap)
    memory = torch.cuda.mem_get_info(device)[1]
    profile, cluster = measure(cap, graph, rows, device, 1, memory, partita.parallelize, show_progress=False)
    assert cluster.device.name != "cpu" and "measured on" in profile.source
    flops = 2 * rows * width * width
    peak = max(DEVICES[cluster.device.name].flops.values())
    forwards = [cost.fwd_s.at(rows) for cost in profile.blocks]
    assert all(0 < f for f in forwards)
    assert sum(forwards) >= 2 * flops / (1.5 * peak), (forwards, peak)
    assert 0 < cluster.overhead_bytes < 4 * 2**30, cluster.overhead_bytes
    assert torch.cuda.memory_reserved(device) > 0  # measuring's blocks, cached, and not counted above


def test_host_tensors_reach_the_gpu_through_pinned_memory(monkeypatch, tmp_path):
    """Copies run asynchronously from pinned memory and land whole, also when the pinned memory in flight is
    waited for along the way; a model's weights read from disk reach the GPU the same way."""
    from partita.runtime import host_copies
    from partita.runtime.route import TensorSpec, pack, unpack

    monkeypatch.setattr(host_copies, "IN_FLIGHT_BYTES", 2**20)
    device = partita.init().device
    copies = host_copies.HostCopies(device)
    sources = [torch.randn(512, 256, generator=torch.Generator().manual_seed(i)) for i in range(12)]  # 512 KiB each
    assert all(copies.pinned(t) for t in sources)
    landed = [copies.to(t, torch.bfloat16 if i % 2 else None) for i, t in enumerate(sources)]
    assert 0 < copies.in_flight_bytes <= 2**20 + sources[0].numel() * 4
    copies.finish()
    assert copies.in_flight_bytes == 0
    for i, (t, d) in enumerate(zip(sources, landed)):
        assert d.device.type == "cuda" and torch.equal(d.cpu(), t.to(d.dtype)), i
    packed = pack(sources[:3], device)  # how rank 0 sends a CPU model's weights
    assert packed.device.type == "cuda"
    views = unpack(packed, [TensorSpec.of(t) for t in sources[:3]])
    assert all(torch.equal(v.cpu(), t) for v, t in zip(views, sources[:3]))
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(-2)  # values the model built below does not start from
    torch.save(net.state_dict(), tmp_path / "w.pt")
    model = partita.parallelize(_net(), loss_fn=nn.MSELoss(), weights=tmp_path / "w.pt")
    x, y = _batches(device)[0]
    model(x, y)
    for name, p in net.named_parameters():
        assert torch.equal(model.get_param(name).cpu(), p.detach()), name


def _run(ranks: int, mode: str, visible: str | None, timeout: int, where: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PARTITA_TIMEOUT_S": "60"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run([sys.executable, "-m", "partita.cli.main", "run", "-n", str(ranks), str(RANKS), mode],
                          cwd=where, env=env, capture_output=True, text=True, timeout=timeout)


def test_more_ranks_than_gpus_is_partitas_error_on_every_rank(tmp_path):
    """Every rank stops with partita's error, or was stopped by the launcher after the first rank did (torch's
    agent ends the others as soon as one fails): none gets CUDA's or NCCL's."""
    job = _run(2, "init", "0", timeout=120, where=tmp_path)
    out = job.stdout + job.stderr
    error = "LaunchError: this node runs 2 ranks but only 1 GPU is visible (CUDA_VISIBLE_DEVICES '0')"
    assert job.returncode != 0, out
    assert error in out and "invalid device ordinal" not in out, out
    logs = sorted(tmp_path.glob("partita-logs/*/attempt_0/*/stderr.log"))
    assert len(logs) == 2, logs
    for log in logs:
        text = log.read_text()
        assert error in text or "Error" not in text, text


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs 2 GPUs or more to split a model bigger than one; {torch.cuda.device_count()} here")
def test_a_model_bigger_than_one_gpu_trains_split_over_stages(tmp_path):
    gpus = torch.cuda.device_count()
    job = _run(gpus, "bigger", None, timeout=540, where=tmp_path)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-5000:]
    results = [json.loads(line.split("RESULT", 1)[1]) for line in out.splitlines() if "RESULT" in line]
    plan = next(r for r in results if "stages" in r)
    assert plan["stages"] > 1
    peaks = [r["peak_bytes"] for r in results if "peak_bytes" in r]
    assert len(peaks) == gpus and max(peaks) < plan["total_bytes"]


def test_the_jobs_group_sums_cpu_and_gpu_tensors():
    """The gradients go through NCCL, partita's own small collectives (the ranks' agreement on each call) through
    gloo on CPU tensors: an NCCL-only group raised "No backend type associated with device type cpu" at the first
    call of a job of 2 GPUs or more."""
    partita.init()
    for device in ("cpu", "cuda"):
        t = torch.ones(2, device=device)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
