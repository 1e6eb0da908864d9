"""labkit.parallel.parameter_server: shards, the sync server as plain SGD, async staleness."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labkit import launch
from labkit.parallel.parameter_server import parameter_server, worker_batches

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS, BATCH, LR = 6, 8, 0.5


def _data(n=120, features=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # 3 classes a linear model can learn


def _make():
    return torch.nn.Linear(12, 3)



def test_worker_batches_are_disjoint_shards_reshuffled_each_pass():
    shards = [worker_batches(20, w, 2, batch=5, steps=4) for w in range(2)]
    for batches in shards:
        assert [len(b) for b in batches] == [5] * 4
        # 10 samples per shard: the first pass (2 batches) sees each exactly once, then again.
        assert sorted(torch.cat(batches[:2]).tolist()) == sorted(torch.cat(batches[2:]).tolist())
    assert not set(torch.cat(shards[0]).tolist()) & set(torch.cat(shards[1]).tolist())
    assert [b.tolist() for b in worker_batches(20, 1, 2, 5, 4)] == [b.tolist() for b in shards[1]]


@pytest.mark.parametrize("args, match", [
    ((10, 2, 2, 2, 1), r"worker must be in 0\.\.1, got 2"),
    ((10, 0, 2, 0, 1), "need batch >= 1 and steps >= 1"),
    ((10, 0, 2, 2, 0), "need batch >= 1 and steps >= 1"),
    ((10, 0, 4, 5, 1), r"10 samples over 4 workers leaves 3 each, fewer than one batch of 5"),
])
def test_worker_batches_refuse_what_cannot_work(args, match):
    with pytest.raises(ValueError, match=match):
        worker_batches(*args)


def test_parameter_server_refuses_bad_mode_and_a_lone_rank(group):
    data = _data()
    with pytest.raises(ValueError, match="unknown mode 'hogwild': use 'sync' or 'async'"):
        parameter_server(_make, data, data, mode="hogwild")
    with pytest.raises(ValueError, match="at least one worker: launch it with nproc >= 2"):
        parameter_server(_make, data, data)


def _both_modes(data):
    sync = parameter_server(_make, data, data, mode="sync", steps=STEPS, batch=BATCH, lr=LR)
    # Worker 1 sleeps after each gradient: worker 2's pushes land meanwhile, so 1's go stale.
    late = parameter_server(_make, data, data, mode="async", steps=STEPS, batch=BATCH, lr=LR,
                            slow={1: 0.05})
    return {"sync": sync, "async": late}


@pytest.fixture(scope="module")
def three_ranks():
    """One launch: a server and two workers, both modes (about 10 s here)."""
    return launch(_both_modes, _data(), nproc=3, show_ranks=[], timeout=180).values


def _reference_sgd(data):
    """One process: each step the mean of the two workers' batch gradients, as sync promises."""
    torch.manual_seed(0)
    model = _make()
    w = parameters_to_vector(model.parameters()).detach()
    batches = [worker_batches(len(data[0]), k, 2, BATCH, STEPS) for k in range(2)]
    for step in range(STEPS):
        grads = []
        for k in range(2):
            vector_to_parameters(w, model.parameters())
            model.zero_grad()
            idx = batches[k][step]
            F.cross_entropy(model(data[0][idx]), data[1][idx]).backward()
            grads.append(parameters_to_vector(p.grad for p in model.parameters()))
        w = w - LR * torch.stack(grads).mean(0)
    return w


def test_sync_server_is_sgd_on_the_union_of_the_batches(three_ranks):
    server = three_ranks[0]["sync"]
    assert server["updates"] == STEPS and set(server["staleness"]) == {0}
    assert torch.allclose(server["weights"], _reference_sgd(_data()), atol=1e-6)
    assert [three_ranks[r]["sync"]["rank"] for r in (1, 2)] == [1, 2]
    assert all(len(three_ranks[r]["sync"]["losses"]) == STEPS for r in (1, 2))


def test_async_server_applies_every_gradient_and_the_slow_ones_late(three_ranks):
    server = three_ranks[0]["async"]
    assert server["updates"] == 2 * STEPS
    assert sorted(server["pushed_by"]) == [1] * STEPS + [2] * STEPS
    late = [s for s, who in zip(server["staleness"], server["pushed_by"], strict=True) if who == 1]
    assert min(server["staleness"]) >= 0 and max(late) >= 1, server["staleness"]
    assert server["mean_staleness"] == pytest.approx(sum(server["staleness"]) / (2 * STEPS))
    assert 0 <= server["accuracy"] <= 1 and server["bytes_per_update"] == (12 * 3 + 3) * 4
