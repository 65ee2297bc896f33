"""Parse Megatron-LM / Megatron-Bridge / NeMo 2 training logs and PyTorch failure messages.

Pure: takes the log text, returns a typed summary. Formats, each checked against its source
(fixtures and their provenance are in tests/fixtures/logs/README.md):

- Megatron-LM `megatron/training/training.py::training_log`: ``[2025-..] iteration   10/ 1000 |
  consumed samples: ... | elapsed time per iteration (ms): ... | throughput per GPU (TFLOP/s/GPU):
  ... | learning rate: ... | global batch size: ... | lm loss: ... | loss scale: ... | grad norm:
  ... | num zeros: ... | params norm: ... | number of skipped iterations: ... | number of nan
  iterations: ... |``. Megatron-Bridge `training/utils/train_utils.py::training_log` prints the same
  line, plus ``Step Time : 1.23s GPU utilization: 456.7MODEL_TFLOP/s/GPU``.
- `megatron/training/utils.py::report_memory`: ``[Rank 0] (after 10 iterations) memory (MB) |
  allocated: ... | max allocated: ... | reserved: ... | max reserved: ...`` (MB = 2^20 B; very old
  releases said ``cached``/``max cached``); Bridge prints ``memory (GB) | mem-allocated-gigabytes: ...``
  with GB = 10^9 B (`report_memory` divides torch's byte counts by 1.0e9).
- `megatron/training/theoretical_memory_usage.py::report_theoretical_memory`: ``Theoretical memory
  footprints: weight and optimizer=... MB, activation=... MB, total=... MB`` (older releases: the
  weight part only).
- `megatron/training/arguments.py::_print_args`: the ``---- arguments ----`` dump, one
  ``  name ........ value`` line per argument, and the tokenizer's `` > padded vocab (size: V) with
  k dummy tokens (new size: Vp)``.
- NeMo 2 `nemo/lightning/pytorch/callbacks/progress_printer.py`: ``Training epoch 0, iteration
  10/100 | lr: ... | global_batch_size: ... | global_step: ... | reduced_train_loss: ... |
  train_step_timing in s: ... | consumed_samples: ... | TFLOPS_per_GPU: ...``; and the tqdm bar
  ``[..., reduced_train_loss=..., global_step=..., train_step_timing in s=...]``.
- PyTorch c10 `CUDACachingAllocator.cpp` OOM: ``CUDA out of memory. Tried to allocate X. GPU 0 has a
  total capacity of Y of which Z is free. Including non-PyTorch memory, this process has W memory in
  use. Of the allocated memory A is allocated by PyTorch, and B is reserved by PyTorch but
  unallocated.`` (sizes from c10 `format_size`: bytes/KiB/MiB/GiB), and the pre-2.1 form
  ``Tried to allocate X (GPU 0; Y total capacity; A already allocated; Z free; R reserved in total by
  PyTorch)``.
- `torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`: ``[Rank 3] Watchdog caught collective
  operation timeout: WorkNCCL(SeqNum=..., OpType=ALLREDUCE, NumelIn=..., NumelOut=...,
  Timeout(ms)=600000) ran for 600xxx milliseconds before timing out.``
- Megatron's rerun state machine: ``Unexpected result nan (message='found NaN in local forward loss
  calculation')``.

Robustness: ANSI colour codes and launcher prefixes (``[rank3]:``, ``[default0]:``, ``3: ``,
``[1,3]<stdout>:``) are stripped; over-long lines are cut; unknown lines are skipped. Input beyond
`max_scan_chars` is not read in full: the head (argument dump, first memory report) and the tail
(latest iterations, the failure) are scanned and the result says so. Only the last
`max_iteration_records` iteration records are kept, so time and memory are bounded by the window,
not by the input size.
"""

from __future__ import annotations

import io
import math
import re
import statistics
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.schemas import Plan

_RESULT = ConfigDict(frozen=True)

MIB = 2**20
GIB = 2**30

DEFAULT_MAX_SCAN_CHARS = 16 * MIB
"""Characters read from one log: beyond this only the head and the tail are scanned."""
HEAD_SHARE = 1 / 8
"""Share of the scan window given to the head of an over-long log (argument dump, first reports)."""
DEFAULT_MAX_ITERATION_RECORDS = 1000
MAX_LINE_CHARS = 16_384
"""Longer lines are cut: no Megatron line is longer (an iteration line with 100 MoE losses is ~5 kB)."""
MAX_EVENTS = 32
MAX_ARGS = 4000
MAX_MEMORY_RANKS = 1024
MAX_EXTRA_FIELDS = 48


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


class IterationRecord(BaseModel):
    """One logged training step (Megatron/Bridge iteration line or a NeMo 2 progress line).

    Megatron averages time and losses over the `log_interval` iterations since the previous line.
    """

    model_config = _RESULT

    source_format: Literal["megatron", "nemo2", "nemo2_tqdm"]
    iteration: int
    train_iters: int | None = None
    timestamp: str | None = None
    consumed_samples: int | None = None
    elapsed_time_per_iteration_ms: float | None = None
    throughput_tflops_per_gpu: float | None = Field(None, description="The log's own model TFLOP/s/GPU (its FLOP convention is the log's; see check_mfu).")
    learning_rate: float | None = None
    global_batch_size: int | None = None
    losses: dict[str, float] = Field(default_factory=dict, description="'lm loss', 'reduced_train_loss', MoE aux losses, ...")
    loss_scale: float | None = None
    grad_norm: float | None = None
    num_zeros: float | None = None
    params_norm: float | None = None
    num_skipped_iterations: int | None = Field(None, description="Skipped (overflow/NaN) iterations in this logging interval.")
    num_nan_iterations: int | None = None
    extra: dict[str, float] = Field(default_factory=dict, description="Other numeric fields (energy, power, tokens/s, ...).")


class IterationTimeStats(BaseModel):
    """Spread of the logged iteration times (the first record, which includes start-up, excluded)."""

    model_config = _RESULT

    num_records: int
    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    p90_ms: float
    coefficient_of_variation: float = Field(description="stdev / mean of the per-record times.")
    num_spikes: int = Field(description="Records more than 1.3x the median.")
    spike_excess_share: float = Field(description="Time above the median in spike records / total time: what stalls (data loading, checkpointing, GC) cost.")


class MemoryReport(BaseModel):
    """One rank's memory report (Megatron `report_memory` or the Bridge variant), in GiB."""

    model_config = _RESULT

    rank: int | None
    after_iterations: int
    unit_in_log: Literal["MB", "GB"] = Field(description="MB = 2^20 B (Megatron); GB = 10^9 B (Megatron-Bridge).")
    allocated_gib: float | None = None
    max_allocated_gib: float | None = None
    reserved_gib: float | None = None
    max_reserved_gib: float | None = None
    device_memory_used_gib: float | None = None
    alloc_retries: int | None = Field(None, description="cudaMalloc retries after a cache flush (Bridge 'mem-alloc-retires'): > 0 means the allocator was under pressure.")


