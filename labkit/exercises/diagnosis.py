"""Notebook 05's exercises: a NaN detector that names the rank, runs that repeat, a hang fixed.

Each grader runs the learner's function on real gloo ranks, two and then four
(:func:`labkit.check.on_ranks`, warm workers), beside labkit's reference, and returns what it
verified (values, and where the concept is communication, the calls each rank made), or raises
:class:`labkit.check.NotYet` naming what is still wrong. The workers below are what every rank
runs: they call the learner's function and return plain data, compared in the grader.
"""

from __future__ import annotations

import math

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "05"
EARLY_STOP = {"epochs": 10, "patience": 1}  # the job's arguments, the learner's and labkit's
WORLDS = (2, 4)  # the rank counts the checks of this notebook run on


def _ranks(ranks) -> str:
    """``[2]`` -> "rank 2", ``[2, 3]`` -> "ranks 2, 3": ranks named as a sentence names them."""
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# world -> (what the case is, each rank's value, its dtype); the ranks to be named are worked
# out from the values (torch.isfinite), not written down
_NAN, _INF = float("nan"), float("inf")
_CASES = {
    2: [("finite on both ranks", [0.7, 1.3], "float32"),
        ("NaN on rank 1", [0.7, _NAN], "float32"),
        ("inf on rank 0", [_INF, 1.3], "float32"),
        ("NaN on rank 0, -inf on rank 1", [_NAN, -_INF], "float32"),
        ("one NaN among a gradient's 3 values on rank 1", [[0.1, 0.2, 0.3], [0.1, _NAN, 0.3]],
         "float32")],
    4: [("on 4 ranks, NaN on the last rank only", [0.5, 1.0, 1.5, _NAN], "float32"),
        ("on 4 ranks, inf on ranks 1 and 2, in float64", [0.5, _INF, -_INF, 2.0], "float64"),
        ("on 4 ranks, a bfloat16 NaN on rank 2", [[1.0, 2.0], [1.0, 2.0], [_NAN, 2.0],
                                                  [1.0, 2.0]], "bfloat16"),
        ("on 4 ranks, finite everywhere", [0.1, 0.2, 0.3, 0.4], "float32")],
}


def _bad_ranks(values) -> list[int]:
    """The reference: the ranks whose value holds a NaN or an infinity."""
    return [r for r, v in enumerate(values)
            if not all(math.isfinite(x) for x in (v if isinstance(v, list) else [v]))]


def _nonfinite_worker(fn, cases) -> list[dict]:
    """Every case on this rank: what the learner's function answered, and if it kept the value."""
    import torch
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for _, values, dtype in cases:
        value = torch.tensor(values[rank], dtype=getattr(torch, dtype))
        before = value.clone()
        answer = fn(value)
        if isinstance(answer, torch.Tensor):
            answer = answer.tolist()
        if isinstance(answer, list | tuple):  # tensors of rank numbers travel as plain numbers
            answer = [a.item() if isinstance(a, torch.Tensor) else a for a in answer]
        kept = torch.equal(torch.nan_to_num(before), torch.nan_to_num(value))
        out.append({"answer": answer, "kept": kept and before.isnan().equal(value.isnan())})
    return out


@exercise("nonfinite_ranks", notebook=NOTEBOOK, title="a NaN detector that names the rank")
def nonfinite_ranks(fn, *, timeout: float = 20.0) -> str:
    """Exercise: ``fn(value)`` returns the ranks where ``value`` is NaN/inf, the same on every rank.

    Example::

        >>> exercise.nonfinite_ranks(my_nonfinite_ranks)
        [pass] a NaN detector that names the rank: 5 cases on 2 ranks, ...
    """
    for world, cases in _CASES.items():
        _judge_nonfinite(_nonfinite_on_ranks(fn, cases, world, timeout), cases)
    return (f"{sum(map(len, _CASES.values()))} cases on 2 and 4 ranks (NaN, inf, a NaN in a "
            f"vector, the last rank bad, float64 and bfloat16): the same, right list on every "
            f"rank, and the values left as they were")


