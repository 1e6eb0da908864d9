# Solutions to the exercises of notebooks/00_environment_check.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 00_environment_check_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% first_allreduce
def my_allreduce(x):
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # in place: x now holds the sum on every rank
    return x

# %% busbw_from_algbw
def my_busbw(algbw, n):
    # a ring sends 2(n-1) chunks of 1/n of the message over every link
    return algbw * 2 * (n - 1) / n

# %% ring_allreduce_seconds
def my_ring_seconds(nbytes, n, alpha_s, bandwidth_GBps):
    # 2(n-1) steps one after the other; each pays the latency once and moves S/n bytes
    steps = 2 * (n - 1)
    return steps * (alpha_s + nbytes / n / (bandwidth_GBps * 1e9))
