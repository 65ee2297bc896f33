"""Published Megatron-Bridge MoE runs on DGX-H100 that no table of this project holds, predicted (issue 15).

A check, never a fit: no constant of the model is chosen on these rows, and they are not in
knowledge/data/published_runs.csv (which the tool reads). Rows: the DGX-H100 MoE rows of Megatron-Bridge's
docs/performance-summary.md (25.11, 26.02) and docs/performance-summary-archive.md (25.09), tokens/s/GPU as
published. Each row is written as the Megatron-LM arguments the performance recipe of that release ran
(scripts/performance/configs/<model>/..., utils/helpers.py or utils/overrides.py: the recipe file and commit
read are in `recipe`); what the table or the recipe does not say is listed under `assumed`. Hosts are
bare metal (knowledge.runs.BARE_METAL_HOST_FLOOR_MS).

    .venv/bin/python benchmarks/published_moe_check.py   # writes benchmarks/results/published_moe_check.txt
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.knowledge.runs import BARE_METAL_HOST_FLOOR_MS
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Plan, with_changes

OUT = Path(__file__).resolve().parent / "results" / "published_moe_check.txt"
DOCS = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md @ 00b7660b"
ARCHIVE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @ 0a25f911"

#: every Bridge performance recipe of these releases (helpers set_common_perf_overrides / set_user_overrides)
COMMON = {"use_distributed_optimizer": True, "grad_reduce_in_bf16": True, "moe_token_dispatcher_type": "alltoall",
          "moe_grouped_gemm": True, "moe_permute_fusion": True, "cross_entropy_loss_fusion": True,
          "cross_entropy_fusion_impl": "te", "manual_gc": True, "manual_gc_interval": 100}
DROPLESS = {"moe_router_force_load_balancing": True}  # 'required for token dropless' (set_*_common_configs)
TOKENDROP = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}  # apply_moe_token_drop
A2A_OVERLAP = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}  # set_moe_a2a_overlap_overrides
FP8_CS = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True}  # bf16_with_fp8_current_scaling_mixed
BF16_OPT = {"use_precision_aware_optimizer": True}  # BF16 runs (set_user_overrides / set_post_overrides)
QWEN_ROUTER = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3}  # Qwen3 MoE provider


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    gpus: int
    tokens_per_s_per_gpu: float
    source: str
    recipe: str
    args: dict
    assumed: list[str] = field(default_factory=list)


def _layout(tp: int, pp: int, vp: int | None, ep: int, gbs: int, mbs: int) -> dict:
    """Every recipe read sets ETP 1 (Qwen3's BASE_*_CONFIG expert_tensor_parallel_size=1, the 25.09 yamls' `etp: 1`;
    GPT-OSS runs TP 1): without it Megatron's default is ETP = TP."""
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "num_virtual_stages_per_pipeline_rank": vp,
            "expert_model_parallel_size": ep, "expert_tensor_parallel_size": 1, "sequence_parallel": tp > 1, "seq_length": 4096,
            "global_batch_size": gbs, "micro_batch_size": mbs}


Q3_235_SPLIT = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}

