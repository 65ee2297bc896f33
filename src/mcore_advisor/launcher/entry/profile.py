"""The profiled Megatron-Core job: train a GPT with a plan's shape and layout on synthetic tokens,
time it, trace it, and report what it measured.

    torchrun --nproc_per_node N -m mcore_advisor.launcher.entry.profile --spec spec.json --out-dir DIR
    python -m mcore_advisor.launcher.entry.profile --spec spec.json --out-dir DIR     (world size 1)

`spec.json` is launcher/spec.py's `job_spec(plan)`. This module reads that dict only: it imports no
pydantic and nothing from mcore_advisor outside launcher/entry, because the GPU image has torch but
not the rest of the project's dependencies.

Writes into DIR:
- result.json (rank 0): step times, tokens/s, TFLOP/s and MFU in both conventions, peak memory of
  every rank, exposed communication and GPU busy time from the trace, host diagnostics (Python GC
  pauses per timed iteration, CPU steal and load over the measured ones), versions, and what was
  actually used;
- train.log: one line per iteration in Megatron-LM's `training_log` format plus its memory report;
- trace_rank0.json: torch.profiler Chrome trace of the profiled iterations;
- error.json on failure ({status: "failed", error_type, message, rank, ...}), exit status 1.

Model: megatron-core GPTModel built from `get_gpt_decoder_block_spec` (dense and MoE layers per
moe_layer_freq), bf16 mixed precision through Megatron's DDP and `get_megatron_optimizer` (Adam),
the layout through `parallel_state.initialize_model_parallel` and `get_forward_backward_func`, as
Megatron-LM's pretrain_gpt does. Transformer Engine's layer spec when TE imports and the plan asks
for it; otherwise the local spec with torch SDPA as core attention (Megatron's own
DotProductAttention for attention_backend 'unfused'/'local').
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

from mcore_advisor.launcher.entry import flops as _flops
from mcore_advisor.launcher.entry import trace as _trace
from mcore_advisor.launcher.entry import trainlog as _trainlog

GIB = 2**30
MIB = 2**20
#: constant learning rate (no scheduler: the job measures speed and memory, not convergence)
LEARNING_RATE = 1.0e-4


class _State:
    """What the error report needs to know about how far the job got."""

    phase = "start"
    iteration = 0
    use_cuda = False


# --------------------------------------------------------------------------- schedule of iterations

def iteration_plan(warmup_steps: int, measure_steps: int, profile_steps: list[int] | tuple[int, int] | None) -> list[str]:
    """Kind of each iteration (index 0 = iteration 1): 'warmup', 'profile', 'measure' or 'extra'.

    The first `measure_steps` iterations after warm-up that are not profiled are measured; the job
    runs until both the measured count and the profile window are complete.
    """
    kinds: list[str] = []
    measured = 0
    it = 0
    last_profiled = profile_steps[1] if profile_steps else 0
    while measured < measure_steps or it < last_profiled:
        it += 1
        if profile_steps and profile_steps[0] <= it <= profile_steps[1]:
            kinds.append("profile")
        elif it <= warmup_steps:
            kinds.append("warmup")
        elif measured < measure_steps:
            kinds.append("measure")
            measured += 1
        else:
            kinds.append("extra")
    return kinds


# --------------------------------------------------------------------------- one micro-batch

def loss_func(loss_mask, output_tensor):
    """Megatron-LM pretrain_gpt `loss_func`: (summed loss, token count, {'lm loss': [sum, count]}).

    With `calculate_per_token_loss=False` (the TransformerConfig default, as in pretrain_gpt) the
    schedule divides the returned loss in place by the token count and the number of micro-batches
    (schedules.forward_step_calc_loss), hence the detached clone for reporting.
    Nothing here reads a device value back to the host: a `.item()`/`float()`/`bool()` per
    micro-batch would make the CPU wait for the GPU and leave it idle while the next micro-batch
    is launched. (pretrain_gpt's own NaN/Inf checks do read the loss back, twice per micro-batch;
    this job leaves them out, so it is never slower than pretrain_gpt on that account.)
    """
    import torch

    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1))
    num_tokens = loss_mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model_chunk):
    """The `forward_step_func` handed to Megatron's schedule: one prebuilt device batch per call."""
    batch = next(data_iterator)
    output = model_chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------- host diagnostics

