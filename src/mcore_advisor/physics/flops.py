"""Training FLOPs as Megatron-LM counts them, in both attention conventions, plus hardware FLOPs.

Model FLOPs reproduce `num_floating_point_operations` in Megatron-LM
`megatron/training/training.py` (HEAD): every GEMM counted x2 (multiply-add) and x3 (forward,
data-gradient, weight-gradient); norms, softmax, activations, router and embedding lookup are
ignored; recompute is not counted. Two conventions for the core-attention term (QK^T and PV):

- 'causal': Megatron since commit 8873b55d6a (2025-03-06) counts half of the s x s matrix
  (causal mask). This is what Megatron >= 0.12 prints as "throughput per GPU (TFLOP/s/GPU)".
- 'full':   the full s x s matrix, as Megatron before 2025-03, NeMo 24.x, Narayanan 2021 and
  Korthikanti 2022 (their 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) for GPT-3 shapes).

'causal' = 'full' - half the core-attention term; every other term is identical. (For MoE,
pre-2025-03 Megatron also used ffn_hidden_size for every layer and ignored dense layers and
shared experts; 'full' here keeps HEAD's per-layer MoE accounting and changes only attention.)

Megatron multiplies the logits term by `args.padded_vocab_size` (Megatron's
`_vocab_size_with_padding`: V rounded up to make_vocab_size_divisible_by * TP), so TP can change
the count by a few ppm; pass `tensor_model_parallel_size` (or an explicit padded vocab).

Each part is counted from the one description of a layer, physics.anatomy, which the profile job's
counter (launcher/entry/profile.py) calls too.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.physics.anatomy import FWD_BWD as _FWD_BWD
from mcore_advisor.physics.anatomy import Convention, flops_per_token_parts
from mcore_advisor.physics.anatomy import flops_per_iteration as anatomy_flops_per_iteration
from mcore_advisor.schemas import ModelShape, ParallelismSpec


class FlopsPerToken(BaseModel):
    """Training FLOPs (forward + backward, model FLOPs) per token of one sequence, by part.

    Each part is summed over all layers (MTP layers included where Megatron counts them). The
    forward pass is exactly one third of every part. `total_flops` is Megatron's per-token count;
    multiply by global_batch_size * seq_length for one iteration.
    """

    model_config = ConfigDict(frozen=True)

    convention: Convention = Field(description="'causal' (Megatron >= 2025-03) or 'full' (full s^2 core attention).")
    seq_length: int
    padded_vocab_size: int = Field(description="Vocab size used for the logits term (Megatron uses the padded vocab).")
    num_attention_layers: int = Field(description="Layers with self-attention: num_layers + mtp_num_layers (a hybrid pattern's '*' layers).")
    attention_linear_flops: float = Field(description="QKV (or MLA down/up) and output projections, all attention layers.")
    core_attention_flops: float = Field(description="QK^T and softmax(QK^T)V, all attention layers, in `convention`.")
    dense_mlp_flops: float = Field(description="Dense MLP GEMMs (fc1 incl. the SwiGLU gate, fc2), all dense layers.")
    moe_routed_flops: float = Field(description="Routed experts: top-k experts per token, all MoE layers (router GEMM not counted, as Megatron).")
    moe_shared_flops: float = Field(description="Shared expert(s), all MoE layers.")
    mtp_extra_flops: float = Field(description="MTP eh-projection and norms (Megatron's 3h + 2h^2 per MTP layer).")
    logits_flops: float = Field(description="Output layer h x V, once plus once per MTP layer.")
    mamba_flops: float = Field(0.0, description="Mamba-2 layers of a hybrid model (in_proj, scan, out_proj), as Megatron's hybrid_flops counts them.")
    total_flops: float = Field(description="Sum of the parts: Megatron's FLOPs per token.")

    @property
    def layer_flops(self) -> float:
        """FLOPs of the transformer layers (everything except logits and MTP extras)."""
        return (
            self.attention_linear_flops
            + self.core_attention_flops
            + self.dense_mlp_flops
            + self.moe_routed_flops
            + self.moe_shared_flops
            + self.mamba_flops
        )


def _padded_vocab(shape: ModelShape, tensor_model_parallel_size: int, padded_vocab_size: int | None) -> int:
    return padded_vocab_size if padded_vocab_size is not None else shape.padded_vocab_size(tensor_model_parallel_size)


def flops_per_token_breakdown(
    shape: ModelShape,
    seq_length: int,
    convention: Convention = "causal",
    *,
    tensor_model_parallel_size: int = 1,
    padded_vocab_size: int | None = None,
) -> FlopsPerToken:
    """Megatron's model FLOPs per token (fwd+bwd), split into the parts a step-time model times.

    `padded_vocab_size` defaults to shape.padded_vocab_size(tensor_model_parallel_size), which is
    what Megatron's `args.padded_vocab_size` holds after tokenizer setup.
    """
    V = _padded_vocab(shape, tensor_model_parallel_size, padded_vocab_size)
    parts = flops_per_token_parts(shape, seq_length, convention, V)
    attn_layers = parts.pop("num_attention_layers")
    return FlopsPerToken(
        convention=convention,
        seq_length=seq_length,
        padded_vocab_size=V,
        num_attention_layers=attn_layers,
        total_flops=sum(parts.values()),
        **parts,
    )


def flops_per_iteration(
    shape: ModelShape,
    seq_length: int,
    global_batch_size: int,
    convention: Convention = "causal",
    *,
    tensor_model_parallel_size: int = 1,
    padded_vocab_size: int | None = None,
) -> float:
    """Model FLOPs of one global batch: Megatron's num_floating_point_operations(args, gbs).

    Divide by (iteration time * 1e12 * world size) for Megatron's TFLOP/s/GPU log figure (in the
    'causal' convention for Megatron >= 2025-03, 'full' for older releases and NeMo 24.x).
    """
    V = _padded_vocab(shape, tensor_model_parallel_size, padded_vocab_size)
    return anatomy_flops_per_iteration(shape, seq_length, global_batch_size, convention, padded_vocab_size=V)


def recomputed_layer_fraction(num_layers_per_chunk, recompute_method, recompute_num_layers):
    """Fraction of a model chunk's layers whose forward is rerun under full recompute.

    Megatron `TransformerBlock._checkpointed_forward`: 'uniform' checkpoints groups of
    recompute_num_layers layers and reruns every group, so every layer is recomputed; 'block'
    checkpoints only the first recompute_num_layers layers of each model chunk (each virtual
    stage), the rest keep their activations. Numbers or numpy arrays: `recompute_method` may be an
    array of 'block' flags and `recompute_num_layers` an array with 0 for unset (the whole chunk).
    """
    chunk = np.asarray(num_layers_per_chunk, dtype=np.float64)
    if recompute_method is None or isinstance(recompute_method, str):
        recompute_method = recompute_method == "block"
    k = np.asarray(0 if recompute_num_layers is None else recompute_num_layers, dtype=np.float64)
    r = np.where(k > 0, k, chunk)
    frac = np.where(np.asarray(recompute_method, dtype=bool), np.minimum(r, chunk) / np.maximum(chunk, 1.0), 1.0)
    out = np.where(chunk > 0, frac, 0.0)
    return float(out) if out.ndim == 0 else out


def hardware_flops_per_iteration(
    shape: ModelShape,
    seq_length: int,
    global_batch_size: int,
    convention: Convention = "causal",
    parallelism: ParallelismSpec | None = None,
    *,
    padded_vocab_size: int | None = None,
    selective_form: Literal["korthikanti", "exact"] = "korthikanti",
) -> float:
    """FLOPs the GPUs actually execute per iteration: model FLOPs + recomputed forward work (HFU),
    with the plan's `parallelism` (recompute choices, TP for the vocab padding, PP/VP for block
    recompute; None = no recompute, TP 1).

    - selective (core_attn, Megatron's default module): Korthikanti et al. 2022 (arXiv 2205.05198,
      Sec. 6) count hardware FLOPs as 72*B*s*L*h^2*(1 + s/(3h) + V/(12*L*h)) vs model
      72*B*s*L*h^2*(1 + s/(6h) + ...): the whole core-attention term is added once more.
      `selective_form='korthikanti'` (default) follows that, which reproduces their published HFU
      (175B: 51.4% MFU -> 52.8% HFU). `'exact'` adds only the rerun forward of core attention
      (one third of its fwd+bwd term), which is what the GPU does.
      Other selective modules: 'mlp', 'moe', 'shared_experts' rerun their GEMM forward (1/3 of
      their term); 'layernorm' and 'moe_act' rerun no GEMM; 'mla_up_proj' reruns MLA's
      up-projections, which this breakdown does not separate (not added).
    - full: one extra forward of every recomputed layer (Narayanan et al. 2021:
      96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h)) = 4/3 of the layer FLOPs, logits not recomputed), for the
      fraction of layers implied by recompute_method / recompute_num_layers per model chunk.
    """
    p = parallelism or ParallelismSpec()
    bd = flops_per_token_breakdown(
        shape, seq_length, convention,
        tensor_model_parallel_size=p.tensor_model_parallel_size, padded_vocab_size=padded_vocab_size,
    )
    extra = 0.0
    if p.recompute_granularity == "selective":
        modules = p.recompute_modules if p.recompute_modules is not None else ["core_attn"]
        if "core_attn" in modules:
            extra += bd.core_attention_flops * (1.0 if selective_form == "korthikanti" else 1.0 / _FWD_BWD)
        if "mlp" in modules:
            extra += bd.dense_mlp_flops / _FWD_BWD
        if "moe" in modules:
            extra += (bd.moe_routed_flops + bd.moe_shared_flops) / _FWD_BWD
        elif "shared_experts" in modules:
            extra += bd.moe_shared_flops / _FWD_BWD
    elif p.recompute_granularity == "full":
        pp = p.pipeline_model_parallel_size
        vp = (p.virtual_pipeline_model_parallel_size or 1) if pp > 1 else 1
        per_chunk = max(1, shape.num_layers // (pp * vp))
        frac = recomputed_layer_fraction(per_chunk, p.recompute_method, p.recompute_num_layers)
        # MTP layers live outside the decoder block and are not part of its checkpointing.
        decoder_share = shape.num_layers / (shape.num_layers + shape.mtp_num_layers)
        extra += bd.layer_flops * decoder_share * frac / _FWD_BWD
    return (bd.total_flops + extra) * global_batch_size * seq_length


def gpt3_closed_form_flops(global_batch_size: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int) -> float:
    """Korthikanti 2022 / Narayanan 2021 model FLOPs, 'full' convention: 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)).

    Valid for MHA, ffn = 4h, no SwiGLU; kept as an independent cross-check of the general formula.
    """
    B, s, L, h, V = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
