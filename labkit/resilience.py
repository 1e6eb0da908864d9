"""Checkpoints and failures at scale: how often to save, what failures cost, and two recoveries.

Notebook 12's room. Three parts, from paper to processes:

1. **How often to save.** Saving costs δ seconds; failures come every M seconds on average;
   a restart costs R. Young's interval :func:`young_daly_interval`, Daly's higher-order one
   :func:`daly_interval`, the exact optimum of the exponential-failure model
   :func:`exact_interval`, the goodput each predicts (:func:`expected_goodput`,
   :func:`exact_goodput`) and a seeded Monte Carlo to check them against
   (:func:`simulate_goodput`). Pure math: no torch.
2. **Failure rates with their source.** :data:`LLAMA3_405B` holds the interruptions Meta
   reported for Llama 3 405B pre-training, with the quote; :func:`mtbf_at_scale` and
   :func:`interval_at_scale` turn them into the interval and goodput of a run on N GPUs.
3. **Faults on real ranks.** :func:`resilient_training` is a worker function: data-parallel
   training on a deterministic stream with a fault plan (a rank killed, hung, or its weights
   silently corrupted), per-replica :func:`fingerprints` to catch a replica that diverged, and
   two recoveries: restart every rank from the last checkpoint (``labkit.elastic``'s recipe)
   or heal the lost replica in memory from a healthy peer (torchft's way,
   :func:`peer_recovery_plan`). :func:`lying_resumes` shows checkpoints that leave state out.

One room past 800 lines because the three parts are one argument: the interval's formula
needs the failure rate, and the real runs measure the goodput the formula predicts.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

from ._sizes import positive, whole

__all__ = [
    "young_daly_interval", "daly_interval", "exact_interval", "expected_goodput",
    "exact_goodput", "simulate_goodput", "Interruptions", "LLAMA3_405B", "mtbf_at_scale",
    "interval_at_scale", "FAULT_KINDS", "Fault", "fault_plan", "fingerprint", "fingerprints",
    "divergent_ranks", "peer_recovery_plan", "heal_from_peers", "resilient_training", "LIES",
    "lying_resumes",
]


def _positive(value, name: str, hint: str = "") -> float:
    return positive(value, name, what="a number of seconds > 0", hint=hint)


def _not_negative(value, name: str) -> float:
    return positive(value, name, what="a number of seconds >= 0", zero=True)


# ---- 1. how often to save ----------------------------------------------------------------


def young_daly_interval(save_seconds, mtbf_seconds) -> float:
    """Young's checkpoint interval: ``sqrt(2 δ M)`` seconds of work between two saves.

    J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9),
    1974. It is the exact maximum of the first-order goodput :func:`expected_goodput` (its
    derivative ``δ/τ² - 1/(2M)`` vanishes there), good while ``δ << M``.

    Example::

        >>> young_daly_interval(60, 3 * 3600)     # a 1-minute save, a failure every 3 hours
        1138.42...
    """
    return math.sqrt(2 * _positive(save_seconds, "save_seconds")
                     * _positive(mtbf_seconds, "mtbf_seconds"))


def daly_interval(save_seconds, mtbf_seconds) -> float:
    """Daly's higher-order interval: ``sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + δ/18M] − δ``, or M if δ ≥ 2M.

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22(3):303-312, 2006, equation 37 (as LLNL's SCR library
    implements it in ``scripts/python/scr_ckpt_interval.py``). It is the perturbation series
    of :func:`exact_interval` in ``sqrt(δ/2M)``: the two agree to third order (checked with
    sympy while writing this; the tests check the paper's own worked values).

    Example::

        >>> round(daly_interval(5, 24 * 60))      # minutes: Daly's Fig. 3 says 117
        117
    """
    delta = _positive(save_seconds, "save_seconds")
    mtbf = _positive(mtbf_seconds, "mtbf_seconds")
    if delta >= 2 * mtbf:
        return mtbf  # saving takes longer than failures allow: save every M (Daly's cut-off)
    ratio = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


def exact_interval(save_seconds, mtbf_seconds) -> float:
    """The interval that maximises :func:`exact_goodput`: ``M·(1 + W₀(−e^(−1−δ/M)))``.

    Setting the derivative of ``τ / (e^((τ+δ)/M) − 1)`` to zero gives
    ``(1 − τ/M)·e^((τ+δ)/M) = 1``, whose root in ``(0, M)`` is the Lambert-W form above
    (Daly 2006 derives the same). The restart time R scales the goodput but does not move its
    maximum. Solved here by bisection to the last bit, so no special function is needed.

    Example::

        >>> exact_interval(5, 24 * 60)            # minutes
        116.69...
    """
    d = _positive(save_seconds, "save_seconds") / _positive(mtbf_seconds, "mtbf_seconds")
    low, high = 0.0, 1.0  # x = τ/M: f(0) = e^d − 1 > 0, f(1) = −1 < 0, f decreasing between
    while True:
        mid = (low + high) / 2
        if mid in (low, high):
            return mid * mtbf_seconds
        if (1 - mid) * math.exp(mid + d) > 1:
            low = mid
        else:
            high = mid


def _model(interval, save_seconds, mtbf_seconds, restart_seconds) -> tuple[float, ...]:
    """The goodput models' four inputs, checked: τ, δ, M > 0 and R >= 0."""
    return (_positive(interval, "interval"), _positive(save_seconds, "save_seconds"),
            _positive(mtbf_seconds, "mtbf_seconds"),
            _not_negative(restart_seconds, "restart_seconds"))


def expected_goodput(interval, save_seconds, mtbf_seconds, restart_seconds=0.0) -> float:
    """The first-order goodput: ``1 − δ/τ − (τ/2 + R)/M``, the fraction of time doing work.

    Derivation (Young's model): per τ seconds of work the run also spends δ saving, a share
    δ/τ; failures arrive 1/M per second, each losing on average half an interval of work plus
    R to restart, a share (τ/2 + R)/M. First order in δ/τ and τ/M; its maximum is exactly
    :func:`young_daly_interval`. Clipped at 0 (a model past its range: no progress).

    Example::

        >>> expected_goodput(1138.4, 60, 3 * 3600, restart_seconds=300)
        0.866...
    """
    tau, delta, mtbf, restart = _model(interval, save_seconds, mtbf_seconds, restart_seconds)
    return max(0.0, 1 - delta / tau - (tau / 2 + restart) / mtbf)


def exact_goodput(interval, save_seconds, mtbf_seconds, restart_seconds=0.0) -> float:
    """The exact expected goodput under exponential failures: ``τ / (M·e^(R/M)·(e^((τ+δ)/M)−1))``.

    Derivation: a segment is τ of work then δ of saving, redone from its start whenever a
    failure (rate 1/M, memoryless, possible at any moment, restarts included) interrupts it.
    With ``L = τ + δ`` and ``E_R = M(e^(R/M) − 1)`` the expected time to get one restart done,
    the expected segment time T satisfies ``T = M(1 − e^(−L/M)) + (1 − e^(−L/M))(E_R + T)``,
    so ``T = M·e^(R/M)·(e^(L/M) − 1)``; the goodput is τ/T (Daly 2006 has the same wall time).
    :func:`simulate_goodput` runs exactly this model.

    Example::

        >>> exact_goodput(1138.4, 60, 3 * 3600, restart_seconds=300)
        0.873...
    """
    tau, delta, mtbf, restart = _model(interval, save_seconds, mtbf_seconds, restart_seconds)
    # expm1 keeps the digits when (τ+δ)/M is small, which is the usual case.
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


def simulate_goodput(interval, save_seconds, mtbf_seconds, restart_seconds=0.0, *,
                     horizon, seed: int = 0) -> dict:
    """A seeded Monte Carlo run of the model :func:`exact_goodput` solves.

    The run works τ, saves δ, repeats; failures arrive at exponential gaps (mean M) in wall
    time, drawn in order from ``random.Random(seed)``; each one throws away the work since the
    last completed save, then a restart of R (which a failure can interrupt too). The same
    seed gives the same failure times whatever the interval (common random numbers), so
    intervals compared under one seed differ by the schedule alone, not by luck.

    Returns ``goodput`` (saved work / wall time), ``failures``, ``lost_seconds`` (work thrown
    away), ``saves`` and ``wall_seconds`` (the run stops after the segment that crosses
    ``horizon``).

    Example::

        >>> simulate_goodput(1138.4, 60, 3 * 3600, 300, horizon=1e8, seed=0)["goodput"]
        0.873...
    """
    tau, delta, mtbf, restart = _model(interval, save_seconds, mtbf_seconds, restart_seconds)
    horizon = _positive(horizon, "horizon")
    rng = random.Random(seed)
    now = work = lost = 0.0
    failures = saves = 0
    next_failure = rng.expovariate(1 / mtbf)
    while now < horizon:
        if next_failure >= now + tau + delta:  # the segment and its save complete
            now += tau + delta
            work += tau
            saves += 1
            continue
        lost += min(next_failure - now, tau)  # the work since the last save is gone
        now = next_failure
        failures += 1
        next_failure = now + rng.expovariate(1 / mtbf)
        while next_failure < now + restart:  # a failure during the restart: start it again
            now = next_failure
            failures += 1
            next_failure = now + rng.expovariate(1 / mtbf)
        now += restart
    return {"goodput": work / now, "failures": failures, "lost_seconds": lost, "saves": saves,
            "wall_seconds": now}


# ---- 2. failure rates at scale, with their source -----------------------------------------


@dataclass(frozen=True)
class Interruptions:
    """Job interruptions a real run reported, with where it says so."""

    source: str
    where: str
    quote: str
    days: float
    gpus: int
    planned: int
    unexpected: int

    @property
    def total(self) -> int:
        return self.planned + self.unexpected


LLAMA3_405B = Interruptions(
    source="Llama Team, AI @ Meta, The Llama 3 Herd of Models, arXiv:2407.21783 (2024)",
    where="section 3.3.4 'Reliability and Operational Challenges' and Table 5; the GPU count "
          "is Table 4's 16,384 (the text says '16K GPU training')",
    quote="During a 54-day snapshot period of pre-training, we experienced a total of 466 job "
          "interruptions. Of these, 47 were planned interruptions due to automated maintenance "
          "operations such as firmware upgrades or operator-initiated operations like "
          "configuration or dataset updates. The remaining 419 were unexpected interruptions, "
          "which are classified in Table 5.",
    days=54, gpus=16_384, planned=47, unexpected=419,
)


def mtbf_at_scale(gpus: int, record: Interruptions = LLAMA3_405B, *,
                  planned: bool = False) -> dict:
    """The per-GPU MTBF a record implies, and the job MTBF of a run on ``gpus`` GPUs.

    A synchronous job stops when any of its parts fails, so with independent failures the
    job's rate is the sum of its GPUs' rates: job MTBF = per-GPU MTBF / N. The per-GPU figure
    charges every interruption (switches and software bugs included) to the GPUs, as a
    "per-GPU share" of the job's failures. ``planned=True`` counts the maintenance stops too.

    Example::

        >>> mtbf_at_scale(16_384)["job_mtbf_seconds"] / 3600     # Llama 3: one every ~3.1 h
        3.09...
    """
    gpus = whole(gpus, "gpus")
    count = record.total if planned else record.unexpected
    per_gpu = record.days * 86400 * record.gpus / count
    return {"per_gpu_mtbf_seconds": per_gpu, "job_mtbf_seconds": per_gpu / gpus,
            "interruptions": count}


def interval_at_scale(gpus: int, save_seconds, restart_seconds=0.0, *,
                      record: Interruptions = LLAMA3_405B, planned: bool = False) -> dict:
    """The save interval and goodput of a run on ``gpus`` GPUs failing at ``record``'s rate.

    Returns the job MTBF, the optimal interval (:func:`exact_interval`) next to Young's and
    Daly's, and the goodput at the optimum, exact and first-order.

    Example::

        >>> out = interval_at_scale(16_384, save_seconds=60, restart_seconds=600)
        >>> round(out["interval_seconds"]), round(out["goodput"], 3)
        (1116, 0.853)
    """
    mtbf = mtbf_at_scale(gpus, record, planned=planned)["job_mtbf_seconds"]
    best = exact_interval(save_seconds, mtbf)
    return {"gpus": int(gpus), "job_mtbf_seconds": mtbf, "interval_seconds": best,
            "young_seconds": young_daly_interval(save_seconds, mtbf),
            "daly_seconds": daly_interval(save_seconds, mtbf),
            "goodput": exact_goodput(best, save_seconds, mtbf, restart_seconds),
            "first_order_goodput": expected_goodput(best, save_seconds, mtbf, restart_seconds)}


# ---- 3. faults on real ranks: the plan, fingerprints, and who heals whom ------------------

FAULT_KINDS = ("kill", "hang", "corrupt")


class Fault(NamedTuple):
    kind: str
    rank: int
    step: int


def fault_plan(faults, world: int, steps: int) -> list[Fault]:
    """``faults`` (dicts with ``kind``, ``rank``, ``step``) checked against the run, in order.

    ``kill``: the rank's process dies before the step (``os._exit``) or, under peer recovery,
    loses its model and optimizer state. ``hang``: the rank stops before the step's all-reduce
    and sleeps far past the collective timeout. ``corrupt``: after the step, one of the rank's
    weights is silently nudged (a bit flip the hardware did not report).

    Example::

        >>> fault_plan([{"kind": "kill", "rank": 1, "step": 5}], world=2, steps=10)
        [Fault(kind='kill', rank=1, step=5)]
    """
    plan = []
    for fault in faults:
        if not isinstance(fault, dict) or set(fault) != {"kind", "rank", "step"}:
            raise ValueError(f"a fault is a dict with kind, rank and step, got {fault!r}: "
                             f"e.g. {{'kind': 'kill', 'rank': 1, 'step': 5}}")
        kind, rank, step = fault["kind"], fault["rank"], fault["step"]
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}: use one of {', '.join(FAULT_KINDS)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"the {kind} fault names rank {rank!r}, but this run has ranks "
                             f"0..{world - 1}")
        if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= steps:
            raise ValueError(f"the {kind} fault is at step {step!r}, but the run has steps "
                             f"1..{steps}: pick a step inside it")
        plan.append(Fault(kind, rank, step))
    clashes = [key for key, n in Counter((f.rank, f.step) for f in plan).items() if n > 1]
    if clashes:
        rank, step = clashes[0]
        raise ValueError(f"two faults hit rank {rank} at step {step}: give each one its own step")
    return sorted(plan, key=lambda f: (f.step, f.rank))


