"""labkit.check's machinery, and notebook 01's graders: right answers pass, wrong ones get hints."""

import json
import re

import pytest
import torch
from torchvision.transforms import v2

from labkit import check
from labkit.exercises import augmentation

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def tail():
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def test_a_good_pipeline_passes(capsys):
    good = v2.Compose([v2.RandomResizedCrop(32, scale=(0.7, 1.0)), v2.RandomHorizontalFlip(),
                       v2.RandomRotation(15), *tail()])
    assert augmentation.augmentation_pipeline(good, 32)
    assert "[pass] augmentation pipeline" in capsys.readouterr().out


@pytest.mark.parametrize("steps, needs, said", [
    ([v2.Resize((32, 32)), v2.RandomRotation(15)], ("flip", "rotation"), "no flip step"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip()], ("flip", "rotation"), "no rotation step"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip(p=0.0), v2.RandomRotation(0)],
     ("flip", "rotation"), "nothing random happens"),
    ([v2.Resize((40, 40)), v2.RandomHorizontalFlip(), v2.RandomRotation(15)],
     ("flip", "rotation"), "output shape (3, 40, 40)"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip()], ("flip", "policy"), "no policy step"),
])
def test_augmentation_pipeline_wrong_steps_get_a_hint(capsys, steps, needs, said):
    verdict = augmentation.augmentation_pipeline(v2.Compose([*steps, *tail()]), 32, needs=needs)
    assert not verdict
    out = capsys.readouterr().out
    assert "[not yet]" in out and said in out and "hint:" in out


def test_a_pipeline_without_float_output_is_told_how_to_end():
    verdict = augmentation.augmentation_pipeline(
        v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(),
                    v2.RandomRotation(10)]), 32)
    assert not verdict and "ToDtype" in verdict.hint


def test_a_pipeline_that_crashes_is_reported_not_raised():
    def broken(image):
        raise RuntimeError("kaput")

    verdict = augmentation.augmentation_pipeline(broken, 32)
    assert not verdict and "kaput" in verdict.detail


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Conv2d(3, 4, 3)
        self.classifier = torch.nn.Linear(4, 2)


def test_frozen_base_wrong_answers_get_hints():
    model = Net()
    assert not augmentation.frozen_base(model)  # nothing frozen yet
    for p in model.features.parameters():
        p.requires_grad = False
    assert augmentation.frozen_base(model)
    for p in model.classifier.parameters():
        p.requires_grad = False
    verdict = augmentation.frozen_base(model)
    assert not verdict and "nothing would learn" in verdict.detail


@pytest.fixture
def judged(monkeypatch):
    """Claims judged as on a laptop (the cpu profile), whatever profile the tests run in."""
    monkeypatch.setenv("LABKIT_PROFILE", "cpu")


def test_in_band_prints_a_verdict_and_never_raises_on_a_noisy_figure(capsys, judged):
    assert check.in_band("gap", 0.48, 0.3, 1.0, cause="few epochs")
    assert capsys.readouterr().out == ("[as expected] gap: measured 0.48, expected between 0.3 "
                                       "and 1\n")
    verdict = check.in_band("gap", 0.1, 0.3, cause="few epochs")
    out = capsys.readouterr().out
    assert not verdict and "[not as expected] gap: measured 0.1, expected at least 0.3" in out
    assert "likely cause: few epochs" in out and verdict.hint == "likely cause: few epochs"
    assert not check.in_band("accuracy", float("nan"), high=1.0, cause="a loss became NaN")
    assert "at most 1" in capsys.readouterr().out


def test_in_band_wants_low_below_high():
    with pytest.raises(ValueError, match="low <= high.*swap them"):
        check.in_band("gap", 0.5, 1.0, 0.3, cause="-")


def test_solutions_only_when_asked(capsys):
    assert "requires_grad = False" in check.solution("frozen_base")
    assert "requires_grad" in capsys.readouterr().out
    with pytest.raises(KeyError, match="no exercise 'nope': choose from .*augmentation_pipeline"):
        check.solution("nope")


# ---- the exercise machinery ---------------------------------------------------------------------

@check.exercise("_test_double", notebook="99", title="double it")
def double_check(fn):
    if fn(2) != 4:
        raise check.NotYet(f"fn(2) gave {fn(2)}", "multiply by two")
    return "fn(2) == 4"


def _double_on_ranks(fn):
    import torch.distributed as dist

    return fn(dist.get_rank() + 1)


