"""Host time of Megatron's own MoE modules on one GPU (issue 15): the probe behind the MoE host constants.

Runs on the device machine (one GPU, megatron-core and Transformer Engine installed; world size 1 over NCCL).
Builds Megatron-Core's modules from its own TE layer spec, not copies of them:
  - `experts`: TEGroupedMLP alone (TE GroupedLinear fc1, the weighted SwiGLU, fc2; FP8's Fp8Padding /
    Fp8Unpadding around them) over 2-128 local experts, bf16, FP8 delayed scaling and FP8 current scaling
    ('tensorwise'), uneven token counts per expert as a router gives them;
  - `layer`: the whole MoELayer (TopKRouter, the alltoall dispatcher at EP 1, fused permute, TEGroupedMLP)
    over 8-128 experts.
  - `misses`: TEGroupedMLP inside Megatron's DDP at 8 and 32 local experts, every expert's row count the same
    each iteration or one never met before (every GEMM's problem new to cuBLASLt's heuristics cache), with
    gradient-accumulation fusion off (Megatron-LM without Apex, this workplace's runs) and on (TE's wgrad
    accumulating into main_grad, NeMo's containers); `fusion`: the experts' per-expert slope with fusion on.
Each case times forward and backward apart: the CPU seconds the host takes to issue them (the GPU drained
before each iteration; the tokens are few, so the GPU never holds the host back) and the wall time. The
reference layer's host probe (launcher/entry/host_probe.py, what the profile job measures) runs before, between
and after the cases, so benchmarks/moe_host_accuracy.py prices the step-time model's host units at this machine's
speed. Writes $OUT/moe_host_probe.jsonl.

    python3 benchmarks/gpu/moe_host_probe.py [experts] [layer] [misses] [fusion]   (misses, fusion: MOE_PROBE_DDP=1)
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))  # the job's host probe

OUT = os.environ.get("OUT", ".")
HIDDEN, FFN = 2048, 768  # Qwen3-30B-A3B's expert (the E rank's)
PRECISIONS = {"bf16": {}, "fp8_delayed": {"fp8": "hybrid", "fp8_recipe": "delayed"},
              "fp8_tensorwise": {"fp8": "hybrid", "fp8_recipe": "tensorwise"}}
LOCAL_EXPERTS = (2, 4, 8, 16, 32, 64, 128)
TOKENS_PER_EXPERT = 128
LAYER_CASES = ((8, 2), (16, 8), (32, 8), (64, 8), (128, 8))  # (experts, top-k) of the whole MoE layer
LAYER_TOKENS = 2048
ITERS = 20
#: MOE_PROBE_DDP=1 wraps each module in Megatron's DistributedDataParallel (world size 1, no overlap), whose
#: per-parameter backward hook adds each weight's gradient into its main_grad, as in training
DDP = os.environ.get("MOE_PROBE_DDP") == "1"
records: list[dict] = []


def emit(**kw):
    kw = {k: (float(f"{v:.5g}") if isinstance(v, float) else v) for k, v in kw.items()}
    records.append(kw)
    print(json.dumps(kw), flush=True)
    with open(os.path.join(OUT, "moe_host_probe.partial.jsonl"), "a") as fh:
        fh.write(json.dumps(kw) + "\n")


def init():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def config(experts: int, topk: int, precision: str, fusion: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=32, ffn_hidden_size=6144, moe_ffn_hidden_size=FFN,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        moe_permute_fusion=True, moe_router_force_load_balancing=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, normalization="RMSNorm", bf16=True,
        params_dtype=torch.bfloat16, gradient_accumulation_fusion=fusion, hidden_dropout=0.0, attention_dropout=0.0,
        **PRECISIONS[precision])


def moe_layer(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=True)
    return spec.submodules.mlp(config=cfg).cuda()  # a partial of MoELayer, as TransformerLayer calls it


def wrapped(cfg, module):
    if not DDP:
        return module
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(), module=module)


def timed(fwd, grad) -> dict:
    """Median host seconds (thread CPU time and wall) to issue one forward and one backward, the GPU drained
    before each iteration; wall_s: forward + backward to the GPU's end."""
    from megatron.core.fp8_utils import get_fp8_context

    fc, bc, fw, bw, tot = [], [], [], [], []
    for i in range(ITERS + 3):
        torch.cuda.synchronize()
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fwd(get_fp8_context)
        c1, w1 = time.thread_time(), time.perf_counter()
        out.backward(grad)
        c2, w2 = time.thread_time(), time.perf_counter()
        torch.cuda.synchronize()
        if i >= 3:
            fc.append(c1 - c0), bc.append(c2 - c1), fw.append(w1 - w0), bw.append(w2 - w1)
            tot.append(time.perf_counter() - w0)
    med = statistics.median
    return {"fwd_cpu_s": med(fc), "bwd_cpu_s": med(bc), "fwd_wall_s": med(fw), "bwd_wall_s": med(bw),
            "wall_s": med(tot)}


