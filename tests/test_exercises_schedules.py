"""Notebook 10's interleaved-schedule grader: the solution passes, known wrong answers get hints.

The passing run plays the schedule on 2 and 4 warm gloo ranks; the wrong answers are caught before.
"""

from __future__ import annotations

from labkit.exercises import composition
from labkit.exercises.composition import schedules as graders
from labkit.parallel import pipeline, schedules

from .fakes import solution_namespace

STEM = "10_composing_parallelism"


def _solution(name: str):
    """The object the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


def _interleaved(stages, chunks, m, *, warmup=None, forward=None, backward=None, check=True):
    """interleaved 1F1B with one part swapped for a mistake (the defaults are right)."""
    p, v = stages, chunks
    if check and m % p:
        raise ValueError("m must be a multiple of p")

    def right(k):
        group, within = divmod(k, p * v)
        return within // p, group * p + within % p

    forward = forward or right
    backward = backward or (lambda k: (v - 1 - right(k)[0], right(k)[1]))
    out = []
    for r in range(p):
        total = m * v
        w = min((warmup or (lambda r: (p - r - 1) * 2 + (v - 1) * p))(r), total)
        actions = [("F", *forward(k)) for k in range(w)]
        for k in range(total - w):
            actions += [("F", *forward(w + k)), ("B", *backward(k))]
        actions += [("B", *backward(k)) for k in range(total - w, total)]
        out.append(actions)
    return out


def test_grader_is_exported_for_the_notebook():
    assert composition.interleaved_schedule is graders.interleaved_schedule
    assert graders.__all__ == ["interleaved_schedule"] and graders.NOTEBOOK == "10"


def test_interleaved_schedule_solution_passes_and_runs_on_ranks():
    fn = _solution("interleaved_schedule")["my_interleaved"]
    for p, v, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6)]:
        assert fn(p, v, m) == schedules.interleaved_1f1b(p, v, m)
    verdict = graders.interleaved_schedule(fn)
    assert verdict, verdict
    assert "played on 2 and 4 gloo ranks" in verdict.detail
    # The pass line names no formula: the notebook asks the learner to predict the bubble next.
    assert "bubble exactly interleaved 1F1B's" in verdict.detail and "(p-1)" not in verdict.detail


def test_interleaved_schedule_reference_passes_too():
    assert graders.interleaved_schedule(schedules.interleaved_1f1b)


def test_interleaved_schedule_wrong_chunk_order_looped_bfs():
    def bfs(p, v, m):  # all micro-batches through chunk 0 first
        return _interleaved(p, v, m, forward=lambda k: divmod(k, m),
                            backward=lambda k: (v - 1 - k // m, k % m))

    verdict = graders.interleaved_schedule(bfs)
    assert not verdict and "chunks in the wrong order within a group" in verdict.hint
    assert "looped BFS" in verdict.hint


def test_interleaved_schedule_wrong_warmup_too_short():
    def one_f_one_b_warmup(p, v, m):  # 1F1B's p - r - 1
        return _interleaved(p, v, m, warmup=lambda r: p - r - 1)

    verdict = graders.interleaved_schedule(one_f_one_b_warmup)
    assert not verdict and "warm-up too short" in verdict.hint
    assert "(p-r-1)*2" not in verdict.hint  # the hint explains; it does not hand out the formula


def test_interleaved_schedule_wrong_warmup_too_long():
    def one_more(p, v, m):
        return _interleaved(p, v, m, warmup=lambda r: (p - r - 1) * 2 + (v - 1) * p + 1)

    verdict = graders.interleaved_schedule(one_more)
    assert not verdict and "warm-up too long" in verdict.hint


def test_interleaved_schedule_wrong_deadlocking_order():
    def last_rank_defers_its_first_backward(p, v, m):
        # each rank's own order is possible, but the last rank now waits for a chunk-0 gradient
        # that needs its own deferred chunk-1 backward first: every rank waits for another
        out = schedules.interleaved_1f1b(p, v, m)
        row = list(out[-1])
        first = row.pop(next(k for k, a in enumerate(row) if a[0] == "B"))
        at = next(k for k, a in enumerate(row) if a[0] == "B" and a[1] == 0)
        out[-1] = row[:at + 1] + [first] + row[at + 1:]
        return out

    verdict = graders.interleaved_schedule(last_rank_defers_its_first_backward)
    assert not verdict and "deadlocks" in verdict.detail


def test_interleaved_schedule_valid_order_other_than_megatrons_passes():
    def eager_first_rank(p, v, m):
        """Megatron's order, but rank 0 runs each steady-state backward before the chunk-0
        forward beside it (that forward's input is local data, so nothing waits): as fast,
        holding less. With 2 ranks there is no such pair and it is Megatron's order."""
        out = schedules.interleaved_1f1b(p, v, m)
        if p < 3:
            return out
        row, k = list(out[0]), 0
        while k < len(row) - 1:
            if row[k][0] == "F" and row[k][1] == 0 and row[k + 1][0] == "B":
                row[k], row[k + 1] = row[k + 1], row[k]
                k += 2
            else:
                k += 1
        out[0] = row
        return out

    assert eager_first_rank(4, 2, 8) != schedules.interleaved_1f1b(4, 2, 8)
    verdict = graders.interleaved_schedule(eager_first_rank)
    assert verdict, verdict
    assert "other than Megatron's" in verdict.detail


def test_interleaved_schedule_wrong_message_order_between_neighbours():
    def last_rank_backward_early(p, v, m):
        # fine for the simulator's free messages, but rank 1 now receives a gradient before
        # the activation rank 0 sent first: in-order point-to-point matching deadlocks
        out = schedules.interleaved_1f1b(p, v, m)
        row = list(out[-1])
        for k in range(len(row) - 1):
            if row[k][0] == "F" and row[k][1] == 0 and row[k + 1][0] == "B" and k > v * p:
                row[k], row[k + 1] = row[k + 1], row[k]
                break
        out[-1] = row
        return out

    verdict = graders.interleaved_schedule(last_rank_backward_early)
    assert not verdict and "matched in the order" in verdict.hint


def test_interleaved_schedule_wrong_bubble_of_a_valid_order():
    def gpipe_like(p, v, m):  # valid, but every forward before any backward: a big bubble
        out = []
        for row in schedules.interleaved_1f1b(p, v, m):
            out.append([a for a in row if a[0] == "F"] + [a for a in row if a[0] == "B"])
        return out

    verdict = graders.interleaved_schedule(gpipe_like)
    assert not verdict
    assert "it runs, but its simulated bubble" in verdict.detail or "holds" in verdict.detail


def test_interleaved_schedule_wrong_backward_chunks_not_reversed():
    def same_order(p, v, m):
        def forward(k):
            group, within = divmod(k, p * v)
            return within // p, group * p + within % p
        return _interleaved(p, v, m, backward=forward)

    verdict = graders.interleaved_schedule(same_order)
    assert not verdict and "backward of chunks not in reverse order" in verdict.hint


def test_interleaved_schedule_wrong_chunk_mapping():
    def contiguous(p, v, m):  # as if rank r held stages r*v .. r*v+v-1: chunks back to back
        out = []
        for actions in pipeline.one_f_one_b_schedule(p, m):
            row = []
            for kind, i in actions:
                chunks = range(v) if kind == "F" else range(v - 1, -1, -1)
                row += [(kind, c, i) for c in chunks]
            out.append(row)
        return out

    verdict = graders.interleaved_schedule(contiguous)
    assert not verdict and "chunk/virtual-stage mapping" in verdict.hint
    assert "r, r+p, r+2p" in verdict.hint


def test_interleaved_schedule_wrong_m_not_a_multiple_of_p():
    verdict = graders.interleaved_schedule(lambda p, v, m: _interleaved(p, v, m, check=False))
    assert not verdict and "m not a multiple of p" in verdict.hint
    assert "my_interleaved(2, 2, 3) returned" in verdict.detail


def test_interleaved_schedule_wrong_error_type():
    def asserts(p, v, m):
        assert m % p == 0
        return _interleaved(p, v, m)

    verdict = graders.interleaved_schedule(asserts)
    assert not verdict and "raised AssertionError" in verdict.detail and "ValueError" in \
        verdict.hint


def test_interleaved_schedule_wrong_shape():
    def two_tuples(p, v, m):
        return [[(k, i) for k, _, i in row] for row in schedules.interleaved_1f1b(p, v, m)]

    verdict = graders.interleaved_schedule(two_tuples)
    assert not verdict and "('F', chunk, i)" in verdict.hint
    verdict = graders.interleaved_schedule(lambda p, v, m: schedules.interleaved_1f1b(2, v, m))
    assert not verdict and "one per rank" in verdict.hint


def test_interleaved_schedule_placeholder_is_not_yet():
    def my_interleaved(stages, chunks, m):
        raise NotImplementedError("your code here")

    verdict = graders.interleaved_schedule(my_interleaved)
    assert not verdict and "not written yet" in verdict.detail