@check.exercise("_test_double_on_ranks", notebook="99", title="double it on every rank")
def double_on_ranks(fn):
    values = check.on_ranks(_double_on_ranks, fn, timeout=60)
    if values != [2, 4]:
        raise check.NotYet(f"ranks returned {values}", "multiply by two")
    return "both ranks doubled"


def test_a_pass_is_recorded_in_the_progress_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert double_check(lambda x: 2 * x)
    assert "[pass] double it: fn(2) == 4" in capsys.readouterr().out
    assert "_test_double" in json.loads((tmp_path / "progress.json").read_text())
    done = check.progress()
    assert done["99"] == ["_test_double"]
    out = capsys.readouterr().out
    assert "[pass] double it" in out and "[    ] double it on every rank" in out
    assert f"recorded in {tmp_path / 'progress.json'}" in out


def test_a_wrong_answer_is_a_hint_and_not_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = double_check(lambda x: x + 1)
    assert not verdict and verdict.hint == "multiply by two" and "fn(2) gave 3" in verdict.detail
    assert "[not yet] double it" in capsys.readouterr().out
    assert not (tmp_path / "progress.json").exists()


def test_the_placeholder_is_not_written_yet_without_running_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))

    def untouched(x):
        raise NotImplementedError(check.PLACEHOLDER)

    class Untouched:  # as the learner finds a class to write: seen without calling it
        @staticmethod
        def forward(ctx, x):
            raise NotImplementedError("your code here")

    for answer in (untouched, ..., Untouched):
        verdict = double_check(answer)
        assert not verdict and "not written yet" in verdict.detail
        assert "check.solution('_test_double')" in verdict.hint


def test_the_learners_exception_is_a_verdict_with_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))

    def broken(x):
        return {}[x]

    verdict = double_check(broken)
    assert not verdict and "your code raised KeyError: 2" in verdict.detail
    assert "in broken" in verdict.detail and "return {}[x]" in verdict.detail


def test_a_damaged_progress_file_starts_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    (tmp_path / "progress.json").write_text("{not json")
    assert double_check(lambda x: 2 * x)
    assert list(json.loads((tmp_path / "progress.json").read_text())) == ["_test_double"]


def test_an_exercise_id_is_taken_once():
    with pytest.raises(ValueError, match="'_test_double' is taken"):
        check.exercise("_test_double", notebook="98", title="again")


def test_on_ranks_grades_on_real_ranks_and_turns_failures_into_hints(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert double_on_ranks(lambda x: 2 * x)
    wrong = double_on_ranks(lambda x: x)
    assert not wrong and "ranks returned [1, 2]" in wrong.detail

    def fails_on_rank_1(x):
        if x == 2:
            raise ValueError("rank one is unhappy")
        return 2 * x

    failed = double_on_ranks(fails_on_rank_1)
    assert not failed and "rank 1 raised" in failed.detail
    assert "rank one is unhappy" in failed.detail

    def untouched(x):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in double_on_ranks(untouched).detail
    assert double_on_ranks(lambda x: 2 * x)  # the pool was replaced after the failure


def _hangs_on_rank_0(fn):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return 0


def test_on_ranks_names_a_hang(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    with pytest.raises(check.NotYet, match="still running after 8 s") as hang:
        check.on_ranks(_hangs_on_rank_0, None, timeout=8)
    assert "same collectives in the same order" in hang.value.hint
    assert "rank 0: waits in all_reduce, from " in hang.value.detail
    assert "in _hangs_on_rank_0" in hang.value.detail


# A ring exercise's wrong chunk sizes, as gloo fails on 4 ranks: the rank that receives a
# message larger than its buffer aborts in native code, and its peers' reads then fail with
# "connection reset" or "connection closed". Which of them the run reports first is a race.
_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
          "[127.0.0.1]:9094: Connection reset by peer. This is typically caused by a remote "
          "worker hanging or bugs in the application.")
_CLOSED = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
           "peer [127.0.0.1]:20891. This is typically caused by a remote worker crashing.")
_ABORT_LINES = [
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "  what():  [enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 4 vs 0. "
    "Received data size doesn't match expected size."]


def _peer_error(rank: int, message: str) -> str:
    return (f"rank {rank} failed with RuntimeError: {message}\n\n"
            f"--- rank {rank} traceback ---\nTraceback (most recent call last):\n"
            f'  File "/tmp/ipykernel_1/7.py", line 4, in my_ring\n    work.wait()\n'
            f"RuntimeError: {message}")


