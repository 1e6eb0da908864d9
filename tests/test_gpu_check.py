"""tests/gpu_check.py (`make gpu-check`): its logic on a CPU, without running the whole check.

The whole check takes a minute or more even where every GPU part skips; here each piece runs
alone: which test files it leaves out, how it reads pytest's and the VGG16 benchmark's output,
the summary, the exit status when a part fails or runs out of time, the parts that skip
without a GPU, and the warm-launch probe on gloo.
"""

from __future__ import annotations

import time

import pytest

import labkit
from tests import gpu_check
from tests.gpu_check import Context, Failed, Part, Result, Skipped


def write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


# ---- which test files run ---------------------------------------------------------------------

def test_files_that_import_a_missing_module_at_module_level_are_left_out(tmp_path, monkeypatch):
    write(tmp_path, {
        "pkg/__init__.py": "from .mod import x\n",
        "pkg/mod.py": "import json\nimport not_installed_xyz\nx = 1\n",
        "solutions/sol.py": "import also_not_installed_xyz\n",
        "tests/__init__.py": "",
        "tests/helper.py": "import os\n",
        # missing through the checkout's own package, followed into pkg/mod.py
        "tests/test_a.py": "import pytest\nfrom pkg import mod\n\n@pytest.mark.gpu\n"
                           "def test_a():\n    pass\n",
        # guarded and function-level imports do not count; relative imports are followed
        "tests/test_b.py": "import pytest\nfrom . import helper\nfrom .helper import os\n"
                           "try:\n    import guarded_xyz\nexcept ImportError:\n    pass\n\n"
                           "def test_b():\n    import inside_xyz\n\n"
                           "pytestmark = pytest.mark.gpu\n",
        # a module of a folder the test puts on sys.path itself (solutions/)
        "tests/test_c.py": "import sol\n",
        "tests/test_d.py": "import os\n\ndef test_d():\n    pass\n",  # no gpu tests
    })
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    runnable, left_out = gpu_check.gpu_test_files()
    assert [p.name for p in runnable] == ["test_b.py"]
    assert left_out == {
        "test_a.py": "imports not_installed_xyz: not installed",
        "test_c.py": "imports also_not_installed_xyz: not installed; it has no gpu tests",
    }


def test_the_repository_s_notebook_tests_are_left_out_without_nbformat(monkeypatch):
    monkeypatch.setattr(gpu_check, "installed", lambda module: module != "nbformat")
    runnable, left_out = gpu_check.gpu_test_files()
    names = [p.name for p in runnable]
    assert "test_launch.py" in names and "test_perf.py" in names
    assert "test_notebooks.py" not in names and "test_capstone.py" not in names
    assert left_out["test_notebooks.py"].startswith("imports nbformat: not installed")


# ---- reading output ---------------------------------------------------------------------------

PYTEST_OUT = """\
tests/test_launch.py::test_nccl PASSED                                   [ 50%]
tests/test_diagnose.py::test_flight FAILED                               [100%]
=========================== short test summary info ============================
SKIPPED [1] tests/test_parallel_tensor.py:199: needs 2 CUDA GPUs for 2 NCCL ranks
SKIPPED [2] tests/test_a.py:3: needs a GPU
SKIPPED [1] tests/test_b.py:9: needs a GPU
FAILED tests/test_diagnose.py::test_flight - ValueError: backend='nccl' needs one GPU per rank
ERROR tests/test_x.py - ModuleNotFoundError: No module named 'y'
====== 1 failed, 5 passed, 4 skipped, 955 deselected, 1 error in 31.20s ======"""


def test_pytest_figures_count_and_list_failures_and_skip_reasons():
    counts, figures = gpu_check.pytest_figures(PYTEST_OUT.splitlines())
    assert counts == {"failed": 1, "passed": 5, "skipped": 4, "deselected": 955, "error": 1}
    assert figures == [
        "5 passed, 4 skipped, 1 failed, 1 error(s)",
        "FAILED tests/test_diagnose.py::test_flight - ValueError: backend='nccl' needs one GPU "
        "per rank",
        "ERROR tests/test_x.py - ModuleNotFoundError: No module named 'y'",
        "skipped 1: needs 2 CUDA GPUs for 2 NCCL ranks (test_parallel_tensor.py:199)",
        "skipped 3: needs a GPU (test_a.py:3, test_b.py:9)",
    ]


