"""The profile job's input: a Plan flattened into plain JSON for launcher/entry/profile.py.

The entry point runs where pydantic and the rest of mcore_advisor may be absent (the GPU image has
torch but no pydantic), so everything it needs is resolved here: the model shape with Megatron's
defaults filled in, the derived parallel sizes, the GPU's dense peak and the run settings. The job
backends write the dict to `spec.json` in the job directory.
"""

from __future__ import annotations

from typing import Any

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.schemas import Plan, parallel_dims
from mcore_advisor.tools.render import LaunchArtifact, RenderRequest, render_launch_script

SPEC_VERSION = 1

#: Default traced window: the last warm-up iteration, so the trace shows a warmed-up step and the
#: measured iterations stay unprofiled.
DEFAULT_PROFILE_STEPS: tuple[int, int] = (3, 3)


def job_spec(
    plan: Plan,
    *,
    warmup_steps: int = 3,
    measure_steps: int = 10,
    profile_steps: tuple[int, int] | None = DEFAULT_PROFILE_STEPS,
    seed: int = 1234,
) -> dict[str, Any]:
    """Plain-JSON job spec of `plan` for `python -m mcore_advisor.launcher.entry.profile --spec`.

    Iterations are numbered from 1. The first `warmup_steps` are not timed; then `measure_steps`
    timed iterations follow. `profile_steps=(first, last)` (inclusive) are traced with
    torch.profiler and never count as measured iterations (the job runs extra iterations if the
    window overlaps the measured ones); None disables tracing.

    Raises ValueError naming the plan field when the layout cannot be run: the world size must
    be a multiple of TP*PP*CP and the global batch a multiple of micro-batch * DP.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if measure_steps < 1:
        raise ValueError(f"measure_steps must be >= 1, got {measure_steps}")
    if profile_steps is not None:
        first, last = profile_steps
        if first < 1 or last < first:
            raise ValueError(f"profile_steps must be (first, last) with 1 <= first <= last, got {profile_steps}")
        profile_steps = (int(first), int(last))

    shape = resolve_model(plan.model)
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
    # Megatron's _vocab_size_with_padding: the padded vocab is what the model is built with.
    padded_vocab = shape.padded_vocab_size(d.tp)
    return {
        "spec_version": SPEC_VERSION,
        "model": shape.model_dump(mode="json"),
        "padded_vocab_size": padded_vocab,
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
            "warmup_steps": int(warmup_steps),
            "measure_steps": int(measure_steps),
            "profile_steps": list(profile_steps) if profile_steps is not None else None,
            "seed": int(seed),
        },
        "plan": plan.model_dump(mode="json"),
    }


def render_with_job_spec(request: RenderRequest) -> LaunchArtifact:
    """render_launch_script, with the profile target's job spec built from the plan when not given
    (the core renders it; building it is the launcher's part)."""
    if request.target == "profile" and request.profile_spec is None:
        request = request.model_copy(update={"profile_spec": job_spec(request.plan)})
    return render_launch_script(request)