def _fails_with(monkeypatch, error):
    from labkit import launcher

    def launch(*args, **kwargs):
        raise error

    monkeypatch.setattr(launcher, "launch", launch)
    with pytest.raises(check.NotYet) as wrong:
        check.on_ranks(_double_on_ranks, None, nproc=4)
    return wrong.value


@pytest.mark.parametrize("peer", [_RESET, _CLOSED])
def test_on_ranks_shows_the_rank_that_died_not_the_peer_that_lost_it(monkeypatch, peer):
    from labkit.launcher import LaunchError

    death = ("rank 1 was killed by SIGABRT (signal 6): native code aborted\n\n"
             "--- rank 1 last output lines ---\n" + "\n".join(_ABORT_LINES) +
             f"\n\nThen rank 2 failed with RuntimeError: {peer}")
    wrong = _fails_with(monkeypatch, LaunchError(death, rank=1, full_message=_peer_error(2, peer),
                                                 logs={1: _ABORT_LINES, 2: []}))
    assert wrong.detail.startswith("rank 1 was killed by SIGABRT")
    assert "size doesn't match" in wrong.detail and "crashed in native code" in wrong.hint


@pytest.mark.parametrize("peer", [_RESET, _CLOSED])
def test_on_ranks_finds_an_unrecorded_abort_behind_a_lost_connection(monkeypatch, peer):
    from labkit.launcher import LaunchError

    # The run stopped on rank 3's error before rank 1's death was recorded: its output has it.
    raised = _peer_error(3, peer)
    wrong = _fails_with(monkeypatch, LaunchError(raised, rank=3, full_message=raised,
                                                 logs={0: ["step 1"], 1: _ABORT_LINES, 3: []}))
    assert wrong.detail.startswith("rank 1 aborted in native code")
    assert "size doesn't match" in wrong.detail and "Connection" not in wrong.detail


def test_on_ranks_says_a_lost_connection_is_a_consequence(monkeypatch):
    from labkit.launcher import LaunchError

    raised = _peer_error(2, _CLOSED)
    wrong = _fails_with(monkeypatch, LaunchError(raised, rank=2, full_message=raised, logs={}))
    assert wrong.detail.startswith("rank 2 lost its connection to a peer")
    assert "Connection closed by peer" in wrong.detail and "in my_ring" in wrong.detail
    assert wrong.hint.startswith("that error is a consequence")


def test_on_ranks_keeps_a_rank_that_raised_before_its_peers_lost_it(monkeypatch):
    from labkit.launcher import LaunchError

    raised = _peer_error(0, "shape mismatch in my code")
    wrong = _fails_with(monkeypatch, LaunchError(raised, rank=0, full_message=raised,
                                                 logs={1: ["fine"]}))
    assert wrong.detail.startswith("rank 0 raised RuntimeError: shape mismatch in my code")
    assert "the traceback above is your code's" in wrong.hint


def test_in_band_measures_again_once_when_it_misses(capsys, judged):
    again = iter([0.5])
    assert check.in_band("speedup", 0.1, 0.3, cause="busy", retry=lambda: next(again))
    out = capsys.readouterr().out
    assert "[measuring again] speedup" in out and "[as expected] speedup: measured 0.5" in out
    assert not check.in_band("speedup", 0.1, 0.3, cause="busy", retry=lambda: 0.2)


def test_prediction_compares_and_never_raises(capsys, judged):
    assert check.prediction("speedup", 1.9, 1.62, unit="x")
    assert "you said 1.9x, measured 1.62x (17% off: close)" in capsys.readouterr().out
    far = check.prediction("speedup", 4, 1.62, unit="x", why="communication is not free")
    assert not far and "why: communication is not free" in capsys.readouterr().out
    assert check.prediction("bytes", 20_000, 20_436)
    assert "you said 20,000, measured 20,436 (2% off: close)" in capsys.readouterr().out
    assert check.prediction("speedup", ..., 1.62) is None
    assert "Write your prediction first" in capsys.readouterr().out


# ---- notebook 01: the batched per-image flip and the fair train-validation gap -----------------

