"""Notebook 04's graders: the reference solutions pass, known wrong answers get their hints."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import perf
from labkit.exercises import performance
from labkit.models import convnet

from .fakes import solution_namespace

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEM = "04_performance_tuning"


def _solved(name: str, ex_id: str):
    """The reference solution's function, from solutions/04_performance_tuning.py."""
    return solution_namespace(STEM, ex_id, nn=nn)[name]


def _ce(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


# ---- amp_grad_scaler_step ------------------------------------------------------------------------


def test_amp_grad_scaler_step_solution_passes():
    verdict = performance.amp_grad_scaler_step(_solved("amp_step", "amp_grad_scaler_step"))
    assert verdict, verdict
    assert "65536 -> 32768" in verdict.detail


def test_amp_grad_scaler_step_unscaled_first_passes():
    """Written another way: torch.amp.autocast, gradients unscaled explicitly before the step
    (where clipping would go), zero_grad after the update instead of before."""
    def step(model, opt, scaler, x, y):
        with torch.amp.autocast(device_type=x.device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return float(loss)

    verdict = performance.amp_grad_scaler_step(step)
    assert verdict, verdict


def test_amp_grad_scaler_step_wrong_no_autocast():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        scaler.scale(_ce(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "torch.autocast" in verdict.hint


def test_amp_grad_scaler_step_wrong_bf16():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _ce(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "dtype=torch.float16" in verdict.hint


def test_amp_grad_scaler_step_wrong_backward_outside_the_scaler():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        loss.backward()
        scaler.step(opt)
        scaler.update()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "never scaled a loss" in verdict.detail
    assert "backward outside the scaler" in verdict.hint

    def scaled_but_unused(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        scaler.scale(loss)
        loss.backward()
        scaler.step(opt)
        scaler.update()

    verdict = performance.amp_grad_scaler_step(scaled_but_unused)
    assert not verdict and "unscaled loss" in verdict.detail
    assert "backward outside the scaler" in verdict.hint


def test_amp_grad_scaler_step_wrong_optimizer_step_on_scaled_gradients():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        scaler.scale(loss).backward()
        opt.step()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "65536 times too large" in verdict.detail
    assert "optimizer.step() instead of scaler.step(opt)" in verdict.hint

    def then_update(model, opt, scaler, x, y):
        step(model, opt, scaler, x, y)
        scaler.update()

    verdict = performance.amp_grad_scaler_step(then_update)
    assert not verdict and "scaler.step(opt) never did" in verdict.detail
    assert "optimizer.step() instead of scaler.step(opt)" in verdict.hint


def test_amp_grad_scaler_step_wrong_optimizer_step_takes_an_inf_step():
    def step(model, opt, scaler, x, y):  # unscaled by hand, so the size is right: inf slips by
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        opt.step()
        scaler.update()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "a step with inf gradients was taken" in verdict.hint


def test_amp_grad_scaler_step_wrong_no_update():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "call scaler.update()" in verdict.hint

    def update_only_without_overflow(model, opt, scaler, x, y):  # a one-step run looks fine
        step(model, opt, scaler, x, y)
        if torch.isfinite(x).all():
            scaler.update()

    verdict = performance.amp_grad_scaler_step(update_only_without_overflow)
    assert not verdict and "the scale is still 65536" in verdict.detail


def test_amp_grad_scaler_step_wrong_no_step():
    def step(model, opt, scaler, x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _ce(model, x, y)
        scaler.scale(loss).backward()

    verdict = performance.amp_grad_scaler_step(step)
    assert not verdict and "scaler.step(opt)" in verdict.hint


def test_the_grader_leaves_the_kernels_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    performance.amp_grad_scaler_step(_solved("amp_step", "amp_grad_scaler_step"))
    assert torch.equal(torch.rand(3), expected)


# ---- fp16_compress_hook (two gloo ranks, warm) ---------------------------------------------------


def test_fp16_compress_hook_solution_passes():
    verdict = performance.fp16_compress_hook(_solved("compress_hook", "fp16_compress_hook"))
    assert verdict, verdict
    assert "bytes sent" in verdict.detail


def test_fp16_compress_hook_torchs_own_hook_passes():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert performance.fp16_compress_hook(default_hooks.fp16_compress_hook)


def test_fp16_compress_hook_wrong_sum_not_average():
    def hook(state, bucket):
        buffer = bucket.buffer()
        fut = dist.all_reduce(buffer.to(torch.float16), async_op=True).get_future()
        return fut.then(lambda f: buffer.copy_(f.value()[0]))

    verdict = performance.fp16_compress_hook(hook)
    assert not verdict and "un-averaged sum: divide by world size" in verdict.hint


def test_fp16_compress_hook_wrong_float32_sent():
    def hook(state, bucket):
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    verdict = performance.fp16_compress_hook(hook)
    assert not verdict and "uncompressed" in verdict.detail and "float16" in verdict.hint


def test_fp16_compress_hook_wrong_no_all_reduce():
    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    verdict = performance.fp16_compress_hook(hook)
    assert not verdict and "never communicated" in verdict.detail


def test_fp16_compress_hook_wrong_local_bucket_returned():
    def hook(state, bucket):
        buffer = bucket.buffer()
        dist.all_reduce(buffer.to(torch.float16).div_(dist.get_world_size()))  # result dropped
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    verdict = performance.fp16_compress_hook(hook)
    assert not verdict and "different gradients" in verdict.detail


def test_fp16_compress_hook_wrong_divided_by_two_shows_on_4_ranks():
    def hook(state, bucket):
        t = bucket.buffer().to(torch.float16).div_(2)  # the world size of the first try
        fut = dist.all_reduce(t, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].to(torch.float32))

    verdict = performance.fp16_compress_hook(hook)
    assert not verdict and "on 4 ranks the gradients are 2 times the average" in verdict.detail
    assert "not by 2" in verdict.hint


def test_fp16_compress_hook_wrong_placeholder_is_not_run():
    def hook(state, bucket):
        raise NotImplementedError("your code here")

    assert "not written yet" in performance.fp16_compress_hook(hook).detail


# ---- no_sync_accumulation (two gloo ranks, warm) ------------------------------------------------


def test_no_sync_accumulation_solution_passes():
    verdict = performance.no_sync_accumulation(_solved("accumulation_step",
                                                       "no_sync_accumulation"))
    assert verdict, verdict
    assert "1 all-reduce for 4 micro-batches" in verdict.detail


def test_no_sync_accumulation_with_a_context_per_micro_batch_passes():
    """Written another way: one loop, no_sync for all but the last, a null context for it, and
    the loss averaged by scaling the gradients once at the end."""
    def step(model, opt, micro_batches):
        import contextlib

        opt.zero_grad()
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < last else contextlib.nullcontext():
                nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad /= len(micro_batches)
        opt.step()

    verdict = performance.no_sync_accumulation(step)
    assert verdict, verdict


def test_no_sync_accumulation_wrong_all_reduce_per_micro_batch():
    def step(model, opt, micro_batches):
        opt.zero_grad()
        for x, y in micro_batches:
            (_ce(model, x, y) / len(micro_batches)).backward()
        opt.step()

    verdict = performance.no_sync_accumulation(step)
    assert not verdict and "wrap all but the last in model.no_sync()" in verdict.hint


def test_no_sync_accumulation_wrong_loss_not_divided():
    def step(model, opt, micro_batches):
        opt.zero_grad()
        for x, y in micro_batches[:-1]:
            with model.no_sync():
                _ce(model, x, y).backward()
        _ce(model, *micro_batches[-1]).backward()
        opt.step()

    verdict = performance.no_sync_accumulation(step)
    assert not verdict and "loss not divided by accumulation steps" in verdict.hint


def test_no_sync_accumulation_wrong_everything_under_no_sync():
    def step(model, opt, micro_batches):
        opt.zero_grad()
        with model.no_sync():
            for x, y in micro_batches:
                (_ce(model, x, y) / len(micro_batches)).backward()
        opt.step()

    verdict = performance.no_sync_accumulation(step)
    assert not verdict and "outside model.no_sync()" in verdict.hint


def test_no_sync_accumulation_wrong_zero_grad_per_micro_batch():
    def step(model, opt, micro_batches):
        for i, (x, y) in enumerate(micro_batches):
            opt.zero_grad()
            if i < len(micro_batches) - 1:
                with model.no_sync():
                    (_ce(model, x, y) / len(micro_batches)).backward()
            else:
                (_ce(model, x, y) / len(micro_batches)).backward()
        opt.step()

    verdict = performance.no_sync_accumulation(step)
    assert not verdict and "zero_grad() once before the loop" in verdict.hint


def test_no_sync_accumulation_wrong_no_optimizer_step():
    def step(model, opt, micro_batches):
        for x, y in micro_batches[:-1]:
            with model.no_sync():
                (_ce(model, x, y) / len(micro_batches)).backward()
        (_ce(model, *micro_batches[-1]) / len(micro_batches)).backward()

    verdict = performance.no_sync_accumulation(step)
    assert not verdict and "opt.step()" in verdict.hint


# ---- the notebook's bad-input refusals (moved here from the notebook) ---------------------------


def _batch(n=8):
    return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))


@pytest.mark.parametrize("refuse, match", [
    (lambda: perf.compare_steps(convnet(4), _batch(), {"fp8": {"amp": "fp8"}}),
     "amp must be None, 'bf16' or 'fp16'"),
    (lambda: perf.accumulation_check(convnet(4), _batch(8), 3), "does not split into 3"),
    (lambda: perf.comm_hook_sweep(steps=5, powersgd_start=10), "use steps > 10"),
    (lambda: perf.result_row("torch.compile", 0.01, 0.0, "s/step"),
     "after must be a positive number"),
])
def test_the_notebooks_techniques_refuse_bad_input_with_what_to_do(refuse, match):
    with pytest.raises(ValueError, match=match):
        refuse()
