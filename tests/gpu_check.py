"""`make gpu-check`: one prepared check of labkit's GPU paths, for a GPU machine lent for minutes.

Needs no venv and no Jupyter: a plain Python with torch, run from the checkout
(``PYTHONPATH=. python3 tests/gpu_check.py``). Parts, in this order, each in a subprocess with
its own time limit and all of them within ``--budget`` seconds (default 285, so the whole
stays under 5 minutes):

- environment: Python, torch, CUDA, cuDNN, NCCL, the GPUs;
- launch cold / warm: a trivial all_reduce on one NCCL rank, started fresh, then on warm
  workers (``launch(..., warm=True)``), where a run holding 1 GiB must leave CUDA memory as
  it found it;
- vgg16 bench: ``python -m labkit bench vgg16`` (images/s, TFLOP/s, MFU per variant);
- gpu tests: ``pytest -m gpu`` over the test files that mark tests gpu and that this Python
  can import (a file importing, say, nbformat at module level is left out and listed).

One summary at the end: a line per part (PASS / FAIL / SKIP, seconds, key figures), a failed
or timed-out part with its last output lines. Exit status 1 if a part failed, 2 without torch.
Without a CUDA GPU the GPU parts say "skipped: no CUDA GPU" and the check passes.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 285.0  # every part together: the check ends, summary printed, within 5 minutes
MIN_PART_S = 5.0  # a part with less time than this left is not started (and fails)
TAIL = 15  # output lines a failed part shows in the summary
MARK = "GPU-CHECK "  # a probe's one line of JSON for this script
WIDTH = 100  # the summary's lines
INDENT = 30  # where a part's figures start in them


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)  # the key figures, a line each
    tail: list[str] = field(default_factory=list)  # a failed part's last output lines


class Skipped(Exception):
    """The part cannot run here (no GPU, ...): its arguments are the summary's lines."""


class Failed(Exception):
    """The part failed: its arguments are the summary's lines, ``tail`` its last output."""

    def __init__(self, *lines: str, tail=()):
        super().__init__(*lines)
        self.tail = list(tail)[-TAIL:]


@dataclass
class Context:
    timeout: float = 0.0  # seconds the running part may take
    gpus: int = 0  # CUDA GPUs torch sees, found by the environment part
    facts: dict = field(default_factory=dict)  # what one part tells the next ones


@dataclass
class Part:
    name: str
    limit_s: float
    run: Callable[[Context], list[str]]  # the summary's lines; or raises Skipped / Failed


# ---- running parts ----------------------------------------------------------------------------

