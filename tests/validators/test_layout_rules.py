"""Parallel-layout rules: world size, node shape, silently dropped switches."""

from __future__ import annotations

TP = "parallelism.tensor_model_parallel_size"
PP = "parallelism.pipeline_model_parallel_size"
NUM_GPUS = "cluster.num_gpus"


def test_63_gpus_with_tp8_is_an_error_naming_num_gpus_and_suggesting_56_or_64(kit):
    p = kit.plan(cluster={"num_gpus": 63}, parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "world_not_divisible_by_model_parallel")
    assert f.severity == "error"
    assert f.fields[0] == NUM_GPUS and TP in f.fields
    assert "(63)" in f.message and "= 8" in f.message
    assert "56 or 64" in f.fix


def test_world_must_divide_by_expert_tensor_times_expert_times_pipeline(kit):
    # 12 GPUs in nodes of 4, TP2 (DP6): ETP1 x EP8 x PP1 = 8 does not divide 12 although 8 experts / EP8 is fine.
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 12, "gpus_per_node": 4},
        parallelism={
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 1,
        },
        training={"global_batch_size": 12},
    )
    f = kit.one(p, "world_not_divisible_by_expert_parallel")
    assert f.severity == "error"
    assert set(f.fields) >= {NUM_GPUS, "parallelism.expert_model_parallel_size"}
    assert "1x8x1 = 8" in f.message
    # num_gpus must be a multiple of lcm(8, TP*PP*CP = 2) = 8; EP 4 divides both 12 and the 8 experts.
    assert "8 or 16" in f.fix and "expert_model_parallel_size to" in f.fix and "4" in f.fix.split("to")[-1]


def test_dense_model_does_not_repeat_the_world_error_as_an_expert_error(kit):
    p = kit.plan(cluster={"num_gpus": 63}, parallelism={"pipeline_model_parallel_size": 1})
    assert "world_not_divisible_by_expert_parallel" not in kit.codes(p)


def test_twelve_gpus_on_eight_gpu_nodes_is_an_error_with_node_multiples(kit):
    p = kit.plan(
        cluster={"num_gpus": 12},
        parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
        training={"global_batch_size": 12},
    )
    f = kit.one(p, "num_gpus_not_multiple_of_node")
    assert f.severity == "error"
    assert f.fields == [NUM_GPUS, "cluster.gpus_per_node"]
    assert "8 or 16" in f.fix and "gpus_per_node to 6" in f.fix


def test_a_partial_single_node_is_fine(kit):
    p = kit.plan(
        cluster={"num_gpus": 4},
        parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
    )
    assert "num_gpus_not_multiple_of_node" not in kit.codes(p)


def test_virtual_pipeline_with_pp1_is_a_warning_not_silence(kit):
    p = kit.plan(parallelism={"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 2})
    f = kit.one(p, "virtual_pipeline_ignored_without_pp")
    assert f.severity == "warning"
    assert f.fields == ["parallelism.virtual_pipeline_model_parallel_size", PP]
    assert "(2)" in f.message and "pipeline_model_parallel_size >= 2" in f.fix


def test_sequence_parallel_with_tp1_is_a_warning_because_megatron_disables_it(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": True,
        },
    )
    f = kit.one(p, "sequence_parallel_without_tp")
    assert f.severity == "warning"
    assert f.fields == ["parallelism.sequence_parallel", TP]
    assert "Disabling sequence parallelism" in f.message


def test_tp_without_sequence_parallel_gets_an_info_quantifying_the_saving(kit):
    p = kit.plan(parallelism={"sequence_parallel": False})
    f = kit.one(p, "sequence_parallel_recommended")
    assert f.severity == "info"
    # Korthikanti 2022 eq. 2 - eq. 4: 10*s*b*h*(1 - 1/t) bytes per layer; 40 layers per stage.
    saving = 10 * 8192 * 1 * 8192 * (1 - 1 / 8) * 40 / 2**30
    assert f"{saving:.1f} GiB" in f.message  # 21.9 GiB
    assert f.fix == "set parallelism.sequence_parallel true"


def test_moe_with_tensor_parallel_and_no_sp_is_an_error_like_megatron(kit):
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 4,
            "sequence_parallel": False,
        },
    )
    f = kit.one(p, "expert_and_tensor_parallel_without_sp")
    assert f.severity == "error"
    assert "parallelism.sequence_parallel" in f.fields
    assert "sequence parallelism must be used" in f.message
    assert "sequence_parallel_recommended" not in kit.codes(p)


