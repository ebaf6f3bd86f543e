"""A plan as a table, in the spirit of RaNNC's partitioning log."""

from __future__ import annotations

from partita.plan.plan import Plan


def size(n: float) -> str:
    """Bytes for people: '31.3 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or unit == "P":
            return f"{n:.1f} {unit}FLOP"
        n /= 1000
    return f"{n:.1f} PFLOP"


def explain(plan: Plan) -> str:
    """The plan as a table: one row per stage, then why it was chosen.

    >>> from partita.plan.plan import Plan, StagePlan
    >>> p = Plan(world_size=2, num_microbatches=1, schedule="GPipe",
    ...          stages=(StagePlan(0, (0, 3), "linear", "relu", (0, 1)),))
    >>> print(explain(p).splitlines()[0])
    partita plan: 1 stage x 2 replicas, GPipe, 1 micro-batch, world 2
    """
    head = (f"partita plan: {plan.num_stages} stage{'s' if plan.num_stages > 1 else ''} x "
            f"{plan.num_replicas} replica{'s' if plan.num_replicas > 1 else ''}, {plan.schedule}, "
            f"{plan.num_microbatches} micro-batch{'es' if plan.num_microbatches > 1 else ''}, "
            f"world {plan.world_size}")
    rows = [("stage", "blocks", "first .. last node", "ranks", "params", "param size", "fwd/sample", "est. memory")]
    for s in plan.stages:
        rows.append((
            str(s.index), f"{s.blocks[0]}-{s.blocks[1] - 1}", f"{s.first_node} .. {s.last_node}",
            ",".join(map(str, s.ranks)), str(s.num_params), size(s.param_bytes),
            _flops(s.fwd_flops_per_sample), size(s.memory_bytes),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"  - {r}" for r in plan.reasons]
    return "\n".join(lines)