def _nonfinite_on_ranks(fn, cases, world: int, timeout: float) -> list:
    """The learner's detector on ``world`` ranks; a hang named for what it is here."""
    try:
        return on_ranks(_nonfinite_worker, fn, cases, nproc=world, timeout=timeout)
    except NotYet as wrong:
        if not wrong.stuck:  # not a hang: the learner's exception, as on_ranks put it
            raise
        stuck = _ranks(wrong.stuck) if wrong.stuck else "a rank"
        raise NotYet(wrong.detail, f"{stuck} waited in a collective that another rank "
                     "never called: call it on every rank, every time, finite or not; that "
                     "call is how the finite ranks learn of the bad one") from None


def _judge_nonfinite(ranks: list, cases) -> None:
    """Raise NotYet unless every rank named the reference's bad ranks in every case."""
    for i, (case, values, _) in enumerate(cases):
        want = _bad_ranks(values)
        said = {r: ranks[r][i]["answer"] for r in range(len(ranks))}
        if not all(ranks[r][i]["kept"] for r in said):
            raise NotYet(f"{case}: your function changed the value it was given",
                         "all_reduce works in place: reduce a tensor of flags of your own, "
                         "not the loss itself (which the training step still needs)")
        if any(not isinstance(a, list | tuple) for a in said.values()):
            raise NotYet(f"{case}: it returned {said[0]!r} on rank 0, not a list of ranks",
                         "return a list of rank numbers, e.g. [1], or [] when all is finite")
        if any(isinstance(x, bool) for a in said.values() for x in a):
            raise NotYet(f"{case}: it returned {said[0]!r} on rank 0, a mask, not rank numbers",
                         "return the numbers of the bad ranks: [r for r, bad in "
                         "enumerate(mask) if bad]")
        if len({tuple(a) for a in said.values()}) > 1:
            raise NotYet(f"{case}: the ranks disagree: " + ", ".join(
                f"rank {r} said {a}" for r, a in said.items()),
                "each rank looked only at its own value: give each rank a slot in a tensor of "
                "world_size flags, set your own, and all_reduce it so every rank sees all")
        if sorted(int(r) for r in said[0]) != want:
            hint = ("torch.isnan misses inf: torch.isfinite(value).all() catches both"
                    if "inf" in case else "name each rank whose value is not finite, and only "
                    "those: one flag per rank (set your own slot), summed over the ranks")
            raise NotYet(f"{case}: every rank said {said[0]}, expected {want}", hint)


