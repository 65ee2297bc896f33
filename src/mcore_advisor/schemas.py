"""Pydantic types that cross layers: the plan every tool accepts, and shared result pieces.

Field names are Megatron-LM's argument names in snake_case, so `tensor_model_parallel_size`
renders 1:1 to `--tensor-model-parallel-size`. Inputs are frozen and forbid unknown fields;
derived values (data-parallel size, resolved model shape) are computed, never written back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_INPUT = ConfigDict(extra="forbid", frozen=True)

MAX_MICRO_BATCH_SIZE = 4096
"""Largest micro-batch a plan may ask for (the search never proposes more)."""
MAX_GLOBAL_BATCH_SIZE = 2**24
"""Largest global batch (samples): 16.8M, far beyond any published run (Llama-3 405B: 16M tokens =
2,048 samples of 8,192); bounds the micro-batch enumeration and Megatron's per-micro-batch loop."""
MAX_NUM_LAYERS = 1024


class ModelSpec(BaseModel):
    """A transformer's shape: a catalog `name`, a Hugging Face `hf_config`, explicit fields, or
    either of the first two plus overrides.

    Explicit fields override the catalog entry or the imported config. Unset fields take Megatron's
    defaults when the model is resolved (kv_channels = hidden/heads, num_query_groups = heads, ffn = 4h).
    """

    model_config = _INPUT

    name: str | None = Field(None, description="Catalog key, e.g. 'llama3-70b' (see the models resource). Optional when every required shape field is given.")
    hf_config: str | dict[str, Any] | None = Field(None, description="The model's Hugging Face config.json (its text or JSON object) instead of a catalog name: Llama, Mistral, Qwen2/3 (dense and MoE), Mixtral, DeepSeek-V2/V3, GPT-OSS, Nemotron-H. Explicit fields still override it.")
    num_layers: int | None = Field(None, ge=1, le=MAX_NUM_LAYERS, description="Transformer layers (decoder blocks).")
    hidden_size: int | None = Field(None, ge=1, le=131072, description="Model width h.")
    num_attention_heads: int | None = Field(None, ge=1, le=1024, description="Attention heads n.")
    num_query_groups: int | None = Field(None, ge=1, le=1024, description="K/V heads g for GQA; None = MHA (g = n). Megatron: --num-query-groups with --group-query-attention.")
    kv_channels: int | None = Field(None, ge=1, le=4096, description="Head dim d; None = hidden_size / num_attention_heads.")
    ffn_hidden_size: int | None = Field(None, ge=1, le=1048576, description="Dense MLP inner size f; None = 4 * hidden_size.")
    vocab_size: int | None = Field(None, ge=1, le=4_000_000, description="Tokenizer vocabulary V before padding (padded to make_vocab_size_divisible_by * TP as Megatron does).")
    make_vocab_size_divisible_by: int = Field(128, ge=1, le=65536, description="Megatron pads the vocab to a multiple of this times TP.")
    seq_length_max: int | None = Field(None, ge=1, description="Context length the model was trained for (informational; the run's seq_length is in training).")
    swiglu: bool | None = Field(None, description="Gated SiLU MLP (3 matrices, f per gate) instead of 2-matrix GeLU.")
    normalization: Literal["LayerNorm", "RMSNorm"] | None = Field(None, description="Norm type.")
    add_bias_linear: bool | None = Field(None, description="Biases in linear layers (GPT-3 style); Llama-style models have none.")
    untie_embeddings_and_output_weights: bool | None = Field(None, description="Separate input embedding and output layer (two V*h matrices).")
    position_embedding_type: Literal["rope", "learned_absolute", "none"] | None = Field(None, description="Position embedding.")
    num_experts: int | None = Field(None, ge=1, le=4096, description="Routed experts E per MoE layer; None = dense model. Megatron: --num-experts.")
    moe_router_topk: int | None = Field(None, ge=1, le=64, description="Experts k each token is routed to.")
    moe_ffn_hidden_size: int | None = Field(None, ge=1, le=1048576, description="Inner size of one routed expert; None = ffn_hidden_size.")
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1, le=1048576, description="Total inner size of the shared expert(s); None = no shared expert.")
    # Megatron takes i % N == 0 for the MoE layers (gpt_layer_specs.py): N = 0 divides by zero there too.
    moe_layer_freq: Annotated[int, Field(ge=1, le=MAX_NUM_LAYERS)] | Annotated[list[Literal[0, 1]], Field(max_length=MAX_NUM_LAYERS)] | None = Field(None, description="1 = every layer is MoE; N = every Nth; or a 0/1 list of length num_layers. Megatron: --moe-layer-freq.")
    multi_latent_attention: bool | None = Field(None, description="DeepSeek MLA instead of MHA/GQA.")
    q_lora_rank: int | None = Field(None, ge=1, le=131072, description="MLA query low-rank; None = no query compression.")
    kv_lora_rank: int | None = Field(None, ge=1, le=131072, description="MLA key/value low-rank r_kv.")
    qk_head_dim: int | None = Field(None, ge=1, le=4096, description="MLA per-head Q/K dim without RoPE part.")
    qk_pos_emb_head_dim: int | None = Field(None, ge=0, le=4096, description="MLA per-head RoPE dim.")
    v_head_dim: int | None = Field(None, ge=1, le=4096, description="MLA per-head V dim.")
    mtp_num_layers: int | None = Field(None, ge=0, le=16, description="Multi-token-prediction layers; None/0 = off.")
    hybrid_layer_pattern: str | None = Field(None, min_length=1, max_length=1024, description="Hybrid Mamba model (Megatron --hybrid-layer-pattern, formerly --hybrid-override-pattern; pretrain_hybrid.py): one symbol per decoder layer, 'M' Mamba-2 mixer, '*' self-attention, '-' dense MLP, 'E' MoE MLP; its length is num_layers. None = GPT model (every layer attention + MLP/MoE).")
    mamba_num_heads: int | None = Field(None, ge=1, le=16384, description="Mamba-2 heads (--mamba-num-heads); None = 2 * hidden_size / mamba_head_dim (MambaMixer's expand = 2).")
    mamba_head_dim: int | None = Field(None, ge=1, le=1024, description="Mamba-2 head dim P (--mamba-head-dim); None = 64.")
    mamba_state_dim: int | None = Field(None, ge=1, le=1024, description="Mamba-2 SSM state size N (--mamba-state-dim); None = 128.")
    mamba_num_groups: int | None = Field(None, ge=1, le=1024, description="Mamba-2 B/C groups G (--mamba-num-groups); None = 8.")
    squared_relu: bool | None = Field(None, description="Squared-ReLU MLP (--squared-relu; Nemotron, Nemotron-H): 2 matrices like GeLU.")
    qk_layernorm: bool | None = Field(None, description="Norm on each head's query and key (--qk-layernorm; Qwen3): 2 x kv_channels weights per attention layer. MLA's q/kv latent norms are always counted.")
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = Field(None, description="Router score function (--moe-router-score-function); sigmoid for DeepSeek-V3-style routers.")
    moe_router_pre_softmax: bool | None = Field(None, description="Score all experts before the top-k (--moe-router-pre-softmax); None = Megatron's default False (top-k first, softmax over the k chosen). Megatron requires it for top-1 softmax routing, where a softmax over one logit has no gradient.")
    moe_router_topk_scaling_factor: float | None = Field(None, gt=0, description="Scale of the routed experts' weights (--moe-router-topk-scaling-factor; HF routed_scaling_factor).")
    moe_router_num_groups: int | None = Field(None, ge=1, le=4096, description="Device/node groups for group-limited routing (--moe-router-num-groups; HF n_group).")
    moe_router_group_topk: int | None = Field(None, ge=1, le=4096, description="Groups each token may use (--moe-router-group-topk; HF topk_group).")
    rotary_base: int | None = Field(None, ge=1, description="RoPE base (--rotary-base; HF rope_theta). Does not change FLOPs or memory.")
    rotary_percent: float | None = Field(None, gt=0, le=1, description="Fraction of each head rotated (--rotary-percent; HF partial_rotary_factor).")
    rope_scaling_factor: float | None = Field(None, gt=0, description="RoPE context-extension factor (HF rope_scaling.factor): Llama-3 style --use-rope-scaling --rope-scaling-factor; YaRN under MLA --rotary-scaling-factor. Does not change FLOPs or memory.")
    norm_epsilon: float | None = Field(None, gt=0, lt=1, description="Norm epsilon (--norm-epsilon; HF rms_norm_eps / layer_norm_epsilon).")
    rope_scaling_type: Literal["llama3", "yarn"] | None = Field(None, description="How rope_scaling_factor extends the context (HF rope_scaling.rope_type): 'llama3' (Llama 3.1 frequency scaling, --use-rope-scaling) or 'yarn' (--rotary-scaling-factor under MLA); None = yarn under MLA, llama3 otherwise. Does not change FLOPs or memory.")
    moe_router_enable_expert_bias: bool | None = Field(None, description="Aux-loss-free load balancing with a per-expert routing bias (--moe-router-enable-expert-bias; DeepSeek-V3 style). A buffer, not a parameter.")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] | None = Field(None, description="Load-balancing loss (--moe-router-load-balancing-type); None = Megatron's default 'aux_loss'.")
    moe_aux_loss_coeff: float | None = Field(None, ge=0, description="Weight of the load-balancing loss (--moe-aux-loss-coeff; HF router_aux_loss_coef); None = Megatron's default 0.0 (no balancing loss).")

    @field_validator("hf_config", mode="before")
    @classmethod
    def _hf_config_as_text(cls, v: Any) -> Any:
        # Kept as canonical JSON text, so a spec stays hashable and its cache key stable.
        return json.dumps(v, sort_keys=True) if isinstance(v, dict) else v