def solved_01():
    """The names that solutions/01_vgg16_data_augmentation.py's function blocks define."""
    from torch.utils.data import DataLoader

    from labkit import augment, data, exercises

    names = {"torch": torch, "augment": augment, "data": data, "DataLoader": DataLoader}
    blocks = exercises.solution_blocks("01_vgg16_data_augmentation")
    for ex_id in ("per_image_flip", "fair_gap"):
        exec(blocks[ex_id], names)
    return names


def test_per_image_flip_solution_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    assert augmentation.per_image_flip(solved_01()["my_flip"])


def _coins(batch, p, generator):
    return (torch.rand(len(batch), generator=generator) < p).view(-1, 1, 1, 1)


def _flip_in_place(batch, p, generator=None):
    coins = _coins(batch, p, generator).flatten()
    batch[coins] = batch[coins].flip(-1)
    return batch


@pytest.mark.parametrize("answer, said", [
    (lambda b, p, generator=None: b.flip(-1) if torch.rand(1, generator=generator) < p else b,
     "torch.rand(len(batch))"),
    (lambda b, p, generator=None: torch.where(_coins(b, p, generator), b.flip(-2), b),
     "an up-down flip"),
    (lambda b, p, generator=None: torch.where(_coins(b, p, generator), b.flip(1), b),
     "the last dimension"),
    (lambda b, p, generator=None: torch.where(_coins(b, 1 - p, generator), b.flip(-1), b),
     "p=0 flips none"),
    (lambda b, p, generator=None: torch.where(_coins(b, p, None), b.flip(-1), b),
     "the generator you are given"),
    (_flip_in_place, "the caller still needs the original images"),
    (lambda b, p, generator=None: b[0], "return the whole batch"),
])
def test_per_image_flip_wrong_answers_get_their_hint(tmp_path, monkeypatch, answer, said):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = augmentation.per_image_flip(answer)
    assert not verdict and said in verdict.hint, verdict


def test_fair_gap_solution_passes_on_a_model_that_memorised_its_images(tmp_path, monkeypatch):
    from labkit import data
    from labkit.train import evaluate

    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = augmentation.fair_gap(solved_01()["my_gap"])
    assert verdict and "train 1.00" in verdict.detail
    train = data.shapes(30, image_size=16, seed=3, classes=["circle", "square", "cross"])
    model = augmentation._memoriser(train, 16)
    loader = torch.utils.data.DataLoader(data.to_torch(train, _plain(16)), batch_size=7)
    assert evaluate(model, loader, torch.device("cpu"))[1] == 1.0  # what the detail says


def _plain(size):
    from labkit import augment

    return augment.augmentation(size, kind="none")


def _augmented(size):
    from labkit import augment

    return augment.augmentation(size)


def _accuracy(model, images, size, *, eval_mode=True, transform=None, batch_size=256):
    from labkit import data

    model.eval() if eval_mode else model.train()
    loader = torch.utils.data.DataLoader(data.to_torch(images, transform or _plain(size)),
                                         batch_size=batch_size)
    with torch.no_grad():
        correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    return correct / len(images)


def _gap(**how):
    return lambda m, tr, va, s: _accuracy(m, tr, s, **how) - _accuracy(m, va, s, **how)


@pytest.mark.parametrize("answer, said", [
    (_gap(eval_mode=False), "call model.eval()"),
    (lambda m, tr, va, s: _gap(transform=_augmented(s))(m, tr, va, s), "un-augmented images"),
    (lambda m, tr, va, s: -_gap()(m, tr, va, s), "the sign"),
    (lambda m, tr, va, s: 100 * _gap()(m, tr, va, s), "not percentages"),
    (lambda m, tr, va, s: _accuracy(m, tr, s), "the train accuracy alone"),
    (lambda m, tr, va, s: _accuracy(m, tr, s) - _accuracy(m, tr, s), "each on its own set"),
])
def test_fair_gap_wrong_measurements_get_their_hint(tmp_path, monkeypatch, answer, said):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = augmentation.fair_gap(answer)
    assert not verdict and said in verdict.hint, verdict


# ---- claims in the smoke profile, grader failures, tracebacks, progress per notebook ----------

