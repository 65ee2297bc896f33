"""GPU catalog values against NVIDIA datasheets and measurements (see each entry's `source`)."""

import pytest

from mcore_advisor.knowledge.hardware import gpu, gpu_catalog, gpu_key_from_label


def test_h100_sxm_dense_bf16_is_half_the_sparse_datasheet_figure():
    # H100 SXM datasheet: BF16 1,979 TFLOP/s "with sparsity"; dense is half (footnote).
    assert gpu("h100-sxm").bf16_dense_tflops == pytest.approx(1979 / 2, abs=0.2)
    assert gpu("h100-sxm").bf16_dense_tflops == pytest.approx(989.4, abs=0.05)


def test_h100_dense_peak_follows_from_tensor_cores_and_clock():
    # 132 SMs x 4 tensor cores x 512 BF16 FMA/clk x 2 FLOP x 1.83 GHz (boost used for the spec).
    derived_tflops = 132 * 4 * 512 * 2 * 1.83e9 / 1e12
    assert gpu("h100-sxm").bf16_dense_tflops == pytest.approx(derived_tflops, rel=1e-3)


def test_hopper_fp8_dense_peak_is_twice_bf16():
    for key in ("h100-sxm", "h100-pcie", "h200"):
        g = gpu(key)
        assert g.fp8_dense_tflops == pytest.approx(2 * g.bf16_dense_tflops, rel=1e-3)


def test_h200_has_141_gb_at_4_8_tbs_and_h100_compute():
    g = gpu("h200")
    # H200 datasheet: 141 GB HBM3e, 4.8 TB/s; PyTorch reports 139.80 GiB total capacity.
    assert 139.0 <= g.hbm_capacity_gib <= 141.0
    assert g.hbm_bandwidth_gbps == 4800
    assert g.bf16_dense_tflops == gpu("h100-sxm").bf16_dense_tflops


def test_a100_bf16_peak_is_312_dense_and_has_no_fp8():
    # A100 datasheet: BF16 312 TFLOP/s dense, 624 with sparsity; no FP8 tensor cores.
    for key in ("a100-80gb", "a100-40gb"):
        assert gpu(key).bf16_dense_tflops == 312.0
        assert gpu(key).fp8_dense_tflops is None
    assert gpu("a100-80gb").hbm_bandwidth_gbps == 2039
    assert gpu("a100-40gb").hbm_bandwidth_gbps == 1555


def test_blackwell_dense_peaks_are_half_the_sparse_system_figures():
    # HGX B200: 8 GPUs, 36 PFLOP/s FP16/BF16 with sparsity -> 2.25 dense per GPU.
    assert gpu("b200").bf16_dense_tflops == pytest.approx(36e3 / 8 / 2)
    # GB200 NVL72: 360 PFLOP/s BF16 with sparsity over 72 GPUs -> 2.5 dense per GPU.
    assert gpu("gb200").bf16_dense_tflops == pytest.approx(360e3 / 72 / 2)
    assert gpu("gb200").gpus_per_node == 72


def test_no_entry_uses_a_sparse_peak():
    # The datasheets' 2:4-sparse BF16 figures (H100 SXM 1979, PCIe 1513, A100 624) must not appear.
    for g in gpu_catalog().values():
        if g.fp8_dense_tflops:
            assert g.bf16_dense_tflops < g.fp8_dense_tflops
        assert g.bf16_dense_tflops not in (1979.0, 1978.9, 624.0, 1513.0)


def test_matmul_efficiency_matches_measured_gemm_rates():
    # H100: 798 TFLOP/s measured here (8192^3 bf16) and 794.5 in stas00/ml-engineering's MAMF table.
    assert gpu("h100-sxm").matmul_efficiency == pytest.approx(794.5 / 989.4, abs=0.01)
    # H200: 801-805 TFLOP/s measured (shared/data/device-measurements-h200.jsonl).
    assert gpu("h200").matmul_efficiency == pytest.approx(803 / 989.4, abs=0.01)
    # A100 SXM: MAMF 271.2 TFLOP/s.
    assert gpu("a100-80gb").matmul_efficiency == pytest.approx(271.2 / 312, abs=0.01)
    for g in gpu_catalog().values():
        assert 0.5 < g.matmul_efficiency < 0.95


def test_capacity_is_what_pytorch_reports_not_the_marketing_gb():
    # torch OOM messages: H100 79.11 GiB, A100-80GB 79.15 GiB, B200 178.36 GiB, GB200 184.31 GiB.
    assert gpu("h100-sxm").hbm_capacity_gib == pytest.approx(79.11, abs=0.01)
    assert gpu("a100-80gb").hbm_capacity_gib == pytest.approx(79.15, abs=0.01)
    assert gpu("b200").hbm_capacity_gib == pytest.approx(178.36, abs=0.01)
    assert gpu("gb200").hbm_capacity_gib == pytest.approx(184.31, abs=0.01)


def test_every_entry_cites_a_source():
    for g in gpu_catalog().values():
        assert "datasheet" in g.source.lower()


def test_unknown_gpu_names_the_field_and_lists_known_keys():
    with pytest.raises(KeyError) as e:
        gpu("v100")
    assert "cluster.gpu" in str(e.value)
    for key in gpu_catalog():
        assert key in str(e.value)


def test_aliases_and_table_labels_map_to_catalog_keys():
    assert gpu("H100").key == "h100-sxm"
    assert gpu("A100_SXM4_80GB").key == "a100-80gb"
    assert gpu_key_from_label("A100-SXM4-80GB") == "a100-80gb"
    assert gpu_key_from_label("H100-SXM5-80GB (DGX-H100)") == "h100-sxm"
    assert gpu_key_from_label("H100 (NVLink4, IB 8x50GB/s)") == "h100-sxm"
    assert gpu_key_from_label("H100 PCIe") == "h100-pcie"
    assert gpu_key_from_label("A100 40GB") == "a100-40gb"
    assert gpu_key_from_label("MI300X") is None


def test_a_multi_node_cluster_gets_the_bare_metal_host_one_node_the_catalogs():
    from mcore_advisor.knowledge.hardware import BARE_METAL_HOST_FLOOR_MS, default_host_floor_ms
    from mcore_advisor.physics.step_time import hardware_params
    from mcore_advisor.schemas import ClusterSpec

    h100 = gpu("h100-sxm")
    assert default_host_floor_ms(h100, 8) == h100.host_floor_ms_per_layer == 5.5  # this workplace's VMs
    assert default_host_floor_ms(h100, 16) == BARE_METAL_HOST_FLOOR_MS == 2.75
    assert default_host_floor_ms(h100, 16, gpus_per_node=16) == 5.5  # one NVLink domain of 16: one node
    assert default_host_floor_ms(gpu("a100-80gb"), 64) == 0.0  # not binding stays not binding
    # the step-time model reads it unless the cluster says otherwise
    assert hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=64)).host_floor_s_per_layer == pytest.approx(2.75e-3)
    assert hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=8)).host_floor_s_per_layer == pytest.approx(5.5e-3)
    pinned = ClusterSpec(gpu="h100-sxm", num_gpus=64, host_floor_ms_per_layer=6.0)
    assert hardware_params(pinned).host_floor_s_per_layer == pytest.approx(6.0e-3)
