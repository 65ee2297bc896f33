"""model.moe_router_pre_softmax reaches --moe-router-pre-softmax (and only when true), reads back from
Megatron's arguments, and Megatron-LM 0.19.2's own parser, validate_args and TransformerConfig agree with
the validator on top-1 routing: they accept the rendered argv exactly where the plan has no
router_top1_needs_pre_softmax error, and otherwise fail with the message the rule quotes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.rendering.render import render_launch_script
from mcore_advisor.rendering.request import RenderRequest
from mcore_advisor.schemas import Plan
from mcore_advisor.validators import validate

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "megatron_args_check.py"
FLAG = "--moe-router-pre-softmax"
CODE = "router_top1_needs_pre_softmax"

# Mixtral 8x7B's shape (mistralai/Mixtral-8x7B-v0.1 config.json) with the router changed per case.
MOE = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
           vocab_size=32000, swiglu=True, normalization="RMSNorm", untie_embeddings_and_output_weights=True,
           num_experts=8, moe_aux_loss_coeff=0.01)

CASES = {
    "top1_softmax": dict(moe_router_topk=1),
    "top1_pre_softmax": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "top1_sigmoid": dict(moe_router_topk=1, moe_router_score_function="sigmoid"),
    "top1_sinkhorn": dict(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=None),
    "top2_softmax": dict(moe_router_topk=2),
}


def _plan(model: dict) -> Plan:
    return Plan.model_validate({
        "model": model, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
        "training": {"seq_length": 4096, "global_batch_size": 64},
        "parallelism": {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 8}})


def _moe_plan(case: str) -> Plan:
    return _plan({k: v for k, v in {**MOE, **CASES[case]}.items() if v is not None})


def _argv(plan: Plan) -> list[str]:
    return list(render_launch_script(RenderRequest(plan=plan, allow_invalid=True)).megatron_args)


@pytest.mark.parametrize("value, rendered", [(True, True), (False, False), (None, False)])
def test_the_flag_is_rendered_only_when_the_field_is_true(value, rendered):
    argv = _argv(_plan({**MOE, "moe_router_topk": 1, "moe_router_pre_softmax": value}))
    assert (FLAG in argv) is rendered
    if rendered:  # a switch: no value follows it
        assert argv[argv.index(FLAG) + 1].startswith("--")


def test_a_dense_model_never_gets_the_flag():
    dense = {k: v for k, v in MOE.items() if k not in ("num_experts", "moe_aux_loss_coeff")}
    assert FLAG not in _argv(_plan({**dense, "moe_router_pre_softmax": True}))


def test_parsed_arguments_read_back_true_and_megatrons_default_as_unset():
    on = megatron_flags.parse({"num_experts": "8", "moe_router_pre_softmax": "True"}).sections["model"]
    off = megatron_flags.parse({"num_experts": "8", "moe_router_pre_softmax": "False"}).sections["model"]
    dense = megatron_flags.parse({"num_experts": "None", "moe_router_pre_softmax": "True"}).sections["model"]
    assert on["moe_router_pre_softmax"] is True
    assert "moe_router_pre_softmax" not in off  # False is Megatron's default: the plan's None
    assert "moe_router_pre_softmax" not in dense  # the MoE gate is closed


def _check_module():
    spec = importlib.util.spec_from_file_location("megatron_args_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_megatron_accepts_top1_scripts_exactly_where_the_validator_does(tmp_path):
    if importlib.util.find_spec("megatron.training") is None:
        pytest.skip("megatron-core with megatron.training is not installed")
    mod = _check_module()
    files, flagged = [], {}
    for case in CASES:
        plan = _moe_plan(case)
        flagged[case] = CODE in {f.code for f in validate(plan)}
        path = tmp_path / f"{case}.txt"
        path.write_text(mod.args_file_text(case, plan, {"allow_invalid": True}))
        files.append(path)
    assert flagged == {"top1_softmax": True, "top1_pre_softmax": False, "top1_sigmoid": False,
                       "top1_sinkhorn": False, "top2_softmax": False}
    r = subprocess.run([sys.executable, str(CHECK), "--batch", *map(str, files)], capture_output=True, text=True,
                       timeout=900, cwd=tmp_path)
    verdicts = {ln.split()[1].removesuffix(".txt"): ln for ln in r.stdout.splitlines() if ln.startswith(("OK", "FAIL"))}
    assert set(verdicts) == set(CASES), r.stdout + r.stderr[-2000:]
    for case, line in verdicts.items():
        if flagged[case]:
            assert line.startswith("FAIL") and "[config]" in line, line
            assert "Please use --moe-router-pre-softmax when topk is 1." in line, line
        else:
            assert line.startswith("OK"), line
