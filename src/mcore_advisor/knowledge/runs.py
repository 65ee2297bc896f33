"""Published measured training runs (data/published_runs.csv) as typed records, and Plans built from them.

Every row of shared/data/published-runs-dev.csv is kept, with missing values as None (nothing is
filled in at load time). A `flop_convention` column says how each source counted its TFLOP/s:

- 'full+recompute': Narayanan 2021, whose TFLOP/s and "% of peak" count the recomputed forward
  pass (96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h)), their eq. 3): hardware FLOPs, HFU-like.
- 'full': model FLOPs with the full s x s attention matrix (Korthikanti 2022's
  72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)); Megatron before 2025-03 (MCore r0.8.0 README);
  NeMo 24.07 and 25.02, whose tokens/s x FLOPs/token reproduce their TFLOP/s in that convention).
- 'causal': Megatron-LM since commit 8873b55d6a (2025-03-06) and Megatron-Bridge, which count
  the causal half of core attention (and MoE per layer: top-k routed + shared experts, dense
  layers separately). The MoE-ModelZoo Qwen3 rows reproduce in this convention; the Bridge
  memory-tuning rows have no tokens/s, so their convention is the tool's, not verified.

`plan_for_run` turns a row into a complete Plan where the row publishes enough (model shape, GPU,
TP/PP, sequence length, global batch); every value it had to assume is listed in `assumptions`. The
row is first written as the Megatron-LM arguments it ran with, which knowledge/megatron_flags.py reads
into plan fields like any other run's arguments. What the row's table leaves out but the recipe that
produced it states (optimizer-state precision, FP8 primary weights, recompute) comes from
data/run_recipes.json, each entry with its citation (`run_recipes`).
"""

from __future__ import annotations

import csv
import json
import re
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.knowledge.hardware import BARE_METAL_HOST_FLOOR_MS, gpu_key_from_label
from mcore_advisor.knowledge.models import model_catalog, normalize_key, resolve_model
from mcore_advisor.schemas import ImplementationSpec, ModelSpec, Plan

FlopConvention = Literal["full", "full+recompute", "causal"]


class RunSource(BaseModel):
    """One source key of the published-runs table, with its citation."""

    model_config = ConfigDict(frozen=True)

    key: str
    citation: str
    provenance: str
    flop_convention: FlopConvention
    hardware: str


