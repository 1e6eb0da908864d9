"""labkit.doctor: every section gathered, every check's verdicts, the CLI's JSON and exit status."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest

from labkit import doctor
from labkit.doctor import SECTIONS, VERDICTS, Check, GPUFacts, InterfaceFacts, run_doctor

from .conftest import cuda_gpus

# Pinned: scripts and notebooks read these keys; changing them is a breaking change.
TOP_LEVEL_KEYS = [*SECTIONS, "checks", "ok"]
CHECK_NAMES = ["system", "python", "torch", "gloo", "gpu", "nccl", "cuda_arch", "p2p",
               "tensorflow", "shm", "memlock", "env", "jupyter", "network", "profile"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = GPUFacts(0, "NVIDIA H200", 150_000_000_000, "9.0")


@pytest.fixture(scope="module")
def report():
    """One real run on this machine (two probe interpreters: about 15 s on 2 cores)."""
    return run_doctor()


@pytest.fixture
def fresh(report):
    """A copy to edit: each test changes facts and reads the checks derived from them."""
    return copy.deepcopy(report)


@pytest.fixture
def with_gpus(fresh):
    """This machine's report, pretending two H200s that torch can use."""
    fresh.torch.found = fresh.torch.cuda_available = fresh.torch.nccl_available = True
    fresh.torch.gpus = [H200, GPUFacts(1, "NVIDIA H200", 150_000_000_000, "9.0")]
    fresh.torch.arch_list = ["sm_80", "sm_90"]
    fresh.p2p.matrix = [[True, True], [True, True]]
    fresh.system.nvidia_devices = fresh.profile.visible_gpus = 2
    return fresh