class TheoreticalMemory(BaseModel):
    """Megatron's own estimate (theoretical_memory_usage.py), MB = 2^20 B converted to GiB."""

    model_config = _RESULT

    weight_and_optimizer_gib: float
    activation_gib: float | None = None
    total_gib: float | None = None


class OomEvent(BaseModel):
    """A PyTorch CUDA out-of-memory error, numbers as c10's CUDACachingAllocator printed them."""

    model_config = _RESULT

    message_format: Literal["torch>=2.1", "legacy"]
    rank: int | None = Field(None, description="From the launcher prefix ([rankN]:, N:) when present.")
    gpu_index: int | None = None
    tried_to_allocate_gib: float
    total_capacity_gib: float | None = None
    free_gib: float | None = None
    this_process_in_use_gib: float | None = Field(None, description="NVML: this process incl. non-PyTorch memory (CUDA context, NCCL, cuBLAS workspaces).")
    other_processes_in_use_gib: float = Field(0.0, description="NVML: other processes on the same GPU.")
    allowed_gib: float | None = Field(None, description="Set by torch.cuda.set_per_process_memory_fraction.")
    allocated_by_pytorch_gib: float
    private_pools_gib: float = Field(0.0, description="Allocated in private pools (CUDA graphs).")
    reserved_unallocated_gib: float = Field(description="Reserved by the caching allocator but not in live tensors: fragmentation after the allocator already freed what it could.")
    line: str = Field(description="The message (trimmed).")

    @property
    def non_pytorch_gib(self) -> float | None:
        """This process's memory outside the caching allocator (context, NCCL, cuBLAS, ...)."""
        if self.this_process_in_use_gib is None:
            return None
        reserved = self.allocated_by_pytorch_gib + self.reserved_unallocated_gib
        return max(0.0, self.this_process_in_use_gib - reserved)


class NcclTimeout(BaseModel):
    """A ProcessGroupNCCL watchdog timeout."""

    model_config = _RESULT

    rank: int | None
    seq_num: int | None
    op_type: str
    numel_in: int | None = None
    numel_out: int | None = None
    timeout_ms: int | None = None
    ran_for_ms: int | None = None
    line: str


class NcclWorkStatus(BaseModel):
    """A watchdog's status line for one rank's process group: which work failed, what it had queued."""

    model_config = _RESULT

    rank: int | None
    process_group: str | None = Field(None, description="'PG ID n' and, when torch printed it, the group's name (Megatron names its groups, e.g. TENSOR_MODEL_PARALLEL_GROUP).")
    failed_seq: int | None = None
    last_enqueued: int | None = None
    last_completed: int | None = None


class CrashInfo(BaseModel):
    """What a failed run printed on the way down: the exception, argparse's complaint, torchrun's root cause."""

    model_config = _RESULT

    exception_type: str | None = Field(None, description="The first exception raised by the training code (torchrun's ChildFailedError wrapper skipped).")
    exception_message: str | None = None
    raised_in: str | None = Field(None, description="The innermost traceback frame before that exception: 'file:line in function'.")
    argparse_error: str | None = Field(None, description="'pretrain_gpt.py: error: ...' from the argument parser.")
    failed_rank: int | None = Field(None, description="torchrun's 'Root Cause (first observed failure)' rank.")
    exitcode: int | None = None
    signal: str | None = Field(None, description="e.g. 'Signal 6 (SIGABRT)', 'Signal 9 (SIGKILL)'.")
    host: str | None = None


class ParsedLog(BaseModel):
    """What a training log says, bounded in size whatever the input size."""

    model_config = _RESULT

    input_chars: int
    lines_scanned: int
    truncated: bool = Field(description="True when the input exceeded the scan window and only its head and tail were read.")
    formats_detected: list[str] = Field(description="e.g. ['megatron_iteration', 'megatron_args', 'torch_oom'].")
    iterations: list[IterationRecord] = Field(description="The last iteration records (bounded).")
    num_iteration_records: int = Field(description="Iteration records seen in the scanned text (all, not only those kept).")
    first_iteration: int | None = None
    last_iteration: int | None = None
    skipped_iterations_total: int = 0
    nan_iterations_total: int = 0
    iteration_time: IterationTimeStats | None = None
    memory_reports: list[MemoryReport] = Field(default_factory=list, description="Latest report per rank.")
    theoretical_memory: TheoreticalMemory | None = None
    parameter_counts_billions: dict[str, float] = Field(default_factory=dict, description="Megatron's 'Number of parameters in ... in billions' lines.")
    vocab_size: int | None = Field(None, description="Tokenizer vocabulary before padding (' > padded vocab (size: V) ...').")
    padded_vocab_size: int | None = None
    megatron_args: dict[str, str] = Field(default_factory=dict, description="The arguments dump, raw strings.")
    oom_events: list[OomEvent] = Field(default_factory=list)
    num_oom_events: int = 0
    nccl_timeouts: list[NcclTimeout] = Field(default_factory=list)
    num_nccl_timeouts: int = 0
    nan_messages: list[str] = Field(default_factory=list, description="'found NaN/Inf in ...' messages.")
    error_lines: dict[str, str] = Field(default_factory=dict, description="First line of each other failure kind seen (nccl_error, host_oom_kill, traceback, ...).")
    nccl_work_status: list[NcclWorkStatus] = Field(default_factory=list, description="Watchdog status lines (process group, failed work, last enqueued/completed).")
    crash: CrashInfo | None = Field(None, description="Exception, argument error and launcher exit information, when the run failed.")
    config_values: dict[str, str] = Field(default_factory=dict, description="Megatron-Bridge / NeMo config dumps as 'section.key' -> raw value (the Bridge 'Configuration Summary', NeMo-Run 'model=... trainer=...' reprs, NeMo YAML configs).")
    config_model_names: list[str] = Field(default_factory=list, description="Model names a config dump gives (config or provider class names, tokenizer model).")
    world_size: int | None = Field(None, description="From Megatron's 'using world size: N, ...' line.")
    notes: list[str] = Field(default_factory=list, description="What was cut, skipped or not found.")

    @property
    def has_training_data(self) -> bool:
        return self.num_iteration_records > 0

    def median_iteration_time_s(self) -> float | None:
        return self.iteration_time.median_ms / 1000.0 if self.iteration_time else None

    def median_reported_tflops(self) -> float | None:
        """Median of the log's TFLOP/s/GPU over the records used for the time statistics."""
        vals = [r.throughput_tflops_per_gpu for r in _steady_records(self.iterations) if r.throughput_tflops_per_gpu is not None]
        return statistics.median(vals) if vals else None

    def most_loaded_memory_report(self) -> MemoryReport | None:
        """The rank with the highest peak reserved (else allocated) memory."""
        def key(m: MemoryReport) -> float:
            return m.max_reserved_gib or m.reserved_gib or m.max_allocated_gib or m.allocated_gib or 0.0
        return max(self.memory_reports, key=key) if self.memory_reports else None


