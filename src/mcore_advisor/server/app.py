"""The MCP adapter: registers the tools, resources and prompts on the official SDK's MCPServer.

Thin by design: every tool is a pure function (or the job manager) below this layer; here we only
map input errors to ToolError and choose annotations.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

from mcp.server import MCPServer
from mcp.server.auth.provider import AccessToken
from mcp.types import ToolAnnotations

from mcore_advisor import __version__
from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.spec import render_with_job_spec
from mcore_advisor.schemas import Plan
from mcore_advisor.server.errors import tool_errors
from mcore_advisor.server.resources import register_prompts, register_resources
from mcore_advisor.tools.estimate_memory import MemoryReport
from mcore_advisor.tools.estimate_memory import estimate_memory as _estimate_memory
from mcore_advisor.tools.evaluate import Evaluation
from mcore_advisor.tools.evaluate import evaluate_plan as _evaluate_plan
from mcore_advisor.tools.mfu import MfuReport, MfuRequest
from mcore_advisor.tools.mfu import check_mfu as _check_mfu
from mcore_advisor.tools.recommend import Recommendation, RecommendRequest
from mcore_advisor.tools.recommend import recommend_parallelism as _recommend
from mcore_advisor.tools.render import LaunchArtifact, RenderRequest

INSTRUCTIONS = """\
Plan, check, launch and profile NVIDIA Megatron-Core training runs.
- recommend_parallelism: model + cluster -> ranked TP/PP/VP/CP/EP/micro-batch/recompute plans with predictions.
- evaluate_plan / estimate_memory: one plan -> validation findings, per-GPU memory, predicted step time and MFU.
- check_mfu: numbers or a pasted Megatron/NeMo log or OOM message -> MFU/HFU (both FLOP conventions) and ranked fixes.
- render_launch_script: plan -> torchrun or Slurm sbatch script for Megatron-LM or the profile job.
- run_profile_job -> get_job / list_jobs / cancel_job: really run a short profiled job and compare with the prediction.
Plans use Megatron-LM argument names; the same plan object goes into every tool.
"""

READ_ONLY = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)


class StaticTokenVerifier:
    """Bearer-token check for the HTTP transport: one shared secret, compared in constant time."""

    def __init__(self, token: str):
        self._token = token

    async def verify_token(self, token: str) -> AccessToken | None:
        if secrets.compare_digest(token.encode(), self._token.encode()):
            return AccessToken(token=token, client_id="mcore-advisor-client", scopes=["mcore"])
        return None


def build_server(
    *, http_url: str | None = None, token: str | None = None, manager: jobs.JobManager | None = None
) -> MCPServer:
    """The MCP server. `http_url` + `token` turn on bearer auth for the streamable-HTTP transport."""
    auth_kwargs: dict = {}
    if token:
        from mcp.server.auth.settings import AuthSettings

        auth_kwargs = {
            "token_verifier": StaticTokenVerifier(token),
            "auth": AuthSettings(
                issuer_url=http_url, resource_server_url=http_url, required_scopes=["mcore"],
                validate_token_resource=False,
            ),
        }
    mcp = MCPServer("mcore-advisor", version=__version__, instructions=INSTRUCTIONS, **auth_kwargs)

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    def recommend_parallelism(request: RecommendRequest) -> Recommendation:
        """Ranked parallel layouts (TP/PP/VP/CP/EP, micro-batch, recompute, SP, distributed optimizer, FP8) for a model on a cluster.

        Use it first when someone asks how to train a model on N GPUs. Each returned plan is a complete
        plan accepted by every other tool, with predicted step time, tokens/s/GPU, TFLOP/s/GPU, MFU and
        memory, why it beats the runners-up, and the nearest published run. When nothing fits it says
        what is needed instead.
        """
        return _recommend(request, clock=time.perf_counter)

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    def evaluate_plan(plan: Plan) -> Evaluation:
        """Validation findings, per-GPU memory and predicted performance of one complete plan.

        Use it to check a layout someone proposes. Findings name the plan field and a fix; a plan
        that does not fit is a normal result (feasible=false), not an error.
        """
        return _evaluate_plan(plan)

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    def estimate_memory(plan: Plan) -> MemoryReport:
        """Per-GPU memory breakdown on the most-loaded rank (weights, grads, optimizer, activations, logits, buffers, fragmentation).

        Use it for "will this fit?" and "why does this OOM?": it says whether the plan fits, the
        headroom, and the changes that would make it fit with the memory each saves.
        """
        return _estimate_memory(plan)

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    def check_mfu(request: MfuRequest) -> MfuReport:
        """MFU/HFU in both FLOP conventions from numbers or a pasted Megatron/NeMo log, with a ranked diagnosis.

        Use it when someone reports low MFU/TFLOP/s, pastes a training log, an OOM traceback or an
        NCCL timeout, or quotes a throughput claim to check. Fixes are concrete plan changes with
        predicted before/after throughput (or memory for an OOM).
        """
        return _check_mfu(request)

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    def render_launch_script(request: RenderRequest) -> LaunchArtifact:
        """A runnable torchrun or Slurm sbatch script (Megatron-LM pretrain_gpt.py or the profile job) for a plan.

        Every value is validated and shell-quoted; the script's header states the plan's predicted
        figures and each non-default flag is explained. Nothing is executed.
        """
        return render_with_job_spec(request)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=True))
    @tool_errors
    def run_profile_job(request: jobs.ProfileJobRequest) -> jobs.JobSubmission:
        """Submit a short profiled Megatron-Core job for a plan (local torchrun by default, or Slurm); returns the job id at once.

        Poll get_job for state, log tail and measured-vs-predicted figures. dry_run=true shows the
        exact command without creating a job. An invalid plan creates no job.
        """
        return jobs.run_profile_job(request, manager=manager)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False))
    @tool_errors
    def get_job(job_id: str) -> jobs.JobStatus:
        """State, log tail, result and measured-vs-predicted comparison (% error per figure) of a profile job; failures come with a diagnosis."""
        return jobs.get_job(job_id, manager=manager)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False))
    @tool_errors
    def list_jobs(
        state: Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"] | None = None,
        limit: int = 20,
    ) -> jobs.JobList:
        """Profile jobs, newest first, optionally filtered by state."""
        return jobs.list_jobs(state, limit, manager=manager)

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=True))
    @tool_errors
    def cancel_job(job_id: str) -> jobs.JobStatus:
        """Cancel a pending or running profile job (its process group or Slurm job is stopped); returns the final state."""
        return jobs.cancel_job(job_id, manager=manager)

    register_resources(mcp)
    register_prompts(mcp)
    return mcp