def _determinism_worker(setup, seed: int) -> dict:
    """The learner's settings, then what a run draws: a number from each generator, and weights."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from ..diagnose import fingerprint

    setup(seed, dist.get_rank())
    drawn = {"random": random.random(), "numpy": float(np.random.random()),
             "torch": torch.rand(1).item()}
    settings = {"deterministic": torch.are_deterministic_algorithms_enabled(),
                "benchmark": torch.backends.cudnn.benchmark}
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))  # a fixed data set
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))  # each rank its own (no DDP: quicker)
    for xb, yb in loader:  # the order (torch), dropout (torch), noise (NumPy), flips (random)
        xb = xb.flip(1) if random.random() < 0.5 else xb
        xb = xb + torch.from_numpy(np.random.normal(0, 0.1, xb.shape).astype("float32"))
        model.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        with torch.no_grad():  # SGD by hand: torch.optim's first use imports seconds of torch
            for p in model.parameters():
                p -= 0.01 * p.grad
    return {"drawn": drawn, "settings": settings, "weights": fingerprint(model)}


_SEEDERS = {"random": "random.seed(...)", "numpy": "np.random.seed(...)",
            "torch": "torch.manual_seed(...)"}


def _same_streams(draws: list[float]) -> list[list[int]]:
    """The groups of ranks (two or more) that drew the same number, lowest rank first."""
    groups: dict[float, list[int]] = {}
    for rank, x in enumerate(draws):
        groups.setdefault(x, []).append(rank)
    return [g for g in groups.values() if len(g) > 1]


@exercise("seed_everything", notebook=NOTEBOOK, title="runs that repeat bit for bit")
def seed_everything(setup, *, seed: int = 1234, worlds=WORLDS) -> str:
    """Exercise: ``setup(seed, rank)`` makes two runs give bit-identical weights, rank by rank.

    On 2 and on 4 ranks (``worlds``), runs a small training twice with the same seed and once
    with another: each rank's weights repeat, every rank draws its own stream, and the seed
    argument decides every rank's weights.

    Example::

        >>> exercise.seed_everything(my_seed_everything)
        [pass] runs that repeat bit for bit: on 2 and 4 ranks, two runs, the same weights ...
    """
    for world in worlds:
        _judge_seeding(setup, seed, world)
    return (f"on {' and '.join(map(str, worlds))} ranks, two runs gave bit-identical weights on "
            f"every rank; random, NumPy and torch repeat, every rank its own stream; "
            f"deterministic algorithms on; another seed, other weights on every rank")


def _judge_seeding(setup, seed: int, world: int) -> None:
    """Raise NotYet unless ``setup`` makes runs on ``world`` ranks repeat, each rank apart."""
    # Warm ranks reseed every generator from fresh entropy before each run, as a new process.
    first, again = (on_ranks(_determinism_worker, setup, seed, nproc=world) for _ in range(2))
    where = f"on {world} ranks"
    for name, seeder in _SEEDERS.items():
        for rank, (a, b) in enumerate(zip(first, again, strict=True)):
            if a["drawn"][name] != b["drawn"][name]:
                raise NotYet(f"{where}, {name}'s generator gave other numbers in the second run "
                             f"(rank {rank}: {a['drawn'][name]:.6f}, then "
                             f"{b['drawn'][name]:.6f})", f"it seeds itself from the operating "
                             f"system at start-up: seed it with {seeder}")
        same = _same_streams([r["drawn"][name] for r in first])
        if same == [list(range(world))]:
            raise NotYet(f"{where}, every rank drew the same numbers from {name}: every rank "
                         f"got the same seed",
                         "seed with seed + rank, so that each rank's augmentation and dropout "
                         "differ (DDP copies rank 0's weights to every rank anyway)")
        if same:
            more = "".join(f" (and {' and '.join(map(str, g))} too)" for g in same[1:])
            raise NotYet(f"{where}, ranks {' and '.join(map(str, same[0]))} drew the same "
                         f"numbers from {name}{more}: they got the same seed",
                         f"derive each rank's seed from its global rank, 0 to {world - 1} "
                         f"(seed + rank), not from a number that repeats across ranks (the "
                         f"local rank on a node, rank % 2): ranks with one seed augment and "
                         f"drop out alike")
    if not all(r["settings"]["deterministic"] for r in first):
        raise NotYet("the generators repeat, but torch.are_deterministic_algorithms_enabled() "
                     "is False", "torch.use_deterministic_algorithms(True): on GPUs, scatter, "
                     "index_add and cuDNN otherwise add in a different order each run")
    if any(r["settings"]["benchmark"] for r in first):
        raise NotYet("torch.backends.cudnn.benchmark is True",
                     "set it to False: the autotuner may pick another kernel in each run")
    weights = [r["weights"] for r in first]
    if weights != [r["weights"] for r in again]:
        raise NotYet(f"{where}, the weights differ between the two runs ({weights} then "
                     f"{[r['weights'] for r in again]}) though every generator repeats",
                     "is anything else random in your setup (the time, os.urandom)?")
    other = [r["weights"] for r in on_ranks(_determinism_worker, setup, seed + 1, nproc=world)]
    kept = [r for r in range(world) if other[r] == weights[r]]
    if kept == list(range(world)):
        raise NotYet(f"seed {seed} and seed {seed + 1} gave the same weights",
                     "use the seed argument, not a number of your own: another seed is how you "
                     "check that a result does not rest on one lucky draw")
    if kept:
        raise NotYet(f"{where}, seed {seed} and seed {seed + 1} gave {_ranks(kept)} the same "
                     f"weights (the other ranks changed)",
                     f"{_ranks(kept)}'s seed does not depend on the seed argument (seed * rank "
                     f"is 0 on rank 0 whatever the seed): add the rank to the seed")


def _early_stop_worker(fn) -> dict:
    """labkit's fixed job, then the learner's, on this rank, each with the calls it made."""
    import torch

    from ..diagnose import early_stopping
    from ..parallel import traffic

    with traffic.count_traffic() as ours:
        labkit = early_stopping(**EARLY_STOP, fixed=True)
    with traffic.count_traffic() as theirs:
        yours = fn(**EARLY_STOP)
    grad = sum(p.numel() * p.element_size() for p in torch.nn.Linear(4, 1).parameters())
    return {"labkit": labkit, "yours": yours, "grad_bytes": grad,
            "labkit_calls": [(c.op, c.payload_bytes) for c in ours.calls],
            "calls": [(c.op, c.payload_bytes) for c in theirs.calls]}


@exercise("early_stop_together", notebook=NOTEBOOK, title="early stopping on every rank")
def early_stop_together(fn, *, timeout: float = 20.0, worlds=WORLDS) -> str:
    """Exercise: the early-stopping job fixed, so that every rank stops at the same, right epoch.

    ``fn(epochs=10, patience=1)`` runs on 2 and on 4 ranks (``worlds``) beside
    ``diagnose.early_stopping(fixed=True)``: every rank must stop at its epoch, report its
    validation losses (the loss over all ranks), and send for the validation no more than a
    few numbers per epoch beyond the gradients' all-reduces.

    Example::

        >>> exercise.early_stop_together(my_early_stopping)
        [pass] early stopping on every rank: on 2 ranks every rank stopped after 9 epochs, ...
    """
    said = [_judge_early_stop(_early_stop_on_ranks(fn, world, timeout), world)
            for world in worlds]
    return ("; ".join(said) + ", with labkit's validation losses; for the validation, a few "
            "numbers all-reduced per epoch; no rank left waiting")


def _early_stop_on_ranks(fn, world: int, timeout: float) -> list:
    """The learner's job and labkit's on ``world`` ranks; a hang named for who left, who waits."""
    try:
        return on_ranks(_early_stop_worker, fn, nproc=world, timeout=timeout)
    except NotYet as wrong:
        if not wrong.stuck:  # not a hang: the learner's exception, as on_ranks put it
            raise NotYet(f"on {world} ranks: {wrong.detail}", wrong.hint,
                         traceback=wrong.traceback) from None
        stuck = wrong.stuck
        left = [r for r in range(world) if r not in stuck]
        who = (f"{_ranks(stuck)} still wait{'s' if len(stuck) == 1 else ''} in a collective, "
               f"and {_ranks(left)} had left: " if left else "the ranks wait in a collective: ")
        raise NotYet(f"on {world} ranks: {wrong.detail}", who + "a rank left the epoch loop "
                     "(its own shard's loss rose) while another went on into the next epoch's "
                     "gradient all-reduce. The stop decision must come out the same on every "
                     "rank: base it on the validation loss over all ranks' shards, not on "
                     "one shard's", stuck=stuck) from None


def _close(got: list, want: list) -> bool:
    """Two lists of validation losses equal to float32 rounding (the job rounds to 5 places)."""
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                                         for a, b in zip(got, want, strict=True))


def _judge_early_stop(ranks: list, world: int) -> str:
    """Raise NotYet unless every rank stopped at labkit's epoch, with its losses, by its route."""
    where = f"on {world} ranks"
    ref, yours = ranks[0]["labkit"], [r["yours"] for r in ranks]
    if not all(isinstance(y, dict) and {"epochs", "val"} <= set(y) for y in yours):
        raise NotYet(f"{where}: it returned {yours[0]!r:.80} on rank 0",
                     "return the dict the job returns: {'epochs': ..., 'val': [...]}")
    epochs, best = yours[0]["epochs"], ref["val"].index(min(ref["val"])) + 1
    own_shards = any(y["val"] != yours[0]["val"] for y in yours)
    # The usual wrong average, to name it: the mean of the ranks' own means, which weighs a
    # shard of 32 samples like one of 48 (odd ranks hold 48). Every rank ran labkit's job to the
    # same epoch, so their shard losses line up.
    means = [sum(col) / world for col in zip(*(r["labkit"]["shard"] for r in ranks), strict=True)]
    common = min(len(yours[0]["val"]), len(means))
    if (not own_shards and common and not _close(yours[0]["val"][:common], ref["val"][:common])
            and _close(yours[0]["val"][:common], means[:common])):
        sizes = ", ".join(str(32 + 16 * (r % 2)) for r in range(world))
        raise NotYet(f"{where}: the validation losses are the mean of the ranks' own means "
                     f"({yours[0]['val'][:3]} vs labkit's {ref['val'][:3]}, ...), and every rank "
                     f"stopped after {yours[0]['epochs']} epochs (labkit's job: {ref['epochs']})",
                     f"the shards hold {sizes} samples: a mean of means weighs each shard "
                     f"alike. All-reduce each rank's sum of squared errors and its sample count, "
                     f"then divide")
    if len({y["epochs"] for y in yours}) > 1:
        raise NotYet(f"{where}: " + ", ".join(
            f"rank {r} trained {y['epochs']}" + (" epochs" if r == 0 else "")
            for r, y in enumerate(yours)),
            "the stop decision must come out the same on every rank: take it on a value that "
            "is the same on every rank, the validation loss over all ranks' shards")
    if epochs != ref["epochs"]:
        said = (f"{where}: every rank stopped after {epochs} epochs; the validation loss over "
                f"all ranks was best at epoch {best}, so with patience={EARLY_STOP['patience']} "
                f"the job stops after {ref['epochs']}")
        if epochs < ref["epochs"]:
            raise NotYet(said, "stopping when any one rank's loss rises (a stop flag "
                         "all-reduced with MAX) ends too early: decide on the loss over all "
                         "ranks' shards" if own_shards else
                         f"with patience={EARLY_STOP['patience']} the job stops once the loss "
                         f"has not improved for {EARLY_STOP['patience'] + 1} epochs: is "
                         f"patience still used?")
        raise NotYet(said, "is the stop test still run, with patience?" if not own_shards else
                     "stopping only when every rank's own loss rises (a stop flag all-reduced "
                     "with MIN) ends too late: decide on the loss over all ranks' shards")
    if own_shards:
        differ = next(r for r, y in enumerate(yours) if y["val"] != yours[0]["val"])
        raise NotYet(f"{where}: right epoch, but the ranks saw different validation losses "
                     f"(rank 0 {yours[0]['val'][:3]}, rank {differ} {yours[differ]['val'][:3]}, "
                     f"...)", "each rank still reports its own shard's loss: report the loss "
                     "over all ranks, the number the decision is taken on")
    if len(yours[0]["val"]) != len(ref["val"]):
        raise NotYet(f"{where}: {epochs} epochs but {len(yours[0]['val'])} validation losses",
                     "append one validation loss per epoch trained, as the job does")
    ratio = yours[0]["val"][0] / ref["val"][0]
    if not _close(yours[0]["val"], ref["val"]):
        hint = ("all_reduce sums: divide the sum by the number of samples (or of ranks)"
                if math.isclose(ratio, world, rel_tol=1e-3) else
                "the loss over all ranks is the sum of the squared errors over every shard "
                "divided by the number of samples")
        raise NotYet(f"{where}: right epoch, but the validation losses are {ratio:.3g}x "
                     f"labkit's ({yours[0]['val'][:3]} vs {ref['val'][:3]}, ...)", hint)
    for rank, got in enumerate(ranks):
        _judge_early_stop_route(where, rank, got, epochs)
    return f"on {world} ranks every rank stopped after {epochs} epochs (best at epoch {best})"


