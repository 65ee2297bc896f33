"""Core attention through torch's scaled_dot_product_attention, for Megatron's local layer spec.

Without Transformer Engine, Megatron's local spec uses DotProductAttention, which materialises the
b x n x s x s score matrix (the 'unfused' backend). Swapping this module into
`self_attention.submodules.core_attention` (spec_utils composition, no model code touched) gives
torch's flash / cuDNN / memory-efficient kernels instead. Causal masking only; no context
parallelism, no packed sequences.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

_BACKENDS = {
    # attention_backend -> torch SDPA kernels allowed; None = torch picks
    "auto": None,
    "flash": ("FLASH_ATTENTION",),
    "fused": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"),
}


class SDPACoreAttention(MegatronModule):
    """Drop-in for DotProductAttention: [s, b, heads, d] in, [s, b, heads * d_v] out."""

    #: set by the entry before the model is built: which kernels SDPA may use
    allowed_backends: tuple[str, ...] | None = None

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError(
                "parallelism.context_parallel_size > 1 needs Transformer Engine attention; "
                "set implementation.transformer_impl='transformer_engine' or context_parallel_size=1"
            )
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("packed sequences are not supported by the SDPA core attention")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        kw = {}
        if k.shape[1] != q.shape[1]:
            kw["enable_gqa"] = True  # GQA: fewer K/V heads than query heads
        dropout = self.dropout_p if self.training else 0.0
        allowed = self.allowed_backends
        if allowed and q.is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, name) for name in allowed]):
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale, **kw)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale, **kw)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def allowed_backends(attention_backend: str) -> tuple[str, ...] | None:
    return _BACKENDS.get(attention_backend)
