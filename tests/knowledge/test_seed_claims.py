"""Seed-document claims: coverage, quotes, and the arithmetic behind the verdicts."""

import json
import re
from pathlib import Path

import pytest

from mcore_advisor.knowledge.claims import claims_for_seed, seed_claim, seed_claims
from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.knowledge.runs import published_runs
from mcore_advisor.physics.anatomy import count_active_params, count_params
from mcore_advisor.schemas import ModelSpec

SEEDS = Path("/work/shared/seeds")
H100 = gpu("h100-sxm").bf16_dense_tflops


def norm(t: str) -> str:
    return re.sub(r"\s+", " ", t).strip()


def test_every_claim_has_a_verdict_and_a_reason():
    ids = [c.id for c in seed_claims()]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 90
    for c in seed_claims():
        assert c.verdict in ("holds", "wrong", "unverifiable", "misleading")
        assert len(c.why) > 20, c.id
        assert c.claim, c.id
        if c.verdict == "wrong":
            assert c.correct_value, c.id


@pytest.mark.skipif(not SEEDS.exists(), reason="seed documents not mounted")
def test_quotes_are_verbatim_and_the_seed_files_are_exact():
    texts = {p.name: norm(p.read_text(encoding="utf-8")) for p in sorted(SEEDS.iterdir())}
    for c in seed_claims():
        q = norm(c.quote)
        holders = [name for name, t in texts.items() if q in t]
        assert holders, c.id
        assert [c.seed_file, *c.also_in] == holders, c.id


@pytest.mark.skipif(not SEEDS.exists(), reason="seed documents not mounted")
def test_all_four_seed_documents_are_covered():
    files = sorted(p.name for p in SEEDS.iterdir())
    assert len(files) == 4
    for f in files:
        assert len(claims_for_seed(f)) >= 10, f


def test_sparse_1979_peak_is_marked_wrong_with_the_dense_value():
    c = seed_claim("h100-bf16-1979")
    assert c.verdict == "wrong"
    assert "989.4" in c.correct_value
    # The datasheet's 1979 is "with sparsity"; dense = half.
    assert 1979 / 2 == pytest.approx(H100, abs=0.2)
    for cid in ("h100-fp16-1979", "h100-fp8-3958", "a100-fp16-312-sparse"):
        assert seed_claim(cid).verdict == "wrong"


def test_390_tflops_is_not_47_percent_mfu():
    mfu = 390 / H100
    assert mfu == pytest.approx(0.394, abs=0.001)
    assert abs(mfu - 0.47) > 0.07
    assert 0.47 * H100 == pytest.approx(465.0, abs=0.1)
    assert seed_claim("gpt3-390-vs-47").verdict == "wrong"


def test_two_x_for_gradients_and_optimizer_is_wrong():
    # Megatron mixed-precision Adam: bf16 weight 2 + fp32 grad 4 + fp32 main weight 4 + two fp32 moments 8.
    bytes_per_param = 2 + 4 + 4 + 4 + 4
    assert bytes_per_param == 18 == 9 * 2
    claimed_70b_gb = 70e9 * 2 / 1e9 * 3  # weights + "~2x"
    actual_70b_gb = 70e9 * bytes_per_param / 1e9
    assert (claimed_70b_gb, actual_70b_gb) == (420, 1260)
    # Distributed optimizer: 6 + 12/DP bytes per parameter (theoretical_memory_usage.py).
    assert 6 + 12 / 8 == 7.5
    assert seed_claim("optimizer-2x").verdict == "wrong"


def test_benchmark_table_tokens_contradict_its_mfu():
    rows = [(7e9, 8, 0.45, 8000), (13e9, 16, 0.46, 12000), (70e9, 64, 0.47, 10000), (175e9, 256, 0.48, 8000)]
    per_gpu_reading = []
    for params, gpus, mfu, claimed in rows:
        # tokens/s = MFU * peak * GPUs / (6 * params); attention FLOPs would only lower it.
        implied_total = mfu * H100 * 1e12 * gpus / (6 * params)
        assert implied_total > 5 * claimed  # read as totals: every row is >5x too low
        per_gpu_reading.append(claimed * 6 * params / (H100 * 1e12))
    # Read per GPU, the 70B and 175B rows would need 424% and 849% MFU: above the peak.
    assert per_gpu_reading[2] > 4 and per_gpu_reading[3] > 8
    assert seed_claim("expert-benchmark-table").verdict == "wrong"


