"""RenderRequest: what render_launch_script renders (the plan, target, launcher and run options).

Its own module so that the renderer and the Megatron argument table both import it without
importing each other. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mcore_advisor.schemas import Plan

Target = Literal["megatron", "profile"]
Launcher = Literal["torchrun", "slurm"]
TokenizerType = Literal[
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer",
]


class RenderRequest(BaseModel):
    """What to render: a plan, what to run (target), how to start it (launcher), and run options.

    Flat on purpose, so a CLI maps one option to one field: `mcore-advisor render plan.json
    --launcher slurm --nodes 8` is `RenderRequest(plan=..., launcher="slurm", nodes=8)`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    plan: Plan = Field(description="The training plan (its world size is cluster.num_gpus).")
    target: Target = Field("megatron", description="'megatron': Megatron-LM pretrain_gpt.py (pretrain_hybrid.py for a hybrid Mamba model); 'profile': mcore-advisor's profile entry (python -m mcore_advisor.launcher.entry.profile; GPT models only).")
    launcher: Launcher = Field("torchrun", description="'torchrun': single-node script; 'slurm': sbatch script, one torch.distributed.run per node via srun.")
    nodes: int | None = Field(None, ge=1, le=65536, description="Nodes; None = cluster.num_gpus / gpus_per_node. nodes x gpus_per_node must equal cluster.num_gpus.")
    gpus_per_node: int | None = Field(None, ge=1, le=72, description="GPU processes per node; None = cluster.gpus_per_node, else the GPU's catalog default (capped at num_gpus).")
    time_limit_min: int = Field(60, ge=1, le=525600, description="Slurm wall-clock limit, minutes.")
    job_name: str | None = Field(None, description="Slurm job name; None = 'mcore-<model name>'.")
    run_dir: str | None = Field(None, description="Directory for the run's outputs (profiles, spec.json, tensorboard); None = 'runs/<job_name>'. Relative paths are relative to where the script runs.")
    script_name: str | None = Field(None, description="File name the script is meant to be saved as (used in the command); None = 'run.sh' / 'run.sbatch'.")
    megatron_lm_dir: str = Field("/opt/megatron-lm", description="Megatron-LM checkout (target megatron).")
    pretrain_script: str | None = Field(None, description="Path of the training script; None = <megatron_lm_dir>/pretrain_gpt.py, or <megatron_lm_dir>/pretrain_hybrid.py for a hybrid Mamba model.")
    python_executable: str = Field("python", description="Python used on Slurm nodes (python -m torch.distributed.run) and nothing else.")
    torchrun_executable: str = Field("torchrun", description="torchrun used by the single-node script.")
    data_path: list[str] | None = Field(None, description="Megatron --data-path items (prefixes, optionally 'weight prefix' pairs); None = --mock-data.")
    tokenizer_type: TokenizerType | None = Field(None, description="Megatron --tokenizer-type; required with data_path. Mock data uses NullTokenizer.")
    tokenizer_model: str | None = Field(None, description="Megatron --tokenizer-model (HF name or path to a tokenizer model file).")
    save_dir: str | None = Field(None, description="Checkpoint directory (--save); None = no checkpoints.")
    load_dir: str | None = Field(None, description="Checkpoint to resume from (--load).")
    save_interval: int | None = Field(None, ge=1, description="Steps between checkpoints; None = once at the end.")
    train_iters: int = Field(50, ge=1, description="Optimizer steps (--train-iters).")
    log_interval: int = Field(1, ge=1, description="Steps between log lines (--log-interval).")
    eval_interval: int | None = Field(None, ge=1, description="Steps between validations; None = no validation.")
    eval_iters: int = Field(10, ge=1, description="Batches per validation when eval_interval is set.")
    lr: float = Field(3.0e-4, gt=0, le=1, description="Peak learning rate; cosine decay to lr/10.")
    lr_warmup_fraction: float = Field(0.01, ge=0, lt=1, description="Warm-up as a fraction of train_iters.")
    profile: bool = Field(False, description="Profile steps profile_step_start..profile_step_end (Megatron --profile): torch.profiler, or nsys when nsys is true.")
    profile_step_start: int = Field(10, ge=0, description="First profiled step.")
    profile_step_end: int = Field(12, ge=1, description="Step where profiling stops (exclusive, as Megatron).")
    profile_ranks: list[int] = Field(default_factory=lambda: [0], description="Global ranks that record a profile.")
    nsys: bool = Field(False, description="Wrap the launcher in `nsys profile` (capture range = Megatron's cudaProfilerStart/Stop window when profile is set).")
    container_image: str | None = Field(None, description="Slurm + Pyxis: srun --container-image (e.g. nvcr.io#nvidia/pytorch:25.01-py3).")
    container_mounts: list[str] = Field(default_factory=list, description="Slurm + Pyxis: srun --container-mounts entries 'src:dst[:flags]'.")
    slurm_account: str | None = Field(None, description="#SBATCH --account.")
    slurm_partition: str | None = Field(None, description="#SBATCH --partition.")
    slurm_log_dir: str = Field("logs", description="Directory for the job's stdout/stderr (%x-%j.out/.err); created by the run command.")
    slurm_exclusive: bool = Field(True, description="#SBATCH --exclusive (whole nodes: NVLink, NICs and host memory unshared).")
    slurm_cpus_per_task: int | None = Field(None, ge=1, le=1024, description="CPUs for the one task per node (torchrun and its workers); None = Slurm's default.")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rendezvous port on the first node.")
    apex_installed: bool | None = Field(None, description="Apex present where the job runs? None = assume yes inside a container image (NGC PyTorch ships it), no otherwise; without Apex the script passes --no-gradient-accumulation-fusion.")
    extra_args: list[str] = Field(default_factory=list, description="Extra Megatron flags appended verbatim, '--flag [values]' tokens only: e.g. settings the plan does not model (--rotary-base 500000, --qk-layernorm, --moe-router-score-function sigmoid). Flags the plan already sets are rejected.")
    extra_env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables exported before the launch (e.g. site NCCL settings).")
    profile_spec: dict[str, Any] | None = Field(None, description="target profile: the job spec (launcher.spec.job_spec(plan)) written to <run_dir>/spec.json by the script.")
    allow_invalid: bool = Field(False, description="Render even when the validators report errors (they are listed in the header).")
    invocation: str | None = Field(None, description="The command line that asked for this render (shown in the header); None = the request's options as JSON.")

    @field_validator("data_path", "container_mounts", "extra_args", "profile_ranks", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        return [v] if isinstance(v, str | int) else v
