"""Run megatron-core on a CPU-only torch build (gloo), for tests and CI.

Megatron's training path hard-codes CUDA (`device="cuda"`, `torch.cuda.current_device()`,
`torch.cuda.synchronize()`, CUDA type strings in the optimizer). Nothing in site-packages is edited:
`install()` patches at run time, before megatron is imported (recipe: shared reference
megatron-core-cpu.md, section 3.2):

- a TorchFunctionMode maps every CUDA device argument (`"cuda"`, `"cuda:N"`, a bare int index,
  `torch.device("cuda")`) to the CPU, makes `Tensor.cuda()` the identity and redirects
  `Tensor.to(<cuda>)`;
- `torch.cuda.current_device()` returns the CPU *device*: autograd's backward runs outside the
  mode, and sequence-parallel backward allocates with `device=torch.cuda.current_device()`;
- `torch.cuda.synchronize()` does nothing; `torch.cuda.current_stream()`, `torch.cuda.Stream()` and
  `torch.cuda.stream(s)` give stand-ins whose waits do nothing (megatron-core >= 0.19 calls
  current_stream in every DDP grad sync; the MoE all-to-all dispatcher makes a side stream);
- `torch.cuda.get_rng_state()` returns the CPU generator's state: activation recompute saves and
  restores "CUDA" RNG state around each checkpointed region (the CPU state is saved separately);
- with `spoof_tensor_type`, `Tensor.type()` without arguments answers `torch.cuda.*Tensor`, which
  the distributed optimizer, the bf16 optimizer and gradient clipping check for;
- `torch.cuda.device_count()` answers 1 and `torch.cuda.set_device` does nothing: megatron.training
  initialises the model-parallel groups only when it sees a device (initialize.py
  _initialize_distributed); `torch.cuda.get_device_properties` / `get_device_capability` describe an
  sm90 (Hopper) device, which validate_args' architecture checks read (CUDA_DEVICE_MAX_CONNECTIONS
  rule for TP/CP, grouped-GEMM capability);
- `torch._dynamo` is disabled, so the jit fusions Megatron wraps in torch.compile run eagerly (no
  C++ compilation on the CPU);
- Megatron's "CPU RNG state changed within GPU RNG context" warning is silenced: the "CUDA"
  generator is the CPU one here, so every forked region changes it.

`install_megatron()`, after megatron.training is imported:
- `pretrain` calls `initialize_megatron` with allow_no_cuda=True (it asserts a CUDA device otherwise);
- `WrappedTorchNorm` (the local spec's norm without Apex) accepts sequence parallelism, tagging its
  parameters `sequence_parallel` so finalize_model_grads all-reduces their gradients over the TP
  group, as Megatron does for its fused SP norms; megatron-core refuses SP for torch norms, which on
  a GPU only Apex or Transformer Engine avoid;
- the MoE all-to-all dispatcher's `maybe_move_tensor_to_cpu` turns its split sizes into numpy
  arrays for CPU tensors too (it converts only CUDA tensors, and torch's all_to_all_single takes
  no tensor as a split list);
- multi-latent attention on the local spec: MLASelfAttention gives its core attention the
  `k_channels` / `v_channels` only Transformer Engine's attention takes (multi_latent_attention.py);
  Megatron's DotProductAttention accepts them here and sizes its output from `v_channels`.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.overrides import TorchFunctionMode


def _names_cuda(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # Megatron passes torch.cuda.current_device() (an int) as a device
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    def __init__(self, spoof_tensor_type: bool) -> None:
        super().__init__()
        self._spoof = spoof_tensor_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if self._spoof and func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            if out.startswith("torch.") and not out.startswith("torch.cuda."):
                out = "torch.cuda." + out[len("torch."):]
        return out


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoStream:
    """What megatron asks of a CUDA stream on the training path; the CPU runs everything in order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _NoEvent:
        return _NoEvent()

    def synchronize(self) -> None:
        pass


_mode: _CudaToCpu | None = None


def install(spoof_tensor_type: bool = True) -> None:
    """Patch torch for megatron on CPU, process-wide; a second call does nothing."""
    global _mode
    if _mode is not None:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.get_device_properties = lambda *args, **kwargs: _Sm90()
    torch.cuda.get_device_capability = lambda *args, **kwargs: (_Sm90.major, _Sm90.minor)
    from torch import _dynamo

    _dynamo.config.disable = True
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _mode = _CudaToCpu(spoof_tensor_type)
    _mode.__enter__()


class _Sm90:
    """What validate_args reads of a device: an H100's compute capability and size."""

    major, minor = 9, 0
    name = "cpu (presented as sm90)"
    total_memory = 80 * 2**30
    multi_processor_count = 132


def install_megatron() -> None:
    """Patches that need megatron.training imported; call after install()."""
    from megatron.core.transformer import torch_norm
    from megatron.training import training

    if not isinstance(training.initialize_megatron, functools.partial):
        training.initialize_megatron = functools.partial(training.initialize_megatron, allow_no_cuda=True)
    if torch_norm.WrappedTorchNorm.__new__ is not _sp_torch_norm:
        torch_norm.WrappedTorchNorm.__new__ = _sp_torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not getattr(DotProductAttention.__init__, "_cpu_shim", False):
        DotProductAttention.__init__ = _mla_init(DotProductAttention.__init__)


def _mla_init(orig):
    """DotProductAttention.__init__ that takes MLA's k_channels / v_channels (module docstring)."""

    @functools.wraps(orig)
    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        orig(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    init._cpu_shim = True
    return init


def _to_host(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the CPU."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _sp_torch_norm(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                   normalization="LayerNorm"):
    """WrappedTorchNorm that also serves sequence parallelism (see the module docstring)."""
    if config.persist_layer_norm or config.layernorm_zero_centered_gamma:
        raise ValueError("torch norms have no persistent or zero-centered-gamma kernel: pass --no-persist-layer-norm")
    norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
    norm = norm_cls(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = bool(config.sequence_parallel)
    return norm