_SOURCES: dict[str, RunSource] = {
    s.key: s
    for s in [
        RunSource(
            key="NARAYANAN21_T1",
            citation="Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', SC'21, arXiv 2104.04473, Table 1",
            provenance="10 weak-scaling rows (GPT 1.7B-1T, V=51200, s=2048, full recompute); same numbers as Megatron-LM README image images/cases_april2021.png (commit 50a4b5fa02). Micro-batch not in the table; tokens/s derived from eq. 3.",
            flop_convention="full+recompute",
            hardware="DGX A100 80GB (Selene), 8x 200 Gb/s HDR IB per node",
        ),
        RunSource(
            key="NARAYANAN21_T2",
            citation="Narayanan et al. 2021 (arXiv 2104.04473), Table 2, PTD-P rows",
            provenance="175B TP8/PP12 on 384/768/1536 GPUs and 530B TP8/PP35 on 560/1120/2240 GPUs; corroborated by cli99/llm-analysis examples/megatron-lm/run_train.sh. ZeRO-3 comparison rows not included. mfu_pct = TFLOP/s / 312 (derived, counts recompute).",
            flop_convention="full+recompute",
            hardware="DGX A100 80GB (Selene)",
        ),
        RunSource(
            key="KORTHIKANTI22_T5",
            citation="Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', MLSys'23, arXiv 2205.05198, Tables 3 and 5",
            provenance="Iteration times from Table 5 as transcribed in calculon-ai/calculon calculon/llm/validation.py; MFU/HFU of the selective rows from the old Megatron-LM README; full-recompute MFUs derived from the times with 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)).",
            flop_convention="full",
            hardware="DGX A100 80GB (Selene)",
        ),
        RunSource(
            key="KORTHIKANTI22_ABS",
            citation="Korthikanti et al. 2022 (arXiv 2205.05198), abstract",
            provenance="530B on 2240 A100: 54.2% MFU with selective recompute vs 42.1% with full; TP/PP/DP of that run not stated (8x35 assumed from Table 3), batch not stated.",
            flop_convention="full",
            hardware="DGX A100 80GB (Selene)",
        ),
        RunSource(
            key="MCORE_README_H100",
            citation="NVIDIA/Megatron-LM README, images/model_table.png (blob f126c2f, 2024-07-15, MCore r0.8.0)",
            provenance="Weak scaling 2B-462B on H100, V=131072, s=4096, DP=48 throughout; kv heads, ffn, micro-batch, VP and recompute are not published; MFU uses 989 TFLOP/s.",
            flop_convention="full",
            hardware="H100 SXM5 80GB (NVIDIA Eos-class DGX H100)",
        ),
        RunSource(
            key="MCORE_README_STRONG",
            citation="NVIDIA/Megatron-LM README text (MCore r0.8.0), strong scaling",
            provenance="GPT-3 175B with V=131072, batch 1152: 47% MFU on 96 GPUs, 42% on 4608 GPUs; only the endpoints and MFU are published (no layout).",
            flop_convention="full",
            hardware="H100 SXM5 80GB",
        ),
        RunSource(
            key="NEMO_2407",
            citation="NVIDIA/NeMo docs/source/performance/performance_summary.md @ 8e3d65dcfe (NeMo 24.07; file deleted in d31653f792)",
            provenance="DGX-H100 FP8: 12 pretraining + 3 SFT rows (final revision; earlier revisions differ by 1-4.5% for the same configs). Pretraining TFLOP/s = tokens/s x full-s^2 FLOPs/token within 0.1%. The SFT rows count attention over the real (short) SQuAD sequences inside 4096-token packs, so they do not reproduce from s=4096.",
            flop_convention="full",
            hardware="DGX H100 (8x H100 SXM5 80GB, 8x 400 Gb/s)",
        ),
        RunSource(
            key="NEMO_2502_DOCS",
            citation="docs.nvidia.com NeMo Framework 25.02 performance summary",
            provenance="Only the first H100 row (GPT3-175B, 512 GPUs) was retrievable; NeMo 2.0 FLOP callbacks count full s^2 attention (same FLOPs/token as the 24.07 row within 0.1%).",
            flop_convention="full",
            hardware="DGX H100",
        ),
        RunSource(
            key="MOE_MODELZOO_QWEN3",
            citation="yanring/Megatron-MoE-ModelZoo @ e8650517d6, Qwen3 benchmark table",
            provenance="Qwen3-235B-A22B on 256 H100 with several layouts (DeepEP or all-to-all dispatcher, ETP=1); step time published, tokens/s derived as gbs*4096/(step*256), MFU derived as TFLOP/s / 989. TFLOP/s reproduce with Megatron's post-2025-03 formula (causal attention, per-layer MoE). The Qwen3-Next row lacks a shape.",
            flop_convention="causal",
            hardware="H100 SXM (NVLink4, IB 8x 50 GB/s per node)",
        ),
        RunSource(
            key="MBRIDGE_SKILL_MEMTUNE",
            citation="NVIDIA-NeMo/Megatron-Bridge skills/nemo-mbridge-perf-memory-tuning/SKILL.md",
            provenance="Llama3-70B SFT FP8 current scaling, s=4096, 32 H100: measured peak memory and TFLOP/s per layout (golden 709.93 TFLOP/s). Megatron-Bridge counts FLOPs like Megatron-LM HEAD (causal); no tokens/s to check it against.",
            flop_convention="causal",
            hardware="H100 80GB",
        ),
    ]
}


