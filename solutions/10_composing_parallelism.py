# Solutions to the exercises of notebooks/10_composing_parallelism.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 10_composing_parallelism_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% zero1_step
def my_zero1_step(flat_params, flat_grad, update_shard):
    """One ZeRO-1 step: reduce-scatter the gradient, update this rank's shard, all-gather."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = flat_params.numel() // world
    grad_shard = torch.empty(shard, dtype=flat_grad.dtype, device=flat_grad.device)
    dist.reduce_scatter_tensor(grad_shard, flat_grad)  # my slice of the SUM over the ranks
    grad_shard /= world  # the average, what data parallelism's all-reduce and divide give
    mine = flat_params[rank * shard:(rank + 1) * shard]  # the slice reduce-scatter gave me
    new_shard = update_shard(mine, grad_shard)
    dist.all_gather_into_tensor(flat_params, new_shard)  # every rank's new shard, in rank order

# %% interleaved_schedule
def my_interleaved(stages, chunks, m):
    p, v = stages, chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B needs m to be a multiple of p: m={m}, p={p}")

    def slot(k):  # the k-th forward of a rank: groups of p micro-batches, chunk after chunk
        group, within = divmod(k, p * v)
        return within // p, group * p + within % p

    schedule = []
    for r in range(p):
        total = m * v
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        forwards = [("F", *slot(k)) for k in range(total)]
        # The backwards: the same groups, the chunks last to first.
        backwards = [("B", v - 1 - slot(k)[0], slot(k)[1]) for k in range(total)]
        actions = forwards[:warmup]
        for k in range(total - warmup):  # steady state: one forward, one backward
            actions += [forwards[warmup + k], backwards[k]]
        actions += backwards[total - warmup:]  # cool-down
        schedule.append(actions)
    return schedule

# %% layout_memory
def my_memory(model, degrees):
    """Bytes one device of pipeline stage 0 holds, by part, for model laid out as degrees."""
    d = degrees
    n = d.dp * d.cp                                   # the ranks that hold the same weights
    local = model.params / (d.tp * d.pp)              # this device's share of the weights
    parts = {"params": model.param_bytes * local, "grads": model.grad_bytes * local,
             "optimizer": model.optimizer_bytes * local}
    for part, stage in (("optimizer", 1), ("grads", 2), ("params", 3)):
        if d.zero >= stage:                           # ZeRO shards from its stage on
            parts[part] /= n
    # One layer, one micro-batch, in units of s*b*h*act_bytes (flash attention, no dropout).
    tokens = model.seq_len / d.cp                     # context parallelism splits the sequence
    unit = tokens * model.micro_batch * model.hidden * model.act_bytes
    whole = 4                                         # norms' inputs, QKV's and fc1's inputs
    split = 2 + 2 * model.kv_heads / model.heads + 2 * model.ffn / model.hidden
    if d.tp > 1 and d.sp:
        per_layer = (whole + split) * unit / d.tp     # sequence parallelism splits it all
    else:
        per_layer = (whole + split / d.tp) * unit
    in_flight = min(d.pp, d.m) if d.pp > 1 else 1     # 1F1B's stage 0
    parts["activations"] = in_flight * (model.layers / d.pp) * per_layer
    return parts

# %% zero3_linear
def gather_layer(shard, in_features, out_features):
    """The layer's full weight and bias from every rank's shard: one all-gather."""
    full = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(full, shard.detach())
    n = in_features * out_features
    return full[:n].view(out_features, in_features), full[n:n + out_features]


class MyZero3Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, in_features, out_features):
        weight, bias = gather_layer(shard, in_features, out_features)
        ctx.save_for_backward(x, shard)  # not the full parameters: they are freed on return
        ctx.features = (in_features, out_features)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        world = dist.get_world_size()
        weight, _ = gather_layer(shard, *ctx.features)  # gathered again, freed again
        flat = torch.cat([(grad_out.T @ x).reshape(-1), grad_out.sum(0)])
        flat = torch.cat([flat, flat.new_zeros(shard.numel() * world - flat.numel())])  # padding
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter_tensor(grad_shard, flat)  # the sum over the ranks of my slice only
        return grad_out @ weight, grad_shard / world, None, None
