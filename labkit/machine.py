"""The machine card and the roofline, the code of notebook 11: what this machine can do, and
where each operation stands against it.

Three parts, one concept per function:

- Published limits: :data:`GPUS` holds NVIDIA's own figures for a few data-centre GPUs, each
  with its source; :func:`peak_flops` picks the right peak for an MFU (dense, the dtype the
  matmuls ran in, this exact part) and refuses the choices that inflate MFU.
- The machine card: :func:`measure_matmul_peak` and :func:`measure_bandwidth` measure this
  machine's compute and memory limits; :func:`measure_card` gathers them into a
  :class:`MachineCard`, which :func:`save_card` and :func:`load_card` keep in
  ``$LABKIT_HOME/machine.json``.
- The roofline: :func:`attainable_flops`, :func:`ridge_point` and :func:`bound`, the FLOPs and
  bytes of common operations (:func:`matmul_intensity` ...), and :func:`measure_op`, which
  times an operation so that a notebook can place it on the roofline. :func:`count_bytes`
  checks a byte count against what torch actually reads and writes.

Nothing here plots; every result is plain data. The three parts stay one room (past 800 lines)
because each reads the others: the card's peaks feed the roofline, the published limits sit
beside the card, and the op counts are what the roofline places.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ._display import wrap
from ._sizes import positive, whole
from .profile import current, knob

__all__ = ["GpuSpec", "GPUS", "DTYPES", "gpu_spec", "peak_flops", "explain_peak",
           "measure_matmul_peak", "measure_bandwidth", "copy_kernel", "triad_kernel",
           "copy_bytes", "triad_bytes",
           "count_bytes", "MachineCard", "CARD_VERSION", "card_path", "measure_card",
           "card_beside_spec",
           "save_card", "load_card", "attainable_flops", "ridge_point", "bound",
           "matmul_intensity", "add_intensity", "layernorm_intensity", "softmax_intensity",
           "attention_intensity", "measure_op"]

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Other spellings a learner may pass, mapped to the table's keys.
_ALIASES = {"float32": "fp32", "float": "fp32", "tensorfloat32": "tf32", "bfloat16": "bf16",
            "float16": "fp16", "half": "fp16", "float8": "fp8", "float8_e4m3fn": "fp8",
            "float8_e5m2": "fp8"}


# ---- published limits --------------------------------------------------------------------------


# H100 SXM and H200 SXM are the same GH100 chip at the same clocks (H200 has more and faster
# HBM): one set of dense peaks, NVIDIA's H100 whitepaper's unrounded figures, serves both.
_GH100_DENSE_TFLOPS = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU's published limits: dense peak TFLOP/s per dtype, HBM and NVLink GB/s.

    ``pattern`` is a regular expression (case-insensitive) that matches the names
    ``torch.cuda.get_device_name()`` reports for this exact part and no other: a PCIe or NVL
    card of the same family is a different part with lower peaks. ``fp32`` is the CUDA-core
    (non-tensor) rate; the others are tensor-core rates without sparsity. ``nvlink_GBps`` is
    the total of both directions per GPU, as NVIDIA prints it. ``source`` is where the
    figures come from and what it says.
    """

    name: str
    pattern: str
    dense_tflops: dict
    hbm_GBps: float
    nvlink_GBps: float
    source: str


