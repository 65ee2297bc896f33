"""The profile job: Megatron-LM's own training loop (`megatron.training.pretrain`) on the exact argv
`render_launch_script` renders for the plan, and what it measured.

    torchrun --nproc_per_node N -m mcore_advisor.launcher.entry.profile --spec spec.json --out-dir DIR
    python -m mcore_advisor.launcher.entry.profile --spec spec.json --out-dir DIR     (one process)

`spec.json` is launcher/spec.py's `job_spec(plan)`; its `megatron_argv` is the rendered argv with the
job's iteration count, Megatron's torch-profiler window (`--profile --use-pytorch-profiler`) and,
when asked, `--record-memory-history` or `--fake-process-group`. This module imports no pydantic and
nothing from mcore_advisor outside launcher/entry (the GPU image has torch but not the project's
other dependencies).

What runs is megatron-core's: its argument parser and validation, `pretrain` (initialisation,
`get_model`, the optimizer, the data iterators, `train` with its timers, logging and memory report,
the torch profiler). The project supplies only the small `model_provider` / `forward_step` /
mock-data provider of entry/gpt.py. Where the machine lacks a part, entry/argv.py `for_machine`
adapts the argv and result.json lists each change (`argv_adjustments`); on a CPU, entry/cpu_shim.py
stands in for CUDA. Two shims apply everywhere: the wheel's dataset helpers ship compiled but
without their Makefile, so Megatron's `compile_helpers` (which would `make` and exit on failure) is
skipped when the compiled module imports; and megatron.training's functions `train_step` and
`setup_model_and_optimizer` are wrapped (called unchanged) to time each iteration on the host,
count Python GC pauses in it and read memory at the points below.

Modes (spec["mode"]):
- "profile": the plan on cluster.num_gpus processes; step times, TFLOP/s and memory;
- "memory_at_scale": one process plays rank spec["measured_rank"] of the plan's world through
  Megatron's `--fake-process-group` (entry/fakepg.py fills the collectives' outputs); it trains 3
  iterations and reports the rank's memory after iteration 2. Middle pipeline stages get
  `do_train` forced (no data loader there, and the flags broadcast from rank 0 carries nothing).

Writes into DIR:
- result.json (rank 0): Megatron's own iteration lines, memory report and timer lines, and the
  figures read from them (step times, tokens/s, TFLOP/s, MFU in both conventions, peak memory of
  every rank), exposed communication and GPU busy time from Megatron's trace, host diagnostics,
  versions, the argv as run and what was adapted;
- train.log: every rank's console output (what a user's Megatron log shows);
- torch_profile/rank-0.json.gz: Megatron's torch.profiler trace of the profiled iterations;
- error.json on failure ({status: "failed", error_type, message, rank, phase, ...}), exit status 1.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import io
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# The one FLOP count (physics.anatomy: standard library only, no pydantic), for the full-s^2 convention
# beside Megatron's own causal one.
import mcore_advisor.physics.anatomy as _anatomy
from mcore_advisor.launcher.entry import argv as _argv
from mcore_advisor.launcher.entry import host_probe as _host_probe
from mcore_advisor.launcher.entry import mem_peak as _mem_peak
from mcore_advisor.launcher.entry import moe_routing as _moe_routing
from mcore_advisor.launcher.entry import result as _contract
from mcore_advisor.launcher.entry import trace as _trace
from mcore_advisor.launcher.entry import trainlog as _trainlog

GIB = 2**30
MIB = 2**20
#: memory_at_scale: iterations run, and the one after which memory is read (optimizer state exists
#: after the first step; later steps train on other ranks' fake data). No iteration after the read:
#: a third one on Mixtral-8x22B's rank 0 (s4/9) routed every token to a few experts (NaN gradients
#: from the fake world) and ran out of memory after the figure had been taken.
AT_SCALE_ITERATIONS = 2
AT_SCALE_READ_AFTER = 2
TRACE_FILE = "torch_profile/rank-0.json.gz"


class _State:
    """What the error report needs to know about how far the job got."""

    phase = "start"
    iteration = 0
    use_cuda = False


# --------------------------------------------------------------------------- schedule of iterations

def iteration_plan(warmup_steps: int, measure_steps: int, profile_steps: list[int] | tuple[int, int] | None) -> list[str]:
    """Kind of each iteration (index 0 = iteration 1): 'warmup', 'profile', 'measure' or 'extra'.

    Megatron's torch profiler (`--profile-step-start F --profile-step-end L+1`) records iterations
    F..L, warms up during F-1 and writes the trace at the start of L+1, inside that iteration's
    timer: all of F-1..L+1 are 'profile' and never measured. The first `measure_steps` other
    iterations after warm-up are measured; the job runs until both are complete.
    """
    kinds: list[str] = []
    measured = 0
    it = 0
    lo, hi = (profile_steps[0] - 1, profile_steps[1] + 1) if profile_steps else (0, 0)
    while measured < measure_steps or it < hi:
        it += 1
        if profile_steps and lo <= it <= hi:
            kinds.append("profile")
        elif it <= warmup_steps:
            kinds.append("warmup")
        elif measured < measure_steps:
            kinds.append("measure")
            measured += 1
        else:
            kinds.append("extra")
    return kinds


def job_iterations(run: dict[str, Any], mode: str) -> list[str]:
    """The job's iterations: iteration_plan of the spec's run, or for memory_at_scale
    AT_SCALE_ITERATIONS with the one memory is read after marked 'measure'."""
    if mode == "memory_at_scale":
        return ["warmup"] * (AT_SCALE_READ_AFTER - 1) + ["measure"] + ["extra"] * (AT_SCALE_ITERATIONS - AT_SCALE_READ_AFTER)
    return iteration_plan(run["warmup_steps"], run["measure_steps"], run["profile_steps"])


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


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


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


#: a profiled iteration whose GPU idles more than this is reported as host-bound
HOST_BOUND_IDLE_FRACTION = 0.25


def device_idle(device_busy_s: float, iteration_s: float) -> tuple[float, str | None]:
    """(idle fraction of the GPU in an iteration of `iteration_s`, 'host-bound' note or None), from
    the GPU busy time of a traced iteration."""
    idle = max(0.0, 1.0 - device_busy_s / iteration_s)
    if idle <= HOST_BOUND_IDLE_FRACTION:
        return idle, None
    return idle, (f"host-bound: GPU kernels ran {device_busy_s:.3f} s of the {iteration_s:.3f} s iteration "
                  f"({100 * idle:.0f}% idle); the CPU did not launch work fast enough (see host)")


# --------------------------------------------------------------------------- the console

class _Capture(io.TextIOBase):
    """sys.stdout of one job: written through, each complete line appended to train.log (one
    O_APPEND write per line, so ranks interleave whole lines) and the lines Megatron's figures come
    from kept for result.json."""

    def __init__(self, stream, log_path: Path) -> None:
        super().__init__()
        self._stream = stream
        self._fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._partial = ""
        self.iteration_lines: list[str] = []
        self.memory_lines: list[str] = []
        self.timer_lines: list[str] = []
        self.theoretical_lines: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._stream.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self.record(line)
        return len(text)

    def record(self, line: str) -> None:
        """A line for train.log and the kept lines (also those Megatron logs through `logging`,
        whose handlers write to the stream they were given before this capture existed)."""
        self._keep(line)
        os.write(self._fd, (line + "\n").encode("utf-8", "replace"))

    def _keep(self, line: str) -> None:
        if _trainlog.parse_iteration_line(line):
            self.iteration_lines.append(line)
        elif _trainlog.parse_memory_line(line):
            self.memory_lines.append(line.strip())
        elif _trainlog.parse_timer_line(line) or "time across ranks (ms)" in line:
            self.timer_lines.append(line)
        elif line.startswith("Theoretical memory footprints") or line.startswith("Number of parameters in"):
            self.theoretical_lines.append(line)

    def flush(self) -> None:
        self._stream.flush()

    def __enter__(self) -> _Capture:
        self._tap = _LogTap(self)
        logging.getLogger().addHandler(self._tap)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self._tap)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        if self._partial:
            self.write("\n")
        os.close(self._fd)
        super().close()


class _LogTap(logging.Handler):
    """Megatron's `logging` records (timers, warnings) into the capture, one line each."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__(logging.INFO)
        self._capture = capture

    def emit(self, record: logging.LogRecord) -> None:
        for line in record.getMessage().split("\n"):
            self._capture.record(line)