def fingerprint(model) -> tuple[float, str]:
    """This replica's fingerprint: the float64 sum of its parameters and a sha256 of their bytes.

    The sum is readable (and tells by how much); the hash changes with any single bit.

    Example::

        >>> fingerprint(torch.nn.Linear(2, 1))
        (0.53..., '9f2c...')
    """
    import torch

    digest = hashlib.sha256()
    total = torch.zeros((), dtype=torch.float64)
    for p in getattr(model, "module", model).parameters():
        data = p.detach().cpu().contiguous()
        total += data.double().sum()
        digest.update(data.view(torch.uint8).numpy().tobytes())  # raw bits, not rounded text
    return float(total), digest.hexdigest()


def fingerprints(model, group=None) -> list[tuple[float, str]]:
    """Every replica's :func:`fingerprint`, indexed by rank (a collective: all ranks call it).

    Without a process group, a list with this process's fingerprint alone.

    Example::

        >>> divergent_ranks(fingerprints(model))     # on every rank, after each step
        []
    """
    import torch.distributed as dist

    mine = fingerprint(model)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def divergent_ranks(prints) -> list[int]:
    """The ranks whose fingerprint differs from the majority's; ``[]`` when all agree.

    A vote needs a strict majority: with no fingerprint shared by more than half the ranks
    (two replicas that disagree, say) nobody can tell which is right, and every rank is
    returned as suspect.

    Example::

        >>> divergent_ranks([(1.0, "a"), (1.0, "a"), (1.5, "b"), (1.0, "a")])
        [2]
    """
    prints = [tuple(p) for p in prints]
    if len(set(prints)) <= 1:
        return []
    common, votes = Counter(prints).most_common(1)[0]
    if votes * 2 <= len(prints):
        return list(range(len(prints)))  # no strict majority: every rank is a suspect
    return [rank for rank, p in enumerate(prints) if p != common]