def run(cmd: list[str], timeout: float) -> tuple[int | None, list[str]]:
    """Run ``cmd`` in the checkout, echoing its output; returns (exit code or None if it ran past
    ``timeout`` and was stopped, its output lines)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            print(f"    {lines[-1]}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        code = None
    reader.join(timeout=5)
    return code, lines


def stop(proc: subprocess.Popen) -> None:
    """Interrupt ``proc`` (pytest then prints its summary, labkit stops its workers), then kill
    it and every process under it (torchrun runs in a session of its own)."""
    try:
        import psutil

        family = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # no psutil, or gone already
        family = []
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for p in family:
        try:
            p.kill()
        except Exception:  # gone already
            pass
    proc.kill()
    proc.wait()


def python(*args: str, timeout: float) -> list[str]:
    """Run this Python with ``args``; its output lines, or Failed with them."""
    code, lines = run([sys.executable, *args], timeout)
    if code is None:
        raise Failed(f"timed out after {timeout:.0f} s", tail=lines)
    if code != 0:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
        raise Failed(f"exit status {code}: {last}", tail=lines)
    return lines


def probed(lines: list[str]) -> dict:
    """The JSON a probe printed after MARK."""
    found = [line[len(MARK):] for line in lines if line.startswith(MARK)]
    if not found:
        raise Failed(f"the probe printed no {MARK.strip()} line", tail=lines)
    return json.loads(found[-1])


def run_parts(parts: list[Part], budget: float = BUDGET_S) -> list[Result]:
    """Each part in turn, with min(its limit, what is left of ``budget``) seconds."""
    ctx, deadline, results = Context(), time.monotonic() + budget, []
    for part in parts:
        ctx.timeout = min(part.limit_s, deadline - time.monotonic())
        start = time.monotonic()
        if ctx.timeout < MIN_PART_S:
            result = Result(part.name, "FAIL",
                            details=[f"not started: the {budget:.0f} s budget is spent"])
        else:
            print(f"\n>> {part.name} (at most {ctx.timeout:.0f} s)", flush=True)
            try:
                result = Result(part.name, "PASS", details=part.run(ctx))
            except Skipped as exc:
                result = Result(part.name, "SKIP", details=list(exc.args))
            except Failed as exc:
                result = Result(part.name, "FAIL", details=list(exc.args), tail=exc.tail)
            except Exception as exc:  # a bug in this script: a failed part, not a crash
                result = Result(part.name, "FAIL", details=[f"{type(exc).__name__}: {exc}"],
                                tail=traceback.format_exc().splitlines())
        result.seconds = time.monotonic() - start
        results.append(result)
        print(f"<< {part.name}: {result.status} in {result.seconds:.1f} s"
              + (f": {result.details[0]}" if result.status != "PASS" and result.details else ""),
              flush=True)
    return results


def summary(results: list[Result], seconds: float | None = None) -> str:
    """The one block printed at the end: a line per part (long ones wrapped), then the verdict."""
    out = ["", " gpu-check summary ".center(WIDTH, "=")]
    for r in results:
        lines = [piece for line in r.details or [""]
                 for piece in textwrap.wrap(line, WIDTH - INDENT, subsequent_indent="  ") or [""]]
        out.append(f"{r.status:<4}  {r.seconds:6.1f} s  {r.name:<12}  {lines[0]}".rstrip())
        out += [" " * INDENT + line for line in lines[1:]]
        out += [f"{'':<6}| {line}" for line in r.tail]
    failed = [r.name for r in results if r.status == "FAIL"]
    counts = ", ".join(f"{sum(r.status == s for r in results)} {s.lower()}"
                       for s in ("PASS", "SKIP", "FAIL"))
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    verdict = f"FAILED ({', '.join(failed)})" if failed else "PASS"
    out += ["=" * WIDTH, f"gpu-check: {verdict}: {counts}{took}"]
    return "\n".join(out)


def check(parts: list[Part], budget: float = BUDGET_S) -> int:
    """Run ``parts``, print the summary; 1 if one failed, else 0."""
    start = time.monotonic()
    results = run_parts(parts, budget)
    print(summary(results, time.monotonic() - start), flush=True)
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ---- which test files this Python can import --------------------------------------------------

def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def module_name(path: Path) -> str:
    name = ".".join(path.resolve().relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def module_imports(path: Path) -> list[str]:
    """What ``path`` imports at module level, in order (``from a import b``: a and a.b); the
    imports inside functions, ``try`` and ``if`` blocks are left out (they may be guarded)."""
    package = module_name(path)
    package = package if path.name == "__init__.py" else package.rpartition(".")[0]
    names = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *filter(None, [base])])
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def local_files(name: str) -> list[Path]:
    """The checkout's files that importing ``name`` runs, packages first; [] if not ours."""
    files, base = [], ROOT
    for part in name.split("."):
        base = base / part
        if (base / "__init__.py").is_file():
            files.append(base / "__init__.py")
        elif base.with_suffix(".py").is_file():
            files.append(base.with_suffix(".py"))
            break
        else:
            break
    return files


def first_missing_import(path: Path, seen: set | None = None) -> str | None:
    """The first module that importing ``path`` needs and this Python cannot find, following
    the checkout's own modules (``labkit``, ``tests``, ``solutions/*.py``); None if all are."""
    seen = set() if seen is None else seen
    seen.add(path)
    for name in module_imports(path):
        ours, top = local_files(name), name.split(".")[0]
        if not ours and not installed(top):
            # a module of one of the checkout's folders, which the test puts on sys.path itself
            ours = sorted(ROOT.glob(f"*/{top}.py"))[:1]
            if not ours:
                return top
        for file in ours:
            missing = None if file in seen else first_missing_import(file, seen)
            if missing:
                return missing
    return None


def has_gpu_tests(path: Path) -> bool:
    """Whether ``path`` marks tests ``gpu`` (as ``@pytest.mark.gpu`` or in ``pytestmark``)."""
    return "mark.gpu" in path.read_text()


def gpu_test_files(folder: Path | None = None) -> tuple[list[Path], dict[str, str]]:
    """The test files with gpu tests that this Python can import, and {file name: why not} for
    the files it cannot import."""
    runnable, left_out = [], {}
    for path in sorted((folder or ROOT / "tests").glob("test_*.py")):
        missing, gpu = first_missing_import(path), has_gpu_tests(path)
        if missing:
            left_out[path.name] = (f"imports {missing}: not installed"
                                   + ("" if gpu else "; it has no gpu tests"))
        elif gpu:
            runnable.append(path)
    return runnable, left_out


# ---- the parts --------------------------------------------------------------------------------

