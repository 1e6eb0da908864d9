"""Notebook 12's graders: the solutions pass, answers written differently pass, and the usual
wrong answers (wrong values, and right values by a wrong route) get the hint that names them."""

import math

import numpy as np
import pytest
import torch.distributed as dist

from labkit import exercises
from labkit.exercises import checkpoints_failures as ex


@pytest.fixture(autouse=True)
def _own_progress_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def solved():
    """The names that solutions/12_checkpoints_failures.py's blocks define."""
    names = {"dist": dist}
    for block in exercises.solution_blocks("12_checkpoints_failures").values():
        exec(block, names)
    return names


def not_yet(verdict, *words):
    assert not verdict, verdict
    text = f"{verdict.detail} {verdict.hint}"
    for word in words:
        assert word in text, text


def test_placeholders_are_not_written_yet():
    def my_reshard_reads(rows, old_world, new_world):
        raise NotImplementedError("your code here")

    def my_goodput(interval, save_s, mtbf_s, restart_s):
        raise NotImplementedError("your code here")

    not_yet(ex.reshard_reads(my_reshard_reads), "not written yet")
    not_yet(ex.checkpoint_interval(my_goodput, lambda d, m: 1.0), "not written yet")


# ---- reshard_reads ---------------------------------------------------------------------------


