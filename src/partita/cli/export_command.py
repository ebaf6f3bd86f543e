"""`partita export CKPT OUT.pt`: a checkpoint's model weights as one plain state-dict file.

CKPT is a directory given to partita.save (its latest checkpoint is exported) or one of its step-*
directories, written by any number of ranks. OUT.pt loads without partita:
model.load_state_dict(torch.load("OUT.pt", weights_only=True)). Runs in one process.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's model weights as one plain state-dict file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint root or step-* directory")
    p.add_argument("out", metavar="OUT.pt", help="the file to write")
    p.set_defaults(func=run)


def run(args) -> int:
    from partita.checkpoint import export

    done = export(args.checkpoint, args.out)
    print(f"wrote {done.path}: {done.tensors} tensors, {done.bytes / 2**20:.1f} MiB, step {done.step} "
          f"from {done.checkpoint}")
    return 0
