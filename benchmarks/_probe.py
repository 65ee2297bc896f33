"""The plan of a device-probe run (shared/data/device-measurements-h200.jsonl, TE-on-gpu.md rows).

Those runs: Megatron's GPT with RoPE, LayerNorm, GeLU 4h MLP, biases, untied embeddings, DDP without
overlap, no distributed optimizer, Megatron's default unfused cross entropy, no wgrad-accumulation
fusion (TransformerConfig's default in the probe; --no-gradient-accumulation-fusion without Apex in
pretrain_gpt), one H200 per TP rank.
Shared by the accuracy benchmarks so both model the same runs the same way.
"""

from __future__ import annotations

from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)


def probe_plan(model: dict, mbs: int, gbs: int, s: int, *, impl: str, attn: str, recompute: str | None,
               precision: str = "bf16", tp: int = 1, n: int = 1) -> Plan:
    """`model` holds num_layers, hidden_size, num_attention_heads, ffn_hidden_size, padded_vocab_size.

    attn as the project's launcher maps it: local spec + 'auto' = torch SDPA, + 'local' = Megatron's
    unfused DotProductAttention. recompute 'full' = uniform, one layer per group.
    """
    rc = {} if not recompute or recompute == "none" else (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute == "full"
        else {"recompute_granularity": recompute})
    return Plan(
        model=ModelSpec(num_layers=model["num_layers"], hidden_size=model["hidden_size"], num_attention_heads=model["num_attention_heads"],
                        ffn_hidden_size=model["ffn_hidden_size"], vocab_size=model["padded_vocab_size"], swiglu=False,
                        normalization="LayerNorm", add_bias_linear=True, untie_embeddings_and_output_weights=True,
                        position_embedding_type="rope"),
        cluster=ClusterSpec(gpu="h200", num_gpus=n),
        training=TrainingSpec(seq_length=s, global_batch_size=gbs, micro_batch_size=mbs, precision=precision),
        parallelism=ParallelismSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, use_distributed_optimizer=False,
                                    overlap_grad_reduce=False, overlap_param_gather=False, **rc),
        implementation=ImplementationSpec(transformer_impl=impl, attention_backend=attn, cross_entropy_loss_fusion=False,
                                          gradient_accumulation_fusion=False),
    )
