"""The multi-GPU evidence set (benchmarks/gpu/configs_multi.py) and its report's arithmetic
(benchmarks/gpu/report_multi.py): CPU only, no device."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

import configs_multi  # noqa: E402
import report_multi  # noqa: E402


@pytest.fixture(scope="module")
def lines2():
    return configs_multi.spec_lines(2)


def _flag(line, flag):
    argv = line["spec"]["megatron_argv"]
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_every_real_row_uses_the_whole_machine_and_names_are_unique(lines2):
    real = [x for x in lines2 if x["group"] == "multi"]
    assert len(real) >= 20
    assert len({x["name"] for x in lines2}) == len(lines2)
    for x in real:
        assert x["nproc"] == 2 and x["spec"]["dims"]["world_size"] == 2 and x["spec"]["mode"] == "profile"
        assert x["spec"]["run"]["profile_steps"] == [3, 3]  # traced: exposed communication from the trace


def test_the_layouts_the_issue_names_are_all_there(lines2):
    real = {x["name"]: x for x in lines2 if x["group"] == "multi"}
    assert "--sequence-parallel" in real["tp2_sp"]["spec"]["megatron_argv"]
    assert "--tp-comm-overlap" in real["tp2_sp_tpoverlap"]["spec"]["megatron_argv"]
    assert _flag(real["pp2_vp2"], "--num-virtual-stages-per-pipeline-rank") == "2"
    assert int(_flag(real["cp2_s32k"], "--seq-length")) == 32768 and int(_flag(real["cp2_s32k"], "--context-parallel-size")) == 2
    assert {_flag(real[n], "--moe-token-dispatcher-type") for n in real if "_ep2_" in n} == {"alltoall", "allgather"}
    assert {_flag(real[n], "--fp8-recipe") for n in real if "fp8" in n} == {"delayed", "tensorwise"}
    assert int(_flag(real["moe64top8_ep2_alltoall"], "--num-experts")) == 64
    assert _flag(real["moe8top2_ep2_alltoall"], "--moe-shared-expert-intermediate-size") == "2816"
    assert "--overlap-param-gather" in real["dp2_distopt_overlap"]["spec"]["megatron_argv"]
    assert "--use-distributed-optimizer" not in real["dp2_ddp_nooverlap"]["spec"]["megatron_argv"]


def test_fake_rows_mirror_every_plan_but_tp_comm_overlap(lines2):
    real = [x for x in lines2 if x["group"] == "multi"]
    fake = {x["name"]: x for x in lines2 if x["group"] == "multi_fake"}
    for x in real:
        if x["spec"]["parallelism"]["tp_comm_overlap"]:
            assert "fake_" + x["name"] not in fake  # TE userbuffers need real peers
            continue
        f = fake["fake_" + x["name"]]
        assert f["nproc"] == 1 and f["spec"]["mode"] == "memory_at_scale"
        assert "--fake-process-group" in f["spec"]["megatron_argv"]
        assert f["spec"]["plan"] == x["spec"]["plan"] and f["held_out"] == x["held_out"]


def test_held_out_rule_is_crc32_mod_3_and_about_a_third(lines2):
    assert configs_multi.held_out("pp2") == (zlib.crc32(b"pp2") % 3 == 0)
    real = [x for x in lines2 if x["group"] == "multi"]
    share = sum(x["held_out"] for x in real) / len(real)
    assert 0.2 <= share <= 0.45


def test_four_gpu_set_builds():
    lines = configs_multi.spec_lines(4)
    real = [x for x in lines if x["group"] == "multi"]
    # the 4-GPU plans, then the TE-only 2-GPU plans (run two at a time on GPU pairs)
    assert {x["spec"]["dims"]["world_size"] for x in real} == {4, 2}
    assert {x["name"] for x in real if x["nproc"] == 2} == set(configs_multi.TE_ONLY_2GPU)
    four = [x for x in real if x["nproc"] == 4]
    assert any(x["spec"]["dims"]["ep"] == 4 for x in four) and any(x["spec"]["dims"]["tp"] == 4 for x in four)
    # the at-scale memory rows issue 14 still lacked ride along, one GPU each
    assert [x["name"] for x in lines if x["group"] == "at_scale"] == list(configs_multi.AT_SCALE_ROWS)


def test_fake_pair_compares_the_rank_it_played():
    real = {"r": {"status": "ok", "result": {"peak_allocated_gib": [20.0, 10.0]}}}
    fake = {"name": "fake_r", "status": "ok", "result": {"measured_rank": 1, "peak_allocated_gib": [10.1]}}
    pair = report_multi.fake_pair(fake, real, "s/1")
    assert pair["real_rank_peak_allocated_gib"] == 10.0
    assert pair["fake_vs_real_pct"] == pytest.approx(1.0)


def test_blame_names_the_part_furthest_off():
    meas = {"compute_s": 0.50, "exposed_comm_s": 0.40, "idle_s": 0.10}
    pred = {"compute_s": 0.52, "exposed_comm_s": 0.05, "idle_s": 0.12}
    assert report_multi._blame(meas, pred).startswith("exposed communication")
    assert report_multi._blame(None, pred) is None


def test_trace_parts_split_the_step():
    parts = report_multi._trace_parts({"iter_s": 1.0, "device_busy_s_per_profiled_iteration": 0.8,
                                       "exposed_comm_s": 0.1, "comm_s": 0.4})
    assert parts["compute_s"] == pytest.approx(0.7) and parts["idle_s"] == pytest.approx(0.2)
    assert parts["overlap_fraction"] == pytest.approx(0.75)


@pytest.mark.parametrize("rows", [configs_multi.fine_rows, lambda: configs_multi.routing_rows(2),
                                  lambda: configs_multi.large_rows(4),
                                  lambda: [(n, p) for n, p, _ in configs_multi.mask_rows() + configs_multi.mask_more_rows()]],
                         ids=["fine", "routing", "large", "mask"])
def test_every_evidence_plan_passes_the_validators_and_fits(rows):
    """A row Megatron rejects at startup wastes a device lease (s7: 32 experts top-1 without
    --moe-router-pre-softmax): every plan the sets run must be valid and predicted to fit an H100."""
    from mcore_advisor.physics.evaluate import evaluate_plan

    for name, plan in rows():
        ev = evaluate_plan(plan)
        errors = [f.message for f in ev.findings if f.severity == "error"]
        assert ev.valid and not errors, (name, errors)
        assert ev.feasible, name


def test_the_fine_set_is_one_gpu_and_keeps_its_rerun_twins():
    lines = configs_multi.fine_spec_lines()
    assert {x["nproc"] for x in lines} == {1}
    names = [x["name"] for x in lines]
    assert len(names) == len(set(names))
    for twin in (n for n in names if n.endswith("_again")):
        first = next(x for x in lines if x["name"] == twin.removesuffix("_again"))
        again = next(x for x in lines if x["name"] == twin)
        assert first["spec"]["megatron_argv"] == again["spec"]["megatron_argv"]


def test_the_mask_set_pairs_differ_by_the_one_flag():
    lines = {x["name"]: x for x in configs_multi.mask_spec_lines()}
    flag = "--no-create-attention-mask-in-dataloader"
    pairs = [n for n in lines if n + "_nomask" in lines]
    assert len(pairs) == 6
    for name in pairs:
        on, off = lines[name]["spec"]["megatron_argv"], lines[name + "_nomask"]["spec"]["megatron_argv"]
        assert flag not in on and [a for a in off if a != flag] == on
    assert all(flag in x["spec"]["megatron_argv"] for n, x in lines.items() if n.endswith("_nomask"))
