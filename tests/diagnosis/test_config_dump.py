"""A Plan from a Bridge / NeMo config dump: the layout, recompute, FP8, dropout and batch fields are
read by the one Plan <-> Megatron table (knowledge/megatron_flags.py) after the configs' own names are
mapped onto Megatron-LM's argument names."""

from __future__ import annotations

from mcore_advisor.diagnosis.config_dump import plan_from_config_dump


def _plan(values: dict[str, str], model: str = "qwen3-30b-a3b"):
    plan, _ = plan_from_config_dump(values, [], gpu=None, num_gpus=64, model=model, seq_length=None, world_size=None)
    return plan


def test_transformer_config_names_reach_the_plan_through_the_table():
    p = _plan({"model.tensor_model_parallel_size": "4", "model.pipeline_model_parallel_size": "4",
               "model.virtual_pipeline_model_parallel_size": "2", "model.num_moe_experts": "128",
               "model.expert_model_parallel_size": "8", "model.recompute_granularity": "full",
               "model.recompute_method": "block", "model.recompute_num_layers": "2", "model.fp8": "e4m3",
               "model.fp8_recipe": "tensorwise", "model.hidden_dropout": "0.1", "model.attention_dropout": "${oc.env:X}",
               "ddp.overlap_grad_reduce": "False", "dataset.sequence_length": "4096", "train.global_batch_size": "512"})
    par, t = p.parallelism, p.training
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size,
            par.expert_model_parallel_size) == (4, 4, 2, 8)
    assert (par.recompute_granularity, par.recompute_method, par.recompute_num_layers) == ("full", "block", 2)
    assert par.overlap_grad_reduce is False
    assert (t.precision, t.fp8_format, t.fp8_recipe) == ("fp8", "e4m3", "tensorwise")
    assert (t.hidden_dropout, t.attention_dropout) == (0.1, 0.0)  # an unresolved interpolation stays at the default
    assert (t.seq_length, t.global_batch_size) == (4096, 512)


def test_nemo1_yaml_names_and_fp8_off_are_read():
    p = _plan({"model.tensor_model_parallel_size": "2", "model.activations_checkpoint_granularity": "selective",
               "model.fp8": "False", "model.encoder_seq_length": "8192", "model.micro_batch_size": "2",
               "model.global_batch_size": "64", "model.sequence_parallel": "True"}, model="llama3-8b")
    assert p.parallelism.recompute_granularity == "selective" and p.parallelism.sequence_parallel is True
    assert p.training.precision == "bf16" and (p.training.seq_length, p.training.micro_batch_size) == (8192, 2)


def test_a_single_virtual_stage_is_no_interleaving():
    p = _plan({"model.pipeline_model_parallel_size": "4", "model.virtual_pipeline_model_parallel_size": "1",
               "model.recompute_num_layers": "4"}, model="llama3-8b")
    assert p.parallelism.virtual_pipeline_model_parallel_size is None and p.parallelism.recompute_num_layers is None
