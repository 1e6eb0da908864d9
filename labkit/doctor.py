"""Is this machine ready for distributed training? Facts as plain data, checks with a fix each.

One room past 800 lines on purpose: every fact about the machine feeds one report, and each
check reads the facts of the sections before it.

``run_doctor()`` gathers facts section by section (system, python, torch, p2p, tensorflow, shm,
memlock, env, jupyter, network, profile) and judges them with checks whose verdict is
``pass``, ``warn`` or ``fail``; every warning and failure carries a one-line fix.

torch and TensorFlow are each asked in a fresh interpreter (``sys.executable -c ...``): the
calling process stays framework-free, so a Jupyter kernel never initialises CUDA (which would
make later launches fragile) and never holds both frameworks at once (importing TensorFlow
next to torchvision crashes). A framework that is missing, crashes or hangs is reported as a
fact, never raised. From a shell: ``python -m labkit doctor [--json]``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from ._display import hang

__all__ = [
    "SECTIONS",
    "VERDICTS",
    "SHM_MIN_BYTES",
    "Check",
    "Report",
    "run_doctor",
    "run_checks",
    "main",
]

SECTIONS = (
    "system",
    "python",
    "torch",
    "p2p",
    "tensorflow",
    "shm",
    "memlock",
    "env",
    "jupyter",
    "network",
    "profile",
)
VERDICTS = ("pass", "warn", "fail")
GiB = 1 << 30
MiB = 1 << 20
# Docker gives a container 64 MiB of /dev/shm; DataLoader workers and NCCL's intra-node
# transport need far more, and the failure ("Bus error", NCCL "unhandled system error") is
# cryptic, so the doctor warns early.
SHM_MIN_BYTES = 1 * GiB
SHM_FIX = "docker run --shm-size=16g (or --ipc=host), or free space in /dev/shm"
MIN_PYTHON = (3, 10)
PROBE_TIMEOUT = 120.0  # seconds; a cold `import tensorflow` takes ~15 s on a 2-core machine
_PROBE_MARK = "LABKIT-PROBE "  # the probe's JSON line, found even among a library's own prints
_ENV_PREFIXES = ("CUDA_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                 "OPENBLAS_", "LABKIT_", "NVIDIA_", "MASTER_")
# TensorFlow's variables by name: a TF_ prefix would also catch other tools' (Terraform's).
_ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID",
              "SLURM_NTASKS", "LD_LIBRARY_PATH", "TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL",
              "TF_USE_LEGACY_KERAS", "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR",
              "TF_ENABLE_ONEDNN_OPTS", "KERAS_BACKEND")
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL", re.IGNORECASE)
# Variables that trade NCCL speed for a workaround; worth a warning when left set by accident.
_NCCL_SLOWDOWNS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
# The labkit checkout, so the probe interpreter imports this very labkit even when uninstalled.
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- facts, section by section


def _human_bytes(n) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_matrix(matrix) -> str:
    if not matrix:
        return "n/a (fewer than 2 GPUs)"
    head = "      " + " ".join(f"GPU{j:<2}" for j in range(len(matrix)))
    rows = [f"GPU{i:<2} " + " ".join(f"{'yes' if ok else 'NO':<5}" for ok in row)
            for i, row in enumerate(matrix)]
    return "\n".join([head, *rows])


@dataclass
class SystemFacts:
    os: str = ""
    kernel: str = ""
    machine: str = ""
    container: bool = False
    cpu_cores: int = 0
    cpu_usable: int = 0
    memory_bytes: int | None = None
    nvidia_devices: int = 0  # /dev/nvidiaN: GPUs installed, whatever CUDA_VISIBLE_DEVICES says
    nvidia_driver: str | None = field(default=None, metadata={"none": "not found"})


@dataclass
class PythonFacts:
    version: str = ""
    implementation: str = ""
    executable: str = ""
    labkit: str = ""


@dataclass
class GPUFacts:
    index: int = 0
    name: str = ""
    memory_bytes: int = 0
    compute_capability: str = ""

    def __str__(self) -> str:
        return (f"[{self.index}] {self.name}, {_human_bytes(self.memory_bytes)}, "
                f"compute capability {self.compute_capability}")


@dataclass
class TorchFacts:
    found: bool = False
    version: str | None = None
    cuda: str | None = field(default=None, metadata={"none": "none (CPU build)"})
    cudnn: str | None = None
    nccl: str | None = None
    gloo_available: bool = False
    nccl_available: bool = False
    cuda_available: bool = False
    arch_list: list = field(default_factory=list)
    gpus: list = field(default_factory=list, metadata={"empty": "none found"})
    cuda_error: str | None = None
    error: str | None = None


@dataclass
class P2PFacts:
    matrix: list = field(default_factory=list, metadata={"fmt": _fmt_matrix})
    topology: str | None = field(default=None, metadata={"none": "nvidia-smi not found"})
    error: str | None = None


@dataclass
class TensorFlowFacts:
    found: bool = False
    version: str | None = None
    keras: str | None = None
    built_with_cuda: bool = False
    devices: list = field(default_factory=list)
    error: str | None = None


@dataclass
class ShmFacts:
    path: str = "/dev/shm"
    total_bytes: int | None = None
    free_bytes: int | None = None
    error: str | None = None


@dataclass
class MemlockFacts:
    soft_bytes: int | None = field(default=None, metadata={"none": "unlimited"})
    hard_bytes: int | None = field(default=None, metadata={"none": "unlimited"})
    error: str | None = None


@dataclass
class EnvFacts:
    variables: dict = field(default_factory=dict, metadata={"empty": "none set"})


@dataclass
class JupyterFacts:
    jupyterlab: str | None = field(default=None, metadata={"none": "not installed"})
    ipywidgets: str | None = field(default=None, metadata={"none": "not installed"})
    ipykernel: str | None = field(default=None, metadata={"none": "not installed"})


@dataclass
class InterfaceFacts:
    name: str = ""
    ipv4: list = field(default_factory=list)
    up: bool = True

    def __str__(self) -> str:
        return f"{self.name} {' '.join(self.ipv4) or '(no IPv4)'}{'' if self.up else ' (down)'}"


@dataclass
class NetworkFacts:
    interfaces: list = field(default_factory=list)
    hint: str = ""
    error: str | None = None


@dataclass
class ProfileFacts:
    name: str | None = None
    visible_gpus: int = 0
    error: str | None = None


def _os_name() -> str:
    try:
        with open("/etc/os-release") as f:
            found = re.search(r'^PRETTY_NAME="?([^"\n]*)', f.read(), re.MULTILINE)
        if found:
            return found.group(1)
    except OSError:
        pass  # not Linux, or a minimal image: platform's name is good enough
    return platform.platform(terse=True)


def _driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version (proprietary or open kernel module)."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return found.group(1) if found else None


def _gather_system() -> SystemFacts:
    try:
        import psutil

        memory = psutil.virtual_memory().total
    except ImportError:
        memory = None
    try:
        with open("/proc/driver/nvidia/version") as f:
            driver = _driver_version(f.read())
    except OSError:
        driver = None  # no NVIDIA kernel module loaded (or not Linux)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return SystemFacts(
        os=_os_name(),
        kernel=platform.release(),
        machine=platform.machine(),
        container=os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
        cpu_cores=os.cpu_count() or 0,
        cpu_usable=usable or 0,
        memory_bytes=memory,
        nvidia_devices=len(glob.glob("/dev/nvidia[0-9]*")),
        nvidia_driver=driver,
    )


def _gather_python() -> PythonFacts:
    from . import __version__

    return PythonFacts(platform.python_version(), platform.python_implementation(),
                       sys.executable, __version__)


def _gather_shm(path: str) -> ShmFacts:
    try:
        usage = shutil.disk_usage(path)
    except OSError as e:
        return ShmFacts(path=path, error=f"{type(e).__name__}: {e}")
    return ShmFacts(path=path, total_bytes=usage.total, free_bytes=usage.free)


def _gather_memlock() -> MemlockFacts:
    try:
        import resource
    except ImportError:
        return MemlockFacts(error="the resource module is not available on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    return MemlockFacts(None if soft == unlimited else soft, None if hard == unlimited else hard)


def _gather_env(environ=None) -> EnvFacts:
    environ = os.environ if environ is None else environ
    found = {}
    for name in sorted(environ):
        if name.startswith(_ENV_PREFIXES) or name in _ENV_NAMES:
            # People paste this report into forums: never print anything that looks secret.
            found[name] = "***" if _SECRET.search(name) else environ[name]
    return EnvFacts(found)


def _gather_jupyter() -> JupyterFacts:
    from importlib.metadata import PackageNotFoundError, version

    def _version(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return JupyterFacts(_version("jupyterlab"), _version("ipywidgets"), _version("ipykernel"))


def _gather_network() -> NetworkFacts:
    try:
        import psutil
    except ImportError:
        return NetworkFacts(error="psutil is not installed (pip install psutil)")
    import socket

    stats = psutil.net_if_stats()
    interfaces = []
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        ipv4 = [a.address for a in addresses if a.family == socket.AF_INET]
        interfaces.append(InterfaceFacts(name, ipv4, stats[name].isup if name in stats else True))
    routable = [i.name for i in interfaces if i.ipv4 and i.up and not i.name.startswith("lo")]
    if routable:
        hint = (f"for multi-node runs pick the interface the nodes share, e.g. "
                f"NCCL_SOCKET_IFNAME={routable[0]} GLOO_SOCKET_IFNAME={routable[0]}")
    else:
        hint = "only loopback: single-node runs work, multi-node runs need a network interface"
    return NetworkFacts(interfaces, hint)


def _gather_profile() -> ProfileFacts:
    from . import profile

    try:
        name = profile.current()
    except profile.ProfileError as e:
        return ProfileFacts(None, profile.visible_gpu_count(), str(e))
    return ProfileFacts(name, profile.visible_gpu_count())


def _nvidia_smi_topology() -> tuple[str | None, str | None]:
    """``nvidia-smi topo -m``: how each GPU pair is linked (NVLink, PCIe switch, CPU socket)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi topo -m failed: {e}"
    if out.returncode != 0:
        return None, f"nvidia-smi topo -m failed: {(out.stderr or out.stdout).strip()}"
    return out.stdout.rstrip(), None