GPUS = (
    GpuSpec(
        name="A100 SXM 80GB",
        pattern=r"\bA100[- ]SXM4?[- ]80\s?GB\b",  # torch: "NVIDIA A100-SXM4-80GB"
        dense_tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        hbm_GBps=2039.0, nvlink_GBps=600.0,
        source="NVIDIA A100 datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
               "Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, "
               "A100 80GB SXM column: FP32 19.5 TFLOPS; TF32 156 | 312* TFLOPS; BFLOAT16 and "
               "FP16 Tensor Core 312 | 624* TFLOPS (* with sparsity: the first figure is "
               "dense); GPU memory bandwidth 2,039GB/s; NVLink 600GB/s. No FP8."),
    GpuSpec(
        name="H100 SXM",
        # torch: "NVIDIA H100 80GB HBM3"; the PCIe ("H100 PCIe") and NVL cards are refused.
        pattern=r"^(?!.*\b(?:PCIe|NVL)\b).*\bH100\b.*\b(?:SXM5?|80GB HBM3)\b",
        dense_tflops=dict(_GH100_DENSE_TFLOPS),
        hbm_GBps=3350.0, nvlink_GBps=900.0,
        source="NVIDIA H100 product page, https://www.nvidia.com/en-us/data-center/h100/, H100 "
               "SXM column: FP32 67 TFLOPS; TF32 989*, BF16 and FP16 1,979*, FP8 3,958* "
               "teraFLOPS (* with sparsity: dense is half); GPU memory bandwidth 3.35TB/s; "
               "NVLink 900GB/s. Unrounded dense values from NVIDIA's H100 whitepaper (H100 "
               "SXM5: FP32 66.9, TF32 494.7, FP16/BF16 989.4, FP8 1978.9 TFLOPS), which is "
               "528 tensor cores x 1024 FLOP/clock x 1.83 GHz for BF16."),
    GpuSpec(
        name="H200 SXM",
        pattern=r"^(?!.*\b(?:PCIe|NVL)\b).*\bH200\b",  # torch: "NVIDIA H200"; not GH200
        dense_tflops=dict(_GH100_DENSE_TFLOPS),
        hbm_GBps=4800.0, nvlink_GBps=900.0,
        source="NVIDIA H200 product page, https://www.nvidia.com/en-us/data-center/h200/, H200 "
               "SXM column: FP32 67 TFLOPS; TF32 989*, BF16 and FP16 1,979*, FP8 3,958* "
               "TFLOPS (* with sparsity), the same rounded figures as H100 SXM (same GH100 "
               "chip), so the H100 whitepaper's unrounded dense values are used; GPU memory "
               "bandwidth 4.8TB/s; NVLink 900GB/s."),
    GpuSpec(
        name="B200 SXM",
        # torch: "NVIDIA B200"; GB200 (two B200s beside a Grace CPU, clocked higher) and B300
        # are other parts with other peaks, and \bB200\b does not match inside "GB200".
        pattern=r"\bB200\b",
        dense_tflops={"fp32": 80.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0,
                      "fp8": 4500.0},
        hbm_GBps=8000.0, nvlink_GBps=1800.0,
        source="NVIDIA HGX platform page, https://www.nvidia.com/en-us/data-center/hgx/, and "
               "DGX B200 datasheet, https://resources.nvidia.com/en-us-dgx-systems/"
               "dgx-b200-datasheet: figures for 8 GPUs with sparsity (FP4 144 PFLOPS, 14.4 "
               "TB/s of NVLink in all), divided per GPU and halved for dense in stas00/"
               "ml-engineering's accelerator table (compute/accelerator/README.md, B200 SXM: "
               "FP32 80, TF32 1,125, FP16 and BF16 2,250, FP8 4,500 TFLOPS without sparsity; "
               "HBM3e 8.00 TB/s); NVLink 1.8 TB/s per GPU. Peaks at the 1,000 W HGX power."),
)


def _dtype_key(dtype) -> str:
    """``dtype`` as one of :data:`DTYPES`: strings, aliases and torch dtypes accepted."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a name such as 'bf16' or a torch.dtype, got "
                        f"{type(dtype).__name__}")
    key = dtype.strip().lower()
    if "sparse" in key:
        raise ValueError(f"dtype {dtype!r} names a sparse peak: peaks are dense unless you "
                         f"pass sparse=True, which is right only for 2:4 sparse matmuls")
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return key


def gpu_spec(device_name: str) -> GpuSpec:
    """The :class:`GpuSpec` whose pattern matches ``device_name``, or a ValueError.

    There is no closest match: an unknown part never borrows another part's peak (an H100
    PCIe measured against the H100 SXM's peak, or an unknown GPU against an H100's, is how
    MFUs above 100 % get reported).

    Example::

        >>> gpu_spec("NVIDIA H100 80GB HBM3").name
        'H100 SXM'
    """
    if not isinstance(device_name, str) or not device_name.strip():
        raise TypeError("device_name must be a GPU's name, e.g. torch.cuda.get_device_name()")
    for spec in GPUS:
        if re.search(spec.pattern, device_name, flags=re.IGNORECASE):
            return spec
    known = ", ".join(spec.name for spec in GPUS)
    raise ValueError(f"no published peak for {device_name!r} (labkit knows {known}; a PCIe "
                     f"or NVL card is another part): pass the dense peak from your part's data "
                     f"sheet yourself, or measure one with measure_matmul_peak()")


def peak_flops(device_name: str, dtype, *, sparse: bool = False) -> float:
    """The published peak FLOP/s of ``device_name`` at ``dtype``: dense unless ``sparse``.

    MFU divides the FLOP/s a run achieved by this number, so three choices matter: the exact
    part (an unknown one is refused), the dtype the matmuls ran in (fp32 matmuls with TF32
    enabled run at the ``tf32`` peak) and dense: NVIDIA's headline tensor-core figures assume
    2:4 structured sparsity, twice the dense rate, which ordinary training never uses.

    Example::

        >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
        989400000000000.0
    """
    if not isinstance(sparse, bool):
        raise TypeError(f"sparse must be True or False, got {sparse!r}")
    spec = gpu_spec(device_name)
    key = _dtype_key(dtype)
    if key not in spec.dense_tflops:
        have = ", ".join(spec.dense_tflops)
        raise ValueError(f"the {spec.name} has no published {key} peak (it has {have}): "
                         f"compare against the dtype your matmuls actually ran in")
    if sparse and key == "fp32":
        raise ValueError("fp32 runs on CUDA cores, which have no sparse rate: use sparse=False")
    # Sparse peaks are the dense ones doubled: 2:4 sparsity skips half the multiplications.
    return spec.dense_tflops[key] * 1e12 * (2 if sparse else 1)


def explain_peak(device_name: str, dtype, *, sparse: bool = False) -> str:
    """One sentence on which peak :func:`peak_flops` picks: part, dtype, dense, source.

    Example::

        >>> print(explain_peak("NVIDIA A100-SXM4-80GB", "bf16"))
        'NVIDIA A100-SXM4-80GB' is the A100 SXM 80GB: bf16 dense peak 312 TFLOP/s, from ...
    """
    flops = peak_flops(device_name, dtype, sparse=sparse)
    spec = gpu_spec(device_name)
    url = re.search(r"https?://\S+", spec.source)
    kind = "sparse (2:4)" if sparse else "dense"
    return wrap(f"{device_name!r} is the {spec.name}: {_dtype_key(dtype)} {kind} peak "
                f"{flops / 1e12:g} TFLOP/s, from {url.group(0).rstrip(',') if url else '?'}")


# ---- measuring this machine --------------------------------------------------------------------


def _device(device) -> torch.device:
    """``device`` as a torch.device; None is the GPU when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc


def _sync(device) -> None:
    """Wait for the GPU: CUDA calls return before the kernels finish, so clocks would lie."""
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_seconds(fn, repeats: int, device, *, pick=statistics.median,
                   min_s: float = 2e-3) -> float:
    """Seconds of one ``fn()`` call over ``repeats`` timed rounds, after one warm-up: the
    rounds' median, or ``pick=min`` for a limit of the machine.

    A call shorter than the clock can resolve is timed in a batch of calls long enough to
    take about ``min_s``, and the batch's time divided by its length. A busy moment only
    slows a round down, so the fastest round is the closest to what the machine can do:
    the card's peak and bandwidths take it, as STREAM reports its best rate from the
    minimum time.
    """
    _sync(device)
    start = time.perf_counter()
    fn()  # warm-up: first-call costs (allocation, kernel selection) stay out of the rounds
    _sync(device)
    first = time.perf_counter() - start
    calls = max(1, min(10_000, math.ceil(min_s / max(first, 1e-9))))
    rounds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        rounds.append((time.perf_counter() - start) / calls)
    return pick(rounds)


_MATMUL_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                  "fp16": torch.float16}


def measure_matmul_peak(dtype="fp32", device=None, sizes=None, *, repeats: int = 5) -> dict:
    """This machine's matmul FLOP/s at ``dtype``: square (n, n) @ (n, n) at growing n.

    Each matmul is ``2 n^3`` FLOPs (n^3 multiplications, n^3 additions); each size's rate
    is that of the fastest of ``repeats`` rounds (another program only slows a round
    down), and the peak is the best size's, since small matmuls cannot keep every core
    busy. ``tf32`` is fp32 with TensorFloat-32 tensor cores allowed (CUDA only). ``sizes``
    defaults by profile: tiny in smoke, up to 8192 on GPUs.
    Returns ``{"dtype", "device", "peak_flops", "best_n", "rows"}``, a row per size.

    Example::

        >>> r = measure_matmul_peak("fp32", "cpu", sizes=(256, 512))
        >>> r["peak_flops"] > 0, [row["n"] for row in r["rows"]]
        (True, [256, 512])
    """
    key = _dtype_key(dtype)
    dev = _device(device)
    if key not in _MATMUL_DTYPES:
        raise ValueError(f"{key} matmuls need per-tensor scales (torch._scaled_mm), not a "
                         f"plain matmul: measure one of {', '.join(_MATMUL_DTYPES)} here")
    if key == "tf32" and dev.type != "cuda":
        raise ValueError("tf32 is a GPU tensor-core format: on a CPU measure 'fp32'")
    sizes = knob((1024, 2048, 4096, 8192), cpu=(128, 256, 512, 1024),
                 smoke=(16, 32)) if sizes is None else sizes
    sizes = [whole(n, "each of sizes") for n in sizes]
    if not sizes:
        raise ValueError("sizes must name at least one matrix size, e.g. (256, 512)")
    whole(repeats, "repeats")
    # fp32 and tf32 differ only in this switch; set it for the measurement, then restore it.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if key == "tf32" else "highest")
    rows = []
    try:
        for n in sizes:
            a = torch.randn(n, n, device=dev).to(_MATMUL_DTYPES[key])
            b = torch.randn(n, n, device=dev).to(_MATMUL_DTYPES[key])
            out = torch.empty_like(a)  # written in place: the clock times the matmul alone
            seconds = _round_seconds(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out),
                                     repeats, dev, pick=min)
            rows.append({"n": n, "flops": 2 * n**3, "seconds": seconds,
                         "flops_per_s": 2 * n**3 / seconds})
    finally:
        torch.set_float32_matmul_precision(precision)
    best = max(rows, key=lambda r: r["flops_per_s"])
    return {"dtype": key, "device": str(dev), "peak_flops": best["flops_per_s"],
            "best_n": best["n"], "rows": rows}