# --------------------------------------------------------------------------- memory

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
    return float(cur), float(max(peak, cur))


def _memory_mb(use_cuda: bool) -> dict[str, float]:
    """torch's caching-allocator counters (what Megatron's report_memory prints); RSS on a CPU."""
    import torch

    if use_cuda:
        return {"allocated_mb": torch.cuda.memory_allocated() / MIB,
                "max_allocated_mb": torch.cuda.max_memory_allocated() / MIB,
                "reserved_mb": torch.cuda.memory_reserved() / MIB,
                "max_reserved_mb": torch.cuda.max_memory_reserved() / MIB}
    cur, peak = _rss_bytes()
    return {"allocated_mb": cur / MIB, "max_allocated_mb": peak / MIB, "reserved_mb": cur / MIB, "max_reserved_mb": peak / MIB}


# --------------------------------------------------------------------------- the machine

def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _te_version(use_cuda: bool) -> str | None:
    if not use_cuda:
        return None
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # absent or broken: the local spec still runs
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def _versions(te_version: str | None) -> dict[str, Any]:
    import torch
    from megatron.core import package_info

    return {"torch": torch.__version__, "megatron_core": package_info.__version__, "transformer_engine": te_version,
            "cuda": torch.version.cuda, "python": platform.python_version()}