# ---------------------------------------------------------------------------------------------
# Regexes (compiled once)
# ---------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Launcher prefixes: torchrun --tee/--log-dir ([rank3]: / [default3]:), srun --label (3: ),
# OpenMPI --tag-output ([1,3]<stdout>:), pdsh/deepspeed (host: ).
_PREFIX = re.compile(
    r"^\s*(?:\[(?:rank|default)(?P<r1>\d+)\]:|(?P<r2>\d{1,6}):\s|\[\d+,(?P<r3>\d+)\]<std(?:out|err)>:)"
)
# Logging prefixes wrappers put before each line (tried after ANSI codes are gone):
#   colorlog / rich / cluster wrappers  [2026-11-26 03:10:01 INFO]  or  [2026-11-26 03:10:01,123][name][INFO] -
#   Python logging defaults             2026-11-26 03:10:01,123 - INFO -   or  INFO:megatron.core.x:
#   NeMo's logger                       [NeMo I 2026-11-26 03:10:01 nemo_logging:393]
#   c10 / glog (PyTorch C++)            [E1121 10:15:42.123456789 ProcessGroupNCCL.cpp:616]  or  E1121 10:16:01.512000 140210 api.py:869]
_TS = r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
_LEVEL = r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)"
_LOG_PREFIX = re.compile(
    r"^\s*(?:"
    r"\[" + _TS + r"\s*(?:\|\s*)?" + _LEVEL + r"\s*\]\s*(?:-\s+)?"
    r"|\[" + _TS + r"\](?:\[[^\]]{1,80}\])*\[" + _LEVEL + r"\]\s*(?:-\s+)?"
    r"|" + _TS + r"(?:\s*[-|]\s*[\w.]+)?\s*[-|]?\s*" + _LEVEL + r"\s*(?:[-|:]\s*)?"
    r"|" + _LEVEL + r":[\w.]+:"
    r"|\[NeMo [DIWEC] " + _TS + r"[^\]]*\]\s*"
    r"|\[?[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+ (?:\d+ )?[\w./-]+:\d+\]\s*"
    r")"
)
_BARE_TIMESTAMP = re.compile(r"^\s*\[" + _TS + r"\]\s*")
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf)"
_NUM_RE = re.compile(_NUM)

_MEGATRON_ITER = re.compile(
    r"(?:\[(?P<ts>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)?)\]\s*)?"
    r"\biteration\s+(?P<it>\d+)\s*/\s*(?P<total>\d+)\s*\|(?P<fields>.*)$"
)
_SKIPPED_ITERS = re.compile(r"number of skipped iterations:\s*(\d+)")
_NAN_ITERS = re.compile(r"number of nan iterations:\s*(\d+)")
_NEMO_ITER = re.compile(r"\bTraining epoch (?P<epoch>\d+), iteration (?P<it>\d+)/(?P<total>\d+)(?P<fields>(?: \| .*)?)$")
_NEMO_TQDM = re.compile(r"\[[^\[\]]*?train_step_timing in s=[^\[\]]*\]")
_KV_EQ = re.compile(r"([A-Za-z_][\w ]{0,64}?)=\s*(" + _NUM + r")")
_BRIDGE_STEP = re.compile(r"Step Time : (?P<t>" + _NUM + r")s GPU utilization: (?P<tf>" + _NUM + r")MODEL_TFLOP/s/GPU")

_MEMORY = re.compile(
    r"(?:\[Rank (?P<rank>\d+)\]\s*)?\(after (?P<it>\d+) iterations\) memory \((?P<unit>MB|GB)\)(?P<fields>.*)$"
)
_THEORETICAL = re.compile(
    r"Theoretical memory footprints: weight and optimizer=\s*(?P<w>" + _NUM + r") MB"
    r"(?:, activation=\s*(?P<a>" + _NUM + r") MB, total=\s*(?P<t>" + _NUM + r") MB)?"
)
_PARAMS = re.compile(
    r"(?P<what>Total number of (?:active )?parameters|Number of (?:active )?parameters in [\w ]+?) in billions:\s*(?P<v>" + _NUM + r")"
)
_PADDED_VOCAB = re.compile(r"padded vocab \(size: (?P<v>\d+)\) with (?P<k>\d+) dummy tokens \(new size: (?P<vp>\d+)\)")

_ARGS_BEGIN = re.compile(r"^-{3,} arguments -{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,} end of arguments -{3,}\s*$")
# _print_args: '  {arg} {dots} {value}' with dots = '.' * (48 - len(arg)) (empty when the name is long).
_ARG_LINE = re.compile(r"^(?P<k>[A-Za-z_]\w*) (?:\.+ | )(?P<v>.*)$")

_SIZE = r"(?P<{}>\d+(?:\.\d+)?) (?P<{}u>bytes|KiB|MiB|GiB|TiB)"
_OOM_NEW = re.compile(
    r"CUDA out of memory\. Tried to allocate " + _SIZE.format("req", "req") + r"\. "
    r"GPU (?P<gpu>\d+) has a total capacity of " + _SIZE.format("tot", "tot") + r" of which "
    + _SIZE.format("free", "free") + r" is free\. "
    r"(?P<procs>(?:(?:Including non-PyTorch memory, this process|Process \d+) has \d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB|TiB) memory in use\. )*)"
    r"(?:" + _SIZE.format("allowed", "allowed") + r" allowed; )?"
    r"Of the allocated memory " + _SIZE.format("alloc", "alloc") + r" is allocated by PyTorch, "
    r"(?:with " + _SIZE.format("priv", "priv") + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    r"and " + _SIZE.format("unalloc", "unalloc") + r" is reserved by PyTorch but unallocated"
)
_OOM_PROC = re.compile(r"(?:(?P<self>Including non-PyTorch memory, this process)|Process (?P<pid>\d+)) has (?P<v>\d+(?:\.\d+)?) (?P<u>bytes|KiB|MiB|GiB|TiB) memory in use")
_OOM_LEGACY = re.compile(
    r"CUDA out of memory\. Tried to allocate " + _SIZE.format("req", "req") + r" \(GPU (?P<gpu>\d+); "
    + _SIZE.format("tot", "tot") + r" total capacity; " + _SIZE.format("alloc", "alloc") + r" already allocated; "
    + _SIZE.format("free", "free") + r" free; (?:" + _SIZE.format("allowed", "allowed") + r" allowed; )?"
    + _SIZE.format("res", "res") + r" reserved in total by PyTorch\)"
)
_NCCL_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\((?P<body>[^)]*\)?[^)]*)\) ran for (?P<ran>\d+) milliseconds before timing out"
)
_NCCL_FIELD = re.compile(r"(SeqNum|OpType|NumelIn|NumelOut|Timeout\(ms\))=([\w.]+)")
_RANK_IN_TEXT = re.compile(r"\[(?:PG ID \d+ PG GUID [^\]]*?)?\s*Rank (?P<rank>\d+)\s*\]")
_NAN_MSG = re.compile(r"found (?:NaN|Inf) in [\w ]+")
# ProcessGroupNCCL status lines: torch <= 2.5 "Exception (either an error or timeout) detected by watchdog at work:
# N, last enqueued NCCL work: E, last completed NCCL work: C."; later "failure detected by watchdog at work
# sequence id: N PG status: last enqueued work: E, last completed work: C".
_NCCL_STATUS = re.compile(
    r"\[PG (?:ID )?(?P<pg>\d+)(?: PG GUID (?P<guid>[^\]\s]+))? Rank (?P<rank>\d+)\]\s+"
    r"(?:Exception \(either an error or timeout\) detected by watchdog at work: (?P<seq>\d+), last enqueued NCCL work: "
    r"(?P<enq>\d+), last completed NCCL work: (?P<done>\d+)"
    r"|failure detected by watchdog at work sequence id: (?P<seq2>\d+) PG status: last enqueued work: (?P<enq2>\d+), "
    r"last completed work: (?P<done2>\d+))"
)
_EXCEPTION = re.compile(r"^(?P<t>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Failure))(?::\s*(?P<m>.*))?$")
_WRAPPER_EXCEPTIONS = ("ChildFailedError",)
_FRAME = re.compile(r'^File "(?P<f>[^"]+)", line (?P<l>\d+), in (?P<fn>\S+)')
_ARGPARSE = re.compile(r"^(?P<prog>\S+\.py): error: (?P<m>.+)$")
_ROOT_FIELD = re.compile(r"^(?P<k>rank|exitcode|host|traceback)\s*:\s*(?P<v>.+)$")
_EXITCODE_LINE = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<rank>\d+)")
_WORLD = re.compile(r"using world size: (?P<n>\d+)")
# Megatron-Bridge ConfigContainer.log_non_default_values: "  key: value  (Mcore default: d)" under "[model] ..." /
# "[train]:" headers; NeMo's YAML config: "key: value" under top-level "model:" / "trainer:".
_CFG_KV = re.compile(r"^(?P<k>[A-Za-z_]\w*): (?P<v>.*?)(?:\s{2}\(Mcore default: .*\))?$")
_CFG_SECTION = re.compile(r"^\[(?P<s>\w+)\](?: Non-default values.*)?:$|^(?P<y>[A-Za-z_]\w*):$")
_INLINE_KV = re.compile(r"\b(?P<k>[A-Za-z_]\w*)=(?P<v>'[^']*'|\"[^\"]*\"|[^,()\[\]\s]+)")
_CONFIG_CLASS = re.compile(r"\b(?:Config|Partial)\[(?P<c>\w+)\]|\b(?P<p>\w+(?:ModelProvider|Provider)\w*)\(")
MAX_CONFIG_VALUES = 2000
_ERRORS = (
    ("nccl_error", re.compile(r"NCCL error|ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclRemoteError")),
    ("cuda_error", re.compile(r"CUDA error: (?!out of memory)")),
    ("host_oom_kill", re.compile(r"Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|Killed process \d+|oom-kill")),
    ("child_failed", re.compile(r"ChildFailedError")),
    ("traceback", re.compile(r"^Traceback \(most recent call last\):")),
)

