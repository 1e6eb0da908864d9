"""Notebook 02's exercises (PyTorch DDP): the training set-up, one accuracy over all ranks,
gradient averaging by hand, and the linearly scaled learning rate with warm-up.

The distributed ones run the learner's function on real gloo ranks, 2 then 4 (warm workers),
through :func:`labkit.check.on_ranks`: a module-level worker below calls it on each rank and
returns plain data (with what the rank sent, counted by :mod:`labkit.parallel.traffic`), and
the grader compares the ranks with each other and with a one-process reference, and the route
with the one the exercise teaches.
Each grader returns what it verified, or raises :class:`labkit.check.NotYet` with a hint that
names the likely mistake.

One room past 800 lines on purpose: it is the notebook's graders and nothing else (the module a
notebook imports as ``exercise``), and each grader keeps its worker, reference and hints beside
it so that one exercise reads in one place; the challenge is the last section.
"""

from __future__ import annotations

import math

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "02"


def _flat(module, grad: bool = False):
    """Every parameter of ``module`` in one CPU float64 vector (its gradients with ``grad``)."""
    import torch

    return torch.cat([(p.grad if grad else p).detach().reshape(-1).double().cpu()
                      for p in module.parameters()])


def _gap(a, b) -> float:
    return float((a - b).abs().max())


# ---- the DDP training set-up: model wrapped, data sharded, epoch set -------------------------

_LOOP_WORLDS = (2, 4)  # 40 samples: 20 or 10 per rank, so batches of 3 leave a short last one
_LOOP_TOL = 1e-5  # float32: the ranks' partial means add up in another order than one process's


class _Recorded:
    """A map-style dataset that notes every index read: which samples a rank trained on."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.x[i], self.y[i]


def _loop_data(n: int):
    """The grading dataset (features, labels): the same on every rank and in the kernel."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _loop_model():
    """The model every rank (and the one-process reference) starts from."""
    import torch
    from torch import nn

    torch.manual_seed(0)  # the same initial weights everywhere, as a real script seeds them
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _train_on_rank(fn, epochs: int, batch_size: int, n: int) -> dict:
    """Worker: the learner's ``fn(dataset, make_model, epochs, batch_size, lr)`` on this rank.

    Notes what it read, the size of each batch its model saw, and what it put on the wire.
    """
    from torch import nn

    from ..parallel.traffic import count_traffic

    data = _Recorded(*_loop_data(n))
    batches: list[int] = []

    def make_model():
        model = _loop_model()
        model[0].register_forward_pre_hook(lambda _, args: batches.append(len(args[0])))
        return model

    with count_traffic() as sent:
        model = fn(data, make_model, epochs, batch_size, 0.1)
    module = getattr(model, "module", model)
    trained = _flat(module) if isinstance(module, nn.Module) else None
    return {"reads": data.reads, "params": trained, "initial": _flat(_loop_model()),
            "returned": type(model).__name__, "batches": batches,
            "all_reduce": [c.payload_bytes for c in sent.calls if c.op == "all_reduce"]}


def _one_process(steps, n: int, lr: float, *, accumulate: bool = False):
    """The weights one process reaches with SGD on the global batches ``steps`` (index lists).

    DDP's promise (section 4): N ranks with batch b take the steps one process takes with the
    N*b samples they hold together. ``accumulate`` leaves out zero_grad, a known mistake.
    """
    import torch
    from torch import nn

    x, y = _loop_data(n)
    model = _loop_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for idx in steps:
        if not accumulate:
            opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return _flat(model)


def _global_batches(shards, batch_size: int) -> list[list[int]]:
    """The global batch of every step: step k of each epoch holds every rank's k-th batch."""
    steps = []
    for epoch in zip(*shards, strict=True):  # one epoch: each rank's reads, in order
        per_rank = max(len(reads) for reads in epoch)
        for start in range(0, per_rank, batch_size):
            steps.append([i for reads in epoch for i in reads[start:start + batch_size]])
    return steps


def _shards_mistake(ranks, epochs: int, n: int):
    """Each rank's reads cut into epochs, or the NotYet the sharding earns."""
    world, shards = len(ranks), []  # shards[rank][epoch]: the indices in the order read
    for rank, out in enumerate(ranks):
        reads, per_epoch = out["reads"], len(out["reads"]) // epochs
        if not reads or len(reads) % epochs:
            raise NotYet(f"rank {rank} read {len(reads)} samples in {epochs} epochs",
                         "loop over a DataLoader of the `dataset` argument in every epoch, with "
                         "num_workers=0 (the default): the check records what each rank reads")
        shards.append([reads[e * per_epoch:(e + 1) * per_epoch] for e in range(epochs)])
    first = [set(s[0]) for s in shards]
    if all(f == first[0] for f in first[1:]):
        raise NotYet(f"on {world} ranks, rank 1 read the same {len(first[0])} samples as rank 0 "
                     f"in epoch 1", "was a DistributedSampler used? DataLoader(dataset, "
                     "batch_size, sampler=DistributedSampler(dataset)) gives each rank its own "
                     "shard")
    for r in range(1, world):
        if both := first[0] & first[r]:
            raise NotYet(f"on {world} ranks, ranks 0 and {r} both read {len(both)} of the same "
                         f"samples in epoch 1", "the shards must not overlap: one "
                         "DistributedSampler per rank with the same seed (the default) splits "
                         "one permutation between them")
    if len(set().union(*first)) < n:
        raise NotYet(f"in epoch 1 the {world} ranks read {len(set().union(*first))} of the {n} "
                     f"samples", "DistributedSampler(dataset) covers the whole dataset between "
                                 "the ranks")
    order = shards[0]
    if order[1] == order[0]:
        if order[0] == sorted(order[0]):
            raise NotYet("rank 0 read its shard in index order, the same in both epochs",
                         "let the sampler shuffle: DistributedSampler(dataset, shuffle=True) "
                         "(its default), and call sampler.set_epoch(epoch) every epoch")
        raise NotYet("epoch 2 repeated epoch 1's order on rank 0",
                     "set_epoch? call sampler.set_epoch(epoch) at the top of each epoch: the "
                     "sampler cannot know the epoch otherwise")
    return shards