# Beyond the gradients' all-reduces, the validation may add per epoch labkit's own bytes (one
# all-reduce of the loss sum and the sample count, two float32 numbers) and one number more (a
# count in int64, a stop flag): a bound that does not grow with the ranks, as a gather's would.
_ES_SPARE = 4
_ES_ROUTE = ("the decision needs two numbers over all ranks, the sum of the squared errors and "
             "the sample count: one all_reduce (SUM) of both gives every rank the loss and, from "
             "it, the same decision")


def _judge_early_stop_route(where: str, rank: int, got: dict, epochs: int) -> None:
    """Raise NotYet if ``rank``'s validation traffic is a gather, or more than a few numbers."""
    calls, grad = got["calls"], got["grad_bytes"]
    gathered = [b for op, b in calls if op in ("all_gather", "gather")]
    if gathered:
        raise NotYet(f"{where}: right epochs and losses, but rank {rank} gathered every rank's "
                     f"values ({len(gathered)} gathers, {sum(gathered)} bytes)",
                     "a gather of every rank's losses (or predictions) is a message that grows "
                     "with the number of ranks, for a decision that needs two numbers: "
                     + _ES_ROUTE)
    odd = sorted({op for op, _ in calls} - {"all_reduce", "reduce", "broadcast"})
    if odd:
        raise NotYet(f"{where}: right epochs and losses, but rank {rank} made {odd} calls",
                     "the job needs only all-reduces: " + _ES_ROUTE)
    ours = (sum(b for _, b in got["labkit_calls"]) - len(got["labkit"]["val"]) * grad) \
        / len(got["labkit"]["val"])
    theirs = (sum(b for _, b in calls) - epochs * grad) / epochs
    if theirs > ours + _ES_SPARE:
        raise NotYet(f"{where}: right epochs and losses, but rank {rank} all-reduced "
                     f"{theirs:.0f} bytes per epoch for the validation, beyond the gradients' "
                     f"{grad}, where {ours:.0f} carry the loss sum and the sample count "
                     f"({len(calls)} calls in {epochs} epochs)",
                     ("is the same all-reduce made twice (once for the loss, once for the "
                      "decision), or are its numbers float64? " if theirs <= 2 * ours else
                      "that is more than a few numbers: are predictions or per-sample losses "
                      "all-reduced? ") + _ES_ROUTE)