def test_in_band_in_smoke_says_the_claim_is_not_judged(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    retried = []
    verdict = check.in_band("weak-scaling speedup on 2 workers", 0.905, 1.2, cause="busy",
                            retry=lambda: retried.append(1) or 2.0)
    out = capsys.readouterr().out.replace("\n    ", " ")  # wrapped within 100 characters
    assert out.startswith("[not judged at this size] weak-scaling speedup on 2 workers: "
                          "measured 0.905; not judged at this size (the cpu and gpu profiles "
                          "expect at least 1.2)")
    assert "as expected" not in out and not retried  # a smoke run is not measured twice
    assert not verdict and not verdict.judged


def test_a_noisy_prediction_is_not_judged_in_smoke_an_exact_one_is(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    timed = check.prediction("speedup", 1.9, 0.9, unit="x", noisy=True)
    out = capsys.readouterr().out
    assert "you said 1.9x, measured 0.9x; not judged at this size" in out
    assert not timed and not timed.judged and "close" not in out
    assert check.prediction("bytes", 20_000, 20_436)  # a count means the same at every size
    assert "(2% off: close)" in capsys.readouterr().out


@check.exercise("_test_tensor", notebook="99", title="ones as a tensor")
def tensor_check(fn):
    import torch

    if not torch.equal(fn(), torch.ones(2)):  # fails on anything but a tensor
        raise check.NotYet("not ones", "return torch.ones(2)")
    return "ones"


def test_the_checks_own_failure_is_not_called_the_learners(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = tensor_check(lambda: [1.0, 1.0])  # a list: torch.equal cannot take it
    assert not verdict and "your code raised" not in verdict.detail
    assert verdict.detail.startswith("the check could not use what your code gave it: TypeError")
    assert "not your code raising" in verdict.hint and "dtype and shape" in verdict.hint
    assert "torch.equal" in verdict.traceback  # the whole text stays on the verdict


def _shape_error():
    import torch

    weight = torch.ones(3, 5)
    return torch.nn.functional.linear(torch.ones(2, 4), weight)  # 4 inputs, 5 expected


def test_a_learners_traceback_shows_their_frames_and_where_labkit_called(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    verdict = tensor_check(_shape_error)
    lines = verdict.detail.splitlines()
    assert lines[0].startswith("your code raised RuntimeError: mat1 and mat2 shapes")
    # The grader (here a test's) is the check's code: one line says where it called the answer.
    assert lines[1].startswith("  (labkit called your code from ")
    assert lines[1].endswith(", in tensor_check)")
    assert 'test_check.py", line' in lines[2] and "in _shape_error" in lines[2]
    assert "labkit/check.py\"" not in verdict.detail and "_grade" not in verdict.detail
    assert "Traceback (most recent call last)" in verdict.traceback


def test_learner_traceback_elides_a_librarys_frames_between_the_learners():
    torch_file = f"{torch.__file__.rsplit('/', 1)[0]}/nn/modules/module.py"
    text = ("Traceback (most recent call last):\n"
            f'  File "{check.__file__}", line 10, in _grade\n    detail = grader()\n'
            '  File "/tmp/ipykernel_1/2.py", line 3, in my_step\n    model(x)\n'
            f'  File "{torch_file}", line 1, in _wrapped_call_impl\n    return self._call(x)\n'
            f'  File "{torch_file}", line 2, in _call_impl\n    return forward_call(x)\n'
            '  File "/tmp/ipykernel_1/3.py", line 5, in forward\n    return x @ self.w\n'
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied\n")
    assert check.learner_traceback(text).splitlines() == [
        "  (labkit called your code from labkit/check.py, line 10, in _grade)",
        '  File "/tmp/ipykernel_1/2.py", line 3, in my_step', "    model(x)",
        "  ... 2 frames inside torch (the verdict's .traceback has them all)",
        '  File "/tmp/ipykernel_1/3.py", line 5, in forward', "    return x @ self.w",
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied"]
    no_learner = text.replace("/tmp/ipykernel_1/", f"{torch_file}.")
    assert check.learner_traceback(no_learner) == no_learner.rstrip()  # kept whole


def _compare_on_rank(fn):
    import torch

    return torch.equal(fn(), torch.ones(2))  # the check's comparison, on the rank


@check.exercise("_test_tensor_on_ranks", notebook="99", title="ones on every rank")
def tensor_on_ranks(fn):
    if not all(check.on_ranks(_compare_on_rank, fn, timeout=60)):
        raise check.NotYet("not ones", "return torch.ones(2)")
    return "ones"


def test_on_ranks_tells_the_learners_failure_from_the_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    learners = tensor_on_ranks(_shape_error)
    # Both ranks fail alike; which one the launcher reports first is a race.
    assert re.match(r"rank [01] raised RuntimeError: mat1 and mat2 shapes", learners.detail)
    assert "in _shape_error" in learners.detail and "in _compare_on_rank)" in learners.detail
    assert "the traceback above is your code's" in learners.hint
    assert "functional" in learners.traceback or "linear" in learners.traceback
    checks = tensor_on_ranks(lambda: [1.0, 1.0])
    assert checks.detail.startswith("the check's worker failed on rank")
    assert "not in your code: TypeError" in checks.detail and "raised" not in checks.detail


def test_progress_counts_a_twin_on_its_own_and_shows_once(tmp_path, monkeypatch, capsys):
    from labkit import exercises

    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    (tmp_path / "progress.json").write_text(json.dumps({"keras_tf_config": "2026-01-01"}))
    done = check.progress()
    assert done["02 keras"] == ["keras_tf_config"] and done["02"] == []
    assert done["01 keras"] == [] and "01" in done
    out = capsys.readouterr().out
    twin = [line for line in out.splitlines() if line.strip().startswith("02 keras")]
    plain = [line for line in out.splitlines() if line.strip().startswith("02 ")
             and "keras" not in line.split("of")[0]]
    assert len(twin) == 1 and "1 of 3" in twin[0] and "0 of" in plain[0]
    done._ipython_display_()  # a cell ending in check.progress() adds nothing to what printed
    assert capsys.readouterr().out == ""
    assert exercises.notebook_label("labkit.exercises.data_parallel_keras", "02") == "02 keras"
    assert exercises.notebook_label("labkit.exercises.composition.zero", "10") == "10"


def test_comparable_names_an_answer_of_the_wrong_kind_before_any_comparison():
    want = torch.zeros(2, 3)
    assert check.comparable(torch.ones(2, 3), want) is not None
    with pytest.raises(check.NotYet, match=r"my_ring\(x\) gave a list, where the check compares "
                                           r"a Tensor of shape \(2, 3\) and dtype torch.float32"):
        check.comparable([[1.0] * 3] * 2, want, "my_ring(x)")
    with pytest.raises(check.NotYet, match="has dtype torch.float64, where the check compares "
                                           "torch.float32") as wrong:
        check.comparable(torch.ones(2, 3, dtype=torch.float64), want)
    assert "keep the dtype of the input" in wrong.value.hint
    with pytest.raises(check.NotYet, match=r"has shape \(6,\), where the check compares \(2, 3\)"):
        check.comparable(torch.ones(6), want)
    assert check.comparable(torch.tensor(0.5), 1.0) is not None and check.comparable(3, 1.0) == 3
    with pytest.raises(check.NotYet, match="gave a str, where the check compares a number"):
        check.comparable("0.5", 1.0)
    with pytest.raises(check.NotYet, match="gave a Tensor, where the check compares a number"):
        check.comparable(torch.ones(2), 1.0)


# ---- what the learner sees: verdicts as badges in Jupyter, lines that fit ----------------------

def _in_a_kernel(monkeypatch):
    """Make labkit believe it runs in a Jupyter kernel; return what it displays."""
    from labkit import _display

    shown = []
    monkeypatch.setattr(_display, "in_kernel", lambda: True)
    import IPython.display

    monkeypatch.setattr(IPython.display, "display",
                        lambda obj, raw=False: shown.append((obj, raw)))
    return shown


@pytest.mark.parametrize("make, label, kind", [
    (lambda: check.Verdict("double it", True, "fn(2) == 4").show(), "pass", "labkit-pass"),
    (lambda: check.Verdict("double it", False, "fn(2) == 5", "add, do not multiply").show(),
     "not yet", "labkit-not-yet"),
    (lambda: check.in_band("gap", 0.48, 0.3, 1.0, cause="few epochs"), "as expected",
     "labkit-pass"),
    (lambda: check.in_band("gap", 0.1, 0.3, cause="few epochs"), "not as expected",
     "labkit-not-yet"),
])
def test_in_a_kernel_a_verdict_is_a_badge_with_its_text_beside_it(make, label, kind, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("LABKIT_PROFILE", "cpu")
    plain_out = None
    make()  # outside a kernel: printed
    plain_out = capsys.readouterr().out
    shown = _in_a_kernel(monkeypatch)
    make()
    assert capsys.readouterr().out == ""  # displayed, not printed twice
    (data, raw), = shown
    assert raw and data["text/plain"] + "\n" == plain_out  # logs and nbval read the same text
    assert data["text/plain"].startswith(f"[{label}] ")
    html = data["text/html"]
    assert "labkit-verdict" in html and kind in html and "labkit-badge" in html
    assert f">{label}</span>" in html and "border-left:4px solid" in html
    if label in ("not yet", "not as expected"):  # the hint on its own line, under its name
        assert 'class="labkit-note"' in html
        assert "\n  hint: " in data["text/plain"] or "\n  likely cause: " in data["text/plain"]


def test_in_smoke_the_badge_says_not_judged(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    shown = _in_a_kernel(monkeypatch)
    check.in_band("speedup", 0.9, 1.2, cause="busy")
    (data, _), = shown
    assert "labkit-not-judged" in data["text/html"]
    assert ">not judged at this size</span>" in data["text/html"]
    assert data["text/plain"].startswith("[not judged at this size] speedup: measured 0.9")


def test_the_html_escapes_what_the_learner_wrote(monkeypatch):
    shown = _in_a_kernel(monkeypatch)
    check.Verdict("<b>mine</b>", False, "got <script>alert(1)</script> & more",
                  'try "a < b"').show()
    (data, _), = shown
    html = data["text/html"]
    assert "<script>" not in html and "<b>mine</b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in html
    assert "&lt;b&gt;mine&lt;/b&gt;" in html and "try &quot;a &lt; b&quot;" in html
    assert "<script>alert(1)</script>" in data["text/plain"]  # the text itself is unchanged


def test_str_of_a_verdict_is_unchanged_and_a_worker_prints_plain_text(capsys):
    v = check.Verdict("double it", False, "x " * 80, "the hint")
    assert str(v) == f"[not yet] double it: {'x ' * 80}\n  hint: the hint"
    from labkit import _display

    assert not _display.in_kernel()  # pytest's process is no kernel: the verdict is printed
    v.show()
    assert capsys.readouterr().out.startswith("[not yet] double it: x x")


LONG = ("rank 1 sent 1,234,567 bytes in 3 messages where the reference sends 617,284 bytes in "
        "2 messages of 308,642.5 bytes each, on 2 and 4 ranks, with tensors of dtype "
        "torch.float64 and a rank with nothing to send at /home/learner/a_rather_long/"
        "path/to/some_file_name_that_goes_on_and_on_and_on_and_on_and_on_and_on.py")


def test_printed_verdicts_wrap_within_100_without_splitting_numbers_or_words(capsys,
                                                                             monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "cpu")
    check.Verdict("the ring's route", False, LONG, LONG).show()
    check.in_band("a claim with a long name", 0.1, 0.3, cause=LONG)
    check.prediction("speedup", 4, 1.62, unit="x", why=LONG)
    out = capsys.readouterr().out
    lines = out.splitlines()
    words = set(LONG.split())
    long_word = max(words, key=len)
    assert all(len(line) <= 100 or line.strip() == long_word for line in lines), out
    got = set(out.split())
    assert words <= got, words - got  # every number and word whole: 1,234,567 and 308,642.5
    # the hint wraps under its own name, not under the verdict's first column
    hint = lines.index(next(line for line in lines if line.startswith("  hint: ")))
    assert lines[hint + 1].startswith(" " * len("  hint: ")) and lines[hint + 1][8] != " "
    assert "\n  likely cause: " in out and "\n  why: " in out


def test_progress_keeps_each_exercise_whole_within_100(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    check.progress()
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(len(line) <= 100 for line in lines[1:]), [
        line for line in lines if len(line) > 100]
    check.assert_passed([])


def test_out_of_reach_refuses_everywhere_the_learner_could_reach_and_puts_everything_back():
    import types

    from labkit.check import NotAllowedHere, out_of_reach

    owner = types.ModuleType("labkit.fake_answers")
    owner.answer = lambda: 42
    user = types.ModuleType("labkit.fake_user")
    user.same = owner.answer  # imported under another name
    learner_globals = {"mine": owner.answer}
    fn = eval("lambda: mine()", learner_globals)
    with pytest.raises(ZeroDivisionError), out_of_reach(fn, [owner, user], ["answer"], "by hand"):
        for call in (fn, owner.answer, user.same):
            with pytest.raises(NotAllowedHere,
                               match="fake_answers.answer is not allowed here: by hand"):
                call()
        raise ZeroDivisionError  # the block ends with an error: everything is still put back
    assert fn() == owner.answer() == user.same() == 42
