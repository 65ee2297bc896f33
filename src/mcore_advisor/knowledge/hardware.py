"""GPU catalog: peak rates, memory and interconnect, each figure with its source."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field


class GpuSpec(BaseModel):
    """One GPU type. Rates are dense (never 2:4-sparse) datasheet peaks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(description="Catalog key used in plans, e.g. 'h100-sxm'.")
    name: str
    architecture: str = Field(description="'ampere', 'hopper' or 'blackwell'.")
    bf16_dense_tflops: float = Field(description="Dense BF16 tensor-core peak, TFLOP/s (the MFU denominator).")
    fp8_dense_tflops: float | None = Field(description="Dense FP8 peak, TFLOP/s; None where FP8 is unsupported.")
    hbm_capacity_gib: float = Field(description="HBM capacity as the driver reports it, GiB (2^30 B).")
    hbm_bandwidth_gbps: float = Field(description="HBM bandwidth, GB/s (10^9 B/s).")
    nvlink_bandwidth_gbps: float | None = Field(description="NVLink bandwidth per GPU per direction, GB/s; None = PCIe only.")
    scaleout_bandwidth_gbps: float = Field(description="Inter-node network bandwidth per GPU per direction, GB/s (typical DGX/HGX: one 400 Gb/s NIC per GPU = 50).")
    gpus_per_node: int = Field(description="GPUs per node (NVLink domain) in the reference system.")
    matmul_efficiency: float = Field(description="Achievable fraction of the dense peak on large bf16 GEMMs; how it was measured is in `source`.")
    source: str = Field(description="Where every number above comes from.")


@cache
def gpu_catalog() -> dict[str, GpuSpec]:
    raw = json.loads(resources.files(__package__).joinpath("data/hardware.json").read_text())
    return {g["key"]: GpuSpec(**g) for g in raw["gpus"]}


def gpu(key: str) -> GpuSpec:
    """Look up a GPU by catalog key (case-insensitive, '_' = '-'); KeyError lists the known keys."""
    cat = gpu_catalog()
    norm = key.strip().lower().replace("_", "-")
    if norm in cat:
        return cat[norm]
    aliases = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}
    if norm in aliases:
        return cat[aliases[norm]]
    raise KeyError(f"unknown gpu {key!r}; known: {', '.join(sorted(cat))}")