# ------------------------------------------------- probes: a framework in a fresh interpreter


def _cudnn_version(v: int | None) -> str | None:
    """cuDNN's integer version as text: 8907 is 8.9.7 (cuDNN 8), 92400 is 9.24.0 (cuDNN 9+)."""
    if not v:
        return None
    if v >= 10000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _probe_torch() -> dict:
    """Runs in the probe interpreter: torch's facts and the GPUs' peer-to-peer matrix."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return {"found": False, "error": f"{type(e).__name__}: {e}"}
    facts = {"found": True, "version": torch.__version__, "cuda": torch.version.cuda,
             "cudnn": _cudnn_version(torch.backends.cudnn.version()), "nccl": None,
             "gloo_available": dist.is_available() and dist.is_gloo_available(),
             "nccl_available": dist.is_available() and dist.is_nccl_available(),
             "cuda_available": torch.cuda.is_available(), "gpus": [], "p2p": []}
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # CPU-only builds have no NCCL to ask
        pass
    if not facts["cuda_available"]:
        if glob.glob("/dev/nvidia[0-9]*"):
            try:  # the driver is there but torch cannot use it: init() says why
                torch.cuda.init()
            except Exception as e:
                facts["cuda_error"] = f"{type(e).__name__}: {e}"
        return facts
    try:  # a GPU that fails to answer is a fact too, not a reason to lose the others
        facts["arch_list"] = torch.cuda.get_arch_list()
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                  "compute_capability": f"{p.major}.{p.minor}"})
        if n > 1:
            facts["p2p"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                            for i in range(n)]
    except Exception as e:
        facts["cuda_error"] = f"{type(e).__name__}: {e}"
    return facts


def _probe_tensorflow() -> dict:
    """Runs in the probe interpreter: TensorFlow's version and the devices it sees."""
    try:
        import tensorflow as tf
    except ImportError as e:
        return {"found": False, "error": f"{type(e).__name__}: {e}"}
    try:
        import keras

        keras_version = keras.__version__
    except ImportError:
        keras_version = None
    devices = [d.name.replace("/physical_device:", "") for d in tf.config.list_physical_devices()]
    return {"found": True, "version": tf.__version__, "keras": keras_version,
            "built_with_cuda": tf.test.is_built_with_cuda(), "devices": devices}


