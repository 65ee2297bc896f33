"""The profile job's input: a Plan flattened into plain JSON for launcher/entry/profile.py.

The entry point runs where pydantic and the rest of mcore_advisor may be absent (the GPU image has
torch but no pydantic), so everything it needs is resolved here. Above all `megatron_argv`: the
exact argv `render_launch_script` renders for the plan (Megatron-LM pretrain_gpt.py's arguments),
with the job's iteration count, Megatron's own torch-profiler window and, when asked,
`--record-memory-history` or `--fake-process-group`: one Plan-to-Megatron mapping for the rendered
script and the job. The rest (model shape, derived parallel sizes, the GPU's dense peak, the run
settings) is what the entry reports with. The job backends write the dict to `spec.json` in the
job directory.
"""

from __future__ import annotations

from typing import Any, Literal

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.launcher.entry.profile import job_iterations
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.rendering.render import profile_job_refusal
from mcore_advisor.schemas import Plan, parallel_dims
from mcore_advisor.tools.render import LaunchArtifact, RenderRequest, render_launch_script

SPEC_VERSION = 2

#: Default traced window: iteration 3, so the trace shows a warmed-up step; Megatron's profiler
#: also disturbs iterations 2 (its warm-up) and 4 (the trace export), which are never measured.
DEFAULT_PROFILE_STEPS: tuple[int, int] = (3, 3)
#: Megatron-LM's --seed default (arguments.py): rendered only when the job asks for another.
MEGATRON_DEFAULT_SEED = 1234
Mode = Literal["profile", "memory_at_scale"]


