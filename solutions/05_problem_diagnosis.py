# Solutions to the exercises of notebooks/05_problem_diagnosis.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 05_problem_diagnosis_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% nonfinite_ranks
def my_nonfinite_ranks(value):
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world)                 # one slot per rank, in a tensor of our own
    flags[rank] = float(not torch.isfinite(value).all())   # isfinite: NaN and +-inf
    dist.all_reduce(flags)                     # on every rank, finite or not
    return [r for r in range(world) if flags[r] > 0]

# %% seed_everything
def my_seed_everything(seed, rank):
    random.seed(seed + rank)                   # each rank its own, repeatable stream
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    torch.use_deterministic_algorithms(True)   # no kernel that adds in a new order each run
    torch.backends.cudnn.benchmark = False     # no autotuner picking another kernel

# %% early_stop_together
def my_early_stopping(epochs=10, patience=1):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 4, generator=gen)
    y = x.sum(1, keepdim=True)
    val_x = torch.randn(32 + 16 * (rank % 2), 4, generator=gen)
    val_y = val_x.sum(1, keepdim=True) * (1 - 0.5 * rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    best, worse, history = float("inf"), 0, []
    for epoch in range(epochs):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= 0.1 * p.grad / dist.get_world_size()
            val = F.mse_loss(model(val_x), val_y)
        # The fix: the loss over every rank's shard (sum of squared errors / samples), the same
        # number on every rank, so every rank takes the same decision below.
        total = torch.stack([val * len(val_x), torch.tensor(float(len(val_x)))])
        dist.all_reduce(total)
        val = total[0] / total[1]
        history.append(round(val.item(), 5))
        worse = 0 if val.item() < best else worse + 1
        best = min(best, val.item())
        print(f"epoch {epoch + 1}: validation loss {val.item():.4f}", flush=True)
        if worse > patience:
            print(f"stopping early: no improvement for {worse} epochs", flush=True)
            break
    return {"epochs": len(history), "val": history}

# %% uneven_shards
def my_train_uneven(model, batches, lr):
    params = list(model.parameters())
    dtype, step = params[0].dtype, 0
    while True:
        mine = step < len(batches)
        active = torch.tensor([float(mine)], dtype=dtype)
        dist.all_reduce(active)  # how many ranks have a batch this step: the same on every rank
        if active.item() == 0:
            return  # every rank leaves here, at the same step
        if mine:
            x, y = batches[step]
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
        else:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype)  # adds nothing
        dist.all_reduce(flat)  # every rank takes part, with or without a batch
        flat /= active  # the mean over the ranks that had a batch
        with torch.no_grad():
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p -= lr * g.view_as(p)
        step += 1
