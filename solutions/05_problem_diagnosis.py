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
    val_x = torch.randn(32, 4, generator=gen)
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
