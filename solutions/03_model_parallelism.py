# Solutions to the exercises of notebooks/03_model_parallelism.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 03_model_parallelism_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% pipeline_1f1b_schedule
def my_1f1b(stages, m):
    """[[("F", 0), ...], ...]: one list of actions per stage, in the order that stage runs them."""
    schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, m)  # enough forwards in flight to keep later stages fed
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the next forward, then the oldest backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]  # cool-down: the backwards owed
        schedule.append(actions)
    return schedule

# %% tp_f_and_g
class MyCopyToTP(torch.autograd.Function):
    """f: x unchanged forward; the gradient summed over the ranks backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)  # every rank already holds all of x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # all_reduce works in place: on a copy
        dist.all_reduce(grad)  # dL/dx is the sum of every rank's share
        return grad


class MyReduceFromTP(torch.autograd.Function):
    """g: x summed over the ranks forward; the gradient unchanged backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)  # the partial outputs add up to the dense layer's output
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad  # y = sum of the partials: dL/dpartial = dL/dy, the same on every rank

# %% zero_bytes_per_rank
def my_zero_bytes(n_params, world_size, stage, param_bytes=2, grad_bytes=2, optimizer_bytes=12):
    """{"params", "grads", "optimizer"}: the bytes one of world_size data-parallel ranks holds."""
    def per_rank(nbytes, sharded_from):  # ZeRO-1 shards the optimizer, 2 the grads, 3 the params
        return n_params * nbytes / (world_size if stage >= sharded_from else 1)

    return {"params": per_rank(param_bytes, 3), "grads": per_rank(grad_bytes, 2),
            "optimizer": per_rank(optimizer_bytes, 1)}

# %% gpipe_runner
def my_gpipe_step(stage, x, y, rows, width, m, loss_fn):
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    dtype = next(stage.parameters()).dtype
    sizes = [len(part) for part in torch.arange(rows).tensor_split(m)]  # may differ by one
    inputs, outputs, sends = [], [], []
    for i, n in enumerate(sizes):  # every forward first
        if first:
            inp = x.tensor_split(m)[i]
        else:
            inp = torch.empty(n, width, dtype=dtype)
            dist.recv(inp, src=rank - 1)  # the n-th message is micro-batch n
            inp.requires_grad_()  # its gradient goes back to rank - 1
        out = stage(inp)
        if last:  # micro-batch i's share of the whole batch's mean loss
            out = loss_fn(out, y.tensor_split(m)[i]) * (n / rows)
        else:
            sends.append(dist.isend(out.detach(), dst=rank + 1))  # isend: no waiting on rank + 1
        inputs.append(inp)
        outputs.append(out)
    loss = 0.0
    for i in range(m):  # then every backward; the .grad of the m add up
        if last:
            outputs[i].backward()
            loss += outputs[i].item()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
            outputs[i].backward(grad)
        if not first:
            sends.append(dist.isend(inputs[i].grad, dst=rank - 1))
    for work in sends:
        work.wait()
    return loss if last else None