def _splits(local: int, mean: int, seed: int | None = None) -> torch.Tensor:
    """Uneven token counts per local expert summing to local * mean (not multiples of 16, so FP8 pads)."""
    g = torch.Generator().manual_seed(local if seed is None else seed)
    dev = torch.randint(-mean // 4, mean // 4 + 1, (local,), generator=g)
    dev[-1] -= dev.sum()
    return (mean + dev).clamp(min=1).to(torch.int64)


def experts_case(local: int, precision: str, fusion: bool = False):
    cfg = config(local, 2, precision, fusion)
    ex = wrapped(cfg, moe_layer(cfg).experts)
    counts = _splits(local, TOKENS_PER_EXPERT)  # on the host, as the alltoall dispatcher hands them over
    n = int(counts.sum())
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(n, device="cuda", dtype=torch.float32)
    grad = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def fwd(ctx):
        with ctx(cfg):
            return ex(x, counts, probs)[0]

    return {"module": type(getattr(ex, "module", ex)).__name__, "tokens": n, **timed(fwd, grad)}


_MET: dict[int, itertools.count] = {}  # per expert count: the iterations of every case so far (no count met twice)
MISS_TOKENS_PER_EXPERT = 4096


def _new_counts(local: int, total: int, i: int) -> torch.Tensor:
    """Row counts summing to `total`, each met in no earlier iteration (the last expert's takes the remainder);
    the two expert counts draw from disjoint ranges."""
    base = 200 if local < 32 else 1000
    c = torch.tensor([base + i * local + e for e in range(local - 1)] + [0], dtype=torch.int64)
    c[-1] = total - c.sum()
    return c


CYCLED_SPLITS = 3  # 'cycle': the counts take one of this many fixed sets in turn, all met in the warm-up iterations


def misses_case(local: int, fusion: bool, mode: str):
    """TEGroupedMLP with every expert's row count the same each iteration ('same'), one of CYCLED_SPLITS sets met
    before ('cycle': the counts change but every GEMM problem is cached) or never met before ('new')."""
    cfg = config(local, 2, "bf16", fusion)
    ex = wrapped(cfg, moe_layer(cfg).experts)
    total = MISS_TOKENS_PER_EXPERT * local
    fixed = _splits(local, MISS_TOKENS_PER_EXPERT)
    x = torch.randn(total, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(total, device="cuda", dtype=torch.float32)
    grad = torch.randn(total, HIDDEN, device="cuda", dtype=torch.bfloat16)
    it = _MET.setdefault(local, itertools.count())
    cycled = [_splits(local, MISS_TOKENS_PER_EXPERT, seed=local * 100 + j) for j in range(CYCLED_SPLITS)]
    turn = itertools.count()

    def fwd(ctx):
        counts = {"new": lambda: _new_counts(local, total, next(it)), "same": lambda: fixed,
                  "cycle": lambda: cycled[next(turn) % CYCLED_SPLITS]}[mode]()
        with ctx(cfg):
            return ex(x, counts, probs)[0]

    return {"module": type(getattr(ex, "module", ex)).__name__, "tokens": total, **timed(fwd, grad)}


def layer_case(experts: int, topk: int, precision: str):
    cfg = config(experts, topk, precision)
    layer = wrapped(cfg, moe_layer(cfg))
    x = torch.randn(LAYER_TOKENS, 1, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def fwd(ctx):
        with ctx(cfg):
            out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    return {"module": type(getattr(layer, "module", layer)).__name__, "dispatcher": cfg.moe_token_dispatcher_type, **timed(fwd, grad)}


def reference(tag: str):
    from mcore_advisor.launcher.entry import host_probe

    emit(kind="host_probe", at=tag, **{k: v for k, v in host_probe.measure(True).items() if k != "per_iteration_ms"})


#: MOE_PROBE_FUSION=off|on|both: the wgrad fusion settings `misses` runs (both: off, then on)
FUSIONS = {"off": (False,), "on": (True,), "both": (False, True)}[os.environ.get("MOE_PROBE_FUSION", "both")]
#: MOE_PROBE_MODES=same,new[,cycle]: the count modes `misses` interleaves, each twice
MODES = tuple(os.environ.get("MOE_PROBE_MODES", "same,new").split(","))


def run_misses():
    for local in (8, 32):
        for fusion in FUSIONS:
            for mode in MODES * 2:  # interleaved twice: the host's drift shows
                rec = {"kind": "moe_misses", "local_experts": local, "fusion": fusion, "new_counts": mode == "new",
                       "counts": mode, "precision": "bf16", "hidden": HIDDEN, "ffn": FFN, "ddp": DDP}
                try:
                    emit(**rec, **misses_case(local, fusion, mode))
                except Exception as exc:
                    emit(**rec, error=repr(exc)[:400])
                torch.cuda.empty_cache()


def run_fusion():
    for local in (2, 8, 32, 64):
        rec = {"kind": "moe_fusion", "local_experts": local, "fusion": True, "precision": "bf16", "hidden": HIDDEN,
               "ffn": FFN, "ddp": DDP}
        try:
            emit(**rec, **experts_case(local, "bf16", fusion=True))
        except Exception as exc:
            emit(**rec, error=repr(exc)[:400])
        torch.cuda.empty_cache()


def run(section: str):
    if section in ("misses", "fusion"):
        return run_misses() if section == "misses" else run_fusion()
    cases = ([(local, p) for p in PRECISIONS for local in LOCAL_EXPERTS] if section == "experts"
             else [(ek, p) for p in ("bf16", "fp8_tensorwise") for ek in LAYER_CASES])
    for arg, precision in cases:
        rec = ({"local_experts": arg} if section == "experts" else {"experts": arg[0], "topk": arg[1]})
        rec.update(kind=f"moe_{section}", precision=precision, hidden=HIDDEN, ffn=FFN, ddp=DDP)
        try:
            got = experts_case(arg, precision) if section == "experts" else layer_case(*arg, precision)
            emit(**rec, **got)
        except Exception as exc:
            emit(**rec, error=repr(exc)[:400])
        torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    sections = argv or ["experts", "layer"]
    props = torch.cuda.get_device_properties(0)
    emit(kind="device", name=props.name, torch=torch.__version__, cpus=os.cpu_count())
    init()
    reference("start")
    for s in sections:
        run(s)
        reference(f"after_{s}")
    with open(os.path.join(OUT, "moe_host_probe.jsonl"), "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
