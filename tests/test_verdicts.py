"""Every verdict a notebook prints on a noisy figure can say no, and says it the lesson's way.

The calls are read from the notebooks' sources (``check.in_band``, ``perf.timing_verdict``,
``check.prediction``), so a new verdict is caught here until it has a row below. Each in-band
verdict's row names what the lesson claims and the outcome opposite to it; the test works out
the band the notebook passes (its constants taken from the notebook, ``knob`` at the profile
where the verdict is judged) and checks that the band rejects that outcome. Each prediction's
row says whether its figure is noisy (a time, an accuracy after a short run): those are not
judged in the smoke profile, the others are.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from pathlib import Path

import pytest

from labkit import check, profile

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
VERDICT_CALLS = ("in_band", "timing_verdict")


@functools.cache
def notebook_trees() -> dict[str, list[ast.Module]]:
    """Each notebook's code cells, parsed (IPython's % and ! lines left out)."""
    trees = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        trees[path.stem] = [
            ast.parse("\n".join(line for line in "".join(c["source"]).splitlines()
                                if not line.lstrip().startswith(("%", "!"))))
            for c in cells if c["cell_type"] == "code"]
    return trees


def calls(kinds) -> list[tuple[str, str, ast.Call]]:
    """``(notebook, claim as written, call)`` for every call of ``check.<kind>`` or
    ``perf.<kind>`` in the notebooks."""
    found = []
    for stem, trees in notebook_trees().items():
        for tree in trees:
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in kinds):
                    found.append((stem, ast.unparse(node.args[0]), node))
    return found


def assignments(stem: str) -> dict[str, ast.expr]:
    """The last top-level ``NAME = value`` of each name in a notebook."""
    found = {}
    for tree in notebook_trees()[stem]:
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                    and isinstance(stmt.targets[0], ast.Name):
                found[stmt.targets[0].id] = stmt.value
    return found


def evaluate(expr: ast.expr, stem: str, env: dict):
    """``expr`` of the notebook, its names resolved from the notebook's own assignments."""
    known = dict(env)
    values = assignments(stem)
    for _ in range(20):
        try:
            return eval(compile(ast.Expression(expr), stem, "eval"), {"math": math}, known)
        except NameError as missing:
            name = missing.name
            if name in known or name not in values:
                raise AssertionError(f"{stem}: the band uses {name!r}, which the test cannot "
                                     f"work out: give it in the row's env") from None
            known[name] = evaluate(values[name], stem, known)
    raise AssertionError(f"{stem}: the band's names do not resolve")


def band_of(stem: str, call: ast.Call, env: dict) -> tuple[float, float]:
    """The ``(low, high)`` a notebook's verdict call passes."""
    if call.func.attr == "timing_verdict":
        return tuple(evaluate(call.args[2], stem, env))
    low, high = -math.inf, math.inf
    if len(call.args) > 2:
        low = evaluate(call.args[2], stem, env)
    if len(call.args) > 3:
        high = evaluate(call.args[3], stem, env)
    for kw in call.keywords:
        if kw.arg == "low":
            low = evaluate(kw.value, stem, env)
        elif kw.arg == "high":
            high = evaluate(kw.value, stem, env)
        elif kw.arg is None:  # **band
            given = evaluate(kw.value, stem, env)
            low, high = given.get("low", low), given.get("high", high)
    return low, high


