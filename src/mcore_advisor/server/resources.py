"""Knowledge base and prompts exposed to MCP clients."""

from __future__ import annotations

import json

from mcp.server import MCPServer
from pydantic_core import to_jsonable_python

from mcore_advisor.knowledge.claims import seed_claims
from mcore_advisor.knowledge.hardware import gpu_catalog
from mcore_advisor.knowledge.models import catalog_model, model_catalog
from mcore_advisor.knowledge.runs import published_runs, sources
from mcore_advisor.server.params import PlanStore

FLOP_CONVENTIONS = {
    "causal": (
        "Megatron-LM since commit 8873b55d6a (2025-03-06): the core-attention term (QK^T and PV) is "
        "counted over the causal half of the s x s matrix. Megatron-LM >= 0.12 / Megatron-Bridge logs use it."
    ),
    "full": (
        "Before 2025-03: core attention counted over the full s x s matrix. Used by Narayanan 2021, "
        "Korthikanti 2022, the MCore r0.8 README H100 table and NeMo 24.x performance tables; gives "
        "+12.5% (8B), +7.2% (70B), +4% (405B) more TFLOP/s at s=8192 for the same run."
    ),
    "mfu_denominator": "Dense peak of the GPU (H100 SXM BF16: 989.4 TFLOP/s; 1979 is the 2:4-sparse figure).",
}


def _dump(obj) -> str:
    return json.dumps(to_jsonable_python(obj), indent=1)


def register_resources(mcp: MCPServer, plans: PlanStore | None = None) -> None:
    if plans is not None:
        @mcp.resource("mcore://plans/{plan_id}", mime_type="application/json")
        def plan(plan_id: str) -> str:
            """A plan this server answered about, by the plan_id its answer gave: the full plan object."""
            return _dump(plans.get(plan_id).model_dump(mode="json"))

    @mcp.resource("mcore://hardware", mime_type="application/json")
    def hardware() -> str:
        """GPU catalog: dense BF16/FP8 peaks, HBM, NVLink and network bandwidth, each with its source."""
        return _dump([g.model_dump() for g in gpu_catalog().values()])

    @mcp.resource("mcore://models", mime_type="application/json")
    def models() -> str:
        """Model catalog: architectures (Megatron argument names) with published parameter counts and sources."""
        return _dump([m.model_dump(exclude_none=True) for m in model_catalog().values()])

    @mcp.resource("mcore://models/{key}", mime_type="application/json")
    def model(key: str) -> str:
        """One catalog model by key, e.g. mcore://models/llama3-70b."""
        return _dump(catalog_model(key).model_dump(exclude_none=True))

    @mcp.resource("mcore://flop-conventions", mime_type="application/json")
    def flop_conventions() -> str:
        """The two FLOP conventions every TFLOP/s and MFU figure is labelled with."""
        return _dump(FLOP_CONVENTIONS)

    @mcp.resource("mcore://published-runs", mime_type="application/json")
    def runs() -> str:
        """Published measured Megatron runs with layouts, TFLOP/s, MFU, tokens/s, FLOP convention and provenance."""
        return _dump({"sources": sources(), "runs": [r.model_dump() for r in published_runs()]})

    @mcp.resource("mcore://seed-claims", mime_type="application/json")
    def claims() -> str:
        """Numeric claims from the seed documents with a verdict (holds / wrong / misleading / unverifiable) and why."""
        return _dump([c.model_dump() for c in seed_claims()])


def register_prompts(mcp: MCPServer) -> None:
    @mcp.prompt()
    def plan_a_run(model: str, num_gpus: str = "64", gpu: str = "h100-sxm", seq_length: str = "8192") -> str:
        """Plan a Megatron-Core training run for a model on a cluster."""
        return (
            f"Plan a Megatron-Core pretraining run of {model} on {num_gpus} {gpu} GPUs at sequence length "
            f"{seq_length}. Call recommend_parallelism first; show the top plans with predicted step time, "
            "tokens/s/GPU, TFLOP/s/GPU (name the FLOP convention), MFU and per-GPU memory; explain why the best "
            "beats the runners-up; then call estimate_memory on the chosen plan and render_launch_script for it. "
            "Offer run_profile_job to measure it."
        )

    @mcp.prompt()
    def debug_low_mfu(log_excerpt: str = "", plan_json: str = "") -> str:
        """Diagnose a training run whose MFU or TFLOP/s is lower than expected."""
        return (
            "A Megatron training run is slower than expected. Call check_mfu with the log below "
            "(and the plan, if given). Report MFU/HFU in both FLOP conventions against the dense peak, which "
            "convention the log used, the expected band from published runs, and the ranked fixes with their "
            "predicted before/after throughput.\n\nPlan:\n" + (plan_json or "(not given)")
            + "\n\nLog:\n" + (log_excerpt or "(paste the training log lines here)")
        )

    @mcp.prompt()
    def debug_oom(error_text: str = "", plan_json: str = "") -> str:
        """Diagnose a CUDA out-of-memory error in a Megatron training run."""
        return (
            "A Megatron training run ran out of GPU memory. Call check_mfu with the error text and the plan "
            "to see where the memory went (estimate vs the message's numbers, fragmentation vs real "
            "over-commitment, most-loaded rank), then estimate_memory on the proposed fix.\n\nPlan:\n"
            + (plan_json or "(not given)") + "\n\nError:\n" + (error_text or "(paste the OOM message here)")
        )
