"""One bad input (or fault) per run, as an adversarial user would make it: `partita run -n 2 bad_input.py CASE DIR`.

Errors are not caught: the test reads what each rank printed, and the job's exit status. A run that must succeed
checks its own numbers and exits 3 if they are wrong.
"""

import copy
import os
import pickle
import sys

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


def damage(kind: str, checkpoint: str) -> None:
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
    partita.load(model, opt if kind != "of_another_model" else None, root)


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
    else:
        raise KeyError(CASE)
    partita.shutdown()


if __name__ == "__main__":
    main()