def _cpu_times() -> tuple[float, float] | None:
    """(steal, total) jiffies summed over all CPUs from /proc/stat; None off Linux.

    Steal time is what a hypervisor gave to other guests while this VM's vCPU wanted to run.
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [float(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
    total = sum(vals[:8])
    steal = vals[7] if len(vals) > 7 else 0.0
    return steal, total


class _HostMonitor:
    """Per-iteration Python GC pauses and, over the measured window, CPU steal and load.

    A host-bound step (the GPU waits for the CPU to launch kernels, typical at small micro-batches)
    is slowed by anything that takes the CPU away: GC pauses in this process, other processes on
    the machine, or the hypervisor. These figures say which one it was without a re-run.
    """

    def __init__(self) -> None:
        self.gc_s: list[float] = []
        self.gc_gen2: list[int] = []
        self._t0 = 0.0
        self._steal0: tuple[float, float] | None = None
        self.steal_fraction: float | None = None
        self.loadavg_1m: tuple[float, float] | None = None
        self._load0: float | None = None
        self._active = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self._active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.gc_s[-1] += time.perf_counter() - self._t0
            if info.get("generation") == 2:
                self.gc_gen2[-1] += 1

    def begin_iteration(self) -> None:
        """Start counting GC for one timed iteration (call right before its clock starts)."""
        self.gc_s.append(0.0)
        self.gc_gen2.append(0)
        self._active = True

    def end_iteration(self) -> None:
        self._active = False

    def measure_start(self) -> None:
        self._steal0 = _cpu_times()
        self._load0 = _loadavg()

    def measure_end(self) -> None:
        end = _cpu_times()
        if self._steal0 is not None and end is not None and end[1] > self._steal0[1]:
            self.steal_fraction = (end[0] - self._steal0[0]) / (end[1] - self._steal0[1])
        load1 = _loadavg()
        if self._load0 is not None and load1 is not None:
            self.loadavg_1m = (self._load0, load1)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


#: a profiled iteration whose GPU idles more than this is reported as host-bound
HOST_BOUND_IDLE_FRACTION = 0.25


def device_idle(device_busy_s: float, profiled_iteration_s: float) -> tuple[float, str | None]:
    """(idle fraction of the GPU in a profiled iteration, 'host-bound' note or None).

    No per-micro-batch host sync in the loop means an idle GPU is waiting for the CPU to launch
    kernels. The profiler adds host time per op, so a profiled iteration overstates it somewhat.
    """
    idle = max(0.0, 1.0 - device_busy_s / profiled_iteration_s)
    if idle <= HOST_BOUND_IDLE_FRACTION:
        return idle, None
    return idle, (f"host-bound: GPU kernels ran {device_busy_s:.3f} s of the {profiled_iteration_s:.3f} s profiled "
                  f"iteration ({100 * idle:.0f}% idle); the CPU did not launch work fast enough (see host)")


# --------------------------------------------------------------------------- environment

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_env(spec: dict[str, Any]) -> None:
    """Environment that must be set before torch initialises CUDA or the process group."""
    dims = spec["dims"]
    if dims["tp"] > 1 or dims["cp"] > 1:
        # Megatron asserts this for TP/SP/CP: one hardware queue keeps the communication kernels
        # in issue order so they overlap with the GEMMs that follow.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if spec["implementation"].get("expandable_segments"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if "RANK" not in os.environ:  # plain `python -m`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))


def _filtered(cls, kwargs: dict[str, Any], dropped: list[str]):
    """Build a Megatron config dataclass from the kwargs it knows; record the rest."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    for k in kwargs:
        if k not in names:
            dropped.append(f"{cls.__name__}.{k}")
    return cls(**{k: v for k, v in kwargs.items() if k in names})


