"""The data loader's attention masks (Megatron-LM's --create-attention-mask-in-dataloader default) on the step.

Hand-derived: a sample's mask is seq x seq bytes; a rank loads micro_batch_size of them per micro-batch; the
ranks that wait for each other every layer (CP, EP's distinct data-parallel ranks) add their stalls.
"""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.runs import plan_for_run, published_runs
from mcore_advisor.physics.evaluate import evaluate_plan
from mcore_advisor.physics.step_time import DATALOADER_MASK_S_PER_GIB, step_time
from mcore_advisor.planning.recommend import RecommendRequest, recommend_parallelism
from mcore_advisor.schemas import Plan

LLAMA_8L = {"num_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
            "ffn_hidden_size": 14336, "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm",
            "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope"}
MOE8 = {**LLAMA_8L, "hidden_size": 2048, "ffn_hidden_size": 5632, "num_attention_heads": 16, "num_query_groups": 8,
        "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 5632}


def _plan(model=LLAMA_8L, n=4, seq=16384, gbs=2, mbs=1, par=None, mask=True) -> Plan:
    return Plan(model=model, cluster={"gpu": "h100-sxm", "num_gpus": n},
                training={"seq_length": seq, "global_batch_size": gbs, "micro_batch_size": mbs},
                parallelism=par or {}, implementation={"create_attention_mask_in_dataloader": mask})


def test_cp4_at_16k_adds_four_ranks_of_half_a_gib():
    on = step_time(_plan(par={"context_parallel_size": 4}))
    off = step_time(_plan(par={"context_parallel_size": 4}, mask=False))
    # 2 micro-batches x 1 sample x 16384^2 B = 0.5 GiB per rank, 4 CP ranks tied by the K/V ring
    assert on.breakdown.dataloader_mask_s == pytest.approx(DATALOADER_MASK_S_PER_GIB * 0.5 * 4)
    assert off.breakdown.dataloader_mask_s == 0.0
    assert on.iteration_time_s - off.iteration_time_s == pytest.approx(on.breakdown.dataloader_mask_s)


def test_one_loader_under_tp_and_none_where_no_peer_waits():
    tp = step_time(_plan(seq=8192, gbs=8, mbs=2, par={"tensor_model_parallel_size": 4, "sequence_parallel": True}))
    # only TP rank 0 loads: 4 micro-batches x 2 x 8192^2 B = 0.5 GiB
    assert tp.breakdown.dataloader_mask_s == pytest.approx(DATALOADER_MASK_S_PER_GIB * 0.5)
    assert step_time(_plan(n=1, seq=4096, gbs=8, mbs=2)).breakdown.dataloader_mask_s == 0.0
    assert step_time(_plan(seq=4096, gbs=8, mbs=2)).breakdown.dataloader_mask_s == 0.0  # DP4 only


def test_ep_ranks_are_distinct_loaders_unless_tp_holds_them():
    ep4 = step_time(_plan(MOE8, seq=4096, gbs=32, mbs=4, par={"expert_model_parallel_size": 4}))
    # DP4 x EP4: 2 micro-batches x 4 x 4096^2 B = 0.125 GiB on each of 4 tied ranks
    assert ep4.breakdown.dataloader_mask_s == pytest.approx(DATALOADER_MASK_S_PER_GIB * 0.125 * 4)
    tp_ep = step_time(_plan(MOE8, seq=4096, gbs=16, mbs=4, par={
        "tensor_model_parallel_size": 4, "sequence_parallel": True, "expert_model_parallel_size": 4,
        "expert_tensor_parallel_size": 1}))
    # the EP group is the TP group: one loader (TP rank 0), 4 micro-batches x 4 x 4096^2 B = 0.25 GiB
    assert tp_ep.breakdown.dataloader_mask_s == pytest.approx(DATALOADER_MASK_S_PER_GIB * 0.25)


def test_evaluate_plan_warns_with_the_flag_that_removes_it():
    ev = evaluate_plan(_plan(par={"context_parallel_size": 4}))
    f = [x for x in ev.findings if x.code == "dataloader_attention_mask"]
    assert f and "--no-create-attention-mask-in-dataloader" in f[0].fix
    assert f[0].fields == ["implementation.create_attention_mask_in_dataloader"]
    off = evaluate_plan(_plan(par={"context_parallel_size": 4}, mask=False))
    assert not [x for x in off.findings if x.code == "dataloader_attention_mask"]


def test_published_runs_are_planned_without_masks():
    rp = next(plan_for_run(r) for r in published_runs() if plan_for_run(r) is not None)
    assert rp.plan.implementation.create_attention_mask_in_dataloader is False


def test_recommend_turns_the_mask_off_unless_asked():
    req = {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8}, "seq_length": 16384, "global_batch_size": 16}
    best = recommend_parallelism(RecommendRequest(**req)).plans[0].plan
    assert best.implementation.create_attention_mask_in_dataloader is False
    kept = recommend_parallelism(RecommendRequest(**req, implementation={"create_attention_mask_in_dataloader": True}))
    assert kept.plans[0].plan.implementation.create_attention_mask_in_dataloader is True
