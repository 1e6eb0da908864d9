"""labkit.elastic: checkpoints every k steps, resume, and a killed worker restarted by torchrun."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from labkit.elastic import latest_checkpoint, resumable_training, resume_latest, step_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _data(n=96, features=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    return x, (x[:, 0] > 0).long()


def _make():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_latest_checkpoint_is_the_highest_step(tmp_path):
    assert latest_checkpoint(tmp_path / "none-yet") is None
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10, 100):
        (tmp_path / f"step-{step:06d}.pt").write_bytes(b"")
    (tmp_path / ".step-000200.pt.tmp-123").write_bytes(b"")  # a write that never finished
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000100.pt"


def test_step_batch_depends_on_the_step_alone_and_covers_each_epoch():
    first = [step_batch(40, s, 4, r, 2, seed=1) for s in range(5) for r in range(2)]
    assert sorted(torch.cat(first).tolist()) == list(range(40))  # one epoch: every sample once
    assert torch.equal(step_batch(40, 7, 4, 1, 2, seed=1), step_batch(40, 7, 4, 1, 2, seed=1))
    assert not torch.equal(step_batch(40, 0, 4, 0, 2, seed=1), step_batch(40, 5, 4, 0, 2, seed=1))
    with pytest.raises(ValueError, match="do not make one batch of 16 on each of 4 ranks: use a "
                                         "batch of at most 10"):
        step_batch(40, 0, 16, 0, 4)


def test_resuming_from_a_checkpoint_ends_bitwise_where_a_straight_run_ends(group, tmp_path):
    data = _data()
    straight = resumable_training(_make, data, tmp_path / "a", steps=12, ckpt_every=4, batch=8)
    assert straight["resumed_from"] is None and straight["steps_run"] == list(range(1, 13))
    # Stop after 8 steps, then run again asking for 12: it resumes at the step-8 checkpoint.
    resumable_training(_make, data, tmp_path / "b", steps=8, ckpt_every=4, batch=8)
    resumed = resumable_training(_make, data, tmp_path / "b", steps=12, ckpt_every=4, batch=8)
    assert resumed["resumed_from"] == 8 and resumed["steps_run"] == [9, 10, 11, 12]
    assert torch.equal(resumed["weights"], straight["weights"])  # momentum restored too
    assert [p.name for p in sorted((tmp_path / "a").iterdir())] == [
        "step-000004.pt", "step-000008.pt", "step-000012.pt"]


def test_resume_latest_restores_the_newest_checkpoint_or_says_0(group, tmp_path):
    model = _make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert resume_latest(model, opt, tmp_path / "none-yet") == 0
    resumable_training(_make, _data(), tmp_path, steps=6, ckpt_every=4, batch=8)
    assert resume_latest(model, opt, tmp_path) == 6
    saved = torch.load(tmp_path / "step-000006.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 saved["model"].values(), strict=True))
    assert opt.state_dict()["state"][0]["momentum_buffer"] is not None


def test_the_resume_step_is_the_callers_to_choose(group, tmp_path):
    resumable_training(_make, _data(), tmp_path, steps=8, ckpt_every=4, batch=8)
    calls = []

    def from_scratch(model, optimizer, folder):
        calls.append(folder)
        return 0  # ignore the checkpoints: every step again

    again = resumable_training(_make, _data(), tmp_path, steps=8, ckpt_every=4, batch=8,
                               resume=from_scratch)
    assert calls == [tmp_path] and again["resumed_from"] is None
    assert again["steps_run"] == list(range(1, 9))


def test_bad_step_counts_are_refused(group, tmp_path):
    with pytest.raises(ValueError, match="need steps >= 1 and ckpt_every >= 1"):
        resumable_training(_make, _data(), tmp_path, steps=10, ckpt_every=0)


def test_a_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_weights(tmp_path,
                                                                                       capsys):
    from labkit import launch

    data = _data()
    kwargs = {"steps": 16, "ckpt_every": 5, "batch": 8}
    straight = launch(resumable_training, _make, data, str(tmp_path / "a"), nproc=2,
                      show_ranks=[], **kwargs).values
    # Rank 1 dies by SIGKILL before step 13: torchrun restarts both ranks, which resume from
    # the step-10 checkpoint and redo steps 11 and 12.
    killed = launch(resumable_training, _make, data, str(tmp_path / "b"), nproc=2,
                    show_ranks=[], max_restarts=1, crash={"rank": 1, "step": 13}, **kwargs).values
    for rank in range(2):
        assert killed[rank]["restarts"] == 1 and killed[rank]["resumed_from"] == 10
        assert killed[rank]["steps_run"] == list(range(11, 17))
        assert torch.equal(killed[rank]["weights"], straight[rank]["weights"])  # bitwise
    out = capsys.readouterr().out
    assert "torchrun restarted the workers 1 time(s), then the run finished" in out


def test_without_restarts_the_killed_run_fails_and_says_so(tmp_path):
    from labkit import LaunchError, launch

    with pytest.raises(LaunchError, match=r"rank 1 was killed by SIGKILL \(signal 9\)") as err:
        launch(resumable_training, _make, _data(), str(tmp_path), steps=6, ckpt_every=5, batch=8,
               crash={"rank": 1, "step": 3}, nproc=2, show_ranks=[])
    assert err.value.rank == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_restarts_must_be_a_whole_number(bad):
    from labkit import launch

    with pytest.raises(ValueError, match="max_restarts must be a whole number >= 0"):
        launch(_make, nproc=1, max_restarts=bad)