def test_distributed_optimizer_with_dp1_is_harmless_info(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 8},
        parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "distributed_optimizer_without_data_parallel")
    assert f.severity == "info" and f.fields == ["parallelism.use_distributed_optimizer"]
    assert f.fix is None


def test_expert_tensor_parallel_on_a_dense_model_is_a_warning(kit):
    p = kit.plan(parallelism={"expert_tensor_parallel_size": 4})
    f = kit.one(p, "expert_tensor_parallel_ignored_dense")
    assert f.severity == "warning" and f.fields == ["parallelism.expert_tensor_parallel_size"]
    assert "(4)" in f.message


# ---------------------------------------------------------------- pipeline splits (issue 16, part 3)

import itertools  # noqa: E402

import pytest  # noqa: E402

from mcore_advisor.knowledge.megatron_flags import parse, render  # noqa: E402,F401
from mcore_advisor.schemas import layers_per_stage  # noqa: E402

_SPLIT_CODES = {"layers_not_divisible_by_pp", "stage_layers_not_divisible_by_vp", "uneven_split_with_account_for"}
EMB = "parallelism.account_for_embedding_in_pipeline_split"
LOSS = "parallelism.account_for_loss_in_pipeline_split"


def _qwen3_235b_like(kit, pp, vp, **par):
    # Qwen3-235B-A22B's 94 layers (MoE model zoo row: PP8 VP4 on 256 H100); a dense stand-in suffices
    # for the split rules.
    model = {"num_layers": 94, "hidden_size": 4096, "num_attention_heads": 64, "num_query_groups": 4,
             "ffn_hidden_size": 12288, "vocab_size": 151936}
    return kit.plan(model=model, cluster={"num_gpus": 8 * pp * 2},
                    parallelism={"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vp, **par})


def test_layers_per_stage_counts_embedding_and_loss_as_layers():
    # (94 + 2) / 8 = 12 slots per stage; the first stage gives one to the embedding, the last to the loss.
    assert layers_per_stage(94, 8, embedding=True, loss=True) == [11] + [12] * 6 + [11]
    assert layers_per_stage(95, 8, loss=True) == [12] * 7 + [11]
    assert layers_per_stage(95, 8, embedding=True) == [11] + [12] * 7
    with pytest.raises(ValueError, match=r"num_layers \+ 1 \(embedding\) \+ 1 \(loss\) \(96\)"):
        layers_per_stage(94, 7, embedding=True, loss=True)
    with pytest.raises(ValueError, match="cannot be set together"):
        layers_per_stage(94, 8, 10, None, embedding=True)


def test_94_layers_on_pp8_vp4_is_valid_with_the_embedding_and_loss_aware_split(kit):
    codes = set(kit.codes(_qwen3_235b_like(kit, 8, 4, **{EMB.split(".")[1]: True, LOSS.split(".")[1]: True})))
    assert not codes & _SPLIT_CODES
    # PP32 VP3: 96 slots, one layer per chunk (the first and last chunks hold only the embedding / loss).
    codes = set(kit.codes(_qwen3_235b_like(kit, 32, 3, account_for_embedding_in_pipeline_split=True,
                                           account_for_loss_in_pipeline_split=True)))
    assert not codes & _SPLIT_CODES


def test_94_layers_on_pp8_names_the_embedding_and_loss_aware_split_as_a_fix(kit):
    f = kit.one(_qwen3_235b_like(kit, 8, None), "layers_not_divisible_by_pp")
    assert "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split true" in f.fix
    assert "96 slots, 12 per stage" in f.fix


def test_embedding_aware_split_that_does_not_divide_names_the_slots(kit):
    f = kit.one(_qwen3_235b_like(kit, 8, None, account_for_embedding_in_pipeline_split=True),
                "layers_not_divisible_by_pp")
    assert f.severity == "error" and EMB in f.fields
    assert "(95 slots) must be divisible by pipeline_model_parallel_size (8)" in f.message
    # 95 slots divide over no PP that 128 GPUs at TP8 allow but 1; counting the loss too gives 96.
    assert f.fix.startswith("set parallelism.pipeline_model_parallel_size to 1, or ")
    assert "account_for_loss_in_pipeline_split true (94 layers + embedding + loss = 96 slots" in f.fix


def test_embedding_aware_split_checks_the_vp_chunks_on_the_slots_not_the_built_layers(kit):
    # 96 slots / PP8 = 12 per stage: VP 5 does not divide 12 (Megatron: "number of layers on each pipeline
    # rank: 12 ... must be divisible by virtual_pipeline_model_parallel_size 5").
    p = _qwen3_235b_like(kit, 8, 5, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert "stage_layers_not_divisible_by_vp" in kit.codes(p)


def test_first_last_split_with_account_for_is_megatrons_error(kit):
    p = _qwen3_235b_like(kit, 8, None, decoder_first_pipeline_num_layers=10, account_for_loss_in_pipeline_split=True)
    f = kit.one(p, "uneven_split_with_account_for")
    assert f.severity == "error" and LOSS in f.fields and "parallelism.decoder_first_pipeline_num_layers" in f.fields
    assert "layers_not_divisible_by_pp" not in kit.codes(p)


def test_uneven_split_with_vp_is_accepted_when_every_stage_divides_by_vp(kit):
    # Llama-3.1-405B's 126 layers on PP16 VP2: first 6, last 8, 14 middle stages of 8 (all even).
    model = {"num_layers": 126, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
             "ffn_hidden_size": 14336, "vocab_size": 128256}
    p = kit.plan(model=model, cluster={"num_gpus": 128}, parallelism={
        "pipeline_model_parallel_size": 16, "virtual_pipeline_model_parallel_size": 2,
        "decoder_first_pipeline_num_layers": 6, "decoder_last_pipeline_num_layers": 8})
    assert not set(kit.codes(p)) & _SPLIT_CODES
    assert layers_per_stage(126, 16, 6, 8) == [6] + [8] * 14 + [8]


def test_split_fields_render_and_parse_back_through_the_flag_table(kit):
    from mcore_advisor.knowledge import megatron_flags as table
    from mcore_advisor.knowledge.megatron_flags import RenderView
    from mcore_advisor.knowledge.models import resolve_model
    from mcore_advisor.rendering.megatron_args import as_rendered, megatron_flags  # noqa: F401

    p = _qwen3_235b_like(kit, 8, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    flags = table.render(RenderView(p, resolve_model(p.model), None, None, []), "layout")
    names = [f.name for f in flags]
    assert "--account-for-embedding-in-pipeline-split" in names and "--account-for-loss-in-pipeline-split" in names
    par = table.parse({"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": "True",
                       "pipeline_model_parallel_size": 8}).sections["parallelism"]
    assert par["account_for_embedding_in_pipeline_split"] is True and par["account_for_loss_in_pipeline_split"] is True
    off = table.render(RenderView(kit.plan(), resolve_model(kit.plan().model), None, None, []), "layout")
    assert not any("account-for" in f.name for f in off)


def _megatron_split(cfg_cls, build, dtype, L, pp, vp, first, last, emb, loss):
    """Megatron's per-stage layer counts, or None where TransformerConfig / get_num_layers_to_build reject."""
    try:
        cfg = cfg_cls(num_layers=L, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                      pipeline_dtype=dtype, virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                      num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                      account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
        out = [sum(build(cfg, vp_stage=v if vp > 1 else None, pp_rank=r) for v in range(vp)) for r in range(pp)]
    except (ValueError, AssertionError):
        return None
    # Megatron's checks let first + last exceed num_layers when the middle count divides anyway
    # (e.g. 6 layers, PP3, first 4, last 3: middle -1); no model has a negative layer count.
    return out if min(out) >= 0 else None


@pytest.mark.slow
def test_splits_match_megatrons_get_num_layers_to_build_and_its_rejections(kit):
    torch = pytest.importorskip("torch")
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    tb = pytest.importorskip("megatron.core.transformer.transformer_block")
    import warnings

    checked = 0
    for L, pp, vp, first, last, emb, loss in itertools.product(
        (6, 10, 12), (2, 3, 4), (1, 2, 3), (None, 1, 2, 4), (None, 2, 3), (False, True), (False, True)
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _megatron_split(tc.TransformerConfig, tb.get_num_layers_to_build, torch.bfloat16,
                                   L, pp, vp, first, last, emb, loss)
        model = {"num_layers": L, "hidden_size": 1024, "num_attention_heads": 8, "ffn_hidden_size": 4096,
                 "vocab_size": 32000}
        plan = kit.plan(model=model, cluster={"num_gpus": 8 * pp}, parallelism={
            "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": vp,
            "decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
            "account_for_embedding_in_pipeline_split": emb, "account_for_loss_in_pipeline_split": loss})
        rejected = bool(set(kit.codes(plan)) & _SPLIT_CODES)
        case = (L, pp, vp, first, last, emb, loss)
        assert rejected == (want is None), f"{case}: validators {'reject' if rejected else 'accept'}, Megatron {want}"
        if want is not None:
            assert layers_per_stage(L, pp, first, last, embedding=emb, loss=loss) == want, case
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("tp, etp", [(2, 1), (4, 1), (1, 2), (2, 4)])
def test_expert_tensor_parallel_independent_of_tp_is_valid_and_round_trips(kit, tp, etp):
    # Megatron-Core sizes the expert groups from ETP x EP x PP alone (parallel_state.initialize_model_parallel);
    # the MoE model zoo's Qwen3-235B runs TP2 with ETP1.
    from mcore_advisor.knowledge import megatron_flags as table
    from mcore_advisor.knowledge.megatron_flags import RenderView
    from mcore_advisor.knowledge.models import resolve_model

    p = kit.plan(model=kit.MIXTRAL, cluster={"num_gpus": 64}, parallelism={
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 8,
        "expert_tensor_parallel_size": etp, "sequence_parallel": tp > 1})
    assert [f.code for f in kit.findings(p) if f.severity == "error"] == []
    argv = [a for f in table.render(RenderView(p, resolve_model(p.model), None, None, []), "layout") for a in f.argv]
    assert argv[argv.index("--expert-tensor-parallel-size") + 1] == str(etp)
    back = table.parse({"tensor_model_parallel_size": tp, "expert_tensor_parallel_size": etp, "num_experts": 8})
    assert back.sections["parallelism"]["expert_tensor_parallel_size"] == etp


def test_account_for_split_on_a_hybrid_model_is_megatrons_error(kit):
    # 8 layers: Mamba, attention, Mamba, MLP ... (Megatron hybrid symbols); validate_args asserts.
    model = {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 8, "ffn_hidden_size": 4096,
             "vocab_size": 32000, "hybrid_layer_pattern": "M*M-M*M-"}
    p = kit.plan(model=model, cluster={"num_gpus": 16},
                 parallelism={"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
                              "account_for_loss_in_pipeline_split": True, "sequence_parallel": False})
    f = kit.one(p, "account_for_split_with_hybrid_pattern")
    assert f.severity == "error" and f.fields == [LOSS, "model.hybrid_layer_pattern"]
    assert "decoder_first/last_pipeline_num_layers" in f.fix


def test_memory_books_the_layers_megatron_builds_with_the_embedding_and_loss_aware_split(kit):
    from mcore_advisor.physics.memory import memory_breakdown

    p = _qwen3_235b_like(kit, 8, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    by_role = {s.role: s.num_layers for s in memory_breakdown(p).stages}
    assert by_role == {"first": 11, "middle": 12, "last": 11}