def _versions(te_version: str | None) -> dict[str, Any]:
    import torch

    try:
        from megatron.core import package_info

        mcore = package_info.__version__
    except Exception:  # pragma: no cover - very old megatron
        mcore = None
    return {
        "torch": torch.__version__,
        "megatron_core": mcore,
        "transformer_engine": te_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _rss_bytes() -> tuple[float, float]:
    """(current, peak) resident set size of this process, bytes (Linux)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    cur = peak
    try:
        with open("/proc/self/statm") as f:
            cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    # ru_maxrss lags the current RSS between samples of the kernel's high-water mark
    return float(cur), float(max(peak, cur))


# --------------------------------------------------------------------------- the job

class Job:
    def __init__(self, spec: dict[str, Any], out_dir: Path, device: str = "auto") -> None:
        self.spec = spec
        self.out = out_dir
        self.device_request = device
        self.rank = int(os.environ.get("RANK", "0"))
        self.notes: list[str] = []
        self.dropped: list[str] = []

    # ---- setup
    def _init(self) -> None:
        import torch

        _State.phase = "init"
        self.torch = torch
        use_cuda = self.device_request == "cuda" or (self.device_request == "auto" and torch.cuda.is_available())
        if self.device_request == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        self.use_cuda = _State.use_cuda = use_cuda
        if not use_cuda:
            from mcore_advisor.launcher.entry import cpu_shim

            cpu_shim.install(spoof_tensor_type=True)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        want = self.spec["dims"]["world_size"]
        if self.world != want:
            raise ValueError(
                f"the job runs with world size {self.world} but the plan's cluster.num_gpus is {want}; "
                f"launch torchrun --nproc_per_node {want} (or change cluster.num_gpus)"
            )
        self.te_version = None
        self.have_te = False
        impl = self.spec["implementation"]
        if use_cuda and impl["transformer_impl"] == "transformer_engine":
            try:
                import transformer_engine
                import transformer_engine.pytorch  # noqa: F401

                self.have_te = True
                self.te_version = getattr(transformer_engine, "__version__", "unknown")
            except Exception as exc:  # TE absent or broken: the local spec still runs
                self.notes.append(f"transformer_engine requested but not importable ({type(exc).__name__}: {exc}); local spec used")
        elif impl["transformer_impl"] == "transformer_engine":
            self.notes.append("transformer_engine requested; not used on CPU (local spec)")
        if use_cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo",
                                             rank=self.rank, world_size=self.world)

    def _parallel(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        _State.phase = "parallel_state"
        ps.initialize_model_parallel(**_parallel_sizes(self.spec["dims"]))
        self.ps = ps
        seed = self.spec["run"]["seed"]
        self.torch.manual_seed(seed)
        # On CPU the default RNG tracker reads CUDA RNG state; the inference tracker is a no-op.
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not self.use_cuda)

    def _config(self):
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer.enums import AttnBackend
        from megatron.core.transformer.transformer_config import TransformerConfig

        _State.phase = "config"
        m, t, p, impl, d = (self.spec[k] for k in ("model", "training", "parallelism", "implementation", "dims"))
        if m.get("multi_latent_attention"):
            raise ValueError("model.multi_latent_attention is not supported by the profile job yet; profile an MHA/GQA model")
        if m.get("mtp_num_layers"):
            raise ValueError("model.mtp_num_layers > 0 is not supported by the profile job yet; set it to 0")
        cuda = self.use_cuda
        sp = bool(p["sequence_parallel"]) and d["tp"] > 1
        if p["sequence_parallel"] and d["tp"] == 1:
            self.notes.append("sequence_parallel ignored: tensor_model_parallel_size is 1")
        fp8 = None
        if t["precision"] == "fp8":
            if not self.have_te:
                raise ValueError("training.precision='fp8' needs Transformer Engine on a GPU; "
                                 "set training.precision='bf16' or install transformer_engine")
            fp8 = t["fp8_format"]
        attn_backend = impl["attention_backend"]
        if self.have_te:
            self.transformer_impl = "transformer_engine"
            cfg_backend = AttnBackend[attn_backend]
        else:
            self.transformer_impl = "local"
            cfg_backend = AttnBackend.local
        # Recompute: Megatron needs a method with 'full'; uniform groups of 1 is its usual choice.
        gran = p["recompute_granularity"]
        method = p["recompute_method"] if gran == "full" else None
        nlayers = p["recompute_num_layers"] if gran == "full" else None
        if gran == "full" and method is None:
            method, nlayers = "uniform", nlayers or 1
            self.notes.append("recompute_granularity=full without recompute_method: uniform, 1 layer per group")
        if gran == "full" and nlayers is None:
            nlayers = 1
        experts = m.get("num_experts")
        grouped = bool(experts) and impl["moe_grouped_gemm"] and self.have_te
        if experts and impl["moe_grouped_gemm"] and not grouped:
            self.notes.append("moe_grouped_gemm needs Transformer Engine here; SequentialMLP experts used")
        dispatcher = impl["moe_token_dispatcher_type"]
        if dispatcher == "flex":
            self.notes.append("moe_token_dispatcher_type 'flex' needs DeepEP; 'alltoall' used")
            dispatcher = "alltoall"
        gelu_bias_ok = m["add_bias_linear"] or m["swiglu"]
        want_gaf = cuda and bool(impl.get("gradient_accumulation_fusion", True))
        apex_gaf = want_gaf and _have_apex_wgrad_fusion()
        self.fuse_te_wgrad = want_gaf and not apex_gaf and self.have_te
        kw = dict(
            num_layers=m["num_layers"],
            hidden_size=m["hidden_size"],
            num_attention_heads=m["num_attention_heads"],
            num_query_groups=m["num_query_groups"],
            kv_channels=m["kv_channels"],
            ffn_hidden_size=m["ffn_hidden_size"],
            normalization=m["normalization"],
            layernorm_epsilon=1e-5,
            gated_linear_unit=bool(m["swiglu"]),
            activation_func=F.silu if m["swiglu"] else F.gelu,
            add_bias_linear=bool(m["add_bias_linear"]),
            add_qkv_bias=bool(m["add_bias_linear"]),
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=0.02,
            **_parallel_sizes(d),
            sequence_parallel=sp,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            recompute_granularity=gran,
            recompute_method=method,
            recompute_num_layers=nlayers,
            recompute_modules=p["recompute_modules"] if gran == "selective" and p["recompute_modules"] else None,
            # For Megatron's own linear layers (the output layer under TE) the fusion needs Apex's
            # fused_weight_gradient_mlp_cuda, and TransformerConfig asks it of every layer: without
            # Apex the TE layers get it after the build (_fuse_te_wgrad).
            gradient_accumulation_fusion=apex_gaf,
            # Megatron-LM's defaults on a GPU; its fused kernels are torch.compile'd or TE's.
            bias_activation_fusion=cuda and gelu_bias_ok,
            # Megatron's fused masked softmax (unfused attention only) needs the compiled
            # scaled_*masked_softmax_cuda extensions (Apex / Megatron-LM builds); the GPU image has
            # neither, and megatron-core 0.19 then fails with ModuleNotFoundError at the first step.
            masked_softmax_fusion=cuda and _have_fused_softmax(),
            bias_dropout_fusion=cuda,
            apply_rope_fusion=cuda and self.have_te and m["position_embedding_type"] == "rope",
            cross_entropy_loss_fusion=cuda and bool(impl["cross_entropy_loss_fusion"]),
            cross_entropy_fusion_impl="native",
            attention_backend=cfg_backend,
            transformer_impl=self.transformer_impl,
            use_cpu_initialization=not cuda,
            # CPU: p2p_communication would call torch.cuda.synchronize().
            batch_p2p_sync=cuda,
            # Interleaved PP: Megatron-LM's own default; batched isend/irecv also pairs messages
            # wrongly over gloo when prev and next stage are the same peer (PP=2).
            overlap_p2p_comm=d["vp"] is not None,
            batch_p2p_comm=d["vp"] is None,
            # On CPU an async gloo send of a stage output may still be reading it when the
            # schedule frees it (no stream-ordered allocator keeps it alive, as CUDA's does):
            # interleaved PP then trained on garbage (NaN loss from iteration 1 at PP 2 and 4).
            deallocate_pipeline_outputs=cuda,
            fp8=fp8,
            fp8_recipe=t["fp8_recipe"] if fp8 else None,
            fp8_margin=0,
            fp8_amax_history_len=1,
            fp8_amax_compute_algo="most_recent",
        )
        if fp8 is None:
            for k in ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"):
                kw.pop(k)
        if experts:
            kw.update(
                num_moe_experts=experts,
                moe_router_topk=m["moe_router_topk"],
                moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
                moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"] or None,
                moe_layer_freq=list(m["moe_layer_pattern"]),
                moe_grouped_gemm=grouped,
                moe_token_dispatcher_type=dispatcher,
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=0.0,
            )
        if t.get("fp8_param_gather") and fp8:
            self.notes.append("fp8_param_gather not used by the profile job (weights kept in bf16)")
        if p.get("tp_comm_overlap"):
            self.notes.append("tp_comm_overlap not used by the profile job (needs TE userbuffers setup)")
        cfg = _filtered(TransformerConfig, kw, self.dropped)
        self.settings = {
            "sequence_parallel": sp,
            "recompute_granularity": gran,
            "recompute_method": method,
            "recompute_num_layers": nlayers,
            "recompute_modules": kw["recompute_modules"],
            "fp8": fp8,
            "fp8_recipe": kw.get("fp8_recipe"),
            "moe_grouped_gemm": grouped if experts else None,
            "moe_token_dispatcher_type": dispatcher if experts else None,
            "gradient_accumulation_fusion": "all layers" if apex_gaf else ("TE layers" if self.fuse_te_wgrad else False),
            "bias_activation_fusion": kw["bias_activation_fusion"],
            "bias_dropout_fusion": kw["bias_dropout_fusion"],
            "apply_rope_fusion": kw["apply_rope_fusion"],
            "masked_softmax_fusion": kw["masked_softmax_fusion"],
            "cross_entropy_loss_fusion": kw["cross_entropy_loss_fusion"],
            "deallocate_pipeline_outputs": kw["deallocate_pipeline_outputs"],
            "dropout": 0.0,
        }
        return cfg

    def _layer_block(self, config, vp_stage):
        """Decoder block spec for one model chunk, with our core attention / norms swapped in."""
        import copy

        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        m, impl = self.spec["model"], self.spec["implementation"]
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=self.have_te,
                                           normalization=m["normalization"], vp_stage=vp_stage)
        block = copy.copy(block)
        backend = impl["attention_backend"]
        core = None
        if self.have_te:
            if backend == "local":
                core = DotProductAttention
                self.attention_impl = "megatron DotProductAttention (unfused, in the TE layer spec)"
            else:
                self.attention_impl = f"transformer_engine DotProductAttention (attention_backend={backend})"
        elif backend in ("unfused", "local"):
            self.attention_impl = "megatron DotProductAttention (unfused)"
        else:
            from mcore_advisor.launcher.entry import sdpa

            sdpa.SDPACoreAttention.allowed_backends = sdpa.allowed_backends(backend) if self.use_cuda else None
            core = sdpa.SDPACoreAttention
            kernels = sdpa.SDPACoreAttention.allowed_backends
            self.attention_impl = "torch scaled_dot_product_attention" + (f" ({'/'.join(kernels)})" if kernels else " (torch picks the kernel)")
        norm = None
        if not self.have_te and config.sequence_parallel:
            norm = _sp_norm_class()
        new_layers = []
        for layer in block.layer_specs:
            layer = copy.deepcopy(layer)
            sub = layer.submodules
            if core is not None:
                sub.self_attention.submodules.core_attention = core
            if norm is not None:
                from megatron.core.transformer.identity_op import IdentityOp

                for name in ("input_layernorm", "pre_mlp_layernorm"):
                    if getattr(sub, name, IdentityOp) is not IdentityOp:
                        setattr(sub, name, norm)
            new_layers.append(layer)
        block.layer_specs = new_layers
        if norm is not None:
            block.layer_norm = norm
        return block

    def _model(self, config):
        import torch
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        _State.phase = "model"
        m, t, p, impl, d = (self.spec[k] for k in ("model", "training", "parallelism", "implementation", "dims"))
        ps = self.ps
        chunks = []
        for i in range(d["vp"] or 1):
            vp_stage = i if d["vp"] else None
            block = self._layer_block(config, vp_stage)
            kwargs = dict(
                config=config,
                transformer_layer_spec=block,
                vocab_size=self.spec["padded_vocab_size"],
                max_sequence_length=t["seq_length"],
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
                position_embedding_type=m["position_embedding_type"],
                rotary_percent=1.0,
            )
            if d["vp"]:
                kwargs["vp_stage"] = vp_stage
            chunks.append(GPTModel(**kwargs))
        self.num_params_local = sum(x.numel() for c in chunks for x in c.parameters())
        if self.use_cuda:
            for c in chunks:
                c.cuda(torch.cuda.current_device())
        chunks = [Float16Module(config, c) for c in chunks]
        dp_cp = d["dp"] * d["cp"]
        distopt = bool(p["use_distributed_optimizer"])
        overlap_grad = bool(p["overlap_grad_reduce"])
        expert_dp = (d["tp"] * d["pp"] * dp_cp) // max(1, d["etp"] * d["ep"] * d["pp"])
        if overlap_grad and dp_cp == 1 and expert_dp == 1:
            # Nothing is reduced across data-parallel ranks: the overlap machinery (per-parameter
            # backward hooks, buckets) would only cost host time on every micro-batch.
            overlap_grad = False
            self.notes.append("data-parallel size 1: overlap_grad_reduce / overlap_param_gather have nothing "
                              "to overlap and are off (their hooks only cost host time)")
        overlap_param = bool(p["overlap_param_gather"]) and distopt and overlap_grad
        # Megatron-LM arguments.py: --align-param-gather (default on) is reset to off unless the
        # schedule is interleaved; get_model passes it into the DDP config.
        align_param = overlap_param and d["vp"] is not None
        ddp_kw = dict(
            grad_reduce_in_fp32=bool(impl["grad_reduce_in_fp32"]),
            overlap_grad_reduce=overlap_grad,
            overlap_param_gather=overlap_param,
            align_param_gather=align_param,
            use_distributed_optimizer=distopt,
            check_for_nan_in_grad=False,
            # Megatron-LM training.py resolve_ddp_bucket_size: buckets only when overlapping.
            bucket_size=max(40_000_000, 1_000_000 * dp_cp) if overlap_grad else None,
        )
        if self.fuse_te_wgrad:
            n = _fuse_te_wgrad(chunks)
            self.notes.append(f"gradient_accumulation_fusion: {n} Transformer Engine layers accumulate wgrad into main_grad "
                              "in the GEMM; Megatron's own layers (output layer) add it separately (no Apex "
                              "fused_weight_gradient_mlp_cuda here)")
        ddp_config = _filtered(DistributedDataParallelConfig, ddp_kw, self.dropped)
        chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
                  for i, c in enumerate(chunks)]
        opt_kw = dict(
            optimizer="adam",
            lr=LEARNING_RATE,
            min_lr=LEARNING_RATE,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=distopt,
            overlap_param_gather=overlap_param,
        )
        optimizer = get_megatron_optimizer(_filtered(OptimizerConfig, opt_kw, self.dropped), chunks)
        # Megatron-LM training.py train(): the schedule's hooks. no_sync keeps the DDP hooks from
        # launching the gradient reduction before the last micro-batch; grad_sync_func
        # (--align-grad-reduce, default on) lets the pipeline schedules launch it for all stages
        # together (forward_backward_no_pipelining does not use it); param_sync_func only with
        # align_param_gather, which Megatron-LM's arguments.py keeps only for interleaved PP.
        config.grad_scale_func = optimizer.scale_loss
        if overlap_grad:
            nosync = [c.no_sync for c in chunks]
            gsync = [c.start_grad_sync for c in chunks]
            config.no_sync_func = nosync[0] if len(chunks) == 1 else nosync
            config.grad_sync_func = gsync[0] if len(chunks) == 1 else gsync
        if align_param:
            psync = [c.start_param_sync for c in chunks]
            config.param_sync_func = psync[0] if len(chunks) == 1 else psync
        config.finalize_model_grads_func = finalize_model_grads
        self.settings.update(
            use_distributed_optimizer=distopt,
            overlap_grad_reduce=overlap_grad,
            overlap_param_gather=overlap_param,
            grad_reduce_in_fp32=bool(impl["grad_reduce_in_fp32"]),
            ddp_bucket_size=ddp_kw["bucket_size"],
            align_param_gather=align_param,
            schedule_hooks=sorted(k for k in ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func")
                                  if getattr(config, k, None) is not None),
        )
        self.chunks, self.optimizer, self.config = chunks, optimizer, config

    def _data(self):
        """Synthetic tokens, one fixed batch per micro-batch slot, cycled forever per model chunk."""
        import torch

        t, d = self.spec["training"], self.spec["dims"]
        s, b, cp = t["seq_length"], t["micro_batch_size"], d["cp"]
        V = self.spec["model"]["vocab_size"]
        dev = torch.device("cuda", torch.cuda.current_device()) if self.use_cuda else torch.device("cpu")
        gen = torch.Generator().manual_seed(self.spec["run"]["seed"] + self.ps.get_data_parallel_rank())
        if cp > 1:
            # Megatron's get_batch_on_this_cp_rank: 2*cp chunks, rank r keeps chunks r and 2cp-1-r
            # so every CP rank gets an equal share of the causal work.
            r = self.ps.get_context_parallel_rank()
            c = s // (2 * cp)
            idx = torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
        else:
            idx = torch.arange(s)
        batches = []
        for _ in range(min(self.spec["dims"]["num_microbatches"], 4)):
            toks = torch.randint(0, V, (b, s + 1), generator=gen)
            batches.append({
                "tokens": toks[:, :-1][:, idx].contiguous().to(dev),
                "labels": toks[:, 1:][:, idx].contiguous().to(dev),
                "loss_mask": torch.ones(b, idx.numel(), dtype=torch.float32).to(dev),
                "position_ids": idx.unsqueeze(0).expand(b, -1).contiguous().to(dev),
            })

        def cycle():
            while True:
                yield from batches

        return [cycle() for _ in self.chunks]

    # ---- the training loop
    def run(self) -> None:
        self._init()
        self._parallel()
        config = self._config()
        self._model(config)
        iters = self._data()
        self._train(iters)

    def _sync(self) -> None:
        if self.use_cuda:
            self.torch.cuda.synchronize()

    def _memory(self) -> dict[str, float]:
        torch = self.torch
        if self.use_cuda:
            return {
                "allocated_mb": torch.cuda.memory_allocated() / MIB,
                "max_allocated_mb": torch.cuda.max_memory_allocated() / MIB,
                "reserved_mb": torch.cuda.memory_reserved() / MIB,
                "max_reserved_mb": torch.cuda.max_memory_reserved() / MIB,
            }
        cur, peak = _rss_bytes()
        return {"allocated_mb": cur / MIB, "max_allocated_mb": peak / MIB, "reserved_mb": cur / MIB, "max_reserved_mb": peak / MIB}

    def _gather(self, obj):
        out = [None] * self.world
        self.torch.distributed.all_gather_object(out, obj)
        return out

    def _train(self, iters) -> None:
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        _State.phase = "train"
        t, d, run = self.spec["training"], self.spec["dims"], self.spec["run"]
        ps = self.ps
        s, b, gbs, nmb = t["seq_length"], t["micro_batch_size"], t["global_batch_size"], d["num_microbatches"]
        kinds = iteration_plan(run["warmup_steps"], run["measure_steps"], run["profile_steps"])
        total = len(kinds)
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        is_log_rank = self.rank == self.world - 1  # Megatron's print_rank_last
        model = self.chunks if len(self.chunks) > 1 else self.chunks[0]
        data = iters if len(iters) > 1 else iters[0]
        fwd_bwd = get_forward_backward_func()
        flops_causal = _flops.flops_per_iteration(self.spec["model"], s, gbs, "causal", padded_vocab=self.spec["padded_vocab_size"])
        flops_full = _flops.flops_per_iteration(self.spec["model"], s, gbs, "full", padded_vocab=self.spec["padded_vocab_size"])
        self.flops = {"causal": flops_causal, "full": flops_full}

        log_file = open(self.out / "train.log", "a") if is_log_rank else None
        prof = None
        times: list[float] = []
        losses_out: list[float | None] = []
        grad_norms: list[float | None] = []
        trace_path = self.out / f"trace_rank{self.rank}.json"
        measured_at = [i for i, k in enumerate(kinds) if k == "measure"]
        first_measured, last_measured = measured_at[0] + 1, measured_at[-1] + 1
        host = self.host = _HostMonitor()
        impl = self.spec["implementation"]
        manual_gc = bool(impl.get("manual_gc"))
        gc_every = int(impl.get("manual_gc_interval") or 0)
        self.settings.update(manual_gc=manual_gc, manual_gc_interval=gc_every if manual_gc else None)
        if manual_gc:
            # Megatron-LM training.py: threshold GC off, one collection before the loop.
            gc.disable()
            gc.collect()
        try:
            for it in range(1, total + 1):
                _State.iteration = it
                kind = kinds[it - 1]
                if kind == "profile" and (it == 1 or kinds[it - 2] != "profile") and self.rank == 0:
                    prof = self._start_profiler()
                self._sync()
                if it == first_measured:
                    host.measure_start()
                host.begin_iteration()
                t0 = time.perf_counter()
                for c in self.chunks:
                    c.zero_grad_buffer()
                self.optimizer.zero_grad()
                reduced = fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=model,
                                  num_microbatches=nmb, seq_length=s, micro_batch_size=b, forward_only=False)
                ok, grad_norm, _ = self.optimizer.step()
                if manual_gc and gc_every and it % gc_every == 0:
                    gc.collect()  # inside Megatron's interval timer too
                self._sync()
                dt = time.perf_counter() - t0
                host.end_iteration()
                if it == last_measured:
                    host.measure_end()
                if prof is not None and (it == total or kinds[it] != "profile"):
                    prof.stop()
                    prof.export_chrome_trace(str(trace_path))
                    prof = None
                times.append(dt)
                loss = None
                if last_stage and reduced:
                    acc = torch.stack([x["lm loss"] for x in reduced]).sum(0)
                    torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group(with_context_parallel=True))
                    loss = float(acc[0] / acc[1].clamp(min=1))
                losses_out.append(loss)
                gn = float(grad_norm) if grad_norm is not None else None
                grad_norms.append(gn)
                if log_file is not None:
                    tfl = flops_causal / (dt * 1e12 * self.world)
                    log_file.write(_trainlog.iteration_line(
                        when=datetime.now(), iteration=it, train_iters=total, consumed_samples=it * gbs,
                        elapsed_ms=dt * 1000.0, tflops_per_gpu=tfl, learning_rate=LEARNING_RATE,
                        global_batch_size=gbs, losses={"lm loss": loss} if loss is not None else {},
                        loss_scale=1.0, grad_norm=gn, skipped_iterations=0 if ok else 1,
                        nan_iterations=1 if loss is not None and loss != loss else 0) + "\n")
                    log_file.flush()
                # Megatron reports memory after iterations 1 and 2 (optimizer state exists after
                # the first step); we add the end of the run, as --log-memory-interval would.
                if it in (1, 2) or it == total:
                    self._report_memory(it, log_file)
        finally:
            host.close()
            if manual_gc:
                gc.enable()
            if log_file is not None:
                log_file.close()
        self._finish(kinds, times, losses_out, grad_norms, trace_path)

    def _start_profiler(self):
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.use_cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
        prof.start()
        return prof

    def _report_memory(self, it: int, log_file) -> None:
        mem = self._memory()
        rows = self._gather({"rank": self.rank, "dp_rank": self.ps.get_data_parallel_rank(), **mem})
        if log_file is not None:
            for r in rows:
                if r["dp_rank"] == 0:  # Megatron prints on data-parallel rank 0 of each model replica slice
                    log_file.write(_trainlog.memory_line(r["rank"], it, r["allocated_mb"], r["max_allocated_mb"],
                                                         r["reserved_mb"], r["max_reserved_mb"]) + "\n")
            log_file.flush()

    def _finish(self, kinds, times, losses, grad_norms, trace_path: Path) -> None:
        torch = self.torch
        _State.phase = "report"
        mem = self._memory()
        ps = self.ps
        mine = {
            "rank": self.rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "times": times,
            "losses": losses,
            "grad_norms": grad_norms,
            "peak_allocated_gib": mem["max_allocated_mb"] * MIB / GIB,
            "peak_reserved_gib": mem["max_reserved_mb"] * MIB / GIB,
            "num_params_local": self.num_params_local,
            "gc_pause_s": self.host.gc_s,
            "gc_gen2": self.host.gc_gen2,
        }
        rows = sorted(self._gather(mine), key=lambda r: r["rank"])
        if self.rank != 0:
            return
        t = self.spec["training"]
        # An iteration ends when its slowest rank does (Megatron times with barrier=True).
        step = [max(r["times"][i] for r in rows) for i in range(len(times))]
        measured = [step[i] for i, k in enumerate(kinds) if k == "measure"]
        iter_s = statistics.median(measured)
        tokens = t["global_batch_size"] * t["seq_length"]
        peak = self.spec["gpu"]["bf16_dense_tflops"] if self.use_cuda else None
        tfl_c = self.flops["causal"] / (iter_s * 1e12 * self.world)
        tfl_f = self.flops["full"] / (iter_s * 1e12 * self.world)
        last_losses = next((r["losses"] for r in reversed(rows) if any(x is not None for x in r["losses"])), [])
        comm = None
        if trace_path.exists():
            try:
                events = json.loads(trace_path.read_text()).get("traceEvents", [])
                comm = _trace.exposed_comm(events, num_steps=kinds.count("profile"))
            except Exception as exc:  # the trace is evidence; a parse problem must not fail the run
                self.notes.append(f"trace analysis failed: {type(exc).__name__}: {exc}")
        device_busy = idle = None
        profiled = [step[i] for i, k in enumerate(kinds) if k == "profile"]
        if comm and comm["method"].startswith("gpu") and profiled:
            device_busy = comm["device_busy_s"]
            idle, note = device_idle(device_busy, statistics.median(profiled))
            if note:
                self.notes.append(note)
        device = torch.cuda.get_device_name() if self.use_cuda else (platform.processor() or platform.machine() or "cpu")
        result = {
            "status": "ok",
            "device": device,
            "world_size": self.world,
            "versions": _versions(self.te_version),
            "transformer_impl": self.transformer_impl,
            "attention_impl": self.attention_impl,
            "settings": self.settings,
            "notes": self.notes,
            "config_fields_not_in_this_megatron": self.dropped,
            "iterations": kinds,
            "step_times_s": step,
            "measured_step_times_s": measured,
            "iter_s": iter_s,
            "iter_s_mean": statistics.fmean(measured),
            "iter_s_min": min(measured),
            "tokens_per_s_per_gpu": tokens / iter_s / self.world,
            "flops_per_iteration_causal": self.flops["causal"],
            "flops_per_iteration_full": self.flops["full"],
            "tflops_per_gpu_causal": tfl_c,
            "tflops_per_gpu_full": tfl_f,
            "mfu_peak_tflops": peak,
            "mfu_peak_note": "dense BF16 peak of the spec's GPU (also for FP8 runs)" if peak else "peak unknown on CPU",
            "mfu_pct_causal": 100.0 * tfl_c / peak if peak else None,
            "mfu_pct_full": 100.0 * tfl_f / peak if peak else None,
            "peak_allocated_gib": [r["peak_allocated_gib"] for r in rows],
            "peak_reserved_gib": [r["peak_reserved_gib"] for r in rows],
            "memory_source": "torch.cuda caching allocator (max_memory_allocated / max_memory_reserved)" if self.use_cuda
            else "process peak RSS (getrusage ru_maxrss) for both: the CPU allocator keeps no peak statistics",
            "ranks": [{k: r[k] for k in ("rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank", "num_params_local")} for r in rows],
            "exposed_comm_s": comm["exposed_comm_s"] if comm else None,
            "comm_s": comm["comm_s"] if comm else None,
            "exposed_comm_method": comm["method"] if comm else None,
            "device_busy_s_per_profiled_iteration": device_busy,
            "device_idle_fraction_profiled": idle,
            "host": self._host_report(rows),
            "trace": trace_path.name if trace_path.exists() else None,
            "losses": last_losses,
            "grad_norms": rows[-1]["grad_norms"],
            "spec": self.spec,
        }
        tmp = self.out / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(self.out / "result.json")

    def _host_report(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """What competed with the launching CPU threads during the timed iterations."""
        h = self.host
        n = len(rows[0]["gc_pause_s"])
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            usable = None
        return {
            "cpu_count": os.cpu_count(),
            "cpus_usable": usable,
            "local_processes_of_this_job": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "cpu_steal_fraction_measured": h.steal_fraction,
            "loadavg_1m_measure_start_end": list(h.loadavg_1m) if h.loadavg_1m else None,
            # The slowest rank sets the step; report the worst rank per iteration.
            "gc_pause_s_per_iteration": [max(r["gc_pause_s"][i] for r in rows) for i in range(n)],
            "gc_gen2_collections_per_iteration": [max(r["gc_gen2"][i] for r in rows) for i in range(n)],
            "gc_source": "Python gc.callbacks inside the timed region of each iteration, worst rank",
            "steal_source": "/proc/stat steal / total jiffies over the measured iterations (all CPUs of the machine)",
        }


def _parallel_sizes(dims: dict[str, Any]) -> dict[str, Any]:
    """The spec's parallel dims under Megatron's names (initialize_model_parallel and TransformerConfig)."""
    return {
        "tensor_model_parallel_size": dims["tp"],
        "pipeline_model_parallel_size": dims["pp"],
        "virtual_pipeline_model_parallel_size": dims["vp"],
        "context_parallel_size": dims["cp"],
        "expert_model_parallel_size": dims["ep"],
        "expert_tensor_parallel_size": dims["etp"],
    }


def _have_apex_wgrad_fusion() -> bool:
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _fuse_te_wgrad(chunks) -> int:
    """Turn on Transformer Engine's native wgrad accumulation into `main_grad` (what Megatron's TE
    wrappers pass as fuse_wgrad_accumulation when gradient_accumulation_fusion is on). TE reads the
    attribute at every forward; Megatron's DDP skips its own add for parameters that TE marks
    grad_added_to_main_grad."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    n = 0
    for c in chunks:
        for mod in c.modules():
            if isinstance(mod, TransformerEngineBaseModule) and hasattr(mod, "fuse_wgrad_accumulation"):
                mod.fuse_wgrad_accumulation = True
                n += 1
    return n


