"""One parameter count per pipeline rank (physics.memory.rank_params through stage_table), used by the
memory model and by the step time's data-parallel traffic and optimizer step (tests/physics/
test_step_time.py checks the step time's side on Llama-3-8B). Hand-derived counts
for the three cases where the step time's former averaged count was off: Llama-3-8B's untied output
layer, DeepSeek-V3's first stage (dense layers, MLA) and Llama-3.1-405B's lighter last stage."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.memory import memory_breakdown, stage_table
from mcore_advisor.schemas import ClusterSpec, ModelSpec, ParallelismSpec, Plan, TrainingSpec


def _plan(name: str, num_gpus: int, **par) -> Plan:
    return Plan(model=ModelSpec(name=name), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=num_gpus),
                training=TrainingSpec(seq_length=4096, global_batch_size=num_gpus), parallelism=ParallelismSpec(**par))


def _rank_params(plan: Plan) -> dict[int, float]:
    """pipeline rank -> parameters on one of its GPUs, as the one counter gives them."""
    st = stage_table(LayoutBatch.from_plan(plan, resolve_model(plan.model)))
    return {int(r): float(d + e) for r, d, e in zip(st.rank[:, 0], st.dense_params[:, 0], st.expert_params[:, 0], strict=True)}


# Llama-3-8B: h 4096, 32 heads, 8 KV groups of 128, SwiGLU 14336, RMSNorm, 32 layers, untied,
# vocab 128256 (a multiple of 128: no padding at TP1).
H, L, V = 4096, 32, 128256
LLAMA3_8B_LAYER = (H * H + 2 * H * 8 * 128 + H * H) + 3 * H * 14336 + 2 * H  # q, k, v, o + fc1 (x2 gate), fc2 + 2 norms
LLAMA3_8B = L * LLAMA3_8B_LAYER + V * H + V * H + H  # embedding, untied output layer, final norm


def test_llama3_8b_one_rank_holds_the_embedding_and_the_untied_output_layer():
    assert LLAMA3_8B == 8_030_261_248  # Meta's published 8.03B
    plan = _plan("llama3-8b", 16)
    assert _rank_params(plan) == {0: pytest.approx(LLAMA3_8B, abs=0.5)}
    assert memory_breakdown(plan).stages[0].num_params == LLAMA3_8B


def test_deepseek_v3_first_stage_holds_its_three_dense_layers_four_moe_layers_and_the_embedding():
    # TP2 PP8 (first stage 7 layers, last 6, 8 x 6 between), EP8, ETP1 on 256 GPUs. Layers 0-2 dense
    # (first_k_dense_replace 3), 3-6 MoE. h 7168, 128 heads; MLA (multi_latent_attention.py): q down
    # h x 1536 and kv down h x (512 + 64) duplicated on every TP rank with their norms (1536, 512),
    # q up 1536 x 128*(128+64), kv up 512 x 128*(128+128), o 128*128 x h split over TP.
    h, tp = 7168, 2
    mla = (h * 1536 + 1536 + h * 576 + 512) + (1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * h) / tp
    norms = 2 * h
    dense_mlp = 3 * h * 18432 / tp
    moe_non_expert = 3 * h * 2048 / tp + h * 256  # shared expert over TP, router whole
    experts = 4 * 256 * 3 * h * 2048 / (8 * 1)  # 4 MoE layers x 256 experts over EP8 x ETP1
    embedding = 129280 * h / tp  # 129280 is a multiple of 128 * 2: no padding
    first = 7 * (mla + norms) + 3 * dense_mlp + 4 * moe_non_expert + experts + embedding
    plan = _plan("deepseek-v3", 256, tensor_model_parallel_size=2, pipeline_model_parallel_size=8,
                 decoder_first_pipeline_num_layers=7, decoder_last_pipeline_num_layers=6, expert_model_parallel_size=8,
                 expert_tensor_parallel_size=1, sequence_parallel=True)
    assert _rank_params(plan)[0] == pytest.approx(first, rel=1e-12)
    assert memory_breakdown(plan).stages[0].num_params == round(first)


def test_llama3_1_405b_last_stage_holds_seven_layers_the_final_norm_and_the_output_layer():
    # PP16 split 7 + 14 x 8 + 7 at TP8: h 16384, 128 heads, 8 KV groups of 128, SwiGLU 53248; the
    # vocab 128256 pads to a multiple of 128 * 8 = 1024: 129024.
    h, tp = 16384, 8
    layer = (2 * h * h + 2 * h * 8 * 128 + 3 * h * 53248) / tp + 2 * h
    last = 7 * layer + h + 129024 * h / tp
    middle = 8 * layer
    plan = _plan("llama3.1-405b", 1024, tensor_model_parallel_size=8, pipeline_model_parallel_size=16,
                 decoder_first_pipeline_num_layers=7, decoder_last_pipeline_num_layers=7, sequence_parallel=True)
    got = _rank_params(plan)
    assert got[15] == pytest.approx(last, rel=1e-12) and got[1] == pytest.approx(middle, rel=1e-12)
    # the former count gave every stage the most-loaded stage's 8 layers plus V*h/tp
    assert (8 * layer + 129024 * h / tp) / last == pytest.approx(1.13, abs=0.01)
