"""labkit.machine: published peaks and their refusals, the machine card on disk, the roofline,
the FLOPs and bytes of common ops, and measurements that return sane numbers at tiny sizes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from labkit import machine
from labkit.bench import fit_alpha_beta

# The names torch.cuda.get_device_name() reports for each part in the table.
TORCH_NAMES = {"A100 SXM 80GB": "NVIDIA A100-SXM4-80GB", "H100 SXM": "NVIDIA H100 80GB HBM3",
               "H200 SXM": "NVIDIA H200", "B200 SXM": "NVIDIA B200"}


def _card(**changes):
    fields = {"device": "cpu", "model": "test CPU", "cores": 2, "cpus": 8,
              "peak_flops": {"fp32": 4e10, "bf16": 1e10}, "copy_GBps": 10.0,
              "triad_GBps": 8.0, "memory_GiB": 16.0, "profile": "smoke"}
    return machine.MachineCard(**{**fields, **changes})


# ---- published limits --------------------------------------------------------------------------


def test_table_covers_the_parts_with_dense_figures_and_sources():
    assert [s.name for s in machine.GPUS] == list(TORCH_NAMES)
    for spec in machine.GPUS:
        assert set(spec.dense_tflops) <= set(machine.DTYPES)
        assert all(v > 0 for v in spec.dense_tflops.values())
        assert spec.hbm_GBps > 0 and spec.nvlink_GBps > 0
        assert "https://www.nvidia.com/" in spec.source and "sparsity" in spec.source
        # tensor cores are several times faster than CUDA cores: fp32 is the lowest figure
        assert spec.dense_tflops["fp32"] == min(spec.dense_tflops.values())
    a100, h100, h200, b200 = machine.GPUS
    assert "fp8" not in a100.dense_tflops and "fp8" in h100.dense_tflops
    assert h200.dense_tflops == h100.dense_tflops and h200.hbm_GBps > h100.hbm_GBps
    # Blackwell's dense BF16 and FP8 are about 2.27x Hopper's; its NVLink is twice as fast
    assert b200.dense_tflops["fp8"] == 2 * b200.dense_tflops["bf16"]
    assert b200.nvlink_GBps == 2 * h100.nvlink_GBps


@pytest.mark.parametrize("spec", machine.GPUS, ids=lambda s: s.name)
def test_peak_flops_of_every_part_and_dtype(spec):
    for name in (TORCH_NAMES[spec.name], spec.name, spec.name.lower()):
        assert machine.gpu_spec(name) is spec
        for dtype, tflops in spec.dense_tflops.items():
            assert machine.peak_flops(name, dtype) == tflops * 1e12


def test_peak_flops_hand_values_aliases_and_sparse():
    assert machine.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert machine.peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert machine.peak_flops("NVIDIA H200", "float8_e4m3fn") == 1978.9e12
    assert machine.peak_flops("NVIDIA H100 80GB HBM3", "bf16", sparse=True) == 2 * 989.4e12


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL",
                                  "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-40GB",
                                  "NVIDIA GB200", "NVIDIA B300 SXM6 AC",
                                  "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "cpu"])
def test_an_unknown_part_never_borrows_another_parts_peak(name):
    with pytest.raises(ValueError, match="pass the dense peak from your part's data sheet"):
        machine.peak_flops(name, "bf16")


def test_peak_flops_refusals():
    with pytest.raises(ValueError, match="no published fp8 peak"):
        machine.peak_flops("NVIDIA A100-SXM4-80GB", "fp8")
    with pytest.raises(ValueError, match="sparse=True"):
        machine.peak_flops("NVIDIA H100 80GB HBM3", "bf16_sparse")
    with pytest.raises(ValueError, match="no sparse rate"):
        machine.peak_flops("NVIDIA H100 80GB HBM3", "fp32", sparse=True)
    with pytest.raises(TypeError, match="sparse must be True or False"):
        machine.peak_flops("NVIDIA H100 80GB HBM3", "bf16", sparse="yes")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        machine.peak_flops("NVIDIA H100 80GB HBM3", "int8")
    with pytest.raises(TypeError, match="dtype must be"):
        machine.peak_flops("NVIDIA H100 80GB HBM3", 16)
    with pytest.raises(TypeError, match="device_name must be"):
        machine.peak_flops("", "bf16")


def test_explain_peak_names_part_dtype_density_and_source():
    text = machine.explain_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert "H100 SXM" in text and "bf16 dense peak 989.4 TFLOP/s" in text
    assert "https://www.nvidia.com/en-us/data-center/h100/" in text
    assert all(len(line) <= 100 or " " not in line.strip() for line in text.splitlines())
    assert "sparse (2:4) peak 1978.8" in machine.explain_peak("NVIDIA H100 80GB HBM3", "bf16",
                                                              sparse=True)


# ---- the roofline ------------------------------------------------------------------------------


def test_roofline_below_at_and_above_the_ridge():
    peak, bw = 1e12, 1e10
    assert machine.ridge_point(peak, bw) == 100.0
    assert machine.attainable_flops(10, peak, bw) == 10 * bw          # below: memory roof
    assert machine.attainable_flops(100, peak, bw) == peak            # at: both roofs meet
    assert machine.attainable_flops(1000, peak, bw) == peak           # above: compute roof
    assert machine.bound(10, peak, bw) == "memory"
    assert machine.bound(100, peak, bw) == "compute"
    assert machine.bound(1000, peak, bw) == "compute"


@pytest.mark.parametrize("args", [(0, 1e12, 1e10), (1, -1e12, 1e10), (1, 1e12, math.inf),
                                  (1, 1e12, True)])
def test_roofline_refuses_non_positive_or_non_finite_inputs(args):
    with pytest.raises(ValueError, match="positive, finite"):
        machine.attainable_flops(*args)
    with pytest.raises(ValueError, match="positive, finite"):
        machine.bound(*args)


def test_ridge_point_refuses_zero_bandwidth():
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        machine.ridge_point(1e12, 0)


def test_op_costs_against_hand_computed_values():
    assert machine.matmul_intensity(2, 3, 4, 2) == {
        "op": "matmul", "flops": 48, "bytes": 52, "intensity": 48 / 52}  # (8 + 12 + 6) * 2
    assert machine.add_intensity(10, 4) == {"op": "add", "flops": 10, "bytes": 120,
                                            "intensity": 1 / 12}
    ln = machine.layernorm_intensity(3, 4, 2)  # 8 * 12 FLOPs; (24 + 8) * 2 bytes
    assert (ln["flops"], ln["bytes"]) == (96, 64)
    sm = machine.softmax_intensity(2, 8, 4)  # 5 * 16 FLOPs; 32 * 4 bytes
    assert (sm["flops"], sm["bytes"], sm["intensity"]) == (80, 128, 0.625)
    # b=2, h=3, s=4, d=2: 6 * (4*16*2 + 5*16) = 1248 FLOPs; fused 6 * 4*4*2 = 192 elements,
    # unfused 192 + 6 * 4*16 = 576 elements; 2 bytes each.
    fused = machine.attention_intensity(2, 3, 4, 2, 2, fused=True)
    unfused = machine.attention_intensity(2, 3, 4, 2, 2, fused=False)
    assert (fused["flops"], fused["bytes"]) == (1248, 384)
    assert (unfused["flops"], unfused["bytes"]) == (1248, 1152)
    assert fused["intensity"] == 3 * unfused["intensity"]


def test_op_costs_refuse_bad_sizes():
    with pytest.raises(ValueError, match="k must be a whole number"):
        machine.matmul_intensity(2, 3, 0, 2)
    with pytest.raises(ValueError, match="bytes_per_element"):
        machine.add_intensity(10, 2.5)
    with pytest.raises(TypeError, match="fused must be True or False"):
        machine.attention_intensity(1, 1, 4, 2, 2, fused=1)


def test_counted_bytes_match_the_documented_conventions():
    # The dispatcher's count of what torch reads and writes equals the formulas' bytes.
    x, y = torch.ones(10), torch.ones(10)
    counted = machine.count_bytes(lambda: x + y)
    assert counted["read"] + counted["written"] == machine.add_intensity(10, 4)["bytes"]
    a, b, c = torch.ones(2, 4), torch.ones(4, 3), torch.empty(2, 3)
    counted = machine.count_bytes(lambda: torch.matmul(a, b, out=c))
    assert counted["read"] + counted["written"] == machine.matmul_intensity(2, 3, 4, 4)["bytes"]
    with pytest.raises(TypeError, match="fn must be a callable"):
        machine.count_bytes(None)


def test_copy_and_triad_kernels_move_what_the_convention_counts():
    n = 16
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)
    counted = machine.count_bytes(lambda: machine.copy_kernel(a, b))
    assert (counted["read"], counted["written"]) == (4 * n, 4 * n)
    assert counted["read"] + counted["written"] == machine.copy_bytes(4 * n)
    counted = machine.count_bytes(lambda: machine.triad_kernel(a, b, c, 3.0))
    assert (counted["read"], counted["written"]) == (8 * n, 4 * n)
    assert counted["read"] + counted["written"] == machine.triad_bytes(4 * n)
    assert torch.equal(a, torch.full((n,), 7.0))  # 1 + 3 * 2


def test_measure_bandwidth_reports_the_bytes_its_kernels_move(monkeypatch):
    moved = {"copy": set(), "triad": set()}
    copy, triad = machine.copy_kernel, machine.triad_kernel

    def counted(kind, kernel):
        def run(*args):
            c = machine.count_bytes(lambda: kernel(*args))
            moved[kind].add(c["read"] + c["written"])
        return run

    monkeypatch.setattr(machine, "copy_kernel", counted("copy", copy))
    monkeypatch.setattr(machine, "triad_kernel", counted("triad", triad))
    r = machine.measure_bandwidth("cpu", 1001, repeats=1)
    assert r["nbytes"] == 1000  # whole float32 elements
    assert moved == {"copy": {r["copy_bytes"]}, "triad": {r["triad_bytes"]}}
    assert (r["copy_bytes"], r["triad_bytes"]) == (2000, 3000)


# ---- measurements at smoke sizes ---------------------------------------------------------------


def _sane(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measure_matmul_peak_is_positive_and_self_consistent(dtype):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        r = machine.measure_matmul_peak(dtype, "cpu", sizes=(8, 16), repeats=2)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(before)
    assert (r["dtype"], r["device"]) == (dtype, "cpu")
    assert [row["n"] for row in r["rows"]] == [8, 16]
    for row in r["rows"]:
        assert row["flops"] == 2 * row["n"] ** 3 and _sane(row["seconds"])
        assert row["flops_per_s"] == pytest.approx(row["flops"] / row["seconds"])
    assert r["peak_flops"] == max(row["flops_per_s"] for row in r["rows"])
    assert r["best_n"] in (8, 16) and _sane(r["peak_flops"])


def test_measure_matmul_peak_refusals():
    with pytest.raises(ValueError, match="_scaled_mm"):
        machine.measure_matmul_peak("fp8", "cpu", sizes=(8,))
    with pytest.raises(ValueError, match="on a CPU measure 'fp32'"):
        machine.measure_matmul_peak("tf32", "cpu", sizes=(8,))
    with pytest.raises(ValueError, match="at least one"):
        machine.measure_matmul_peak("fp32", "cpu", sizes=())
    with pytest.raises(ValueError, match="each of sizes"):
        machine.measure_matmul_peak("fp32", "cpu", sizes=(8, 0))
    with pytest.raises(ValueError, match="device must be"):
        machine.measure_matmul_peak("fp32", "tpu:x", sizes=(8,))


def test_measure_bandwidth_is_positive_and_self_consistent():
    r = machine.measure_bandwidth("cpu", 1 << 14, repeats=2)
    assert _sane(r["copy_GBps"]) and _sane(r["triad_GBps"])
    assert r["copy_GBps"] == pytest.approx(r["copy_bytes"] / r["copy_s"] / 1e9)
    assert r["triad_GBps"] == pytest.approx(r["triad_bytes"] / r["triad_s"] / 1e9)
    with pytest.raises(ValueError, match="nbytes must be a whole number >= 4"):
        machine.measure_bandwidth("cpu", 2)


def test_measure_op_places_an_op_on_the_roofline():
    x = torch.ones(64, 64)
    cost = machine.add_intensity(x.numel(), 4)
    r = machine.measure_op(lambda: x + x, flops=cost["flops"], nbytes=cost["bytes"],
                           repeats=2)
    assert _sane(r["seconds"]) and _sane(r["flops_per_s"]) and _sane(r["bytes_per_s"])
    assert r["intensity"] == cost["intensity"]
    assert r["flops_per_s"] / r["bytes_per_s"] == pytest.approx(cost["intensity"])
    with pytest.raises(TypeError, match="fn must be a callable"):
        machine.measure_op(x, flops=1, nbytes=1)
    with pytest.raises(ValueError, match="flops must be a positive"):
        machine.measure_op(lambda: x, flops=0, nbytes=1)
    with pytest.raises(ValueError, match="repeats"):
        machine.measure_op(lambda: x, flops=1, nbytes=1, repeats=0)


def test_measure_card_with_an_alpha_beta_fit():
    rows = [{"bytes": b, "seconds": 1e-5 + b / 1e9} for b in (1 << 10, 1 << 16, 1 << 20)]
    card = machine.measure_card("cpu", alpha_beta=fit_alpha_beta(rows), allreduce_ranks=4,
                                sizes=(8,), nbytes=1 << 12, repeats=1)
    assert card.device == "cpu" and set(card.peak_flops) == {"fp32", "bf16"}
    assert all(_sane(v) for v in card.peak_flops.values())
    assert _sane(card.copy_GBps) and _sane(card.triad_GBps) and card.cores >= 1
    assert card.alpha_s == pytest.approx(1e-5) and card.beta_GBps == pytest.approx(1.0)
    assert card.allreduce_ranks == 4 and _sane(card.memory_GiB) and card.cpus >= card.cores
    with pytest.raises(ValueError, match="allreduce_ranks="):
        machine.measure_card("cpu", alpha_beta=fit_alpha_beta(rows), sizes=(8,), nbytes=64)
    assert card.torch_version == torch.__version__
    with pytest.raises(ValueError, match="fit_alpha_beta"):
        machine.measure_card("cpu", alpha_beta={"alpha": 1}, sizes=(8,), nbytes=64)
    with pytest.raises(ValueError, match="non-empty list"):
        machine.measure_card("cpu", dtypes="fp32", sizes=(8,), nbytes=64)


# ---- the machine card --------------------------------------------------------------------------


def test_card_ridge_point_uses_the_triad_bandwidth():
    card = _card()
    assert card.ridge_point("fp32") == 4e10 / 8e9
    with pytest.raises(ValueError, match="no fp16 peak"):
        card.ridge_point("fp16")


@pytest.mark.parametrize("changes, message", [
    ({"device": ""}, "device must be a non-empty string"),
    ({"cores": 0}, "cores must be a whole number"),
    ({"cpus": 1.5}, "cpus must be a whole number"),
    ({"peak_flops": {}}, "at least one dtype"),
    ({"peak_flops": {"fp32": -1.0}}, r"peak_flops\['fp32'\]"),
    ({"peak_flops": {"int8": 1.0}}, "unknown dtype"),
    ({"copy_GBps": math.nan}, "copy_GBps"),
    ({"memory_GiB": 0}, "memory_GiB"),
    ({"alpha_s": 1e-5}, "all three or none"),
    ({"alpha_s": 1e-5, "beta_GBps": 1.0}, "all three or none"),
    ({"alpha_s": -1.0, "beta_GBps": 1.0, "allreduce_ranks": 2}, "alpha_s must be a latency"),
    ({"alpha_s": 0.0, "beta_GBps": math.inf, "allreduce_ranks": 2}, "beta_GBps"),
    ({"alpha_s": 0.0, "beta_GBps": 1.0, "allreduce_ranks": 1}, "2 or more workers"),
    ({"version": 1}, "version 2"),
])
def test_a_card_checks_itself(changes, message):
    with pytest.raises(ValueError, match=message):
        _card(**changes)


def test_save_and_load_round_trip(tmp_path):
    card = _card(alpha_s=2e-5, beta_GBps=5.0, allreduce_ranks=2)
    path = machine.save_card(card, tmp_path / "sub" / "card.json")
    assert path == tmp_path / "sub" / "card.json"
    assert machine.load_card(path) == card
    assert json.loads(path.read_text())["version"] == machine.CARD_VERSION


def test_default_path_is_in_labkit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert machine.card_path() == tmp_path / "machine.json"
    machine.save_card(_card())
    assert machine.load_card() == _card()


def test_load_card_missing_file_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="notebook 00's machine-card cell"):
        machine.load_card(tmp_path / "machine.json")


@pytest.mark.parametrize("text, message", [
    ("{not json", "is damaged"),
    ("[1, 2]", "holds no machine card"),
    (json.dumps({"version": 99}), "version 99; this labkit reads version 2"),
    (json.dumps({"version": 1, "device": "cpu"}), "version 1; this labkit reads version 2"),
    (json.dumps({"version": 2, "device": "cpu"}), "lacks"),
])
def test_load_card_refuses_a_damaged_file(tmp_path, text, message):
    path = tmp_path / "machine.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        machine.load_card(path)


def test_load_card_refuses_a_card_with_a_bad_value(tmp_path):
    path = machine.save_card(_card(), tmp_path / "machine.json")
    data = json.loads(path.read_text())
    data["triad_GBps"] = -3.0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is damaged .*triad_GBps"):
        machine.load_card(path)


def test_save_card_refuses_what_is_not_a_card(tmp_path):
    with pytest.raises(TypeError, match="MachineCard"):
        machine.save_card({"device": "cpu"}, tmp_path / "machine.json")


@pytest.mark.parametrize("fail", ["write", "replace"])
def test_a_failed_save_leaves_the_old_card_whole(tmp_path, monkeypatch, fail):
    path = machine.save_card(_card(), tmp_path / "machine.json")
    old = path.read_text()

    def half_written(obj, f, **kwargs):
        f.write(json.dumps(obj)[:20])
        raise OSError("disk full")

    def refused(src, dst):
        raise OSError("rename refused")

    if fail == "write":
        monkeypatch.setattr(machine.json, "dump", half_written)
    else:
        monkeypatch.setattr(machine.os, "replace", refused)
    with pytest.raises(OSError):
        machine.save_card(_card(model="another CPU"), path)
    assert path.read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == ["machine.json"]  # no temporary left


# ---- the planner's "this machine" --------------------------------------------------------------


def test_the_planners_cluster_from_a_card():
    from labkit import planner

    card = _card(alpha_s=60e-6, beta_GBps=2.0, allreduce_ranks=4)
    here = planner.Cluster.from_card(card, devices=4)
    # a ring all-reduce over 4 workers sends 2 * 3/4 of the message from each worker
    assert here.intra_GBps == here.inter_GBps == 2.0 * 1.5
    assert here.latency_us == pytest.approx(60 / 6)        # alpha over 2 * (4 - 1) ring steps
    assert here.tflops == 4e10 / 1e12 and here.devices_per_node == 4   # 4 x 2 threads on 8
    crowded = planner.Cluster.from_card(card, devices=8)   # 8 workers x 2 threads on 8 CPUs
    assert crowded.tflops == 4e10 / 2 / 1e12
    assert here.memory_gib == 16.0 / 4                        # CPU workers share the RAM
    assert "this machine" in str(here)
    gpu = planner.Cluster.from_card(_card(device="cuda", alpha_s=1e-5, beta_GBps=100.0,
                                          allreduce_ranks=8), devices=8, dtype="bf16")
    assert gpu.memory_gib == 16.0 and gpu.tflops == 1e10 / 1e12   # a GPU's memory is its own


def test_the_planners_cluster_from_a_card_refusals():
    from labkit import planner

    with pytest.raises(planner.PlanError, match="no all-reduce fit: run notebook 00"):
        planner.Cluster.from_card(_card(), devices=2)
    fitted = _card(alpha_s=1e-5, beta_GBps=1.0, allreduce_ranks=2)
    with pytest.raises(planner.PlanError, match="no fp16 matmul peak .* fp32, bf16"):
        planner.Cluster.from_card(fitted, devices=2, dtype="fp16")
    with pytest.raises(planner.PlanError, match="devices"):
        planner.Cluster.from_card(fitted, devices=0)


def test_a_gpu_card_beside_its_data_sheet():
    h100 = _card(device="cuda", model="NVIDIA H100 80GB HBM3",
                 peak_flops={"fp32": 50e12, "bf16": 700e12}, copy_GBps=2900.0)
    rows = {r["what"]: r for r in machine.card_beside_spec(h100)}
    assert set(rows) == {"fp32 matmul", "bf16 matmul", "memory (copy)"}
    assert rows["bf16 matmul"]["published"] == 989.4e12
    assert rows["bf16 matmul"]["fraction"] == 700e12 / 989.4e12
    assert rows["memory (copy)"]["fraction"] == 2900.0 / 3350.0
    # a CPU has no data sheet here, nor does a part labkit does not know (none is borrowed)
    assert machine.card_beside_spec(_card()) is None
    assert machine.card_beside_spec(_card(device="cuda", model="NVIDIA H100 PCIe")) is None
    with pytest.raises(TypeError, match="MachineCard"):
        machine.card_beside_spec({"device": "cuda"})
