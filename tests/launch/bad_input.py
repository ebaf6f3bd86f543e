"""One bad input (or fault) per run, as an adversarial user would make it: `partita run -n 2 bad_input.py CASE DIR`.

Errors are not caught: the test reads what each rank printed, and the job's exit status. A run that must succeed
checks its own numbers and exits 3 if they are wrong.
"""

import copy
import json
import os
import pickle
import subprocess
import sys
import time

import torch
from torch import nn

import partita

CASE, DIR = sys.argv[1], sys.argv[2]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)


class Uncapturable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value: torch.export cannot capture it
            return self.fc(x)
        return -self.fc(x)


class FailsOnRank1(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = mlp()

    def forward(self, x):
        if partita.get_rank() == 1:
            raise ValueError("a record on rank 1 is corrupt")
        return self.inner(x)


class RunsShell:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class RedrawsChildren(nn.Module):
    """Draws its layers' weights again after building them (as nanoGPT does), and keeps no argument under its name:
    built on the meta device, partita cannot replay that."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def forward(self, x):
        return self.body(x)


def craft_checksums(kind: str, checkpoint: str) -> None:
    """A manifest whose checksums name a file that never ends (/dev/zero, a FIFO), or that has none at all."""
    path = os.path.join(checkpoint, "manifest.json")
    manifest = json.load(open(path))
    if kind == "checksums_removed":
        del manifest["checksums"]
    elif kind == "checksums_dev_zero":
        manifest["checksums"]["/dev/zero"] = "xxh3_64:0000000000000000"
    else:
        os.mkfifo(os.path.join(checkpoint, "queue"))
        manifest["checksums"]["queue"] = "xxh3_64:0000000000000000"
    json.dump(manifest, open(path, "w"))


def damage(kind: str, checkpoint: str) -> None:
    if kind.startswith("checksums_"):
        return craft_checksums(kind, checkpoint)
    data = os.path.join(checkpoint, "__0_0.distcp")
    content = bytearray(open(data, "rb").read())
    if kind == "value_changed":  # one byte in the middle: the file keeps its length
        content[len(content) // 2] ^= 0xFF
    elif kind == "truncated":
        content = content[:len(content) // 3]
    if kind == "crafted_metadata":
        with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
            pickle.dump(RunsShell(f"touch {os.path.join(DIR, 'pwned')}"), f, protocol=4)
    else:
        open(data, "wb").write(bytes(content))


def load_damaged_checkpoint(kind: str, rank: int) -> None:
    """Two checkpoints saved by both ranks; rank 0 damages the newer one (or the loader is another model), then
    every rank loads."""
    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model = partita.parallelize(net, opt, loss_fn=nn.MSELoss(), stages=1)
    root = os.path.join(DIR, "ckpt")
    for step in (1, 2):
        model(*batch(8, seed=step)).backward()
        opt.step()
        partita.save(model, opt, root, step=step)
    if rank == 0 and kind != "of_another_model":
        damage(kind, os.path.join(root, "step-000002"))
    partita.barrier()
    if kind == "of_another_model":
        other = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
        model = partita.parallelize(other, torch.optim.Adam(other.parameters()), loss_fn=nn.MSELoss(), stages=1)
        model(*batch(8))
    # a crafted manifest makes its checkpoint unreadable, and the root's latest the one before: load it by name
    target = os.path.join(root, "step-000002") if kind.startswith("checksums_") else root
    partita.load(model, opt if kind != "of_another_model" else None, target)


class DetachedBranch(nn.Module):
    """A branch whose parameters get no gradient: its value reaches the output only detached."""

    def __init__(self):
        super().__init__()
        self.inner = mlp()
        self.aside = nn.Linear(8, 1)

    def forward(self, x):
        return self.inner(x) + self.aside(x).detach()


def train_on_rows(rank: int, mine: slice, net: nn.Module, steps: int = 1, **options) -> None:
    """Train `net` on rows `mine` of a batch of 10 and compare loss and gradients with one process's on all 10
    rows (SGD; exit 3 if they differ)."""
    ref = copy.deepcopy(net)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    model = partita.parallelize(net, opt, loss_fn=nn.MSELoss(), **options)
    ok = True
    for step in range(steps):
        x, y = batch(10, seed=step)
        loss = model(x[mine], y[mine])
        loss.backward()
        want = nn.MSELoss()(ref(x), y)
        want.backward()
        grads = [model.get_param_grad(n) for n, _ in ref.named_parameters()]
        ok = ok and torch.allclose(loss, want, rtol=1e-5) and all(
            (g is None and p.grad is None) or torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7)
            for g, p in zip(grads, ref.parameters()))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    print(f"rank {rank}: loss {loss.item():.6f}, global batch's {want.item():.6f}, {'equal' if ok else 'WRONG'}")
    if not ok:
        sys.exit(3)


def hold_checkpoint_dir(root: str) -> subprocess.Popen:
    """Another job (one process, its own, joined as partita.init() joins it) that saved into `root` and goes on
    running until DIR/release exists or this process ends."""
    keep = ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PARTITA_CACHE_DIR", "PARTITA_PROFILE", "HOME")
    code = ("import os, sys, time, torch, partita\n"
            "partita.init()\n"
            "net = torch.nn.Linear(8, 1)\n"
            "partita.save(net, torch.optim.SGD(net.parameters(), lr=0.5), sys.argv[1], step=5)\n"
            "while not os.path.exists(sys.argv[2]) and os.getppid() == int(sys.argv[3]):\n"
            "    time.sleep(0.1)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, root, os.path.join(DIR, "release"), str(os.getpid())],
                              env={k: v for k, v in os.environ.items() if k in keep})
    while not os.path.exists(os.path.join(root, "latest")):
        if holder.poll() is not None:
            raise RuntimeError(f"the job holding {root} ended with {holder.returncode}")
        time.sleep(0.1)
    return holder


def main() -> None:
    partita.init()
    rank = partita.get_rank()
    mse = nn.MSELoss()
    if CASE in ("uneven_rows_data_parallel", "uneven_rows_pipeline"):
        net = mlp()
        ref = copy.deepcopy(net)
        model = partita.parallelize(net, loss_fn=mse, stages=1 if "data_parallel" in CASE else 2)
        x, y = batch(10)
        mine = slice(0, 4) if rank == 0 else slice(4, 10)
        loss = model(x[mine], y[mine])
        loss.backward()
        want = mse(ref(x), y)
        want.backward()
        grads = [model.get_param_grad(n) for n, _ in ref.named_parameters()]
        ok = torch.allclose(loss, want, rtol=1e-5) and all(
            torch.allclose(g, p.grad, rtol=1e-5, atol=1e-7) for g, p in zip(grads, ref.parameters()))
        print(f"rank {rank}: loss {loss.item():.6f}, global batch's {want.item():.6f}, {'equal' if ok else 'WRONG'}")
        if not ok:
            sys.exit(3)
    elif CASE == "uneven_steps":
        model = partita.parallelize(mlp(), loss_fn=mse, stages=1)
        for _ in range(3 if rank == 0 else 2):
            model(*batch(8)).backward()
    elif CASE == "micro_batches_do_not_split":
        model = partita.parallelize(mlp(), loss_fn=mse, micro_batches=4)
        model(*batch(3))
    elif CASE == "elastic_global_batch_does_not_split":
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        partita.elastic(partita.parallelize(net, opt, loss_fn=mse), opt, os.path.join(DIR, "ckpt"), global_batch=9)
    elif CASE == "elastic_loop_left_early":  # rank 1 leaves the loop (a `break` on its own data), rank 0 goes on
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model = partita.parallelize(net, opt, loss_fn=mse)
        job = partita.elastic(model, opt, os.path.join(DIR, "ckpt"))
        for step in job.steps(4):
            model(*batch(8)).backward()
            opt.step()
            opt.zero_grad()
            if rank == 1 and step == 1:
                break
    elif CASE == "float64_input":
        model = partita.parallelize(mlp(), loss_fn=mse, stages=2)
        model(*batch(8)).backward()
        x, y = batch(8)
        model(x.double(), y)
    elif CASE == "capture_fails_on_one_rank":
        model = partita.parallelize(FailsOnRank1(), loss_fn=mse)
        model(*batch(8))
    elif CASE == "uncapturable":
        model = partita.parallelize(Uncapturable(), loss_fn=mse)
        model(*batch(8))
    elif CASE in ("corrupt_plan", "plan_of_another_model"):
        path = os.path.join(DIR, "plan.json")
        if CASE == "plan_of_another_model":
            other = partita.parallelize(nn.Sequential(nn.Linear(8, 1)), loss_fn=mse, stages=1)
            other(*batch(8))
        if rank == 0:
            if CASE == "corrupt_plan":
                with open(path, "w") as f:
                    f.write('{"version": 1, "stages": [')
            else:
                other.plan.save(path)
        partita.barrier()
        model = partita.parallelize(mlp(), loss_fn=mse, plan=path)
        model(*batch(8))
    elif CASE.startswith("checkpoint_"):
        load_damaged_checkpoint(CASE[len("checkpoint_"):], rank)
    elif CASE == "train":  # a short job that must end well (two of them run at once)
        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model = partita.parallelize(net, opt, loss_fn=mse)
        for step in range(3):
            model(*batch(8, seed=step)).backward()
            opt.step()
            opt.zero_grad()
    elif CASE == "meta_parent_redraws_children":  # issue 30, 12: partita cannot replay what its __init__ draws
        with torch.device("meta"):
            net = RedrawsChildren(16)
        partita.parallelize(net, loss_fn=mse, stages=1)(*batch(8)).backward()
    elif CASE == "weights_not_finite":  # issue 30, 12: a safetensors file carries no checksums
        from safetensors.torch import save_file

        path = os.path.join(DIR, "w.safetensors")
        if rank == 0:
            state = {n: t.clone() for n, t in mlp().state_dict().items()}
            state["2.weight"][0, 0] = float("nan")
            save_file(state, path)
        partita.barrier()
        partita.parallelize(mlp(), loss_fn=mse, stages=1, weights=path)(*batch(8))
    elif CASE == "zero_rows_data_parallel":  # rank 0's last batch is empty
        train_on_rows(rank, slice(0, 0) if rank == 0 else slice(0, 10), mlp(), steps=2, stages=1)
    elif CASE == "live_job_checkpoint_dir":
        root = os.path.join(DIR, "ckpt")
        holder = hold_checkpoint_dir(root) if rank == 0 else None
        try:
            partita.barrier()
            net = mlp()
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            partita.elastic(partita.parallelize(net, opt, loss_fn=mse), opt, root)
        finally:  # the holder ends by itself: waiting for it here, rank 0 could be stopped before saying why
            if holder is not None:
                open(os.path.join(DIR, "release"), "w").close()
    elif CASE in ("module_state_dict_two_stages", "module_state_dict_zero3"):  # DDP's saving idiom
        options = {"stages": 2} if CASE.endswith("two_stages") else {"stages": 1, "sharding": "parameters"}
        model = partita.parallelize(mlp(), loss_fn=mse, **options)
        model(*batch(8)).backward()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(DIR, "model.pt"))
        partita.barrier()
    elif CASE == "unused_parameter_data_parallel":
        train_on_rows(rank, slice(0, 5) if rank == 0 else slice(5, 10), DetachedBranch(), steps=2, stages=1)
    elif CASE == "bad_safetensors_header":
        path = os.path.join(DIR, "weights.safetensors")
        if rank == 0:
            with open(path, "wb") as f:
                f.write((40).to_bytes(8, "little") + b'{"fc.weight": {"dtype": "F32", "shape": [')
        partita.barrier()
        model = partita.parallelize(mlp(), loss_fn=mse, weights=path)
        model(*batch(8))
    elif CASE in ("uneven_rows_zero3", "uneven_rows_micro_batches"):
        options = {"sharding": "parameters"} if CASE.endswith("zero3") else {"micro_batches": 2}
        model = partita.parallelize(mlp(), loss_fn=mse, stages=1, **options)
        x, y = batch(10)
        mine = slice(0, 4) if rank == 0 else slice(4, 10)
        model(x[mine], y[mine])
    elif CASE == "zero_rows_first_batch":
        model = partita.parallelize(mlp(), loss_fn=mse)
        model(*batch(0))
    elif CASE == "optimizer_of_another_model":
        other = mlp()
        partita.parallelize(mlp(), torch.optim.SGD(other.parameters(), lr=0.1), loss_fn=mse)
    elif CASE == "shared_checkpoint_dir":  # two jobs at once, on one directory: each notes its end in DIR
        try:
            net = mlp()
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            model = partita.parallelize(net, opt, loss_fn=mse)
            job = partita.elastic(model, opt, os.path.join(DIR, "ckpt"), save_every=1)
            for step in job.steps(3):
                model(*batch(8, seed=step)).backward()
                opt.step()
                opt.zero_grad()
            while rank == 0 and len(os.listdir(os.path.join(DIR, "ended"))) < 1:
                time.sleep(0.1)  # the other job ends first: it had its chance at the directory while this one ran
        finally:
            if rank == 0:
                open(os.path.join(DIR, "ended", str(os.getpid())), "w").close()
    else:
        raise KeyError(CASE)
    partita.shutdown()


if __name__ == "__main__":
    main()
