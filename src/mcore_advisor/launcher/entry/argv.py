"""The rendered Megatron-LM argv, adapted where the machine that runs the profile job lacks a part.

The job spec carries the exact argv `render_launch_script` renders for the plan (launcher/spec.py).
The entry passes it to megatron.training unchanged except for what `for_machine` lists, each change
recorded with its reason in result.json (`argv_adjustments`), so get_job predicts for the run as it
ran (launcher/as_ran.py):

- output paths (`--tensorboard-dir`, where Megatron's torch profiler writes its trace, and
  `--memory-snapshot-path`) are placed in the job's --out-dir;
- without Transformer Engine, TE's implementation choices fall back to Megatron's local ones:
  `--transformer-impl local`, `--no-rope-fusion`, and `--attention-backend` (flash/fused are TE kernels),
  `--moe-grouped-gemm`, `--moe-permute-fusion`, `--tp-comm-overlap` and `--cross-entropy-fusion-impl te` are dropped;
  FP8 (`--fp8-format`) is refused: it changes the numerics, not just the kernels; so is multi-latent attention on
  a GPU (megatron-core 0.19's local DotProductAttention cannot take MLA's head dims; the CPU CI patches it);
- with the local spec and no Apex, `--no-persist-layer-norm` (Megatron's torch norm refuses the
  persistent kernel, torch_norm.py WrappedTorchNorm);
- without Megatron's compiled masked-softmax kernels (Apex / Megatron-LM builds; the wheel has
  none), `--no-masked-softmax-fusion`: megatron-core would import them at the first attention;
- on the CPU, `--distributed-backend gloo`, and no `--record-memory-history` (a CUDA allocator
  snapshot).

`shrink` (CI only) turns a full-size argv into a couple of small layers on 1-2 CPU processes: it
rewrites the size and layout flags (and `--num-workers 0`) only and keeps every other flag.
Pure functions on lists of strings; no torch, no pydantic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

Argv = list[str]


@dataclass(frozen=True)
class Adjustment:
    """One change to the rendered argv: 'set' (added or value replaced) or 'dropped'."""

    flag: str
    action: str
    values: tuple[str, ...]
    why: str

    def as_dict(self) -> dict:
        return {**asdict(self), "values": list(self.values)}


# --------------------------------------------------------------------------- flag groups

def groups(argv: Argv) -> list[list[str]]:
    """['--a', '1', '--b'] -> [['--a', '1'], ['--b']]; a value never starts with '--'."""
    out: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--") or not out:
            out.append([tok])
        else:
            out[-1].append(tok)
    return out


def values(argv: Argv, flag: str) -> list[str] | None:
    """The values after the last `flag` (empty for a switch); None when absent."""
    found = None
    for g in groups(argv):
        if g[0] == flag:
            found = g[1:]
    return found


def value(argv: Argv, flag: str, default: str | None = None) -> str | None:
    v = values(argv, flag)
    return v[0] if v else default


def int_value(argv: Argv, flag: str, default: int) -> int:
    v = value(argv, flag)
    return int(v) if v is not None else default


def drop(argv: Argv, flag: str) -> Argv:
    return [t for g in groups(argv) if g[0] != flag for t in g]


def put(argv: Argv, flag: str, *vals: object) -> Argv:
    """`flag vals...` in place of an existing `flag`, else appended."""
    new = [flag, *(str(v) for v in vals)]
    out: Argv = []
    done = False
    for g in groups(argv):
        if g[0] == flag:
            if not done:
                out += new
                done = True
        else:
            out += g
    return out if done else out + new


class _Editor:
    """Applies changes to an argv and records each one."""

    def __init__(self, argv: Argv) -> None:
        self.argv = list(argv)
        self.log: list[Adjustment] = []

    def put(self, flag: str, *vals: object, why: str) -> None:
        if values(self.argv, flag) == [str(v) for v in vals]:
            return
        self.argv = put(self.argv, flag, *vals)
        self.log.append(Adjustment(flag, "set", tuple(str(v) for v in vals), why))

    def drop(self, flag: str, why: str) -> None:
        old = values(self.argv, flag)
        if old is None:
            return
        self.argv = drop(self.argv, flag)
        self.log.append(Adjustment(flag, "dropped", tuple(old), why))


# --------------------------------------------------------------------------- the machine

@dataclass(frozen=True)
class Machine:
    """What the machine that runs the job has."""

    cuda: bool
    transformer_engine: bool
    apex: bool
    fused_softmax: bool


def uses_te(argv: Argv) -> bool:
    return value(argv, "--transformer-impl", "transformer_engine") == "transformer_engine"


def for_machine(argv: Argv, machine: Machine, out_dir: str) -> tuple[Argv, list[Adjustment]]:
    """The argv the job runs on `machine`, and what changed (see the module docstring).

    Raises ValueError naming the plan field when the plan needs what the machine lacks and no
    Megatron fallback keeps its meaning (FP8 without Transformer Engine).
    """
    ed = _Editor(argv)
    if values(argv, "--tensorboard-dir") is not None:
        ed.put("--tensorboard-dir", f"{out_dir}/tensorboard", why="the torch profiler trace goes to the job directory")
    if values(argv, "--record-memory-history") is not None:
        ed.put("--memory-snapshot-path", f"{out_dir}/memory_snapshot.pickle", why="the memory snapshot goes to the job directory")
    te = machine.transformer_engine and machine.cuda
    if not te:
        where = "on the CPU" if not machine.cuda else "(Transformer Engine is not importable here)"
        if values(ed.argv, "--fp8-format") is not None:
            raise ValueError(f"training.precision='fp8' needs Transformer Engine on a GPU {where}; "
                             "set training.precision='bf16' or run where transformer_engine imports")
        if machine.cuda and values(ed.argv, "--multi-latent-attention") is not None:
            # megatron-core 0.19's local DotProductAttention refuses MLA's k_channels (validators: mla_needs_transformer_engine);
            # the CPU CI patches it (cpu_shim.py), a GPU run has no such shim
            raise ValueError(f"model.multi_latent_attention needs Transformer Engine's attention {where}: Megatron's "
                             "local spec fails at model build; run where transformer_engine imports")
        if uses_te(ed.argv):
            ed.put("--transformer-impl", "local", why=f"no Transformer Engine {where}: Megatron's local spec")
        ed.put("--no-rope-fusion", why=f"the fused RoPE kernel is Transformer Engine's; none {where}")
        for flag in ("--attention-backend", "--moe-grouped-gemm", "--tp-comm-overlap", "--moe-permute-fusion"):
            ed.drop(flag, why=f"a Transformer Engine feature; no Transformer Engine {where}")
        if value(ed.argv, "--cross-entropy-fusion-impl") == "te":
            ed.drop("--cross-entropy-fusion-impl", why=f"Transformer Engine's cross entropy; Megatron's native one {where}")
    if not uses_te(ed.argv) and not machine.apex:
        ed.put("--no-persist-layer-norm", why="local spec without Apex: Megatron's torch norm has no persistent kernel")
    if not machine.fused_softmax:
        ed.put("--no-masked-softmax-fusion",
               why="Megatron's compiled masked-softmax kernels (scaled_*masked_softmax_cuda) are not installed")
    if not machine.cuda:
        ed.put("--distributed-backend", "gloo", why="CPU processes: gloo instead of NCCL")
        for flag in ("--record-memory-history", "--memory-snapshot-path"):
            ed.drop(flag, why="a CUDA caching-allocator snapshot; no CUDA allocator on the CPU")
    return ed.argv, ed.log


# --------------------------------------------------------------------------- CI: a small model on 1-2 processes

#: What a shrunk model looks like (the CPU CI runs one iteration of it).
SMALL = {
    "--hidden-size": 64, "--num-attention-heads": 4, "--ffn-hidden-size": 128, "--vocab-size": 256,
    "--seq-length": 64, "--max-position-embeddings": 64, "--micro-batch-size": 1,
    "--kv-channels": 32,  # only where the plan sets it (a head dim other than hidden / heads)
    "--num-query-groups": 2, "--num-experts": 4, "--moe-ffn-hidden-size": 64,
    "--moe-shared-expert-intermediate-size": 64, "--q-lora-rank": 32, "--kv-lora-rank": 32,
    "--qk-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 16, "--mtp-num-layers": 1,
    "--recompute-num-layers": 1,
    # group-limited routing (DeepSeek-V3): 2 groups of 2 experts, the best group's experts chosen
    "--moe-router-num-groups": 2, "--moe-router-group-topk": 1,
}
#: experts a shrunk token picks at most (2 of SMALL's 4; with 2 groups of 2, one group holds 2)
SMALL_TOPK = 2

#: Flags whose meaning needs the Transformer Engine kernels; the CPU CI drops them.
TE_ONLY = ("--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--tp-comm-overlap", "--attention-backend",
           "--moe-grouped-gemm", "--moe-permute-fusion")


def _fit(size: int, room: int) -> int:
    """The largest divisor of `room` not above `size` (sizes are kept where they fit)."""
    return max(d for d in range(1, room + 1) if room % d == 0 and d <= size)


def shrink(argv: Argv, world: int) -> tuple[Argv, list[Adjustment]]:
    """`argv` with a couple of small layers on `world` processes; every non-size flag kept.

    Layout: TP, then PP keep their size where it fits the processes left (a size larger than what
    is left becomes the largest divisor that fits, usually 1), PP first when the plan splits its
    pipeline unevenly, so that split stays in the run; the expert grid (ETP x EP x PP) is fitted
    the same way; CP becomes 1 (Megatron runs it only with Transformer Engine's attention). Model: hidden 64, 4 heads, and the SMALL sizes for
    every size flag the argv has; layers = 2 per pipeline stage and virtual stage (at least the MoE
    pattern's dense-then-MoE prefix), uneven first/last stages 1 layer each. Batch: 2
    micro-batches of 1 per data-parallel rank. TE-only flags are dropped (TE_ONLY); what Megatron's
    local spec cannot build goes too: linear biases of MoE models (its experts cannot add them) and
    the query norm of MLA without q_lora_rank.
    """
    ed = _Editor(argv)
    small = "CI: small model on CPU processes"
    for flag in TE_ONLY:
        ed.drop(flag, why="CI on CPU: a Transformer Engine feature")
    ed.put("--num-workers", 0, why="CI on CPU: the data loader runs in the training process (DataLoader workers forked "
           "from a process that has already run a dozen batch jobs segfaulted, seen at job 13 of the catalog batch)")
    if uses_te(ed.argv):
        ed.put("--transformer-impl", "local", why="CI on CPU: no Transformer Engine")
    if (values(argv, "--multi-latent-attention") is not None and values(argv, "--q-lora-rank") is None
            and values(argv, "--qk-layernorm") is not None):
        ed.drop("--qk-layernorm", why="CI on CPU: Megatron's local MLA spec gives the query a norm that has nothing "
                "to normalise without q_lora_rank and refuses it (mla_qk_norm_config.py); TE's spec fuses it")
    if values(argv, "--num-experts") is not None and values(argv, "--disable-bias-linear") is None:
        ed.put("--disable-bias-linear", why="CI on CPU: the local spec's experts (SequentialMLP, the only ones without "
               "Transformer Engine) cannot add biases (mlp.py: fused SwiGLU with routing weights takes none, and the "
               "output bias is added in place to a view)")
    tp_want = int_value(argv, "--tensor-model-parallel-size", 1)
    pp_want = int_value(argv, "--pipeline-model-parallel-size", 1)
    if values(argv, "--decoder-first-pipeline-num-layers") or values(argv, "--decoder-last-pipeline-num-layers"):
        pp = _fit(pp_want, world)  # keep the uneven pipeline split in the run
        tp = _fit(tp_want, world // pp)
    else:
        tp = _fit(tp_want, world)
        pp = _fit(pp_want, world // tp)
    cp = 1  # Megatron's own DotProductAttention asserts context-parallel size 1 (TE-only)
    etp = _fit(int_value(argv, "--expert-tensor-parallel-size", tp), world // pp)
    ep = _fit(int_value(argv, "--expert-model-parallel-size", 1), world // (etp * pp))
    for flag, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        ed.put(flag, size, why=small)
    if int_value(argv, "--context-parallel-size", 1) > 1:
        ed.put("--context-parallel-size", cp, why="CI on CPU: context parallelism needs Transformer Engine's attention")
    for flag, size in (("--expert-tensor-parallel-size", etp), ("--expert-model-parallel-size", ep)):
        if values(argv, flag) is not None:
            ed.put(flag, size, why=small)
    if tp == 1:
        ed.drop("--sequence-parallel", why="CI on CPU: tensor-parallel size 1 (Megatron turns it off)")
    vp = int_value(argv, "--num-virtual-stages-per-pipeline-rank", 1)
    if pp == 1:
        for flag in ("--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
                     "--decoder-last-pipeline-num-layers"):
            ed.drop(flag, why="CI on CPU: pipeline-parallel size 1")
        vp = 1
    layers = _small_layers(argv, pp, vp)
    ed.put("--num-layers", layers, why=small)
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        if values(ed.argv, flag) is not None:
            ed.put(flag, 1, why=small)
    freq = value(argv, "--moe-layer-freq")
    if freq is not None and freq.startswith("["):
        dense = 1 if freq.startswith("[0") else 0
        ed.put("--moe-layer-freq", "[" + ",".join(["0"] * dense + ["1"] * (layers - dense)) + "]", why=small)
    for flag, size in SMALL.items():
        if values(argv, flag) is not None:
            ed.put(flag, size, why=small)
    if values(argv, "--moe-router-topk") is not None:
        ed.put("--moe-router-topk", min(int_value(argv, "--moe-router-topk", 2), SMALL_TOPK), why=small)
    dp = world // (tp * pp)
    ed.put("--global-batch-size", dp * SMALL["--micro-batch-size"] * 2 * pp, why=small)
    return ed.argv, ed.log


def _small_layers(argv: Argv, pp: int, vp: int) -> int:
    """2 layers per pipeline chunk, 1 per chunk when interleaved, plus room for uneven first/last. With
    --account-for-embedding/loss-in-pipeline-split the embedding and the loss count as a layer each in
    Megatron's split (TransformerConfig: num_layers + them divides by PP x VP), so they take a layer's place,
    and chunks keep 2 so the end chunks still hold a decoder layer."""
    accounted = sum(values(argv, f) is not None for f in ("--account-for-embedding-in-pipeline-split",
                                                          "--account-for-loss-in-pipeline-split"))
    if pp > 1 and accounted:
        return pp * vp * 2 - accounted
    per_chunk = 1 if vp > 1 else 2
    layers = pp * vp * per_chunk
    first = values(argv, "--decoder-first-pipeline-num-layers") is not None
    last = values(argv, "--decoder-last-pipeline-num-layers") is not None
    if pp > 1 and (first or last):
        # 1 layer on each uneven end stage, per_chunk * vp on every other stage
        layers = int(first) + int(last) + (pp - int(first) - int(last)) * vp * per_chunk
    return max(layers, 2)
