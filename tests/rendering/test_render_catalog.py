"""Every catalog model's rendered script trains the catalog's model: each setting the catalog gives reaches
its Megatron-LM flag with the catalog's value (or the script's notes say why it cannot), dropout is explicit,
and Megatron-LM 0.19.2's own parser, validator and TransformerConfig accept every script."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_advisor.knowledge.models import model_catalog, resolve_model
from mcore_advisor.rendering.render import render_launch_script
from mcore_advisor.rendering.request import RenderRequest
from mcore_advisor.schemas import ModelSpec, Plan

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "megatron_args_check.py"

# Catalog field -> the pretrain_gpt.py / pretrain_hybrid.py flag that carries it (megatron/training/arguments.py, 0.19.2).
VALUE_FLAGS = {
    "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent",
    "norm_epsilon": "--norm-epsilon",
    "moe_router_score_function": "--moe-router-score-function",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups",
    "moe_router_group_topk": "--moe-router-group-topk",
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type",
    "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "q_lora_rank": "--q-lora-rank",
    "kv_lora_rank": "--kv-lora-rank",
    "qk_head_dim": "--qk-head-dim",
    "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim",
    "v_head_dim": "--v-head-dim",
    "mtp_num_layers": "--mtp-num-layers",
    "num_experts": "--num-experts",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "hybrid_layer_pattern": "--hybrid-layer-pattern",
    "mamba_num_heads": "--mamba-num-heads",
    "mamba_head_dim": "--mamba-head-dim",
    "mamba_state_dim": "--mamba-state-dim",
    "mamba_num_groups": "--mamba-num-groups",
}
SWITCH_FLAGS = {
    "qk_layernorm": "--qk-layernorm",
    "squared_relu": "--squared-relu",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "multi_latent_attention": "--multi-latent-attention",
    "swiglu": "--swiglu",
}

MODELS = sorted(model_catalog())
HYBRID_MODELS = sorted(k for k, m in model_catalog().items() if m.spec.hybrid_layer_pattern)


def _plan(key: str) -> Plan:
    return Plan(model={"name": key}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
                training={"seq_length": 4096, "global_batch_size": 64})


def _values(argv: list[str], flag: str) -> list[str]:
    assert flag in argv, f"{flag} missing"
    i = argv.index(flag)
    out = []
    for tok in argv[i + 1:]:
        if tok.startswith("--"):
            break
        out.append(tok)
    return out


def _same(text: str, value: object) -> bool:
    if isinstance(value, bool) or isinstance(value, str):
        return text == str(value)
    return float(text) == pytest.approx(float(value), rel=1e-6)


@pytest.mark.parametrize("key", MODELS)
def test_every_catalog_setting_reaches_its_flag(key):
    spec = model_catalog()[key].spec.model_dump(exclude_none=True)
    art = render_launch_script(RenderRequest(plan=_plan(key), allow_invalid=True))
    argv = art.megatron_args
    for field, flag in VALUE_FLAGS.items():
        if field in spec and not (field == "mtp_num_layers" and spec[field] == 0):
            (got,) = _values(argv, flag)
            assert _same(got, spec[field]), (field, got, spec[field])
    for field, flag in SWITCH_FLAGS.items():
        if spec.get(field):
            assert flag in argv and _values(argv, flag) == [], field
    shape = resolve_model(ModelSpec(name=key))
    if shape.multi_latent_attention:
        assert "--qk-layernorm" in argv  # Megatron builds MLA's latent norms only with it
    factor = spec.get("rope_scaling_factor")
    if factor is not None:
        kind = spec.get("rope_scaling_type") or ("yarn" if shape.multi_latent_attention else "llama3")
        if kind == "llama3":
            assert "--use-rope-scaling" in argv and _same(_values(argv, "--rope-scaling-factor")[0], factor)
        elif shape.multi_latent_attention:
            assert _same(_values(argv, "--rotary-scaling-factor")[0], factor)
        else:  # YaRN for standard attention: pretrain_gpt.py has no flag, the script says so
            assert any("rope_scaling_factor" in n and "not passed" in n for n in art.notes)
            assert "--use-rope-scaling" not in argv
    # Dropout always explicit, at the plan's value (Megatron's default is 0.1).
    assert _values(argv, "--attention-dropout") == ["0"] and _values(argv, "--hidden-dropout") == ["0"]
    if shape.is_moe and "moe_aux_loss_coeff" not in spec:
        assert any("moe_aux_loss_coeff" in n for n in art.notes)


def test_llama3_script_carries_its_rope_base_and_llama31_its_scaling():
    # meta-llama config.json: rope_theta 500000; Llama 3.1 adds rope_scaling llama3 factor 8.
    argv3 = render_launch_script(RenderRequest(plan=_plan("llama3-70b"), allow_invalid=True)).megatron_args
    argv31 = render_launch_script(RenderRequest(plan=_plan("llama3.1-405b"), allow_invalid=True)).megatron_args
    assert _values(argv3, "--rotary-base") == ["500000"] and "--use-rope-scaling" not in argv3
    assert _values(argv31, "--rope-scaling-factor") == ["8"] and "--use-rope-scaling" in argv31


def test_plan_dropout_is_rendered():
    plan = _plan("llama3-8b").model_copy(update={"training": _plan("llama3-8b").training.model_copy(
        update={"attention_dropout": 0.1, "hidden_dropout": 0.05})})
    argv = render_launch_script(RenderRequest(plan=plan, allow_invalid=True)).megatron_args
    assert _values(argv, "--attention-dropout") == ["0.1"] and _values(argv, "--hidden-dropout") == ["0.05"]


@pytest.mark.parametrize("key", HYBRID_MODELS)
def test_hybrid_models_run_pretrain_hybrid_and_gpt_models_pretrain_gpt(key):
    art = render_launch_script(RenderRequest(plan=_plan(key), allow_invalid=True))
    assert art.program[0].endswith("/pretrain_hybrid.py") and "--hybrid-layer-pattern" in art.megatron_args
    gpt = render_launch_script(RenderRequest(plan=_plan("llama3-8b"), allow_invalid=True))
    assert gpt.program[0].endswith("/pretrain_gpt.py") and "--hybrid-layer-pattern" not in gpt.megatron_args


def _check_module():
    spec = importlib.util.spec_from_file_location("megatron_args_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_megatron_accepts_every_catalog_script_and_the_representative_set(tmp_path):
    """megatron.training.arguments.parse_args + validate_args + core_transformer_config_from_args on
    every catalog model's argv and the benchmark's representative / recommended files, in one process."""
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core with megatron.training is not installed")
    mod = _check_module()
    files = sorted(mod.ARGS_DIR.glob("*.txt"))
    for key in MODELS:
        path = tmp_path / f"catalog_{key}.txt"
        path.write_text(mod.args_file_text(f"catalog_{key}", _plan(key), {"allow_invalid": True}))
        files.append(path)
    r = subprocess.run([sys.executable, str(CHECK), "--batch", *map(str, files)], capture_output=True, text=True,
                       timeout=900, cwd=tmp_path)
    failures = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert r.returncode == 0 and not failures, "\n".join(failures) or r.stderr[-2000:]
    assert f"{len(files)}/{len(files)} passed" in r.stdout