def emit(figures: dict) -> dict:
    """A probe's answer: one MARK line of JSON on stdout, for :func:`probed`."""
    print(MARK + json.dumps(figures), flush=True)
    return figures


def env_probe() -> dict:
    """In a subprocess: the versions, and the GPUs torch sees."""
    import platform

    import torch

    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        gpus.append(f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor})")
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:  # a CPU-only torch
        nccl = f"unavailable ({type(exc).__name__})"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return emit({"python": platform.python_version(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "cudnn": cudnn, "nccl": nccl, "gpus": gpus})


def probe(ctx: Context, call: str) -> dict:
    """Run ``gpu_check.<call>`` in a subprocess of this Python; the figures it emits."""
    code = f"from tests import gpu_check; gpu_check.{call}"
    return probed(python("-c", code, timeout=ctx.timeout))


def part_environment(ctx: Context) -> list[str]:
    env = probe(ctx, "env_probe()")
    ctx.gpus, ctx.facts["env"] = len(env["gpus"]), env
    gpus = (f"{len(env['gpus'])} GPU(s): {', '.join(env['gpus'])}" if env["gpus"]
            else "no CUDA GPU (torch.cuda.is_available() is False): the GPU parts skip")
    return [f"Python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, "
            f"cuDNN {env['cudnn']}, NCCL {env['nccl']}", gpus]


def needs_gpu(ctx: Context) -> None:
    if "env" not in ctx.facts:
        raise Skipped("skipped: the environment part failed, so the GPUs are unknown")
    if ctx.gpus == 0:
        raise Skipped("skipped: no CUDA GPU")


def _all_reduce(hold_mib: int = 0) -> dict:
    """A rank's trivial job: an all_reduce, with ``hold_mib`` MiB allocated while it runs."""
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    start = allocated()
    block = torch.empty(hold_mib << 20, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    t = torch.ones(1, device=block.device)
    dist.all_reduce(t)
    held = allocated()
    del block
    return {"sum": t.item(), "allocated_at_start": start, "allocated_holding": held}


def launch_probe(warm: bool, backend: str = "nccl") -> dict:
    """In a subprocess: cold, one launch; warm, three runs on warm workers (the first starts
    them, the second holds 1 GiB), then stop_workers(). Prints and returns the figures."""
    import labkit

    def timed(*args, **kwargs) -> dict:
        start = time.perf_counter()
        value = labkit.launch(_all_reduce, *args, nproc=1, backend=backend, timeout=45,
                              **kwargs).values[0]
        return {"seconds": time.perf_counter() - start, **value}

    if not warm:
        out = {"runs": [timed()]}
    elif not (hasattr(labkit, "workers") and hasattr(labkit, "stop_workers")):
        out = {"runs": None}
    else:
        runs = []
        try:
            runs += [timed(warm=True), timed(1024, warm=True), timed(warm=True)]
        finally:
            stopped = labkit.stop_workers()
        out = {"runs": runs, "stopped": stopped, "strays": labkit.stray_workers()}
    return emit(out)


def part_cold(ctx: Context) -> list[str]:
    needs_gpu(ctx)
    cold = probe(ctx, "launch_probe(warm=False)")["runs"][0]
    if cold["sum"] != 1:
        raise Failed(f"all_reduce of 1 on one rank gave {cold['sum']}")
    ctx.facts["cold_s"] = cold["seconds"]
    return [f"labkit.launch(nproc=1, backend='nccl'): {cold['seconds']:.2f} s, all_reduce ok"]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def judge_warm(out: dict, cold_s: float | None) -> list[str]:
    """The summary's lines for the warm probe's figures; Failed if memory was not given back,
    a sum is wrong, or a worker outlived stop_workers()."""
    if out["runs"] is None:
        raise Skipped("warm pools: not available in this checkout")
    first, holding, after = out["runs"]
    cold = f" (cold: {cold_s:.2f} s)" if cold_s is not None else ""
    starts = [_mib(r["allocated_at_start"]) for r in out["runs"]]
    lines = [f"warm: {holding['seconds']:.3f} s, {after['seconds']:.3f} s a run{cold}; "
             f"the first, {first['seconds']:.2f} s, starts the workers",
             f"CUDA allocated at each run's start: {starts[0]}, {starts[1]} (then "
             f"{_mib(holding['allocated_holding'])} holding 1 GiB), {starts[2]}"]
    problems = []
    if holding["allocated_holding"] - holding["allocated_at_start"] < 1 << 30:
        problems.append("the 1 GiB block was not allocated")
    if after["allocated_at_start"] != holding["allocated_at_start"]:
        problems.append("CUDA memory not back to baseline after the warm run holding 1 GiB")
    if any(r["sum"] != 1 for r in out["runs"]):
        problems.append(f"all_reduce sums {[r['sum'] for r in out['runs']]}, expected 1s")
    if out["strays"]:
        problems.append(f"workers left after stop_workers(): {'; '.join(out['strays'])}")
    if problems:
        raise Failed(*problems, *lines)
    return [*lines, f"memory back to baseline; stop_workers() stopped {out['stopped']} set(s), "
                    "no stray workers"]


def part_warm(ctx: Context) -> list[str]:
    needs_gpu(ctx)
    return judge_warm(probe(ctx, "launch_probe(warm=True)"), ctx.facts.get("cold_s"))


VGG_ROW = re.compile(r"^\s+((?:fp32|bf16)\S*)\s+(?:skipped: (.*)|([\d.]+)\s+(\S+)\s+(\S+))")


def vgg16_figures(lines: list[str]) -> list[str]:
    """The VGG16 table of ``python -m labkit bench vgg16``, a line per variant."""
    out = [line.split(" on ", 1)[-1] for line in lines if line.startswith("VGG16 training step")]
    for line in lines:
        m = VGG_ROW.match(line)
        if m and m[2]:
            out.append(f"{m[1]}: skipped: {m[2]}")
        elif m:
            out.append(f"{m[1]}: {float(m[3]):.0f} images/s, {m[4]} TFLOP/s, MFU {m[5]}")
    if len(out) < 2:
        raise Failed("no VGG16 figures in the output", tail=lines)
    return out


def part_vgg16(ctx: Context) -> list[str]:
    needs_gpu(ctx)
    return vgg16_figures(python("-m", "labkit", "bench", "vgg16", timeout=ctx.timeout))


def pytest_figures(lines: list[str]) -> tuple[dict, list[str]]:
    """(counts such as {'passed': 3}, the summary's lines) from ``pytest -v -rfEs`` output."""
    counts: dict[str, int] = {}
    for line in lines:  # the last "==== 3 passed, 1 skipped, 9 deselected in 4.2s ====" counts
        if line.startswith("=") and re.search(r" in [\d.]+s\b", line):
            found = re.findall(r"(\d+) (passed|failed|skipped|error|deselected|xfailed|xpassed)",
                               line)
            counts = {word: int(n) for n, word in found}
    figures = [", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "skipped", "failed"))
               + (f", {counts['error']} error(s)" if counts.get("error") else "")]
    reasons: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")):
            figures.append(line)
        m = re.match(r"SKIPPED \[(\d+)\] (\S+?):? (.*)", line)
        if m:
            reasons.setdefault(m[3], []).extend([m[2].removeprefix("tests/")] * int(m[1]))
    for reason, where in reasons.items():
        places = f" ({', '.join(dict.fromkeys(where))})" if len(where) <= 3 else ""
        figures.append(f"skipped {len(where)}: {reason}{places}")
    return counts, figures


def part_gpu_tests(ctx: Context) -> list[str]:
    files, left_out = gpu_test_files()
    not_run = [f"not run: {name} ({why})" for name, why in left_out.items()]
    cmd = ["-m", "pytest", "-m", "gpu", "-v", "-rfEs", "-p", "no:cacheprovider",
           "--continue-on-collection-errors"]
    if installed("pytest_timeout"):
        cmd.append("--timeout=120")  # one hung test fails alone, the others still run
    code, lines = run([sys.executable, *cmd, *(str(f.relative_to(ROOT)) for f in files)],
                      ctx.timeout)
    counts, figures = pytest_figures(lines)
    figures += not_run
    if code is None:
        raise Failed(f"timed out after {ctx.timeout:.0f} s", *figures, tail=lines)
    if code not in (0, 5):  # 5: no test selected
        raise Failed(*figures, tail=lines)
    if not counts.get("passed"):
        raise Skipped(*figures)
    return figures


PARTS = [
    Part("environment", 60, part_environment),
    Part("launch cold", 60, part_cold),
    Part("launch warm", 90, part_warm),
    Part("vgg16 bench", 150, part_vgg16),
    Part("gpu tests", 150, part_gpu_tests),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for all parts together (default {BUDGET_S:g})")
    args = parser.parse_args(argv)
    if not installed("torch"):
        print(f"gpu-check: torch is not installed for {sys.executable}: run it with a Python "
              "that has torch (make gpu-check PYTHON=/path/to/python)", file=sys.stderr)
        return 2
    return check(PARTS, args.budget)


if __name__ == "__main__":
    sys.exit(main())
