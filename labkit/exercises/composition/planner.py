"""Notebook 10's planner exercise: the memory of one layout, by hand.

The learner writes ``my_memory(model, degrees)``: the bytes one device holds for ``params``,
``grads``, ``optimizer`` and ``activations`` (pipeline stage 0, the fullest under 1F1B) when
``model`` is trained laid out as ``degrees``. The grader compares each part with the planner's
own figures (:func:`labkit.planner.model_state_bytes`, :func:`labkit.planner.
stage_activation_bytes`) on the layouts of :func:`memory_cases`, and while the learner's
function runs the planner's answers are out of reach: ``plan``, ``suggest``, ``layouts``,
``model_state_bytes``, ``layer_activation_bytes`` and ``stage_activation_bytes`` raise "not
allowed here" wherever the learner could reach them (the ``labkit.planner`` package and its
modules, and the function's own globals). No ranks are started: the planner is arithmetic.
"""

from __future__ import annotations

import contextlib
import math

from ...check import NotAllowedHere, NotYet, exercise, out_of_reach

NOTEBOOK = "10"

__all__ = ["memory_cases", "layout_memory"]

PARTS = ("params", "grads", "optimizer", "activations")
_REL = 1e-6  # the planner's figures are exact arithmetic; this only absorbs float rounding
# What the learner must compute, not call.
_OUT_OF_REACH = ("plan", "suggest", "layouts", "model_state_bytes", "layer_activation_bytes",
                 "stage_activation_bytes")


def memory_cases() -> list[tuple]:
    """The (what, Model, Degrees) cases the grader tries, in the order it tries them."""
    from ...planner import Degrees, Model

    seven = Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
                  micro_batch=1, flash_attention=True, dropout=False)
    seventy = Model("70B", params=70e9, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                    seq_len=4096, micro_batch=1, flash_attention=True, dropout=False)
    long = Model("13B, 32k tokens", params=13e9, layers=40, hidden=5120, heads=40,
                 seq_len=32768, micro_batch=1, flash_attention=True, dropout=False)
    one = Model("1B", params=1e9, layers=8, hidden=2048, heads=16, seq_len=1024, micro_batch=2,
                flash_attention=True, dropout=False)
    return [
        ("7B, data parallelism over 8 with ZeRO-1", seven, Degrees(dp=8, zero=1)),
        ("1B, dp=2 x pp=2 with ZeRO-2, 4 micro-batches", one,
         Degrees(dp=2, pp=2, zero=2, microbatches=4)),
        ("70B, tp=8 x pp=4 x dp=2 with ZeRO-1, 8 micro-batches", seventy,
         Degrees(dp=2, tp=8, pp=4, zero=1, microbatches=8)),
        ("13B at 32k tokens, tp=8 x cp=2 with ZeRO-3", long, Degrees(tp=8, cp=2, zero=3)),
    ]


def _reference(model, d) -> dict:
    """The planner's four parts for one case (computed before the learner's code runs)."""
    from ...planner import model_state_bytes, stage_activation_bytes

    state = model_state_bytes(model, d)
    return {"params": state["params"], "grads": state["grads"],
            "optimizer": state["optimizer"], "activations": stage_activation_bytes(model, d)}


@contextlib.contextmanager
def _planner_out_of_reach(fn):
    """The planner's answers refused in its package, its modules and ``fn``'s globals."""
    import sys

    from ... import planner

    modules = [planner] + [m for k, m in sys.modules.items()
                           if k.startswith(planner.__name__ + ".") and m is not None]
    with out_of_reach(fn, modules, _OUT_OF_REACH, "my_memory computes the bytes by hand"):
        yield


def _close(got, want: float) -> bool:
    return isinstance(got, (int, float)) and not isinstance(got, bool) and \
        math.isclose(got, want, rel_tol=_REL, abs_tol=1.0)