@pytest.fixture
def no_frameworks(tmp_path, monkeypatch):
    """Probe interpreters where `import torch` and `import tensorflow` fail as if not installed."""
    for name in ("torch", "tensorflow"):
        error = f"No module named '{name}'"
        (tmp_path / f"{name}.py").write_text(f"raise ModuleNotFoundError({error!r})\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


# ------------------------------------------------------------------ the real run on this machine


def test_every_section_present_in_data_and_text(report):
    text = str(report)
    for name in SECTIONS:
        assert getattr(report, name) is not None
        assert f"\n\n{name}\n" in text, f"section {name} missing from the text report"
    assert [c.name for c in report.checks] == CHECK_NAMES
    assert "summary:" in text.splitlines()[-1]


def test_json_is_stable_and_parses(report):
    data = json.loads(json.dumps(report.to_dict()))
    assert list(data) == TOP_LEVEL_KEYS
    assert [c["name"] for c in data["checks"]] == CHECK_NAMES
    assert all(set(c) == {"name", "verdict", "detail", "fix"} for c in data["checks"])
    assert all(c["verdict"] in VERDICTS for c in data["checks"])
    assert all(c["fix"] for c in data["checks"] if c["verdict"] != "pass"), "a problem lacks a fix"
    assert data["ok"] is report.ok


def test_this_machine_has_torch_gloo_and_facts(report):
    assert report.torch.found and report.torch.version
    assert report.check("gloo").verdict == "pass"
    assert report.check("python").verdict == "pass"
    assert report.system.cpu_cores >= 1 and report.system.memory_bytes > 0
    assert report.python.executable == sys.executable
    assert report.jupyter.jupyterlab and report.jupyter.ipywidgets
    assert any(i.name.startswith("lo") for i in report.network.interfaces)
    assert report.profile.name in ("smoke", "cpu", "gpu")
    assert report.ok, [str(c) for c in report.checks if c.verdict == "fail"]


@pytest.mark.skipif(cuda_gpus() > 0, reason="this machine has GPUs")
def test_cpu_machine_says_no_gpu_found(report):
    assert report.torch.gpus == [] and report.p2p.matrix == []
    assert "none found" in str(report)
    gpu = report.check("gpu")
    assert gpu.verdict == "warn" and "no CUDA GPU" in gpu.detail  # information, not a failure
    assert report.check("nccl").verdict == "pass"  # NCCL is not needed without GPUs
    assert report.check("memlock").verdict == "pass"


def test_text_report_in_ipython_is_the_report(report):
    shown = []

    class Printer:  # the part of IPython's pretty printer that _repr_pretty_ uses
        text = shown.append

    report._repr_pretty_(Printer(), False)
    assert shown == [report.report()]


# ------------------------------------------------------------------------- failures, reported


def test_missing_torch_and_tensorflow_are_reported_not_raised(no_frameworks):
    r = run_doctor()
    assert not r.torch.found and "No module named 'torch'" in r.torch.error
    assert not r.tensorflow.found and "No module named 'tensorflow'" in r.tensorflow.error
    assert r.check("torch").verdict == "fail" and "pip install torch" in r.check("torch").fix
    assert r.check("gloo").verdict == "fail"
    tf = r.check("tensorflow")
    assert tf.verdict == "warn" and "labkit[tensorflow]" in tf.fix  # optional: never a failure
    assert not r.ok
    json.dumps(r.to_dict())
    assert r.check("torch").detail == "torch is not installed"
    assert "No module named 'torch'" in str(r)


def test_probe_interpreter_missing_is_reported(tmp_path):
    r = run_doctor(shm_path=str(tmp_path / "no-such-shm"), python=str(tmp_path / "no-python"))
    assert not r.torch.found and "cannot run" in r.torch.error
    assert r.check("torch").verdict == "fail" and "did not load" in r.check("torch").detail
    tf = r.check("tensorflow")
    assert tf.verdict == "warn" and "did not load" in tf.detail
    shm = r.check("shm")
    assert shm.verdict == "warn" and "not usable" in shm.detail and "--shm-size" in shm.fix


def test_probe_that_crashes(tmp_path):
    python = _script(tmp_path, "segv", "kill -SEGV $$\n")
    facts = doctor._run_probe("torch", python, timeout=30)
    assert facts["found"] is False and "crashed with SIGSEGV" in facts["error"]


def test_probe_that_fails_with_a_message(tmp_path):
    python = _script(tmp_path, "fails", "echo 'ImportError: libcudart.so.13' >&2\nexit 3\n")
    facts = doctor._run_probe("tensorflow", python, timeout=30)
    assert "exited with status 3: ImportError: libcudart.so.13" in facts["error"]


def test_probe_that_hangs(tmp_path):
    python = _script(tmp_path, "hangs", "exec sleep 30\n")
    facts = doctor._run_probe("tensorflow", python, timeout=0.5)
    assert facts["found"] is False and "did not finish within 0.5 s" in facts["error"]


def test_probe_with_garbled_answer(tmp_path):
    python = _script(tmp_path, "garbled", "echo 'LABKIT-PROBE {not json'\n")
    facts = doctor._run_probe("torch", python, timeout=30)
    assert facts["found"] is False and "exited with status 0: no output" in facts["error"]


def test_probe_answer_found_among_other_output(tmp_path):
    python = _script(tmp_path, "chatty", """\
        echo 'a library printing to stdout'
        echo 'LABKIT-PROBE {"found": true, "version": "9.9"}'
        echo 'more chatter'
        """)
    assert doctor._run_probe("torch", python, timeout=30) == {"found": True, "version": "9.9"}


# ------------------------------------------------------------------- each check's verdicts


def test_small_shm_warns_with_the_docker_fix(fresh):
    fresh.shm.total_bytes = fresh.shm.free_bytes = 64 << 20  # Docker's default
    shm = fresh.check("shm")
    assert shm.verdict == "warn" and "64.0 MiB" in shm.detail
    assert "--shm-size" in shm.fix and "--ipc=host" in shm.fix
    assert "fix: docker run --shm-size" in str(fresh)
    assert fresh.ok  # a warning does not fail the report


def test_full_shm_warns(fresh):
    fresh.shm.total_bytes, fresh.shm.free_bytes = 16 << 30, 100 << 20
    shm = fresh.check("shm")
    assert shm.verdict == "warn" and "free" in shm.detail and "stale files" in shm.fix


def test_shm_facts_from_a_real_path(tmp_path):
    facts = doctor._gather_shm(str(tmp_path))
    assert facts.total_bytes > 0 and facts.error is None
    assert doctor._gather_shm(str(tmp_path / "missing")).error.startswith("FileNotFoundError")


def test_gpus_nccl_arch_p2p_all_pass(with_gpus):
    for name in ("gpu", "nccl", "cuda_arch", "p2p"):
        assert with_gpus.check(name).verdict == "pass", with_gpus.check(name)
    assert "2 GPU(s): NVIDIA H200" in with_gpus.check("gpu").detail
    text = str(with_gpus)
    assert "[0] NVIDIA H200, 139.7 GiB, compute capability 9.0" in text
    assert "GPU0  yes   yes" in text


def test_nccl_missing_with_gpus_fails(with_gpus):
    with_gpus.torch.nccl_available = False
    nccl = with_gpus.check("nccl")
    assert nccl.verdict == "fail" and "CUDA build" in nccl.fix and not with_gpus.ok


def test_p2p_blocked_warns(with_gpus):
    with_gpus.p2p.matrix = [[True, False], [False, True]]
    p2p = with_gpus.check("p2p")
    assert p2p.verdict == "warn" and "0->1, 1->0" in p2p.detail and "topo -m" in p2p.fix
    assert "GPU0  yes   NO" in str(with_gpus)


def test_unsupported_compute_capability_fails(with_gpus):
    with_gpus.torch.gpus = [GPUFacts(0, "Tesla K80", 12 << 30, "3.7")]
    arch = with_gpus.check("cuda_arch")
    assert arch.verdict == "fail" and "3.7" in arch.detail and "sm_37" in arch.fix


@pytest.mark.parametrize("capability, arch_list, ok", [
    ("9.0", ["sm_80", "sm_90"], True),
    ("8.6", ["sm_80"], True),            # same major, newer minor: the sm_80 cubin runs
    ("9.0", ["sm_80"], False),
    ("9.0", ["sm_80", "compute_80"], True),  # PTX is compiled just in time for newer GPUs
    ("12.0", ["sm_90a", "sm_100"], False),
    ("10.0", ["sm_90a", "sm_100f"], True),
    ("7.5", [], True),                   # the build did not say: do not guess
])
def test_arch_supported(capability, arch_list, ok):
    assert doctor._arch_supported(capability, arch_list) is ok


def test_gpus_hidden_by_cuda_visible_devices_warn(fresh):
    fresh.torch.gpus, fresh.system.nvidia_devices, fresh.profile.visible_gpus = [], 4, 0
    gpu = fresh.check("gpu")
    assert gpu.verdict == "warn" and "CUDA_VISIBLE_DEVICES" in gpu.fix


def test_gpus_installed_but_torch_blind_fails(fresh):
    fresh.torch.found, fresh.torch.gpus, fresh.torch.cuda = True, [], None
    fresh.system.nvidia_devices = fresh.profile.visible_gpus = 2
    fresh.system.nvidia_driver = "560.35.03"
    gpu = fresh.check("gpu")
    assert gpu.verdict == "fail" and "CPU-only" in gpu.detail and "560.35.03" in gpu.fix


def test_gpus_installed_without_torch_defer_to_the_torch_check(fresh):
    fresh.torch = doctor.TorchFacts(error="ModuleNotFoundError: No module named 'torch'")
    fresh.system.nvidia_devices = fresh.profile.visible_gpus = 1
    gpu = fresh.check("gpu")
    assert gpu.verdict == "warn" and "torch did not load" in gpu.detail


def test_memlock_matters_only_with_gpus(with_gpus):
    with_gpus.memlock.soft_bytes = 8 << 20
    memlock = with_gpus.check("memlock")
    assert memlock.verdict == "warn" and "memlock=-1" in memlock.fix
    with_gpus.memlock.soft_bytes = None
    assert with_gpus.check("memlock").detail == "unlimited"
    with_gpus.memlock.error = "no resource module"
    assert with_gpus.check("memlock").verdict == "pass"


def test_tensorflow_without_gpu_on_a_gpu_machine_warns(with_gpus):
    with_gpus.tensorflow.found, with_gpus.tensorflow.devices = True, ["CPU:0"]
    tf = with_gpus.check("tensorflow")
    assert tf.verdict == "warn" and "and-cuda" in tf.fix
    with_gpus.tensorflow.devices = ["CPU:0", "GPU:0", "GPU:1"]
    assert with_gpus.check("tensorflow").verdict == "pass"


def test_torch_that_crashes_on_import_fails(fresh):
    fresh.torch.found, fresh.torch.error = False, "asking torch crashed with SIGSEGV: "
    torch = fresh.check("torch")
    assert torch.verdict == "fail" and "SIGSEGV" in torch.detail and "import torch" in torch.fix


def test_old_python_fails(fresh):
    fresh.python.version = "3.8.10"
    assert fresh.check("python").verdict == "fail" and not fresh.ok


def test_small_machine_warns(fresh):
    fresh.system.cpu_usable, fresh.system.memory_bytes = 1, 2 << 30
    assert fresh.check("system").verdict == "warn"


def test_nccl_slowdown_variables_warn(fresh):
    fresh.env.variables = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "0"}
    env = fresh.check("env")
    assert env.verdict == "warn" and env.detail.startswith("NCCL_P2P_DISABLE=1")
    assert "NCCL_IB_DISABLE" not in env.detail


