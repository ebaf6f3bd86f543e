"""`partita plan MODULE:FACTORY --devices 8xA100-40GB --batch 512 --input 5000`: plan for hardware you don't have.

The model is built on the meta device (no memory), its blocks are counted (FLOPs, bytes), timed from the
device preset (a roofline), and the same search that plans real runs chooses the layout. Prints the plan;
--out writes it as JSON and, next to it, a picture of one simulated step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from partita.errors import PartitaError
from partita.plan.plan import SHARDING_LEVELS

OPTIMIZERS = {"sgd": 0.0, "sgd-momentum": 1.0, "adagrad": 1.0, "rmsprop": 1.0, "adam": 2.0, "adamw": 2.0}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a model for a cluster (no hardware needed)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="an importable module or a .py file, and a callable in it that returns the model")
    p.add_argument("--devices", required=True,
                   help="e.g. 8xA100-40GB, 1024xA100-80GB, 2x8xH100-80GB (presets: V100-32GB, A100-40GB, "
                        "A100-80GB, H100-80GB, H200-141GB, cpu)")
    p.add_argument("--batch", type=int, required=True, help="the global batch (rows of one optimizer step)")
    p.add_argument("--input", action="append", default=[], dest="inputs", metavar="SHAPE[:DTYPE]",
                   help="one sample of one positional input, in order: 5000, 3x224x224, 128:int64")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS), help="what the optimizer keeps")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the dtype the model's weights are cast to and its FLOP/s are taken for")
    p.add_argument("--stages", type=int)
    p.add_argument("--replicas", type=int)
    p.add_argument("--micro-batches", type=int)
    p.add_argument("--schedule")
    p.add_argument("--sharding", choices=SHARDING_LEVELS,
                   help="what each stage's replicas split among themselves: nothing, the optimizer's state "
                        "(ZeRO-1), + gradients (ZeRO-2), + parameters (ZeRO-3) (default: the planner's choice)")
    p.add_argument("--out", help="write the plan as JSON here (and a timeline picture next to it)")
    p.add_argument("--timeline", help="write a picture of one simulated step here (.png or .svg)")
    p.set_defaults(func=run)


def run(args) -> int:
    from partita.capture.meta import meta_graph
    from partita.cluster import parse_cluster
    from partita.graph.profile import roofline_profile
    from partita.plan import Constraints, choose_plan
    from partita.plan.choose import simulate_plan
    from partita.sim.timeline import draw_timeline

    if not args.inputs:
        print("partita plan: give at least one --input (one sample of each positional input)", file=sys.stderr)
        return 2
    try:
        cluster = parse_cluster(args.devices)
        started = time.perf_counter()
        graph, cached = meta_graph(args.factory, args.inputs, args.dtype)
        counted = time.perf_counter()
        profile = roofline_profile(graph, cluster.device, args.dtype)
        factor = OPTIMIZERS[args.optimizer]
        plan = choose_plan(graph, profile, cluster, global_batch=args.batch, optimizer_factor=factor,
                           constraints=Constraints(stages=args.stages, replicas=args.replicas,
                                                   micro_batches=args.micro_batches, schedule=args.schedule,
                                                   sharding=args.sharding))
        planned = time.perf_counter()
    except PartitaError as e:
        print(f"partita plan: {e}", file=sys.stderr)
        return 1
    print(plan.explain())
    print(f"model: {graph.num_blocks} blocks, {sum(graph.param_bytes.values()) / 2**30:.2f} GiB of parameters; "
          f"{'graph from the cache' if cached else 'built and counted on the meta device'} in "
          f"{counted - started:.2f} s, searched in {planned - counted:.2f} s")
    timeline = args.timeline or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    if timeline:
        draw_timeline(simulate_plan(plan, graph, profile, cluster, factor), timeline)
        print(f"timeline written to {timeline}")
    return 0