# ==== challenge: training on uneven shards without a hang =====================================
# Graded on 2 and 4 ranks, one of them with no batch at all: every rank's weights after the run
# against the run simulated in one process, and the route (one gradient all-reduce per step that
# some rank has a batch for, no more; the rest small all-reduces of counts).

_UN_CASES = (("float32", {2: [3, 1], 4: [2, 0, 3, 1]}), ("float64", {2: [0, 2], 4: [1, 1, 0, 2]}))
_UN_LR = 0.1
_UN_TIMEOUT = 30.0  # a step takes milliseconds: longer is a rank waiting for a partner
_UN_TOL = {"float32": 1e-5, "float64": 1e-12}
_UN_ROUTE = ("each step: one small all-reduce that tells every rank how many ranks still have a "
             "batch (0 means stop, on every rank at once), then, unless it is 0, one all-reduce "
             "of the gradients flattened into one tensor (zeros from a rank without a batch), "
             "divided by that count")


def _un_model(dtype: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)).to(getattr(torch, dtype))


def _un_batches(world: int, rank: int, n: int, dtype: str):
    import torch

    g = torch.Generator().manual_seed(100 * world + rank)
    return [(torch.randn(2, 3, generator=g).to(getattr(torch, dtype)),
             torch.randn(2, 1, generator=g).to(getattr(torch, dtype))) for _ in range(n)]