def test_gpt3_example_needs_more_than_the_peak():
    flops_per_iter = 3 * 350e9 * 1536 * 2048
    tflops_per_gpu = flops_per_iter / (5 * 512) / 1e12
    assert tflops_per_gpu == pytest.approx(1290, rel=0.01)
    assert tflops_per_gpu > H100
    assert flops_per_iter / (390e12 * 512) == pytest.approx(16.5, abs=0.1)
    assert seed_claim("gpt3-example-5s").verdict == "wrong"


def test_weak_scaling_efficiency_contradicts_its_own_mfu():
    mfu = [42, 44, 45, 46, 47]
    claimed_eff = [100, 95, 93, 90, 88]
    derived = [100 * m / mfu[0] for m in mfu]  # fixed per-GPU work: efficiency = MFU_i / MFU_0
    assert all(d >= 100 for d in derived)
    assert all(c < d for c, d in zip(claimed_eff[1:], derived[1:], strict=True))
    assert seed_claim("weak-scaling-table").verdict == "wrong"


def test_strong_scaling_table_is_consistent_but_unpublished():
    for gpus_ratio, time_ratio, speedup, eff in [(2, 0.52, 1.92, 96), (4, 0.27, 3.70, 93)]:
        assert 1 / time_ratio == pytest.approx(speedup, abs=0.01)
        assert 100 / time_ratio / gpus_ratio == pytest.approx(eff, abs=0.5)
    assert seed_claim("strong-scaling-table").verdict == "unverifiable"
    # The one published strong-scaling pair: 47% -> 42% MFU from 96 to 4608 GPUs.
    strong = [r.measured_mfu_pct for r in published_runs() if r.source == "MCORE_README_STRONG"]
    assert strong == [47, 42] and 42 / 47 == pytest.approx(0.894, abs=0.001)


def test_sequence_parallel_alone_does_not_save_75_percent_at_tp4():
    t = 4
    tp_only = 10 + 24 / t  # Korthikanti Table 2, TP + selective recompute, in units of s*b*h
    tp_sp = 34 / t
    no_parallel = 34
    assert 1 - tp_sp / tp_only == pytest.approx(0.469, abs=0.001)
    assert 1 - tp_sp / no_parallel == pytest.approx(0.75)
    assert seed_claim("sp-75pct").verdict == "misleading"


def test_interleaving_utilization_depends_on_microbatches():
    def utilization(p, m, v):
        return m / (m + (p - 1) / v)

    assert utilization(8, 8, 1) == pytest.approx(0.533, abs=0.001)
    assert utilization(8, 8, 4) == pytest.approx(0.821, abs=0.001)
    assert utilization(4, 32, 1) > 0.9
    assert seed_claim("studio-vp-50-80").verdict == "misleading"


def test_fp8_cannot_double_throughput():
    # H100 MAMF (stas00/ml-engineering): FP8 1402.6 vs BF16 794.5 TFLOP/s on the best GEMM shapes.
    assert 1402.6 / 794.5 == pytest.approx(1.77, abs=0.01)
    # End-to-end, 1.3B GPT on H200 with TE: 1068 ms BF16 -> 824 ms FP8 (reference/device-probe/TE-on-gpu.md).
    assert 1068 / 824 == pytest.approx(1.30, abs=0.01)
    for cid in ("fp8-2x-studio", "fp8-2x-expert"):
        assert seed_claim(cid).verdict == "wrong"
    assert seed_claim("fp8-1.5-2x").verdict == "misleading"


def test_mixtral_totals_from_the_config_not_8x_the_name():
    m7 = resolve_model(ModelSpec(name="mixtral-8x7b"))
    m22 = resolve_model(ModelSpec(name="mixtral-8x22b"))
    assert count_params(m7) / 1e9 == pytest.approx(46.7, abs=0.1) and count_params(m7) / 1e9 < 56 * 0.9
    assert count_active_params(m7) / 1e9 == pytest.approx(12.9, abs=0.1)
    assert count_params(m22) / 1e9 == pytest.approx(141, rel=0.01) and count_params(m22) / 1e9 < 176 * 0.9
    assert count_active_params(m22) / 1e9 == pytest.approx(39, rel=0.01)
    assert seed_claim("mixtral-8x7b-params").verdict == seed_claim("mixtral-8x22b-params").verdict == "wrong"