def peer_recovery_plan(healthy_ranks, recovering_ranks) -> list[tuple[int, int]]:
    """Which healthy rank sends its state to which recovering rank: ``[(src, dst), ...]``.

    The rule: sort both lists; the i-th recovering rank receives from the
    ``(i mod H)``-th healthy rank (H healthy ranks), so the transfers go round-robin and no
    healthy rank sends more than ``ceil(R / H)`` of the R copies. The pairs come sorted by
    ``dst``; the same inputs always give the same plan, so every rank computes it alone and
    all agree. torchft assigns its recovering replicas the same way, round-robin over the
    up-to-date ones (``compute_quorum_results`` in its ``src/manager.rs``).

    Example::

        >>> peer_recovery_plan(healthy_ranks=[0, 2], recovering_ranks=[1, 3, 4])
        [(0, 1), (2, 3), (0, 4)]
    """
    healthy, recovering = list(healthy_ranks), list(recovering_ranks)
    for name, ranks in (("healthy_ranks", healthy), ("recovering_ranks", recovering)):
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise ValueError(f"{name} must be ranks (whole numbers >= 0), got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{name} lists a rank twice: {ranks!r}")
    both = sorted(set(healthy) & set(recovering))
    if both:
        raise ValueError(f"rank(s) {both} are both healthy and recovering: a rank is one or "
                         f"the other")
    if recovering and not healthy:
        raise ValueError("no healthy rank is left to recover from: restore every rank from "
                         "the last checkpoint instead")
    healthy.sort()
    return [(healthy[i % len(healthy)], dst) for i, dst in enumerate(sorted(recovering))]


