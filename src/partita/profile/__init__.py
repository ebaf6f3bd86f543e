"""Measuring on the real device: block costs and links, cached on disk.

`measure(cap, graph, local_batch)` is collective (every rank calls it) and returns, on rank 0, the Profile
and the Cluster the planner needs; other ranks get (None, None).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from partita.cluster import DEVICES, Cluster, DeviceSpec, Link, RuntimeOverheads
from partita.graph import ModelGraph, Profile
from partita import cache
from partita.profile.block_times import measure_blocks, profile_rows, stream_bandwidth, warm_up
from partita.plan.explain import seconds, size
from partita.profile.optimizer_rate import OptimizerKind, optimizer_rate
from partita.profile.comm import SIZES_BYTES, measure_allgather, measure_allreduce, measure_p2p, measure_reduce_scatter
from partita.profile.overheads import STEPS as PROBE_STEPS
from partita.profile.overheads import Parallelize, measure_overheads

__all__ = ["OptimizerKind", "Parallelize", "device_spec", "measure"]

MEASUREMENT_VERSION = 8  # part of every cache key: measurements made differently are not reused

log = logging.getLogger("partita")


def device_spec(device: torch.device) -> DeviceSpec:
    """The preset closest to this device (its datasheet numbers and typical overheads)."""
    if device.type != "cuda":
        return DEVICES["cpu"]
    return gpu_preset(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)


def gpu_preset(name: str, memory_bytes: int) -> DeviceSpec:
    """The preset of the GPU family `name` names (a whole word: "GH200" is no H200) with the memory nearest
    `memory_bytes`; a GPU of no known family gets the preset with the nearest memory."""
    for family in ("H200", "H100", "A100", "V100"):
        if re.search(rf"\b{family}\b", name):
            candidates = [d for k, d in DEVICES.items() if k.startswith(family)]
            return min(candidates, key=lambda d: abs(d.memory_bytes - memory_bytes))
    return min((d for k, d in DEVICES.items() if k != "cpu"), key=lambda d: abs(d.memory_bytes - memory_bytes))


def fixed_overhead_bytes(used: int, held: int) -> int:
    """A process's fixed overhead: the memory it `used` less what its tensors `held`.

    >>> fixed_overhead_bytes(5 * 2**30, 4 * 2**30) == 2**30
    True
    """
    return max(used - held, 0)


def _process_bytes(device: torch.device, model: torch.nn.Module) -> int:
    """What this process uses on `device` besides its tensors: the fixed overhead (libraries, the CUDA context,
    NCCL's buffers), measured when measuring is done (the communicators exist) and before the rank builds its
    part of the model. Tensors are not part of it: the plan counts the model's with each stage, activations
    with the schedule. One rule on both devices, the process's memory less what its tensors hold: on a GPU,
    the device's used memory less all that torch's allocator reserved (weights already there, and the blocks
    measuring freed, which the allocator keeps for the job); on the CPU, the resident memory less the model's
    tensors there (freed big blocks go back to the system, launch.env)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return fixed_overhead_bytes(int(total - free), int(torch.cuda.memory_reserved(device)))
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"}
    return fixed_overhead_bytes(used, sum(t.numel() * t.element_size() for t in tensors.values()))


def _agreed(flag: bool) -> bool:
    """Rank 0's flag on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def measure(cap, graph: ModelGraph, local_batch: int, device: torch.device, local_world_size: int,
            memory_per_rank: int, parallelize: Parallelize, show_progress: bool = True,
            compute_dtype: torch.dtype | None = None,
            optimizer: OptimizerKind | None = None) -> tuple[Profile | None, Cluster | None]:
    """(profile, cluster) on rank 0, (None, None) elsewhere; collective. `parallelize` wraps a model as partita
    does (its runtime's own costs are measured by training a probe model with it). `compute_dtype`: blocks
    compute in it under autocast, as the job will (mixed precision). `optimizer`: the job's, whose step is
    timed (rank 0)."""
    # measuring draws random inputs and seeds its own models: the user's random streams (just restored from a
    # checkpoint, perhaps) must come out as they went in
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _measure(cap, graph, local_batch, device, local_world_size, memory_per_rank, parallelize,
                        show_progress, compute_dtype, optimizer)


@dataclass(frozen=True)
class _Job:
    """Where measuring runs: this rank, the job's size, the device and what it is."""

    rank: int
    world: int
    local_world_size: int
    device: torch.device
    spec: DeviceSpec
    cores: int  # CPU cores this process may use (0 on CUDA)
    say: bool  # rank 0 tells what it measures (unless PARTITA_LOG=off or show_progress=False)
    compute_dtype: torch.dtype | None  # under autocast (mixed precision), else the weights' own


def _measure(cap, graph: ModelGraph, local_batch: int, device: torch.device, local_world_size: int,
             memory_per_rank: int, parallelize: Parallelize, show_progress: bool,
             compute_dtype: torch.dtype | None,
             optimizer: OptimizerKind | None) -> tuple[Profile | None, Cluster | None]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    job = _Job(rank, world, local_world_size, device, device_spec(device),
               len(os.sched_getaffinity(0)) if device.type == "cpu" else 0,
               show_progress and rank == 0 and not log.disabled and log.isEnabledFor(logging.INFO), compute_dtype)
    dtype = str(compute_dtype or next((t.dtype for t in cap.module.parameters() if t.is_floating_point()),
                                      torch.float32))
    blocks_key = cache.key(MEASUREMENT_VERSION, [b.signature for b in graph.blocks], profile_rows(local_batch),
                           job.spec.name, str(device.type), torch.__version__, dtype)
    links_key = cache.key(MEASUREMENT_VERSION, dist.get_backend() if dist.is_initialized() else "none", world,
                          local_world_size, job.spec.name, torch.__version__)
    cached_profile = cache.load("profile", blocks_key) if rank == 0 else None
    cached_links = cache.load("links", links_key) if rank == 0 else None
    if job.say:
        _announce(graph, local_batch, world, cached_profile is not None, cached_links is not None)
    profile_cached = _agreed(cached_profile is not None)
    if profile_cached:
        profile = Profile.from_json(cached_profile) if rank == 0 else None
    else:
        profile = _block_costs(cap, graph, local_batch, job)
        if rank == 0:
            cache.store("profile", blocks_key, profile.to_json())
    if _agreed(cached_links is not None):
        links = json.loads(cached_links) if rank == 0 else None
    else:
        links = _links(job, memory_per_rank, parallelize)
        if rank == 0:
            cache.store("links", links_key, json.dumps(links))
    overhead = _process_bytes(device, cap.module)
    if rank != 0:
        return None, None
    if optimizer is not None:  # right after measuring blocks, a GPU is loaded already
        profile = replace(profile, optimizer_bps=_optimizer_rate(optimizer, graph, device, warm_first=profile_cached))
    return profile, _cluster(job, memory_per_rank, links, overhead)


def _optimizer_rate(optimizer: OptimizerKind, graph: ModelGraph, device: torch.device, warm_first: bool) -> float:
    """`optimizer_rate` for this model's parameters on `device`, cached; `warm_first`: load an idle GPU first."""
    param_bytes, tensors = sum(graph.param_bytes.values()), len(graph.param_bytes)
    key = cache.key(MEASUREMENT_VERSION, optimizer.description, param_bytes, tensors, device_spec(device).name,
                    str(device.type), torch.__version__)
    cached = cache.load("optimizer", key)
    if cached is not None:
        return float(cached)
    if warm_first:
        warm_up(device)
    rate = optimizer_rate(optimizer, param_bytes, tensors, device)
    cache.store("optimizer", key, repr(rate))
    return rate


def _at_once(job: _Job) -> int:
    """How many ranks measure at once: all but when they share fewer cores than there are ranks."""
    return job.cores if job.local_world_size > job.cores else 0


def _block_costs(cap, graph: ModelGraph, local_batch: int, job: _Job) -> Profile | None:
    """The measured Profile of the model's blocks (rank 0; None elsewhere). Collective."""
    warm_up(job.device)
    started = time.perf_counter()
    costs = measure_blocks(cap, graph, local_batch, job.device, job.say, at_once=_at_once(job),
                           compute_dtype=job.compute_dtype)
    if job.say:
        log.info("blocks measured in %s", seconds(time.perf_counter() - started))
    if job.rank != 0:
        return None
    where = job.spec.name if job.device.type == "cuda" else "cpu"
    return Profile(f"measured on {where} ({job.device}), torch {torch.__version__}",
                   tuple(costs[b.signature] for b in graph.blocks),
                   stream_bandwidth(sum(graph.param_bytes.values()), job.device))


def _links(job: _Job, memory_per_rank: int, parallelize: Parallelize) -> dict:
    """The links between ranks and partita's own costs, as cached (JSON-ready). Collective."""
    started = time.perf_counter()
    if job.say and job.world > 1:
        log.info("timing messages between the %d ranks (point-to-point, all-reduce, reduce-scatter and all-gather, "
                 "%s to %s), then partita's own costs per step (a small probe model trained %d steps under each of "
                 "a few plans)",
                 job.world, size(min(SIZES_BYTES)), size(max(SIZES_BYTES)), PROBE_STEPS)
    measured = {"p2p": measure_p2p(job.device), "allreduce": measure_allreduce(job.device),
                "reduce_scatter": measure_reduce_scatter(job.device), "allgather": measure_allgather(job.device)}
    links: dict = {name: link and [link.latency_s, link.bandwidth_bps] for name, link in measured.items()}
    links["overheads"] = None
    if job.world > 1:  # collective; fitted on rank 0, against the links just measured
        cluster = _cluster(job, memory_per_rank, links) if job.rank == 0 else None
        runtime = measure_overheads(cluster, job.device, parallelize, _at_once(job))
        links["overheads"] = runtime and asdict(runtime)
    if job.say and job.world > 1:
        log.info("links and partita's own costs measured in %s", seconds(time.perf_counter() - started))
    return links


def _cluster(job: _Job, memory_per_rank: int, links: dict, overhead_bytes: int = -1) -> Cluster:
    per_node = max(1, min(job.local_world_size, job.world))
    return Cluster(
        device=job.spec, num_nodes=max(1, job.world // per_node), devices_per_node=per_node,
        p2p=Link(*links["p2p"]) if links["p2p"] else None,
        allreduce=Link(*links["allreduce"]) if links["allreduce"] else None, allreduce_ranks=job.world,
        reduce_scatter=Link(*links["reduce_scatter"]) if links["reduce_scatter"] else None,
        allgather=Link(*links["allgather"]) if links["allgather"] else None,
        memory_bytes=memory_per_rank, fixed_overhead_bytes=overhead_bytes,
        overheads=RuntimeOverheads(**links["overheads"]) if links.get("overheads") else None,
        cores_per_node=job.cores if per_node > job.cores else 0,
    )


def _announce(graph: ModelGraph, local_batch: int, world: int, blocks_cached: bool, links_cached: bool) -> None:
    """What is about to be measured, and that it is measured once: the results are cached on disk."""
    where = f"{cache.cache_dir()} (PARTITA_CACHE_DIR)"
    links = world > 1  # one rank has no links to measure
    if blocks_cached and (links_cached or not links):
        log.info("block costs%s measured by an earlier run: read from %s; delete them there to measure again",
                 " and links" if links else "", where)
        return
    if blocks_cached:
        log.info("measuring the links between ranks before planning (this model's blocks are known from an "
                 "earlier run); this happens once: the results go to %s and later runs of %d ranks here read them",
                 where, world)
        return
    distinct = len({b.signature for b in graph.blocks})
    small, large = profile_rows(local_batch)
    what = ("this model's blocks and the links between ranks" if links and not links_cached
            else "this model's blocks (the links between ranks are known from an earlier run)" if links
            else "this model's blocks")
    log.info("measuring %s before planning; this happens once: the results go to %s and later runs of this "
             "model here read them", what, where)
    log.info("timing the forward and backward of %d distinct block%s (of %d: repeated layers are measured once) "
             "and the memory each keeps for its backward, at micro-batches of %d and %d rows, shared among %d "
             "rank%s", distinct, "s" if distinct > 1 else "", graph.num_blocks, small, large, world,
             "s" if world > 1 else "")