_UNIT_BYTES = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

# Megatron iteration-line keys -> IterationRecord fields.
_MEGATRON_KEYS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "elapsed_time_per_iteration_ms",
    "throughput per GPU (TFLOP/s/GPU)": "throughput_tflops_per_gpu",
    "learning rate": "learning_rate",
    "global batch size": "global_batch_size",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "num_skipped_iterations",
    "number of nan iterations": "num_nan_iterations",
}
_NEMO_KEYS = {
    "lr": "learning_rate",
    "global_batch_size": "global_batch_size",
    "consumed_samples": "consumed_samples",
    "TFLOPS_per_GPU": "throughput_tflops_per_gpu",
    "tflops_per_sec_per_gpu": "throughput_tflops_per_gpu",
}
_INT_FIELDS = {"consumed_samples", "global_batch_size", "num_skipped_iterations", "num_nan_iterations"}


# ---------------------------------------------------------------------------------------------
# Line-level helpers
# ---------------------------------------------------------------------------------------------


def _to_float(s: str) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def _first_number(s: str) -> float | None:
    m = _NUM_RE.search(s)
    return _to_float(m.group(0)) if m else None


def _size_gib(m: re.Match[str], name: str) -> float | None:
    v = m.group(name)
    if v is None:
        return None
    return float(v) * _UNIT_BYTES[m.group(name + "u")] / GIB