class RunRecipe(BaseModel):
    """Settings the recipe behind a source's rows states and the row's table leaves out (data/run_recipes.json)."""

    model_config = ConfigDict(frozen=True)

    source: str
    models: Literal["*"] | tuple[str, ...] = Field(description="Model labels as published, or '*' for every row of the source.")
    args: dict[str, bool | int | float | str] = Field(description="Megatron-LM argument destinations and values (what megatron_flags.parse reads).")
    mechanism: str
    citation: str
    differs: str | None = Field(None, description="Where Megatron-LM's mechanism is not byte-for-byte the recipe's.")

    def applies(self, run: PublishedRun) -> bool:
        return run.source == self.source and (self.models == "*" or run.model in self.models)


@cache
def run_recipes() -> tuple[RunRecipe, ...]:
    """Every entry of data/run_recipes.json, in the order plan_for_run applies them."""
    text = resources.files(__package__).joinpath("data/run_recipes.json").read_text(encoding="utf-8")
    recipes = tuple(RunRecipe(**r) for r in json.loads(text)["recipes"])
    unknown = sorted({r.source for r in recipes} - set(_SOURCES))
    if unknown:
        raise ValueError(f"data/run_recipes.json: unknown source {unknown}; use one of {sorted(_SOURCES)}")
    return recipes


def _recipe_args(run: PublishedRun, a: list[str]) -> dict:
    """The arguments every recipe entry that applies to the row adds (later entries win), each noted."""
    out: dict = {}
    for r in run_recipes():
        if r.applies(run):
            out.update(r.args)
            a.append(f"from the recipe ({r.citation}): {', '.join(f'{k}={v}' for k, v in r.args.items())}: {r.mechanism}"
                     + (f"; differs: {r.differs}" if r.differs else ""))
    return out


def sources() -> dict[str, RunSource]:
    """Every source key of the published-runs table with its citation and FLOP convention."""
    return dict(_SOURCES)


class PublishedRun(BaseModel):
    """One published measured run. Fields the source does not publish are None."""

    model_config = ConfigDict(frozen=True)

    row: int = Field(description="0-based row in published_runs.csv (stable id with `source`).")
    source: str = Field(description="Source key; see sources().")
    provenance: str = Field(description="Citation and how the row was transcribed or derived.")
    model: str = Field(description="Model label as published.")
    params_b: float | None = Field(description="Parameter count as published, billions.")
    num_layers: int | None
    hidden_size: int | None
    num_attention_heads: int | None
    num_query_groups: int | None = Field(description="K/V heads as published (= heads for MHA); None = not published.")
    ffn_hidden_size: int | None = Field(description="MLP inner size as published (for MoE rows the per-expert size).")
    vocab_size: int | None
    seq_length: int | None
    gpu_label: str = Field(description="GPU as the source names it.")
    gpu: str | None = Field(description="Catalog key for gpu_label (knowledge.hardware), None if unknown.")
    num_gpus: int | None
    tensor_model_parallel_size: int | None
    pipeline_model_parallel_size: int | None
    context_parallel_size: int | None
    expert_model_parallel_size: int | None
    virtual_pipeline_model_parallel_size: int | None
    data_parallel_size: int | None
    micro_batch_size: int | None
    global_batch_size: int | None
    precision_label: str | None = Field(description="Precision as published.")
    precision: Literal["bf16", "fp16", "fp8"] | None = Field(description="Normalized precision; 'fp16' for the A100-era 'FP16 mixed' rows.")
    recompute: str | None = Field(description="Recompute as published ('full', 'selective+SP', 'selective: norm, act', 'none', ...).")
    measured_tflops_per_gpu: float | None = Field(description="TFLOP/s per GPU in `flop_convention`.")
    measured_mfu_pct: float | None = Field(description="MFU (%) as published or derived by the transcriber (see notes).")
    measured_tokens_per_sec_per_gpu: float | None = Field(description="Tokens/s per GPU (some derived; see notes).")
    flop_convention: FlopConvention
    notes: str