def _hint(part: str, got, want: float, model, d) -> str:
    """A named mistake for one part, where one matches, else what the part is made of."""
    n, layers = d.dp * d.cp, model.layers / d.pp
    near = (lambda x: _close(got, x))  # noqa: E731
    if part in ("params", "grads", "optimizer"):
        per = {"params": model.param_bytes, "grads": model.grad_bytes,
               "optimizer": model.optimizer_bytes}[part]
        stage = {"params": 3, "grads": 2, "optimizer": 1}[part]
        local = model.params / (d.tp * d.pp)
        if d.zero >= stage and near(per * local):
            return (f"ZeRO-{d.zero} shards the {part} (from stage {stage}) over the dp*cp = {n} "
                    f"ranks that hold the same weights: divide by {n}")
        if d.zero < stage and near(per * local / n):
            return (f"ZeRO-{d.zero} does not shard the {part} (stage {stage} does): every "
                    f"data-parallel rank holds its whole share")
        if d.cp > 1 and d.zero >= stage and near(per * local / d.dp):
            return "context-parallel ranks hold the same weights too: ZeRO shards over dp*cp"
        if near(per * model.params / max(d.tp, d.pp)) and d.tp != d.pp:
            return ("tensor and pipeline parallelism both divide the weights: each device "
                    "holds params / (tp*pp) of them")
        return (f"{part}: {per:g} bytes per parameter, for the params / (tp*pp) parameters this "
                f"device holds, divided by dp*cp if ZeRO-{stage} or higher shards them")
    one = want / (min(d.pp, d.m) if d.pp > 1 else 1)
    if d.pp > 1 and near(one):
        return (f"stage 0 of a 1F1B pipeline holds min(pp, m) = {min(d.pp, d.m)} micro-batches "
                f"in flight (pp - 1 forwards before its first backward), each through "
                f"layers/pp = {layers:g} layers")
    if d.tp > 1 and d.sp and near(want * d.tp):
        return ("with sequence parallelism (Degrees(sp=True), the default) tensor parallelism "
                "divides every activation of the layer by tp, not only the split ones")
    if d.cp > 1 and near(want * d.cp):
        return "context parallelism gives each rank seq_len/cp of the tokens: divide by cp"
    return ("per layer and micro-batch, in units of s*b*h*act_bytes (s the tokens on this rank): "
            "4 for the inputs of the two norms and of the QKV and first MLP matmuls, 2 + 2*kv/"
            "heads for Q, K, V and the attention output, 2*ffn/hidden for the MLP's wide "
            "tensors (no dropout masks, no s x s scores with flash attention); then times the "
            "stage's layers and the micro-batches in flight")


@exercise("layout_memory", notebook=NOTEBOOK, title="the memory of a layout, by hand")
def layout_memory(fn) -> str:
    """Exercise: ``fn(model, degrees)`` gives the bytes one device holds, by part.

    ``{"params": ..., "grads": ..., "optimizer": ..., "activations": ...}`` for stage 0 under
    1F1B, checked against the planner's figures on every case of :func:`memory_cases` (within
    a millionth), with the planner's answers out of reach while ``fn`` runs.

    Example::

        >>> exercise.layout_memory(my_memory)
        [pass] the memory of a layout, by hand: 4 layouts, every part equal to the planner's ...
    """
    done = []
    for what, model, d in memory_cases():
        want = _reference(model, d)
        try:
            with _planner_out_of_reach(fn):
                got = fn(model, d)
        except NotAllowedHere as refused:
            raise NotYet(f"{what}: {refused}",
                         "plan, suggest and the planner's memory functions answer the question "
                         "for you, so they are switched off while your function is graded: "
                         "compute each part from the model's numbers and the degrees") from None
        if not isinstance(got, dict) or any(k not in got for k in PARTS):
            raise NotYet(f"{what}: my_memory returned {str(got)[:120]}",
                         f"return a dict with the bytes of {', '.join(PARTS)} (numbers)")
        for part in PARTS:
            if not _close(got[part], want[part]):
                raise NotYet(f"{what}: {part} {got[part]!r} bytes, the planner says "
                             f"{want[part]:,.0f}",
                             _hint(part, got[part], want[part], model, d))
        total = sum(want.values()) / 2**30
        done.append(f"{what}: {total:.1f} GiB")
    return (f"{len(done)} layouts, every part equal to the planner's, computed by hand: "
            + "; ".join(done))
