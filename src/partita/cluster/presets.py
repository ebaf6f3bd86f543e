"""Device presets, so that partita can plan for hardware it does not have. Extend DEVICES with your own.

Peak numbers come from the vendors' datasheets (SXM parts, dense, no sparsity); the efficiency, op overhead
and fixed memory overhead are typical values for PyTorch eager training, not datasheet figures. "cpu" was
measured on this project's development machine (see the entry).
"""

from __future__ import annotations

import re

from partita.cluster.cluster import Cluster, DeviceSpec, Link
from partita.errors import PlanError

GB = 10**9
GiB = 2**30
_NVLINK_LATENCY_S = 5e-6  # NCCL point-to-point over NVLink, small messages
_IB_LATENCY_S = 10e-6  # NCCL over InfiniBand, small messages
_CUDA_FIXED_BYTES = 1 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, allocator slack
# partita's runtime on GPUs: Python per pipeline action (torch's stage machinery, NCCL send/recv launches) and
# per step (routing, agreement, loss sum); typical of eager PyTorch, not measured here (no GPU on this machine)
_GPU_ACTION_S, _GPU_PIPELINE_STEP_S, _GPU_DATA_PARALLEL_STEP_S = 100e-6, 1e-3, 300e-6


def _gpu(name, memory_bytes, fp32, bf16, mem_bw, nvlink_bps, ib_bps, source):
    return DeviceSpec(
        name=name, memory_bytes=memory_bytes, flops={"float32": fp32, "bfloat16": bf16, "float16": bf16},
        mem_bandwidth_bps=mem_bw, matmul_efficiency=0.7, op_overhead_s=10e-6,
        fixed_overhead_bytes=_CUDA_FIXED_BYTES, action_overhead_s=_GPU_ACTION_S,
        pipeline_step_overhead_s=_GPU_PIPELINE_STEP_S, data_parallel_step_overhead_s=_GPU_DATA_PARALLEL_STEP_S,
        intra_node=Link(_NVLINK_LATENCY_S, nvlink_bps),
        inter_node=Link(_IB_LATENCY_S, ib_bps), devices_per_node=8, source=source,
    )


DEVICES: dict[str, DeviceSpec] = {
    "V100-32GB": _gpu(
        "V100-32GB", 32 * GB, 15.7e12, 125e12, 900e9, 150e9, 12.5e9,
        "NVIDIA V100 datasheet (SXM2): FP32 15.7 TFLOPS, tensor FP16 125 TFLOPS, HBM2 900 GB/s, NVLink 300 GB/s "
        "both directions; inter-node: 100 Gb/s EDR InfiniBand per device"),
    "A100-40GB": _gpu(
        "A100-40GB", 40 * GB, 19.5e12, 312e12, 1555e9, 300e9, 25e9,
        "NVIDIA A100 datasheet (SXM4): FP32 19.5 TFLOPS, BF16 312 TFLOPS, HBM2 1,555 GB/s, NVLink 600 GB/s both "
        "directions; DGX A100: one 200 Gb/s HDR InfiniBand port per GPU"),
    "A100-80GB": _gpu(
        "A100-80GB", 80 * GB, 19.5e12, 312e12, 2039e9, 300e9, 25e9,
        "NVIDIA A100 datasheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16 312 TFLOPS, HBM2e 2,039 GB/s, NVLink 600 GB/s; "
        "DGX A100: 200 Gb/s HDR InfiniBand per GPU"),
    "H100-80GB": _gpu(
        "H100-80GB", 80 * GB, 67e12, 989e12, 3350e9, 450e9, 50e9,
        "NVIDIA H100 datasheet (SXM5): FP32 67 TFLOPS, BF16 989 TFLOPS dense, HBM3 3.35 TB/s, NVLink 900 GB/s "
        "both directions; DGX H100: one 400 Gb/s NDR InfiniBand port per GPU"),
    "H200-141GB": _gpu(
        "H200-141GB", 141 * GB, 67e12, 989e12, 4800e9, 450e9, 50e9,
        "NVIDIA H200 datasheet (SXM): FP32 67 TFLOPS, BF16 989 TFLOPS dense, HBM3e 4.8 TB/s, 141 GB, NVLink "
        "900 GB/s; DGX H200: 400 Gb/s NDR InfiniBand per GPU"),
    "cpu": DeviceSpec(
        name="cpu", memory_bytes=6 * GiB, flops={"float32": 104e9}, mem_bandwidth_bps=7.8e9,
        matmul_efficiency=1.0, op_overhead_s=15e-6, fixed_overhead_bytes=330 * 2**20,
        action_overhead_s=0.75e-3, pipeline_step_overhead_s=3.4e-3, data_parallel_step_overhead_s=2.6e-3,
        intra_node=Link(180e-6, 1.0e9), inter_node=Link(180e-6, 1.0e9), devices_per_node=4,
        source="measured 2026-11-21 on the 2-core development VM, one thread per rank: 1024x1024 fp32 matmul "
               "104 GFLOP/s, 64 MiB copy 7.5-8.1 GB/s, a process with torch imported 329 MiB, gloo scalar "
               "all-reduce 0.18 ms between 2 ranks; partita's runtime at 2 ranks: 0.75 ms per pipeline action, "
               "3.4 ms per pipeline step, 2.6 ms per data-parallel step; memory: 24 GiB shared by 4 ranks"),
}


def parse_cluster(text: str) -> Cluster:
    """'8xA100-40GB' (one node), '1024xA100-80GB' (nodes of the device's size), '2x8xH100-80GB', '4xcpu'.

    >>> c = parse_cluster("16xA100-80GB"); (c.num_nodes, c.devices_per_node, c.world_size)
    (2, 8, 16)
    """
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x(.+)", text.strip())
    if not m or m.group(3) not in DEVICES:
        raise PlanError(f"cannot read devices {text!r}: write COUNTxDEVICE or NODESxPER_NODExDEVICE, e.g. "
                        f"8xA100-40GB; devices: {', '.join(DEVICES)}")
    device = DEVICES[m.group(3)]
    if m.group(1):
        nodes, per_node = int(m.group(1)), int(m.group(2))
    else:
        count = int(m.group(2))
        per_node = min(count, device.devices_per_node)
        if count % per_node:
            raise PlanError(f"{count} x {device.name} do not fill nodes of {per_node}; write NODESxPER_NODEx{device.name}")
        nodes = count // per_node
    if nodes < 1 or per_node < 1:
        raise PlanError(f"{text}: need at least one device")
    return Cluster(device=device, num_nodes=nodes, devices_per_node=per_node)
