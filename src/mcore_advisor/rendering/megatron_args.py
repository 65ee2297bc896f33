"""Plan -> Megatron-LM `pretrain_gpt.py` command-line flags, each with the reason it is there.

Flag names are Megatron-LM's exactly as megatron/training/arguments.py (megatron-core 0.19.2 wheel)
defines them; several differ from the Plan's field names:
- there is no `--virtual-pipeline-model-parallel-size`: the interleaved schedule is asked for with
  `--num-virtual-stages-per-pipeline-rank` (chunks per stage, our field) or
  `--num-layers-per-virtual-pipeline-stage` (validate_args derives one from the other);
- `--fp8-format` stores into `args.fp8`; `--disable-bias-linear` clears `add_bias_linear`;
- gradients are reduced in fp32 unless `--grad-reduce-in-bf16` is given.

Only flags that differ from Megatron's defaults are emitted, plus the layout and shape flags a
reader wants to see spelt out. Pure: no I/O; values are strings here and quoted by the renderer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcore_advisor.knowledge.models import catalog_model
from mcore_advisor.schemas import ModelShape, Plan, parallel_dims

if TYPE_CHECKING:
    from mcore_advisor.rendering.request import RenderRequest

# Megatron-LM's parser defaults that decide whether a flag is needed (arguments.py, 0.19.2).
_MEGATRON_DEFAULT_MAKE_VOCAB_DIVISIBLE_BY = 128
_MEGATRON_DEFAULT_POSITION_EMBEDDING = "learned_absolute"
_MEGATRON_DEFAULT_MOE_ROUTER_TOPK = 2


@dataclass(frozen=True, slots=True)
class Flag:
    """One Megatron-LM flag with its values (unquoted strings) and why it is set."""

    name: str
    values: tuple[str, ...]
    why: str

    @property
    def argv(self) -> list[str]:
        return [self.name, *self.values]


def _text(v: object) -> str:
    # Floats in the shortest form argparse reads back exactly enough (3e-05, not 2.9999999999999997e-05).
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _f(name: str, *values: object, why: str) -> Flag:
    return Flag(name, tuple(_text(v) for v in values), why)


def _moe_layer_freq(pattern: tuple[int, ...]) -> str | None:
    """Megatron's --moe-layer-freq for a 0/1 layer pattern; None when every layer is MoE (default 1).

    An integer N means layer i is MoE when i % N == 0 (arguments.py moe_freq_type); anything else is
    written as the explicit Python list Megatron evaluates (only digits, commas and brackets).
    """
    if all(pattern):
        return None
    for n in range(2, len(pattern) + 1):
        if pattern == tuple(1 if i % n == 0 else 0 for i in range(len(pattern))):
            return str(n)
    return "[" + ",".join(str(x) for x in pattern) + "]"


def model_flags(shape: ModelShape, seq_length: int, seq_length_max: int | None) -> list[Flag]:
    """Model-shape flags. ffn_hidden_size is always explicit: Megatron's own default for SwiGLU
    (int(8h/3 / 64) * 64, arguments.py) differs from the 4h the plan assumes when it is unset."""
    flags = [
        _f("--num-layers", shape.num_layers, why="model.num_layers: transformer blocks"),
        _f("--hidden-size", shape.hidden_size, why="model.hidden_size: width h"),
        _f("--num-attention-heads", shape.num_attention_heads, why="model.num_attention_heads"),
        _f("--ffn-hidden-size", shape.ffn_hidden_size,
           why="model.ffn_hidden_size: explicit, since Megatron's SwiGLU default (8h/3 rounded to 64) differs from 4h"),
    ]
    if not shape.multi_latent_attention and shape.num_query_groups != shape.num_attention_heads:
        flags += [
            _f("--group-query-attention", why="model.num_query_groups < heads: grouped-query attention"),
            _f("--num-query-groups", shape.num_query_groups, why="model.num_query_groups: K/V heads"),
        ]
    if shape.hidden_size % shape.num_attention_heads or shape.kv_channels != shape.hidden_size // shape.num_attention_heads:
        flags.append(_f("--kv-channels", shape.kv_channels, why="model.kv_channels: head dim differs from hidden/heads"))
    if shape.swiglu:
        flags.append(_f("--swiglu", why="model.swiglu: gated SiLU MLP (3 matrices)"))
    if shape.normalization != "LayerNorm":
        flags.append(_f("--normalization", shape.normalization, why="model.normalization (Megatron's default is LayerNorm)"))
    if not shape.add_bias_linear:
        flags.append(_f("--disable-bias-linear", why="model.add_bias_linear false: no biases in linear layers"))
    if shape.untie_embeddings_and_output_weights:
        flags.append(_f("--untie-embeddings-and-output-weights",
                        why="model.untie_embeddings_and_output_weights: separate input embedding and output layer"))
    if shape.position_embedding_type != _MEGATRON_DEFAULT_POSITION_EMBEDDING:
        flags.append(_f("--position-embedding-type", shape.position_embedding_type,
                        why="model.position_embedding_type (Megatron's default is learned_absolute)"))
    # Required by validate_args; for learned positions it sizes the embedding table, so keep the model's own.
    max_pos = max(seq_length, seq_length_max or 0)
    flags.append(_f("--max-position-embeddings", max_pos,
                    why="required by Megatron; max(training.seq_length, model.seq_length_max)"))
    if shape.make_vocab_size_divisible_by != _MEGATRON_DEFAULT_MAKE_VOCAB_DIVISIBLE_BY:
        flags.append(_f("--make-vocab-size-divisible-by", shape.make_vocab_size_divisible_by,
                        why="model.make_vocab_size_divisible_by: vocab padded to a multiple of this x TP"))
    if shape.is_moe:
        flags += [
            _f("--num-experts", shape.num_experts, why="model.num_experts: routed experts per MoE layer"),
            _f("--moe-ffn-hidden-size", shape.moe_ffn_hidden_size, why="model.moe_ffn_hidden_size: inner size of one expert"),
        ]
        if shape.moe_router_topk != _MEGATRON_DEFAULT_MOE_ROUTER_TOPK:
            flags.append(_f("--moe-router-topk", shape.moe_router_topk, why="model.moe_router_topk: experts per token"))
        if shape.moe_shared_expert_intermediate_size:
            flags.append(_f("--moe-shared-expert-intermediate-size", shape.moe_shared_expert_intermediate_size,
                            why="model.moe_shared_expert_intermediate_size: shared expert(s) total inner size"))
        freq = _moe_layer_freq(shape.moe_layer_pattern)
        if freq is not None:
            flags.append(_f("--moe-layer-freq", freq, why="model.moe_layer_freq: which layers are MoE"))
    if shape.multi_latent_attention:
        flags.append(_f("--multi-latent-attention", why="model.multi_latent_attention: DeepSeek MLA"))
        if shape.q_lora_rank is not None:
            flags.append(_f("--q-lora-rank", shape.q_lora_rank, why="model.q_lora_rank: query low rank"))
        flags += [
            _f("--kv-lora-rank", shape.kv_lora_rank, why="model.kv_lora_rank: key/value low rank"),
            _f("--qk-head-dim", shape.qk_head_dim, why="model.qk_head_dim"),
            _f("--qk-pos-emb-head-dim", shape.qk_pos_emb_head_dim, why="model.qk_pos_emb_head_dim: RoPE part"),
            _f("--v-head-dim", shape.v_head_dim, why="model.v_head_dim"),
        ]
    if shape.mtp_num_layers:
        flags.append(_f("--mtp-num-layers", shape.mtp_num_layers, why="model.mtp_num_layers: multi-token prediction"))
    return flags


def parallel_flags(plan: Plan, shape: ModelShape, notes: list[str]) -> list[Flag]:
    """Layout, optimizer sharding, overlap and recompute flags. `notes` collects what was dropped and why."""
    p = plan.parallelism
    impl = plan.implementation
    d = parallel_dims(plan)
    flags = [
        _f("--tensor-model-parallel-size", d.tp, why="parallelism.tensor_model_parallel_size: TP splits every GEMM"),
        _f("--pipeline-model-parallel-size", d.pp, why="parallelism.pipeline_model_parallel_size: PP stages"),
        _f("--context-parallel-size", d.cp, why="parallelism.context_parallel_size: CP splits the sequence"),
    ]
    if d.pp > 1 and d.vp > 1:
        flags.append(_f("--num-virtual-stages-per-pipeline-rank", d.vp,
                        why="parallelism.virtual_pipeline_model_parallel_size: interleaved 1F1B model chunks per stage "
                            "(Megatron-LM has no --virtual-pipeline-model-parallel-size flag)"))
    elif p.virtual_pipeline_model_parallel_size and p.virtual_pipeline_model_parallel_size > 1:
        notes.append("virtual_pipeline_model_parallel_size ignored: it needs pipeline_model_parallel_size > 1")
    if p.decoder_first_pipeline_num_layers is not None:
        flags.append(_f("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers,
                        why="parallelism.decoder_first_pipeline_num_layers: uneven PP split"))
    if p.decoder_last_pipeline_num_layers is not None:
        flags.append(_f("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers,
                        why="parallelism.decoder_last_pipeline_num_layers: uneven PP split"))
    if shape.is_moe:
        flags.append(_f("--expert-model-parallel-size", d.ep, why="parallelism.expert_model_parallel_size: EP splits experts"))
        if p.expert_tensor_parallel_size is not None:
            flags.append(_f("--expert-tensor-parallel-size", p.expert_tensor_parallel_size,
                            why="parallelism.expert_tensor_parallel_size: TP inside experts"))
    if p.sequence_parallel and d.tp > 1:
        flags.append(_f("--sequence-parallel", why="parallelism.sequence_parallel: norm/dropout activations sharded over TP"))
    elif p.sequence_parallel:
        notes.append("sequence_parallel dropped: Megatron turns it off when tensor_model_parallel_size is 1")

    fsdp = impl.use_torch_fsdp2
    if fsdp:
        flags.append(_f("--use-torch-fsdp2", why="implementation.use_torch_fsdp2: parameters sharded by torch FSDP2"))
    dist_opt = p.use_distributed_optimizer and not fsdp
    if dist_opt:
        flags.append(_f("--use-distributed-optimizer", why="parallelism.use_distributed_optimizer: Adam state sharded over DP (ZeRO-1)"))
    elif p.use_distributed_optimizer:
        notes.append("use_distributed_optimizer dropped: Megatron rejects it together with --use-torch-fsdp2")
    if p.overlap_grad_reduce:
        flags.append(_f("--overlap-grad-reduce", why="parallelism.overlap_grad_reduce: DP reduce-scatter overlapped with backward"))
    if p.overlap_param_gather and dist_opt and p.overlap_grad_reduce:
        flags.append(_f("--overlap-param-gather", why="parallelism.overlap_param_gather: DP all-gather overlapped with forward"))
    elif p.overlap_param_gather:
        # validate_args: "--overlap-param-gather only supported with distributed optimizer" and
        # "Must use --overlap-param-gather with --overlap-grad-reduce".
        notes.append("overlap_param_gather dropped: Megatron requires the distributed optimizer and overlap_grad_reduce")
    if p.tp_comm_overlap:
        if impl.transformer_impl == "transformer_engine" and p.sequence_parallel and d.tp > 1:
            flags.append(_f("--tp-comm-overlap", why="parallelism.tp_comm_overlap: TE userbuffers overlap TP/SP comms with GEMMs"))
        else:
            # validate_args asserts sequence_parallel; the userbuffers live in Transformer Engine.
            notes.append("tp_comm_overlap dropped: it needs transformer_engine, sequence_parallel and TP > 1")

    if p.recompute_granularity == "selective":
        flags.append(_f("--recompute-granularity", "selective", why="parallelism.recompute_granularity: recompute chosen modules in backward"))
        if p.recompute_modules:
            flags.append(_f("--recompute-modules", *p.recompute_modules, why="parallelism.recompute_modules"))
    elif p.recompute_granularity == "full":
        # TransformerConfig asserts a method for full recompute; uniform groups of 1 layer is
        # Megatron-LM's documented "recompute every layer" setting.
        method = p.recompute_method or "uniform"
        num = p.recompute_num_layers or 1
        if p.recompute_method is None or p.recompute_num_layers is None:
            notes.append(f"full recompute without method/num_layers: rendered as --recompute-method {method} --recompute-num-layers {num}")
        flags += [
            _f("--recompute-granularity", "full", why="parallelism.recompute_granularity: whole layers recomputed in backward"),
            _f("--recompute-method", method, why="parallelism.recompute_method"),
            _f("--recompute-num-layers", num, why="parallelism.recompute_num_layers"),
        ]
    return flags


def precision_flags(plan: Plan, gradient_accumulation_fusion: bool) -> list[Flag]:
    t = plan.training
    impl = plan.implementation
    flags = [_f("--bf16", why="bf16 parameters and activations (also the base precision under FP8)")]
    if t.precision == "fp8":
        flags += [
            _f("--fp8-format", t.fp8_format, why="training.precision fp8: TE FP8 GEMMs; training.fp8_format"),
            _f("--fp8-recipe", t.fp8_recipe, why="training.fp8_recipe: FP8 scaling recipe"),
        ]
        if t.fp8_param_gather:
            flags.append(_f("--fp8-param-gather", why="training.fp8_param_gather: weights all-gathered in FP8"))
    if not impl.grad_reduce_in_fp32:
        flags.append(_f("--grad-reduce-in-bf16", why="implementation.grad_reduce_in_fp32 false: bf16 gradient buffers and reduction"))
    if impl.transformer_impl != "transformer_engine":
        flags.append(_f("--transformer-impl", impl.transformer_impl, why="implementation.transformer_impl: Megatron's local modules"))
        # The fused RoPE kernel is Transformer Engine's; without TE, TransformerConfig raises
        # "apply_rope_fusion is not available" (transformer_config.py), whatever the position embedding.
        flags.append(_f("--no-rope-fusion", why="local spec: the fused RoPE kernel comes from Transformer Engine"))
    if impl.attention_backend not in ("auto", "local"):
        flags.append(_f("--attention-backend", impl.attention_backend,
                        why="implementation.attention_backend: core attention kernel (sets NVTE_*_ATTN itself)"))
    if impl.cross_entropy_loss_fusion:
        flags.append(_f("--cross-entropy-loss-fusion", why="implementation.cross_entropy_loss_fusion: fused vocab-parallel cross entropy"))
        if impl.cross_entropy_fusion_impl != "native":
            flags.append(_f("--cross-entropy-fusion-impl", impl.cross_entropy_fusion_impl,
                            why="Transformer Engine's cross entropy: no fp32 copy of the logits (2 B/logit instead of the native fused kernel's 10)"))
    if impl.use_torch_fsdp2:
        flags.append(_f("--no-gradient-accumulation-fusion",
                        why="FSDP2: Megatron's validate_args rejects gradient accumulation fusion with --use-torch-fsdp2"))
    elif not impl.gradient_accumulation_fusion:
        flags.append(_f("--no-gradient-accumulation-fusion",
                        why="implementation.gradient_accumulation_fusion false: weight gradients added to main_grad by a separate kernel"))
    elif not gradient_accumulation_fusion:
        flags.append(_f("--no-gradient-accumulation-fusion",
                        why="no Apex: the fused wgrad accumulation needs Apex's fused_weight_gradient_mlp_cuda "
                            "(Megatron raises at model build otherwise)"))
    return flags


def moe_impl_flags(plan: Plan, shape: ModelShape) -> list[Flag]:
    if not shape.is_moe:
        return []
    impl = plan.implementation
    flags = [_f("--moe-token-dispatcher-type", impl.moe_token_dispatcher_type,
                why="implementation.moe_token_dispatcher_type (Megatron's default is allgather)")]
    if impl.moe_grouped_gemm:
        flags.append(_f("--moe-grouped-gemm", why="implementation.moe_grouped_gemm: one grouped GEMM for the local experts"))
    return flags


def run_flags(plan: Plan, shape: ModelShape, req: RenderRequest, run_dir: str) -> list[Flag]:
    """Batch, data, optimizer, checkpoint, logging and profiling flags from the render options."""
    t = plan.training
    flags = [
        _f("--seq-length", t.seq_length, why="training.seq_length"),
        _f("--micro-batch-size", t.micro_batch_size, why="training.micro_batch_size: samples per forward per replica"),
        _f("--global-batch-size", t.global_batch_size, why="training.global_batch_size: samples per optimizer step"),
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
            # megatron.core NullTokenizer reports exactly --vocab-size (no extra EOD slot in 0.19.2).
            _f("--vocab-size", shape.vocab_size, why="model.vocab_size, so the embedding matches the plan"),
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
    im = plan.implementation
    if im.manual_gc:
        flags.append(_f("--manual-gc", why="implementation.manual_gc: garbage collection only at chosen steps, aligned across ranks"))
        if im.manual_gc_interval:
            flags.append(_f("--manual-gc-interval", im.manual_gc_interval, why="implementation.manual_gc_interval: steps between collections"))
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


def megatron_flags(plan: Plan, shape: ModelShape, req: RenderRequest, *, run_dir: str,
                   gradient_accumulation_fusion: bool, notes: list[str]) -> list[Flag]:
    """All flags for pretrain_gpt.py, grouped: layout, model, precision/kernels, MoE, run options."""
    return [
        *parallel_flags(plan, shape, notes),
        *model_flags(shape, plan.training.seq_length, _seq_length_max(plan)),
        *precision_flags(plan, gradient_accumulation_fusion),
        *moe_impl_flags(plan, shape),
        *run_flags(plan, shape, req, run_dir),
    ]
