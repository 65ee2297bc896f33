"""The profile job's wgrad-accumulation fusion for Transformer Engine layers without Apex.

Transformer Engine cannot be installed on the CPU machines, so a stand-in package provides the one
class the entry looks for; the H200 runs (benchmarks/results/gpu_h200_targets.md) are the evidence
that TE then trains with the same losses and grad norms as without the fusion."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from mcore_advisor.launcher.entry import profile  # noqa: E402


@pytest.fixture
def fake_te(monkeypatch):
    class TransformerEngineBaseModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fuse_wgrad_accumulation = False
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module",
             "transformer_engine.pytorch.module.base"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["transformer_engine.pytorch.module.base"].TransformerEngineBaseModule = TransformerEngineBaseModule
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return TransformerEngineBaseModule


def test_only_transformer_engine_modules_get_the_fusion(fake_te):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.fc1 = fake_te(), fake_te()
            self.output = torch.nn.Linear(2, 2)  # Megatron's own layer: needs Apex for the fusion
            self.output.fuse_wgrad_accumulation = False

    chunks = [torch.nn.Sequential(Layer(), Layer()), torch.nn.Sequential(Layer())]
    assert profile._fuse_te_wgrad(chunks) == 6
    for c in chunks:
        for layer in c:
            assert layer.qkv.fuse_wgrad_accumulation and layer.fc1.fuse_wgrad_accumulation
            assert layer.output.fuse_wgrad_accumulation is False


def test_apex_s_wgrad_extension_decides_between_all_layers_and_te_only(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    for present in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, present=present: (
            object() if present and name == "fused_weight_gradient_mlp_cuda" else real(name)))
        assert profile._have_apex_wgrad_fusion() is present
