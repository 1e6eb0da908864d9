# Solutions to the exercises of notebooks/04_performance_tuning.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 04_performance_tuning_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% amp_grad_scaler_step
def amp_step(model, opt, scaler, x, y):
    """Forward and loss under fp16 autocast, backward through the scaler, step, update."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.float16):  # matmuls in fp16, the loss fp32
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()  # loss x scale: small gradients survive in fp16
    scaler.step(opt)               # unscales the gradients; skips the step if any is inf/NaN
    scaler.update()                # halves the scale after an overflow, grows it slowly
    return loss.item()

# %% fp16_compress_hook
def compress_hook(state, bucket):
    """Average the bucket's gradients over the ranks, sending them as float16; return a Future."""
    buffer = bucket.buffer()  # this bucket's float32 gradients, flattened into one tensor
    half = buffer.to(torch.float16).div_(dist.get_world_size())  # divide first: a mean, not a sum
    fut = dist.all_reduce(half, async_op=True).get_future()

    def back_to_fp32(fut):
        buffer.copy_(fut.value()[0])  # the all-reduced fp16 values, cast back into the bucket
        return buffer

    return fut.then(back_to_fp32)

# %% no_sync_accumulation
def accumulation_step(model, opt, micro_batches):
    """One optimizer step from k micro-batches: the big batch's gradient, one all-reduce."""
    k = len(micro_batches)
    opt.zero_grad(set_to_none=True)
    for x, y in micro_batches[:-1]:
        with model.no_sync():  # forward and backward here: .grad adds up, nothing is sent
            (nn.functional.cross_entropy(model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (nn.functional.cross_entropy(model(x), y) / k).backward()  # all-reduces the sum of all k
    opt.step()

# %% powersgd_step
def my_powersgd(grad, q, error):
    world = dist.get_world_size()
    m = grad + error  # error feedback: what the last step's approximation dropped
    p = m @ q  # n x r
    dist.all_reduce(p)
    p /= world
    p = torch.linalg.qr(p).Q  # orthonormal columns: P P^T projects onto their span
    new_q = m.T @ p  # m x r, the next step's q too
    dist.all_reduce(new_q)
    new_q /= world
    approx = p @ new_q.T  # = P P^T (mean of the M): the same on every rank
    return approx, new_q, m - approx