class ClusterSpec(BaseModel):
    """Where the run goes: GPU type and count."""

    model_config = _INPUT

    gpu: str = Field("h100-sxm", description="GPU catalog key, e.g. 'h100-sxm', 'h200', 'a100-80gb' (see the hardware resource).")
    num_gpus: int = Field(8, ge=1, le=1_048_576, description="Total GPUs (world size).")
    gpus_per_node: int | None = Field(None, ge=1, le=72, description="GPUs per node (NVLink domain); None = the GPU's catalog default.")
    nvlink_bandwidth_gbps: float | None = Field(None, gt=0, description="Override: unidirectional NVLink bandwidth per GPU, GB/s.")
    scaleout_bandwidth_gbps: float | None = Field(None, gt=0, description="Override: unidirectional inter-node bandwidth per GPU, GB/s (e.g. 50 for 400 Gb/s IB).")
    gpu_memory_gib: float | None = Field(None, gt=0, description="Override: usable HBM per GPU, GiB.")
    host_floor_ms_per_layer: float | None = Field(None, ge=0, description="Override: the host's speed, as the CPU time to launch a reference layer's forward + backward for one micro-batch (GPT-3 1.3B with Transformer Engine), ms; the step-time model scales it by what each plan launches (kernels per layer, recompute, host syncs, the per-step work). None = the GPU catalog's inside one node (5.5 fitted on this workplace's H100 and H200 VMs) and a bare-metal DGX/HGX host's over several nodes (2.75, knowledge.hardware.BARE_METAL_HOST_FLOOR_MS); 0 = a host never binding.")


