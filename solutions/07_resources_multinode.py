# Solutions to the exercises of notebooks/07_resources_multinode.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 07_resources_multinode_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% memory_largest_batch
def my_largest_batch(n_params, fixed, per_sample, budget):
    states = 16 * n_params  # fp32 Adam: 4 weights + 4 gradients + 8 optimizer state
    room = budget - states - fixed  # what is left for the activations that grow with the batch
    return max(0, room // per_sample)

# %% thread_budget
def my_thread_envs(cores, jobs, ranks_per_job):
    threads = max(1, cores // (jobs * ranks_per_job))  # threads x ranks x jobs <= cores
    return [resources.thread_env(threads) for _ in range(jobs)]  # OMP, MKL and OpenBLAS alike

# %% slurm_rank_env
def my_rank_env(env):
    return {"MASTER_ADDR": slurm.first_node(env["SLURM_JOB_NODELIST"]),  # the job's first node
            "MASTER_PORT": str(20000 + int(env["SLURM_JOB_ID"]) % 20000),  # one per job
            "WORLD_SIZE": env["SLURM_NTASKS"],  # every task on every node
            "RANK": env["SLURM_PROCID"],  # the task's rank in the job
            "LOCAL_RANK": env["SLURM_LOCALID"]}  # its number on its node: its GPU

# %% checkpoint_resume
def my_resume(model, optimizer, folder):
    path = elastic.latest_checkpoint(folder)
    if path is None:
        return 0  # nothing saved yet: start at step 1
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # the momentum, too
    return state["step"]

# %% resharded_checkpoint
import re

import torch.distributed as dist


def slice_ranges(numel, world):
    """[start, stop) of each rank's slice under tensor_split(world)."""
    sizes = [len(part) for part in torch.arange(numel).tensor_split(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [(a, a + n) for a, n in zip(starts, sizes)]


def my_save(shard, step, folder):
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(folder, f"step-{step}-rank-{rank}-of-{world}.pt")
    torch.save(shard.clone(), path + ".tmp")  # a crash mid-write leaves no half file behind
    os.replace(path + ".tmp", path)


def my_load(numel, folder):
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {}  # step -> (ranks it was saved on, files present)
    for name in os.listdir(folder):
        if m := re.fullmatch(r"step-(\d+)-rank-(\d+)-of-(\d+)\.pt", name):
            saved.setdefault(int(m[1]), [int(m[3]), 0])[1] += 1
    step = max(s for s, (w, present) in saved.items() if present == w)  # complete, by number
    old_world = saved[step][0]
    lo, hi = slice_ranges(numel, world)[rank]
    pieces = []
    for r, (a, b) in enumerate(slice_ranges(numel, old_world)):
        if a < b and a < hi and lo < b:  # old slice r overlaps my new range: read it
            old = torch.load(os.path.join(folder, f"step-{step}-rank-{r}-of-{old_world}.pt"))
            pieces.append(old[max(lo, a) - a:min(hi, b) - a])
    if not pieces:  # an empty range: one file only to learn the dtype
        first = torch.load(os.path.join(folder, f"step-{step}-rank-0-of-{old_world}.pt"))
        pieces.append(first[:0])
    return torch.cat(pieces), step
