"""The profile job's GPT for `megatron.training.pretrain`: model provider, forward step, mock data.

Written from megatron-core 0.19.2's public API (megatron/training/argument_utils.py,
megatron/core/models/gpt/gpt_layer_specs.py, megatron/core/datasets, megatron/core/utils.py), so a
profile job builds the model Megatron-LM's pretrain_gpt.py builds from the same arguments:
- the layer spec follows Megatron's choice (megatron/training/models/gpt.py `default_layer_spec`):
  the per-layer decoder block spec for MoE models, else the Transformer Engine or local layer spec
  (`--transformer-impl`), with `--attention-backend local` swapping in Megatron's own
  DotProductAttention; MTP layers get `get_gpt_mtp_block_spec`;
- `core_transformer_config_from_args` turns the parsed arguments into the TransformerConfig;
- data: `MockGPTDataset` through `BlendedMegatronDatasetBuilder` (`--mock-data`), batches moved to
  the GPU on tensor-parallel rank 0 and broadcast with `get_batch_on_this_tp_rank`, then split for
  context parallelism with `get_batch_on_this_cp_rank`;
- loss: the masked sum over tokens with the token count, checked for NaN/Inf through the rerun
  state machine when `--check-for-nan-in-loss-and-grad` is on (Megatron's default), as pretrain_gpt.

With `--fake-process-group` no broadcast carries data, so every first/last-stage rank loads its
own mock batch instead of receiving tensor-parallel rank 0's (the values differ, the shapes and
hence the memory do not).
"""

from __future__ import annotations

import functools

import torch


def _args():
    from megatron.training import get_args

    return get_args()


def _fake_pg() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_backend() == "fake"


# --------------------------------------------------------------------------- model

def _layer_spec(config, args, vp_stage):
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                                qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            None, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention, qk_l2_norm=args.qk_l2_norm)
    else:
        spec = specs.get_gpt_layer_local_spec(None, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
                                              normalization=args.normalization, qk_l2_norm=args.qk_l2_norm)
    if config.attention_backend == AttnBackend.local:
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    return spec


def _mtp_spec(config, args, layer_spec, vp_stage):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if not args.mtp_num_layers:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    # MTP layers copy the last decoder layer's kind (dense or MoE).
    last = specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te, normalization=args.normalization,
                                             qk_l2_norm=args.qk_l2_norm)[-1]
    return specs.get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te, vp_stage=vp_stage)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """`model_provider_func` for megatron.training.get_model: one GPTModel stage (or chunk)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.utils import start_memory_history_recording
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    args = _args()
    if args.record_memory_history:
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        # Before the first parameter exists, so the snapshot shows every allocation.
        start_memory_history_recording(pretrain_cfg_container_from_args(args).profiling)
    config = config or core_transformer_config_from_args(args)
    spec = _layer_spec(config, args, vp_stage)
    vocab = args.padded_vocab_size or calculate_padded_vocab_size(
        args.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    kwargs = dict(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=_mtp_spec(config, args, spec, vp_stage),
        vp_stage=vp_stage,
    )
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    return GPTModel(**kwargs)


# --------------------------------------------------------------------------- one micro-batch

#: get_batch's order (pretrain_gpt's): what forward_step unpacks
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch (tokens, labels, loss_mask, attention_mask, position_ids); all None
    on pipeline stages that neither embed nor compute the loss."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = _args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    tp_rank = mpu.get_tensor_model_parallel_rank()
    fake = _fake_pg()
    batch: dict = {}
    if tp_rank == 0 or fake:
        raw = next(data_iterator)
        batch = {k: (raw[k].cuda(non_blocking=True) if raw.get(k) is not None else None) for k in _BATCH_KEYS}
    if not fake:
        ignore_virtual = vp_stage is None
        batch = get_batch_on_this_tp_rank(
            batch,
            has_cu_seqlens=False,
            is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(),
            cp_size=args.context_parallel_size,
            tp_rank=tp_rank,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            mtp_on_this_rank=mtp_on_this_rank(mtp_num_layers=args.mtp_num_layers, ignore_virtual=ignore_virtual,
                                              vp_stage=vp_stage),
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
            is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(k) for k in _BATCH_KEYS)


def loss_func(loss_mask, output_tensor, check_nan: bool = False):
    """(summed masked loss, token count, {'lm loss': [sum, count]}), Megatron's loss contract.

    The schedule divides the returned loss in place by the token count and the number of
    micro-batches (schedules.forward_step_calc_loss), hence the detached clone for reporting.
    `check_nan` validates the loss through the rerun state machine (`--check-for-nan-in-loss-and-grad`,
    on by default), which reads it back to the host; off, nothing here waits for the GPU.
    """
    losses = output_tensor.view(-1).float()
    loss = torch.sum(losses * loss_mask.view(-1).float())
    num_tokens = loss_mask.sum().detach().to(torch.int)
    report = torch.cat([loss.detach().clone().view(1), num_tokens.float().view(1)])
    if check_nan:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        rsm = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rsm.validate_result(result=loss, rejection_func=reject, message=f"found {what} in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """`forward_step_func` for megatron.training: one micro-batch through one model chunk. The combined 1F1B
    schedule (--overlap-moe-expert-parallel-comm) asks for the chunk's schedule plan instead of its output
    (pipeline_parallel/combined_1f1b.py: GPTModel.build_schedule_plan on the same inputs)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    args = _args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, functools.partial(loss_func, loss_mask, check_nan=bool(args.check_for_nan_in_loss_and_grad))


# --------------------------------------------------------------------------- data

def datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """Megatron's mock GPT data (`--mock-data`), built where batches are read."""
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_tokenizer
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = _args()
    if not args.mock_data:
        raise ValueError("the profile job reads Megatron's mock data only; render the plan without data_path (--mock-data)")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split=args.split,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    fake = _fake_pg()

    def built_here():
        return is_first_or_last_pipeline_stage(vp_stage) and (fake or mpu.get_tensor_model_parallel_rank() == 0)

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_valid_test_num_samples, built_here, config).build()


# Every rank builds (or skips) its own datasets; Megatron then broadcasts only the do-train flags.
datasets_provider.is_distributed = True
