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