def test_vgg16_figures_read_the_table_labkit_bench_prints(capsys):
    from labkit import perf

    row = {"device": "cuda:0", "device_name": "NVIDIA H200", "image_size": 224, "width": 1.0,
           "batch_size": 128, "train_flops_per_image": 3 * 15.5e9, "skipped": None}
    perf.print_vgg16_throughput([
        {**row, "variant": "fp32", "precision": "tf32", "peak_tflops": 494.7,
         "images_per_s": 1234.56, "tflops": 57.4, "mfu": 0.116},
        {**row, "variant": "bf16+channels_last", "precision": "bf16", "peak_tflops": 989.4,
         "images_per_s": 4321.0, "tflops": 201.0, "mfu": 0.203},
        {**row, "variant": "bf16+channels_last+compile", "precision": "bf16",
         "skipped": "torch.compile failed: no triton"},
    ])
    lines = capsys.readouterr().out.splitlines()
    assert gpu_check.vgg16_figures(lines) == [
        "cuda:0 (NVIDIA H200): 224 px, width 1, batch 128",
        "fp32: 1235 images/s, 57.4 TFLOP/s, MFU 11.6%",
        "bf16+channels_last: 4321 images/s, 201 TFLOP/s, MFU 20.3%",
        "bf16+channels_last+compile: skipped: torch.compile failed: no triton",
    ]
    with pytest.raises(Failed, match="no VGG16 figures"):
        gpu_check.vgg16_figures(["Traceback (most recent call last):"])


# ---- parts, summary, exit status --------------------------------------------------------------

def test_the_summary_has_a_line_per_part_and_the_verdict():
    text = gpu_check.summary([
        Result("environment", "PASS", 4.25, ["torch 2.14", "no CUDA GPU"]),
        Result("gpu tests", "FAIL", 31.0, ["1 passed, 0 skipped, 1 failed", "x" * 150],
               tail=["E   boom"]),
        Result("vgg16 bench", "SKIP", 0.0, ["skipped: no CUDA GPU"]),
    ], seconds=35.3)
    assert text.splitlines() == [
        "",
        " gpu-check summary ".center(100, "="),
        "PASS     4.2 s  environment   torch 2.14",
        " " * 30 + "no CUDA GPU",
        "FAIL    31.0 s  gpu tests     1 passed, 0 skipped, 1 failed",
        " " * 30 + "x" * 70,
        " " * 30 + "  " + "x" * 68,
        " " * 30 + "  " + "x" * 12,
        "      | E   boom",
        "SKIP     0.0 s  vgg16 bench   skipped: no CUDA GPU",
        "=" * 100,
        "gpu-check: FAILED (gpu tests): 1 pass, 1 skip, 1 fail in 35 s",
    ]


def _raise(exc):
    raise exc


def test_a_failing_a_timed_out_or_a_broken_part_fails_the_check_and_the_rest_still_run(capsys):
    def exits_3(ctx):
        return gpu_check.python("-c", "print('boom'); raise SystemExit(3)", timeout=ctx.timeout)

    def hangs(ctx):
        return gpu_check.python("-c", "import time; print('started', flush=True); time.sleep(60)",
                                timeout=ctx.timeout)

    parts = [Part("fine", 10, lambda ctx: ["3 figures"]),
             Part("exits 3", 30, exits_3),
             Part("hangs", 6, hangs),
             Part("broken", 10, lambda ctx: 1 / 0),
             Part("no gpu", 10, lambda ctx: _raise(Skipped("skipped: no CUDA GPU")))]
    start = time.monotonic()
    assert gpu_check.check(parts) == 1
    assert time.monotonic() - start < 30  # the hung part was stopped at its limit
    summary = capsys.readouterr().out.split(" gpu-check summary ")[1]
    assert "PASS" in summary and "fine          3 figures" in summary
    assert "exits 3       exit status 3" in summary and "| boom" in summary
    assert "hangs         timed out after 6 s" in summary and "| started" in summary
    assert "broken        ZeroDivisionError: division by zero" in summary
    assert "SKIP     0.0 s  no gpu        skipped: no CUDA GPU" in summary
    assert summary.splitlines()[-1].startswith(
        "gpu-check: FAILED (exits 3, hangs, broken): 1 pass, 1 skip, 3 fail in ")


