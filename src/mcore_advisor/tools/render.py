"""Tool render_launch_script(request): a plan -> a torchrun or sbatch script (rendering/render.py)."""

from __future__ import annotations

from mcore_advisor.rendering.render import LaunchArtifact, render_launch_script
from mcore_advisor.rendering.request import RenderRequest

__all__ = ["LaunchArtifact", "RenderRequest", "render_launch_script"]
