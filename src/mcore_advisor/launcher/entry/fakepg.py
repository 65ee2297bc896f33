"""Collectives that leave defined data behind under Megatron's `--fake-process-group`.

With torch's fake backend one process builds rank R of a world of N and every collective returns
at once without touching its output buffers, which then hold whatever the allocator last put
there. Megatron reads those buffers: the MoE token dispatcher sizes its all-to-all from gathered
token counts, and routing on garbage (NaN) hidden states collapses onto a few experts after a
couple of steps, so the measured rank would not hold what it holds in the real run.

`install()` (before megatron is imported: its modules bind the collectives at import) wraps the
torch.distributed functions Megatron calls so that, after the fake call, each output holds the
calling rank's own data, as if every rank of the group were this one:
- all-gather (into tensor, list, object): every slot gets this rank's input;
- reduce-scatter (tensor, list): this rank's own chunk of the input (a sum over one rank);
- all-to-all (single, list): the output is filled cyclically with this rank's input. These do not
  reach torch's fake backend at all: it checks the split sizes against each other, and split sizes
  derived from "every rank routes as this one" need not agree (a rank that routes none of its
  tokens to its own experts expects to receive none, yet sends some);
- recv / irecv and the receives of batch_isend_irecv (pipeline stages): standard normal values for
  floating tensors, zeros otherwise (activations and gradients of a plausible scale);
- all-reduce and broadcast keep the rank's own data already.
Every fill copies into the output in place (no temporary as large as the output), so the fills do
not move the peak the job measures. The weights drift from a real run's after the first optimizer
step (other ranks' shards are this rank's copies); the job reads memory after iteration 2, as the
issue that introduced this mode asked, before any value could matter for memory.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

_installed = False
_generator: dict[torch.device, torch.Generator] = {}


def _normal_(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    if not t.is_floating_point():
        t.zero_()
        return
    gen = _generator.get(t.device)
    if gen is None:
        gen = _generator[t.device] = torch.Generator(device=t.device).manual_seed(1234)
    t.normal_(generator=gen)


def _cyclic_(out: torch.Tensor, src: torch.Tensor) -> None:
    """`out` filled with repeats of `src`'s values, chunk by chunk (views, no big temporary)."""
    n, m = out.numel(), src.numel()
    if n == 0:
        return
    if m == 0:
        _normal_(out)
        return
    flat_out = out.view(-1) if out.is_contiguous() else None
    flat_src = src.reshape(-1)
    if flat_out is None:
        _normal_(out)
        return
    for start in range(0, n, m):
        k = min(m, n - start)
        flat_out[start:start + k].copy_(flat_src[:k])


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _wrap(fill):
    """Call the fake collective, then fill its outputs; keeps the returned Work handle."""

    def decorate(orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            work = orig(*args, **kwargs)
            with torch.no_grad():
                fill(*args, **kwargs)
            return work

        return wrapper

    return decorate


def _fill_all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    for chunk in output_tensor.view(-1).split(input_tensor.numel()):
        chunk.copy_(input_tensor.reshape(-1)[:chunk.numel()])


def _fill_all_gather(tensor_list, tensor, group=None, async_op=False):
    for t in tensor_list:
        if t is not tensor:
            t.copy_(tensor)


def _fill_all_gather_object(object_list, obj, group=None):
    for i in range(len(object_list)):
        object_list[i] = obj


def _fill_reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    chunks = input.reshape(-1).split(output.numel())
    output.view(-1).copy_(chunks[min(_group_rank(group), len(chunks) - 1)])


def _fill_reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    output.copy_(input_list[min(_group_rank(group), len(input_list) - 1)])


class _Done:
    """The Work handle of a collective that needs no communication."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    with torch.no_grad():
        _cyclic_(output, input)
    return _Done() if async_op else None


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    with torch.no_grad():
        for out, inp in zip(output_tensor_list, input_tensor_list, strict=False):
            _cyclic_(out, inp)
    return _Done() if async_op else None


def _fill_recv(tensor, *args, **kwargs):
    _normal_(tensor)


def _fill_batch_isend_irecv(p2p_op_list):
    for op in p2p_op_list:
        if getattr(op.op, "__name__", "") == "irecv":
            _normal_(op.tensor)


_FILLS = {
    "all_gather_into_tensor": _fill_all_gather_into_tensor,
    "_all_gather_base": _fill_all_gather_into_tensor,
    "all_gather": _fill_all_gather,
    "all_gather_object": _fill_all_gather_object,
    "reduce_scatter_tensor": _fill_reduce_scatter_tensor,
    "_reduce_scatter_base": _fill_reduce_scatter_tensor,
    "reduce_scatter": _fill_reduce_scatter,
    "recv": _fill_recv,
    "irecv": _fill_recv,
    "batch_isend_irecv": _fill_batch_isend_irecv,
}


def install() -> None:
    """Wrap torch.distributed's collectives (module docstring); a second call does nothing."""
    global _installed
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    replaced = {"all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all}
    for name, fill in (_FILLS | replaced).items():
        orig = getattr(c10d, name, None)
        if orig is None:
            continue
        wrapped = functools.wraps(orig)(replaced[name]) if name in replaced else _wrap(fill)(orig)
        # Both names: P2POp accepts only the irecv/isend that distributed_c10d itself holds.
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    _installed = True
