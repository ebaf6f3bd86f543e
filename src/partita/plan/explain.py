"""A plan as a table, in the spirit of RaNNC's partitioning log: one row per stage, then the summary."""

from __future__ import annotations


def size(n: float) -> str:
    """Bytes for people: '31.3 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def seconds(s: float) -> str:
    """'3.21 ms', '1.52 s', '85 us'."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def explain(plan) -> str:
    """The plan as a table: one row per stage, then the estimate and why it was chosen.

    >>> from partita.plan.plan import Plan, StagePlan
    >>> p = Plan(world_size=2, micro_batches=1, schedule="GPipe",
    ...          stages=(StagePlan(0, (0, 3), "linear", "relu", (0, 1)),))
    >>> print(explain(p).splitlines()[0])
    plan: 1 stage x 2 replicas, GPipe, 1 micro-batch, world 2
    """
    head = (f"plan: {plan.num_stages} stage{'s' if plan.num_stages > 1 else ''} x "
            f"{plan.num_replicas} replica{'s' if plan.num_replicas > 1 else ''}, {plan.schedule}, "
            f"{plan.micro_batches} micro-batch{'es' if plan.micro_batches > 1 else ''}, "
            f"world {plan.world_size}")
    rows = [("stage", "blocks", "first .. last node", "ranks", "params", "fwd/mb", "bwd/mb", "recompute",
             "params+grads+optim", "activations", "buffers", "memory/rank", "send/mb", "all-reduce")]
    for s in plan.stages:
        m = s.memory
        rows.append((
            str(s.index), f"{s.blocks[0]}-{s.blocks[1] - 1}", f"{s.first_node} .. {s.last_node}",
            ",".join(map(str, s.ranks)), f"{s.num_params} ({size(s.param_bytes)})",
            seconds(s.fwd_s), seconds(s.bwd_s), "yes" if s.recompute else "no",
            size(m.get("params", 0) + m.get("grads", 0) + m.get("optimizer", 0)) if m else "-",
            size(m.get("activations", 0)) if m else "-", size(m.get("buffers", 0)) if m else "-",
            size(s.memory_bytes), seconds(s.send_s), seconds(s.allreduce_s),
        ))
    lines = [head] + _table(rows)
    e = plan.estimate
    if e is not None:
        lines.append(
            f"estimate: {seconds(e.step_s)} per step (pipeline {seconds(e.pipeline_s)}, then gradient all-reduce "
            f"and optimizer {seconds(e.step_s - e.pipeline_s)}), bubble {100 * e.bubble_fraction:.1f}%, "
            f"{e.samples_per_s:,.0f} samples/s at global batch {e.global_batch}, peak memory "
            f"{size(e.peak_memory_bytes)} per rank of {size(e.memory_per_rank_bytes)}")
        lines.append(f"  on {e.cluster}; block costs {e.profile}; searched in {seconds(e.search_s)}")
    lines += [f"  - {r}" for r in plan.reasons]
    return "\n".join(lines)
