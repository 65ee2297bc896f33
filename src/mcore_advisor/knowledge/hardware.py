"""GPU catalog: peak rates, memory and interconnect, each figure with its source."""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.models import normalize_key


class GpuSpec(BaseModel):
    """One GPU type. Rates are dense (never 2:4-sparse) datasheet peaks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="Catalog key used in plans, e.g. 'h100-sxm'.")
    name: str
    architecture: str = Field(description="'ampere', 'hopper' or 'blackwell'.")
    bf16_dense_tflops: float = Field(description="Dense BF16 tensor-core peak, TFLOP/s (the MFU denominator).")
    fp8_dense_tflops: float | None = Field(description="Dense FP8 peak, TFLOP/s; None where FP8 is unsupported.")
    hbm_capacity_gib: float = Field(description="Device memory CUDA/PyTorch reports as total capacity, GiB (2^30 B): the allocation ceiling before the CUDA context.")
    hbm_bandwidth_gbps: float = Field(description="HBM bandwidth, GB/s (10^9 B/s).")
    nvlink_bandwidth_gbps: float | None = Field(description="NVLink bandwidth per GPU per direction, GB/s; None = PCIe only.")
    scaleout_bandwidth_gbps: float = Field(description="Inter-node network bandwidth per GPU per direction, GB/s (typical DGX/HGX: one 400 Gb/s NIC per GPU = 50).")
    gpus_per_node: int = Field(description="GPUs per node (NVLink domain) in the reference system.")
    matmul_efficiency: float = Field(description="Achievable fraction of the dense peak on large bf16 GEMMs; how it was measured is in `source`.")
    host_floor_ms_per_layer: float = Field(0.0, description="Host (CPU) time to launch one transformer layer's forward + backward for one micro-batch, ms; 0 = not binding. Measured only where `source` says so; published bare-metal runs show it below the GPU work of their layers.")
    source: str = Field(description="Where every number above comes from.")


BARE_METAL_HOST_FLOOR_MS = 2.75
"""The host speed of a bare-metal DGX/HGX node (ClusterSpec.host_floor_ms_per_layer: ms to launch the reference
layer's forward + backward), which published runs are planned with and a multi-node cluster gets by default
(default_host_floor_ms): such hosts launch faster than this workplace's VMs (5.5, the GPU catalog's), which
matters where a layer launches many small kernels (fine-grained MoE: a GEMM per local expert, the dispatcher's
syncs). Chosen on the published rows outside the held-out third
(benchmarks/throughput_accuracy.py section 3) by mean |step error|, over 0.5-4 ms: the dense rows barely read it
(median 5.1% at 1.0, 5.5% at 2.75), the fitted MoE rows decide (Megatron-MoE-ModelZoo Qwen3-235B #53-#55: mean 12.5%
at 1.0, 6.0% at 2.75, 8.0% at 3.0, 11.8% at 3.25); the held-out published rows went 8.0% -> 6.0% median and
Megatron-Bridge's DGX-H100 MoE table (benchmarks/published_moe_check.py, never chosen on) 23% -> 20%. Why about
half the VM's figure: the VM's vCPUs are the same generation as a DGX H100's Xeon Platinum 8480C (lscpu of the
nvidia-h100-x1 VM, session s13: AMX and AVX512-FP16 flags, a KVM guest), so the gap is virtualisation and clock,
not the core; the same Qwen3-30B-A3B EP8 rank took 53 ms a layer (29 of them host) on the VM and 32 ms on
Bridge's DGX (session s12, gpu_h200x2_E_summary.md), a host 2-2.5x faster. MCore's README GPT 32B TP8 row, 4.6 ms of
GPU work per layer and micro-batch, is not host-bound at it."""


def default_host_floor_ms(g: GpuSpec, num_gpus: int, gpus_per_node: int | None = None) -> float:
    """The host speed a plan gets when its cluster does not give one: the catalog's figure (this workplace's VMs,
    where every measured run of one node ran) for a run inside one node, the bare-metal figure for a run over
    several nodes, which are DGX/HGX-class systems (the catalog's scale-out bandwidth is a DGX's one NIC per GPU);
    a GPU whose catalog figure is 0 (not binding) keeps 0."""
    multi_node = num_gpus > (gpus_per_node or g.gpus_per_node)
    return min(g.host_floor_ms_per_layer, BARE_METAL_HOST_FLOOR_MS) if multi_node else g.host_floor_ms_per_layer


@cache
def gpu_catalog() -> dict[str, GpuSpec]:
    raw = json.loads(resources.files(__package__).joinpath("data/hardware.json").read_text(encoding="utf-8"))
    return {g["key"]: GpuSpec(**g) for g in raw["gpus"]}


def gpu(key: str) -> GpuSpec:
    """Look up a GPU by catalog key (case-insensitive, '_' = '-'); KeyError lists the known keys."""
    cat = gpu_catalog()
    norm = normalize_key(key)
    if norm in cat:
        return cat[norm]
    if norm in _ALIASES:
        return cat[_ALIASES[norm]]
    raise KeyError(f"unknown gpu {key!r} (cluster.gpu); known: {', '.join(sorted(cat))}")


_ALIASES = {
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-sxm5-80gb": "h100-sxm", "h100-80gb": "h100-sxm", "h100-80gb-hbm3": "h100-sxm",
    "h100-pcie-80gb": "h100-pcie",
    "a100": "a100-80gb", "a100-sxm4-80gb": "a100-80gb", "a100-sxm-80gb": "a100-80gb", "a100-80gb-sxm": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb", "a100-40gb-sxm": "a100-40gb",
    "h200-sxm": "h200", "h200-141gb": "h200", "h200-sxm-141gb": "h200",
    "b200-180gb": "b200", "gb200-nvl72": "gb200",
}


def gpu_key_from_label(label: str) -> str | None:
    """Map a free-text GPU description from a paper or table ('A100-SXM4-80GB',
    'H100-SXM5-80GB (DGX-H100)', 'H100 (NVLink4, IB 8x50GB/s)') to a catalog key, or None.

    H100 without 'PCIe' is taken as SXM: the published training tables are DGX/HGX systems.
    """
    text = label.strip().lower()
    if "gb200" in text:
        return "gb200"
    if "b200" in text:
        return "b200"
    if "h200" in text:
        return "h200"
    if "h100" in text:
        return "h100-pcie" if "pcie" in text else "h100-sxm"
    if "a100" in text:
        return "a100-40gb" if re.search(r"\b40\s*gb", text) else "a100-80gb"
    return None