def _int(v: str) -> int | None:
    v = v.strip()
    return int(float(v)) if v else None


def _float(v: str) -> float | None:
    v = v.strip()
    return float(v) if v else None


def _precision(label: str) -> Literal["bf16", "fp16", "fp8"] | None:
    t = label.lower()
    if not t:
        return None
    if "fp8" in t:
        return "fp8"
    if t.startswith("bf16"):
        return "bf16"
    if "fp16" in t:
        return "fp16"
    return None


@cache
def published_runs() -> tuple[PublishedRun, ...]:
    """Every row of data/published_runs.csv as a PublishedRun (cached; cheap to call in loops)."""
    text = resources.files(__package__).joinpath("data/published_runs.csv").read_text(encoding="utf-8")
    out = []
    for i, r in enumerate(csv.DictReader(text.splitlines())):
        src = r["source"]
        out.append(
            PublishedRun(
                row=i,
                source=src,
                provenance=_SOURCES[src].citation + ". " + _SOURCES[src].provenance,
                model=r["model"],
                params_b=_float(r["params_b"]),
                num_layers=_int(r["layers"]),
                hidden_size=_int(r["hidden"]),
                num_attention_heads=_int(r["heads"]),
                num_query_groups=_int(r["kv_heads"]),
                ffn_hidden_size=_int(r["ffn"]),
                vocab_size=_int(r["vocab"]),
                seq_length=_int(r["seq_len"]),
                gpu_label=r["gpu"],
                gpu=gpu_key_from_label(r["gpu"]),
                num_gpus=_int(r["num_gpus"]),
                tensor_model_parallel_size=_int(r["tp"]),
                pipeline_model_parallel_size=_int(r["pp"]),
                context_parallel_size=_int(r["cp"]),
                expert_model_parallel_size=_int(r["ep"]),
                virtual_pipeline_model_parallel_size=_int(r["vp"]),
                data_parallel_size=_int(r["dp"]),
                micro_batch_size=_int(r["mbs"]),
                global_batch_size=_int(r["gbs"]),
                precision_label=r["precision"] or None,
                precision=_precision(r["precision"]),
                recompute=r["recompute"] or None,
                measured_tflops_per_gpu=_float(r["tflops_per_gpu"]),
                measured_mfu_pct=_float(r["mfu_pct"]),
                measured_tokens_per_sec_per_gpu=_float(r["tokens_per_sec_per_gpu"]),
                flop_convention=r["flop_convention"],
                notes=r["notes"],
            )
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Row -> Plan
# ---------------------------------------------------------------------------------------------


class RunPlan(BaseModel):
    """A Plan reconstructed from a published run, with every value that was not published."""

    model_config = ConfigDict(frozen=True)

    run: PublishedRun
    catalog_model: str | None = Field(description="Catalog key the row's shape matched, None if the shape is given explicitly.")
    plan: Plan
    assumptions: list[str] = Field(description="Each value filled in because the source does not publish it, and why.")


def _label_key(label: str) -> str:
    # 'LLAMA2-7B SFT' / 'LLAMA3_70B SFT' -> 'llama2-7b' / 'llama3-70b'
    return normalize_key(re.sub(r"\s+sft$", "", label.strip(), flags=re.I))


def _match_catalog(run: PublishedRun) -> tuple[str | None, list[str]]:
    """Catalog key whose resolved shape agrees with every shape field the row publishes."""
    if run.num_layers is None or run.hidden_size is None or run.num_attention_heads is None:
        return None, []
    candidates = []
    for key in model_catalog():
        s = resolve_model(ModelSpec(name=key))
        if (s.num_layers, s.hidden_size, s.num_attention_heads) != (run.num_layers, run.hidden_size, run.num_attention_heads):
            continue
        if run.num_query_groups is not None and s.num_query_groups != run.num_query_groups:
            continue
        if run.vocab_size is not None and s.vocab_size != run.vocab_size:
            continue
        if run.ffn_hidden_size is not None and run.ffn_hidden_size not in (s.ffn_hidden_size, s.moe_ffn_hidden_size):
            continue
        candidates.append(key)
    notes: list[str] = []
    if len(candidates) > 1:
        label = _label_key(run.model)
        named = [k for k in candidates if label == k or label in (normalize_key(a) for a in model_catalog()[k].aliases)]
        chosen = named[0] if named else sorted(candidates)[0]
        shapes = {resolve_model(ModelSpec(name=k)).model_copy(update={"name": None}) for k in candidates}
        if len(shapes) > 1:
            notes.append(f"shape fits several catalog models ({', '.join(sorted(candidates))}); '{chosen}' chosen by the row's label")
        return chosen, notes
    return (candidates[0], notes) if candidates else (None, notes)


def _recompute(run: PublishedRun, assumptions: list[str]) -> dict:
    """Megatron-LM's recompute arguments (and --sequence-parallel) for the row's recompute label."""
    r = (run.recompute or "").strip().lower()
    if not r:
        assumptions.append("recompute not published: none assumed")
        return {}
    if r == "none":
        return {}
    if r == "full":
        method, layers = megatron_flags.FULL_RECOMPUTE_DEFAULT
        assumptions.append(f"full recompute published without method: {method}, {layers} layer per group (every layer) assumed")
        return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}
    if r.startswith("selective"):
        out: dict = {"recompute_granularity": "selective"}
        if "+sp" in r:
            out["sequence_parallel"] = True
            out["recompute_modules"] = ["core_attn"]
        if ":" in r:
            names = {"norm": "layernorm", "act": "moe_act", "shared_expert": "shared_experts", "attn": "core_attn", "mla_up_proj": "mla_up_proj"}
            # Megatron's own --recompute-modules names read as themselves.
            names.update((m, m) for m in ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts"))
            out["recompute_modules"] = [names[m.strip()] for m in r.split(":", 1)[1].split(",") if m.strip() in names]
        return out
    assumptions.append(f"recompute '{run.recompute}' not understood: none assumed")
    return {}


def plan_for_run(run: PublishedRun) -> RunPlan | None:
    """Turn a published run into a complete Plan, or None when the row lacks what a Plan needs
    (model shape, a catalog GPU, num_gpus, TP and PP, sequence length, global batch).

    The model is the matching catalog entry when the row's shape fits one, else an explicit
    shape from the row. Unpublished values take Megatron/recipe defaults, each listed in
    `assumptions` (e.g. micro-batch 1).
    """
    a: list[str] = []
    if run.gpu is None or run.num_gpus is None or run.seq_length is None or run.global_batch_size is None:
        return None
    tp, pp = run.tensor_model_parallel_size, run.pipeline_model_parallel_size
    if tp is None or pp is None:
        return None
    key, notes = _match_catalog(run)
    a.extend(notes)
    if key is not None:
        model = ModelSpec(name=key)
        if run.vocab_size is None:
            a.append(f"vocab_size not published: catalog '{key}' value {resolve_model(model).vocab_size} used")
    elif run.num_layers and run.hidden_size and run.num_attention_heads and run.vocab_size:
        if run.num_query_groups is None:
            a.append("kv heads not published: MHA assumed")
        if run.ffn_hidden_size is None:
            a.append("ffn not published: 4h assumed")
        a.append("architecture details not published: Megatron GPT defaults (GeLU, LayerNorm, biases, RoPE, tied embeddings)")
        model = ModelSpec(
            num_layers=run.num_layers,
            hidden_size=run.hidden_size,
            num_attention_heads=run.num_attention_heads,
            num_query_groups=run.num_query_groups,
            ffn_hidden_size=run.ffn_hidden_size,
            vocab_size=run.vocab_size,
        )
    else:
        return None

    mbs = run.micro_batch_size
    if mbs is None:
        mbs = 1
        a.append("micro_batch_size not published: 1 assumed")
    cp = run.context_parallel_size or 1
    if run.context_parallel_size is None:
        a.append("context_parallel_size not published: 1 assumed")
    if pp > 1 and run.virtual_pipeline_model_parallel_size is None:
        a.append("virtual pipeline size not published: non-interleaved 1F1B assumed")
    derived_dp = run.num_gpus // (tp * pp * cp)
    if run.data_parallel_size is not None and run.data_parallel_size != derived_dp:
        a.append(f"published DP {run.data_parallel_size} != num_gpus/(TP*PP*CP) = {derived_dp}")

    args: dict = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "num_virtual_stages_per_pipeline_rank": run.virtual_pipeline_model_parallel_size,
        "context_parallel_size": cp,
        "expert_model_parallel_size": run.expert_model_parallel_size or 1,
        "seq_length": run.seq_length, "global_batch_size": run.global_batch_size, "micro_batch_size": mbs,
    }
    m = re.search(r"ETP=(\d+)", run.notes)
    if m:
        args["expert_tensor_parallel_size"] = int(m.group(1))
    recipe = _recipe_args(run, a)
    if "recompute_granularity" not in recipe:
        args.update(_recompute(run, a))
    args.update(_pipeline_split(resolve_model(model).num_layers, pp, run.virtual_pipeline_model_parallel_size or 1, a))
    args.update(_layout_practice(run, tp, "sequence_parallel" in args, a))
    args.update(_precision_args(run, a))
    args.update(_implementation_args(run, a))
    args.update(recipe)
    sections = megatron_flags.parse(args).sections
    impl = sections["implementation"]
    if "passes with pytorch_cuda_alloc_conf=expandable_segments:true" in run.notes.lower():
        # the measured (passing) run is the one with expandable segments (an environment variable, not a flag)
        impl["expandable_segments"] = True
    # No data-loader masks: Megatron-Bridge recipes skip them (skip_getting_attention_mask_from_dataset, its
    # --no-create-attention-mask-in-dataloader); the papers' Megatron built the causal mask on the GPU.
    impl["create_attention_mask_in_dataloader"] = False
    # Published runs ran on bare-metal DGX/HGX hosts, not on the VMs the catalog's host figure is from.
    a.append(f"bare-metal host: host_floor_ms_per_layer {BARE_METAL_HOST_FLOOR_MS} (the catalog's figure is this "
             "workplace's VMs')")
    plan = Plan(model=model, cluster={"gpu": run.gpu, "num_gpus": run.num_gpus,
                                      "host_floor_ms_per_layer": BARE_METAL_HOST_FLOOR_MS},
                training=sections["training"], parallelism=sections["parallelism"], implementation=impl)
    return RunPlan(run=run, catalog_model=key, plan=plan, assumptions=a)


