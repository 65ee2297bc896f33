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