class TrainingSpec(BaseModel):
    """Batch and precision."""

    model_config = _INPUT

    seq_length: int = Field(4096, ge=1, le=4_194_304, description="Tokens per sample s.")
    global_batch_size: int = Field(128, ge=1, le=MAX_GLOBAL_BATCH_SIZE, description="Samples per optimizer step B.")
    micro_batch_size: int = Field(1, ge=1, le=MAX_MICRO_BATCH_SIZE, description="Samples per forward pass per model replica b.")
    precision: Literal["bf16", "fp8"] = Field("bf16", description="bf16 mixed precision, or FP8 GEMMs via Transformer Engine (Hopper or newer).")
    fp8_format: Literal["hybrid", "e4m3"] = Field("hybrid", description="TE FP8 format when precision=fp8 (--fp8-format).")
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = Field("delayed", description="FP8 scaling recipe (--fp8-recipe); mxfp8 needs Blackwell.")
    fp8_param_gather: bool = Field(False, description="Keep FP8 copies of weights and all-gather them in FP8 (--fp8-param-gather).")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the attention probabilities (--attention-dropout; always rendered, since Megatron-LM's own default is 0.1). 0 = what large-model pretraining recipes commonly use (e.g. the Hugging Face configs of Llama 3 and Mixtral: attention_dropout 0.0). > 0: Megatron's own DotProductAttention (local spec) keeps a 1-byte mask and the dropped bf16 probabilities per attention score and runs a dropout kernel over them; the fused/flash kernels regenerate the mask from the RNG state (no memory) at a small kernel slowdown.")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after the attention and MLP blocks (--hidden-dropout; always rendered, Megatron-LM's default is 0.1). > 0: each bias-dropout-add keeps a 1-byte mask per element of the s x b x h output (two per layer) and writes/reads it.")