def _pipeline_split(num_layers: int, pp: int, vp: int, a: list[str]) -> dict:
    """Megatron's embedding/loss-aware split when the layers alone do not divide over PP x VP chunks.

    A row that ran needs a split Megatron builds: an even one, or (num_layers + 2) over PP x VP with
    --account-for-embedding/loss-in-pipeline-split (Megatron-Bridge/MoE-recipe practice, e.g. Qwen3-235B's
    94 layers on PP8 VP4). decoder_first/last_pipeline_num_layers need each stage divisible by VP too.
    """
    if pp == 1 or num_layers % (pp * vp) == 0 or (num_layers + 2) % (pp * vp):
        return {}
    a.append(f"pipeline split not published: {num_layers} layers do not divide over PP {pp} x VP {vp}; "
             "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split assumed")
    return {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}


def _layout_practice(run: PublishedRun, tp: int, sp_published: bool, a: list[str]) -> dict:
    """--sequence-parallel (unless the recompute label gave it) and --use-distributed-optimizer as the row's era ran them."""
    out: dict = {}
    paper_era = run.source.startswith(("NARAYANAN21", "KORTHIKANTI22"))
    if not sp_published:
        if paper_era:
            # SP is Korthikanti 2022's contribution: Narayanan had none, Korthikanti's baselines run without it.
            out["sequence_parallel"] = False
        else:
            out["sequence_parallel"] = tp > 1
            if tp > 1:
                a.append("sequence parallelism not published: on with TP > 1 assumed (Megatron/NeMo recipe practice)")
    if paper_era:
        # Megatron's distributed optimizer postdates both papers; each DP rank held full Adam state.
        out["use_distributed_optimizer"] = False
        a.append("distributed optimizer off: it postdates the 2021/2022 papers")
    return out