def test_env_lists_relevant_variables_and_hides_secrets():
    env = doctor._gather_env({"NCCL_DEBUG": "INFO", "TORCH_HUB_TOKEN": "s3cr3t", "HOME": "/root",
                              "TF_CLI_CONFIG_FILE": "/x", "TF_CONFIG": "{}", "RANK": "0"})
    assert env.variables == {"NCCL_DEBUG": "INFO", "RANK": "0", "TF_CONFIG": "{}",
                             "TORCH_HUB_TOKEN": "***"}


def test_missing_jupyter_warns(fresh):
    fresh.jupyter.ipywidgets = None
    jupyter = fresh.check("jupyter")
    assert jupyter.verdict == "warn" and jupyter.fix == "pip install ipywidgets"


def test_socket_ifname_that_matches_nothing_fails(fresh):
    fresh.network.interfaces = [InterfaceFacts("lo", ["127.0.0.1"]),
                                InterfaceFacts("eth0", ["10.0.0.2"])]
    fresh.env.variables["NCCL_SOCKET_IFNAME"] = "ib0"
    network = fresh.check("network")
    assert network.verdict == "fail" and "NCCL_SOCKET_IFNAME=ib0" in network.detail
    assert "lo, eth0" in network.fix
    for ok in ("eth", "=eth0", "^docker,lo", "ib0,eth0"):
        fresh.env.variables["NCCL_SOCKET_IFNAME"] = ok
        assert fresh.check("network").verdict == "pass", ok
    fresh.env.variables["GLOO_SOCKET_IFNAME"] = "=eth"  # '=' asks for the exact name
    assert fresh.check("network").verdict == "fail"