def _skip_helper_build() -> None:
    """megatron.training's _compile_dependencies runs `make` in megatron/core/datasets and exits when
    it fails; the wheel ships helpers_cpp compiled and no Makefile, so skip the build when it imports."""
    import megatron.core.datasets.utils as dataset_utils

    if _have("megatron.core.datasets.helpers_cpp"):
        dataset_utils.compile_helpers = lambda: None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_env(spec: dict[str, Any], argv: list[str]) -> None:
    """Environment read when torch initialises CUDA or the process group, and by validate_args."""
    tp = _argv.int_value(argv, "--tensor-model-parallel-size", 1)
    cp = _argv.int_value(argv, "--context-parallel-size", 1)
    if tp > 1 or cp > 1:
        # Megatron asserts it for TP/CP before Blackwell: one hardware queue keeps communication
        # kernels in issue order so they overlap with the GEMMs that follow.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if spec["implementation"].get("expandable_segments"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if spec["implementation"].get("cublaslt_heuristics_cache_capacity") is not None:
        # read when cuBLASLt loads (the first GEMM): set before any CUDA work
        os.environ.setdefault("CUBLASLT_HEURISTICS_CACHE_CAPACITY",
                              str(int(spec["implementation"]["cublaslt_heuristics_cache_capacity"])))
    if spec.get("mode") == "memory_at_scale":
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise ValueError("a memory_at_scale job is one process; start it without torchrun")
        os.environ.update(RANK=str(spec["measured_rank"]), LOCAL_RANK="0", WORLD_SIZE=str(spec["dims"]["world_size"]))
    elif "RANK" not in os.environ:  # plain `python -m`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


# --------------------------------------------------------------------------- hooks into megatron.training