# ---- 3b. the worker: data-parallel training with faults and recoveries ---------------------

RECOVERIES = ("restart", "peer")
_MARKS = "labkit-resilience"  # key prefix of the progress marks in torchrun's store


def _make_model(seed: int):
    """The run's tiny MLP, initialised from ``seed`` (the same seed on every healthy rank)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _dataset(n: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return x, (x[:, 0] + x[:, 1] > 0).long()


class _Marks:
    """Each rank's last step, kept in torchrun's TCP store: who never arrived at a collective.

    A collective that times out only knows it waited; the store, outside the collective,
    says which peer is behind. Absent (None store) without torchrun, e.g. in a test's group.
    """

    def __init__(self, group):
        import datetime

        import torch.distributed as dist

        self.store, self.world = None, dist.get_world_size(group)
        token = [os.urandom(8).hex()]
        dist.broadcast_object_list(token, src=0, group=group)  # one key space per run
        self.prefix = f"{_MARKS}/{token[0]}"
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=datetime.timedelta(seconds=10))
            self.mark(dist.get_rank(), 0)

    def mark(self, rank: int, step: int) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{rank}", str(step))

    def behind(self, step: int) -> list[int] | None:
        if self.store is None:
            return None
        keys = [f"{self.prefix}/{r}" for r in range(self.world)]
        return [r for r, key in enumerate(keys)
                if not self.store.check([key]) or int(self.store.get(key)) < step]


def _all_reduce_grads(model, loss, group, world: int, step: int, marks: _Marks, timeout: float):
    """Average the gradients (and the loss) over the ranks in one all-reduce; the mean loss.

    A peer that never arrives makes gloo give up after the group's timeout: that is turned
    into an error naming the step and, from the store's marks, the rank that is behind.
    """
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
    marks.mark(dist.get_rank(), step)
    try:
        dist.all_reduce(flat, group=group)
    except RuntimeError as err:
        behind = marks.behind(step)
        if "timed out" not in str(err).lower():  # a peer's socket closed: it died
            raise ConnectionError(f"step {step}: the gradient all-reduce lost rank(s) "
                                  f"{behind or '?'}: a dead rank (its connections closed); "
                                  f"restart the run from its last checkpoint") from err
        who = (f"rank(s) {behind}, which never reached it" if behind
               else "a peer (run under labkit.launch to have it named)")
        raise TimeoutError(
            f"step {step}: the gradient all-reduce gave up after {timeout:g} s waiting for "
            f"{who}: a hung rank (a dead one closes its connections at once). Read its stack, "
            f"and keep collective_timeout short so that a hang fails fast") from err
    flat /= world
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return float(flat[-1])


def heal_from_peers(model, opt, healthy, recovering, group=None, step: int = 0) -> list[dict]:
    """Send model and optimizer state from healthy ranks to recovering ones, per
    :func:`peer_recovery_plan`; run on every rank. Returns ``[{step, src, dst}]``.

    Every rank walks the same plan in the same order, so each send meets its receive.
    """
    import torch.distributed as dist

    rank, events = dist.get_rank(), []
    for src, dst in peer_recovery_plan(healthy, recovering):
        if rank == src:
            dist.send_object_list([{"model": model.state_dict(), "optimizer": opt.state_dict()}],
                                  dst=dst, group=group)
        elif rank == dst:
            box = [None]
            dist.recv_object_list(box, src=src, group=group)
            model.load_state_dict(box[0]["model"])
            opt.load_state_dict(box[0]["optimizer"])  # momentum too: else the steps differ
        events.append({"step": step, "src": src, "dst": dst})
    return events


def _faults_now(plan, rank: int, step: int) -> set[str]:
    """This rank's faults at this step, in the run's first attempt only (restarts are clean)."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return {f.kind for f in plan if first_attempt and f.rank == rank and f.step == step}