class ParallelismSpec(BaseModel):
    """Model-parallel layout. Data-parallel size is derived: num_gpus / (TP * PP * CP)."""

    model_config = _INPUT

    tensor_model_parallel_size: int = Field(1, ge=1, le=1024, description="TP degree.")
    pipeline_model_parallel_size: int = Field(1, ge=1, le=1024, description="PP degree (stages).")
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1, le=128, description="Model chunks per PP stage for the interleaved schedule; None = not interleaved. Ignored (warning) when PP = 1.")
    decoder_first_pipeline_num_layers: int | None = Field(None, ge=0, le=MAX_NUM_LAYERS, description="Layers on the first PP stage when the split is uneven (e.g. 126 layers on PP16); None = even split. The remaining layers split evenly over the other stages.")
    decoder_last_pipeline_num_layers: int | None = Field(None, ge=0, le=MAX_NUM_LAYERS, description="Layers on the last PP stage when the split is uneven; None = even split.")
    account_for_embedding_in_pipeline_split: bool = Field(False, description="--account-for-embedding-in-pipeline-split: count the input embedding as one layer when splitting, so the first stage builds one decoder layer fewer ((num_layers + 1 [+ 1]) must divide by PP, and by PP * VP when interleaved). Not with decoder_first/last_pipeline_num_layers.")
    account_for_loss_in_pipeline_split: bool = Field(False, description="--account-for-loss-in-pipeline-split: count the output layer and loss as one layer when splitting, so the last stage builds one decoder layer fewer. Not with decoder_first/last_pipeline_num_layers.")
    context_parallel_size: int = Field(1, ge=1, le=1024, description="CP degree: the sequence split across GPUs (ring attention).")
    expert_model_parallel_size: int = Field(1, ge=1, le=4096, description="EP degree: experts split across GPUs.")
    expert_tensor_parallel_size: int | None = Field(None, ge=1, le=1024, description="TP degree inside experts; None = tensor_model_parallel_size (Megatron's default).")
    sequence_parallel: bool = Field(False, description="Shard norms/dropout activations over TP (needs TP > 1).")
    use_distributed_optimizer: bool = Field(True, description="Shard fp32 master weights and Adam state over data-parallel ranks (ZeRO-1).")
    recompute_granularity: Literal["selective", "full"] | None = Field(None, description="Activation recomputation: None, 'selective' (core attention and the modules in recompute_modules), or 'full' (whole layers).")
    recompute_method: Literal["uniform", "block"] | None = Field(None, description="With full recompute: 'uniform' (groups of recompute_num_layers) or 'block' (the first recompute_num_layers layers of each stage).")
    recompute_num_layers: int | None = Field(None, ge=1, le=MAX_NUM_LAYERS, description="With full recompute: layers per group (uniform) or layers recomputed per stage (block).")
    recompute_modules: list[Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out"]] | None = Field(None, description="With selective recompute: modules recomputed (Megatron-LM 0.19's --recompute-modules choices); None = Megatron's default ['core_attn'].")
    overlap_grad_reduce: bool = Field(True, description="Overlap DP gradient reduce-scatter with backward.")
    overlap_param_gather: bool = Field(True, description="Overlap distributed-optimizer parameter all-gather with forward.")
    tp_comm_overlap: bool = Field(False, description="TE userbuffers overlap of TP/SP communication with GEMMs (needs TE and SP).")


class ImplementationSpec(BaseModel):
    """Implementation choices that change memory and speed, under Megatron's names."""

    model_config = _INPUT

    transformer_impl: Literal["transformer_engine", "local"] = Field("transformer_engine", description="Layer spec: TE fused modules, or Megatron's local modules.")
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = Field("auto", description="Core attention kernel (--attention-backend). 'unfused' and 'local' store the s*s score matrix.")
    grad_reduce_in_fp32: bool = Field(True, description="Gradient buffers and reduction in fp32 (4 B/param) instead of bf16 (2 B/param).")
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = Field("alltoall", description="MoE token dispatcher.")
    moe_grouped_gemm: bool = Field(True, description="Grouped GEMM for the local experts.")
    cross_entropy_loss_fusion: bool = Field(False, description="Fused vocab-parallel cross entropy (--cross-entropy-loss-fusion; off by default in Megatron-LM): fewer kernels; with the 'native' implementation it holds 10 B/logit at the loss (bf16 logits + fp32 copy + torch.compile's out-of-place buffer) vs 6 B unfused.")
    cross_entropy_fusion_impl: Literal["native", "te"] = Field("native", description="--cross-entropy-fusion-impl (with cross_entropy_loss_fusion): 'native' (Megatron's torch.compile'd kernel, 10 B/logit) or 'te' (Transformer Engine's, gradient written into the bf16 logits: 2 B/logit; needs TE).")
    gradient_accumulation_fusion: bool = Field(True, description="Accumulate weight gradients into the fp32 main_grad inside the wgrad GEMM (Megatron's default; false = --no-gradient-accumulation-fusion). Megatron's own linear layers need Apex's fused_weight_gradient_mlp_cuda for it; Transformer Engine layers do it natively.")
    attention_softmax_in_fp32: bool = Field(False, description="--attention-softmax-in-fp32 (off by default in Megatron-LM; TransformerConfig's own default is on): Megatron's DotProductAttention (the local spec's core attention) runs the masked softmax in fp32 when the fused kernel does not: it then saves the fp32 probabilities and their bf16 copy (6 B per attention score instead of 2) and moves about twice the bytes.")
    masked_softmax_fusion: bool = Field(True, description="Megatron's fused scale-mask-softmax kernel in DotProductAttention (the local spec; --no-masked-softmax-fusion clears it). The kernel (scaled_upper_triang_masked_softmax_cuda, built by Apex as in NVIDIA's containers; without it Megatron fails at the first step, so pass false) runs for sequences of 17 to 4,096 tokens and keeps 2 B per score; longer sequences fall back to PyTorch's softmax.")
    bias_activation_fusion: bool = Field(True, description="Fused bias + activation (Megatron's --no-bias-gelu-fusion / --no-bias-swiglu-fusion clear it): false runs the activation as separate PyTorch kernels and a SwiGLU also keeps its SiLU output (f bf16 values per token) for backward.")
    bias_dropout_fusion: bool = Field(True, description="Fused bias-dropout-add after attention and MLP (--no-bias-dropout-fusion clears it): false runs bias add, dropout and residual add as separate kernels.")
    apply_rope_fusion: bool = Field(True, description="Transformer Engine's fused RoPE kernel (--no-rope-fusion clears it; the local spec cannot use it): false applies RoPE with about five PyTorch kernels per tensor.")
    check_for_nan_in_loss_and_grad: bool = Field(True, description="Megatron-LM's default NaN/Inf checks (--no-check-for-nan-in-loss-and-grad clears it): each micro-batch's loss and, once per step, each gradient bucket's norm are read back to the host (two syncs each), so the GPU idles while the host catches up after every check.")
    create_attention_mask_in_dataloader: bool = Field(True, description="Megatron-LM's default (--no-create-attention-mask-in-dataloader clears it): the data loader builds a seq x seq bool mask per sample (16 MiB at 4k tokens, 256 MiB at 16k, 1 GiB at 32k), pins it, copies it to the GPU every micro-batch and broadcasts it over TP. Causal attention (TE or Megatron's own) never reads it; at long sequences the copies and the host work stall the step.")
    manual_gc: bool = Field(False, description="--manual-gc: Python's threshold-based garbage collector off; collections only every manual_gc_interval steps, at the same step on every rank. Removes GC pauses from random iterations (one gen-2 collection cost 0.36 s inside a 0.75 s step of an H200 run) and the stragglers they make at scale.")
    manual_gc_interval: int = Field(0, ge=0, le=1_000_000, description="--manual-gc-interval (with manual_gc): steps between collections; 0 = none during training (Megatron's default). Host memory then grows with Python garbage; a few hundred steps is a common choice.")
    expandable_segments: bool = Field(False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: far less allocator fragmentation.")
    use_torch_fsdp2: bool = Field(False, description="torch FSDP2 (--use-torch-fsdp2) instead of DDP + distributed optimizer: parameters, gradients and optimizer state sharded over DP x CP, each layer's parameters all-gathered for its forward and again for its backward.")
    use_megatron_fsdp: bool = Field(False, description="Megatron-FSDP (--use-megatron-fsdp) instead of DDP: what it shards over DP x CP (experts over expert-DP) is data_parallel_sharding_strategy; Megatron turns the distributed optimizer on with it and needs --ckpt-format fsdp_dtensor (rendered). Its gradient buffer is bf16 (--megatron-fsdp-main-grads-dtype auto) whatever grad_reduce_in_fp32 says.")
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = Field("optim_grads_params", description="--data-parallel-sharding-strategy with use_megatron_fsdp (Megatron's default optim_grads_params): 'no_shard' (DDP-like), 'optim' (fp32 main weights and Adam state sharded, ZeRO-1), 'optim_grads' (+ gradients, ZeRO-2: reduce-scattered every micro-batch), 'optim_grads_params' (+ bf16 weights, ZeRO-3: each layer all-gathered for its forward and backward of every micro-batch).")
    use_precision_aware_optimizer: bool = Field(False, description="--use-precision-aware-optimizer (needs the distributed optimizer): TE's FusedAdam keeps the optimizer state at exp_avg_dtype / exp_avg_sq_dtype and, in bf16 without FP8 or with delayed-scaling FP8, the fp32 master weights as 16-bit remainders beside the bf16 weights (2 B instead of 4; OptimizerConfig.store_param_remainders); the optimizer reads the bf16 gradients directly (no fp32 copy at the step).")
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = Field("fp32", description="--exp-avg-dtype: Adam's first moment as stored with use_precision_aware_optimizer (ignored without it).")
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = Field("fp32", description="--exp-avg-sq-dtype: Adam's second moment as stored with use_precision_aware_optimizer (ignored without it).")
    moe_permute_fusion: bool = Field(False, description="--moe-permute-fusion (Transformer Engine's fused token permute/unpermute kernels; Megatron-Bridge's MoE recipes and model providers set it): no index_add_ with atomics in the permute's backward and one kernel per direction on the host. Off (Megatron's default): moe_utils.permute/unpermute in plain PyTorch.")
    moe_router_force_load_balancing: bool = Field(False, description="--moe-router-force-load-balancing (benchmarks only; Megatron-Bridge's performance recipes set it for every MoE model): the router routes on random logits, so every expert gets an equal share of tokens up to sampling noise, and the model learns nothing from its router. Off: routing follows the router, and an untrained one sends some experts far more tokens (moe_routing_imbalance).")
    moe_expert_capacity_factor: float | None = Field(None, gt=0, le=64, description="--moe-expert-capacity-factor: each expert takes at most capacity = ceil(tokens x topk / experts x factor) of a rank's tokens and drops the rest (Megatron-Bridge's 'tokendrop' benchmarks: 1.0). None = dropless (Megatron's default).")
    moe_pad_expert_input_to_capacity: bool = Field(False, description="--moe-pad-expert-input-to-capacity (with moe_expert_capacity_factor): every expert receives exactly its capacity from every rank, padded: fixed shapes, so the dispatcher makes no host sync and the expert GEMMs meet one row count; the experts compute the padding too.")
    overlap_moe_expert_parallel_comm: bool = Field(False, description="--overlap-moe-expert-parallel-comm (EP > 1, alltoall or flex dispatcher; interleaved VP when PP > 1): Megatron's combined 1F1B schedule runs one micro-batch's forward beside another's backward, layer by layer, so each token all-to-all runs on its own stream under the other direction's attention or experts (megatron/core/pipeline_parallel/combined_1f1b.py).")
    delay_wgrad_compute: bool = Field(False, description="--delay-wgrad-compute (with overlap_moe_expert_parallel_comm, Transformer Engine): the experts' weight-gradient GEMMs wait until the backward's dispatch all-to-all is issued and run under it.")
    moe_routing_imbalance: float | None = Field(None, ge=1, le=4096, description="Tokens the busiest EP rank receives over the mean, per MoE layer and micro-batch (each all-to-all waits for that rank): measured (a profile job's result moe_routing.rank_imbalance_mean; get_job fills it in) or assumed. None = the model's estimate (physics.moe.routing_imbalance: sampling noise with moe_router_force_load_balancing, else an untrained router's expert-load spread). Not a Megatron argument.")
    cublaslt_heuristics_cache_capacity: int | None = Field(None, ge=0, le=1 << 24, description="Environment variable CUBLASLT_HEURISTICS_CACHE_CAPACITY: GEMM problems cuBLASLt keeps the chosen algorithm for (None = its default 8192; 0 = none). Fine-grained experts routed unevenly meet thousands of row counts, six problems each, and thrash the default: 65536 took 64 experts top-8 on 4 x H200 from 0.735 to 0.656 s per step (physics.moe.heuristic_miss_share).")
    moe_heuristic_miss_share: float | None = Field(None, ge=0, le=1, description="Share of expert GEMMs whose problem misses cuBLASLt's full heuristics cache and pays a heuristic query on the host (physics.moe.heuristic_miss_share): measured (a profile job's result moe_routing.expert_gemm_heuristic_miss_share, an LRU replay of each EP rank's row counts; get_job fills it in) or assumed. None = the model's steady-state estimate from the expert-load spread. Not a Megatron argument.")
    moe_expert_load_cv: float | None = Field(None, ge=0, le=64, description="Spread of the tokens each expert receives per MoE layer call (std / mean over the experts): measured (a profile job's result moe_routing.expert_load_cv_mean; get_job fills it in) or assumed. None = 0 with moe_router_force_load_balancing, else an untrained router's (physics.moe.UNTRAINED_EXPERT_LOAD_CV). It sets the busiest EP rank's load when moe_routing_imbalance is unset. Not a Megatron argument.")
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] = Field("none", description="--cuda-graph-impl (Megatron-LM 0.19; default 'none'): capture each layer's forward/backward as CUDA graphs ('local': Megatron's CudaGraphManager, 'transformer_engine': TE make_graphed_callables) or the whole iteration ('full_iteration'); a captured part replays its kernels from one launch, so the host's per-kernel launch cost drops out of it (a dense layer's attention and MLP halves, the MoE layer's router, preprocess and attention half: knowledge.cuda_graphs).")
    cuda_graph_modules: list[Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"]] | None = Field(None, description="--cuda-graph-modules (0.19's name for the deprecated --cuda-graph-scope) with a per-layer cuda_graph_impl: the parts of each layer captured; None or [] = the whole layer. Dropless MoE layers capture only 'attn', 'moe_router' and 'moe_preprocess' (the dispatcher reads the token counts per expert back to the host; 'moe' needs drop-and-pad). 'local' captures the whole layer when 'attn' or 'mlp' is listed (Megatron-Core 0.19), so use 'transformer_engine' for partial graphs.")


class Plan(BaseModel):
    """A complete training plan: the object every tool accepts and recommend_parallelism returns."""

    model_config = _INPUT

    model: ModelSpec = Field(description="Model shape (catalog name and/or explicit fields).")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="GPU type and count.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Sequence, batch and precision.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Parallel layout.")
    implementation: ImplementationSpec = Field(default_factory=ImplementationSpec, description="Kernels and buffers.")


# ModelSpec fields that resolve_model copies to ModelShape unchanged (catalog value, else the plan's,
# else None = Megatron's default): they change what the model computes, not what it costs.
MODEL_SETTINGS = (
    "rotary_base", "rotary_percent", "rope_scaling_factor", "rope_scaling_type", "norm_epsilon", "squared_relu",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
)

# Megatron's hybrid layer symbols (core/models/hybrid/hybrid_layer_allocation.py Symbols) this model handles.
HYBRID_LAYER_SYMBOLS = {"M": "Mamba-2", "*": "self-attention", "-": "dense MLP", "E": "MoE"}
# MambaMixer's causal-convolution width: its d_conv argument, which Megatron-LM leaves at 4.
MAMBA_CONV_KERNEL = 4


# The Mamba-2 widths below take a ModelShape or any object with its mamba_* fields (physics.anatomy's
# view of the profile job's JSON model), hence functions; ModelShape.mamba_d_inner is the first.
def pads_to_capacity(capacity_factor: float | None, pad: bool) -> bool:
    """--moe-pad-expert-input-to-capacity takes effect (drop-and-pad: every expert gets exactly its capacity, fixed
    shapes, no host sync): it needs --moe-expert-capacity-factor (the validators refuse it alone)."""
    return pad and capacity_factor is not None


def mamba_d_inner(shape: Any) -> int:
    """Mamba-2 inner width: heads x head dim (MambaMixer d_inner)."""
    return shape.mamba_num_heads * shape.mamba_head_dim


def mamba_conv_dim(shape: Any) -> int:
    """Channels of the mixer's depthwise conv1d (MambaMixer conv_dim): x (d_inner), B and C (groups x
    state each)."""
    return mamba_d_inner(shape) + 2 * shape.mamba_num_groups * shape.mamba_state_dim


def mamba_in_proj_width(shape: Any) -> int:
    """Outputs of a Mamba-2 mixer's in_proj (MambaMixer): z (d_inner), the conv's x, B and C, and dt
    (one per head): 2*d_inner + 2*groups*state + heads."""
    return mamba_d_inner(shape) + mamba_conv_dim(shape) + shape.mamba_num_heads


class ModelShape(BaseModel):
    """A model with every shape field resolved (catalog entry + overrides + Megatron defaults)."""

    model_config = ConfigDict(frozen=True)

    name: str | None
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    make_vocab_size_divisible_by: int
    swiglu: bool
    normalization: Literal["LayerNorm", "RMSNorm"]
    add_bias_linear: bool
    untie_embeddings_and_output_weights: bool
    position_embedding_type: Literal["rope", "learned_absolute", "none"]
    num_experts: int | None
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_shared_expert_intermediate_size: int
    moe_layer_pattern: tuple[int, ...] = Field(description="1 where layer i is MoE, 0 where dense; all 0 for dense models.")
    multi_latent_attention: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    mtp_num_layers: int
    hybrid_layer_pattern: str | None = Field(None, description="Megatron hybrid layer symbols (M, *, -, E), one per layer; None = GPT model.")
    mamba_num_heads: int = Field(0, description="Mamba-2 heads (0 without Mamba layers).")
    mamba_head_dim: int = 0
    mamba_state_dim: int = 0
    mamba_num_groups: int = 0
    qk_layernorm: bool = False
    # Settings that change what the model computes but not its cost: None = Megatron's default.
    rotary_base: int | None = None
    rotary_percent: float | None = None
    rope_scaling_factor: float | None = None
    rope_scaling_type: Literal["llama3", "yarn"] | None = None
    norm_epsilon: float | None = None
    squared_relu: bool | None = None
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = None
    moe_router_pre_softmax: bool | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool | None = None
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] | None = None
    moe_aux_loss_coeff: float | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts) and any(self.moe_layer_pattern)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_layer_pattern is not None

    def _count(self, symbol: str) -> int:
        return self.hybrid_layer_pattern.count(symbol) if self.hybrid_layer_pattern else 0

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP: GPT layers that are not MoE, or a hybrid pattern's '-' layers."""
        return self._count("-") if self.is_hybrid else self.num_layers - self.num_moe_layers

    @property
    def num_attention_layers(self) -> int:
        """Decoder layers with self-attention (MTP layers not included)."""
        return self._count("*") if self.is_hybrid else self.num_layers

    @property
    def num_mamba_layers(self) -> int:
        return self._count("M")

    @property
    def mamba_d_inner(self) -> int:
        """Mamba-2 inner width: heads x head dim (MambaMixer d_inner)."""
        return mamba_d_inner(self)

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's _vocab_size_with_padding: round V up to a multiple of divisor * TP."""
        m = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // m) * m


Severity = Literal["error", "warning", "info"]


class Finding(BaseModel):
    """One validation result. Errors block a plan; warnings and info explain."""

    model_config = ConfigDict(frozen=True)

    code: str = Field(description="Stable identifier, e.g. 'heads_not_divisible_by_tp'.")
    severity: Severity
    fields: list[str] = Field(description="Dotted plan fields involved, e.g. ['parallelism.tensor_model_parallel_size'].")
    message: str
    fix: str | None = Field(None, description="A concrete change that resolves it.")


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Resolved parallel degrees of one plan (internal to the core)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    vp: int  # 1 when not interleaved
    world: int

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of expert parameters: world / (ETP * EP * PP)."""
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp


def parallel_dims(plan: Plan) -> ParallelDims:
    """Derive DP from the world size. Divisibility is the validators' job; this floors."""
    p = plan.parallelism
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    world = plan.cluster.num_gpus
    return ParallelDims(
        tp=tp,
        pp=pp,
        dp=max(1, world // (tp * pp * cp)),
        cp=cp,
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size or tp,
        vp=(p.virtual_pipeline_model_parallel_size or 1) if pp > 1 else 1,
        world=world,
    )


def layers_per_stage(num_layers: int, pp: int, first: int | None = None, last: int | None = None, *,
                     embedding: bool = False, loss: bool = False) -> list[int]:
    """Decoder layers on each PP stage (summed over its model chunks), as Megatron builds them
    (transformer_block.get_num_layers_to_build).

    Even split unless decoder_first/last_pipeline_num_layers are set; then the middle stages share the
    rest evenly. `embedding`/`loss` (--account-for-embedding/loss-in-pipeline-split) count the embedding
    and the output layer + loss as one layer each in an even split, taken off the first/last stage.
    Raises ValueError when the split is impossible (the validators report it with a fix). The interleaved
    (VP) divisibility rules are the validators' (stage_layers_not_divisible_by_vp).
    """
    if (embedding or loss) and (first is not None or last is not None):
        # TransformerConfig.__post_init__ raises this (ValueError).
        raise ValueError("decoder_first/last_pipeline_num_layers cannot be set together with "
                         "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split")
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        slots = num_layers + embedding + loss
        if slots % pp:
            what = "num_layers" + (" + 1 (embedding)" if embedding else "") + (" + 1 (loss)" if loss else "")
            raise ValueError(f"{what} ({slots}) is not divisible by pipeline_model_parallel_size ({pp})")
        out = [slots // pp] * pp
        out[0] -= embedding
        out[-1] -= loss
        return out
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle_stages == 0:
        if rest:
            raise ValueError(f"first + last stage layers must equal num_layers ({num_layers}) when PP = 2")
        return [first or 0, last or 0]
    if rest < 0 or rest % middle_stages:
        raise ValueError(f"{rest} remaining layers cannot be split evenly over {middle_stages} middle stages")
    per = rest // middle_stages
    return ([first] if first is not None else []) + [per] * middle_stages + ([last] if last is not None else [])


def with_changes(plan: Plan, section: str, **changes) -> Plan:
    """A copy of `plan` with fields of one section changed, validated like any input plan.

    (model_copy alone skips validation, so a proposed fix could carry an out-of-range value.)
    """
    part = getattr(plan, section).model_dump()
    return Plan.model_validate({**plan.model_dump(), section: {**part, **changes}})