# (notebook, claim as written) -> [(what the lesson says, the opposite outcome, profile, env)]:
# the profile where the verdict is judged (the gpu-only ones at "gpu"), and names the band
# takes from the code around it (a loop's variable).
SPEEDS_UP = "it speeds up"
VERDICTS = {
    ("00_environment_check", "'measured time / ring model'"): [
        ("the ring model predicts the time", 3.0, "cpu", {})],
    ("01_vgg16_data_augmentation", "'pretrained base minus from scratch, validation accuracy'"): [
        ("the pretrained base ends ahead", -0.1, "cpu", {})],
    ("01_vgg16_data_augmentation_keras", "'gap without augmentation'"): [
        ("without augmentation the network memorises", 0.05, "cpu", {})],
    ("01_vgg16_data_augmentation_keras", "'gap with augmentation'"): [
        ("augmentation keeps the gap small", 0.4, "cpu", {})],
    ("01_vgg16_data_augmentation_keras", "'gap narrowed by augmentation'"): [
        ("augmentation narrows the gap", -0.05, "cpu", {})],
    ("01_vgg16_data_augmentation_keras", "'frozen base, validation accuracy'"): [
        ("a frozen pretrained base already classifies", 0.1, "cpu", {})],
    ("01_vgg16_data_augmentation_keras", "'after fine-tuning, validation accuracy'"): [
        ("fine-tuning reaches a high accuracy", 0.2, "cpu", {})],
    ("01_vgg16_data_augmentation_keras",
     "'pretrained base minus from scratch, validation accuracy'"): [
        ("an ImageNet base ends ahead", -0.1, "cpu", {"use_imagenet": True}),
        ("a base from a few shapes gives no lead", 0.2, "cpu", {"use_imagenet": False})],
    ("02_data_parallelism", "f'weak-scaling speedup on {measured} workers'"): [
        (SPEEDS_UP, 0.905, "cpu", {})],
    ("02_data_parallelism",
     "f'DDP throughput over no-communication throughput, {measured} workers'"): [
        ("communication costs a fraction of a step", 0.3, "cpu", {})],
    ("02_data_parallelism_keras",
     'f"speedup of {r[\'workers\']} workers, each on its own device, over one"'): [
        (SPEEDS_UP, 0.9, "cpu", {"r": {"workers": 2}}),
        (SPEEDS_UP, 0.95, "gpu", {"r": {"workers": 4}})],
    ("03_model_parallelism", "'naive: the idle fraction of each rank'"): [
        ("naive model parallelism leaves each rank idle half the time", 0.05, "cpu", {})],
    ("03_model_parallelism", "f'{name}, m = 2: measured bubble / formula'"): [
        ("at m = 2 the formula predicts the bubble", 1.5, "cpu", {})],
    ("03_model_parallelism", "f'{name}, m = 8: how much nearer the measured bubble is to "
                             "+messages than to the formula (below 0: nearer +messages)'"): [
        ("the hand-overs explain the excess over the formula", 0.05, "cpu", {})],
    ("03_model_parallelism", "f'{name}: bubble at m = 8 over bubble at m = 2 (below 1: more "
                             "micro-batches shrink it)'"): [
        ("more micro-batches shrink the bubble", 1.2, "cpu", {})],
    ("03_model_parallelism", "'checkpointed / plain forward + backward time'"): [
        ("recomputation costs time", 0.9, "cpu", {})],
    ("04_performance_tuning", "'bf16 step speed-up over fp32 on a GPU'"): [
        (SPEEDS_UP, 0.8, "gpu", {})],
    ("04_performance_tuning", "f'{what}: TF32 error / fp32 error'"): [
        ("TF32 rounds far more than fp32", 1.0, "gpu", {})],
    ("04_performance_tuning", "'first compiled step / a steady step'"): [
        ("the first compiled step pays for the compilation", 1.0, "cpu", {})],
    ("04_performance_tuning", "f'training-process CPU time, {LOADER_WORKERS} workers / none'"): [
        ("loader workers take the decoding off the training process", 0.9, "cpu", {})],
    ("04_performance_tuning", "f'DataLoader speed-up with {LOADER_WORKERS} workers'"): [
        (SPEEDS_UP, 0.9, "gpu", {})],  # judged with many cores only (WALL_GAIN 0 on cpu)
    ("06_custom_algorithms",
     'f"the ring\'s bandwidth as a fraction of the built-in\'s at {big >> 20} MiB"'): [
        ("for large messages the hand-written ring nears the built-in", 0.3, "cpu", {})],
    ("06_custom_algorithms",
     "f'ring time / recursive doubling time at {small} bytes (doubling wins)'"): [
        ("doubling wins at small sizes", 0.8, "cpu", {})],
    ("06_custom_algorithms", "'largest staleness of a gradient, asynchronous (updates)'"): [
        ("asynchronous updates apply stale gradients", 0, "cpu", {})],
    ("06_custom_algorithms", "'validation accuracy, asynchronous'"): [
        ("asynchronous training still learns", 0.3, "cpu", {})],
    ("07_resources_multinode", "'total throughput, fair budget / all cores each'"): [
        ("a fair thread budget does more in total", 0.8, "cpu", {})],
    ("07_resources_multinode", "'total throughput, own GPUs / shared GPUs'"): [
        ("a GPU each beats sharing", 1.0, "gpu", {})],
    ("09_sequence_context_expert", "'contiguous: compute time, busiest rank / idlest'"): [
        ("causal masking leaves contiguous chunks unbalanced", 1.0, "cpu", {})],
    ("09_sequence_context_expert", "'zigzag: compute time, busiest rank / idlest'"): [
        ("the zig-zag order balances the work", 3.0, "cpu", {})],
    ("09_sequence_context_expert", 'f"rank {v[\'rank\']}: dispatch bytes / uniform formula"'): [
        ("the uniform formula predicts the dispatch bytes", 2.0, "cpu", {})],
    ("09_sequence_context_expert", "'busiest expert / fair share, with the loss'"): [
        ("the balancing loss evens the load", 2.0, "cpu", {})],
    ("09_sequence_context_expert", "'busiest expert / fair share, without the loss'"): [
        ("without it the load is uneven", 1.0, "cpu", {})],
    ("10_composing_parallelism", '"zero bubble\'s measured bubble / 1F1B\'s"'): [
        ("zero bubble idles less than 1F1B", 1.2, "cpu", {})],
    ("10_composing_parallelism", 'f"{name}: measured bubble above the schedule\'s own"'): [
        ("the simulated schedule predicts the bubble, plus the hand-overs", 0.5, "cpu", {})],
    ("10_composing_parallelism",
     '"measured DDP step / the planner\'s step from this machine\'s card"'): [
        ("the planner fed with the card predicts the step within a small factor (every worker "
         "credited with the whole machine's rate is several times off)", 4.5, "cpu", {}),
        ("the planner leaves costs out: the real step is not much faster than it", 0.3, "cpu",
         {})],
    ("12_checkpoints_failures", '"async_save\'s stall / dcp.save\'s"'): [
        ("async_save takes the writing off the training's path", 1.2, "cpu", {})],
    ("12_checkpoints_failures", '"peer recovery\'s goodput / restart\'s"'): [
        ("healing in memory keeps more of the time than restarting everyone", 0.9, "cpu", {})],
    ("11_performance_principles", '"x + y: its bandwidth / the triad\'s"'): [
        ("an add runs at the memory's bandwidth", 0.05, "cpu", {})],
    ("11_performance_principles", 'f"matmul {big}: its FLOP/s / the card\'s peak"'): [
        ("a large matmul reaches the machine's matmul peak", 0.1, "cpu", {})],
    ("11_performance_principles", '"x + y\'s FLOP/s / the big matmul\'s"'): [
        ("a memory-bound add gets a sliver of a matmul's FLOP/s", 0.5, "cpu", {})],
    ("11_performance_principles", '"fused attention\'s speedup over unfused"'): [
        (SPEEDS_UP, 0.8, "cpu", {})],
    ("11_performance_principles", "'MFU of the small transformer'"): [
        ("a step uses a share of the peak, never more than all of it", 1.2, "cpu", {}),
        ("a step uses a share of the peak, never more than all of it", 0.01, "cpu", {})],
    ("11_performance_principles",
     '"rank 0\'s exposed communication / the last rank\'s stall"'): [
        ("a straggler's stall is waited for inside the others' all-reduce", 0.1, "cpu", {})],
    ("11_performance_principles", "'FP8 matmul speedup over bf16'"): [
        (SPEEDS_UP, 1.0, "gpu", {})],
}