def _batch_mistake(ranks, shards, batch_size: int) -> None:
    """The batches each rank's model saw must be ``batch_size`` of its shard: its share."""
    world = len(ranks)
    want = [min(batch_size, len(epoch) - k) for epoch in shards[0]
            for k in range(0, len(epoch), batch_size)]
    got = ranks[0]["batches"]
    if got == want:
        return
    seen = max(got, default=0)
    if seen == batch_size * world:
        raise NotYet(f"on {world} ranks each rank's model saw batches of {seen} samples, "
                     f"{world} x batch_size = {batch_size}",
                     f"per-worker batch off by the world size: batch_size is already this "
                     f"worker's share of the global batch, DataLoader(dataset, "
                     f"batch_size=batch_size, sampler=...); the global batch is {world} x "
                     f"{batch_size}")
    if seen and seen == max(1, batch_size // world):
        raise NotYet(f"on {world} ranks each rank's model saw batches of {seen} samples, "
                     f"batch_size = {batch_size} split {world} ways",
                     "per-worker batch off by the world size: batch_size is already this "
                     "worker's share; the sampler splits the dataset, not each batch")
    raise NotYet(f"rank 0's model saw batches of {sorted(set(got))} samples; with "
                 f"batch_size={batch_size} and its shard of {len(shards[0][0])} they are "
                 f"{sorted(set(want))}",
                 "one forward per batch of DataLoader(dataset, batch_size=batch_size, "
                 "sampler=sampler), and one optimizer step per forward")


def _route_mistake(ranks, steps: int) -> None:
    """What crossed the wire: one all-reduce of the gradients per step, DDP's and no other."""
    world = len(ranks)
    grad_bytes = 4 * ranks[0]["params"].numel()  # float32 gradients, one of each parameter
    for rank, out in enumerate(ranks):
        reduced = sum(out["all_reduce"])
        if reduced == steps * grad_bytes:
            continue
        if reduced > steps * grad_bytes:
            times = reduced / (steps * grad_bytes)
            raise NotYet(f"on {world} ranks, rank {rank} all-reduced {reduced:,} bytes in "
                         f"{steps} steps: {times:.3g} x the {grad_bytes:,} bytes of gradients "
                         f"per step ({len(out['all_reduce'])} all-reduce calls)",
                         "a second all-reduce: DDP already averages the gradients during "
                         "backward(); an all_reduce of p.grad of your own sends them again (and "
                         "its result equals what DDP left, so only the traffic shows it). "
                         "Remove it")
        raise NotYet(f"on {world} ranks, rank {rank} all-reduced {reduced:,} bytes in {steps} "
                     f"steps, less than the {grad_bytes:,} bytes of gradients per step",
                     "every step's backward must go through the DDP-wrapped model (no no_sync), "
                     "so that DDP all-reduces every gradient")


def _weights_mistake(ranks, shards, batch_size: int, lr: float, n: int) -> None:
    """Rank 0's final weights against one process trained on the same global batches."""
    import torch

    world, got = len(ranks), ranks[0]["params"].double()
    steps = _global_batches(shards, batch_size)
    want = _one_process(steps, n, lr)
    gap = float((got - want).abs().max())
    if gap <= _LOOP_TOL:
        return
    said = (f"on {world} ranks the weights after {len(steps)} steps differ from one process "
            f"trained on the same global batches of {world} x {batch_size} by up to {gap:.2g}")
    known = [
        (_one_process(steps, n, lr, accumulate=True),
         "gradients never zeroed: they pile up from step to step. Call opt.zero_grad() before "
         "each backward()"),
        (_one_process(steps, n, lr * world),
         f"learning rate {world} x lr: the lr argument is already the rate for the global "
         f"batch (DDP averages the gradients, it does not sum them); use "
         f"torch.optim.SGD(model.parameters(), lr=lr)"),
        (_one_process(steps, n, lr / world),
         f"learning rate lr / {world}: DDP already averages the gradients over the ranks; use "
         f"lr as given"),
    ]
    for weights, hint in known:
        if torch.allclose(got, weights, rtol=0, atol=_LOOP_TOL):
            raise NotYet(said, hint)
    raise NotYet(said, "one plain SGD step per batch: opt.zero_grad(), cross_entropy(model(x), "
                       "y).backward(), opt.step(), with torch.optim.SGD(model.parameters(), "
                       "lr=lr) (no momentum, no other loss)")


@exercise("ddp_training_loop", notebook=NOTEBOOK, title="the DDP training loop")
def ddp_training_loop(fn, *, epochs: int = 2, batch_size: int = 3, n: int = 40,
                      worlds=_LOOP_WORLDS) -> str:
    """Exercise: ``fn(dataset, make_model, epochs, batch_size, lr)`` trains with DDP on each rank.

    Run on 2, then 4 ranks: each epoch the ranks must read disjoint shards covering the
    dataset, epoch 2 in a new order, in batches of ``batch_size`` (the last one shorter); end
    with equal replicas whose weights are those of one process trained with SGD on the same
    global batches (the equality of section 4); and all-reduce the gradients once per step.

    Example::

        >>> exercise.ddp_training_loop(my_ddp_training)
        [pass] the DDP training loop: on 2 and 4 ranks, disjoint shards of 40 samples ...
    """
    lr = 0.1
    for world in worlds:
        ranks = on_ranks(_train_on_rank, fn, epochs, batch_size, n, nproc=world)
        shards = _shards_mistake(ranks, epochs, n)
        if ranks[0]["params"] is None:
            raise NotYet(f"your function returned {ranks[0]['returned']}, not the model",
                         "end with `return model` (the DDP-wrapped model)")
        spread = max(_gap(ranks[0]["params"], r["params"]) for r in ranks[1:])
        if spread > 1e-6:
            raise NotYet(f"on {world} ranks the replicas differ after training (by up to "
                         f"{spread:.2g})",
                         "replicas differ: was the model wrapped in DDP? model = DDP("
                         "make_model()), and the optimizer built on model.parameters()")
        if _gap(ranks[0]["params"], ranks[0]["initial"]) == 0:
            raise NotYet("the weights did not change during training",
                         "build the optimizer on the DDP model's parameters, and call opt.step() "
                         "after backward()")
        _batch_mistake(ranks, shards, batch_size)
        _route_mistake(ranks, len(ranks[0]["batches"]))
        _weights_mistake(ranks, shards, batch_size, lr, n)
    return (f"on {' and '.join(map(str, worlds))} ranks, disjoint shards of {n} samples each "
            f"epoch, epoch 2 in a new order, equal replicas with the weights of one process "
            f"trained on the same global batches (to {_LOOP_TOL:g}), one all-reduce of the "
            f"gradients per step")


# ---- the validation metric: counts all-reduced, not accuracies averaged ----------------------

_ACC_WORLDS = (2, 4)
_ACC_TIMEOUT = 30.0  # seconds: a few tiny all-reduces take milliseconds; longer is a rank waiting
# Per case (samples, the indices the model gets right). 13 samples split 7/6 on 2 ranks and
# 4/3/3/3 on 4: the slices' accuracies differ, so their mean is not the whole set's. Then a set
# smaller than the ranks (world - 1 samples): one rank holds nothing, and must still take part.
_ACC_CORRECT = frozenset({0, 1, 2, 4, 6, 8, 10})  # 7 of 13; on 2 strided ranks 6/7 and 1/6


def _acc_cases(world: int) -> list[tuple[int, frozenset]]:
    return [(13, _ACC_CORRECT), (world - 1, frozenset({0, 2}) & set(range(world - 1)))]


# The most a right route all-reduces: two numbers (correct, seen), 8 bytes each at most,
# in one call or two.
_ACC_MOST_BYTES, _ACC_MOST_CALLS = 16, 2
_ACC_ROUTE = ("each rank counts its own slice, (correct, seen), and one all_reduce (SUM) of "
              "those two numbers gives every rank the counts of the whole set, a message of the "
              "same few bytes whatever the size of the set; divide after it")


def _accuracy_on_rank(fn, n: int, correct) -> dict:
    """Worker: the learner's ``fn(model, dataset)`` on this rank; the samples the model saw and
    what the rank sent."""
    import torch
    from torch import nn

    from ..parallel.traffic import count_traffic

    class Scored(nn.Module):
        """Returns logits fixed per sample (its last column is the sample's index), noting it."""

        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, x):
            self.seen.extend(x[:, -1].round().long().tolist())
            return x[:, :-1]

    y = torch.arange(n) % 10
    guess = torch.tensor([int(c) if i in correct else (int(c) + 1) % 10 for i, c in enumerate(y)],
                         dtype=torch.long)
    logits = nn.functional.one_hot(guess, 10).float()
    x = torch.cat([logits, torch.arange(n).float()[:, None]], dim=1)
    model = Scored()
    with count_traffic() as sent:
        result = fn(model, torch.utils.data.TensorDataset(x, y))
    try:
        acc = float(result)
    except (TypeError, ValueError, RuntimeError):
        acc = None
    return {"acc": acc, "returned": repr(result)[:80], "seen": model.seen,
            "calls": [(c.op, c.payload_bytes) for c in sent.calls]}


