# Solutions to the exercises of notebooks/02_data_parallelism.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 02_data_parallelism_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% ddp_training_loop
def my_ddp_training(dataset, make_model, epochs, batch_size, lr):
    model = DDP(make_model())  # rank 0's weights on every rank; gradients averaged in backward
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # this rank's shard
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new permutation every epoch, the same on every rank
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model

# %% ddp_global_accuracy
def my_global_accuracy(model, dataset):
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.zeros(2)  # correct, seen
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=256):
            counts += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)])
    dist.all_reduce(counts)  # SUM over the ranks: the counts of the whole dataset
    return (counts[0] / counts[1]).item()

# %% average_gradients
def my_average_gradients(model):
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # SUM over the ranks, in place
        p.grad /= world          # ... and the sum becomes the mean

# %% scaled_lr_warmup
def my_lr(step, global_batch, *, base_lr, base_batch, warmup_steps):
    target = base_lr * global_batch / base_batch  # linear scaling: k times the batch, k times lr
    if warmup_steps == 0:
        return target
    return target * min(1.0, (step + 1) / warmup_steps)  # linear warm-up over warmup_steps

# %% bucketed_ddp
def my_bucketed_ddp(model, bucket_numel):
    world = dist.get_world_size()
    buckets = []  # parameters in the order backward produces their gradients, packed
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if buckets and sum(q.numel() for q in buckets[-1]) + p.numel() <= bucket_numel:
            buckets[-1].append(p)
        else:
            buckets.append([p])
    ready = [0] * len(buckets)
    pending = []  # (work, flat gradient, bucket) started during this backward

    def hook_for(b):
        def hook(p):  # runs once p.grad holds this backward's gradient
            ready[b] += 1
            if ready[b] == len(buckets[b]):  # the bucket's last gradient: send it now
                ready[b] = 0  # counted afresh in the next backward
                flat = torch.cat([q.grad.reshape(-1) for q in buckets[b]])
                pending.append((dist.all_reduce(flat, async_op=True), flat, buckets[b]))
        return hook

    for b, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook_for(b))

    def wait():
        for work, flat, bucket in pending:
            work.wait()
            flat /= world  # the sum over the ranks becomes the mean
            for q, part in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(part.view_as(q))
        pending.clear()

    return wait