def clean_line(line: str) -> tuple[str, int | None]:
    """Strip ANSI codes, launcher rank labels and logging prefixes (stacked in any order, as wrappers
    nest them: ``0: [rank0]: [2026-11-26 03:10:01 INFO] ...``) and surrounding whitespace; return
    (text, rank). Megatron's own ``[date time] iteration ...`` keeps its timestamp (it is the record's)."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    rank = None
    for _ in range(6):
        m = _PREFIX.match(line)
        if m:
            r = m.group("r1") or m.group("r2") or m.group("r3")
            if r is not None and rank is None:
                rank = int(r)
            line = line[m.end():]
            continue
        m = _LOG_PREFIX.match(line)
        if m is None:
            m = _BARE_TIMESTAMP.match(line)
            if m is None or line[m.end():].lstrip().startswith("iteration"):
                break
        line = line[m.end():]
    return line.strip(), rank


def _iter_lines(text: str) -> Iterator[str]:
    """Lines without materialising a list; '\\r' (progress bars redrawing) also separates lines."""
    yield from io.StringIO(text, newline=None)


def _pipe_fields(fields: str) -> Iterator[tuple[str, str]]:
    for part in fields.split("|"):
        key, sep, value = part.partition(":")
        if sep:
            yield key.strip(), value.strip()


def _record_fields(fmt: str, it: int, total: int | None, ts: str | None, kv: Iterable[tuple[str, str]], keymap: dict[str, str]) -> dict:
    """IterationRecord fields as a plain dict: the scanner builds the model only for the records it keeps."""
    rec: dict = {"source_format": fmt, "iteration": it, "train_iters": total, "timestamp": ts}
    losses: dict[str, float] = {}
    extra: dict[str, float] = {}
    for key, raw in kv:
        val = _first_number(raw)
        if val is None:
            continue
        field = keymap.get(key)
        if field is not None:
            if field in _INT_FIELDS:
                if math.isfinite(val):
                    rec[field] = int(val)
            else:
                rec[field] = val
        elif fmt != "megatron" and key == "train_step_timing in s":
            rec["elapsed_time_per_iteration_ms"] = val * 1000.0
        elif "loss" in key.lower() and len(losses) < MAX_EXTRA_FIELDS:
            losses[key] = val
        elif len(extra) < MAX_EXTRA_FIELDS:
            extra[key] = val
    rec["losses"] = losses
    rec["extra"] = extra
    return rec


def _megatron_fields(line: str) -> dict | None:
    m = _MEGATRON_ITER.search(line)
    if not m:
        return None
    return _record_fields("megatron", int(m.group("it")), int(m.group("total")), m.group("ts"), _pipe_fields(m.group("fields")), _MEGATRON_KEYS)


def _nemo_fields(line: str) -> dict | None:
    m = _NEMO_ITER.search(line)
    if m:
        return _record_fields("nemo2", int(m.group("it")), int(m.group("total")), None, _pipe_fields(m.group("fields")), _NEMO_KEYS)
    t = _NEMO_TQDM.search(line)
    if t:
        kv = [(k.strip(), v) for k, v in _KV_EQ.findall(t.group(0))]
        step = next((v for k, v in kv if k == "global_step"), None)
        it = int(float(step)) if step is not None and _to_float(step) is not None and math.isfinite(float(step)) else 0
        return _record_fields("nemo2_tqdm", it, None, None, kv, _NEMO_KEYS)
    return None


def parse_megatron_iteration_line(line: str) -> IterationRecord | None:
    """Parse one Megatron/Bridge `training_log` line (prefixes allowed); None if it is not one."""
    f = _megatron_fields(line)
    return IterationRecord(**f) if f is not None else None


def parse_memory_line(line: str) -> MemoryReport | None:
    """Parse a Megatron (MB) or Megatron-Bridge (GB) `report_memory` line."""
    m = _MEMORY.search(line)
    if not m:
        return None
    unit = m.group("unit")
    # MB: Megatron divides by 1024*1024; GB: Bridge divides by 1.0e9.
    scale = MIB / GIB if unit == "MB" else 1e9 / GIB
    vals: dict[str, float] = {}
    retries = None
    for key, raw in _pipe_fields(m.group("fields")):
        v = _first_number(raw)
        if v is None:
            continue
        k = key.replace("-gigabytes", "").replace("mem-", "").replace("-", " ").strip()
        if k in ("alloc retires", "alloc retries"):
            retries = int(v)
        vals[k] = v * scale
    # Very old Megatron: 'cached' = memory_cached() (= reserved), 'max cached' = memory_reserved()
    # (the current, not the peak value: a bug in that release).
    return MemoryReport(
        rank=int(m.group("rank")) if m.group("rank") else None,
        after_iterations=int(m.group("it")),
        unit_in_log=unit,
        allocated_gib=vals.get("allocated"),
        max_allocated_gib=vals.get("max allocated"),
        reserved_gib=vals.get("reserved", vals.get("cached")),
        max_reserved_gib=vals.get("max reserved", vals.get("max cached")),
        device_memory_used_gib=vals.get("total device memory used"),
        alloc_retries=retries,
    )


def parse_oom_message(text: str, rank: int | None = None) -> OomEvent | None:
    """Parse a PyTorch CUDA OOM message (current or pre-2.1 wording) from one line of text."""
    m = _OOM_NEW.search(text)
    if m:
        this_proc = None
        others = 0.0
        for p in _OOM_PROC.finditer(m.group("procs") or ""):
            v = float(p.group("v")) * _UNIT_BYTES[p.group("u")] / GIB
            if p.group("self"):
                this_proc = v
            else:
                others += v
        return OomEvent(
            message_format="torch>=2.1",
            rank=rank,
            gpu_index=int(m.group("gpu")),
            tried_to_allocate_gib=_size_gib(m, "req") or 0.0,
            total_capacity_gib=_size_gib(m, "tot"),
            free_gib=_size_gib(m, "free"),
            this_process_in_use_gib=this_proc,
            other_processes_in_use_gib=others,
            allowed_gib=_size_gib(m, "allowed"),
            allocated_by_pytorch_gib=_size_gib(m, "alloc") or 0.0,
            private_pools_gib=_size_gib(m, "priv") or 0.0,
            reserved_unallocated_gib=_size_gib(m, "unalloc") or 0.0,
            line=text[m.start(): m.end() + 1][:600],
        )
    m = _OOM_LEGACY.search(text)
    if m:
        alloc = _size_gib(m, "alloc") or 0.0
        res = _size_gib(m, "res") or 0.0
        return OomEvent(
            message_format="legacy",
            rank=rank,
            gpu_index=int(m.group("gpu")),
            tried_to_allocate_gib=_size_gib(m, "req") or 0.0,
            total_capacity_gib=_size_gib(m, "tot"),
            free_gib=_size_gib(m, "free"),
            allowed_gib=_size_gib(m, "allowed"),
            allocated_by_pytorch_gib=alloc,
            reserved_unallocated_gib=max(0.0, res - alloc),
            line=text[m.start(): m.end()][:600],
        )
    return None


def parse_nccl_timeout(text: str, rank: int | None = None) -> NcclTimeout | None:
    m = _NCCL_TIMEOUT.search(text)
    if not m:
        return None
    f = dict(_NCCL_FIELD.findall(m.group("body")))
    # The global rank is the '[Rank N]' right before 'Watchdog caught'; an earlier '[PG ID .. Rank n]' (a
    # DistBackendError's what() line) is the rank within that process group.
    found = list(_RANK_IN_TEXT.finditer(text[: m.start()]))
    if found:
        rank = int(found[-1].group("rank"))

    def as_int(k: str) -> int | None:
        v = f.get(k)
        return int(v) if v is not None and v.isdigit() else None

    return NcclTimeout(
        rank=rank,
        seq_num=as_int("SeqNum"),
        op_type=f.get("OpType", "unknown"),
        numel_in=as_int("NumelIn"),
        numel_out=as_int("NumelOut"),
        timeout_ms=as_int("Timeout(ms)"),
        ran_for_ms=int(m.group("ran")),
        line=text[:600],
    )


def _steady_records(records: Iterable[IterationRecord]) -> list[IterationRecord]:
    """Records with a time, minus the first logged one (it carries start-up: Megatron logs the
    first iteration separately 'to document initialization overhead')."""
    timed = [r for r in records if r.elapsed_time_per_iteration_ms is not None and r.elapsed_time_per_iteration_ms > 0]
    if len(timed) > 1:
        first = min(r.iteration for r in timed)
        timed = [r for r in timed if r.iteration != first]
    return timed


def iteration_time_stats(records: Iterable[IterationRecord]) -> IterationTimeStats | None:
    steady = _steady_records(records)
    t = [r.elapsed_time_per_iteration_ms for r in steady if r.elapsed_time_per_iteration_ms is not None and math.isfinite(r.elapsed_time_per_iteration_ms)]
    if not t:
        return None
    med = statistics.median(t)
    mean = statistics.fmean(t)
    srt = sorted(t)
    p90 = srt[min(len(srt) - 1, math.ceil(0.9 * len(srt)) - 1)]
    cv = statistics.pstdev(t) / mean if mean > 0 and len(t) > 1 else 0.0
    spikes = [x for x in t if x > 1.3 * med]
    excess = sum(x - med for x in spikes)
    return IterationTimeStats(
        num_records=len(t), median_ms=med, mean_ms=mean, min_ms=srt[0], max_ms=srt[-1], p90_ms=p90,
        coefficient_of_variation=cv, num_spikes=len(spikes), spike_excess_share=excess / sum(t) if sum(t) > 0 else 0.0,
    )


# ---------------------------------------------------------------------------------------------
# The scanner
# ---------------------------------------------------------------------------------------------


class _Scanner:
    """Line-at-a-time state machine; every collection it holds is bounded."""

    def __init__(self, max_records: int) -> None:
        self.records: deque[dict] = deque(maxlen=max_records)
        self.num_records = 0
        self.first_it: int | None = None
        self.last_it: int | None = None
        self.skipped = 0
        self.nan = 0
        self.memory: dict[int | None, MemoryReport] = {}
        self.theoretical: TheoreticalMemory | None = None
        self.params: dict[str, float] = {}
        self.vocab: tuple[int, int] | None = None
        self.args: dict[str, str] = {}
        self._args_open = False
        self._args_new: dict[str, str] = {}
        self._args_misses = 0
        self.args_unterminated = False
        self.ooms: list[OomEvent] = []
        self.num_ooms = 0
        self._oom_seen: set[tuple] = set()
        self._oom_pending: list[str] = []
        self._oom_pending_rank: int | None = None
        self.timeouts: list[NcclTimeout] = []
        self.num_timeouts = 0
        self.nan_msgs: list[str] = []
        self.errors: dict[str, str] = {}
        self.formats: set[str] = set()
        self.lines = 0
        self.overlong = 0
        self._bridge_tflops: float | None = None
        self.nccl_status: list[NcclWorkStatus] = []
        self.crash: dict = {}
        self._last_frame: str | None = None
        self._root_cause = False
        self.world: int | None = None
        self.config: dict[str, str] = {}
        self.config_names: list[str] = []
        self._cfg_mode: str | None = None
        self._cfg_section = ""
        self._cfg_misses = 0

    def feed(self, raw: str) -> None:
        for seg in raw.split("\r") if "\r" in raw else (raw,):
            self._line(seg)

    def _line(self, raw: str) -> None:
        self.lines += 1
        if len(raw) > MAX_LINE_CHARS:
            self.overlong += 1
            raw = raw[:MAX_LINE_CHARS]
        line, rank = clean_line(raw)
        if not line:
            return
        if self._oom_pending:
            self._continue_oom(line)
        if self._args_open and self._arg_line(line):
            return
        if self._cfg_mode is not None and self._config_line(line):
            return
        if "iteration" in line:
            if "|" in line:
                if "Training epoch" in line:
                    rec = _nemo_fields(line)
                    if rec is not None:
                        self._add_record(rec, "nemo2_iteration")
                        return
                else:
                    m = _MEGATRON_ITER.search(line)
                    if m is not None:
                        self._add_megatron(m)
                        return
            if "memory (" in line:
                mem = parse_memory_line(line)
                if mem is not None:
                    self._add_memory(mem, rank)
                    return
        if "train_step_timing in s=" in line:
            rec = _nemo_fields(line)
            if rec is not None:
                self._add_record(rec, "nemo2_tqdm")
                return
        if "MODEL_TFLOP/s/GPU" in line:
            m = _BRIDGE_STEP.search(line)
            if m:
                self._bridge_tflops = _to_float(m.group("tf"))
                self.formats.add("bridge_step_time")
                return
        if "out of memory" in line:
            self._oom(line, rank)
            return
        if "Watchdog caught collective operation timeout" in line:
            self.num_timeouts += 1
            self.formats.add("nccl_watchdog_timeout")
            if len(self.timeouts) < MAX_EVENTS:
                t = parse_nccl_timeout(line, rank)
                if t is not None:
                    self.timeouts.append(t)
            return
        if "arguments" in line and _ARGS_BEGIN.match(line):
            self._args_open = True
            self._args_new = {}
            self._args_misses = 0
            return
        if "Theoretical memory footprints" in line:
            m = _THEORETICAL.search(line)
            if m:
                w, a, t = (_to_float(m.group(g)) if m.group(g) else None for g in ("w", "a", "t"))
                self.theoretical = TheoreticalMemory(
                    weight_and_optimizer_gib=(w or 0.0) * MIB / GIB,
                    activation_gib=a * MIB / GIB if a is not None else None,
                    total_gib=t * MIB / GIB if t is not None else None,
                )
                self.formats.add("megatron_theoretical_memory")
            return
        if "in billions" in line:
            m = _PARAMS.search(line)
            if m and len(self.params) < 16:
                v = _to_float(m.group("v"))
                if v is not None:
                    self.params[m.group("what")] = v
            return
        if "padded vocab" in line:
            m = _PADDED_VOCAB.search(line)
            if m:
                self.vocab = (int(m.group("v")), int(m.group("vp")))
            return
        if "found NaN" in line or "found Inf" in line:
            m = _NAN_MSG.search(line)
            if m and len(self.nan_msgs) < MAX_EVENTS:
                self.nan_msgs.append(line[:300])
            self.formats.add("megatron_nan_check")
            return
        if self._failure_line(line, rank) or self._config_start(line):
            return
        for kind, rx in _ERRORS:
            if kind not in self.errors and rx.search(line):
                self.errors[kind] = line[:300]

    # -- failures: watchdog status, exceptions, argparse, torchrun's root cause ------------------

    def _failure_line(self, line: str, rank: int | None) -> bool:
        if "detected by watchdog" in line:
            m = _NCCL_STATUS.search(line)
            if m and len(self.nccl_status) < MAX_EVENTS:
                guid = m.group("guid")
                name = guid.split("(", 1)[1].rstrip(")") if guid and "(" in guid else None
                self.nccl_status.append(NcclWorkStatus(
                    rank=int(m.group("rank")), process_group=f"PG ID {m.group('pg')}" + (f" ({name})" if name else ""),
                    failed_seq=int(m.group("seq") or m.group("seq2")), last_enqueued=int(m.group("enq") or m.group("enq2")),
                    last_completed=int(m.group("done") or m.group("done2"))))
            return bool(m)
        if line.startswith('File "'):
            m = _FRAME.match(line)
            if m:
                self._last_frame = f"{m.group('f')}:{m.group('l')} in {m.group('fn')}"
            return bool(m)
        if ("Error" in line or "Exception" in line or "Interrupt" in line) and "exception_type" not in self.crash:
            m = _EXCEPTION.match(line)
            if m and not m.group("t").endswith(_WRAPPER_EXCEPTIONS):
                self.crash.update(exception_type=m.group("t"), exception_message=(m.group("m") or "")[:500],
                                  raised_in=self._last_frame)
                self.formats.add("python_exception")
                return False  # the error kinds below still classify it
        if ": error: " in line and "argparse_error" not in self.crash:
            m = _ARGPARSE.match(line)
            if m:
                self.crash["argparse_error"] = line[:500]
                self.formats.add("argparse_error")
                return True
        if "Root Cause" in line:
            self._root_cause = True
            return True
        if self._root_cause:
            m = _ROOT_FIELD.match(line)
            if m:
                self._root_field(m.group("k"), m.group("v"))
                return True
        if "failed (exitcode:" in line:
            m = _EXITCODE_LINE.search(line)
            if m and "exitcode" not in self.crash:
                self.crash.update(exitcode=int(m.group("code")), failed_rank=self.crash.get("failed_rank", int(m.group("rank"))))
        if "using world size:" in line:
            m = _WORLD.search(line)
            if m:
                self.world = int(m.group("n"))
                return True
        return False

    def _root_field(self, key: str, value: str) -> None:
        first = value.split()[0] if value.split() else ""
        if key == "rank" and first.lstrip("-").isdigit():
            self.crash["failed_rank"] = int(first)
        elif key == "exitcode" and first.lstrip("-").isdigit():
            self.crash["exitcode"] = int(first)
        elif key == "host":
            self.crash["host"] = first[:100]
        elif key == "traceback" and value.startswith("Signal"):
            self.crash["signal"] = value.split(" received")[0][:60]

    # -- config dumps: Megatron-Bridge, NeMo-Run, NeMo YAML ----------------------------------------

    def _config_start(self, line: str) -> bool:
        if "Configuration Summary" in line and "Megatron Core" in line:
            self._open_config("bridge")
            return True
        if line in ("trainer:", "model:", "exp_manager:"):
            self._open_config("yaml")
            self._cfg_section = line[:-1]
            return True
        if "Config[" in line or "Provider(" in line or ("=" in line and ("model=" in line or "trainer=" in line)):
            self._inline_config(line)
        return False

    def _open_config(self, mode: str) -> None:
        self._cfg_mode, self._cfg_section, self._cfg_misses = mode, "", 0
        self.formats.add("bridge_config_summary" if mode == "bridge" else "nemo_yaml_config")

    def _put_config(self, key: str, value: str) -> None:
        if key in self.config or len(self.config) < MAX_CONFIG_VALUES:
            self.config[key] = value.strip().strip("'\"")[:200]

    def _config_line(self, line: str) -> bool:
        """One line inside a config dump; False closes the dump and hands the line back."""
        if set(line) <= {"=", "-"}:
            if line.startswith("=") and self._cfg_mode == "bridge" and self.config:
                self._cfg_mode = None
            return True
        sec = _CFG_SECTION.match(line)
        if sec:
            self._cfg_section = sec.group("s") or sec.group("y")
            self._cfg_misses = 0
            return True
        m = _CFG_KV.match(line)
        if m:
            self._cfg_misses = 0
            self._put_config(f"{self._cfg_section}.{m.group('k')}" if self._cfg_section else m.group("k"), m.group("v"))
            return True
        if line.startswith("Other Configuration Values"):
            return True
        self._cfg_misses += 1
        if self._cfg_misses >= 20:
            self._cfg_mode = None
        return False

    def _inline_config(self, line: str) -> None:
        pairs = _INLINE_KV.findall(line)
        if pairs:
            self.formats.add("nemo_run_config")
        for k, v in pairs:
            self._put_config(f"inline.{k}", v)
        for m in _CONFIG_CLASS.finditer(line):
            name = m.group("c") or m.group("p")
            if name and name not in self.config_names and len(self.config_names) < 16:
                self.config_names.append(name)

    def flush(self) -> None:
        """End of a scan window: close what a cut could leave open."""
        if self._args_open:
            self._close_args()
            self.args_unterminated = True
        if self._oom_pending:
            self.errors.setdefault("out_of_memory_unparsed", self._oom_pending[0][:300])
            self.num_ooms += 1
            self._oom_pending = []

    def _add_megatron(self, m: re.Match[str]) -> None:
        """Keep the matched line unparsed: only the records that stay in the bounded deque are
        split into fields at the end (`_materialise`); the counters need two fields only."""
        fields = m.group("fields")
        rec = {"_megatron": (int(m.group("it")), int(m.group("total")), m.group("ts"), fields), "iteration": int(m.group("it"))}
        sk = _SKIPPED_ITERS.search(fields) if "skipped iterations" in fields else None
        nan = _NAN_ITERS.search(fields) if "nan iterations" in fields else None
        rec["num_skipped_iterations"] = int(sk.group(1)) if sk else None
        rec["num_nan_iterations"] = int(nan.group(1)) if nan else None
        self._add_record(rec, "megatron_iteration")

    def _add_record(self, rec: dict, fmt: str) -> None:
        if rec.get("throughput_tflops_per_gpu") is None and self._bridge_tflops is not None:
            rec["throughput_tflops_per_gpu"] = self._bridge_tflops
        self._bridge_tflops = None
        self.formats.add(fmt)
        self.records.append(rec)
        self.num_records += 1
        if self.first_it is None:
            self.first_it = rec["iteration"]
        self.last_it = rec["iteration"]
        self.skipped += rec.get("num_skipped_iterations") or 0
        self.nan += rec.get("num_nan_iterations") or 0

    def _add_memory(self, mem: MemoryReport, prefix_rank: int | None) -> None:
        self.formats.add("megatron_memory_report" if mem.unit_in_log == "MB" else "bridge_memory_report")
        key = mem.rank if mem.rank is not None else prefix_rank
        if key in self.memory or len(self.memory) < MAX_MEMORY_RANKS:
            if mem.rank is None and prefix_rank is not None:
                mem = mem.model_copy(update={"rank": prefix_rank})
            self.memory[key] = mem

    def _arg_line(self, line: str) -> bool:
        """Consume a line of the arguments dump; False hands it back to the normal path.

        Other ranks' output can interleave with the dump, and a pasted log can lose its end
        marker, so a dump also closes after 20 lines that are not arguments."""
        if _ARGS_END.match(line):
            self._close_args()
            return True
        m = _ARG_LINE.match(line)
        if m:
            self._args_misses = 0
            if len(self._args_new) < MAX_ARGS:
                self._args_new[m.group("k")] = m.group("v").strip()
            return True
        self._args_misses += 1
        if self._args_misses >= 20:
            self._close_args()
            self.args_unterminated = True
        return False

    def _close_args(self) -> None:
        self._args_open = False
        self.args = self._args_new
        self.formats.add("megatron_args")

    def _oom(self, line: str, rank: int | None) -> None:
        if "CUDA out of memory" not in line:
            self.errors.setdefault("out_of_memory", line[:300])
            return
        ev = parse_oom_message(line, rank)
        if ev is None:
            # The message was wrapped over several lines: join the next few and retry.
            self._oom_pending = [line]
            self._oom_pending_rank = rank
            return
        self._record_oom(ev)

    def _continue_oom(self, line: str) -> None:
        self._oom_pending.append(line)
        ev = parse_oom_message(" ".join(self._oom_pending), self._oom_pending_rank)
        if ev is not None:
            self._oom_pending = []
            self._record_oom(ev)
        elif len(self._oom_pending) >= 8:
            self.errors.setdefault("out_of_memory_unparsed", self._oom_pending[0][:300])
            self.num_ooms += 1
            self._oom_pending = []

    def _record_oom(self, ev: OomEvent) -> None:
        self.formats.add("torch_oom")
        # The same message is printed in the rank's traceback and again in torchrun's summary.
        key = (ev.rank, round(ev.tried_to_allocate_gib, 4), round(ev.allocated_by_pytorch_gib, 4), round(ev.reserved_unallocated_gib, 4))
        if key in self._oom_seen:
            return
        if len(self._oom_seen) < 4 * MAX_EVENTS:
            self._oom_seen.add(key)
        self.num_ooms += 1
        if len(self.ooms) < MAX_EVENTS:
            self.ooms.append(ev)


def _materialise(rec: dict) -> IterationRecord:
    lazy = rec.pop("_megatron", None)
    if lazy is not None:
        it, total, ts, fields = lazy
        full = _record_fields("megatron", it, total, ts, _pipe_fields(fields), _MEGATRON_KEYS)
        if full.get("throughput_tflops_per_gpu") is None and rec.get("throughput_tflops_per_gpu") is not None:
            full["throughput_tflops_per_gpu"] = rec["throughput_tflops_per_gpu"]
        rec = full
    return IterationRecord(**rec)


def _windows(text: str, max_chars: int) -> tuple[list[str], bool, str | None]:
    n = len(text)
    if n <= max_chars:
        return [text], False, None
    head_len = int(max_chars * HEAD_SHARE)
    tail_len = max_chars - head_len
    head = text[:head_len]
    cut = head.rfind("\n")
    head = head[: cut + 1] if cut > 0 else head
    tail = text[n - tail_len:]
    cut = tail.find("\n")
    tail = tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail
    skipped = n - len(head) - len(tail)
    note = (
        f"input is {n / MIB:.1f} MiB, over the {max_chars / MIB:.0f} MiB scan limit: read the first "
        f"{len(head) / MIB:.1f} MiB (arguments, first reports) and the last {len(tail) / MIB:.1f} MiB "
        f"(latest iterations, the failure); {skipped / MIB:.1f} MiB in between were not read"
    )
    return [head, tail], True, note


def parse_log(
    text: str,
    *,
    max_scan_chars: int = DEFAULT_MAX_SCAN_CHARS,
    max_iteration_records: int = DEFAULT_MAX_ITERATION_RECORDS,
) -> ParsedLog:
    """Parse a pasted training log; never raises on content, reports what it found and skipped.

    Raises ValueError only for a non-text argument or non-positive limits.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ValueError(f"log_text must be a string, got {type(text).__name__}")
    if max_scan_chars < 1 or max_iteration_records < 1:
        raise ValueError("max_scan_chars and max_iteration_records must be positive")
    windows, truncated, note = _windows(text, max_scan_chars)
    sc = _Scanner(max_iteration_records)
    for w in windows:
        for raw in _iter_lines(w):
            sc.feed(raw.rstrip("\n"))
        sc.flush()
    records = [_materialise(r) for r in sc.records]
    notes: list[str] = []
    if note:
        notes.append(note)
    if sc.args_unterminated:
        notes.append("the arguments dump is truncated (no 'end of arguments' line); kept what was there")
    if not text or text.isspace():
        notes.append("the log is empty")
    elif not sc.formats and not sc.errors:
        notes.append(
            f"no Megatron-LM, Megatron-Bridge, NeMo 2 or PyTorch error lines recognised in {sc.lines} lines; "
            "paste the training stdout (the 'iteration N/M | ...' lines, the arguments dump, the error)"
        )
    if sc.overlong:
        notes.append(f"{sc.overlong} over-long lines were cut at {MAX_LINE_CHARS} characters")
    if sc.num_records > len(sc.records):
        notes.append(f"kept the last {len(sc.records)} of {sc.num_records} iteration records")
    return ParsedLog(
        input_chars=len(text),
        lines_scanned=sc.lines,
        truncated=truncated,
        formats_detected=sorted(sc.formats),
        iterations=records,
        num_iteration_records=sc.num_records,
        first_iteration=sc.first_it,
        last_iteration=sc.last_it,
        skipped_iterations_total=sc.skipped,
        nan_iterations_total=sc.nan,
        iteration_time=iteration_time_stats(records),
        memory_reports=sorted(sc.memory.values(), key=lambda m: (m.rank is None, m.rank or 0)),
        theoretical_memory=sc.theoretical,
        parameter_counts_billions=sc.params,
        vocab_size=sc.vocab[0] if sc.vocab else None,
        padded_vocab_size=sc.vocab[1] if sc.vocab else None,
        megatron_args=sc.args,
        oom_events=sc.ooms,
        num_oom_events=sc.num_ooms,
        nccl_timeouts=sc.timeouts,
        num_nccl_timeouts=sc.num_timeouts,
        nan_messages=sc.nan_msgs,
        error_lines=sc.errors,
        nccl_work_status=sc.nccl_status,
        crash=CrashInfo(**sc.crash) if sc.crash else None,
        config_values=sc.config,
        config_model_names=sc.config_names + ([sc.config["tokenizer.tokenizer_model"]] if "tokenizer.tokenizer_model" in sc.config else []),
        world_size=sc.world,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# The arguments dump -> a Plan
# ---------------------------------------------------------------------------------------------


def _plan_from_sections(sections: dict[str, dict], notes: list[str]) -> Plan:
    """A Plan of the parsed sections; a value the schema refuses (out of range) is left at its default, noted."""
    for _ in range(2):
        try:
            return Plan.model_validate(sections)
        except ValidationError as exc:
            errors = exc.errors()
        for err in errors:
            loc = err["loc"]
            if len(loc) >= 2 and loc[1] in sections.get(loc[0], {}):
                value = sections[loc[0]].pop(loc[1])
                notes.append(f"{loc[0]}.{loc[1]} = {value!r} from the dump ignored ({err['msg']}): left at the default")
    return Plan.model_validate(sections)


def plan_from_megatron_args(
    args: dict[str, str],
    *,
    gpu: str | None = None,
    vocab_size: int | None = None,
    gpus_per_node: int | None = None,
) -> tuple[Plan, list[str]]:
    """Build a Plan from Megatron's arguments dump; return it with notes on what was assumed.

    Each argument is read back into its plan field by knowledge/megatron_flags.py, the table the
    rendered scripts are written from. The dump does not name the GPU: pass `gpu` (default
    'h100-sxm', noted). The vocabulary comes from `vocab_size` (the log's ' > padded vocab (size: V)
    ...' line), else the dump's vocab_size/padded_vocab_size. Raises ValueError naming the missing
    argument when the dump lacks the model shape or the world size.
    """
    parsed = megatron_flags.parse(args)
    sections = parsed.sections
    model = sections["model"]
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in model]
    if missing:
        raise ValueError(
            f"the log's arguments dump has no {missing[0]}; pass plan.model explicitly "
            "(e.g. model.name='llama3-8b' or num_layers/hidden_size/num_attention_heads/vocab_size)"
        )
    padded = megatron_flags.coerce(args.get("padded_vocab_size"), int | None)
    V = vocab_size or model.get("vocab_size") or (padded if isinstance(padded, int) else None)
    if V is None:
        raise ValueError(
            "the log has neither ' > padded vocab (size: ...)' nor vocab_size in its arguments dump; "
            "pass plan.model.vocab_size"
        )
    model["vocab_size"] = V
    world = megatron_flags.coerce(args.get("world_size"), int | None)
    if not isinstance(world, int):
        raise ValueError("the log's arguments dump has no world_size; pass plan.cluster.num_gpus")
    notes: list[str] = []
    sections["cluster"] = {"num_gpus": world, "gpu": gpu or "h100-sxm"}
    if gpu is None:
        notes.append("the log does not name the GPU: assumed h100-sxm (pass plan.cluster.gpu)")
    if gpus_per_node:
        sections["cluster"]["gpus_per_node"] = gpus_per_node
    notes += parsed.notes
    return _plan_from_sections(sections, notes), notes