def test_passing_and_skipped_parts_pass_the_check_and_the_budget_holds_back_late_parts(capsys):
    assert gpu_check.check([Part("fine", 10, lambda ctx: []),
                            Part("skip", 10, lambda ctx: _raise(Skipped("no GPU")))]) == 0
    ran = []
    assert gpu_check.check([Part("late", 10, lambda ctx: ran.append(1) or [])], budget=1) == 1
    assert not ran and "late          not started: the 1 s budget is spent" in (
        capsys.readouterr().out)


def test_the_gpu_parts_skip_without_a_gpu_and_say_so_if_the_environment_is_unknown():
    for part in gpu_check.PARTS[1:4]:
        with pytest.raises(Skipped, match="^skipped: no CUDA GPU$"):
            part.run(Context(timeout=10, gpus=0, facts={"env": {}}))
        with pytest.raises(Skipped, match="the environment part failed"):
            part.run(Context(timeout=10))


def test_without_torch_it_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "installed", lambda module: module != "torch")
    assert gpu_check.main([]) == 2
    assert "torch is not installed for" in capsys.readouterr().err


# ---- the warm launch ----------------------------------------------------------------------------

def _run(seconds, start, holding=None, total=1.0):
    return {"seconds": seconds, "sum": total, "allocated_at_start": start,
            "allocated_holding": start if holding is None else holding}


def test_warm_runs_pass_when_cuda_memory_is_back_to_its_baseline():
    gib = 1 << 30
    probe = {"runs": [_run(3.1, 512), _run(0.02, 512, 512 + gib), _run(0.01, 512)],
             "stopped": 1, "strays": []}
    lines = gpu_check.judge_warm(probe, cold_s=4.5)
    assert lines[0] == "warm: 0.020 s, 0.010 s a run (cold: 4.50 s); the first, 3.10 s, starts " \
                       "the workers"
    assert lines[1] == ("CUDA allocated at each run's start: 0.0 MiB, 0.0 MiB (then 1024.0 MiB "
                        "holding 1 GiB), 0.0 MiB")
    probe["runs"][2] = _run(0.01, 512 + gib)  # the 1 GiB outlived its run
    with pytest.raises(Failed, match="not back to baseline"):
        gpu_check.judge_warm(probe, cold_s=4.5)
    with pytest.raises(Skipped, match="^warm pools: not available in this checkout$"):
        gpu_check.judge_warm({"runs": None}, cold_s=None)


def test_the_warm_probe_says_when_this_checkout_has_no_warm_pools(monkeypatch, capsys):
    monkeypatch.setattr(labkit, "_LAZY", {k: v for k, v in labkit._LAZY.items() if k != "workers"})
    monkeypatch.delattr(labkit, "workers", raising=False)
    assert gpu_check.launch_probe(warm=True) == {"runs": None}
    assert capsys.readouterr().out == 'GPU-CHECK {"runs": null}\n'


@pytest.mark.slow
def test_the_warm_probe_runs_three_times_and_stops_its_workers_on_gloo():
    import labkit

    labkit.stop_workers()  # the session's warm pools (other tests'): only the probe's count
    out = gpu_check.launch_probe(warm=True, backend="gloo")
    assert [r["sum"] for r in out["runs"]] == [1.0, 1.0, 1.0]
    assert out["stopped"] == 1 and out["strays"] == []