class _Hooks:
    """Wraps megatron.training.training's `train_step` and `setup_model_and_optimizer` (called
    unchanged) for the host's view of each iteration and memory at fixed points."""

    def __init__(self, kinds: list[str], use_cuda: bool, fake_rank: int | None, log) -> None:
        self.kinds = kinds
        self.use_cuda = use_cuda
        self.fake_rank = fake_rank
        self.log = log
        self.host = _HostMonitor()
        self.host_s: list[float] = []
        self.memory_after: dict[int, dict[str, float]] = {}
        self.after_setup: dict[str, float] | None = None
        self.num_params_local: int | None = None
        # Diagnostics beside the figures: the router's tokens per expert in the measured iterations,
        # and (MCORE_ADVISOR_MEMORY_PEAK=1) what is live at iteration 2's memory peak.
        self.routing = _moe_routing.Recorder()
        self.peak = _mem_peak.PeakRecorder(use_cuda)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Hooks:
        from megatron.training import training

        self._saved = {"train_step": training.train_step, "setup_model_and_optimizer": training.setup_model_and_optimizer}
        orig_step, orig_setup = self._saved["train_step"], self._saved["setup_model_and_optimizer"]

        def train_step(*args, **kwargs):
            it = len(self.host_s) + 1
            _State.phase, _State.iteration = "train", it
            kind = self.kinds[it - 1] if it <= len(self.kinds) else "extra"
            if kind == "measure" and "measure" not in self.kinds[:it - 1]:
                self.host.measure_start()
            self.routing.recording, self.routing.iteration, self.routing.measured = True, it, kind == "measure"
            self.peak.begin(it)
            self.host.begin_iteration()
            t0 = time.perf_counter()
            out = orig_step(*args, **kwargs)
            self._sync()
            self.host_s.append(time.perf_counter() - t0)
            self.host.end_iteration()
            self.routing.recording = False
            self.peak.end(it)
            if kind == "measure" and "measure" not in self.kinds[it:]:
                self.host.measure_end()
            self.memory_after[it] = _memory_mb(self.use_cuda)
            if self.fake_rank is not None and it == AT_SCALE_READ_AFTER:
                self.log(_trainlog.memory_line(self.fake_rank, it, **self.memory_after[it]))
            return out

        def setup_model_and_optimizer(*args, **kwargs):
            _State.phase = "model"
            model, optimizer, scheduler = orig_setup(*args, **kwargs)
            self.num_params_local = sum(p.numel() for chunk in model for p in chunk.parameters())
            self.after_setup = _memory_mb(self.use_cuda)
            _State.phase = "data"
            return model, optimizer, scheduler

        training.train_step = train_step
        training.setup_model_and_optimizer = setup_model_and_optimizer
        self.routing.install()
        return self

    def _sync(self) -> None:
        if self.use_cuda:
            import torch

            torch.cuda.synchronize()

    def __exit__(self, *exc) -> None:
        from megatron.training import training

        for name, fn in self._saved.items():
            setattr(training, name, fn)
        self.routing.uninstall()
        self.host.close()


# --------------------------------------------------------------------------- one job

