"""entry/argv.py: the rendered argv adapted to the machine (recorded) and shrunk for the CPU CI."""

from __future__ import annotations

import pytest

from mcore_advisor.launcher.entry import argv as A
from mcore_advisor.launcher.spec import megatron_argv
from mcore_advisor.schemas import Plan

GPU_TE = A.Machine(cuda=True, transformer_engine=True, apex=False, fused_softmax=False)
CPU = A.Machine(cuda=False, transformer_engine=False, apex=False, fused_softmax=False)


def _argv(**kw) -> list[str]:
    plan = Plan(**({"model": {"name": "mixtral-8x7b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
                    "training": {"seq_length": 4096, "global_batch_size": 256},
                    "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                                    "virtual_pipeline_model_parallel_size": 2, "expert_model_parallel_size": 8,
                                    "expert_tensor_parallel_size": 1, "sequence_parallel": True}} | kw))
    return megatron_argv(plan, train_iters=5, profile_steps=(2, 3), seed=1234)


def test_flag_groups_read_and_edit_values_without_touching_other_flags():
    argv = ["--a", "1", "--b", "--c", "x", "y"]
    assert A.groups(argv) == [["--a", "1"], ["--b"], ["--c", "x", "y"]]
    assert (A.values(argv, "--c"), A.values(argv, "--b"), A.values(argv, "--z")) == (["x", "y"], [], None)
    assert A.put(argv, "--a", 2) == ["--a", "2", "--b", "--c", "x", "y"]
    assert A.put(argv, "--d", "v") == [*argv, "--d", "v"]
    assert A.drop(argv, "--c") == ["--a", "1", "--b"]


def test_a_gpu_with_te_keeps_the_rendered_argv_but_the_output_paths():
    argv = _argv()
    out, adj = A.for_machine(argv, GPU_TE, "/jobs/x")
    assert A.value(out, "--tensorboard-dir") == "/jobs/x/tensorboard"
    # no fused-softmax build: Megatron would import the kernels at the first unfused attention
    assert [a.flag for a in adj] == ["--tensorboard-dir", "--no-masked-softmax-fusion"]
    assert A.drop(A.drop(out, "--tensorboard-dir"), "--no-masked-softmax-fusion") == A.drop(argv, "--tensorboard-dir")


def test_without_te_the_te_choices_fall_back_to_megatrons_local_ones_and_each_change_says_why():
    out, adj = A.for_machine(_argv(implementation={"attention_backend": "flash"}), CPU, "/o")
    by = {a.flag: a for a in adj}
    assert A.value(out, "--transformer-impl") == "local" and A.values(out, "--no-rope-fusion") == []
    for flag in ("--attention-backend", "--moe-grouped-gemm"):
        assert A.values(out, flag) is None and by[flag].action == "dropped"
    assert A.value(out, "--distributed-backend") == "gloo"
    assert A.values(out, "--no-persist-layer-norm") == []  # torch norms have no persistent kernel (no Apex)
    assert all(a.why for a in adj)
    snap = A.for_machine([*_argv(), "--record-memory-history"], CPU, "/o")[0]
    assert A.values(snap, "--record-memory-history") is None and A.values(snap, "--memory-snapshot-path") is None
    gpu = A.for_machine([*_argv(), "--record-memory-history"], GPU_TE, "/o")[0]
    assert A.value(gpu, "--memory-snapshot-path") == "/o/memory_snapshot.pickle"


def test_fp8_without_transformer_engine_is_refused_naming_the_plan_field():
    with pytest.raises(ValueError, match=r"training\.precision='fp8' needs Transformer Engine"):
        A.for_machine(_argv(training={"seq_length": 4096, "global_batch_size": 256, "precision": "fp8"}), CPU, "/o")