def most_loaded_rank(plan: Plan) -> int:
    """Global rank of the pipeline stage the memory model finds most loaded (tensor-, context- and
    data-parallel rank 0): Megatron's rank order tp-cp-ep-dp-pp puts pipeline rank p at p * world / PP."""
    d = parallel_dims(plan)
    return memory_breakdown(plan).most_loaded_pipeline_rank * (plan.cluster.num_gpus // d.pp)


def _measured_rank(plan: Plan, rank: int | Literal["most_loaded"] | None) -> int:
    world = plan.cluster.num_gpus
    if rank is None or rank == "most_loaded":
        return most_loaded_rank(plan)
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be 'most_loaded' or a global rank in 0..{world - 1} (cluster.num_gpus {world}), got {rank!r}")
    return rank


def megatron_argv(plan: Plan, *, train_iters: int, profile_steps: tuple[int, int] | None, seed: int,
                  mode: Mode = "profile", record_memory_history: bool = False) -> list[str]:
    """render_launch_script's Megatron argv for the plan with the job's run options."""
    extra: list[str] = []
    if seed != MEGATRON_DEFAULT_SEED:
        extra += ["--seed", str(seed)]
    if mode == "memory_at_scale":
        extra.append("--fake-process-group")
    if record_memory_history:
        extra.append("--record-memory-history")
    gpn = gpu(plan.cluster.gpu).gpus_per_node
    request = RenderRequest(
        plan=plan, target="megatron", launcher="slurm" if plan.cluster.num_gpus > gpn else "torchrun",
        train_iters=train_iters, extra_args=extra,
        profile=profile_steps is not None,
        profile_step_start=profile_steps[0] if profile_steps else 10,
        profile_step_end=profile_steps[1] + 1 if profile_steps else 12,
        profile_ranks=[0],
    )
    return list(render_launch_script(request).megatron_args)


def job_spec(
    plan: Plan,
    *,
    warmup_steps: int = 3,
    measure_steps: int = 10,
    profile_steps: tuple[int, int] | None = DEFAULT_PROFILE_STEPS,
    seed: int = MEGATRON_DEFAULT_SEED,
    mode: Mode = "profile",
    rank: int | Literal["most_loaded"] | None = None,
    record_memory_history: bool = False,
) -> dict[str, Any]:
    """Plain-JSON job spec of `plan` for `python -m mcore_advisor.launcher.entry.profile --spec`.

    Iterations are numbered from 1. The first `warmup_steps` are not timed; then `measure_steps`
    timed iterations follow. `profile_steps=(first, last)` (inclusive) are traced by Megatron's
    torch profiler and never count as measured (nor do first-1 and last+1, which the profiler
    disturbs); None disables tracing. `mode='memory_at_scale'` runs one process as global rank
    `rank` ('most_loaded' or None: the memory model's most-loaded pipeline stage) of the plan's
    world with Megatron's --fake-process-group, for entry.profile.AT_SCALE_ITERATIONS iterations, untraced
    (warm-up and measure counts do not apply).

    Raises ValueError naming the field when the layout cannot be run: the world size must be a
    multiple of TP*PP*CP and the global batch a multiple of micro-batch * DP.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if measure_steps < 1:
        raise ValueError(f"measure_steps must be >= 1, got {measure_steps}")
    if mode not in ("profile", "memory_at_scale"):
        raise ValueError(f"mode must be 'profile' or 'memory_at_scale', got {mode!r}")
    if profile_steps is not None:
        first, last = profile_steps
        if first < 1 or last < first:
            raise ValueError(f"profile_steps must be (first, last) with 1 <= first <= last, got {profile_steps}")
        profile_steps = (int(first), int(last))

    shape = resolve_model(plan.model)
    refusal = profile_job_refusal(shape)  # e.g. hybrid Mamba models: entry/gpt.py builds GPTModels only
    if refusal:
        raise ValueError(refusal)
    g = gpu(plan.cluster.gpu)
    d = parallel_dims(plan)
    p, t = plan.parallelism, plan.training
    model_parallel = d.model_parallel
    if plan.cluster.num_gpus % model_parallel:
        raise ValueError(
            f"cluster.num_gpus ({plan.cluster.num_gpus}) must be a multiple of tensor * pipeline * context "
            f"parallel size ({model_parallel}); change cluster.num_gpus or parallelism sizes"
        )
    per_step = t.micro_batch_size * d.dp
    if t.global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size ({t.global_batch_size}) must be a multiple of micro_batch_size * "
            f"data-parallel size ({t.micro_batch_size} * {d.dp} = {per_step}); try "
            f"{max(per_step, t.global_batch_size // per_step * per_step)}"
        )
    at_scale = mode == "memory_at_scale"
    if at_scale:
        profile_steps = None
    run = {"warmup_steps": int(warmup_steps), "measure_steps": int(measure_steps),
           "profile_steps": list(profile_steps) if profile_steps is not None else None}
    train_iters = len(job_iterations(run, mode))
    argv = megatron_argv(plan, train_iters=train_iters, profile_steps=profile_steps, seed=seed, mode=mode,
                         record_memory_history=record_memory_history)
    return {
        "spec_version": SPEC_VERSION,
        "mode": mode,
        "measured_rank": _measured_rank(plan, rank) if at_scale else None,
        "megatron_argv": argv,
        "model": shape.model_dump(mode="json"),
        # Megatron's _vocab_size_with_padding: the padded vocab is what the model is built with.
        "padded_vocab_size": shape.padded_vocab_size(d.tp),
        "training": t.model_dump(mode="json"),
        "parallelism": p.model_dump(mode="json"),
        "implementation": plan.implementation.model_dump(mode="json"),
        "cluster": plan.cluster.model_dump(mode="json"),
        "dims": {
            "tp": d.tp,
            "pp": d.pp,
            # None when not interleaved, as Megatron's virtual_pipeline_model_parallel_size.
            "vp": d.vp if d.pp > 1 and p.virtual_pipeline_model_parallel_size else None,
            "cp": d.cp,
            "ep": d.ep,
            "etp": d.etp,
            "dp": d.dp,
            "world_size": plan.cluster.num_gpus,
            "num_microbatches": t.global_batch_size // per_step,
        },
        "gpu": {
            "key": g.key,
            "name": g.name,
            "bf16_dense_tflops": g.bf16_dense_tflops,
            "fp8_dense_tflops": g.fp8_dense_tflops,
        },
        "run": {
            **run,
            "train_iters": train_iters,
            "seed": int(seed),
            "record_memory_history": bool(record_memory_history),
        },
        "plan": plan.model_dump(mode="json"),
    }


def render_with_job_spec(request: RenderRequest) -> LaunchArtifact:
    """render_launch_script, with the profile target's job spec built from the plan when not given
    (the core renders it; building it is the launcher's part)."""
    if request.target == "profile" and request.profile_spec is None:
        request = request.model_copy(update={"profile_spec": job_spec(request.plan)})
    return render_launch_script(request)