def _uneven_worker(fn, case: int) -> list[dict]:
    """Each rank, one case: ``fn(model, batches, lr)`` on its own shard; weights, calls."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype, lengths in _UN_CASES[case:case + 1]:
        lens = lengths[world]
        shards = [_un_batches(world, r, n, dtype) for r, n in enumerate(lens)]
        ref = _un_model(dtype)  # the run in one process: each step, the ranks that have a batch
        for step in range(max(lens)):
            active = [s[step] for s in shards if step < len(s)]
            grads = []
            for x, y in active:
                ref.zero_grad()
                nn.functional.mse_loss(ref(x), y).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            with torch.no_grad():
                for k, p in enumerate(ref.parameters()):
                    p -= _UN_LR * sum(g[k] for g in grads) / len(grads)
        model = _un_model(dtype)
        with traffic.count_traffic() as t:
            fn(model, shards[rank], _UN_LR)
        out.append({"dtype": dtype, "lengths": lens,
                    "calls": [(c.op, c.payload_bytes) for c in t.calls],
                    "params": [p.detach().clone() for p in model.parameters()],
                    "ref": [p.detach().clone() for p in ref.parameters()],
                    "initial": [p.detach().clone() for p in _un_model(dtype).parameters()],
                    "numel": sum(p.numel() for p in model.parameters())})
    return out


def _un_on_ranks(fn, world: int) -> list:
    """Every rank's results, case by case (``[rank][case]``).

    One run per case: a rank that leaves its loop early must be left waiting for its partner
    (a hang the timeout names), not go on into the next case, whose all-reduces would pair with
    the other rank's remaining ones and fail in gloo at a moment that depends on timing.
    """
    try:
        runs = [on_ranks(_uneven_worker, fn, case, nproc=world, timeout=_UN_TIMEOUT)
                for case in range(len(_UN_CASES))]
        return [[run[rank][0] for run in runs] for rank in range(world)]
    except NotYet as wrong:
        if not wrong.stuck:
            raise NotYet(f"on {world} ranks: {wrong.detail}", wrong.hint) from None
        raise NotYet(f"on {world} ranks (batches per rank {_UN_CASES[0][1][world]}): "
                     f"{wrong.detail}", "a rank that ran out of batches stopped calling "
                     "all_reduce while another still had some, and that one waits for a partner "
                     "forever. No rank may leave the loop on its own data: " + _UN_ROUTE,
                     stuck=wrong.stuck) from None


@exercise("uneven_shards", notebook=NOTEBOOK, title="challenge: uneven shards without a hang")
def uneven_shards(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn(model, batches, lr)`` trains on this rank's shard, of any length.

    Run on real gloo ranks (``worlds``) with shards of different lengths, one rank with none
    (and, on 4 ranks, two), in float32 and float64: every rank's weights must equal the run
    simulated in one process (each step's update the mean gradient of the ranks that had a
    batch), and each rank must make exactly one gradient all-reduce per step that some rank had
    a batch for, its other calls small ones of counts.

    Example::

        >>> exercise.uneven_shards(my_train_uneven)
        [pass] challenge: uneven shards without a hang: on 2 and 4 ranks ...
    """
    for world in worlds:
        ranks = _un_on_ranks(fn, world)
        for k in range(len(_UN_CASES)):
            _un_replicas(world, [per_case[k] for per_case in ranks])
        for rank, per_case in enumerate(ranks):
            for got in per_case:
                _un_judge(world, rank, got)
    return (f"on {' and '.join(map(str, worlds))} ranks, float32 and float64, shards of "
            f"different lengths (one empty): every rank ends with the weights of the run in one "
            f"process, after one gradient all-reduce per step and no more")