def _clock(folder, group) -> float:
    """When training started: this call, or the first attempt's start under restarts."""
    from pathlib import Path

    import torch.distributed as dist

    now = [time.time()]
    if folder is not None:
        started = Path(folder) / "started"
        if dist.get_rank() == 0 and not started.exists():
            started.parent.mkdir(parents=True, exist_ok=True)
            started.write_text(repr(now[0]))
        dist.barrier(group=group)
        now = [float(started.read_text())]
    return now[0]


def resilient_training(*, steps: int = 20, faults=(), recovery: str = "peer", folder=None,
                       ckpt_every: int = 5, check_every: int = 1, batch: int = 8,
                       lr: float = 0.05, seed: int = 0, collective_timeout: float = 10.0,
                       step_seconds: float = 0.0, heal=None) -> dict:
    """Worker function: data-parallel SGD on a deterministic stream, with faults and recovery.

    Every rank builds the same tiny MLP from ``seed``; step s's batch on rank r is
    ``labkit.elastic.step_batch(.., s - 1, batch, r, world, seed)``, a function of the step
    alone; gradients are averaged with one all-reduce over a group whose timeout is
    ``collective_timeout`` seconds. Replicas therefore stay bitwise identical, which
    :func:`fingerprints` checks every ``check_every`` steps. ``step_seconds`` adds that much
    sleep to each step, standing in for a real model's compute.

    ``faults`` (see :func:`fault_plan`) fire in the first attempt only; a ``hang`` ends the run
    with a TimeoutError naming the hung rank after ``collective_timeout`` seconds (launch it
    with ``warm=False``: the sleeping rank is stopped with its run). ``recovery`` says what a
    ``kill`` means and how the run gets over it:

    - ``"restart"``: the rank's process dies (``os._exit(1)``). Launched with
      ``max_restarts=1``, torchrun restarts every rank, which resume from the last checkpoint
      in ``folder`` (saved every ``ckpt_every`` steps, ``labkit.elastic``'s recipe) and redo
      the steps since: those are the lost steps. Give each run a new folder: one that holds
      checkpoints is resumed, and its clock counts from that earlier start.
    - ``"peer"``: in-memory recovery as torchft does it (github.com/pytorch/torchft: the
      Manager's per-step quorum finds replicas behind the max step and "heals" them with a
      state dict sent by an up-to-date peer, round-robin as in :func:`peer_recovery_plan`,
      while the healthy replicas keep their state). Modelled here without replacing a process
      (that needs a reconfigurable process group, which plain gloo groups are not): the rank
      survives, but its model and optimizer are re-created from another seed, as a fresh
      process would start; at the top of the step every rank learns who lost its state, the
      plan's peers send model and optimizer state, and the step runs with nothing rolled back.
      A replica whose fingerprint leaves the majority (``corrupt``) is healed the same way.
      ``heal(model, optimizer, healthy, recovering, group)``, when given, replaces labkit's
      exchange (:func:`heal_from_peers`): it runs on every rank and must leave the recovering
      ranks' model and optimizer equal to the healthy ones'.

    Returns, per rank: ``weights`` (flat, final), ``fingerprint``, ``losses`` ({step: mean
    loss} of the steps this attempt ran), ``steps_run``, ``resumed_from``, ``restarts``,
    ``lost_steps`` (steps computed and then thrown away), ``healed`` ([{step, src, dst}]),
    ``diverged`` (the first {step, ranks} whose fingerprints left the majority, or None),
    ``heals`` ([{step, healthy, recovering, calls}]: ``calls`` is what this rank sent and
    received while healing, ``(op, peer, sent_bytes, payload_bytes)`` each, counted by
    ``labkit.parallel.traffic``),
    ``wall_seconds`` (from the first attempt's start), ``useful_seconds`` (time in the steps
    the final weights are made of) and ``goodput`` (their ratio).

    Example::

        >>> out = labkit.launch(resilient_training, steps=12, nproc=4, recovery="peer",
        ...                     faults=[{"kind": "kill", "rank": 1, "step": 5}]).values
        >>> out[0]["healed"], out[0]["lost_steps"]
        ([{'step': 5, 'src': 0, 'dst': 1}], 0)
    """
    import datetime
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.utils import parameters_to_vector

    from .ddp import save_on_rank0
    from .elastic import latest_checkpoint, resume_latest, step_batch

    steps, ckpt_every = whole(steps, "steps"), whole(ckpt_every, "ckpt_every")
    check_every = whole(check_every, "check_every")
    if recovery not in RECOVERIES:
        raise ValueError(f"unknown recovery {recovery!r}: use 'restart' (every rank from the "
                         f"last checkpoint) or 'peer' (heal from a healthy replica)")
    if recovery == "restart" and folder is None:
        raise ValueError("recovery='restart' needs folder=, where the checkpoints go")
    timeout = _positive(collective_timeout, "collective_timeout")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = fault_plan(faults, world, steps)
    # A group of its own: gloo (the model stays on the CPU) and a short collective timeout.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    marks = _Marks(group)
    x, y = _dataset(batch * world * 8, seed)
    model = _make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    done = resume_latest(model, opt, folder) if recovery == "restart" else 0
    useful, lost = 0.0, 0
    if done:  # what the first attempt did and what of it the checkpoint kept
        useful = torch.load(latest_checkpoint(folder), map_location="cpu")["useful_seconds"]
        lost = int((Path(folder) / "progress").read_text()) - done
    started = _clock(folder if recovery == "restart" else None, group)
    losses, steps_run, healed, diverged, heals = {}, [], [], None, []

    def healing(healthy, recovering):
        from .parallel.traffic import count_traffic

        with count_traffic() as traffic:
            if heal is None:
                healed.extend(heal_from_peers(model, opt, healthy, recovering, group, step))
            else:
                heal(model, opt, list(healthy), list(recovering), group)
                healed.extend({"step": step, "src": None, "dst": r} for r in recovering)
        heals.append({"step": step, "healthy": healthy, "recovering": recovering,
                      "calls": [(c.op, c.peer, c.sent_bytes, c.payload_bytes)
                                for c in traffic.calls]})

    for step in range(done + 1, steps + 1):
        now = _faults_now(plan, rank, step)
        if "kill" in now and recovery == "restart":
            os._exit(1)  # no exception, no clean-up: a lost node looks like this
        if recovery == "peer":  # torchft's per-step quorum: who must be healed first?
            if "kill" in now:
                model = _make_model(seed + 1000 + rank)  # a fresh process's state, not ours
                opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            lost_state = torch.zeros(world, dtype=torch.int32)
            lost_state[rank] = int("kill" in now)
            dist.all_reduce(lost_state, group=group)
            if lost_state.any():
                bad = [r for r in range(world) if lost_state[r]]
                healing([r for r in range(world) if r not in bad], bad)
        if "hang" in now:
            time.sleep(timeout * 10 + 30)  # far past the timeout: the peers must give up first
        tick = time.perf_counter()
        idx = step_batch(len(x), step - 1, batch, rank, world, seed)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        losses[step] = _all_reduce_grads(model, loss, group, world, step, marks, timeout)
        opt.step()
        time.sleep(step_seconds)
        useful += time.perf_counter() - tick
        steps_run.append(step)
        if "corrupt" in now:
            with torch.no_grad():  # one weight nudged, nothing raised: silent data corruption
                next(model.parameters()).view(-1)[0] += 1e-3
        if step % check_every == 0 or step == steps:
            odd = divergent_ranks(fingerprints(model, group))
            if odd and diverged is None:
                diverged = {"step": step, "ranks": odd}
            if odd and recovery == "peer":
                if len(odd) == world:
                    raise RuntimeError(f"step {step}: the replicas disagree and no majority "
                                       f"is left to trust: restore from a checkpoint")
                healing([r for r in range(world) if r not in odd], odd)
        if recovery == "restart":
            if rank == 0:  # how far the run got: a restart redoes the steps past the checkpoint
                (Path(folder) / "progress").write_text(str(step))
            if step % ckpt_every == 0 or step == steps:
                save_on_rank0({"model": model.state_dict(), "optimizer": opt.state_dict(),
                               "step": step, "useful_seconds": useful},
                              Path(folder) / f"step-{step:06d}.pt")
    wall = time.time() - started
    return {"rank": rank, "weights": parameters_to_vector(model.parameters()).detach().clone(),
            "fingerprint": fingerprint(model), "losses": losses, "steps_run": steps_run,
            "resumed_from": done or None, "lost_steps": lost, "healed": healed,
            "diverged": diverged, "heals": heals,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "wall_seconds": wall, "useful_seconds": useful, "goodput": useful / wall}