def copy_bytes(nbytes: int) -> int:
    """Bytes a copy of an ``nbytes`` array moves: ``dst.copy_(src)`` reads src, writes dst."""
    return 2 * whole(nbytes, "nbytes")


def triad_bytes(nbytes: int) -> int:
    """Bytes the triad ``a = b + s * c`` moves on ``nbytes`` arrays: reads b, c; writes a."""
    return 3 * whole(nbytes, "nbytes")


def copy_kernel(dst, src) -> None:
    """STREAM's copy, the kernel :func:`measure_bandwidth` times: ``dst[:] = src``."""
    dst.copy_(src)


def triad_kernel(a, b, c, scalar: float) -> None:
    """STREAM's triad, the kernel :func:`measure_bandwidth` times: ``a[:] = b + scalar * c``."""
    torch.add(b, c, alpha=scalar, out=a)  # one kernel writing into a: no temporary array


def _llc_bytes() -> int | None:
    """The CPU's largest cache in bytes as Linux reports it, or None where it cannot tell."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def measure_bandwidth(device=None, nbytes=None, *, repeats: int = 5) -> dict:
    """This machine's memory bandwidth in GB/s (1e9 bytes/s): copy and triad, STREAM-style.

    Copy ``dst.copy_(src)`` moves :func:`copy_bytes` (src read, dst written), triad
    ``a = b + s * c`` moves :func:`triad_bytes` (b and c read, a written), counted as STREAM
    counts them. A CPU also reads each destination line before writing it (write-allocate),
    so its memory moves more than this: the convention slightly understates what the
    hardware does. Each array is ``nbytes`` of float32; on a CPU the default is four times
    the last-level cache (at least 64 MiB), so the arrays come from memory, not from cache.
    Each rate is the fastest of ``repeats`` rounds, as STREAM reports its best rate.

    Example::

        >>> r = measure_bandwidth("cpu", 1 << 26)
        >>> r["copy_GBps"] > 0, r["triad_GBps"] > 0
        (True, True)
    """
    dev = _device(device)
    if nbytes is None:
        cpu_default = max(4 * (_llc_bytes() or 1 << 26), 1 << 26)
        nbytes = (1 << 30) if dev.type == "cuda" else knob(cpu_default, smoke=1 << 20)
    whole(nbytes, "nbytes", low=4, hint=" (four bytes make one float32)")
    whole(repeats, "repeats")
    n = nbytes // 4
    nbytes = 4 * n  # a whole number of float32 elements
    a, b, c = (torch.full((n,), v, device=dev) for v in (0.0, 1.0, 2.0))
    copy_s = _round_seconds(lambda: copy_kernel(a, b), repeats, dev, pick=min)
    triad_s = _round_seconds(lambda: triad_kernel(a, b, c, 3.0), repeats, dev, pick=min)
    return {"device": str(dev), "nbytes": nbytes, "copy_bytes": copy_bytes(nbytes),
            "triad_bytes": triad_bytes(nbytes), "copy_s": copy_s, "triad_s": triad_s,
            "copy_GBps": copy_bytes(nbytes) / copy_s / 1e9,
            "triad_GBps": triad_bytes(nbytes) / triad_s / 1e9}


def count_bytes(fn) -> dict:
    """The bytes ``fn()`` reads and writes, counted op by op as torch dispatches them.

    Every tensor an operator takes is counted as read once, every tensor it returns (or
    writes in place, like ``copy_``'s destination or an ``out=`` argument) as written once:
    the convention the roofline uses, checked against what torch really runs. A tensor that
    an op both reads and writes in place (``add_``) counts as written only.

    Example::

        >>> a, b = torch.zeros(1000), torch.ones(1000)
        >>> count_bytes(lambda: a.copy_(b))
        {'read': 4000, 'written': 4000, 'ops': ['aten.copy_.default']}
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    if not callable(fn):
        raise TypeError(f"fn must be a callable, e.g. lambda: a.copy_(b), got "
                        f"{type(fn).__name__}")
    totals = {"read": 0, "written": 0, "ops": []}

    def size(value):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            wrote_in_place = False
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    totals["written"] += size(value)
                    wrote_in_place = True
                else:
                    totals["read"] += size(value)
            if not wrote_in_place:
                totals["written"] += size(result)
            totals["ops"].append(str(func))
            return result

    with Counter():
        fn()
    return totals


# ---- the machine card --------------------------------------------------------------------------

CARD_VERSION = 2  # 2: memory_GiB and allreduce_ranks, for the planner's "this machine"


def _positive(value, name: str) -> float:
    return positive(value, name, what="a positive, finite number")


@dataclasses.dataclass
class MachineCard:
    """This machine's measured limits: what the roofline and MFU of later notebooks use.

    ``device`` is ``"cpu"`` or ``"cuda"``; ``model`` the CPU's or GPU's name; ``cores`` the
    CPU threads torch computed with; ``cpus`` the logical CPUs the machine lets this process
    use (workers that together run more threads than that share them). ``peak_flops`` maps
    a dtype to measured matmul FLOP/s, ``copy_GBps`` and ``triad_GBps`` are memory
    bandwidths (:func:`measure_bandwidth`). ``memory_GiB`` is the device's memory (a GPU's,
    or the RAM all CPU workers share). ``alpha_s`` and ``beta_GBps`` are the all-reduce's
    latency and bandwidth fitted by ``labkit.bench.fit_alpha_beta`` (its ``alpha_s`` and
    ``bandwidth_GBps``, the algbw) over ``allreduce_ranks`` workers, or None when not
    measured. ``profile`` is the labkit profile it was measured under (a smoke card's sizes
    are too small to mean anything). A card checks itself when built.

    Example::

        >>> card = MachineCard("cpu", "AMD EPYC", 2, 2, {"fp32": 5.0e10}, 12.0, 13.5, 16.0)
        >>> card.ridge_point("fp32")             # FLOP per byte, against the triad bandwidth
        3.7037037037037037
    """

    device: str
    model: str
    cores: int
    cpus: int
    peak_flops: dict
    copy_GBps: float
    triad_GBps: float
    memory_GiB: float
    alpha_s: float | None = None
    beta_GBps: float | None = None
    allreduce_ranks: int | None = None
    torch_version: str = torch.__version__
    profile: str = dataclasses.field(default_factory=current)
    version: int = CARD_VERSION

    def __post_init__(self):
        for name in ("device", "model", "torch_version", "profile"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got "
                                 f"{getattr(self, name)!r}")
        whole(self.cores, "cores")
        whole(self.cpus, "cpus")
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError("peak_flops must map at least one dtype to FLOP/s, e.g. "
                             "{'fp32': 5e10}")
        self.peak_flops = {_dtype_key(k): _positive(v, f"peak_flops[{k!r}]")
                           for k, v in self.peak_flops.items()}
        self.copy_GBps = _positive(self.copy_GBps, "copy_GBps")
        self.triad_GBps = _positive(self.triad_GBps, "triad_GBps")
        self.memory_GiB = _positive(self.memory_GiB, "memory_GiB")
        if len({self.alpha_s is None, self.beta_GBps is None, self.allreduce_ranks is None}) > 1:
            raise ValueError("alpha_s, beta_GBps and allreduce_ranks come from one fit over "
                             "some workers: give all three or none")
        if self.alpha_s is not None:
            whole(self.allreduce_ranks, "allreduce_ranks")
            if self.allreduce_ranks < 2:
                raise ValueError(f"an all-reduce fit needs 2 or more workers, got "
                                 f"allreduce_ranks={self.allreduce_ranks}")
            # An infinite bandwidth means the fit saw no growth with size: not a measurement.
            self.beta_GBps = _positive(self.beta_GBps, "beta_GBps")
            if (isinstance(self.alpha_s, bool) or not isinstance(self.alpha_s, (int, float))
                    or not math.isfinite(self.alpha_s) or self.alpha_s < 0):
                raise ValueError(f"alpha_s must be a latency >= 0 s, got {self.alpha_s!r}")
            self.alpha_s = float(self.alpha_s)
        if self.version != CARD_VERSION:
            raise ValueError(f"this labkit reads machine cards of version {CARD_VERSION}, "
                             f"got {self.version!r}: measure the card again")

    def ridge_point(self, dtype="fp32") -> float:
        """FLOP per byte where this machine turns compute-bound: peak / triad bandwidth."""
        key = _dtype_key(dtype)
        if key not in self.peak_flops:
            raise ValueError(f"the card has no {key} peak (it has {', '.join(self.peak_flops)})"
                             f": measure it with measure_card(dtypes=[..., {key!r}])")
        return ridge_point(self.peak_flops[key], self.triad_GBps * 1e9)


def card_path() -> Path:
    """Where the card lives: ``$LABKIT_HOME/machine.json`` (``~/.labkit`` by default)."""
    return Path(os.environ.get("LABKIT_HOME") or Path.home() / ".labkit") / "machine.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gib(dev: torch.device) -> float:
    """The device's memory in GiB: the GPU's, or the RAM (capped by a cgroup's limit, as in a
    container started with ``--memory``)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory / 2**30
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            ram = min(ram, int(limit))
    except OSError:
        pass
    return ram / 2**30


def measure_card(device=None, dtypes=None, *, alpha_beta: dict | None = None,
                 allreduce_ranks: int | None = None, sizes=None, nbytes=None,
                 repeats: int = 5) -> MachineCard:
    """Measure this machine once: matmul peak per dtype, copy and triad bandwidth, memory.

    ``dtypes`` defaults to fp32 and bf16 on a CPU, and fp32, tf32, bf16, fp16 on a GPU.
    ``alpha_beta`` is ``labkit.bench.fit_alpha_beta``'s result for this machine's
    all-reduce over ``allreduce_ranks`` workers, when notebook 00 measured one. ``sizes`` and
    ``nbytes`` go to :func:`measure_matmul_peak` and :func:`measure_bandwidth`.

    Example::

        >>> card = measure_card("cpu")
        >>> save_card(card)                       # then load_card() in any later notebook
    """
    dev = _device(device)
    if dtypes is None:
        dtypes = ("fp32", "tf32", "bf16", "fp16") if dev.type == "cuda" else ("fp32", "bf16")
    if isinstance(dtypes, (str, torch.dtype)) or not dtypes:
        raise ValueError(f"dtypes must be a non-empty list, e.g. ['fp32', 'bf16'], got "
                         f"{dtypes!r}")
    alpha = beta = None
    if alpha_beta is not None:
        if not isinstance(alpha_beta, dict) or not {"alpha_s", "bandwidth_GBps"} <= set(
                alpha_beta):
            raise ValueError("alpha_beta must be labkit.bench.fit_alpha_beta(rows)'s dict, "
                             "with 'alpha_s' and 'bandwidth_GBps'")
        alpha, beta = alpha_beta["alpha_s"], alpha_beta["bandwidth_GBps"]
        if allreduce_ranks is None:
            raise ValueError("give allreduce_ranks=, the number of workers the all-reduce "
                             "behind alpha_beta ran on: its bandwidth depends on it")
    peaks = {_dtype_key(d): measure_matmul_peak(d, dev, sizes, repeats=repeats)["peak_flops"]
             for d in dtypes}
    bandwidth = measure_bandwidth(dev, nbytes, repeats=repeats)
    model = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_model()
    return MachineCard(device=dev.type, model=model, cores=torch.get_num_threads(),
                       cpus=len(os.sched_getaffinity(0)),
                       peak_flops=peaks, copy_GBps=bandwidth["copy_GBps"],
                       triad_GBps=bandwidth["triad_GBps"], memory_GiB=_memory_gib(dev),
                       alpha_s=alpha, beta_GBps=beta,
                       allreduce_ranks=allreduce_ranks if alpha_beta is not None else None,
                       profile=current())


def save_card(card: MachineCard, path=None) -> Path:
    """Write ``card`` as JSON to ``path`` (default :func:`card_path`); return the path.

    The card goes to a temporary file in the same folder first, which then replaces the old
    card in one step (``os.replace``): a crash or a full disk mid-write leaves the old card
    whole, never half a new one.
    """
    if not isinstance(card, MachineCard):
        raise TypeError(f"card must be a MachineCard (from measure_card), got "
                        f"{type(card).__name__}")
    path = Path(path) if path is not None else card_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(card), f, indent=2)
            f.flush()
            os.fsync(f.fileno())  # on disk before it takes the card's name
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_card(path=None) -> MachineCard:
    """The card :func:`save_card` wrote to ``path`` (default :func:`card_path`).

    Example::

        >>> card = load_card()
        >>> card.peak_flops["fp32"] / 1e9, card.triad_GBps      # GFLOP/s, GB/s
        (48.2, 11.9)
    """
    path = Path(path) if path is not None else card_path()
    redo = "run notebook 00's machine-card cell again to measure a new one"
    if not path.exists():
        raise FileNotFoundError(f"no machine card at {path}: run notebook 00's machine-card "
                                f"cell (labkit.machine.save_card(labkit.machine.measure_card())"
                                f") first")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the machine card {path} is damaged ({exc}): {redo}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no machine card (a JSON object): {redo}")
    if data.get("version") != CARD_VERSION:
        raise ValueError(f"the machine card {path} is version {data.get('version')!r}; this "
                         f"labkit reads version {CARD_VERSION}: {redo}")
    fields = {f.name for f in dataclasses.fields(MachineCard)}
    if set(data) != fields:
        raise ValueError(f"the machine card {path} lacks {sorted(fields - set(data))} or has "
                         f"unknown {sorted(set(data) - fields)}: {redo}")
    try:
        return MachineCard(**data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the machine card {path} is damaged ({exc}): {redo}") from exc


def card_beside_spec(card: MachineCard) -> list[dict] | None:
    """A GPU's measured limits beside its data sheet's, for a part :data:`GPUS` knows.

    One row per figure both have: each dtype's matmul peak against the dense peak, and the
    card's copy bandwidth against the HBM bandwidth; ``measured``, ``published`` (FLOP/s or
    bytes/s) and ``fraction``, the first over the second. None for a CPU, or for a GPU
    whose exact part :func:`gpu_spec` does not know: no other part's figures are borrowed.

    Example::

        >>> [(r["what"], round(r["fraction"], 2)) for r in card_beside_spec(load_card())]
        [('fp32 matmul', 0.77), ('bf16 matmul', 0.74), ..., ('memory (copy)', 0.88)]
    """
    if not isinstance(card, MachineCard):
        raise TypeError(f"card must be a MachineCard (from measure_card or load_card), got "
                        f"{type(card).__name__}")
    if card.device != "cuda":
        return None
    try:
        spec = gpu_spec(card.model)
    except ValueError:
        return None
    rows = [{"what": f"{key} matmul", "measured": flops,
             "published": spec.dense_tflops[key] * 1e12}
            for key, flops in card.peak_flops.items() if key in spec.dense_tflops]
    rows.append({"what": "memory (copy)", "measured": card.copy_GBps * 1e9,
                 "published": spec.hbm_GBps * 1e9})
    return [{**row, "fraction": row["measured"] / row["published"]} for row in rows]


# ---- the roofline ------------------------------------------------------------------------------


def attainable_flops(intensity: float, peak_flops: float, bandwidth_Bps: float) -> float:
    """The roofline: FLOP/s an op of ``intensity`` FLOP/byte can reach, ``min(peak, I * B)``.

    Below the ridge point memory cannot deliver bytes fast enough to keep the arithmetic busy
    (``I * B``); above it, the arithmetic is the limit (``peak``).

    Example::

        >>> attainable_flops(10, peak_flops=1e12, bandwidth_Bps=1e10)   # 10 * 1e10 < 1e12
        100000000000.0
    """
    intensity = _positive(intensity, "intensity (FLOP per byte)")
    return min(_positive(peak_flops, "peak_flops"),
               intensity * _positive(bandwidth_Bps, "bandwidth_Bps"))


def ridge_point(peak_flops: float, bandwidth_Bps: float) -> float:
    """FLOP per byte at which an op turns from memory- to compute-bound: ``peak / bandwidth``.

    Example::

        >>> ridge_point(989.4e12, 3.35e12)       # H100 SXM, bf16 dense against HBM3
        295.3432835820896
    """
    return _positive(peak_flops, "peak_flops") / _positive(bandwidth_Bps, "bandwidth_Bps")


def bound(intensity: float, peak_flops: float, bandwidth_Bps: float) -> str:
    """``"memory"`` below the ridge point, ``"compute"`` at or above it (there the op can
    reach the peak, so only faster arithmetic would speed it up).

    Example::

        >>> bound(1 / 6, 989.4e12, 3.35e12)   # a bf16 add: 1 FLOP per 3 elements of 2 bytes
        'memory'
    """
    intensity = _positive(intensity, "intensity (FLOP per byte)")
    return "memory" if intensity < ridge_point(peak_flops, bandwidth_Bps) else "compute"


# FLOPs and bytes of common ops. One convention throughout: a multiplication and an addition
# are two FLOPs (no credit for fused multiply-add), and so is each comparison, exponential or
# division; every tensor an op takes is read from memory once and every tensor it makes is
# written once (perfect reuse inside the op, none between ops). Per-row scalars (a square
# root, one division per row) are left out: they are a vanishing part of the work.


def _cost(op: str, flops: float, nbytes: float) -> dict:
    return {"op": op, "flops": flops, "bytes": nbytes, "intensity": flops / nbytes}


def _counts(**named) -> list[int]:
    return [whole(v, k) for k, v in named.items()]


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: int) -> dict:
    """(m, k) @ (k, n): ``2 m n k`` FLOPs over ``(m k + k n + m n)`` elements moved.

    Each output element is k multiplications and k additions; A and B are read once and C
    written once. Large square matmuls reach hundreds of FLOP/byte: compute-bound.

    Example::

        >>> matmul_intensity(4096, 4096, 4096, 2)["intensity"]      # bf16
        1365.3333333333333
    """
    m, n, k, b = _counts(m=m, n=n, k=k, bytes_per_element=bytes_per_element)
    return _cost("matmul", 2 * m * n * k, (m * k + k * n + m * n) * b)


def add_intensity(n: int, bytes_per_element: int) -> dict:
    """Elementwise ``a + b`` of n elements: n FLOPs over 3 n elements (two read, one written).

    Example::

        >>> add_intensity(1_000_000, 4)["intensity"]         # fp32: 1 / 12 FLOP per byte
        0.08333333333333333
    """
    n, b = _counts(n=n, bytes_per_element=bytes_per_element)
    return _cost("add", n, 3 * n * b)


def layernorm_intensity(rows: int, d: int, bytes_per_element: int) -> dict:
    """LayerNorm over the last dim of (rows, d): ``8 rows d`` FLOPs over ``2 rows d + 2 d``.

    Per element: the mean (1 addition), the variance (subtract, square, add: 3), normalising
    (subtract the mean, multiply by 1/sigma: 2) and the affine (scale, shift: 2). Bytes: x
    read and y written, plus the weight and bias (d each) read once.

    Example::

        >>> layernorm_intensity(1, 4, 2)                    # 32 FLOPs over (8 + 8) * 2 bytes
        {'op': 'layernorm', 'flops': 32, 'bytes': 32, 'intensity': 1.0}
    """
    rows, d, b = _counts(rows=rows, d=d, bytes_per_element=bytes_per_element)
    return _cost("layernorm", 8 * rows * d, (2 * rows * d + 2 * d) * b)


def softmax_intensity(rows: int, d: int, bytes_per_element: int) -> dict:
    """Softmax over the last dim of (rows, d): ``5 rows d`` FLOPs over ``2 rows d`` elements.

    Per element: the row's max (1 comparison), subtract it (1: keeps exp from overflowing),
    exp (1), the row's sum (1) and the division (1). Bytes: x read, y written.

    Example::

        >>> softmax_intensity(2, 8, 4)["intensity"]          # fp32: 5 / 8 FLOP per byte
        0.625
    """
    rows, d, b = _counts(rows=rows, d=d, bytes_per_element=bytes_per_element)
    return _cost("softmax", 5 * rows * d, 2 * rows * d * b)


def attention_intensity(batch: int, heads: int, seq: int, head_dim: int,
                        bytes_per_element: int, *, fused: bool) -> dict:
    """Attention ``softmax(Q K^T) V`` over (batch, heads, seq, head_dim), fused or not.

    FLOPs, the same either way: ``S = Q K^T`` and ``O = P V`` are ``2 s^2 d`` each per head,
    the softmax ``5 s^2`` (see :func:`softmax_intensity`; the 1/sqrt(d) scale is folded into
    Q); no mask. Bytes: Q, K, V read and O written (``4 s d`` per head). Unfused, three
    kernels pass the (s, s) scores through memory: ``Q K^T`` writes S, the softmax reads S
    and writes P, ``P V`` reads P: ``4 s^2`` more per head. Fused (FlashAttention), S and P
    stay on chip. For long sequences that moves attention from memory- to compute-bound.

    Example::

        >>> attention_intensity(1, 1, 4, 2, 2, fused=False)["bytes"]   # (32 + 64) * 2
        192
    """
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be True or False, got {fused!r}")
    batch, heads, s, d, b = _counts(batch=batch, heads=heads, seq=seq, head_dim=head_dim,
                                    bytes_per_element=bytes_per_element)
    bh = batch * heads  # every (batch, head) pair is one independent attention
    flops = bh * (4 * s * s * d + 5 * s * s)
    elements = bh * (4 * s * d + (0 if fused else 4 * s * s))
    return _cost("attention (fused)" if fused else "attention (unfused)", flops,
                 elements * b)


def measure_op(fn, *, flops: float, nbytes: float, repeats: int = 5, device=None) -> dict:
    """Time ``fn()`` and place it on the roofline: achieved FLOP/s, bytes/s and intensity.

    ``flops`` and ``nbytes`` are what one call does and moves, by the convention above (e.g.
    :func:`matmul_intensity`'s): this measures time only. The time is the median of
    ``repeats`` rounds after one warm-up call, the GPU synchronised before each clock read
    (``device``, or every initialised GPU when None).

    Example::

        >>> x = torch.randn(1024, 1024)
        >>> cost = add_intensity(x.numel(), 4)
        >>> r = measure_op(lambda: x + x, flops=cost["flops"], nbytes=cost["bytes"])
        >>> r["intensity"], r["bytes_per_s"] > 0
        (0.08333333333333333, True)
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable that runs the op once, e.g. lambda: a @ b, got "
                        f"{type(fn).__name__}")
    flops = _positive(flops, "flops")
    nbytes = _positive(nbytes, "nbytes")
    whole(repeats, "repeats")
    seconds = _round_seconds(fn, repeats, None if device is None else _device(device))
    return {"seconds": seconds, "flops": flops, "bytes": nbytes,
            "flops_per_s": flops / seconds, "bytes_per_s": nbytes / seconds,
            "intensity": flops / nbytes}