def _un_replicas(world: int, per_rank: list[dict]) -> None:
    """Raise NotYet if the ranks ended with different weights, naming a rank that never moved."""
    first = per_rank[0]
    if all(float((p - q).abs().max()) == 0 for got in per_rank[1:]
           for p, q in zip(got["params"], first["params"], strict=True)):
        return
    where = f"on {world} ranks (batches per rank {first['lengths']}), {first['dtype']}"
    still = [r for r, got in enumerate(per_rank)
             if all(float((p - q).abs().max()) == 0
                    for p, q in zip(got["params"], got["initial"], strict=True))]
    said = (f"rank {still[0]}'s weights never changed" if still
            else "the ranks ended with different weights")
    raise NotYet(f"{where}: {said}", "a rank without a batch of its own still applies every "
                 "step's averaged update: all ranks take the same steps, or the replicas drift "
                 "apart")


def _un_judge(world: int, rank: int, got: dict) -> None:
    dtype, lens = got["dtype"], got["lengths"]
    where = f"on {world} ranks (rank {rank}, batches per rank {lens}), {dtype}"
    tol = _UN_TOL[dtype]
    gap = max(float((p.double() - r.double()).abs().max())
              for p, r in zip(got["params"], got["ref"], strict=True))
    if gap > tol:
        raise NotYet(f"{where}: rank {rank}'s weights differ from the run in one process by "
                     f"{gap:.2g}", "each step's gradient is the mean over the ranks that had a "
                     "batch in that step: divide the all-reduced sum by their count (not by the "
                     "world size: a rank without a batch adds zeros, not a gradient), and every "
                     "rank applies p -= lr * that mean")
    esize = got["params"][0].element_size()
    grad_bytes = got["numel"] * esize
    calls = got["calls"]
    others = sorted({op for op, b in calls if b > 8 * world and b != grad_bytes})
    big = [op for op, b in calls if b == grad_bytes]
    if others or any(op != "all_reduce" for op in big):
        raise NotYet(f"{where}: rank {rank} made {[op for op, _ in calls]} of "
                     f"{[b for _, b in calls]} bytes", _UN_ROUTE)
    steps = max(lens)
    if len(big) != steps:
        extra = (" (an all-reduce of zeros from every rank once all had run out)"
                 if len(big) == steps + 1 else "")
        raise NotYet(f"{where}: rank {rank} all-reduced the gradients {len(big)} times{extra}; "
                     f"some rank had a batch in {steps} steps",
                     "learn whether any rank has a batch left before sending gradients: "
                     + _UN_ROUTE)
    if len(calls) - len(big) > steps + 1:
        raise NotYet(f"{where}: rank {rank} made {len(calls) - len(big)} small calls for "
                     f"{steps} steps", "one count per step (and one more to learn that all "
                     "ranks are done) is enough: " + _UN_ROUTE)