class Job:
    def __init__(self, spec: dict[str, Any], out_dir: Path, device: str = "auto", shrink: int | None = None) -> None:
        self.spec = spec
        self.out = out_dir
        self.device_request = device
        self.shrink = shrink
        self.mode = spec.get("mode", "profile")
        self.notes: list[str] = []
        self.adjustments: list[dict[str, Any]] = []

    def run(self) -> dict[str, Any] | None:
        """Train through megatron.training; the result dict on rank 0 (None elsewhere)."""
        import torch

        _State.phase = "init"
        use_cuda = self.device_request == "cuda" or (self.device_request == "auto" and torch.cuda.is_available())
        if self.device_request == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        self.use_cuda = _State.use_cuda = use_cuda
        argv = list(self.spec["megatron_argv"])
        if self.shrink:
            argv, changes = _argv.shrink(argv, self.shrink)
            self.adjustments += [c.as_dict() for c in changes]
        # Before anything touches CUDA: CUDA_DEVICE_MAX_CONNECTIONS is read when the context is made.
        _prepare_env(self.spec, argv)
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        want = self.shrink or self.spec["dims"]["world_size"]
        if self.world != want:
            raise ValueError(f"the job runs with world size {self.world} but the plan's cluster.num_gpus is {want}; "
                             f"launch torchrun --nproc_per_node {want} (or change cluster.num_gpus)")
        if not use_cuda:
            from mcore_advisor.launcher.entry import cpu_shim

            cpu_shim.install(spoof_tensor_type=True)
        if self.mode == "memory_at_scale":
            from mcore_advisor.launcher.entry import fakepg

            fakepg.install()
        self.te_version = _te_version(use_cuda)
        machine = _argv.Machine(cuda=use_cuda, transformer_engine=self.te_version is not None,
                                apex=_have("apex"),
                                fused_softmax=_have("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))
        self.argv, changes = _argv.for_machine(argv, machine, str(self.out))
        self.adjustments += [c.as_dict() for c in changes]
        return self._train()

    def _train(self) -> dict[str, Any] | None:
        from megatron.core.enums import ModelType
        from megatron.training import training
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        from mcore_advisor.launcher.entry import gpt

        if not self.use_cuda:
            from mcore_advisor.launcher.entry import cpu_shim

            cpu_shim.install_megatron()
        _skip_helper_build()
        kinds = self._kinds()
        saved_stdout, saved_argv = sys.stdout, sys.argv
        fake_rank = self.rank if self.mode == "memory_at_scale" else None
        try:
            with _Capture(saved_stdout, self.out / "train.log") as capture, \
                    _Hooks(kinds, self.use_cuda, fake_rank, print) as hooks:
                sys.stdout = capture
                _State.phase = "arguments"
                sys.argv = ["pretrain"] + self.argv
                args = parse_and_validate_args()
                if fake_rank is not None:
                    if fake_rank != 0:
                        print("\n".join(_trainlog.argument_dump(args)))
                    # No data loader on middle stages; rank 0's do_train flag never arrives.
                    args.do_train = True
                cfg = pretrain_cfg_container_from_args(args)
                training.pretrain(cfg, gpt.datasets_provider, ModelType.encoder_or_decoder, gpt.forward_step,
                                  model_provider=gpt.model_provider)
                _State.phase = "report"
                return self._report(args, kinds, capture, hooks)
        finally:
            sys.stdout, sys.argv = saved_stdout, saved_argv

    def _kinds(self) -> list[str]:
        return job_iterations(self.spec["run"], self.mode)

    # ---- after training
    def _gather(self, obj: Any) -> list[Any]:
        import torch

        if self.mode == "memory_at_scale":
            return [obj]  # nothing is communicated: this process is the only one
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def _report(self, args, kinds: list[str], capture: _Capture, hooks: _Hooks) -> dict[str, Any] | None:
        from megatron.core import parallel_state as ps
        from megatron.training.training import num_floating_point_operations

        mem = _memory_mb(self.use_cuda)
        # After the memory read (the probe's layer must not count) and on every rank at once.
        probe = _host_probe.measure(self.use_cuda) if self.mode == "profile" else None
        mine = {
            "rank": self.rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "num_params_local": hooks.num_params_local,
            "peak_allocated_gib": mem["max_allocated_mb"] * MIB / GIB,
            "peak_reserved_gib": mem["max_reserved_mb"] * MIB / GIB,
            "memory_after_setup_mb": hooks.after_setup,
            "memory_after_iteration_mb": {str(k): v for k, v in hooks.memory_after.items()},
            "host_s": hooks.host_s,
            "gc_pause_s": hooks.host.gc_s,
            "gc_gen2": hooks.host.gc_gen2,
            "host_probe": probe,
            "iteration_lines": capture.iteration_lines,
            "memory_lines": capture.memory_lines,
            "timer_lines": capture.timer_lines,
            "theoretical_lines": capture.theoretical_lines,
            "moe_routing": hooks.routing.report(args),
            "memory_peak": hooks.peak.report(self.rank),
            "notes": hooks.routing.notes + hooks.peak.notes,
        }
        rows = sorted(self._gather(mine), key=lambda r: r["rank"])
        if self.rank != 0 and self.mode != "memory_at_scale":
            return None
        self.notes += list(dict.fromkeys(n for r in rows for n in r["notes"] if n not in self.notes))
        gbs = args.global_batch_size
        # The full-s^2 count needs the spec's model shape, which a shrunk (CI) run does not have.
        full = None if self.shrink else _anatomy.flops_per_iteration(self.spec["model"], args.seq_length, gbs, "full",
                                                                     padded_vocab_size=args.padded_vocab_size)
        flops = {"causal": float(num_floating_point_operations(args, gbs)), "full": full}
        self.host = hooks.host
        result = self._base(rows, kinds)
        result.update(self._timing(rows, kinds, flops, args))
        result.update(self._memory(rows))
        result["settings"] = _settings(args)
        result["transformer_impl"] = args.transformer_impl
        self._diagnostics(rows, args, result)
        return result

    def _diagnostics(self, rows, args, result: dict[str, Any]) -> None:
        """result's moe_routing and memory_peak from the ranks' recorders; a fault is a note, never a failure."""
        try:
            cache = _env_int("CUBLASLT_HEURISTICS_CACHE_CAPACITY")
            routing = _moe_routing.summarize([r["moe_routing"] for r in rows], local_only=self.mode == "memory_at_scale",
                                             **({} if cache is None else {"cache_row_counts": cache // _moe_routing.GEMMS_PER_ROW_COUNT}))
        except Exception as exc:
            routing = None
            self.notes.append(f"MoE routing summary failed: {type(exc).__name__}: {exc}"[:300])
        if routing:
            result["moe_routing"] = routing
        elif getattr(args, "num_experts", None):
            self.notes.append("MoE routing: no router call recorded in the measured iterations "
                              "(a CUDA-graphed router replays without calling TopKRouter.forward)")
        peaks = _mem_peak.pick([r["memory_peak"] for r in rows])
        if peaks:
            result["memory_peak"] = peaks

    def _base(self, rows, kinds) -> dict[str, Any]:
        import torch

        device = torch.cuda.get_device_name() if self.use_cuda else (platform.processor() or platform.machine() or "cpu")
        return {
            "status": "ok",
            "mode": self.mode,
            "measured_rank": self.rank if self.mode == "memory_at_scale" else None,
            "device": device,
            "world_size": self.world,
            "processes": 1 if self.mode == "memory_at_scale" else self.world,
            "versions": _versions(self.te_version),
            "megatron_argv": self.argv,
            "argv_adjustments": self.adjustments,
            "notes": self.notes,
            "iterations": kinds,
            "ranks": [{k: r[k] for k in ("rank", "tp_rank", "pp_rank", "dp_rank", "cp_rank", "ep_rank", "num_params_local")}
                      for r in rows],
            "megatron": {
                "iteration_lines": next((r["iteration_lines"] for r in reversed(rows) if r["iteration_lines"]), []),
                "memory_lines": [line for r in rows for line in r["memory_lines"]],
                "timer_lines": next((r["timer_lines"] for r in reversed(rows) if r["timer_lines"]), []),
                "theoretical_memory_lines": list(dict.fromkeys(rows[0]["theoretical_lines"])),
            },
            "host": self._host_report(rows),
            "spec": self.spec,
        }

    def _timing(self, rows, kinds, flops, args) -> dict[str, Any]:
        """Step times from Megatron's own iteration lines (its interval timer, barrier=True)."""
        lines = [_trainlog.parse_iteration_line(x) for x in next((r["iteration_lines"] for r in reversed(rows)
                                                                  if r["iteration_lines"]), [])]
        step = [x["elapsed_ms"] / 1000.0 for x in lines if x]
        measured = [s for s, k in zip(step, kinds, strict=False) if k == "measure"]
        out: dict[str, Any] = {
            "step_times_s": step,
            "step_times_source": "Megatron's 'elapsed time per iteration (ms)' (interval-time timer, barrier=True)",
            "host_step_times_s": [max(r["host_s"][i] for r in rows) for i in range(len(rows[0]["host_s"]))],
            "losses": [x["lm_loss"] for x in lines if x],
            "grad_norms": [x["grad_norm"] for x in lines if x],
            "megatron_tflops_per_gpu": [x["tflops_per_gpu"] for x in lines if x],
            "flops_per_iteration_causal": flops["causal"],
            "flops_per_iteration_full": flops["full"],
            "flops_source": "causal: Megatron's num_floating_point_operations; full: physics/anatomy.py (full s^2 attention)",
        }
        if not measured:
            return out
        iter_s = statistics.median(measured)
        world = self.world
        peak = self.spec["gpu"]["bf16_dense_tflops"] if self.use_cuda else None
        tfl_c = flops["causal"] / (iter_s * 1e12 * world)
        tfl_f = flops["full"] / (iter_s * 1e12 * world) if flops["full"] else None
        out.update({
            "measured_step_times_s": measured,
            "iter_s": iter_s,
            "iter_s_mean": statistics.fmean(measured),
            "iter_s_min": min(measured),
            "tokens_per_s_per_gpu": args.global_batch_size * args.seq_length / iter_s / world,
            "tflops_per_gpu_causal": tfl_c,
            "tflops_per_gpu_full": tfl_f,
            "mfu_peak_tflops": peak,
            "mfu_peak_note": "dense BF16 peak of the spec's GPU (also for FP8 runs)" if peak else "peak unknown on CPU",
            "mfu_pct_causal": 100.0 * tfl_c / peak if peak else None,
            "mfu_pct_full": 100.0 * tfl_f / peak if peak and tfl_f else None,
        })
        out.update(self._trace(step, kinds))
        return out

    def _trace(self, step: list[float], kinds: list[str]) -> dict[str, Any]:
        path = self.out / TRACE_FILE
        out: dict[str, Any] = {"trace": TRACE_FILE if path.exists() else None, "exposed_comm_s": None, "comm_s": None,
                               "exposed_comm_method": None, "device_busy_s_per_profiled_iteration": None,
                               "device_idle_fraction": None}
        if not path.exists():
            return out
        # Iterations F..L are recorded; F-1 (profiler warm-up) and L+1 (trace export) are not.
        first, last = self.spec["run"]["profile_steps"]
        try:
            events = json.loads(gzip.decompress(path.read_bytes())).get("traceEvents", [])
            comm = _trace.exposed_comm(events, num_steps=last - first + 1)
        except Exception as exc:  # the trace is evidence; a parse problem must not fail the run
            self.notes.append(f"trace analysis failed: {type(exc).__name__}: {exc}")
            return out
        out.update(exposed_comm_s=comm["exposed_comm_s"], comm_s=comm["comm_s"], exposed_comm_method=comm["method"])
        measured = [s for s, k in zip(step, kinds, strict=False) if k == "measure"]
        if comm["method"].startswith("gpu") and measured:
            # Against the unprofiled step: the traced iteration carries the profiler's own start-up
            # (an H100 run: 6.7 s traced, 1.19 s unprofiled, the same GPU work).
            idle, note = device_idle(comm["device_busy_s"], statistics.median(measured))
            out.update(device_busy_s_per_profiled_iteration=comm["device_busy_s"], device_idle_fraction=idle)
            if note:
                self.notes.append(note)
        return out

    def _memory(self, rows) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peak_allocated_gib": [r["peak_allocated_gib"] for r in rows],
            "peak_reserved_gib": [r["peak_reserved_gib"] for r in rows],
            "memory_source": "torch.cuda caching allocator (max_memory_allocated / max_memory_reserved), as Megatron's report_memory"
            if self.use_cuda else "process peak RSS (getrusage ru_maxrss) for both: the CPU allocator keeps no peak statistics",
            "memory_after_setup_mb": [r["memory_after_setup_mb"] for r in rows],
            "memory_after_iteration_mb": [r["memory_after_iteration_mb"] for r in rows],
        }
        if self.mode == "memory_at_scale":
            at = rows[0]["memory_after_iteration_mb"].get(str(AT_SCALE_READ_AFTER))
            if at is None:
                raise RuntimeError(f"memory_at_scale: the run ended before iteration {AT_SCALE_READ_AFTER}")
            # Read after iteration 2, before fake data reaches later steps' weights.
            out["peak_allocated_gib"] = [at["max_allocated_mb"] * MIB / GIB]
            out["peak_reserved_gib"] = [at["max_reserved_mb"] * MIB / GIB]
            out["memory_read_after_iteration"] = AT_SCALE_READ_AFTER
        return out

    def _host_report(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """What competed with the launching CPU threads during the iterations (worst rank each)."""
        h = rows[0]
        n = len(h["gc_pause_s"])
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            usable = None
        return {
            "hostname": socket.gethostname(),
            "boot_id": _boot_id(),
            "cpu_count": os.cpu_count(),
            "cublaslt_heuristics_cache_capacity": _env_int("CUBLASLT_HEURISTICS_CACHE_CAPACITY"),
            "cpus_usable": usable,
            "local_processes_of_this_job": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "cpu_steal_fraction_measured": self.host.steal_fraction,
            "loadavg_1m_measure_start_end": list(self.host.loadavg_1m) if self.host.loadavg_1m else None,
            "steal_source": "/proc/stat steal / total jiffies over the measured iterations (all CPUs of the machine)",
            "gc_pause_s_per_iteration": [max(r["gc_pause_s"][i] for r in rows) for i in range(n)],
            "gc_gen2_collections_per_iteration": [max(r["gc_gen2"][i] for r in rows) for i in range(n)],
            "gc_source": "Python gc.callbacks inside megatron.training's train_step of each iteration, worst rank",
            "probe": _host_probe.summary([r.get("host_probe") for r in rows]),
        }


def _boot_id() -> str | None:
    """The kernel's id of this boot: a VM named like every other ('vm') is one machine only until it reboots."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


#: Megatron's parsed arguments that decide what a run costs (launcher/as_ran.py reads them).
_SETTINGS = (
    "transformer_impl", "attention_backend", "sequence_parallel", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "fp8", "fp8_recipe", "moe_grouped_gemm", "moe_token_dispatcher_type",
    "gradient_accumulation_fusion", "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "apply_rope_fusion",
    "masked_softmax_fusion", "no_persist_layer_norm", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "attention_softmax_in_fp32", "hidden_dropout", "attention_dropout", "use_distributed_optimizer",
    "overlap_grad_reduce", "overlap_param_gather", "align_param_gather", "grad_reduce_in_bf16", "manual_gc", "manual_gc_interval",
    "check_for_nan_in_loss_and_grad", "tp_comm_overlap", "fake_process_group", "use_torch_fsdp2",
    "cuda_graph_impl", "cuda_graph_modules", "use_megatron_fsdp", "data_parallel_sharding_strategy",
    "use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype", "moe_router_force_load_balancing",
    "moe_permute_fusion", "create_attention_mask_in_dataloader", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
)


def _env_int(name: str) -> int | None:
    """An integer environment variable as the job ran with it (None: unset or not an integer)."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _settings(args) -> dict[str, Any]:
    out = {}
    for name in _SETTINGS:
        v = getattr(args, name, None)
        if isinstance(v, list):  # e.g. cuda_graph_modules: CudaGraphModule enum members -> their names
            v = [x if isinstance(x, bool | int | float | str) else str(getattr(x, "name", x)) for x in v]
        out[name] = v if isinstance(v, bool | int | float | str | list | type(None)) else str(v)
    return out


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


def _write_result(out: Path, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=1, default=str)
    problems = _contract.check(json.loads(text))
    if problems:  # written all the same (the measurements stand); the notes say where the contract broke
        print("\n".join(f"result.json contract: {p}" for p in problems), file=sys.stderr)
        result["notes"] = [*result.get("notes", []), *(f"result.json contract (launcher/entry/result.py): {p}" for p in problems)]
        text = json.dumps(result, indent=1, default=str)
    tmp = out / "result.json.tmp"
    tmp.write_text(text)
    tmp.replace(out / "result.json")


def _teardown_megatron() -> None:
    """Megatron's global state, so the next job of a batch starts clean (the process group stays)."""
    from megatron.training.training import destroy_global_state

    destroy_global_state()


def run_one(spec: dict[str, Any], out: Path, device: str, shrink: int | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _State.phase, _State.iteration = "start", 0
    result = Job(spec, out, device, shrink).run()
    if result is not None:
        _write_result(out, result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", help="spec.json written from launcher.spec.job_spec(plan)")
    ap.add_argument("--out-dir", help="where result.json, train.log and the trace go")
    ap.add_argument("--batch", help="CI: a JSON list of {spec, out_dir}, run one after another in this process "
                                    "(one import of torch and megatron for many plans); stops at the first failure")
    ap.add_argument("--shrink", type=int, default=None, metavar="WORLD",
                    help="CI: run each argv shrunk to a couple of small layers on WORLD processes (entry/argv.py shrink)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: CUDA when torch sees a GPU, else CPU with gloo")
    a = ap.parse_args(argv)
    if a.batch:
        jobs = [(Path(j["spec"]), Path(j["out_dir"])) for j in json.loads(Path(a.batch).read_text())]
    elif a.spec and a.out_dir:
        jobs = [(Path(a.spec), Path(a.out_dir))]
    else:
        ap.error("give --spec and --out-dir, or --batch")
    rank = int(os.environ.get("RANK", "0"))
    for i, (spec_path, out) in enumerate(jobs):
        try:
            run_one(json.loads(spec_path.read_text()), out, a.device, a.shrink)
            if i + 1 < len(jobs):
                _teardown_megatron()
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

        if torch.distributed.is_initialized() and torch.distributed.get_backend() != "fake":
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except Exception:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