# ---- 5. a checkpoint that lies -------------------------------------------------------------

LIES = ("no_optimizer", "no_scheduler", "no_data_position")


def _train_span(state: dict, first: int, last: int, data, batch: int, seed: int) -> list[float]:
    """Steps ``first..last`` of the lying-resume run; each step's loss."""
    from torch.nn import functional as F

    from .elastic import step_batch

    x, y = data
    losses = []
    for _ in range(first, last + 1):
        idx = step_batch(len(x), state["position"], batch, 0, 1, seed)  # the loader's cursor
        state["opt"].zero_grad(set_to_none=True)
        loss = F.cross_entropy(state["model"](x[idx]), y[idx])
        loss.backward()
        state["opt"].step()
        state["sched"].step()
        state["position"] += 1
        losses.append(float(loss.detach()))
    return losses


def _fresh(seed: int, lr: float) -> dict:
    import torch

    model = _make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # A closed-form schedule (lr·0.85^step): it reads its own step, not the optimizer's lr.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.85 ** step)
    return {"model": model, "opt": opt, "sched": sched, "position": 0}


def lying_resumes(*, steps: int = 12, resume_at: int = 6, batch: int = 8, lr: float = 0.1,
                  seed: int = 0) -> dict:
    """An uninterrupted run, an honest resume and three lying ones: loss curves and fingerprints.

    Each resumed run saves a checkpoint after ``resume_at`` steps (``torch.save`` of model,
    optimizer, LR scheduler and data-loader position), starts over in fresh objects (the
    model from another seed, as a new process would) and loads it, except that a lie leaves
    one piece out: ``no_optimizer`` (SGD's momentum), ``no_scheduler`` (the schedule restarts
    at step 0) or ``no_data_position`` (the loader starts the data over). The honest resume
    ends bitwise where the uninterrupted run does; each lie does not. In one process, no
    process group needed.

    Returns {name: {"losses": [...one per step...], "fingerprint": ..., "weights": ...}} for
    ``uninterrupted``, ``honest`` and each of :data:`LIES`.

    Example::

        >>> runs = lying_resumes()
        >>> runs["honest"]["fingerprint"] == runs["uninterrupted"]["fingerprint"]
        True
    """
    import torch
    from torch.nn.utils import parameters_to_vector

    steps, resume_at = whole(steps, "steps"), whole(resume_at, "resume_at")
    if resume_at >= steps:
        raise ValueError(f"resume_at={resume_at} must come before the last step ({steps}): "
                         f"a resume needs steps left to run")
    data = _dataset(batch * 4, seed)
    runs = {}
    straight = _fresh(seed, lr)
    head = _train_span(straight, 1, resume_at, data, batch, seed)
    saved = io.BytesIO()
    torch.save({"model": straight["model"].state_dict(), "optimizer": straight["opt"].state_dict(),
                "scheduler": straight["sched"].state_dict(), "position": straight["position"]},
               saved)
    tail = _train_span(straight, resume_at + 1, steps, data, batch, seed)
    runs["uninterrupted"] = head + tail, straight["model"]
    for name in ("honest", *LIES):
        saved.seek(0)
        ckpt = torch.load(saved, weights_only=False)
        state = _fresh(seed + 1, lr)
        state["model"].load_state_dict(ckpt["model"])
        if name != "no_optimizer":
            state["opt"].load_state_dict(ckpt["optimizer"])
        if name != "no_scheduler":
            state["sched"].load_state_dict(ckpt["scheduler"])
        if name != "no_data_position":
            state["position"] = ckpt["position"]
        runs[name] = head + _train_span(state, resume_at + 1, steps, data, batch, seed), \
            state["model"]
    return {name: {"losses": losses, "fingerprint": fingerprint(model),
                   "weights": parameters_to_vector(model.parameters()).detach().clone()}
            for name, (losses, model) in runs.items()}
