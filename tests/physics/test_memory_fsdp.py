"""Model state under Megatron-FSDP, torch FSDP2 and the precision-aware optimizer; the FSDP collectives'
time. Every figure is derived by hand from what each implementation shards (Megatron-FSDP:
megatron_fsdp/param_and_grad_buffer.py _init_each_parameter_group_buffers; the precision-aware
optimizer: distrib_optimizer.py's int16 master_param state)."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.memory import memory_breakdown, stage_table
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)

# GPT 1.3B-like, untied (FSDP2 needs it), 24 layers: one GPU's whole model on every DP rank (TP = PP = 1).
GPT = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32768,
           swiglu=False, normalization="LayerNorm", add_bias_linear=True, untie_embeddings_and_output_weights=True,
           position_embedding_type="rope")
DP = 16
L = 24


def _plan(impl=None, *, par=None, gbs=64, precision="bf16", model=None, gpus=DP, **train):
    return Plan(
        model=ModelSpec(**(model or GPT)),
        cluster=ClusterSpec(gpu="h100-sxm", num_gpus=gpus),
        training=TrainingSpec(seq_length=2048, global_batch_size=gbs, micro_batch_size=1, precision=precision, **train),
        parallelism=ParallelismSpec(**(par or {})),
        implementation=ImplementationSpec(**(impl or {})),
    )


def _state(plan):
    st = memory_breakdown(plan).stages[0]
    return st.num_params, st.weights_bytes, st.gradients_bytes, st.optimizer_bytes, st.optimizer_step_transient_bytes


@pytest.mark.parametrize(
    ("strategy", "weights", "grads", "optim", "step"),
    [
        # bytes per parameter of the rank (n) as functions of n; in-flight = two layers unsharded (2n/L)
        ("no_shard", lambda n: 2 * n, lambda n: 2 * n, lambda n: 12 * n, lambda n: 4 * n),
        ("optim", lambda n: 2 * n, lambda n: 2 * n, lambda n: 12 * n / DP, lambda n: 4 * n / DP),
        ("optim_grads", lambda n: 2 * n, lambda n: 2 * n / DP + 2 * 2 * n / L, lambda n: 12 * n / DP, lambda n: 4 * n / DP),
        ("optim_grads_params", lambda n: 2 * n / DP + 2 * 2 * n / L, lambda n: 2 * n / DP + 2 * 2 * n / L,
         lambda n: 12 * n / DP, lambda n: 4 * n / DP),
    ],
)
def test_each_megatron_fsdp_strategy_shards_what_its_buffers_distribute(strategy, weights, grads, optim, step):
    # Megatron-FSDP's gradient buffer is bf16 (main grads 'auto' = the param dtype) even with the plan's default
    # grad_reduce_in_fp32, so the step casts each held gradient to fp32 for the fp32 main weights (4 B).
    n, w, g, o, s = _state(_plan({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": strategy}))
    assert w == pytest.approx(weights(n), rel=1e-9)
    assert g == pytest.approx(grads(n), rel=1e-9)
    assert o == pytest.approx(optim(n), rel=1e-9)
    assert s == pytest.approx(step(n), rel=1e-9)


def test_megatron_fsdp_optim_holds_the_distributed_optimizers_state_with_bf16_gradients():
    n, w, g, o, _ = _state(_plan({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"}))
    n2, w2, g2, o2, _ = _state(_plan())  # DDP + distributed optimizer, fp32 gradient buffer
    assert (n, w, o) == (n2, w2, o2)
    assert g2 == pytest.approx(2 * g)  # 4 B vs 2 B per parameter


def test_torch_fsdp2_and_megatron_fsdp_optim_grads_params_shard_the_same_state():
    fsdp2 = _plan({"use_torch_fsdp2": True, "grad_reduce_in_fp32": False, "gradient_accumulation_fusion": False},
                  par={"use_distributed_optimizer": False, "overlap_param_gather": False})
    mfsdp = _plan({"use_megatron_fsdp": True, "grad_reduce_in_fp32": False, "gradient_accumulation_fusion": False})
    assert _state(fsdp2)[:4] == pytest.approx(_state(mfsdp)[:4], rel=1e-12)


def test_megatron_fsdp_shards_routed_experts_over_expert_data_parallel():
    # Mixtral-like MoE on 64 GPUs, EP 8: dense parameters over DP = 64, routed experts over 64 / 8 = 8.
    moe = dict(num_layers=8, hidden_size=1024, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=3584,
               vocab_size=32000, swiglu=True, normalization="RMSNorm", untie_embeddings_and_output_weights=True,
               num_experts=8, moe_router_topk=2)
    plan = _plan({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim"},
                 par={"expert_model_parallel_size": 8}, model=moe, gpus=64)
    st = stage_table(LayoutBatch.from_plan(plan, resolve_model(plan.model)))
    dense, expert = float(st.dense_params[0, 0]), float(st.expert_params[0, 0])
    assert expert > 0
    assert _state(plan)[3] == pytest.approx(12 * (dense / 64 + expert / 8), rel=1e-9)


@pytest.mark.parametrize(
    ("precision", "recipe", "moments", "per_param"),
    [
        ("bf16", "delayed", "fp32", 2 + 4 + 4),  # TE holds the master as 16-bit remainders
        ("bf16", "delayed", "bf16", 2 + 2 + 2),
        ("fp8", "delayed", "fp32", 2 + 4 + 4),  # delayed scaling keeps TE's master
        ("fp8", "tensorwise", "fp32", 4 + 4 + 4),  # other recipes: MCore's fp32 master
        ("fp8", "tensorwise", "bf16", 4 + 2 + 2),
    ],
)
def test_precision_aware_optimizer_state_bytes(precision, recipe, moments, per_param):
    impl = {"use_precision_aware_optimizer": True, "exp_avg_dtype": moments, "exp_avg_sq_dtype": moments}
    n, _, _, o, s = _state(_plan(impl, precision=precision, fp8_recipe=recipe))
    assert o == pytest.approx(per_param * n / DP, rel=1e-9)
    # the optimizer reads the (fp32, the plan's default) gradient buffer itself: no copy at the step either way
    assert s == 0.0


def test_precision_aware_optimizer_reads_bf16_gradients_without_an_fp32_copy():
    bf16_grads = {"grad_reduce_in_fp32": False}
    n, *_, s_plain = _state(_plan(bf16_grads))
    assert s_plain == pytest.approx(4 * n / DP, rel=1e-9)  # fp32 copy of the bf16 gradient shard
    *_, s_pao = _state(_plan({**bf16_grads, "use_precision_aware_optimizer": True}))
    assert s_pao == 0.0
    # tensorwise FP8 keeps MCore's fp32 master, fed by an fp32 copy again
    *_, s_fp8 = _state(_plan({**bf16_grads, "use_precision_aware_optimizer": True}, precision="fp8",
                             fp8_recipe="tensorwise"))
    assert s_fp8 == pytest.approx(4 * n / DP, rel=1e-9)


# ---- the collectives' time ---------------------------------------------------------------------

_NO_OVERLAP = {"overlap_grad_reduce": False, "overlap_param_gather": False}


def _dp_s(impl, gbs):
    return step_time(_plan(impl, par=_NO_OVERLAP, gbs=gbs)).breakdown.dp_comm_exposed_s


def test_fully_sharded_weights_are_gathered_twice_and_gradients_scattered_once_per_microbatch():
    # bf16 gradients and weights: one all-gather and one reduce-scatter move the same bytes over the same
    # ring, t. DDP + distributed optimizer: one of each per step (2t). optim_grads_params, M micro-batches:
    # M x (forward gather + backward gather + reduce-scatter) = 3Mt. Nothing overlapped here.
    ddp = {"grad_reduce_in_fp32": False}
    fsdp = {"use_megatron_fsdp": True, "grad_reduce_in_fp32": False}
    for gbs in (16, 64):
        m = gbs // DP
        assert _dp_s(fsdp, gbs) == pytest.approx(_dp_s(ddp, gbs) * 3 * m / 2, rel=1e-9)


def test_megatron_fsdp_optim_grads_scatters_every_microbatch_and_gathers_once():
    # reduce-scatter per micro-batch (M t) + the one all-gather after the step (t)
    ddp = {"grad_reduce_in_fp32": False}
    zero2 = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads", "grad_reduce_in_fp32": False}
    m = 64 // DP
    assert _dp_s(zero2, 64) == pytest.approx(_dp_s(ddp, 64) * (m + 1) / 2, rel=1e-9)


def test_megatron_fsdp_no_shard_all_reduces_like_ddp_without_the_distributed_optimizer():
    plain = {"grad_reduce_in_fp32": False}
    no_shard = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "no_shard", "grad_reduce_in_fp32": False}
    ddp = step_time(_plan(plain, par={**_NO_OVERLAP, "use_distributed_optimizer": False})).breakdown.dp_comm_exposed_s
    assert step_time(_plan(no_shard, par=_NO_OVERLAP)).breakdown.dp_comm_exposed_s == pytest.approx(ddp, rel=1e-9)