# (notebook, claim as written) -> whether the figure is noisy (not judged in smoke)
PREDICTIONS = {
    ("00_environment_check", 'f"busbw of {rows[-1][\'bytes\']:,} bytes"'): True,
    ("00_environment_check", "f'all-reduce of {big:,} bytes'"): True,
    ("01_vgg16_data_augmentation", "'gap without augmentation minus gap with it'"): True,
    ("01_vgg16_data_augmentation", "'pretrained base minus from scratch, validation accuracy'"):
        True,
    ("01_vgg16_data_augmentation_keras", "'gap without augmentation'"): True,
    ("01_vgg16_data_augmentation_keras", "'trainable parameters with the base frozen'"): False,
    ("01_vgg16_data_augmentation_keras", "'from scratch, validation accuracy'"): True,
    ("02_data_parallelism", "'largest weight difference, plain network (power of ten)'"): False,
    ("02_data_parallelism", "f'weak-scaling speedup on {measured} workers'"): True,
    ("02_data_parallelism", "'MB all-reduced per step'"): False,
    ("02_data_parallelism_keras", "'time per step, MirroredStrategy ÷ one device'"): True,
    ("02_data_parallelism_keras", '"gradient with the replica\'s batch ÷ the right one"'): False,
    ("02_data_parallelism_keras", "'speedup of 2 workers over 1'"): True,
    ("03_model_parallelism", "'1F1B bubble, 2 stages, m = 8'"): True,
    ("03_model_parallelism", "f'bytes per rank, FSDP2 over {RANKS} ranks'"): False,
    ("03_model_parallelism", "'activation memory saved by checkpointing'"): False,
    ("04_performance_tuning", "'bf16 step speed-up over fp32'"): True,
    ("04_performance_tuning", "'memory for backward, whole batch / one micro-batch'"): False,
    ("04_performance_tuning", "'kB per step, fp16 hook'"): False,
    ("04_performance_tuning", '"PowerSGD\'s saving (x fewer bytes)"'): False,
    ("04_performance_tuning", 'f"buckets with a {tiny[\'bucket_cap_mb\']:g} MB cap"'): False,
    ("05_problem_diagnosis", "'ranks whose weights end NaN'"): False,
    ("05_problem_diagnosis", "'first mismatched collective'"): False,
    ("05_problem_diagnosis", "'ways that repeat'"): False,
    ("06_custom_algorithms",
     "f'bytes each rank sends, ring all-reduce of {S:,} bytes on {RING_RANKS} ranks'"): False,
    ("06_custom_algorithms", "f'ring time / built-in time at {big >> 20} MiB'"): True,
    ("06_custom_algorithms", '"top-1 % bytes as a fraction of dense\'s"'): False,
    ("07_resources_multinode", "'largest batch that fits, measured'"): False,
    ("07_resources_multinode", "'peak of one step at batch 64'"): False,
    ("07_resources_multinode", "'fair budget / all cores each, total throughput'"): True,
    ("07_resources_multinode", "'steps redone after the restart'"): False,
    ("09_sequence_context_expert", "f'TP / (TP + SP) activation bytes per rank, t = {RANKS}'"):
        False,
    ("09_sequence_context_expert", "'score blocks rank n-1 computes (contiguous, causal)'"): False,
    ("09_sequence_context_expert", "'bytes rank 0 sends in the forward dispatch'"): False,
    ("10_composing_parallelism", "f'bytes per rank under ZeRO-2 on {RANKS} ranks'"): False,
    ("10_composing_parallelism", "'parameter bytes on rank 0'"): False,
    ("10_composing_parallelism", "'interleaved 1F1B bubble, p=4, v=2, m=8'"): False,
    ("10_composing_parallelism", "'MB one FSDP2 rank sends per step'"): False,
    ("10_composing_parallelism", "\"measured step / planner's step\""): True,
    ("11_performance_principles", "'x + y, GFLOP/s'"): True,
    ("12_checkpoints_failures", "'steps redone after the restart'"): False,
    ("11_performance_principles", "'attention, unfused time / fused'"): True,
    ("11_performance_principles", "'MFU of the small transformer step'"): True,
    ("11_performance_principles", '"rank 0\'s exposed communication"'): True,
}