def test_mla_on_a_gpu_without_transformer_engine_is_refused_and_the_cpu_ci_keeps_it():
    gpu_no_te = A.Machine(cuda=True, transformer_engine=False, apex=False, fused_softmax=False)
    plan = Plan(model={"name": "deepseek-v2-lite"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
                training={"seq_length": 4096, "global_batch_size": 64}, parallelism={"expert_model_parallel_size": 8})
    argv = megatron_argv(plan, train_iters=1, profile_steps=None, seed=1234)
    with pytest.raises(ValueError, match=r"model\.multi_latent_attention needs Transformer Engine"):
        A.for_machine(argv, gpu_no_te, "/o")
    cpu_argv, _ = A.for_machine(argv, CPU, "/o")
    assert A.values(cpu_argv, "--multi-latent-attention") == []
    te_argv, _ = A.for_machine(argv, GPU_TE, "/o")
    assert A.values(te_argv, "--multi-latent-attention") == []


def test_shrink_fits_the_layout_to_two_processes_and_keeps_every_non_size_flag():
    argv = _argv()
    small, adj = A.shrink(argv, 2)
    # TP2 fills both processes: PP (and with it VP) becomes 1, experts fit ETP1 x EP2
    assert [A.value(small, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                         "--expert-tensor-parallel-size", "--expert-model-parallel-size")] == ["2", "1", "1", "2"]
    assert A.values(small, "--num-virtual-stages-per-pipeline-rank") is None
    assert [A.value(small, f) for f in ("--num-layers", "--hidden-size", "--num-experts", "--seq-length")] == ["2", "64", "4", "64"]
    # one data-parallel rank x 2 micro-batches of 1
    assert A.value(small, "--global-batch-size") == "2"
    changed = {a.flag for a in adj}
    kept = [g for g in A.groups(argv) if g[0] not in changed]
    assert kept and all(A.values(small, g[0]) == g[1:] for g in kept)
    assert {"--moe-grouped-gemm", "--sequence-parallel"} - {g[0] for g in A.groups(small)} == {"--moe-grouped-gemm"}


def test_shrink_keeps_an_uneven_pipeline_split_by_fitting_pp_first():
    plan = {"model": {"name": "deepseek-v3"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 1024},
            "training": {"seq_length": 4096, "global_batch_size": 1024},
            "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 8,
                            "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 6,
                            "expert_model_parallel_size": 64, "expert_tensor_parallel_size": 1, "sequence_parallel": True}}
    argv = megatron_argv(Plan(**plan), train_iters=1, profile_steps=None, seed=1234)
    small, _ = A.shrink(argv, 2)
    assert [A.value(small, f) for f in ("--pipeline-model-parallel-size", "--tensor-model-parallel-size",
                                         "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                                         "--num-layers")] == ["2", "1", "1", "1", "2"]
    # DeepSeek-V3's first 3 dense layers shrink to 1 dense + 1 MoE; MLA and MTP stay
    assert A.value(small, "--moe-layer-freq") == "[0,1]"
    assert A.values(small, "--multi-latent-attention") == [] and A.value(small, "--mtp-num-layers") == "1"


def test_shrink_keeps_megatrons_embedding_and_loss_aware_split_divisible():
    # DeepSeek-V2-Lite's recommended layout: 27 layers, PP2 x VP7, the loss counted as a layer (28 = 2 x 7 x 2)
    plan = {"model": {"name": "deepseek-v2-lite"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "training": {"seq_length": 4096, "global_batch_size": 64},
            "parallelism": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 7,
                            "account_for_loss_in_pipeline_split": True, "expert_model_parallel_size": 2}}
    small, _ = A.shrink(megatron_argv(Plan(**plan), train_iters=1, profile_steps=None, seed=1234), 2)
    pp, vp = int(A.value(small, "--pipeline-model-parallel-size")), int(A.value(small, "--num-virtual-stages-per-pipeline-rank"))
    layers = int(A.value(small, "--num-layers"))
    # TransformerConfig: (num_layers + 1) divides by PP, and the per-rank count by VP, with 2 per chunk
    assert (pp, vp) == (2, 7) and layers == 27 and (layers + 1) % (pp * vp) == 0