ROWS = [
    Row("GPT-OSS-120B 64x BF16 mbs4 PP4 EP8 (25.11)", "gpt-oss-120b", 64, 5630, DOCS,
        "configs/gpt_oss/workload_base_configs.py @ 8aed9a22 (okoge-kaz), gpt_oss_llm_pretrain.py @ 4830138a",
        {**COMMON, **DROPLESS, **BF16_OPT, **_layout(1, 4, None, 8, 512, 4)},
        ["recompute_modules [layernorm, moe_act] without a granularity: no recompute (Megatron reads the modules "
         "only with --recompute-granularity selective)",
         "the table's MBS 4 (no stored recipe version has it for H100)"]),
    Row("GPT-OSS-120B 64x BF16 mbs1 PP4 EP8 (26.02)", "gpt-oss-120b", 64, 5993, ARCHIVE,
        "configs/gpt_oss/gpt_oss_workload_base_configs.py @ 1e7adfa9 (H100_BF16_V2), utils/overrides.py",
        {**COMMON, **DROPLESS, **BF16_OPT, **_layout(1, 4, None, 8, 1280, 1),
         "recompute_granularity": "selective", "recompute_modules": ["layernorm", "moe_act"]},
        ["the V2 variant (GBS 1280) as the table's"]),
    Row("Qwen3-30B-A3B 16x FP8-CS mbs2 PP2 VP24 EP8 (25.11)", "qwen3-30b-a3b", 16, 5275, DOCS,
        "configs/qwen3/workload_base_configs.py @ 767255d2 (H100_FP8_CS: moe_a2a_overlap), qwen3_llm_pretrain.py",
        {**COMMON, **DROPLESS, **FP8_CS, **QWEN_ROUTER, **A2A_OVERLAP, **_layout(1, 2, 24, 8, 512, 2)},
        ["the table's VP 24 (the recipe file read has VP 12)"]),
    Row("Qwen3-30B-A3B 16x FP8-CS mbs2 PP2 VP24 EP8 tokendrop (25.09)", "qwen3-30b-a3b", 16, 10494, ARCHIVE,
        "scripts/performance/run_script.py @ 2a932de8 (apply_moe_token_drop), qwen3_30b_a3b_llm_pretrain.yaml",
        {**COMMON, **TOKENDROP, **FP8_CS, **QWEN_ROUTER, **_layout(1, 2, 24, 8, 512, 2)},
        ["precision not in the 25.09 table: FP8-CS (the runner's default 'cs')"]),
    Row("Qwen3-30B-A3B 16x FP8-CS mbs1 PP2 VP12 EP8 (26.02)", "qwen3-30b-a3b", 16, 5113, ARCHIVE,
        "configs/qwen/qwen3_workload_base_configs.py @ 15ace117 (H100_FP8_CS_V1, GBS 1024 from PR #2280)",
        {**COMMON, **DROPLESS, **FP8_CS, **QWEN_ROUTER, **A2A_OVERLAP, **_layout(1, 2, 12, 8, 1024, 1)}),
    Row("Qwen3-235B-A22B 256x FP8-CS TP2 PP8 VP4 EP32 (25.11)", "qwen3-235b-a22b", 256, 1575, ARCHIVE,
        "configs/qwen3/workload_base_configs.py @ 767255d2 (H100_FP8_CS), qwen3_llm_pretrain.py (tp_comm_overlap True)",
        {**COMMON, **DROPLESS, **FP8_CS, **QWEN_ROUTER, **A2A_OVERLAP, **Q3_235_SPLIT, **_layout(2, 8, 4, 32, 2048, 1),
         "tp_comm_overlap": True}),
    Row("Qwen3-235B-A22B 256x FP8-CS TP2 PP8 VP4 EP32 tokendrop (25.09)", "qwen3-235b-a22b", 256, 1204, ARCHIVE,
        "scripts/performance/run_script.py @ 2a932de8, qwen3_235b_a22b_llm_pretrain.yaml @ 11d3a36e",
        {**COMMON, **TOKENDROP, **FP8_CS, **QWEN_ROUTER, **Q3_235_SPLIT, **_layout(2, 8, 4, 32, 2048, 1),
         "tp_comm_overlap": True},
        ["precision not in the 25.09 table: FP8-CS (the runner's default 'cs')"]),
    Row("Qwen3-235B-A22B 256x FP8-CS TP2 PP8 VP4 EP32 (26.02)", "qwen3-235b-a22b", 256, 1633, ARCHIVE,
        "configs/qwen/qwen3_workload_base_configs.py @ 15ace117 (H100_FP8_CS_V2), qwen3_llm_pretrain.py (tp_comm_overlap False)",
        {**COMMON, **DROPLESS, **FP8_CS, **QWEN_ROUTER, **A2A_OVERLAP, **Q3_235_SPLIT, **_layout(2, 8, 4, 32, 8192, 1)},
        ["the V2 variant (GBS 8192) as the table's"]),
    Row("DeepSeek-V3 1024x TP2 PP8 VP4 EP64 DeepEP (25.09)", "deepseek-v3", 1024, 1297, ARCHIVE,
        "scripts/performance/run_script.py @ 2a932de8 (enable_deepep, A2A_1F1B for H100), deepseek_v3_llm_pretrain.yaml",
        {**COMMON, **DROPLESS, **FP8_CS, **A2A_OVERLAP, **_layout(2, 8, 4, 64, 8192, 1),
         "moe_token_dispatcher_type": "flex", "recompute_granularity": "selective",
         "recompute_modules": ["mla_up_proj", "mlp"], "overlap_grad_reduce": False, "manual_gc_interval": 5,
         "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 6},
        ["precision: FP8-CS (the table gives two TFLOP/s, the second blockwise; which one the tokens/s is not said)",
         "layout 'Et|(tt|)*30mL' as 7 / 8 x 6 / 6 decoder layers per PP rank (the plan has no layout string)"]),
]


def plan_of(row: Row) -> Plan:
    s = megatron_flags.parse(row.args).sections
    impl = {**s["implementation"], "create_attention_mask_in_dataloader": False}
    return Plan(model={"name": row.model}, cluster={"gpu": "h100-sxm", "num_gpus": row.gpus,
                                                    "host_floor_ms_per_layer": BARE_METAL_HOST_FLOOR_MS},
                training=s["training"], parallelism=s["parallelism"], implementation=impl)


def report() -> str:
    lines = [__doc__.split("\n\n")[0], "", f"{'run':66s} {'meas':>7s} {'pred':>7s} {'step err':>9s}  largest MoE part; breakdown"]
    errs = []
    for row in ROWS:
        plan = plan_of(row)
        est = step_time(plan)
        err = row.tokens_per_s_per_gpu / est.tokens_per_s_per_gpu - 1.0  # predicted / measured step time - 1
        errs.append(abs(err))
        b = est.breakdown
        terms = {k: v for k, v in b.model_dump().items() if isinstance(v, float) and v > 0.03 * est.iteration_time_s}
        lines.append(f"{row.name:66s} {row.tokens_per_s_per_gpu:7.0f} {est.tokens_per_s_per_gpu:7.0f} {100 * err:+8.1f}%  "
                     f"{est.moe_dominant_part}; " + ", ".join(f"{k} {v:.2f}" for k, v in terms.items()))
        lines.append(f"    source: {row.source}; recipe: {row.recipe}")
        for a in row.assumed:
            lines.append(f"    assumed: {a}")
    lines += ["", f"rows {len(errs)}: median |step error| {100 * statistics.median(errs):.1f}%, "
                  f"max {100 * max(errs):.1f}%, within 20%: {sum(e <= 0.2 for e in errs)}/{len(errs)}"]
    return "\n".join(lines + _host_sensitivity()) + "\n"


def _host_sensitivity() -> list[str]:
    """The same rows on faster and slower bare-metal hosts than knowledge.runs.BARE_METAL_HOST_FLOOR_MS: how much of each
    error the host speed could carry (not used by the model; the constant is chosen on the published-runs table)."""
    out = ["", "host sensitivity (step error per row at other bare-metal host speeds, ms per reference layer):"]
    for host in (1.0, 2.0, 4.0):
        errs = []
        for row in ROWS:
            plan = with_changes(plan_of(row), "cluster", host_floor_ms_per_layer=host)
            errs.append(100 * (row.tokens_per_s_per_gpu / step_time(plan).tokens_per_s_per_gpu - 1.0))
        out.append(f"  {host:.1f} ms: " + " ".join(f"{e:+.0f}%" for e in errs)
                   + f"  (median |err| {statistics.median(abs(e) for e in errs):.1f}%)")
    return out


def main() -> int:
    text = report()
    OUT.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
