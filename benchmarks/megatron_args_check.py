"""Check rendered Megatron-LM arguments with Megatron-LM's own parser and validator.

Each file in benchmarks/gpu/rendered_args/*.txt holds the pretrain_gpt.py argv (pretrain_hybrid.py for
a hybrid Mamba model) that render_launch_script produced for one representative plan (one token per
line; '#' header lines give the entry script, the world size, the GPU architecture and the environment
the script sets). For every file this script runs, in a fresh process:

  1. parse     megatron.training.arguments.parse_args(ignore_unknown_args=False) with sys.argv set:
               every flag name and value must exist and type-check in Megatron-LM;
  2. validate  validate_args(args) with WORLD_SIZE/RANK and the script's environment (e.g.
               CUDA_DEVICE_MAX_CONNECTIONS=1): Megatron's cross-flag assertions;
  3. config    core_transformer_config_from_args(args): TransformerConfig.__post_init__ checks; for
               pretrain_hybrid.py also hybrid_config_from_args(args), the HybridModelConfig that script
               builds (its --spec module imported, the pattern's layer symbols checked).

and prints one line per file: OK, or FAIL with the stage and Megatron's message.

Device queries are pinned, not faked wholesale: validate_args asks get_device_arch_version() (it
reads cuda:0) to choose the CUDA_DEVICE_MAX_CONNECTIONS rule, so it is patched to the architecture
the plan targets (9 = Hopper, 10 = Blackwell) whatever GPU runs the check; on a machine without CUDA,
torch.cuda.get_device_capability() (asked for --moe-grouped-gemm) returns that same major version.
Nothing else is patched and no GPU memory is touched.

How to run (Python 3.12, torch installed, megatron-core 0.19.2 and its needs on PYTHONPATH, e.g.
`pip install --no-deps --target /tmp/site megatron-core==0.19.2`; do NOT put mcore-advisor on the path):

    PYTHONPATH=/tmp/site python benchmarks/megatron_args_check.py | tee benchmarks/results/megatron_args_check.txt

Exit status 0 when every file passes. `--generate` (run in the project venv instead) rewrites the
.txt files from the representative plans in REPRESENTATIVE below and recommend_parallelism's top
plans in RECOMMENDED. `--batch FILE...` checks several files in one process (the test path:
tests/rendering/test_render_catalog.py renders every catalog model and checks them this way).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

ARGS_DIR = Path(__file__).resolve().parent / "gpu" / "rendered_args"


# ---- reading a rendered-args file ---------------------------------------------------------------

def read_args_file(path: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """(header fields, env to set as 'NAME=value' / names to unset, argv tokens)."""
    meta: dict[str, str] = {}
    env_set: list[str] = []
    env_unset: list[str] = []
    argv: list[str] = []
    for line in path.read_text().splitlines():
        if not argv and line.startswith("#"):
            key, _, value = line[1:].strip().partition(" ")
            if key == "env":
                env_set.append(value)
            elif key == "unset":
                env_unset.append(value)
            else:
                meta[key] = value
        elif line:
            argv.append(line)
    meta["unset"] = " ".join(env_unset)
    return meta, env_set, argv


# ---- checking argv sets ---------------------------------------------------------------------------

def _pin_device(arch: int) -> None:
    import megatron.training.arguments as margs
    import torch

    margs.get_device_arch_version = lambda: arch
    if not torch.cuda.is_available():
        torch.cuda.get_device_capability = lambda *a, **k: (arch, 0)


def check_file(path: Path) -> int:
    """Parse, validate and build the TransformerConfig of one rendered-args file; print OK or FAIL."""
    meta, env_set, argv = read_args_file(path)
    for name in meta["unset"].split():
        os.environ.pop(name, None)
    for item in env_set:
        name, _, value = item.partition("=")
        os.environ[name] = value
    os.environ["WORLD_SIZE"] = meta.get("world_size", "1")
    os.environ["RANK"] = "0"
    arch = int(meta.get("arch", "9"))
    entry = meta.get("entry", "pretrain_gpt.py")
    sys.argv = [entry, *argv]

    import megatron.training.arguments as margs
    from megatron.training.arguments import parse_args, validate_args

    _pin_device(arch)
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    notes: list[str] = []
    stage = "parse"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = parse_args(ignore_unknown_args=False)
            stage = "validate"
            validate_args(args)
            stage = "config"
            if not te_installed and args.apply_rope_fusion:
                # Without TE, TransformerConfig rejects rope fusion outright; the flag set is what is
                # checked here, not this machine's kernels.
                args.apply_rope_fusion = False
                notes.append("no TE here: config stage run with rope fusion off")
            margs.core_transformer_config_from_args(args)
            if entry == "pretrain_hybrid.py":
                from megatron.core.models.hybrid.hybrid_layer_allocation import validate_segment_layers
                from megatron.training.argument_utils import hybrid_config_from_args

                hybrid_config_from_args(args)
                for segment in args.hybrid_layer_pattern.split("/")[0].split("|"):
                    validate_segment_layers(segment)
    except SystemExit as exc:  # argparse reports bad flags by printing usage and exiting
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        print(f"FAIL {path.name} [{stage}] exit {exc.code}: {lines[-1] if lines else ''}")
        return 1
    except Exception as exc:  # noqa: BLE001 - report whatever Megatron raised, with where
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron" in f.filename]
        where = f" @ {frames[-1].filename.rsplit('site-packages/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
        print(f"FAIL {path.name} [{stage}] {type(exc).__name__}: {exc}{where}")
        return 1
    print(f"OK   {path.name} ({entry}, world {meta.get('world_size')}, arch {arch}, dp {args.data_parallel_size}, "
          f"vp {args.virtual_pipeline_model_parallel_size}, {len(argv)} tokens)" + "".join(f"; {n}" for n in notes))
    return 0


def check_batch(paths: list[Path]) -> int:
    """Several files in this one process (one megatron import instead of one per file): for tests.
    Each file sets its own environment; parse_args builds a fresh parser and namespace every time."""
    saved = dict(os.environ)
    failed = 0
    for path in paths:
        try:
            failed += check_file(path)
        finally:
            os.environ.clear()
            os.environ.update(saved)
    print(f"{len(paths) - failed}/{len(paths)} passed")
    return 1 if failed else 0


def check_all() -> int:
    files = sorted(ARGS_DIR.glob("*.txt"))
    if not files:
        print(f"no rendered args in {ARGS_DIR}")
        return 2
    import platform

    probe = ("import torch, megatron.core as m; print(torch.__version__, m.__version__, "
             "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')")
    ver = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    print(f"python {platform.python_version()} | torch, megatron-core, device: {ver.stdout.strip() or ver.stderr.strip()[-200:]}")
    failed = 0
    for f in files:
        r = subprocess.run([sys.executable, __file__, "--one", str(f)], capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("OK", "FAIL"))]
        if lines:
            print(lines[-1])
        else:
            print(f"FAIL {f.name} [crash] exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}")
        failed += r.returncode != 0 or not lines
    print(f"{len(files) - failed}/{len(files)} passed")
    return 1 if failed else 0


# ---- generating the files (project venv; the only part that imports mcore_advisor) ----------------

# name -> (plan, render options). Chosen to cover the flag families: dense/GQA, PP+VP, FP8,
# TP comm overlap, MoE (EP, grouped GEMM, shared expert, layer pattern), MLA + MTP, CP with full
# recompute, real data + checkpoints + torch profiler, local spec, FSDP2, Blackwell MXFP8 + nsys,
# hybrid Mamba models (pretrain_hybrid.py).
REPRESENTATIVE: dict[str, tuple[dict, dict]] = {
    "01_llama3-8b_tp2_sp": (
        {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 8192, "global_batch_size": 128},
         "parallelism": {"tensor_model_parallel_size": 2, "sequence_parallel": True}},
        {"launcher": "torchrun"}),
    "02_llama3-70b_tp8_pp4_vp5_fp8_tpoverlap": (
        {"model": {"name": "llama3-70b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
         "training": {"seq_length": 8192, "global_batch_size": 128, "precision": "fp8", "fp8_param_gather": True},
         "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
                         "virtual_pipeline_model_parallel_size": 5, "sequence_parallel": True, "tp_comm_overlap": True}},
        {"launcher": "slurm", "container_image": "nvcr.io#nvidia/pytorch:25.01-py3"}),
    "03_mixtral-8x7b_ep8_alltoall": (
        {"model": {"name": "mixtral-8x7b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
         "training": {"seq_length": 4096, "global_batch_size": 256},
         "parallelism": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8,
                         "expert_tensor_parallel_size": 1, "sequence_parallel": True}},
        {"launcher": "slurm"}),
    "04_deepseek-v3_mla_moe_mtp_uneven_pp": (
        {"model": {"name": "deepseek-v3"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 1024},
         "training": {"seq_length": 4096, "global_batch_size": 1024},
         "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 8,
                         "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 6,
                         "expert_model_parallel_size": 64, "expert_tensor_parallel_size": 1,
                         "sequence_parallel": True, "recompute_granularity": "selective",
                         "recompute_modules": ["mla_up_proj", "moe_act", "layernorm"]}},
        {"launcher": "slurm", "allow_invalid": True}),
    "05_llama3-8b_cp4_fullrecompute_data_ckpt_torchprofiler": (
        {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
         "training": {"seq_length": 32768, "global_batch_size": 32},
         "parallelism": {"tensor_model_parallel_size": 2, "context_parallel_size": 4, "sequence_parallel": True,
                         "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}},
        {"launcher": "slurm", "data_path": ["0.7", "/data/web text_document", "0.3", "/data/code_text_document"],
         "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "meta-llama/Meta-Llama-3-8B",
         "save_dir": "/ckpt/llama3 8b", "load_dir": "/ckpt/llama3 8b", "save_interval": 500, "train_iters": 1000,
         "eval_interval": 200, "profile": True, "profile_step_start": 5, "profile_step_end": 7}),
    "06_gpt3-1.3b_local_selective_bf16_grads": (
        {"model": {"name": "gpt3-1.3b"}, "cluster": {"gpu": "a100-80gb", "num_gpus": 8},
         "training": {"seq_length": 2048, "global_batch_size": 512, "micro_batch_size": 4},
         "parallelism": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
         "implementation": {"transformer_impl": "local", "attention_backend": "local", "grad_reduce_in_fp32": False,
                            "cross_entropy_loss_fusion": False}},
        {"launcher": "torchrun", "apex_installed": True}),
    "07_llama3-8b_fsdp2": (
        {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 8192, "global_batch_size": 64},
         "parallelism": {"use_distributed_optimizer": False, "overlap_param_gather": False},
         "implementation": {"use_torch_fsdp2": True}},
        {"launcher": "torchrun", "apex_installed": True}),
    "08_llama3-8b_b200_mxfp8_nsys": (
        {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "b200", "num_gpus": 8},
         "training": {"seq_length": 8192, "global_batch_size": 128, "precision": "fp8", "fp8_recipe": "mxfp8",
                      "fp8_format": "e4m3", "fp8_param_gather": True},
         "parallelism": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
         "implementation": {"manual_gc": True, "manual_gc_interval": 10}},
        {"launcher": "torchrun", "profile": True, "nsys": True}),
    # Model settings the catalog carries (issue 12): RoPE base and Llama 3.1 scaling, norm epsilon, q/k norms,
    # routers (sigmoid, expert bias, group-limited routing, aux losses), MLA's YaRN factor, squared ReLU with
    # partial RoPE, and a dropout > 0 plan.
    "09_llama3.1-70b_rope_scaling_tp8_pp2": (
        {"model": {"name": "llama3.1-70b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 32},
         "training": {"seq_length": 8192, "global_batch_size": 64},
         "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 2, "sequence_parallel": True}},
        {"launcher": "slurm", "allow_invalid": True}),
    "10_qwen3-30b-a3b_qk_layernorm_ep8": (
        {"model": {"name": "qwen3-30b-a3b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 4096, "global_batch_size": 64},
         "parallelism": {"expert_model_parallel_size": 8}},
        {"launcher": "torchrun", "allow_invalid": True}),
    "11_deepseek-v2-lite_mla_yarn_ep8": (
        {"model": {"name": "deepseek-v2-lite"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 4096, "global_batch_size": 64},
         "parallelism": {"expert_model_parallel_size": 8}},
        {"launcher": "torchrun", "allow_invalid": True}),
    "12_nemotron4-340b_squared_relu_dropout": (
        {"model": {"name": "nemotron4-340b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 768},
         "training": {"seq_length": 4096, "global_batch_size": 768, "attention_dropout": 0.1, "hidden_dropout": 0.1},
         "parallelism": {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 12,
                         "virtual_pipeline_model_parallel_size": 8, "sequence_parallel": True}},
        {"launcher": "slurm", "allow_invalid": True}),
    # Hybrid Mamba models (issue 17): pretrain_hybrid.py with --hybrid-layer-pattern, the Mamba-2 shape and
    # --spec; an uneven pipeline split written as the pattern's '|' stages; a hybrid MoE model with EP.
    "13_nemotron-h-8b_hybrid_tp2_pp2_uneven": (
        {"model": {"name": "nemotron-h-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 16},
         "training": {"seq_length": 8192, "global_batch_size": 64},
         "parallelism": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                         "decoder_first_pipeline_num_layers": 24, "sequence_parallel": True}},
        {"launcher": "slurm"}),
    "14_nemotron-3-nano_hybrid_moe_ep8": (
        {"model": {"name": "nemotron-3-nano"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 8192, "global_batch_size": 64},
         "parallelism": {"expert_model_parallel_size": 8}},
        {"launcher": "torchrun", "allow_invalid": True}),
    "15_qwen3-30b-a3b_te_graphs_router_ep8": (
        {"model": {"name": "qwen3-30b-a3b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 4096, "global_batch_size": 128},
         "parallelism": {"expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1},
         "implementation": {"moe_token_dispatcher_type": "alltoall", "expandable_segments": True,
                            "cuda_graph_impl": "transformer_engine",
                            "cuda_graph_modules": ["attn", "moe_router", "moe_preprocess"]}},
        {"launcher": "torchrun"}),
    "16_llama3-8b_local_graphs_layer": (
        {"model": {"name": "llama3-8b"}, "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
         "training": {"seq_length": 8192, "global_batch_size": 64},
         "implementation": {"cuda_graph_impl": "local"}},
        {"launcher": "torchrun"}),
}

# name -> (model, GPUs, seq_length): the top plan of recommend_parallelism for it, rendered as the CLI would.
# The issue-12 report saw every one of these crash before its first step; they must stay runnable.
RECOMMENDED: dict[str, tuple[str, int, int]] = {
    "r1_recommend_llama3-70b_64": ("llama3-70b", 64, 8192),
    "r2_recommend_llama3.1-405b_1024": ("llama3.1-405b", 1024, 8192),
    "r3_recommend_mixtral-8x22b_256": ("mixtral-8x22b", 256, 4096),
    "r4_recommend_deepseek-v3_1024": ("deepseek-v3", 1024, 4096),
}

_ARCH_MAJOR = {"ampere": 8, "hopper": 9, "blackwell": 10}


def args_file_text(name: str, plan, opts: dict) -> str:
    """The rendered-args file of one plan: header lines (world size, architecture, environment) + argv."""
    from mcore_advisor.knowledge.hardware import gpu
    from mcore_advisor.tools.render import RenderRequest, render_launch_script

    art = render_launch_script(RenderRequest(plan=plan, **opts))
    lines = [
        f"# name {name}",
        f"# entry {Path(art.program[0]).name}",
        f"# world_size {plan.cluster.num_gpus}",
        f"# arch {_ARCH_MAJOR[gpu(plan.cluster.gpu).architecture]}",
        *(f"# env {e.name}={e.value}" for e in art.env if e.action == "set"),
        *(f"# unset {e.name}" for e in art.env if e.action == "unset"),
        *art.megatron_args,
    ]
    return "\n".join(lines) + "\n"


def recommended_plan(model: str, num_gpus: int, seq_length: int):
    from mcore_advisor.tools.recommend import recommend_parallelism, request_from_options

    req = request_from_options(model=model, gpu="h100-sxm", num_gpus=num_gpus, seq_length=seq_length, top_k=1, what_if=False)
    return recommend_parallelism(req).plans[0].plan


def rendered_args_files() -> dict[str, str]:
    """File name -> text of every rendered-args file, from REPRESENTATIVE and RECOMMENDED through render_launch_script."""
    from mcore_advisor.schemas import Plan

    files = {f"{name}.txt": args_file_text(name, Plan.model_validate(plan_dict), opts)
             for name, (plan_dict, opts) in REPRESENTATIVE.items()}
    for name, (model, n, s) in RECOMMENDED.items():
        plan = recommended_plan(model, n, s)
        files[f"{name}.txt"] = args_file_text(name, plan, {"launcher": "slurm" if n > 8 else "torchrun"})
    return files


def generate() -> None:
    ARGS_DIR.mkdir(parents=True, exist_ok=True)
    for old in ARGS_DIR.glob("*.txt"):
        old.unlink()
    for name, text in rendered_args_files().items():
        (ARGS_DIR / name).write_text(text)
        print(f"wrote {name} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate"]:
        generate()
    elif sys.argv[1:2] == ["--one"]:
        sys.exit(check_file(Path(sys.argv[2])))
    elif sys.argv[1:2] == ["--batch"]:
        sys.exit(check_batch([Path(a) for a in sys.argv[2:]]))
    else:
        sys.exit(check_all())
