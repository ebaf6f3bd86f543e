"""Sharded checkpoint save and load times for a ~100 MB model on 4 ranks.

    python bench/checkpoint_time.py [--ranks 4] [--repeats 3]

The model is the RaNNC tutorial's MLP widened to 24 x Linear(1024, 1024) (100.7 MB of fp32 weights), with
Adam after one step (another 201 MB of state). Two layouts: 2 stages x 2 replicas (each rank writes its
share of its stage's tensors) and one data-parallel stage (identical copies, DCP spreads the writing). The
reference is what a script without partita.save does: gather the model and optimizer onto rank 0 and
torch.save them. Medians of --repeats runs; the page cache is warm, so loads read memory, not the disk.

The checksums' share: the XXH3 work a save does (each rank its own data files, rank 0 also `.metadata`) and a
load does (each rank its share of the files), timed alone on the saved checkpoint like the save and the load,
against the median save and load (which include it). The goal is at most 10% of the save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"2 stages x 2 replicas": {"stages": 2, "replicas": 2, "schedule": "1F1B", "micro_batches": 4},
           "1 stage x 4 replicas (DDP)": {"stages": 1, "micro_batches": 1}}


def _timed(step) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def worker(out: str, workdir: str, layout: str, repeats: int) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import partita
    from models import TutorialMLP
    from partita.checkpoint.checksums import checksums_of, share, verify
    from partita.checkpoint.manifest import read_manifest

    os.environ["PARTITA_PROFILE"] = "estimate"  # the plan is fixed; measuring would only cost time
    w = partita.init()
    torch.manual_seed(0)
    net = TutorialMLP(1024, 24)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    model = partita.parallelize(net, opt, loss_fn=torch.nn.MSELoss(), **LAYOUTS[layout])
    x = torch.randn(8, 1024)
    model(x, x).backward()
    opt.step()
    root = os.path.join(workdir, "ckpt")
    save = [_timed(lambda: partita.save(model, opt, root, step=1, keep=1)) for _ in range(repeats)]
    load = [_timed(lambda: partita.load(model, opt, root)) for _ in range(repeats)]
    directory = Path(partita.latest_checkpoint(root))
    manifest = read_manifest(directory)
    # DCP names the data files of rank r __<r>_<n>.distcp; rank 0 writes .metadata
    written = [n for n in manifest.checksums if n.startswith(f"__{w.rank}_") or (n == ".metadata" and w.rank == 0)]
    checksum_save = [_timed(lambda: checksums_of(directory, written)) for _ in range(repeats)]
    checksum_load = [_timed(lambda: verify(directory, manifest, share(manifest.checksums, w.rank, w.world_size)))
                     for _ in range(repeats)]
    model_only = [_timed(lambda: partita.save(model, None, os.path.join(workdir, "weights"), step=1, keep=1))
                  for _ in range(repeats)]
    reference_file = os.path.join(workdir, "rank0.pt")

    def gather_and_torch_save():
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        if w.rank == 0:
            torch.save(state, reference_file)

    reference = [_timed(gather_and_torch_save) for _ in range(repeats)]
    if w.rank == 0:
        size = sum(f.stat().st_size for f in directory.iterdir())
        Path(out).write_text(json.dumps({"save": save, "load": load, "model_only": model_only,
                                         "reference": reference, "checksum_save": checksum_save,
                                         "checksum_load": checksum_load,
                                         "bytes": size,
                                         "plan": model.plan.explain().splitlines()[0]}))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker, args.repeats)
    for layout in LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", str(args.ranks), "--quiet",
                   "--log-dir", os.path.join(tmp, "logs"), __file__, "--worker", out, tmp, layout,
                   "--repeats", str(args.repeats)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(Path(out).read_text())
            shutil.rmtree(os.path.join(tmp, "ckpt"), ignore_errors=True)
        median = {k: statistics.median(r[k]) for k in ("save", "load", "model_only", "reference", "checksum_save",
                                                        "checksum_load")}
        mb = r["bytes"] / 1e6
        print(f"checkpoint_time: {r['plan']}")
        print(f"checkpoint_time: {args.ranks} ranks, {layout}, model + Adam {mb:.0f} MB: save {median['save']:.2f} s "
              f"({mb / median['save']:.0f} MB/s), load {median['load']:.2f} s ({mb / median['load']:.0f} MB/s); "
              f"weights only save {median['model_only']:.2f} s; gather to rank 0 + torch.save "
              f"{median['reference']:.2f} s")
        print(f"checkpoint_time: checksums (XXH3-64): {median['checksum_save']:.3f} s of the save "
              f"({100 * median['checksum_save'] / median['save']:.1f}%), {median['checksum_load']:.3f} s of the load "
              f"({100 * median['checksum_load'] / median['load']:.1f}%)")


if __name__ == "__main__":
    main()
