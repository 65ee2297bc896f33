"""Plan -> Megatron-LM `pretrain_gpt.py` (`pretrain_hybrid.py` for hybrid Mamba models) command-line flags,
each with the reason it is there.

Which plan field becomes which flag (names, defaults, derived flags) is knowledge/megatron_flags.py's
table, the one the log parser reads back with; this module puts its groups in order among the flags
the render options give (data, optimizer, checkpoints, logging, profiling) and decides what the plan
becomes when Megatron would reject or ignore part of it (`as_rendered`).

Only flags that differ from Megatron's defaults are emitted, plus the layout and shape flags a
reader wants to see spelt out, every model setting the catalog or plan gives, and the dropout rates
(Megatron's default 0.1 is not what the plan assumes). `as_rendered` is the plan exactly as the flags
run it (fields Megatron would reject or ignore adjusted, each with a note): the flags are built from
it and the script's predicted figures are evaluate_plan of it. Pure: no I/O; values are strings here
and quoted by the renderer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mcore_advisor.knowledge import megatron_flags as table
from mcore_advisor.knowledge.megatron_flags import FULL_RECOMPUTE_DEFAULT, Flag, RenderView
from mcore_advisor.knowledge.models import catalog_model, resolve_model
from mcore_advisor.schemas import ModelShape, Plan, parallel_dims, with_changes

if TYPE_CHECKING:
    from mcore_advisor.rendering.request import RenderRequest

__all__ = ["Flag", "RenderedPlan", "as_rendered", "entry_script", "megatron_flags", "run_flags"]

_f = table.make_flag


@dataclass(frozen=True)
class RenderedPlan:
    """The plan as the rendered flags run it, with a note for every field the renderer changed."""

    plan: Plan
    notes: list[str] = field(default_factory=list)
    no_wgrad_fusion_why: str | None = None
    """Why --no-gradient-accumulation-fusion is passed (None: fusion stays on)."""


def as_rendered(plan: Plan, *, apex: bool) -> RenderedPlan:
    """`plan` with the changes its Megatron-LM flags make: fields Megatron ignores or rejects in this
    combination are set to what actually runs (each with a note), and wgrad fusion is off where the
    script has to pass --no-gradient-accumulation-fusion (FSDP2, or Megatron's own layers without Apex)."""
    p, im = plan.parallelism, plan.implementation
    d = parallel_dims(plan)
    notes: list[str] = []
    par: dict = {}
    imp: dict = {}
    shape = resolve_model(plan.model)
    impl = im.transformer_impl
    if shape.is_hybrid and impl == "local":
        impl = imp["transformer_impl"] = "transformer_engine"
        notes.append("transformer_impl 'local' rendered as transformer_engine: pretrain_hybrid.py builds a hybrid model "
                     "from Megatron-Core's hybrid layer specs, Transformer Engine modules only (there is no local one)")
    if p.virtual_pipeline_model_parallel_size and p.virtual_pipeline_model_parallel_size > 1 and d.pp == 1:
        par["virtual_pipeline_model_parallel_size"] = None
        notes.append("virtual_pipeline_model_parallel_size ignored: it needs pipeline_model_parallel_size > 1")
    if p.sequence_parallel and d.tp == 1:
        par["sequence_parallel"] = False
        notes.append("sequence_parallel dropped: Megatron turns it off when tensor_model_parallel_size is 1")
    fsdp = im.use_torch_fsdp2
    if fsdp and p.use_distributed_optimizer:
        par["use_distributed_optimizer"] = False
        notes.append("use_distributed_optimizer dropped: Megatron rejects it together with --use-torch-fsdp2")
    dist_opt = p.use_distributed_optimizer and not fsdp
    if p.overlap_param_gather and not (dist_opt and p.overlap_grad_reduce):
        # validate_args: "--overlap-param-gather only supported with distributed optimizer" and
        # "Must use --overlap-param-gather with --overlap-grad-reduce".
        par["overlap_param_gather"] = False
        notes.append("overlap_param_gather dropped: Megatron requires the distributed optimizer and overlap_grad_reduce")
    sp = par.get("sequence_parallel", p.sequence_parallel)
    if p.tp_comm_overlap and not (impl == "transformer_engine" and sp and d.tp > 1):
        # validate_args asserts sequence_parallel; the userbuffers live in Transformer Engine.
        par["tp_comm_overlap"] = False
        notes.append("tp_comm_overlap dropped: it needs transformer_engine, sequence_parallel and TP > 1")
    if p.recompute_granularity == "full" and (p.recompute_method is None or p.recompute_num_layers is None):
        # TransformerConfig asserts a method for full recompute; uniform groups of 1 layer is
        # Megatron-LM's documented "recompute every layer" setting.
        par["recompute_method"] = p.recompute_method or FULL_RECOMPUTE_DEFAULT[0]
        par["recompute_num_layers"] = p.recompute_num_layers or FULL_RECOMPUTE_DEFAULT[1]
        notes.append(f"full recompute without method/num_layers: rendered as --recompute-method {par['recompute_method']} "
                     f"--recompute-num-layers {par['recompute_num_layers']}")
    if im.attention_backend == "local" and impl == "transformer_engine":
        imp["attention_backend"] = "auto"
        notes.append("attention_backend 'local' not passed: Megatron's pretrain_gpt cannot take --spec local, so the "
                     "Transformer Engine layers pick their own kernel (auto); use transformer_impl 'local' for Megatron's own attention")
    if im.bias_activation_fusion and not shape.swiglu and not shape.add_bias_linear:
        # validate_args: "Disable bias gelu fusion if we are disabling bias altogether" (bias_gelu_fusion
        # is what TransformerConfig.bias_activation_fusion takes without --swiglu).
        imp["bias_activation_fusion"] = False
        notes.append("bias_activation_fusion off: Megatron turns the fused bias-GeLU off for models without linear biases")
    if im.masked_softmax_fusion and impl == "local" and not apex:
        # The local spec's DotProductAttention imports Apex's compiled kernels (scaled_upper_triang_masked_softmax_cuda)
        # at the first step for sequences of up to 4,096 tokens (fusions/fused_softmax.py): without Apex it fails.
        imp["masked_softmax_fusion"] = False
        notes.append("masked_softmax_fusion off in the script (no Apex: its compiled masked-softmax kernels are missing)")
    if im.cross_entropy_loss_fusion and im.cross_entropy_fusion_impl == "te":
        # validate_args (megatron-core 0.19.2): "Transformer Engine cross entropy loss fusion is disabled due to
        # stability issues. Use --cross-entropy-fusion-impl native, or omit --cross-entropy-loss-fusion."
        imp["cross_entropy_fusion_impl"] = "native"
        notes.append("cross_entropy_fusion_impl 'te' rendered as native: Megatron-LM 0.19 refuses Transformer Engine's "
                     "fused cross entropy (stability issues)")
    why = None
    if im.gradient_accumulation_fusion and fsdp:
        why = "FSDP2: Megatron's validate_args rejects gradient accumulation fusion with --use-torch-fsdp2"
    elif im.gradient_accumulation_fusion and not apex:
        why = ("no Apex: the fused wgrad accumulation needs Apex's fused_weight_gradient_mlp_cuda "
               "(Megatron raises at model build otherwise)")
    elif not im.gradient_accumulation_fusion:
        why = "implementation.gradient_accumulation_fusion false: weight gradients added to main_grad by a separate kernel"
    if why and im.gradient_accumulation_fusion:
        imp["gradient_accumulation_fusion"] = False
        notes.append("gradient_accumulation_fusion off in the script (" + why.split(":")[0] + ")")
    out = plan
    if par:
        out = with_changes(out, "parallelism", **par)
    if imp:
        out = with_changes(out, "implementation", **imp)
    return RenderedPlan(out, notes, why)


def run_flags(view: RenderView, req: RenderRequest, run_dir: str) -> list[Flag]:
    """Batch, data, optimizer, checkpoint, logging and profiling flags: the table's batch, vocabulary
    (mock data) and garbage-collection groups between those the render options give."""
    flags = [
        *table.render(view, "batch"),
        _f("--train-iters", req.train_iters, why="train_iters: optimizer steps to run"),
    ]
    if req.data_path:
        flags.append(_f("--data-path", *req.data_path, why="data_path: Megatron indexed dataset prefix(es), optionally weighted"))
        flags.append(_f("--tokenizer-type", req.tokenizer_type, why="tokenizer_type"))
        if req.tokenizer_model:
            flags.append(_f("--tokenizer-model", req.tokenizer_model, why="tokenizer_model"))
    else:
        flags += [
            _f("--mock-data", why="no data_path: synthetic tokens (enough for throughput and memory)"),
            _f("--tokenizer-type", "NullTokenizer", why="mock data needs no real tokenizer"),
            *table.render(view, "vocab"),
        ]
    flags += [
        # Llama 2 recipe (Touvron et al. 2023, sec. 2.2): AdamW b1 0.9, b2 0.95, weight decay 0.1,
        # grad clip 1.0, cosine decay to 10% of the peak LR.
        _f("--lr", req.lr, why="peak learning rate (render option lr)"),
        _f("--min-lr", req.lr / 10, why="cosine floor at 10% of the peak (Llama 2 recipe)"),
        _f("--lr-decay-style", "cosine", why="Llama 2 recipe"),
        _f("--lr-warmup-fraction", req.lr_warmup_fraction, why="warm-up as a fraction of train_iters"),
        _f("--weight-decay", 0.1, why="Llama 2 recipe (Megatron's default is 0.01)"),
        _f("--adam-beta2", 0.95, why="Llama 2 recipe (Megatron's default is 0.999)"),
        _f("--clip-grad", 1.0, why="gradient clipping at norm 1.0 (Megatron's default, kept explicit)"),
    ]
    if req.eval_interval:
        flags += [
            _f("--eval-interval", req.eval_interval, why="eval_interval: validation every N steps"),
            _f("--eval-iters", req.eval_iters, why="eval_iters: batches per validation"),
        ]
    else:
        # Megatron-LM 0.19 sizes the validation set as (train_iters // eval_interval + 1) * eval_iters
        # before training, so eval_interval may not stay None (TypeError in
        # get_train_valid_test_num_samples); eval_iters 0 then turns validation off (do_valid False).
        flags += [
            _f("--eval-interval", req.train_iters, why="no eval_interval: Megatron needs one to size the validation set"),
            _f("--eval-iters", 0, why="no eval_interval: skip validation (Megatron would run 100 batches at the end)"),
        ]
    if req.save_dir:
        flags += [
            _f("--save", req.save_dir, why="save_dir: checkpoint directory"),
            _f("--save-interval", req.save_interval or req.train_iters,
               why="save_interval (Megatron requires one with --save; default: at the end)"),
        ]
    if req.load_dir:
        flags.append(_f("--load", req.load_dir, why="load_dir: resume from this checkpoint directory"))
    flags += table.render(view, "gc")
    flags += [
        _f("--log-interval", req.log_interval, why="log_interval: steps between log lines"),
        _f("--log-throughput", why="print TFLOP/s per GPU in each log line (what check_mfu reads)"),
    ]
    if req.profile:
        flags += [
            _f("--profile", why="profile: capture a window of steps"),
            _f("--profile-step-start", req.profile_step_start, why="profile_step_start"),
            _f("--profile-step-end", req.profile_step_end, why="profile_step_end"),
            _f("--profile-ranks", *req.profile_ranks, why="profile_ranks: only these global ranks record"),
        ]
        if req.nsys:
            flags.append(_f("--nvtx-ranges", why="nsys: named NVTX ranges around Megatron's phases"))
        else:
            # training.py writes the trace to <tensorboard_dir>/../torch_profile/rank-<r>.json.gz.
            flags += [
                _f("--use-pytorch-profiler", why="no nsys: torch.profiler records the window"),
                _f("--tensorboard-dir", f"{run_dir}/tensorboard",
                   why="torch profiler traces land in <tensorboard-dir>/../torch_profile"),
            ]
    return flags


def _seq_length_max(plan: Plan) -> int | None:
    """The model's trained context: the plan's field, else the catalog entry's."""
    if plan.model.seq_length_max is not None or not plan.model.name:
        return plan.model.seq_length_max
    return catalog_model(plan.model.name).spec.seq_length_max


def entry_script(shape: ModelShape) -> str:
    """Megatron-LM's training script for the model: pretrain_hybrid.py builds a HybridModel from
    --hybrid-layer-pattern (Megatron-LM 0.19 renamed pretrain_mamba.py to it and keeps the old name as a
    deprecated wrapper); pretrain_gpt.py builds a GPTModel, every layer attention + MLP/MoE."""
    return "pretrain_hybrid.py" if shape.is_hybrid else "pretrain_gpt.py"


def megatron_flags(rendered: RenderedPlan, shape: ModelShape, req: RenderRequest, *, run_dir: str,
                   notes: list[str]) -> list[Flag]:
    """All flags for pretrain_gpt.py (pretrain_hybrid.py for a hybrid model) from the as-rendered plan,
    grouped: layout, model, precision/kernels, MoE, run options (knowledge/megatron_flags.py's groups in
    order). `notes` collects model settings the flags cannot carry."""
    plan = rendered.plan
    view = RenderView(plan, shape, _seq_length_max(plan), rendered.no_wgrad_fusion_why, notes)
    flags = [f for group in ("layout", "model", "settings", "dropout", "precision", "moe_impl")
             for f in table.render(view, group)]
    return flags + run_flags(view, req, run_dir)