def _have_fused_softmax() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None
               for m in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def _sp_norm_class():
    """A norm for the local spec under sequence parallelism (Megatron's WrappedTorchNorm refuses SP).

    Its parameters carry `sequence_parallel=True`, so finalize_model_grads all-reduces their
    gradients over the TP group, as Megatron does for its own SP norms.
    """
    import torch

    class SequenceParallelNorm:
        def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
            if config.normalization == "RMSNorm":
                norm = torch.nn.RMSNorm(hidden_size, eps=eps)
            else:
                norm = torch.nn.LayerNorm(hidden_size, eps=eps)
            for prm in norm.parameters():
                prm.sequence_parallel = bool(config.sequence_parallel)
            return norm

    return SequenceParallelNorm


def _write_error(out: Path, rank: int, exc: BaseException) -> None:
    info: dict[str, Any] = {
        "status": "failed",
        "error_type": type(exc).__name__,
        "message": str(exc),
        "rank": rank,
        "phase": _State.phase,
        "iteration": _State.iteration,
        "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:],
    }
    if _State.use_cuda:
        try:
            import torch

            info["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            info["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            info["device"] = torch.cuda.get_device_name()
        except Exception:
            pass
    text = json.dumps(info, indent=1)
    out.mkdir(parents=True, exist_ok=True)
    # The first failing rank writes error.json; later ones (often collateral) their own file.
    try:
        fd = os.open(out / "error.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except FileExistsError:
        (out / f"error_rank{rank}.json").write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="spec.json written from launcher.spec.job_spec(plan)")
    ap.add_argument("--out-dir", required=True, help="where result.json, train.log and the trace go")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: CUDA when torch sees a GPU, else CPU with gloo")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        spec = json.loads(Path(a.spec).read_text())
        _prepare_env(spec)
        Job(spec, out, a.device).run()
    except BaseException as exc:  # noqa: BLE001 - every failure must leave error.json behind
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        _write_error(out, rank, exc)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # A failed rank must not wait in NCCL/gloo teardown for peers that wait for it.
        os._exit(1)
    try:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