def _ranks_named(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _accuracy_run(fn, world: int, n: int, correct, timeout: float) -> list[dict]:
    """One case on ``world`` ranks; a hang or a division by zero named for what it is here."""
    empty = n < world
    try:
        return on_ranks(_accuracy_on_rank, fn, n, correct, nproc=world, timeout=timeout)
    except NotYet as wrong:
        where = f"on {world} ranks, {n} sample{'s' if n != 1 else ''}"
        if wrong.stuck:
            left = [r for r in range(world) if r not in wrong.stuck]
            hint = (f"{_ranks_named(left)} returned without the all-reduce that "
                    f"{_ranks_named(wrong.stuck)} wait{'s' if len(wrong.stuck) == 1 else ''} in"
                    if left else "the ranks wait in different collectives")
            raise NotYet(f"{where}: {wrong.detail}", hint + ": every rank must call the same "
                         "all-reduces, a rank whose slice is empty too (with counts of zero)"
                         if empty else hint + ": every rank makes the same collective calls, "
                         "in the same order", stuck=wrong.stuck) from None
        if empty and "ZeroDivisionError" in wrong.detail:
            raise NotYet(f"{where} (fewer than the ranks, so a slice is empty): {wrong.detail}",
                         "a rank whose slice is empty has seen 0 samples: divide only after the "
                         "all-reduce, by the whole set's count; " + _ACC_ROUTE,
                         traceback=wrong.traceback) from None
        raise NotYet(f"{where}: {wrong.detail}", wrong.hint, traceback=wrong.traceback) from None


def _accuracy_split(ranks: list[dict], n: int, where: str) -> list[list[int]]:
    """Each rank's samples, or the NotYet the split earns: disjoint slices covering the set."""
    world, seen = len(ranks), [r["seen"] for r in ranks]
    everything = set(range(n))
    if n >= world and not all(seen):
        raise NotYet(f"{where}: rank {[bool(s) for s in seen].index(False)} evaluated no sample",
                     "every rank evaluates its own slice: Subset(dataset, range(rank, n, world))")
    if n > 1 and all(set(s) >= everything for s in seen):
        raise NotYet(f"{where}: every rank evaluated all {n} samples: the work was not split",
                     "evaluate only this rank's slice, Subset(dataset, range(rank, len(dataset), "
                     "world)), then all_reduce the counts")
    flat = [i for s in seen for i in s]
    twice = sorted({i for i in flat if flat.count(i) > 1})
    if twice:
        said = f"{where}: samples {twice} were evaluated more than once ({len(flat)} evaluations " \
               f"for {n} samples)"
        if len(flat) == world * math.ceil(n / world):  # the sampler's padding, to equal shards
            raise NotYet(said, "a DistributedSampler pads the shards by repeating samples; "
                               "slice with Subset(dataset, range(rank, n, world))")
        raise NotYet(said, "the slices of different ranks overlap: each rank's slice depends on "
                           "its rank and on the number of ranks, dist.get_world_size() (not a "
                           "number written in), e.g. range(rank, n, world)")
    if set(flat) != everything:
        raise NotYet(f"{where}: samples {sorted(everything - set(flat))} were evaluated by no "
                     f"rank", "the slices range(rank, n, world) of all ranks together cover "
                                 "every sample")
    return seen


def _accuracy_values(ranks: list[dict], seen, n: int, correct, where: str) -> None:
    """Raise NotYet unless every rank reports correct / n, naming the usual wrong combination."""
    world, accs = len(ranks), [r["acc"] for r in ranks]
    truth = len(correct) / n
    empty = [r for r, s in enumerate(seen) if not s]
    if any(math.isnan(a) for a in accs):
        nan = [r for r, a in enumerate(accs) if math.isnan(a)]
        if empty:
            raise NotYet(f"{where}: {_ranks_named(nan)} reported nan; {_ranks_named(empty)} "
                         f"had an empty slice", "an empty slice's own accuracy is 0 / 0 = nan, "
                         "and it spreads through whatever adds it: " + _ACC_ROUTE)
        raise NotYet(f"{where}: {_ranks_named(nan)} reported nan", _ACC_ROUTE)
    if max(accs) - min(accs) > 1e-6:
        said = ", ".join(f"rank {r} {a:.4f}" for r, a in enumerate(accs))
        raise NotYet(f"{where}: the ranks reported {said}: each its own slice",
                     "all_reduce the counts (correct, seen) with SUM before dividing, so every "
                     "rank reports the whole validation set")
    acc = accs[0]
    if math.isclose(acc, truth, abs_tol=1e-6):
        return
    share = [sum(i in correct for i in s) / len(s) if s else 0.0 for s in seen]
    kept = [share[r] for r, s in enumerate(seen) if s]
    sizes = " and ".join(map(str, sorted({len(s) for s in seen}, reverse=True)))
    if math.isclose(acc, sum(kept) / len(kept), abs_tol=1e-6):
        raise NotYet(f"{where}: {acc:.4f} is the mean of the slices' accuracies "
                     f"{', '.join(f'{a:.3f}' for a in kept)}, not the accuracy over all {n} "
                     f"({truth:.4f})", f"the slices hold {sizes} samples: sum the counts "
                     f"(correct, seen) with all_reduce, then divide")
    if empty and math.isclose(acc, sum(share) / world, abs_tol=1e-6):
        raise NotYet(f"{where}: {acc:.4f} is the mean of the ranks' accuracies, an empty slice "
                     f"counted as 0; over all {n} it is {truth:.4f}",
                     "an empty slice has no accuracy: sum the counts (correct, seen) with "
                     "all_reduce, then divide")
    if seen[0] and math.isclose(acc, share[0], abs_tol=1e-6):
        raise NotYet(f"{where}: {acc:.4f} is rank 0's share only, reported on every rank",
                     "all_reduce (SUM) the counts of every rank, then divide correct by seen")
    if math.isclose(acc, sum(share), abs_tol=1e-6) or acc > 1:
        raise NotYet(f"{where}: {acc:.4f}: the accuracies were summed", "sum the counts "
                     "(correct, seen), not the accuracies, then divide correct by seen")
    raise NotYet(f"{where}: every rank reports {acc:.4f}; over all {n} samples it is "
                 f"{truth:.4f}", "accuracy = (correct summed over ranks) / (seen summed over "
                                 "ranks)")


def _accuracy_route(ranks: list[dict], n: int, where: str) -> None:
    """The value is right: did it come from an all-reduce of the counts, and nothing more?"""
    for rank, got in enumerate(ranks):
        calls, at = got["calls"], f"{where}, rank {rank}"
        ops = sorted({op for op, _ in calls})
        moved = sum(b for _, b in calls)
        gathered = [op for op in ops if op in ("all_gather", "gather", "all_to_all", "scatter")]
        if gathered:
            raise NotYet(f"{at}: the right accuracy, but through {', '.join(gathered)} "
                         f"({moved:,} bytes in {len(calls)} calls)",
                         "no need to move the predictions (or each rank's counts) and add them "
                         "up yourself: " + _ACC_ROUTE)
        if ops and ops != ["all_reduce"]:
            raise NotYet(f"{at}: the right accuracy, but through {', '.join(ops)}",
                         "a reduce to one rank and a broadcast back are what one all_reduce "
                         "does in a single call: " + _ACC_ROUTE)
        if not calls:
            raise NotYet(f"{at}: the right accuracy, but no collective was called",
                         _ACC_ROUTE)
        if moved > _ACC_MOST_BYTES or len(calls) > _ACC_MOST_CALLS:
            raise NotYet(f"{at}: the right accuracy, but {moved:,} bytes all-reduced in "
                         f"{len(calls)} call{'s' if len(calls) > 1 else ''}, for {n} samples",
                         "two numbers are enough (correct, seen), not a number per sample or "
                         "per class: " + _ACC_ROUTE)


@exercise("ddp_global_accuracy", notebook=NOTEBOOK, title="one accuracy for all ranks")
def ddp_global_accuracy(fn, worlds=_ACC_WORLDS, *, timeout: float = _ACC_TIMEOUT) -> str:
    """Exercise: ``fn(model, dataset)`` is the accuracy on the whole set, each rank its slice.

    Run on 2, then 4 ranks: 13 validation samples (slices of 7 and 6, or 4, 3, 3 and 3, so
    averaging the slices' accuracies is wrong), then a set smaller than the ranks (one slice
    empty). Every rank must report the accuracy over the whole set, each sample evaluated once,
    reached by all-reducing the counts: at most two numbers (correct, seen), not the predictions.
    A case still running after ``timeout`` seconds is a hang, named with where each rank waits.

    Example::

        >>> exercise.ddp_global_accuracy(my_global_accuracy)
        [pass] one accuracy for all ranks: on 2 and 4 ranks every rank reports 7/13 ...
    """
    for world in worlds:
        for n, correct in _acc_cases(world):
            where = f"on {world} ranks, {n} sample{'s' if n != 1 else ''}"
            ranks = _accuracy_run(fn, world, n, correct, timeout)
            accs = [r["acc"] for r in ranks]
            if None in accs:
                raise NotYet(f"your function returned {ranks[accs.index(None)]['returned']}",
                             "return the accuracy as a number: correct / seen, e.g. "
                             "counts[0] / counts[1]")
            seen = _accuracy_split(ranks, n, where)
            _accuracy_values(ranks, seen, n, correct, where)
            _accuracy_route(ranks, n, where)
    return (f"on {' and '.join(map(str, worlds))} ranks every rank reports "
            f"{len(_ACC_CORRECT)}/13 = {len(_ACC_CORRECT) / 13:.4f} (slices of unequal sizes) "
            f"and the right accuracy with an empty slice, each sample evaluated once, from one "
            f"all-reduce of the counts")


# ---- gradient averaging: what DDP does after backward ----------------------------------------


_AVG_CASES = ("float32", "float64")  # a float64 model: a float32 buffer rounds its gradients
_AVG_TOL = {"float32": 1e-6, "float64": 1e-12}


def _grads_on_rank(fn) -> list[dict]:
    """Worker: for each dtype, one backward on this rank's share of a batch, then the learner's
    ``fn(model)``; the gradients before and after, and what the rank sent."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ..parallel.traffic import count_traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in _AVG_CASES:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4 * world, 6, generator=gen).to(getattr(torch, dtype))
        y = torch.randint(0, 3, (4 * world,), generator=gen)

        def model_and_grads(xs, ys, dtype=dtype):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
            model.to(getattr(torch, dtype))
            nn.functional.cross_entropy(model(xs), ys).backward()
            return model

        reference = _flat(model_and_grads(x, y), grad=True)  # one process, the whole batch
        model = model_and_grads(x[rank::world], y[rank::world])  # this rank's share
        local = _flat(model, grad=True)
        with count_traffic() as sent:
            fn(model)
        grads = [p.grad for p in model.parameters()]
        after = None if any(g is None for g in grads) else _flat(model, grad=True)
        out.append({"reference": reference, "local": local, "after": after, "dtype": dtype,
                    "esize": torch.finfo(getattr(torch, dtype)).bits // 8,
                    "sizes": [p.numel() for p in model.parameters()],
                    "names": [name for name, _ in model.named_parameters()],
                    "calls": [(c.op, c.payload_bytes) for c in sent.calls]})
    return out


def _parts(out: dict):
    """``(name, slice)`` of each parameter in the flat vectors of :func:`_grads_on_rank`."""
    start = 0
    for name, size in zip(out["names"], out["sizes"], strict=True):
        yield name, slice(start, start + size)
        start += size


@exercise("average_gradients", notebook=NOTEBOOK, title="average the gradients by hand")
def average_gradients(fn, worlds=(2, 4)) -> str:
    """Exercise: ``fn(model)`` makes every ``p.grad`` the mean over the ranks, as DDP does.

    Run on 2, then 4 ranks, each after a backward pass on its share of one batch: afterwards
    every rank's gradients must equal one process's gradient over the whole batch, reached by
    all-reducing each gradient once (the bytes all-reduced are counted).

    Example::

        >>> exercise.average_gradients(my_average_gradients)
        [pass] average the gradients by hand: both ranks hold the whole batch's gradient ...
    """
    for world in worlds:
        ranks = on_ranks(_grads_on_rank, fn, nproc=world)
        for k in range(len(_AVG_CASES)):
            _judge_averaged([r[k] for r in ranks])
    return (f"on {' and '.join(map(str, worlds))} ranks, float32 and float64, every rank holds "
            f"the whole batch's gradient, as one process computes it, with each gradient "
            f"all-reduced once")


def _judge_averaged(ranks: list[dict]) -> None:
    """Raise NotYet unless every rank holds the whole batch's gradient, all-reduced once."""
    world, first = len(ranks), ranks[0]
    dtype, tol = first["dtype"], _AVG_TOL[first["dtype"]]
    at = f"on {world} ranks" + ("" if dtype == "float32" else f" ({dtype} model)")
    if any(r["after"] is None for r in ranks):
        raise NotYet(f"{at}: a parameter had no .grad after your function",
                     "average p.grad in place (dist.all_reduce(p.grad), then divide); do not "
                     "set it to None")
    differ = [name for name, part in _parts(first)
              if max(_gap(ranks[0]["after"][part], r["after"][part]) for r in ranks) > tol]
    if differ:
        kept = all(_gap(r["after"], r["local"]) < 1e-9 for r in ranks)
        raise NotYet(f"{at}: the ranks hold different gradients afterwards: " +
                     ("each kept its own" if kept else f"parameters {differ} were not reduced"),
                     "call dist.all_reduce(p.grad) for every parameter (for p in "
                     "model.parameters()), on every rank, in the same order")
    after, ref = first["after"], first["reference"]
    if _gap(after, ref) < tol:
        _averaging_route(ranks, at)
        return
    if _gap(after, world * ref) < tol * world:
        raise NotYet(f"{at}: the gradients are {world}x the whole batch's gradient",
                     "all_reduce sums: divide by dist.get_world_size() to average")
    if dtype != "float32" and _gap(after, ref) < 1e-5:
        raise NotYet(f"{at}: the gradients are off by {_gap(after, ref):.1e}, float32 rounding "
                     f"in a {dtype} model", "keep the gradients' dtype: a buffer of your own "
                     "must be built in it (torch.cat of the gradients keeps it; torch.zeros(n) "
                     "is float32)")
    for name, part in _parts(first):
        if _gap(after[part], ref[part]) >= tol:
            raise NotYet(f"{at}: parameter {name!r} was not averaged",
                         "every parameter: dist.all_reduce(p.grad), then p.grad /= world size")
    raise NotYet(f"{at}: the gradients are not the whole batch's mean gradient",
                 "for each parameter: dist.all_reduce(p.grad); p.grad /= world size")


def _averaging_route(ranks: list[dict], at: str) -> None:
    """The values are right: was every gradient all-reduced exactly once, and nothing else?"""
    grad_bytes = ranks[0]["esize"] * sum(ranks[0]["sizes"])  # one gradient of each parameter
    for rank, got in enumerate(ranks):
        ops = sorted({op for op, _ in got["calls"]})
        reduced = sum(b for op, b in got["calls"] if op == "all_reduce")
        where = f"{at}, rank {rank}"
        gathered = [op for op in ops if op in ("all_gather", "gather")]
        if gathered:
            moved = sum(b for op, b in got["calls"] if op in gathered)
            raise NotYet(f"{where}: the right gradients, but through {', '.join(gathered)} "
                         f"({moved:,} bytes gathered for {grad_bytes:,} bytes of gradients)",
                         "gathering every rank's gradients and taking their mean yourself "
                         "moves and holds a copy per rank; dist.all_reduce(p.grad) sums in "
                         "place on every rank (what DDP does), then divide by the world size")
        if ops != ["all_reduce"]:
            raise NotYet(f"{where}: the right gradients, but through {ops or 'no collective'}",
                         "average with all_reduce: dist.all_reduce(p.grad) sums in place on "
                         "every rank (what DDP does; a reduce to one rank and a broadcast back "
                         "take two calls for what it does in one), then divide by the world "
                         "size")
        if reduced != grad_bytes:
            raise NotYet(f"{where}: the right gradients, but {reduced:,} bytes all-reduced for "
                         f"{grad_bytes:,} bytes of gradients ({len(got['calls'])} calls)",
                         "all-reduce each gradient once: summing twice and dividing by the "
                         "world size twice gives the same numbers at twice the traffic")


# ---- the large-batch learning rate: linear scaling with warm-up -----------------------------

_LR_CASES = [  # (global_batch, base_lr, base_batch, warmup_steps)
    (16, 0.01, 16, 0), (128, 0.01, 16, 10), (512, 0.1, 32, 20), (64, 0.05, 16, 4)]


def _expected_lr(step, global_batch, base_lr, base_batch, warmup_steps) -> float:
    target = base_lr * global_batch / base_batch
    return target if warmup_steps == 0 else target * min(1.0, (step + 1) / warmup_steps)


@exercise("scaled_lr_warmup", notebook=NOTEBOOK, title="linear scaling with warm-up")
def scaled_lr_warmup(fn) -> str:
    """Exercise: ``fn(step, global_batch, *, base_lr, base_batch, warmup_steps)``, the rate.

    ``base_lr * global_batch / base_batch``, ramped linearly over the first ``warmup_steps``
    steps: ``target * min(1, (step + 1) / warmup_steps)`` (``warmup_steps=0``: no ramp).

    Example::

        >>> exercise.scaled_lr_warmup(my_lr)
        [pass] linear scaling with warm-up: 4 schedules, 100 steps each, ...
    """
    for batch, base_lr, base_batch, warmup in _LR_CASES:
        def lr(step, batch=batch, base_lr=base_lr, base_batch=base_batch, warmup=warmup):
            return float(fn(step, batch, base_lr=base_lr, base_batch=base_batch,
                            warmup_steps=warmup))

        try:
            late = lr(99)
        except ZeroDivisionError:
            raise NotYet("warmup_steps=0 raised ZeroDivisionError", "no warm-up "
                         "(warmup_steps=0) means the full scaled rate from step 0") from None
        k, target = batch / base_batch, base_lr * batch / base_batch
        where = (f"at global batch {batch} ({k:g}x the base batch {base_batch}), after the "
                 f"warm-up")
        if not math.isclose(late, target, rel_tol=1e-6):
            if math.isclose(late, base_lr, rel_tol=1e-6):
                raise NotYet(f"{where} the rate is base_lr = {late:g}: not scaled by N",
                             f"N workers make the global batch N times larger: multiply base_lr "
                             f"by global_batch / base_batch ({k:g}x here)")
            if math.isclose(late, base_lr * math.sqrt(k), rel_tol=1e-6):
                raise NotYet(f"{where} the rate is {late:g}, base_lr x sqrt({k:g})",
                             "the linear rule multiplies by k = global_batch / base_batch itself")
            raise NotYet(f"{where} the rate is {late:g}, expected {target:g}",
                         "after the warm-up: base_lr * global_batch / base_batch")
        if warmup and math.isclose(lr(0), target, rel_tol=1e-6):
            raise NotYet(f"step 0 already has the full rate {target:g} (warmup_steps={warmup})",
                         "no warm-up: ramp linearly, target * min(1, (step + 1) / warmup_steps)")
        for step in range(100):
            want = _expected_lr(step, batch, base_lr, base_batch, warmup)
            got = lr(step)
            if not math.isclose(got, want, rel_tol=1e-6):
                hint = ("off by one: step 0 already trains, with target / warmup_steps, and "
                        "step warmup_steps - 1 reaches the target" if warmup and
                        math.isclose(got, target * step / warmup, rel_tol=1e-6)
                        else "target * min(1, (step + 1) / warmup_steps)")
                raise NotYet(f"step {step} (warmup_steps={warmup}, global batch {batch}): "
                             f"{got:g}, expected {want:g}", hint)
    return (f"{len(_LR_CASES)} schedules, 100 steps each: scaled by global_batch / base_batch, "
            f"ramped over warmup_steps")


# ==== challenge: DDP from scratch, gradient buckets all-reduced from backward hooks ==========
# Graded on 2 and 4 ranks: weights after two SGD steps against one process on the global batch,
# and the route (one all-reduce per bucket, each bucket's bytes, started while backward runs).

_BUCKET_CASES = (  # (dtype, bucket_numel, first layer frozen)
    ("float32", 40, False),  # 4 buckets: [4.bias 4.weight 2.bias] [2.weight] [0.bias] [0.weight]
    ("float64", 30, True),  # 3 buckets over the trainable layers only, in double precision
)
_BUCKET_STEPS = 2  # the second step shows whether the hooks re-arm after each backward
_BUCKET_TOL = {"float32": 1e-5, "float64": 1e-10}
_BUCKET_RULE = ("take the parameters with requires_grad in reverse order of model.parameters(); "
                "a bucket takes them one by one until the next would make it exceed bucket_numel "
                "elements (one bigger than that gets a bucket of its own)")


def _bucket_model(dtype: str, frozen: bool):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).to(getattr(torch, dtype))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _buckets(sizes: list[int], bucket_numel: int) -> list[list[int]]:
    """The indices into ``sizes`` (parameters in model order) of each bucket, in send order."""
    buckets: list[list[int]] = []
    for i in reversed(range(len(sizes))):
        if buckets and sum(sizes[j] for j in buckets[-1]) + sizes[i] <= bucket_numel:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _bucketed_ddp_worker(fn, cases) -> list[dict]:
    """On each rank, for each case: the learner's ``fn(model, bucket_numel)``, two SGD steps."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype, cap, frozen in cases:
        gen = torch.Generator().manual_seed(1)
        batches = [(torch.randn(3 * world, 6, generator=gen).to(getattr(torch, dtype)),
                    torch.randint(0, 3, (3 * world,), generator=gen))
                   for _ in range(_BUCKET_STEPS)]
        reference = _bucket_model(dtype, frozen)  # one process on the global batch
        ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
        ref_grads = []
        for x, y in batches:
            ref_opt.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            ref_grads.append([None if p.grad is None else p.grad.clone()
                              for p in reference.parameters()])
            ref_opt.step()
        model = _bucket_model(dtype, frozen)
        wait = fn(model, cap)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        earliest = next(m for m in model if any(p.requires_grad for p in m.parameters()))
        steps = []
        for x, y in batches:
            mine = slice(3 * rank, 3 * rank + 3)
            opt.zero_grad()
            seen: list[int] = []  # all-reduces issued when each of the earliest layer's grads came
            with traffic.count_traffic() as during:
                probes = [p.register_hook(lambda g, seen=seen, t=during: seen.append(len(t.calls)))
                          for p in earliest.parameters()]
                nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
            for probe in probes:
                probe.remove()
            if not callable(wait):
                out.append({"returned": type(wait).__name__})
                break
            with traffic.count_traffic() as after:
                wait()
            steps.append({
                "during": [(c.op, c.payload_bytes) for c in during.calls],
                "sent_during": during.sent_bytes(),
                "after": [(c.op, c.payload_bytes) for c in after.calls],
                "before_earliest": min(seen) if seen else None,
                "grads": [None if p.grad is None else p.grad.detach().clone()
                          for p in model.parameters()],
            })
            opt.step()
        else:
            out.append({"steps": steps, "ref_grads": ref_grads,
                        "params": [p.detach().clone() for p in model.parameters()],
                        "ref_params": [p.detach().clone() for p in reference.parameters()],
                        "names": [n for n, _ in model.named_parameters()],
                        "trainable": [p.requires_grad for p in model.parameters()],
                        "earliest": [any(p is q for q in earliest.parameters())
                                     for p in model.parameters()]})
    return out


def _bucket_route(step: int, got: dict, want: list[int], early: int, esize: int,
                  sizes: list[int], where: str) -> None:
    """Raise NotYet unless step ``step`` issued one all-reduce per bucket, of its size, in time."""
    from ..parallel.traffic import ring_bytes

    calls = got["during"] + got["after"]
    others = sorted({op for op, _ in calls if op != "all_reduce"})
    if others:
        raise NotYet(f"{where}, step {step}: it called {', '.join(others)} besides all_reduce",
                     "each bucket is one dist.all_reduce of the bucket's flat gradient, nothing "
                     "else: every rank already holds the same weights")
    numels = [b // esize for _, b in calls]
    if not calls and step > 1:
        raise NotYet(f"{where}: step 1 all-reduced, step 2 issued no all-reduce",
                     "the hooks fire on every backward, but each bucket must count its ready "
                     "gradients afresh: reset a bucket's count (and buffer) once it is sent")
    if not calls:
        raise NotYet(f"{where}, step {step}: no all-reduce was issued",
                     "register a hook on every parameter with requires_grad "
                     "(p.register_post_accumulate_grad_hook) that, when its bucket is full, "
                     "starts dist.all_reduce(flat, async_op=True)")
    if sorted(numels) != sorted(want):
        sent = sorted(b for _, b in calls)
        other = next((size for size in (2, 4, 8) if size != esize
                      and sent == sorted(n * size for n in want)), None)
        if other:
            raise NotYet(f"{where}, step {step}: the buckets went out as {other}-byte numbers "
                         f"in a model of {esize}-byte ones",
                         "build each bucket's flat buffer in the gradients' dtype (torch.cat of "
                         "the gradients keeps it; torch.zeros(n) is float32)")
        if sorted(numels) == sorted(sizes):
            hint = ("one all-reduce per parameter is what buckets avoid (each call pays the "
                    "latency): pack the gradients into buckets, " + _BUCKET_RULE)
        elif len(numels) > len(want) and set(numels) <= set(want):
            hint = ("a bucket was all-reduced more than once: start a bucket's all-reduce once, "
                    "when its last gradient arrives, and reset it for the next backward")
        else:
            hint = _BUCKET_RULE
        raise NotYet(f"{where}, step {step}: all-reduces of {numels} elements; the buckets are "
                     f"{want}", hint)
    if got["after"]:
        raise NotYet(f"{where}, step {step}: {len(got['after'])} of {len(calls)} all-reduces "
                     f"were started in wait(), after backward returned",
                     "start each bucket's all-reduce from a gradient hook, during backward "
                     "(dist.all_reduce(flat, async_op=True) when the bucket's last gradient "
                     "arrives); wait() only waits for them and writes the means back")
    if got["before_earliest"] is not None and got["before_earliest"] < early:
        raise NotYet(f"{where}, step {step}: {got['before_earliest']} of {len(want)} all-reduces "
                     f"had started when backward reached the first layer (the {early} without "
                     f"its gradients should have)",
                     "start a bucket as soon as its last gradient is accumulated, not all at the "
                     "end of backward: the point of buckets is that communication overlaps with "
                     "the rest of backward")
    world_bytes = sum(ring_bytes("all_reduce", n * esize, got["world"]) for n in want)
    if got["sent_during"] != world_bytes:  # follows from the sizes; kept as the measured claim
        raise NotYet(f"{where}, step {step}: sent {got['sent_during']} bytes, a ring all-reduce "
                     f"of each bucket sends {world_bytes}", _BUCKET_RULE)


def _bucket_values(step: int, got: dict, ref: list, names: list, world: int, tol: float,
                   where: str) -> None:
    """Raise NotYet unless the gradients after ``wait()`` are the global batch's, per parameter."""
    for name, g, r in zip(names, got["grads"], ref, strict=True):
        if r is None:
            if g is not None and g.abs().max() > 0:
                raise NotYet(f"{where}: the frozen parameter {name!r} got a gradient",
                             "leave parameters with requires_grad=False out of the buckets")
            continue
        if g is None:
            raise NotYet(f"{where}, step {step}: {name!r} has no .grad after wait()",
                         "wait() writes each bucket's averaged gradients back into p.grad "
                         "(e.g. p.grad.copy_(view of the flat bucket))")
        if g.dtype != r.dtype:
            raise NotYet(f"{where}: {name!r}.grad is {g.dtype}, the model is {r.dtype}",
                         "build each bucket's flat buffer in the gradients' dtype (torch.cat "
                         "of the gradients keeps it; torch.zeros(n) is float32)")
        gap = float((g.double() - r.double()).abs().max())
        if gap <= tol:
            continue
        if float((g.double() - world * r.double()).abs().max()) <= tol * world:
            raise NotYet(f"{where}, step {step}: {name!r}.grad is {world}x the global "
                         f"batch's gradient", "all_reduce sums: divide each bucket by the world "
                         "size (before or after the all-reduce)")
        if gap < 1e-5:
            raise NotYet(f"{where}, step {step}: {name!r}.grad is off by {gap:.1e}, float32 "
                         f"rounding in a {r.dtype} model", "build each bucket's flat buffer "
                         "in the gradients' dtype (torch.cat of the gradients keeps it)")
        raise NotYet(f"{where}, step {step}: {name!r}.grad differs from the global batch's "
                     f"mean gradient by {gap:.2g}",
                     "after wait() every p.grad must be its bucket's all-reduced flat gradient "
                     "divided by the world size, copied back from the right offset")