def test_deepseek_counts_hold_but_the_layout_needs_etp_one():
    ds = resolve_model(ModelSpec(name="deepseek-v3"))
    assert count_params(ds, include_mtp=False) / 1e9 == pytest.approx(671, rel=0.002)
    assert count_active_params(ds) / 1e9 == pytest.approx(37, rel=0.02)
    assert seed_claim("deepseek-v3-params").verdict == "holds"
    world, tp, pp, ep = 1024, 2, 16, 64
    # Megatron: EP * ETP must divide world / PP.
    assert (world // pp) % (ep * 1) == 0
    assert (world // pp) % (ep * tp) != 0  # default ETP = TP = 2 fails
    assert seed_claim("deepseek-v3-layout").verdict == "misleading"


def test_mfu_headline_and_trend_against_the_readme_table():
    rows = [r for r in published_runs() if r.source == "MCORE_README_H100"]
    mfus = [100 * r.measured_tflops_per_gpu / H100 for r in rows]
    assert max(mfus) == pytest.approx(49.4, abs=0.1) and max(mfus) > 47
    assert min(mfus) == pytest.approx(41.3, abs=0.1)
    assert mfus != sorted(mfus)  # not monotone in model size
    assert seed_claim("mfu-up-to-47-h100").verdict == "misleading"
    assert seed_claim("mfu-increases-with-size").verdict == "wrong"
    r462 = next(r for r in rows if r.model.endswith("462B"))
    assert r462.measured_tflops_per_gpu == 459.9 and seed_claim("gpt462b-390").verdict == "wrong"


def test_llama_layouts_against_nemo_2407():
    nemo = {r.model: r for r in published_runs() if r.source == "NEMO_2407"}
    l8, l70 = nemo["LLAMA3-8B"], nemo["LLAMA3-70B"]
    assert (l8.num_gpus, l8.tensor_model_parallel_size, l8.pipeline_model_parallel_size, l8.context_parallel_size, l8.seq_length) == (8, 1, 1, 2, 8192)
    assert seed_claim("llama3-8b-layout").verdict == "holds"
    assert (l70.num_gpus, l70.tensor_model_parallel_size, l70.pipeline_model_parallel_size, l70.context_parallel_size) == (64, 4, 4, 2)
    assert l70.seq_length == 8192  # the seed says 4K
    assert seed_claim("llama3-70b-layout").verdict == "wrong"
    gpt3 = [r for r in published_runs() if r.model == "GPT3-175B" and r.source == "NEMO_2407"]
    assert {(r.tensor_model_parallel_size, r.pipeline_model_parallel_size, r.num_gpus) for r in gpt3} == {(4, 8, 128), (4, 8, 512)}
    assert seed_claim("gpt3-layout-tp4-pp8").verdict == "holds"


def test_weights_table_is_two_bytes_per_parameter():
    for params_b, gb in [(7, 14), (13, 26), (70, 140), (175, 350), (405, 810)]:
        assert params_b * 2 == gb
    assert seed_claim("memory-table-bf16").verdict == "holds"


DEVICE = Path("/work/shared/data/device-measurements-h200.jsonl")


@pytest.mark.skipif(not DEVICE.exists(), reason="device measurements not mounted")
def test_flash_attention_gain_measured_on_h200():
    rows = [json.loads(line) for line in DEVICE.read_text().splitlines() if line.strip()]
    def pick(kind):
        return next(r for r in rows if r["core_attention"].startswith(kind) and r["micro_batch_size"] == 4
                    and r["model"]["seq_length"] == 2048 and r["model"]["num_layers"] == 24 and r["recompute"] == "none")
    unfused, sdpa = pick("unfused"), pick("torch SDPA")
    assert unfused["iter_s"] / sdpa["iter_s"] == pytest.approx(1.98, abs=0.01)
    assert unfused["peak_allocated_gib"] / sdpa["peak_allocated_gib"] == pytest.approx(1.99, abs=0.01)
    assert seed_claim("flash-30pct").verdict == "misleading"


def test_unknown_claim_id_suggests_close_ids():
    with pytest.raises(KeyError, match="h100-bf16-1979"):
        seed_claim("h100-bf16-1978")