def _chunks(rows, world):
    each = -(-rows // world)
    return [(min(r * each, rows), min((r + 1) * each, rows)) for r in range(world)]


def _overlaps(saved, wanted):
    return [[(o, max(a, s), min(b, e)) for o, (s, e) in enumerate(saved) if max(a, s) < min(b, e)]
            for a, b in wanted]


def _recorded(rows_by_key, old, new, shift=0):
    """What RecordingReader logs when ``new`` ranks load tensors saved on ``old``."""
    reads = [[] for _ in range(new)]
    for key, rows in rows_by_key.items():
        saved = _chunks(rows, old)
        for rank, mine in enumerate(_overlaps(saved, _chunks(rows, new))):
            for o, a, b in mine:
                reads[rank].append({"key": key, "file": f"__{o}_0.distcp",
                                    "storage_offsets": (a - saved[o][0] + shift, 0),
                                    "lengths": (b - a, 4), "chunk_offsets": (saved[o][0], 0),
                                    "dest_offsets": (0, 0)})
        reads[0].append({"key": "optim.state.step", "file": "__0_0.distcp",
                         "storage_offsets": (), "lengths": (), "chunk_offsets": (),
                         "dest_offsets": ()})  # a scalar: not sharded, not planned
    return {"old_world": old, "reads": reads,
            "shapes": {key: (rows, 4) for key, rows in rows_by_key.items()}}


def test_reshard_reads_solution_passes_and_matches_what_dcp_read(solved):
    verdict = ex.reshard_reads(solved["my_reshard_reads"])
    assert verdict and "12 cases" in verdict.detail, verdict
    recorded = _recorded({"model.0.weight": 10, "model.4.weight": 3, "model.4.bias": 3}, 4, 2)
    verdict = ex.reshard_reads(solved["my_reshard_reads"], recorded=recorded)
    assert verdict and "the same pieces DCP read when 2 ranks loaded 3 tensors" in \
        verdict.detail, verdict


def test_reshard_reads_written_row_by_row_passes():
    def my_reshard_reads(rows, old_world, new_world):
        each_old, each_new = -(-rows // old_world), -(-rows // new_world)
        out = [[] for _ in range(new_world)]
        for row in range(rows):  # one row at a time, merged into runs
            rank, old = row // each_new, row // each_old
            if out[rank] and out[rank][-1][0] == old:
                out[rank][-1] = (old, out[rank][-1][1], row + 1)
            else:
                out[rank].append((old, row, row + 1))
        return out

    assert ex.reshard_reads(my_reshard_reads)


def _array_split(rows, world):
    parts = np.array_split(np.arange(rows), world)
    return [(int(p[0]), int(p[-1]) + 1) if len(p) else (rows, rows) for p in parts]


@pytest.mark.parametrize("answer, words", [
    (lambda rows, old, new: _overlaps(_array_split(rows, old), _array_split(rows, new)),
     ["numpy.array_split", "torch.chunk"]),
    (lambda rows, old, new: [[(o, s, e) for o, (s, e) in enumerate(_chunks(rows, old))
                              if max(a, s) < min(b, e)] for a, b in _chunks(rows, new)],
     ["whole saved shard is read"]),
    (lambda rows, old, new: [[(o, max(a, s), min(b, e)) for o, (s, e) in
                              enumerate(_chunks(rows, old)) if max(a, s) <= min(b, e)]
                             for a, b in _chunks(rows, new)],
     ["empty read", "a rank with no rows reads nothing"]),
    (lambda rows, old, new: [[(o, max(a, s) - s, min(b, e) - s) for o, (s, e) in
                              enumerate(_chunks(rows, old)) if max(a, s) < min(b, e)]
                             for a, b in _chunks(rows, new)],
     ["global row numbers"]),
    (lambda rows, old, new: [list(reversed(r)) for r in
                             _overlaps(_chunks(rows, old), _chunks(rows, new))],
     ["not in row order"]),
    (lambda rows, old, new: _overlaps(_chunks(rows, old), _chunks(rows, new))[:-1],
     ["one list per new rank"]),
])
def test_reshard_reads_wrong_answer_gets_its_hint(answer, words):
    not_yet(ex.reshard_reads(answer), *words)


def test_reshard_reads_wrong_against_dcp_only(solved):
    # Right on the twelve cases, but the reads DCP made differ (rows numbered from the file's
    # start, not the tensor's): the check names the tensor, the rank and the pieces.
    recorded = _recorded({"model.0.weight": 10}, 4, 2, shift=1)
    not_yet(ex.reshard_reads(solved["my_reshard_reads"], recorded=recorded),
            "model.0.weight (10, 4), new rank 0", "DCP read")


def test_reshard_reads_may_not_call_labkits_plan():
    from labkit import checkpoints

    def my_reshard_reads(rows, old_world, new_world):
        return [[(r["old_rank"], *r["rows"]) for r in p["reads"]]
                for p in checkpoints.reshard_plan((rows, 1), old_world, new_world)]

    not_yet(ex.reshard_reads(my_reshard_reads), "not allowed here")
    assert checkpoints.reshard_plan((4, 1), 2, 1)  # given back after the check


# ---- checkpoint_interval ----------------------------------------------------------------------


def _goodput(t, d, m, r):
    return 1 - d / t - (t / 2 + r) / m


def _young(d, m):
    return math.sqrt(2 * d * m)


def test_checkpoint_interval_solution_passes(solved):
    verdict = ex.checkpoint_interval(solved["my_goodput"], solved["my_best_interval"])
    assert verdict and "sqrt(2δM)" in verdict.detail, verdict


def test_checkpoint_interval_written_another_way_passes():
    def my_goodput(interval, save_s, mtbf_s, restart_s):  # clipped at 0, one fraction
        lost = save_s * mtbf_s + interval * interval / 2 + restart_s * interval
        return max(0.0, (interval * mtbf_s - lost) / (interval * mtbf_s))

    assert ex.checkpoint_interval(my_goodput, lambda d, m: (2 * d * m) ** 0.5)


@pytest.mark.parametrize("goodput, best, words", [
    (lambda t, d, m, r: 1 - d / t - (t + r) / m, _young, ["half an interval"]),
    (lambda t, d, m, r: 1 - d / t - t / (2 * m), _young, ["restart R"]),
    (lambda t, d, m, r: 1 - (t / 2 + r) / m, _young, ["δ to save"]),
    (_goodput, lambda d, m: math.sqrt(d * m), ["sqrt(δM) is the optimum", "2δM"]),
    (_goodput, lambda d, m: 2 * d * m, ["a square root"]),
    (_goodput, lambda d, m: math.sqrt(2 * d / m), ["multiply, do not divide"]),
    (_goodput, lambda d, m: _young(d, m) - d, ["Daly's higher-order"]),
    (_goodput, lambda d, m: math.sqrt(2 * (d + 300) * m), ["derivative", "does not move"]),
    (_goodput, lambda d, m: "soon", ["return a number"]),
])
def test_checkpoint_interval_wrong_answer_gets_its_hint(goodput, best, words):
    not_yet(ex.checkpoint_interval(goodput, best), *words)


def test_checkpoint_interval_wrong_route_an_interval_off_its_own_curve():
    # The textbook interval, beside a goodput that peaks elsewhere: the two must agree.
    def my_goodput(interval, save_s, mtbf_s, restart_s):  # a bump just past the optimum
        right = _goodput(interval, save_s, mtbf_s, restart_s)
        return right + (1e-3 if 0 < interval / _young(save_s, mtbf_s) - 1 < 0.01 else 0.0)

    not_yet(ex.checkpoint_interval(my_goodput, _young), "higher at", "peaks")


# ---- peer_heal (real gloo ranks) ----------------------------------------------------------------


def test_peer_heal_solution_passes(solved):
    verdict = ex.peer_heal(solved["my_heal"])
    assert verdict and "7 replicas healed" in verdict.detail, verdict


def _tensors_heal(model, optimizer, healthy, recovering, group):
    """Another valid route: every tensor sent on its own, the last healthy rank first."""
    import torch

    rank = dist.get_rank()
    for i, dst in enumerate(recovering):
        src = healthy[-1 - i % len(healthy)]
        if rank not in (src, dst):
            continue
        for p in model.parameters():
            buf = optimizer.state[p].get("momentum_buffer")
            if rank == dst and buf is None:
                buf = optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            for t in (p.data, buf):
                if rank == src:
                    dist.send(t, dst, group=group)
                else:
                    dist.recv(t, src, group=group)


def _broadcast_heal(model, optimizer, healthy, recovering, group):
    box = [{"model": model.state_dict(), "optim": optimizer.state_dict()}]
    dist.broadcast_object_list(box, src=healthy[0], group=group)
    model.load_state_dict(box[0]["model"])
    optimizer.load_state_dict(box[0]["optim"])


def _model_only_heal(model, optimizer, healthy, recovering, group):
    for i, dst in enumerate(recovering):
        src, box = healthy[i % len(healthy)], [model.state_dict()]
        if dist.get_rank() == src:
            dist.send_object_list(box, dst=dst, group=group)
        elif dist.get_rank() == dst:
            dist.recv_object_list(box, src=src, group=group)
            model.load_state_dict(box[0])


def _one_peer_heal(model, optimizer, healthy, recovering, group):
    for dst in recovering:  # right values, but the first healthy rank sends every copy
        box = [{"model": model.state_dict(), "optim": optimizer.state_dict()}]
        if dist.get_rank() == healthy[0]:
            dist.send_object_list(box, dst=dst, group=group)
        elif dist.get_rank() == dst:
            dist.recv_object_list(box, src=healthy[0], group=group)
            model.load_state_dict(box[0]["model"])
            optimizer.load_state_dict(box[0]["optim"])


def _every_peer_heal(model, optimizer, healthy, recovering, group):
    for dst in recovering:  # right values, but every healthy rank sends each copy
        for src in healthy:
            box = [{"model": model.state_dict(), "optim": optimizer.state_dict()}]
            if dist.get_rank() == src:
                dist.send_object_list(box, dst=dst, group=group)
            elif dist.get_rank() == dst:
                dist.recv_object_list(box, src=src, group=group)
                model.load_state_dict(box[0]["model"])
                optimizer.load_state_dict(box[0]["optim"])


def _nothing_heal(model, optimizer, healthy, recovering, group):
    return None


def test_peer_heal_written_tensor_by_tensor_passes():
    assert ex.peer_heal(_tensors_heal)


@pytest.mark.parametrize("answer, words", [
    (_broadcast_heal, ["called ['broadcast']", "point to point"]),
    (_model_only_heal, ["still differed", "optimizer's state"]),
    (_one_peer_heal, ["on 4 ranks, step 2: rank 0 sent to [1, 3]", "ceil(2 / 2) = 1"]),
    (_every_peer_heal, ["rank 1 received from [0, 2]"]),
    (_nothing_heal, ["rank 1 received from nobody"]),
])
def test_peer_heal_wrong_answer_gets_its_hint(answer, words):
    not_yet(ex.peer_heal(answer), *words)