def test_every_verdict_in_the_notebooks_has_its_row_and_every_row_its_verdict():
    found = {(stem, claim) for stem, claim, _ in calls(VERDICT_CALLS)}
    assert found - set(VERDICTS) == set(), "verdicts without a row: add what the lesson says " \
                                           "and the opposite outcome to VERDICTS"
    assert set(VERDICTS) - found == set(), "rows of verdicts no notebook prints any more"


def verdict_cases():
    for stem, claim, call in calls(VERDICT_CALLS):
        for lesson, opposite, where, env in VERDICTS.get((stem, claim), []):
            yield pytest.param(stem, claim, call, lesson, opposite, where, env,
                               id=f"{stem[:2]}: {claim[:50]} ({where}, {opposite})")


@pytest.mark.parametrize("stem, claim, call, lesson, opposite, where, env", list(verdict_cases()))
def test_each_band_rejects_the_outcome_opposite_to_its_lesson(stem, claim, call, lesson,
                                                              opposite, where, env, monkeypatch,
                                                              capsys):
    monkeypatch.setenv("LABKIT_PROFILE", where)
    env = {"knob": functools.partial(profile.knob, profile=where), **env}
    low, high = band_of(stem, call, env)
    assert low <= high and not low <= opposite <= high, \
        f"{stem}: the band {low}..{high} of {claim} accepts {opposite}, the opposite of " \
        f"'{lesson}'"
    if call.func.attr == "timing_verdict":
        from labkit import perf

        said = perf.timing_verdict(claim, opposite, (low, high), below="b", above="a")
        assert not said["ok"] and said["verdict"] != "as expected"
    else:
        verdict = check.in_band(claim, opposite, low, high, cause="the cause")
        assert not verdict and verdict.judged
        assert "[not as expected]" in capsys.readouterr().out