@exercise("bucketed_ddp", notebook=NOTEBOOK, title="challenge: DDP from gradient buckets")
def bucketed_ddp(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn(model, bucket_numel) -> wait`` makes ``model`` data-parallel, DDP's way.

    Run on real gloo ranks (``worlds``) for two SGD steps of a 3-layer MLP, float32 with
    4 buckets, then float64 with its first layer frozen: every rank's gradients after ``wait()``
    and weights after the steps equal one process's on the global batch; each step issues one
    all-reduce per bucket of the bucket's size (and its ring bytes), every one started during
    backward, all but the last before backward reaches the first layer; ``wait()`` sends nothing.

    Example::

        >>> exercise.bucketed_ddp(my_bucketed_ddp)
        [pass] challenge: DDP from gradient buckets: on 2 and 4 ranks ...
    """
    for world in worlds:
        ranks = on_ranks(_bucketed_ddp_worker, fn, _BUCKET_CASES, nproc=world, timeout=60.0)
        for rank, per_case in enumerate(ranks):
            for (dtype, cap, frozen), got in zip(_BUCKET_CASES, per_case, strict=True):
                where = (f"on {world} ranks (rank {rank}), {dtype}, bucket_numel {cap}"
                         + (", first layer frozen" if frozen else ""))
                if "returned" in got:
                    raise NotYet(f"{where}: it returned {got['returned']}, not a function",
                                 "return wait, a function of no arguments that the loop calls "
                                 "after loss.backward(): it waits for the all-reduces and "
                                 "writes the averaged gradients into p.grad")
                kept = [i for i, t in enumerate(got["trainable"]) if t]
                sizes = [got["params"][i].numel() for i in kept]
                buckets = _buckets(sizes, cap)
                want = [sum(sizes[j] for j in b) for b in buckets]
                early = sum(not any(got["earliest"][kept[j]] for j in b) for b in buckets)
                esize = got["params"][0].element_size()
                for step, (s, ref) in enumerate(zip(got["steps"], got["ref_grads"], strict=True),
                                                start=1):
                    _bucket_route(step, {**s, "world": world}, want, early, esize, sizes,
                                  where)
                    _bucket_values(step, s, ref, got["names"], world, _BUCKET_TOL[dtype], where)
                gap = max(float((p.double() - r.double()).abs().max())
                          for p, r in zip(got["params"], got["ref_params"], strict=True))
                if gap > _BUCKET_TOL[dtype]:
                    raise NotYet(f"{where}: after {_BUCKET_STEPS} steps the weights differ "
                                 f"from one process's by {gap:.2g}",
                                 "the gradients were right: leave the optimizer step to the "
                                 "loop (wait() only waits and writes gradients)")
    return (f"on {' and '.join(map(str, worlds))} ranks, float32 and float64 (a frozen layer): "
            f"the weights after {_BUCKET_STEPS} steps equal one process's on the global batch; "
            f"one all-reduce per bucket, each started from a hook while backward ran")
