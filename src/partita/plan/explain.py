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


_WEIGHTS = ("params", "grads", "optimizer")
_STAGE_KINDS = _WEIGHTS + ("activations", "buffers")


def _holders(plan) -> dict[tuple[int, ...], list[int]]:
    """The stages each group of ranks holds (several for looped and V-shaped schedules), by their ranks."""
    held: dict[tuple[int, ...], list[int]] = {}
    for s in plan.stages:
        held.setdefault(tuple(s.ranks), []).append(s.index)
    return held


def rank_memory(plan) -> list[tuple[int, int, int, int | None, int] | None]:
    """Per stage, the bytes its row shows: (params+grads+optim, activations, buffers, process, memory/rank), or
    None when the plan has no memory estimate. `process` is what the process uses besides its stages, once per
    rank: it is on the first row of the stages a rank holds and None on the others, so that the rows of a rank's
    stages add up to its memory/rank."""
    held = _holders(plan)
    out: list = []
    for s in plan.stages:
        m = s.memory
        if not m:
            out.append(None)
            continue
        together = held[tuple(s.ranks)]
        if s.index != together[0]:
            process = None
        elif "overhead" in m:
            process = int(m["overhead"])
        else:  # a plan saved before the overhead was recorded: what the rank's total leaves over
            process = s.memory_bytes - sum(int(plan.stages[t].memory.get(k, 0)) for t in together
                                           for k in _STAGE_KINDS)
        out.append((sum(int(m.get(k, 0)) for k in _WEIGHTS), int(m.get("activations", 0)),
                    int(m.get("buffers", 0)), process, int(s.memory_bytes)))
    return out


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
            f"world {plan.world_size}{'' if plan.precision == 'fp32' else ', computing in ' + plan.precision}")
    rows = [("stage", "blocks", "first .. last node", "ranks", "params", "fwd/mb", "bwd/mb", "recompute", "sharding",
             "params+grads+optim", "activations", "buffers", "process", "memory/rank", "send/mb", "all-reduce")]
    memory, held = rank_memory(plan), _holders(plan)
    for s, mem in zip(plan.stages, memory):
        if mem is None:
            columns = ("-", "-", "-", "-", size(s.memory_bytes))
        else:
            weights, acts, buffers, process, total = mem
            columns = (size(weights), size(acts), size(buffers),
                       size(process) if process is not None else f"in stage {held[tuple(s.ranks)][0]}", size(total))
        rows.append((
            str(s.index), f"{s.blocks[0]}-{s.blocks[1] - 1}", f"{s.first_node} .. {s.last_node}",
            ",".join(map(str, s.ranks)), f"{s.num_params} ({size(s.param_bytes)})",
            seconds(s.fwd_s), seconds(s.bwd_s), "yes" if s.recompute else "no", s.sharding,
            *columns, seconds(s.send_s), seconds(s.allreduce_s),
        ))
    lines = [head] + _table(rows)
    if any(m is not None for m in memory):
        lines.append("memory/rank = params+grads+optim + activations + buffers + process: what the process uses "
                     "besides its stages (libraries, device context, the inputs); activations: kept for the "
                     "backward (with what a stage sharded by FSDP gathers whole), or what the optimizer's step "
                     "allocates where that is more")
        for ranks, indices in held.items():
            if len(indices) > 1:
                names = ", ".join(map(str, indices[:-1])) + f" and {indices[-1]}"
                lines.append(f"ranks {','.join(map(str, ranks))} hold stages {names}: memory/rank is the sum of "
                             f"their rows, with the process counted once (stage {indices[0]})")
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