def test_network_without_psutil_warns(fresh):
    fresh.network = doctor.NetworkFacts(error="psutil is not installed")
    assert fresh.check("network").verdict == "warn"


def test_network_hint_names_a_routable_interface(report):
    routable = [i for i in report.network.interfaces
                if i.ipv4 and i.up and not i.name.startswith("lo")]
    if routable:
        assert f"NCCL_SOCKET_IFNAME={routable[0].name}" in report.network.hint
    else:
        assert "only loopback" in report.network.hint


def test_bad_profile_fails(fresh, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "turbo")
    fresh.profile = doctor._gather_profile()
    profile = fresh.check("profile")
    assert profile.verdict == "fail" and "LABKIT_PROFILE" in profile.fix and not fresh.ok


def test_gpu_profile_without_gpus_warns(fresh):
    fresh.profile.name, fresh.profile.visible_gpus = "gpu", 0
    assert fresh.check("profile").verdict == "warn"


def test_check_rejects_unknown_verdict_and_report_unknown_name(report):
    with pytest.raises(ValueError, match="verdict"):
        Check("x", "maybe", "?")
    with pytest.raises(KeyError, match="no check named 'nope'"):
        report.check("nope")


@pytest.mark.parametrize("raw, text", [(8907, "8.9.7"), (92400, "9.24.0"), (None, None), (0, None)])
def test_cudnn_version(raw, text):
    assert doctor._cudnn_version(raw) == text