_PROBES = {"torch": _probe_torch, "tensorflow": _probe_tensorflow}


def _print_probe(name: str) -> None:
    """The probe interpreter's entry point: one marked JSON line on stdout."""
    print(_PROBE_MARK + json.dumps(_PROBES[name]()), flush=True)


def _why_exited(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"crashed with {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _run_probe(name: str, python: str, timeout: float) -> dict:
    """Ask ``python`` about framework ``name``; on any trouble, say what went wrong instead."""
    code = f"import labkit.doctor as d; d._print_probe({name!r})"
    path = [_PKG_ROOT, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter is not a fact
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"found": False, "error": f"asking {name} did not finish within {timeout:g} s"}
    except OSError as e:
        return {"found": False, "error": f"cannot run {python}: {e}"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith(_PROBE_MARK):
            try:
                return json.loads(line[len(_PROBE_MARK):])
            except json.JSONDecodeError:
                break
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {"found": False, "error": f"asking {name} {_why_exited(out.returncode)}: {tail}"}


def _known(cls, data: dict) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


# ----------------------------------------------------------------------- the report


@dataclass
class Check:
    """One verdict: ``pass``, ``warn`` or ``fail``, what was found and a one-line fix."""

    name: str
    verdict: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")

    def __str__(self) -> str:
        line = hang(f"  {self.verdict.upper():<4}  {self.name:<10}  ", self.detail)
        return line + ("\n" + hang(f"{'':20}fix: ", self.fix)
                       if self.fix and self.verdict != "pass" else "")


def _fmt_value(f: dataclasses.Field, value) -> list[str]:
    if "fmt" in f.metadata:
        return f.metadata["fmt"](value).splitlines()
    if value is None:
        return [f.metadata.get("none", "n/a")]
    if not value and isinstance(value, (list, dict)):
        return [f.metadata.get("empty", "none")]
    if isinstance(value, bool):
        return ["yes" if value else "no"]
    if f.name.endswith("_bytes"):
        return [_human_bytes(value)]
    if isinstance(value, dict):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list):
        return [str(v) for v in value] if not isinstance(value[0], str) else [", ".join(value)]
    return str(value).splitlines() or [""]


def _fmt_section(name: str, facts) -> str:
    lines = [name]
    for f in dataclasses.fields(facts):
        value = getattr(facts, f.name)
        if f.name.endswith("error") and value is None:
            continue  # most sections have no error; an empty line would only be noise
        shown = _fmt_value(f, value)
        lines.append(hang(f"  {f.name:<18}", shown[0]))
        lines += [hang(f"  {'':18}", more) for more in shown[1:]]
    return "\n".join(lines)


@dataclass
class Report:
    """Every section's facts; ``checks`` and ``ok`` are derived from them on each access.

    Example::

        >>> report = run_doctor()
        >>> report.ok, report.check("gloo").verdict
        (True, 'pass')
        >>> report.shm.total_bytes = 64 << 20      # what Docker gives by default
        >>> report.check("shm").verdict
        'warn'
    """

    system: SystemFacts
    python: PythonFacts
    torch: TorchFacts
    p2p: P2PFacts
    tensorflow: TensorFlowFacts
    shm: ShmFacts
    memlock: MemlockFacts
    env: EnvFacts
    jupyter: JupyterFacts
    network: NetworkFacts
    profile: ProfileFacts

    @property
    def checks(self) -> list[Check]:
        return run_checks(self)

    @property
    def ok(self) -> bool:
        """True when no check fails (warnings are allowed)."""
        return all(c.verdict != "fail" for c in self.checks)

    def check(self, name: str) -> Check:
        """The check called ``name`` (see ``[c.name for c in report.checks]``)."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}: {', '.join(c.name for c in self.checks)}")

    def to_dict(self) -> dict:
        """Plain data for JSON: one key per section, then ``checks`` and ``ok``."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        checks = self.checks
        out["checks"] = [dataclasses.asdict(c) for c in checks]
        out["ok"] = all(c.verdict != "fail" for c in checks)
        return out

    def report(self) -> str:
        """The readable text report: facts, then checks, then a one-line summary."""
        checks = self.checks
        counts = {v: sum(c.verdict == v for c in checks) for v in VERDICTS}
        summary = ", ".join(f"{n} {v}" for v, n in counts.items())
        verdict = "ready" if not counts["fail"] else "NOT ready: fix the failing checks first"
        parts = ["labkit doctor: is this machine ready for distributed training?"]
        parts += [_fmt_section(name, getattr(self, name)) for name in SECTIONS]
        parts.append("checks\n" + "\n".join(str(c) for c in checks))
        parts.append(f"summary: {summary} -> {verdict}")
        return "\n\n".join(parts)

    __str__ = report

    def _repr_pretty_(self, printer, cycle):  # IPython shows the report, not a dataclass dump
        printer.text(self.report())


def run_doctor(shm_path: str = "/dev/shm", *, python: str | None = None,
               timeout: float = PROBE_TIMEOUT) -> Report:
    """Gather every section's facts; torch and TensorFlow are asked in ``python`` subprocesses.

    ``shm_path`` is the shared-memory mount to measure; ``python`` the interpreter to ask about
    the frameworks (default: this one); ``timeout`` the seconds each probe may take.

    Example::

        >>> from labkit.doctor import run_doctor
        >>> report = run_doctor()
        >>> print(report)                        # the text report
        >>> report.to_dict()["torch"]["version"]
        '2.14.1+cu130'
    """
    python = python or sys.executable
    # The two probes are independent and mostly import time: run them side by side.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        torch_job = pool.submit(_run_probe, "torch", python, timeout)
        tf_job = pool.submit(_run_probe, "tensorflow", python, timeout)
        topology, topo_error = _nvidia_smi_topology()
        local = dict(system=_gather_system(), python=_gather_python(), shm=_gather_shm(shm_path),
                     memlock=_gather_memlock(), env=_gather_env(), jupyter=_gather_jupyter(),
                     network=_gather_network(), profile=_gather_profile())
        torch_data, tf_data = torch_job.result(), tf_job.result()
    torch = TorchFacts(**_known(TorchFacts, torch_data))
    torch.gpus = [GPUFacts(**_known(GPUFacts, g)) for g in torch.gpus]
    p2p = P2PFacts(torch_data.get("p2p", []), topology, topo_error)
    tensorflow = TensorFlowFacts(**_known(TensorFlowFacts, tf_data))
    return Report(torch=torch, p2p=p2p, tensorflow=tensorflow, **local)


# ----------------------------------------------------------------------- the checks


def _check_system(r: Report) -> Check:
    s = r.system
    memory = _human_bytes(s.memory_bytes) if s.memory_bytes else "unknown memory"
    detail = f"{s.cpu_usable} usable CPU cores, {memory}"
    if s.cpu_usable < 2 or (s.memory_bytes or GiB * 4) < 4 * GiB:
        return Check("system", "warn", f"{detail}: notebooks start 2+ workers, expect slow runs",
                     "give the machine or container at least 2 cores and 4 GiB (docker run --cpus)")
    return Check("system", "pass", detail)


def _check_python(r: Report) -> Check:
    version = tuple(int(p) for p in re.findall(r"\d+", r.python.version)[:2])
    if version < MIN_PYTHON:
        return Check("python", "fail", f"Python {r.python.version} is too old for labkit",
                     "use Python 3.10 or newer (the NGC container has one)")
    return Check("python", "pass", f"Python {r.python.version}")


def _check_torch(r: Report) -> Check:
    t = r.torch
    if t.found:
        return Check("torch", "pass", f"torch {t.version}" + (f", CUDA {t.cuda}" if t.cuda else ""))
    if "No module named" in (t.error or ""):
        return Check("torch", "fail", "torch is not installed",
                     "pip install torch (or work in nvcr.io/nvidia/pytorch, which has it)")
    return Check("torch", "fail", f"torch did not load: {t.error}",
                 "run `python -c 'import torch'` to see the whole error")


def _check_gloo(r: Report) -> Check:
    if r.torch.gloo_available:
        return Check("gloo", "pass", "gloo backend available (CPU collectives)")
    why = "torch has no gloo backend" if r.torch.found else "unknown: torch did not load"
    return Check("gloo", "fail", why, "install an official torch wheel, which ships gloo")


def _check_gpu(r: Report) -> Check:
    t, s = r.torch, r.system
    if t.gpus:
        names = sorted({g.name for g in t.gpus})
        return Check("gpu", "pass", f"{len(t.gpus)} GPU(s): {', '.join(names)}")
    if s.nvidia_devices and r.profile.visible_gpus == 0:
        return Check("gpu", "warn", f"{s.nvidia_devices} GPU(s) installed but CUDA_VISIBLE_DEVICES "
                     f"hides them all", "unset CUDA_VISIBLE_DEVICES (or list the GPUs to use)")
    if s.nvidia_devices and not t.found:
        return Check("gpu", "warn", f"{s.nvidia_devices} GPU(s) installed; whether torch can use "
                     "them is unknown (torch did not load)", "fix the torch check first")
    if s.nvidia_devices:
        why = t.cuda_error or ("torch is a CPU-only build" if not t.cuda else "CUDA is unusable")
        driver = s.nvidia_driver or "see nvidia-smi"
        return Check("gpu", "fail", f"{s.nvidia_devices} GPU(s) installed but torch sees none: "
                     f"{why}", f"install a torch build for this driver ({driver}), or use the NGC "
                     "container")
    return Check("gpu", "warn", "no CUDA GPU found: the notebooks run in the cpu profile (gloo)",
                 "for GPU runs use a machine with NVIDIA GPUs (docker run --gpus all ...)")


def _check_nccl(r: Report) -> Check:
    t = r.torch
    if not t.gpus:
        have = f" (NCCL {t.nccl} is present)" if t.nccl else ""
        return Check("nccl", "pass", f"not needed without GPUs{have}")
    if t.nccl_available:
        return Check("nccl", "pass", f"NCCL {t.nccl or '(version unknown)'} available")
    return Check("nccl", "fail", "GPUs found but torch has no NCCL backend",
                 "install a CUDA build of torch (pip's Linux default, or the NGC container)")


def _arch_supported(capability: str, arch_list: list[str]) -> bool:
    """Can a torch built for ``arch_list`` run on a GPU of this compute capability?

    A cubin ``sm_XY`` runs on the same major version with minor >= Y; PTX ``compute_XY`` is
    compiled just in time for any newer GPU.
    """
    if not arch_list:
        return True  # the build did not say: do not guess
    major, minor = (int(p) for p in capability.split("."))
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("afAF")  # sm_90a, sm_100f: family-specific variants
        if not digits.isdigit():
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def _check_cuda_arch(r: Report) -> Check:
    t = r.torch
    if not t.gpus:
        return Check("cuda_arch", "pass", "not needed without GPUs")
    bad = [g for g in t.gpus if not _arch_supported(g.compute_capability, t.arch_list)]
    if bad:
        cc = bad[0].compute_capability
        sm = "sm_" + cc.replace(".", "")
        gpu = f"compute capability {cc} ({bad[0].name})"
        return Check("cuda_arch", "fail", f"torch {t.version} has no kernels for {gpu}",
                     f"install a torch build that lists {sm} in torch.cuda.get_arch_list() "
                     "(newer torch, or the NGC container)")
    return Check("cuda_arch", "pass", "torch has kernels for every GPU's compute capability")


def _check_p2p(r: Report) -> Check:
    matrix = r.p2p.matrix
    if len(matrix) < 2:
        return Check("p2p", "pass", "not needed with fewer than 2 GPUs")
    blocked = [f"{i}->{j}" for i, row in enumerate(matrix) for j, ok in enumerate(row) if not ok]
    if blocked:
        return Check("p2p", "warn", f"no peer-to-peer access between GPUs {', '.join(blocked)}: "
                     "NCCL goes through host memory (correct, slower)",
                     "check `nvidia-smi topo -m`; PCIe ACS or a VM often blocks P2P")
    return Check("p2p", "pass", f"every pair of the {len(matrix)} GPUs has peer-to-peer access")


def _check_tensorflow(r: Report) -> Check:
    tf = r.tensorflow
    if not tf.found:
        if "No module named" in (tf.error or ""):
            return Check("tensorflow", "warn", "TensorFlow is not installed (only its notebooks "
                         "need it)", "pip install 'labkit[tensorflow]'")
        return Check("tensorflow", "warn", f"TensorFlow did not load: {tf.error}",
                     "run `python -c 'import tensorflow'` to see the whole error")
    detail = f"TensorFlow {tf.version}, devices: {', '.join(tf.devices) or 'none'}"
    if r.torch.gpus and not any(d.startswith("GPU") for d in tf.devices):
        return Check("tensorflow", "warn", f"{detail} (no GPU)",
                     "pip install 'tensorflow[and-cuda]'")
    return Check("tensorflow", "pass", detail)


def _check_shm(r: Report) -> Check:
    s = r.shm
    if s.total_bytes is None:
        return Check("shm", "warn", f"{s.path} not usable: {s.error}", SHM_FIX)
    if s.total_bytes < SHM_MIN_BYTES:
        return Check("shm", "warn", f"{s.path} is only {_human_bytes(s.total_bytes)}: DataLoader "
                     "workers and NCCL need more (Docker's default is 64 MiB)", SHM_FIX)
    if (s.free_bytes or 0) < SHM_MIN_BYTES:
        return Check("shm", "warn", f"{s.path} has only {_human_bytes(s.free_bytes or 0)} free",
                     f"delete stale files in {s.path} (ls -la {s.path}), or {SHM_FIX}")
    return Check("shm", "pass", f"{s.path} is {_human_bytes(s.total_bytes)}")


def _check_memlock(r: Report) -> Check:
    m = r.memlock
    limit = "unlimited" if m.soft_bytes is None else _human_bytes(m.soft_bytes)
    if m.error:
        return Check("memlock", "pass", f"unknown ({m.error})")
    if not r.torch.gpus:
        return Check("memlock", "pass", f"{limit} (only matters for GPUs)")
    if m.soft_bytes is not None:
        # NCCL pins host memory (and RDMA registers it); NVIDIA's containers ask for unlimited.
        return Check("memlock", "warn", f"locked-memory limit is {limit}",
                     "docker run --ulimit memlock=-1 --ulimit stack=67108864 (or raise it in "
                     "/etc/security/limits.conf)")
    return Check("memlock", "pass", "unlimited")


def _check_env(r: Report) -> Check:
    v = r.env.variables
    slow = [f"{k}={v[k]}" for k in _NCCL_SLOWDOWNS if v.get(k, "0") not in ("", "0")]
    if slow:
        names = " ".join(s.split("=")[0] for s in slow)
        return Check("env", "warn", f"{', '.join(slow)} makes NCCL slower",
                     f"unset {names} unless you set it to avoid a hang")
    return Check("env", "pass", f"{len(v)} relevant variable(s) set")


def _check_jupyter(r: Report) -> Check:
    j = r.jupyter
    missing = [n for n in ("jupyterlab", "ipywidgets") if getattr(j, n) is None]
    if missing:
        return Check("jupyter", "warn", f"{' and '.join(missing)} not installed",
                     f"pip install {' '.join(missing)}")
    return Check("jupyter", "pass", f"jupyterlab {j.jupyterlab}, ipywidgets {j.ipywidgets}")


def _ifname_matches(spec: str, names: list[str]) -> bool:
    """NCCL_SOCKET_IFNAME syntax: comma list of prefixes, ``=name`` exact, ``^...`` excludes."""
    if spec.startswith("^"):
        return True  # an exclusion list never selects a missing interface
    exact = spec.startswith("=")
    for item in spec.lstrip("=").split(","):
        item = item.strip()
        if item and any(n == item if exact else n.startswith(item) for n in names):
            return True
    return False


def _check_network(r: Report) -> Check:
    n = r.network
    if n.error:
        return Check("network", "warn", f"interfaces unknown: {n.error}", "pip install psutil")
    names = [i.name for i in n.interfaces]
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        spec = r.env.variables.get(var)
        if spec and not _ifname_matches(spec, names):
            return Check("network", "fail", f"{var}={spec} matches no interface here",
                         f"set {var} to one of: {', '.join(names)} (or unset it)")
    shown = ", ".join(str(i) for i in n.interfaces if i.ipv4) or "no IPv4 interface"
    return Check("network", "pass", shown, n.hint)


def _check_profile(r: Report) -> Check:
    p = r.profile
    if p.error:
        return Check("profile", "fail", p.error.split(":")[0],
                     "set LABKIT_PROFILE to smoke, cpu or gpu, or unset it")
    if p.name == "gpu" and p.visible_gpus == 0:
        return Check("profile", "warn", "profile gpu but no GPU visible: runs will fail or crawl",
                     "unset LABKIT_PROFILE (it then follows the hardware) or set it to cpu")
    return Check("profile", "pass", f"profile {p.name} ({p.visible_gpus} GPU(s) visible)")


_CHECKS = (_check_system, _check_python, _check_torch, _check_gloo, _check_gpu, _check_nccl,
           _check_cuda_arch, _check_p2p, _check_tensorflow, _check_shm, _check_memlock, _check_env,
           _check_jupyter, _check_network, _check_profile)


def run_checks(report: Report) -> list[Check]:
    """Judge the facts: one :class:`Check` per concern, always the same names in the same order.

    Example::

        >>> [c.name for c in run_checks(run_doctor())][:3]
        ['system', 'python', 'torch']
    """
    return [check(report) for check in _CHECKS]


def main(json_output: bool = False) -> int:
    """``python -m labkit doctor [--json]``: print the report; 1 if a check fails, else 0.

    Example::

        $ python -m labkit doctor            # the text report; exit status 1 if a check fails
        $ python -m labkit doctor --json > facts.json
    """
    report = run_doctor()
    print(json.dumps(report.to_dict(), indent=2) if json_output else report.report())
    return 0 if report.ok else 1
