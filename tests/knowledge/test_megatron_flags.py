"""The Plan <-> Megatron-LM table (knowledge/megatron_flags.py): every plan field is in it or named as
not a flag; every catalog model's rendered argv, read back by the log parser, gives the plan it was
rendered from, field by field; and every flag, destination, kind and default in the table is Megatron-LM
0.19.2's (its own parser; the slow tests)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys

import pytest

from mcore_advisor.diagnosis.logparse import parse_log, plan_from_megatron_args
from mcore_advisor.knowledge import megatron_flags as T
from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import model_catalog, resolve_model
from mcore_advisor.rendering.megatron_args import as_rendered
from mcore_advisor.rendering.render import render_launch_script
from mcore_advisor.rendering.request import RenderRequest
from mcore_advisor.schemas import MODEL_SETTINGS, Plan

#: Plan fields that are not Megatron-LM arguments, and why.
NOT_FLAGS = {
    "model.name": "a catalog key: rendering writes the resolved shape",
    "model.hf_config": "a Hugging Face config: rendering writes the resolved shape",
    "cluster.gpu": "the machine, not an argument", "cluster.num_gpus": "WORLD_SIZE from the launcher",
    "cluster.gpus_per_node": "the launcher's layout", "cluster.nvlink_bandwidth_gbps": "a model input",
    "cluster.scaleout_bandwidth_gbps": "a model input", "cluster.gpu_memory_gib": "a model input",
    "cluster.host_floor_ms_per_layer": "a model input",
    "implementation.expandable_segments": "PYTORCH_CUDA_ALLOC_CONF, an environment variable",
    "implementation.cublaslt_heuristics_cache_capacity": "CUBLASLT_HEURISTICS_CACHE_CAPACITY, an environment variable",
    "implementation.moe_routing_imbalance": "a model input (measured routing)",
    "implementation.moe_expert_load_cv": "a model input (measured routing)",
    "implementation.moe_heuristic_miss_share": "a model input (measured routing)",
}

CATALOG = sorted(model_catalog())
ARCH = {"hopper": 9, "blackwell": 10, "ampere": 8}


def _plan(key: str, **sections) -> Plan:
    base = {"model": {"name": key}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "training": {"seq_length": 4096, "global_batch_size": 64}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Plan.model_validate(base)


#: Flag families beyond the defaults: interleaved and uneven pipelines, recompute, FP8, MoE layouts,
#: the local spec, fusions off, bf16 gradients, manual GC, dropout. (name, plan, render options)
def _variants() -> list[tuple[str, Plan, dict]]:
    return [
        ("llama3-70b_pp4_vp5_fp8_tpoverlap", _plan(
            "llama3-70b", cluster={"num_gpus": 64},
            training={"precision": "fp8", "fp8_param_gather": True, "fp8_recipe": "tensorwise", "fp8_format": "e4m3"},
            parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
                         "virtual_pipeline_model_parallel_size": 5, "sequence_parallel": True, "tp_comm_overlap": True}), {}),
        ("mixtral-8x7b_ep8_etp1_dispatcher", _plan(
            "mixtral-8x7b", cluster={"num_gpus": 64},
            parallelism={"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8,
                         "expert_tensor_parallel_size": 1, "sequence_parallel": True},
            implementation={"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False}), {}),
        ("deepseek-v3_uneven_pp_selective", _plan(
            "deepseek-v3", cluster={"num_gpus": 1024}, training={"global_batch_size": 1024},
            parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 8,
                         "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 6,
                         "expert_model_parallel_size": 64, "expert_tensor_parallel_size": 1, "sequence_parallel": True,
                         "recompute_granularity": "selective", "recompute_modules": ["mla_up_proj", "moe_act", "layernorm"]}), {}),
        ("llama3-8b_cp4_full_recompute", _plan(
            "llama3-8b", cluster={"num_gpus": 16}, training={"seq_length": 32768, "global_batch_size": 32},
            parallelism={"tensor_model_parallel_size": 2, "context_parallel_size": 4, "sequence_parallel": True,
                         "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}), {}),
        ("gpt3-1.3b_local_unfused_fusions_off", _plan(
            "gpt3-1.3b", training={"seq_length": 2048, "global_batch_size": 512, "micro_batch_size": 4,
                                   "attention_dropout": 0.1, "hidden_dropout": 0.05},
            parallelism={"use_distributed_optimizer": False, "overlap_grad_reduce": False, "overlap_param_gather": False},
            implementation={"transformer_impl": "local", "attention_backend": "unfused", "grad_reduce_in_fp32": False,
                            "attention_softmax_in_fp32": True, "masked_softmax_fusion": False,
                            "bias_activation_fusion": False, "bias_dropout_fusion": False,
                            "check_for_nan_in_loss_and_grad": False, "manual_gc": True, "manual_gc_interval": 100}),
         {"apex_installed": True}),
        ("qwen3-8b_te_fusions_off_fused_loss", _plan(
            "qwen3-8b", parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True},
            implementation={"apply_rope_fusion": False, "bias_activation_fusion": False, "attention_backend": "flash",
                            "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te",
                            "gradient_accumulation_fusion": False}), {}),
        # Megatron-FSDP with EP (experts sharded over expert-DP) and the precision-aware optimizer's bf16 moments;
        # TP 1: Megatron-FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS != 1, which TP > 1 sets before Blackwell.
        ("mixtral-8x7b_megatron_fsdp_optim_grads_ep8", _plan(
            "mixtral-8x7b", cluster={"num_gpus": 64},
            parallelism={"expert_model_parallel_size": 8},
            implementation={"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads",
                            "grad_reduce_in_fp32": False}), {}),
        ("llama3-8b_precision_aware_bf16_moments", _plan(
            "llama3-8b", implementation={"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16",
                                         "exp_avg_sq_dtype": "bf16"}), {}),
        ("llama3-8b_fsdp2", _plan(
            "llama3-8b", parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False},
            implementation={"use_torch_fsdp2": True}), {"apex_installed": True}),
        # Hybrid Mamba models (pretrain_hybrid.py): the uneven split travels as the pattern's '|' stages.
        ("nemotron-h-8b_tp2_pp2_first24", _plan(
            "nemotron-h-8b", cluster={"num_gpus": 16},
            parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                         "decoder_first_pipeline_num_layers": 24, "sequence_parallel": True}), {}),
        ("nemotron-h-56b_pp4_last28", _plan(
            "nemotron-h-56b", cluster={"num_gpus": 32},
            parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
                         "decoder_last_pipeline_num_layers": 28, "sequence_parallel": True}), {}),
        # Megatron-Bridge's MoE benchmark settings: the combined 1F1B all-to-all overlap, and token drop padded
        ("qwen3-30b-a3b_ep8_a2a_overlap_delay_wgrad", _plan(
            "qwen3-30b-a3b", cluster={"num_gpus": 16},
            parallelism={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 12,
                         "expert_model_parallel_size": 8},
            implementation={"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True,
                            "moe_router_force_load_balancing": True, "moe_permute_fusion": True}), {}),
        ("qwen3-30b-a3b_ep8_tokendrop_padded", _plan(
            "qwen3-30b-a3b", parallelism={"expert_model_parallel_size": 8},
            implementation={"moe_expert_capacity_factor": 1.25, "moe_pad_expert_input_to_capacity": True}), {}),
        ("nemotron-3-nano_ep8_local_impl", _plan(
            "nemotron-3-nano-30b-a3b", parallelism={"expert_model_parallel_size": 8},
            implementation={"transformer_impl": "local"}), {"apex_installed": True}),
    ] + [(f"catalog_{k}", _plan(k), {}) for k in CATALOG]


def _rendered(plan: Plan, opts: dict):
    return render_launch_script(RenderRequest(plan=plan, launcher="slurm", allow_invalid=True, **opts))


def _not_carried(plan: Plan, notes: list[str]) -> set[str]:
    """Fields the flags cannot carry for this plan, each by a documented Megatron rule (or the script's notes)."""
    shape = resolve_model(plan.model)
    out = {f"model.{n}" for n in ("rotary_base", "rotary_percent", "rope_scaling_factor")
           if any(n in note and "not passed" in note for note in notes)}
    if "model.rope_scaling_factor" in out:
        out.add("model.rope_scaling_type")
    if plan.implementation.transformer_impl == "local" or shape.position_embedding_type != "rope":
        # the local spec always runs with --no-rope-fusion; validate_args clears it without RoPE
        out.add("implementation.apply_rope_fusion")
    return out


def _effective(path: str, value, shape) -> object:
    """A field's value as Megatron runs it: None is Megatron's default for the model settings."""
    name = path.split(".")[1]
    if value is None and name in MODEL_SETTINGS:
        row = next((r for r in T.TABLE if isinstance(r, T.Entry) and r.field == path), None)
        if row is not None:
            return row.arg.default
    if name == "rope_scaling_type" and shape.rope_scaling_factor is not None:
        return T.rope_scaling_kind(shape)
    return value


def _differences(expected: Plan, got: Plan, not_carried: set[str]) -> list[str]:
    out = []
    es, gs = resolve_model(expected.model), resolve_model(got.model)
    for name in type(es).model_fields:
        path = f"model.{name}"
        if name == "name" or path in not_carried:
            continue
        e, g = _effective(path, getattr(es, name), es), _effective(path, getattr(gs, name), gs)
        if e != g and not (isinstance(e, float) and g == pytest.approx(e, rel=1e-6)):
            out.append(f"{path}: rendered {e!r}, read back {g!r}")
    catalog_seq_max = model_catalog()[expected.model.name].spec.seq_length_max
    seq_max = max(expected.training.seq_length, catalog_seq_max or 0)
    if got.model.seq_length_max != seq_max:
        out.append(f"model.seq_length_max: rendered {seq_max}, read back {got.model.seq_length_max}")
    for section in ("training", "parallelism", "implementation"):
        e, g = getattr(expected, section).model_dump(), getattr(got, section).model_dump()
        out += [f"{section}.{k}: rendered {e[k]!r}, read back {g[k]!r}" for k in e
                if e[k] != g[k] and f"{section}.{k}" not in not_carried and f"{section}.{k}" not in NOT_FLAGS]
    if got.cluster.num_gpus != expected.cluster.num_gpus:
        out.append(f"cluster.num_gpus: {expected.cluster.num_gpus} -> {got.cluster.num_gpus}")
    return out


def _round_trip(dump_of) -> list[str]:
    """Every variant: rendered argv -> `dump_of(argv, plan, artifact)` (an arguments dump as text) ->
    parse_log -> plan_from_megatron_args, compared with the plan as rendered."""
    failures = []
    for name, plan, opts in _variants():
        art = _rendered(plan, opts)
        expected = as_rendered(plan, apex=bool(opts.get("apex_installed"))).plan
        parsed = parse_log(dump_of(list(art.megatron_args), plan, art))
        got, _ = plan_from_megatron_args(parsed.megatron_args, gpu=plan.cluster.gpu)
        failures += [f"{name}: {d}" for d in _differences(expected, got, _not_carried(plan, art.notes))]
    return failures


# --------------------------------------------------------------------------- without Megatron

def test_every_plan_field_is_in_the_table_or_named_as_not_a_flag():
    fields = {f"{s}.{n}" for s, cls in T._SECTIONS.items() for n in cls.model_fields}
    assert fields - T.plan_fields() == set(NOT_FLAGS), "a new plan field needs a table row (or a reason here)"
    assert not T.plan_fields() - fields


def test_each_field_and_each_flag_has_one_row():
    fields = [f for row in T.TABLE for f in ((row.field,) if isinstance(row, T.Entry) else row.fields)]
    flags = [a.flag for row in T.TABLE for a in row.args]
    assert len(fields) == len(set(fields)) and len(flags) == len(set(flags))


def test_the_profile_job_records_every_argument_as_ran_reads_back():
    # launcher/as_ran.py reads the implementation fields from result.json's `settings` through this table.
    from mcore_advisor.launcher.entry.profile import _SETTINGS

    impl_args = {a.key for row in T.TABLE for a in row.args
                 if any(f.startswith("implementation.") for f in ((row.field,) if isinstance(row, T.Entry) else row.fields))}
    assert impl_args - set(_SETTINGS) == set()


def _table_parser() -> argparse.ArgumentParser:
    """An argparse parser built from the table's own declarations (Megatron's are checked in the slow test)."""
    ap = argparse.ArgumentParser(allow_abbrev=False)
    for row in T.TABLE:
        for a in row.args:
            if a.kind in ("store_true", "store_false"):
                ap.add_argument(a.flag, action=a.kind, dest=a.key)
            else:
                ap.add_argument(a.flag, dest=a.key, default=a.default, nargs="+" if a.kind == "list" else None)
    return ap


def _dump_text(namespace: dict, world: int) -> str:
    rows = [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in {**namespace, "world_size": world}.items()]
    return "\n".join(["---- arguments ----", *sorted(rows, key=str.lower), "---- end of arguments ----"])


def test_every_catalog_plan_reads_back_from_its_rendered_argv_through_the_tables_parser():
    parser = _table_parser()

    def dump_of(argv, plan, art):
        ns, _ = parser.parse_known_args(argv)
        if not ns.add_bias_linear:
            ns.bias_gelu_fusion = False  # validate_args (arguments.py): no bias-GeLU fusion without biases
        return _dump_text(vars(ns), plan.cluster.num_gpus)

    failures = _round_trip(dump_of)
    assert not failures, "\n".join(failures)


def test_a_published_run_uses_the_table_for_its_layout():
    # Narayanan 2021 rows: full recompute published without a method -> the table's default, as rendering fills it.
    from mcore_advisor.knowledge.runs import plan_for_run, published_runs

    rp = next(plan_for_run(r) for r in published_runs() if r.source == "NARAYANAN21_T1")
    p = rp.plan.parallelism
    assert (p.recompute_granularity, p.recompute_method, p.recompute_num_layers) == ("full", *T.FULL_RECOMPUTE_DEFAULT)
    assert p.use_distributed_optimizer is False and p.sequence_parallel is False


def test_parse_reads_typed_values_and_dump_text_alike():
    typed = T.parse({"attention_backend": "AttnBackend.flash", "grad_reduce_in_bf16": True, "num_experts": None,
                     "moe_grouped_gemm": True, "transformer_impl": "local"}).sections["implementation"]
    text = T.parse({"attention_backend": "AttnBackend.flash", "grad_reduce_in_bf16": "True", "num_experts": "None",
                    "moe_grouped_gemm": "True", "transformer_impl": "local"}).sections["implementation"]
    # a dense run (num_experts None): Megatron's grouped-GEMM flag says nothing about the plan
    assert typed == text == {"attention_backend": "flash", "grad_reduce_in_fp32": False, "transformer_impl": "local"}


def test_values_megatron_derived_read_back_as_the_plans_unset():
    s = T.parse({"tensor_model_parallel_size": "2", "expert_tensor_parallel_size": "2", "num_experts": "8",
                 "rotary_base": "10000", "position_embedding_type": "rope", "layernorm_epsilon": "1e-05",
                 "moe_router_load_balancing_type": "['aux_loss']", "moe_aux_loss_coeff": "[0.01]"}).sections
    assert "expert_tensor_parallel_size" not in s["parallelism"]  # validate_args set it to TP
    assert "rotary_base" not in s["model"] and "norm_epsilon" not in s["model"]  # Megatron's defaults
    assert "moe_router_load_balancing_type" not in s["model"] and s["model"]["moe_aux_loss_coeff"] == 0.01


def test_pipeline_stage_counts_give_back_the_fewest_first_last_fields():
    # schemas.layers_per_stage's inverse: 52 layers on 2 stages as 24 + 28 is first=24; 118 on 4 stages
    # as 30, 30, 30, 28 is last=28; an even split sets neither; 5, 9, 8, 8 has no first/last form.
    assert T.stage_split([26, 26]) == (None, None)
    assert T.stage_split([24, 28]) == (24, None)
    assert T.stage_split([30, 30, 30, 28]) == (None, 28)
    assert T.stage_split([6, 10, 10, 4]) == (6, 4)
    assert T.stage_split([5, 9, 8, 8]) is None


def test_a_hybrid_dump_reads_back_its_pattern_stages_and_mamba_shape():
    # What Megatron-LM 0.19 prints for a Nemotron-H-style run on PP 2 (validate_args derives num_layers
    # from the pattern and leaves the first/last flags unset beside '|').
    pattern = "M-M*-M-" * 2 + "M-"
    args = {"pipeline_model_parallel_size": "2", "num_layers": "16", "hybrid_layer_pattern": "M-M*-M-M-M*-|M-M-",
            "decoder_first_pipeline_num_layers": "None", "decoder_last_pipeline_num_layers": "None",
            "mamba_num_heads": "128", "mamba_head_dim": "64", "mamba_state_dim": "256", "mamba_num_groups": "8",
            "moe_layer_freq": "1", "is_hybrid_model": "False"}
    s = T.parse(args).sections
    assert s["model"]["hybrid_layer_pattern"] == pattern and len(pattern) == 16
    assert s["parallelism"]["decoder_first_pipeline_num_layers"] == 12
    assert "decoder_last_pipeline_num_layers" not in s["parallelism"]
    assert (s["model"]["mamba_num_heads"], s["model"]["mamba_state_dim"]) == (128, 256)
    assert "moe_layer_freq" not in s["model"]  # a hybrid model's MoE layers are its 'E' symbols


def test_a_gpt_dump_keeps_no_mamba_fields_and_an_old_dump_its_override_pattern():
    gpt = T.parse({"hybrid_layer_pattern": "None", "mamba_state_dim": "128", "mamba_head_dim": "64",
                   "mamba_num_groups": "8", "mamba_num_heads": "None"}).sections["model"]
    assert not [k for k in gpt if "mamba" in k or "hybrid" in k]
    # Releases before --hybrid-layer-pattern printed only hybrid_override_pattern.
    old = T.parse({"hybrid_override_pattern": "M*M-", "mamba_num_groups": "4"}).sections["model"]
    assert old == {"hybrid_layer_pattern": "M*M-", "mamba_num_groups": 4}


def test_an_unknown_choice_is_skipped_not_guessed():
    s = T.parse({"position_embedding_type": "mrope", "transformer_impl": "inference_optimized", "fp8": "None"}).sections
    assert "position_embedding_type" not in s["model"] and "transformer_impl" not in s["implementation"]
    assert s["training"] == {"precision": "bf16"}


# --------------------------------------------------------------------------- Megatron-LM's own parser

KIND = {"_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false"}


@pytest.fixture(scope="module")
def megatron_arguments():
    return pytest.importorskip("megatron.training.arguments")


def _megatron_parser(margs) -> dict[str, argparse.Action]:
    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.mark.slow
def test_every_table_flag_is_megatrons_with_its_destination_kind_and_default(megatron_arguments):
    actions = _megatron_parser(megatron_arguments)
    wrong = []
    for row in T.TABLE:
        for a in row.args:
            act = actions.get(a.flag)
            if act is None:
                wrong.append(f"{a.flag}: not a Megatron-LM argument")
                continue
            kind = KIND.get(type(act).__name__) or ("list" if act.nargs in ("+", "*") else "value")
            default = getattr(act.default, "name", act.default)  # enum defaults (AttnBackend.auto) by name
            if (act.dest, kind) != (a.key, a.kind):
                wrong.append(f"{a.flag}: Megatron stores {kind} into {act.dest}, the table says {a.kind} into {a.key}")
            elif kind not in ("store_true", "store_false") and default != a.default:
                wrong.append(f"{a.flag}: Megatron's default {default!r}, the table says {a.default!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_every_catalog_plan_reads_back_from_megatrons_own_argument_dump(megatron_arguments, monkeypatch):
    """parse_args + validate_args of Megatron-LM on each rendered argv, its own `_print_args` dump, then
    the log parser: the plan that comes back is the plan as rendered."""
    import torch

    margs = megatron_arguments

    def dump_of(argv, plan, art):
        with monkeypatch.context() as m:
            for e in art.env:
                if e.action == "set":
                    m.setenv(e.name, e.value)
                else:
                    m.delenv(e.name, raising=False)
            m.setenv("WORLD_SIZE", str(plan.cluster.num_gpus))
            m.setenv("RANK", "0")
            arch = ARCH[gpu(plan.cluster.gpu).architecture]
            # validate_args asks the device for its architecture (the CUDA_DEVICE_MAX_CONNECTIONS rule, grouped GEMM)
            m.setattr(margs, "get_device_arch_version", lambda: arch)
            # a rendered script runs where Transformer Engine is installed (the job's 2.20); this CPU venv has none,
            # and validate_args' TE version gates (delay_wgrad_compute's) would read it as 0.0.0
            m.setattr(margs, "is_te_min_version", lambda *a, **k: True)
            if not torch.cuda.is_available():
                m.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (arch, 0))
            m.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                args = margs.parse_args(ignore_unknown_args=False)
                margs.validate_args(args)
                margs._print_args("arguments", args)
        return out.getvalue()

    failures = _round_trip(dump_of)
    assert not failures, "\n".join(failures)
