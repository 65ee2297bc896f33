"""validate() as a whole: a good plan is clean, all problems come back at once, bad names raise."""

from __future__ import annotations

import pathlib
import random

import pytest

from mcore_advisor.schemas import Finding, Plan
from mcore_advisor.validators import AREAS, RULES, errors, rule_names, validate


def test_llama3_70b_on_64_h100_with_tp8_pp2_sp_has_no_errors_and_no_noise(kit):
    # TP8 within a node, PP2 (40 layers each), DP4, SP, GBS 128 = 32 micro-batches of 1 x 8192 tokens.
    findings = validate(kit.plan())
    assert errors(findings) == []
    assert [f.code for f in findings] == ["vocab_padded"]


def test_three_independent_problems_give_three_errors_in_one_call(kit):
    p = kit.plan(
        cluster={"gpu": "a100-80gb"},
        training={"global_batch_size": 102, "precision": "fp8"},
        parallelism={"recompute_granularity": "selective", "recompute_method": "uniform"},
    )
    errs = errors(validate(p))
    assert sorted(f.code for f in errs) == [
        "fp8_needs_hopper",
        "global_batch_not_divisible",
        "selective_recompute_with_method",
    ]


def test_unknown_model_raises_keyerror_naming_known_models(kit):
    with pytest.raises(KeyError, match="llama3"):
        validate(kit.plan(model={"name": "llama3-13b"}))


def test_unknown_gpu_raises_keyerror_listing_known_gpus(kit):
    with pytest.raises(KeyError, match="h100-sxm"):
        validate(kit.plan(cluster={"gpu": "v100"}))


def test_model_without_required_fields_raises_valueerror(kit):
    with pytest.raises(ValueError, match="model.num_layers"):
        validate(kit.plan(model={"hidden_size": 4096}))


def test_validate_is_pure_and_repeatable(kit):
    p = kit.plan(training={"global_batch_size": 102})
    before = p.model_dump()
    assert validate(p) == validate(p)
    assert p.model_dump() == before


def test_errors_keeps_only_errors():
    fs = [
        Finding(code="a", severity="error", fields=[], message="m"),
        Finding(code="b", severity="warning", fields=[], message="m"),
        Finding(code="c", severity="info", fields=[], message="m"),
    ]
    assert [f.code for f in errors(fs)] == ["a"]


def test_rule_codes_are_unique_and_ordered_by_area():
    codes = rule_names()
    assert len(codes) == len(set(codes)) == len(RULES)
    areas = [r.area for r in RULES]
    assert areas == sorted(areas, key=AREAS.index)
    assert set(rule_names(severity="error")) < set(codes)
    assert rule_names(area="batch") == [
        "global_batch_not_divisible",
        "interleaved_microbatches_not_divisible_by_pp",
        "pipeline_bubble",
    ]


def test_every_finding_names_dotted_plan_fields_that_exist(kit):
    # A plan that trips many rules at once; every field a finding names must be a real Plan path.
    p = kit.plan(
        cluster={"num_gpus": 63},
        training={"seq_length": 4100, "precision": "fp8", "fp8_param_gather": True},
        parallelism={
            "tensor_model_parallel_size": 3,
            "pipeline_model_parallel_size": 3,
            "virtual_pipeline_model_parallel_size": 3,
            "context_parallel_size": 2,
            "recompute_granularity": "full",
            "use_distributed_optimizer": False,
        },
        implementation={"transformer_impl": "local", "attention_backend": "flash"},
    )
    findings = validate(p)
    assert len(errors(findings)) >= 10
    for f in findings:
        for field in f.fields:
            section, name = field.split(".")
            assert name in Plan.model_fields[section].annotation.model_fields, field
        if f.severity == "error":
            assert f.fix, f.code


def test_every_rule_has_a_test_naming_its_code():
    here = pathlib.Path(__file__).parent
    text = "".join(p.read_text() for p in here.glob("test_*_rules.py"))
    missing = [c for c in rule_names() if f'"{c}"' not in text]
    assert missing == []


def test_findings_on_random_plans_name_real_fields_and_errors_carry_fixes(kit):
    rng = random.Random(7)
    seen: set[str] = set()
    for _ in range(400):
        p = kit.plan(
            model=rng.choice([{"name": "llama3-70b"}, kit.MIXTRAL, kit.DSV2_LITE]),
            cluster={
                "gpu": rng.choice(["h100-sxm", "a100-80gb"]),
                "num_gpus": rng.choice([8, 12, 16, 63, 64]),
            },
            training={
                "seq_length": rng.choice([4096, 4100]),
                "global_batch_size": rng.choice([4, 100, 128]),
                "precision": rng.choice(["bf16", "fp8"]),
            },
            parallelism={
                "tensor_model_parallel_size": rng.choice([1, 2, 3, 8, 16]),
                "pipeline_model_parallel_size": rng.choice([1, 2, 3]),
                "virtual_pipeline_model_parallel_size": rng.choice([None, 2]),
                "context_parallel_size": rng.choice([1, 2]),
                "expert_model_parallel_size": rng.choice([1, 2, 16]),
                "sequence_parallel": rng.random() < 0.5,
                "recompute_granularity": rng.choice([None, "full", "selective"]),
            },
            implementation={"transformer_impl": rng.choice(["transformer_engine", "local"])},
        )
        for f in validate(p):
            seen.add(f.code)
            assert f.message
            for field in f.fields:
                section, name = field.split(".")
                assert name in Plan.model_fields[section].annotation.model_fields, (f.code, field)
            if f.severity == "error":
                assert f.fix, f.code
    assert len(seen) > 35