def _precision_args(run: PublishedRun, a: list[str]) -> dict:
    """--fp8-format / --fp8-recipe / --fp8-param-gather for the row's precision label (bf16 otherwise)."""
    out: dict = {}
    if run.precision == "fp8":
        out["fp8"] = "hybrid"
        if "cs" in (run.precision_label or "").lower():
            # Bridge 'FP8-CS' = per-tensor current scaling; bf16_with_fp8_current_scaling_mixed(): fp8_param_gather = True
            out.update(fp8_recipe="tensorwise", fp8_param_gather=True)
            a.append("FP8-CS as Megatron-Bridge's bf16_with_fp8_current_scaling_mixed: tensorwise recipe, fp8_param_gather")
        else:
            a.append("FP8 recipe not published: delayed scaling, hybrid format assumed (TE default of that era)")
    elif run.precision == "fp16":
        a.append("FP16 mixed precision modelled as bf16 (same tensor-core peak and bytes per element)")
    elif run.precision is None:
        a.append("precision not published: bf16 assumed")
    if "not stated" in (run.precision_label or "").lower():
        a.append(f"precision not stated by the source ('{run.precision_label}'): {'fp8' if 'fp8' in out else 'bf16'} assumed")
    return out


def _implementation_args(run: PublishedRun, a: list[str]) -> dict:
    """Dispatcher, FSDP and gradient-reduction arguments the row's notes and source imply."""
    out: dict = {}
    notes_l = run.notes.lower()
    if "deepep" in notes_l:
        out["moe_token_dispatcher_type"] = "flex"
    elif "a2a" in notes_l or "alltoall" in notes_l:
        out["moe_token_dispatcher_type"] = "alltoall"
    if "a2a overlap" in notes_l:
        # the row's '1F1B A2A overlap': Megatron's combined 1F1B schedule, with the expert weight gradients
        # delayed under the backward's dispatch as the recipes that switch it on do (Bridge's moe_a2a_overlap)
        out.update(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
        a.append("1F1B A2A overlap as --overlap-moe-expert-parallel-comm with --delay-wgrad-compute")
    if "megatron-fsdp on" in notes_l:
        # Megatron-LM's own FSDP (--use-megatron-fsdp), not torch FSDP2 (which rejects EP).
        out["use_megatron_fsdp"] = True
        strategy = ImplementationSpec.model_fields["data_parallel_sharding_strategy"].default
        a.append(f"Megatron-FSDP sharding strategy not published: Megatron-LM's default {strategy} assumed")
    if run.source.startswith(("NEMO_", "MBRIDGE_")):
        # NeMo/Megatron-Bridge performance recipes turn fp32 gradient reduction off
        # (scripts/performance helpers: plugins.grad_reduce_in_fp32 = False).
        out["grad_reduce_in_bf16"] = True
        a.append("gradients reduced in bf16 (NeMo/Bridge performance-recipe setting; not in the table)")
    return out


def run_to_plan(run: PublishedRun) -> Plan | None:
    """The Plan of `plan_for_run` (None when the row lacks what a Plan needs); see its assumptions there."""
    rp = plan_for_run(run)
    return rp.plan if rp else None
