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
  the distributed optimizer, the bf16 optimizer and gradient clipping check for.
"""

from __future__ import annotations

import contextlib

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
    _mode = _CudaToCpu(spoof_tensor_type)
    _mode.__enter__()
