#!/bin/bash
# mcore-advisor 0.1.0 render_launch_script: Megatron-LM pretrain_gpt.py via torchrun, 1 node(s) x 8 GPU(s) (h100-sxm)
# rendered by: mcore-advisor render dense.json
# plan: llama3-8b | TP 2, PP 1 (no VP), CP 1, EP 1, ETP 2, DP 4 | seq 8192, micro-batch 1, global batch 128 | bf16
# predicted: <masked>
# plan JSON: {"implementation":{"expandable_segments":true},"model":{"name":"llama3-8b"},"parallelism":{"sequence_parallel":true,"tensor_model_parallel_size":2},"training":{"seq_length":8192}}
# run with: bash run.sh
# note: gradient_accumulation_fusion off in the script (no Apex)
# note: the predicted figures above are for the plan as these flags run it (the changes noted here), not for the plan JSON as given
set -euo pipefail

# ---- environment ----
# log lines reach the job log as they are printed, not when a buffer fills
export PYTHONUNBUFFERED=1
# TP/CP before Blackwell: one hardware queue keeps communication kernels in launch order so they overlap with the GEMMs; Megatron's validate_args asserts it
export CUDA_DEVICE_MAX_CONNECTIONS=1
# implementation.expandable_segments: growable segments, far less allocator fragmentation
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# Megatron sets NVTE_*_ATTN from --attention-backend and asserts that inherited values agree (language_module.py)
unset NVTE_FLASH_ATTN
unset NVTE_FUSED_ATTN
unset NVTE_UNFUSED_ATTN
# TORCH_NCCL_AVOID_RECORD_STREAMS not set: avoiding recordStream is PyTorch's default now; the variable is deprecated
# NCCL_* not set: fabric-specific (IB service level, NVLS, socket interface), so NCCL's own detection is the safe default; add site settings with extra_env

mkdir -p runs/mcore-llama3-8b

# ---- program arguments, each with the reason it is set ----
PROGRAM_ARGS=(
  # parallelism.tensor_model_parallel_size: TP splits every GEMM
  --tensor-model-parallel-size 2
  # parallelism.pipeline_model_parallel_size: PP stages
  --pipeline-model-parallel-size 1
  # parallelism.context_parallel_size: CP splits the sequence
  --context-parallel-size 1
  # parallelism.sequence_parallel: norm/dropout activations sharded over TP
  --sequence-parallel
  # parallelism.use_distributed_optimizer: Adam state sharded over DP (ZeRO-1)
  --use-distributed-optimizer
  # parallelism.overlap_grad_reduce: DP reduce-scatter overlapped with backward
  --overlap-grad-reduce
  # parallelism.overlap_param_gather: DP all-gather overlapped with forward
  --overlap-param-gather
  # model.num_layers: transformer blocks
  --num-layers 32
  # model.hidden_size: width h
  --hidden-size 4096
  # model.num_attention_heads
  --num-attention-heads 32
  # model.ffn_hidden_size: explicit, since Megatron's SwiGLU default (8h/3 rounded to 64) differs from 4h
  --ffn-hidden-size 14336
  # model.num_query_groups < heads: grouped-query attention
  --group-query-attention
  # model.num_query_groups: K/V heads
  --num-query-groups 8
  # model.swiglu: gated SiLU MLP (3 matrices)
  --swiglu
  # model.normalization (Megatron's default is LayerNorm)
  --normalization RMSNorm
  # model.add_bias_linear false: no biases in linear layers
  --disable-bias-linear
  # model.untie_embeddings_and_output_weights: separate input embedding and output layer
  --untie-embeddings-and-output-weights
  # model.position_embedding_type (Megatron's default is learned_absolute)
  --position-embedding-type rope
  # required by Megatron; max(training.seq_length, model.seq_length_max)
  --max-position-embeddings 8192
  # model.rotary_base: RoPE base (Megatron's default 10000)
  --rotary-base 500000
  # model.norm_epsilon (Megatron's default 1e-5)
  --norm-epsilon 1e-05
  # training.attention_dropout (Megatron's default is 0.1)
  --attention-dropout 0
  # training.hidden_dropout (Megatron's default is 0.1)
  --hidden-dropout 0
  # bf16 parameters and activations (also the base precision under FP8)
  --bf16
  # no Apex: the fused wgrad accumulation needs Apex's fused_weight_gradient_mlp_cuda (Megatron raises at model build otherwise)
  --no-gradient-accumulation-fusion
  # training.seq_length
  --seq-length 8192
  # training.micro_batch_size: samples per forward per replica
  --micro-batch-size 1
  # training.global_batch_size: samples per optimizer step
  --global-batch-size 128
  # train_iters: optimizer steps to run
  --train-iters 50
  # no data_path: synthetic tokens (enough for throughput and memory)
  --mock-data
  # mock data needs no real tokenizer
  --tokenizer-type NullTokenizer
  # model.vocab_size, so the embedding matches the plan
  --vocab-size 128256
  # peak learning rate (render option lr)
  --lr 0.0003
  # cosine floor at 10% of the peak (Llama 2 recipe)
  --min-lr 3e-05
  # Llama 2 recipe
  --lr-decay-style cosine
  # warm-up as a fraction of train_iters
  --lr-warmup-fraction 0.01
  # Llama 2 recipe (Megatron's default is 0.01)
  --weight-decay 0.1
  # Llama 2 recipe (Megatron's default is 0.999)
  --adam-beta2 0.95
  # gradient clipping at norm 1.0 (Megatron's default, kept explicit)
  --clip-grad 1
  # no eval_interval: Megatron needs one to size the validation set
  --eval-interval 50
  # no eval_interval: skip validation (Megatron would run 100 batches at the end)
  --eval-iters 0
  # log_interval: steps between log lines
  --log-interval 1
  # print TFLOP/s per GPU in each log line (what check_mfu reads)
  --log-throughput
)

exec torchrun --standalone --nnodes 1 --nproc_per_node 8 /opt/megatron-lm/pretrain_gpt.py "${PROGRAM_ARGS[@]}"