def test_driver_version():
    proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 2024"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release"
    assert doctor._driver_version(proprietary) == "550.54.15"
    assert doctor._driver_version(open_module) == "560.35.03"
    assert doctor._driver_version("garbage") is None


def test_human_bytes():
    assert [doctor._human_bytes(n) for n in (512, 2048, 64 << 20, 3 << 30)] == [
        "512 B", "2.0 KiB", "64.0 MiB", "3.0 GiB"]


# ------------------------------------------------------------------------------ main and CLI


def test_main_prints_and_returns_0_when_nothing_fails(report, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "run_doctor", lambda: report)
    assert doctor.main() == 0
    assert "-> ready" in capsys.readouterr().out
    assert doctor.main(json_output=True) == 0
    assert list(json.loads(capsys.readouterr().out)) == TOP_LEVEL_KEYS


def test_main_returns_1_when_a_check_fails(fresh, monkeypatch, capsys):
    fresh.torch.gloo_available = False
    monkeypatch.setattr(doctor, "run_doctor", lambda: fresh)
    assert doctor.main() == 1
    assert "NOT ready" in capsys.readouterr().out


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "labkit", "doctor", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=env)


def test_cli_json_parses_and_exits_0():
    out = _cli("--json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert list(data) == TOP_LEVEL_KEYS and data["ok"] is True
    assert data["torch"]["gloo_available"] is True


def test_cli_exits_1_when_a_check_fails(no_frameworks):
    env = dict(os.environ, LABKIT_PROFILE="turbo")  # an unknown profile is a failing check
    out = _cli("--json", env=env)
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    failed = {c["name"] for c in data["checks"] if c["verdict"] == "fail"}
    assert {"profile", "torch"} <= failed and data["ok"] is False
    text = _cli(env=env)
    assert text.returncode == 1 and "NOT ready" in text.stdout


# ------------------------------------------------------------------------------- on GPUs


@pytest.mark.gpu
def test_gpu_facts(report):
    n = cuda_gpus()
    assert len(report.torch.gpus) == n and report.torch.cuda_available
    for i, gpu in enumerate(report.torch.gpus):
        assert gpu.index == i and gpu.name and gpu.memory_bytes > 0
        major, minor = gpu.compute_capability.split(".")
        assert major.isdigit() and minor.isdigit()
    for name in ("gpu", "nccl", "cuda_arch"):
        assert report.check(name).verdict == "pass", report.check(name)
    assert report.torch.nccl and report.torch.cudnn and report.system.nvidia_driver


@pytest.mark.gpu
def test_gpu_p2p_matrix_and_topology(report):
    n = len(report.torch.gpus)
    if n > 1:
        assert len(report.p2p.matrix) == n and all(len(row) == n for row in report.p2p.matrix)
        assert all(report.p2p.matrix[i][i] for i in range(n))
    else:
        assert report.p2p.matrix == [] and report.check("p2p").verdict == "pass"
    if doctor.shutil.which("nvidia-smi"):
        assert report.p2p.topology and "GPU0" in report.p2p.topology
