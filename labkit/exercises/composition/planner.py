"""Notebook 10's planner exercise: choose degrees that fit a model on a cluster.

The learner writes ``my_degrees(model, cluster)``, returning a :class:`labkit.planner.Degrees`
(or a dict with ``dp``, ``tp``, ``pp``, ``zero`` and, if wanted, ``cp``) for each case of
:func:`fit_cases`. The grader checks each layout with :func:`labkit.planner.plan`: it must place
every device, keep tensor parallelism inside a node, split the model evenly and fit the
devices' memory. No ranks are started: the planner is arithmetic.
"""

from __future__ import annotations

from ...check import NotYet, exercise

NOTEBOOK = "10"

__all__ = ["fit_cases", "fit_degrees"]


def fit_cases() -> list[tuple]:
    """The (what, Model, Cluster) cases the grader tries, in the order it tries them."""
    from ...planner import Cluster, Model

    return [
        ("a 7B model on 8 x 80 GiB",
         Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
               micro_batch=1, flash_attention=True),
         Cluster(devices=8, memory_gib=80)),
        ("a 70B model on 64 x 80 GiB",
         Model("70B", params=70e9, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
               seq_len=4096, micro_batch=1, flash_attention=True, dropout=False),
         Cluster(devices=64, memory_gib=80)),
        ("a 13B model on 16 x 40 GiB with 32k-token sequences",
         Model("13B", params=13e9, layers=40, hidden=5120, heads=40, seq_len=32768,
               micro_batch=1, flash_attention=True, dropout=False),
         Cluster(devices=16, memory_gib=40)),
    ]



def _layout(fn, what, model, cluster):
    """The learner's answer for one case as a Degrees, or NotYet saying what shape to return."""
    from ...planner import PlanError, as_degrees

    got = fn(model, cluster)
    try:
        return as_degrees(got)
    except PlanError as err:
        raise NotYet(f"{what}: my_degrees returned {str(got)[:120]} ({err})",
                     "return Degrees(dp=..., tp=..., pp=..., zero=...) or a dict with those "
                     "keys (cp, ep and microbatches are optional)") from None


def _no_fit_hint(model, cluster, d, p) -> str:
    """A named mistake where one applies, then the planner's own ``why``."""
    state = p.memory["params"] + p.memory["grads"] + p.memory["optimizer"]
    if d.zero == 0 and d.dp * d.cp > 1 and state > p.memory["activations"]:
        return (f"forgot ZeRO? Adam's optimizer state (12 bytes per parameter) is copied on "
                f"all dp*cp={d.dp * d.cp} data-parallel ranks: zero=1 shards it, zero=3 shards "
                f"everything. {p.why}")
    if p.memory["activations"] > state and d.cp == 1 and model.seq_len >= 16384:
        return (f"long sequences: the activations grow with seq_len; tensor parallelism (with "
                f"sequence parallelism) and context parallelism (cp) each divide them. "
                f"{p.why}")
    return p.why


@exercise("fit_degrees", notebook=NOTEBOOK, title="degrees that fit a model on a cluster")
def fit_degrees(fn) -> str:
    """Exercise: ``fn(model, cluster)`` returns a layout that fits, for every case of fit_cases().

    Checked with :func:`labkit.planner.plan` (arithmetic only, no ranks): the degrees'
    product must be the device count, tp at most a node, the layout must split the model
    evenly and ``plan(...).fits`` must hold.

    Example::

        >>> exercise.fit_degrees(my_degrees)
        [pass] degrees that fit a model on a cluster: all 3 cases fit: ...
    """
    from ...planner import PlanError, plan

    found = []
    for what, model, cluster in fit_cases():
        d = _layout(fn, what, model, cluster)
        where = f"{what}: {d}"
        if d.world != cluster.devices:
            raise NotYet(f"{where} places dp*tp*pp*cp = {d.world} devices, not "
                         f"{cluster.devices}",
                         f"the product of the degrees must be the device count: every device "
                         f"gets one place (dp takes what tp*pp*cp leave: dp = "
                         f"{cluster.devices} / (tp*pp*cp))")
        if d.tp > cluster.devices_per_node:
            raise NotYet(f"{where}: tp={d.tp} spans "
                         f"{d.tp // cluster.devices_per_node} nodes of "
                         f"{cluster.devices_per_node}",
                         f"tensor parallelism all-reduces activations in every layer: keep it "
                         f"inside a node (tp <= {cluster.devices_per_node}, on NVLink); use pp "
                         f"or dp across nodes")
        try:
            p = plan(model, cluster, d)
        except PlanError as err:
            hint = str(err)
            if model.layers % d.pp:
                hint = f"pp must divide the {model.layers} layers (equal stages): {err}"
            raise NotYet(f"{where} is refused by the planner", hint) from None
        if not p.fits:
            raise NotYet(f"{where} needs {p.memory['total'] / 2**30:.1f} GiB per device, "
                         f"{p.budget / 2**30:.1f} GiB usable",
                         _no_fit_hint(model, cluster, d, p))
        found.append(f"{what}: {d} ({p.memory['total'] / 2**30:.1f} of "
                     f"{p.budget / 2**30:.0f} GiB)")
    return f"all {len(found)} cases fit: " + "; ".join(found)