def test_in_smoke_no_verdict_of_a_notebook_says_as_expected(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_PROFILE", "smoke")
    from labkit import perf

    for stem, claim, call in calls(VERDICT_CALLS):
        env = {"knob": functools.partial(profile.knob, profile="smoke"),
               **VERDICTS[stem, claim][0][3]}
        low, high = band_of(stem, call, env)
        inside = low if low > -math.inf else high  # an outcome the band would accept
        if call.func.attr == "timing_verdict":
            said = perf.timing_verdict(claim, inside, (low, high), below="b", above="a")
            assert said["verdict"] == "not judged at this size", claim
        else:
            verdict = check.in_band(claim, inside, low, high, cause="-")
            assert not verdict.judged and "as expected" not in capsys.readouterr().out


def test_every_prediction_says_whether_smoke_can_judge_it():
    found = {(stem, claim): call for stem, claim, call in calls(("prediction",))}
    assert set(found) - set(PREDICTIONS) == set(), "predictions without a row in PREDICTIONS"
    assert set(PREDICTIONS) - set(found) == set(), "rows of predictions no notebook makes"
    for key, call in found.items():
        noisy = any(kw.arg == "noisy" and ast.literal_eval(kw.value) for kw in call.keywords)
        assert noisy == PREDICTIONS[key], f"{key}: noisy={noisy}, the row says {PREDICTIONS[key]}"
