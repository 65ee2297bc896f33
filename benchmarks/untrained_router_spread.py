"""How unevenly an untrained Megatron router spreads Megatron's mock tokens over the experts, layer by layer (issue 15).

Builds megatron-core's own GPTModel (local spec, CPU, gloo world of one: launcher/entry/cpu_shim) at Megatron-LM's
initialisation (init_method_std 0.02) for an MoE shape, feeds one sample of Megatron's mock data (MockGPTLowLevelDataset:
documents of token ids 1 .. n-1 and an end-of-document token, n drawn below 4,096, built by Megatron's own class) forward, and records each router's
tokens per expert (TopKRouter's routing_map). Prints and appends, per shape, the spread (population std / mean of the
tokens per expert) of every MoE layer. A probe at initialisation only: the profile job's routing record comes after its
warm-up iterations' optimizer steps (benchmarks/results/gpu_h100_O_summary.md says where the two differ).

    .venv/bin/python benchmarks/untrained_router_spread.py            # the shapes below, a few minutes each on 2 cores
    .venv/bin/python benchmarks/untrained_router_spread.py olmoe      # one of them
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from mcore_advisor.launcher.entry import cpu_shim

OUT = Path(__file__).resolve().parent / "results" / "untrained_router_spread.jsonl"
BASE = {"k": 8, "heads": 16, "kv": 16, "layers": 4, "seq": 4096, "shared": None, "qk_norm": False, "vocab": 32000}
#: the O set's and R set's shapes (benchmarks/gpu/configs_multi.py), a few layers each
SHAPES = {
    "olmoe": {**BASE, "hidden": 2048, "experts": 64, "ffn": 1024, "qk_norm": True, "vocab": 50304},
    "olmoe_shared": {**BASE, "hidden": 2048, "experts": 64, "ffn": 1024, "qk_norm": True, "vocab": 50304, "shared": 5632, "seq": 2048},
    "moe64_shared": {**BASE, "hidden": 2048, "experts": 64, "ffn": 1408, "kv": 4, "shared": 2816, "seq": 2048},
    "mixtral_l2": {**BASE, "hidden": 4096, "experts": 8, "k": 2, "heads": 32, "kv": 8, "ffn": 14336, "layers": 2, "seq": 2048},
}


def mock_tokens(seq: int, vocab: int) -> np.ndarray:
    """One sample of Megatron's own mock documents (core/datasets/gpt_dataset.py MockGPTLowLevelDataset, its seed and
    lengths), documents 0, 1, ... in order (the data loader's shuffle left out), the end-of-document token 0."""
    from types import SimpleNamespace

    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    docs = MockGPTLowLevelDataset(SimpleNamespace(vocab_size=vocab, eod=0))
    out: list[int] = []
    for i in range(len(docs)):
        out += docs[i].tolist()
        if len(out) >= seq:
            return np.asarray(out[:seq])
    raise ValueError(f"mock documents shorter than {seq} tokens")


def spread(s: dict) -> list[float]:
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"], num_query_groups=s["kv"],
        ffn_hidden_size=s["ffn"], num_moe_experts=s["experts"], moe_router_topk=s["k"], moe_ffn_hidden_size=s["ffn"],
        moe_shared_expert_intermediate_size=s["shared"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, qk_layernorm=s["qk_norm"], use_cpu_initialization=True,
        init_method_std=0.02, moe_token_dispatcher_type="alltoall", bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(num_experts=s["experts"], moe_grouped_gemm=False, qk_layernorm=s["qk_norm"],
                                    normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=s["vocab"], max_sequence_length=s["seq"],
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    loads: dict[int, torch.Tensor] = {}

    def record(i: int):
        def hook(_module, _inputs, out) -> None:  # returning None leaves the router's (probs, routing_map) as they are
            loads.setdefault(i, out[1].sum(0).double())
        return hook

    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(record(i))
    tokens = torch.from_numpy(mock_tokens(s["seq"], s["vocab"])).unsqueeze(0)
    with torch.no_grad():
        model(tokens, torch.arange(s["seq"]).unsqueeze(0), attention_mask=None)
    return [round(float(v.std(unbiased=False) / v.mean()), 3) for _, v in sorted(loads.items())]


def main(names: list[str]) -> None:
    cpu_shim.install()
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)  # Megatron's tracker of the model-parallel RNG states, as pretrain sets it
    for name in names or list(SHAPES):
        row = {"shape": name, **SHAPES[name], "spread_per_moe_layer": spread(SHAPES[name]),
               "megatron_core": _version("megatron-core"), "torch": torch.__version__}
        print(json.dumps(row), flush=True)
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    main(sys.argv[1:])
