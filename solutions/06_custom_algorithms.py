# Solutions to the exercises of notebooks/06_custom_algorithms.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 06_custom_algorithms_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% ring_reduce_scatter
def my_reduce_scatter(chunks, rank, world):
    """Sum chunk (rank + 1) % world over all ranks, in place, in world - 1 ring steps."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send, into = chunks[(rank - s) % world], chunks[(rank - s - 1) % world]
        buf = torch.empty_like(into)  # its own size: chunks differ by one element at most
        # Start the send and the receive together: two blocking sends would wait for each other.
        pending = [dist.isend(send, right), dist.irecv(buf, left)]
        for work in pending:
            work.wait()
        into += buf  # in place: the chunk is a view into the tensor being all-reduced

# %% ring_all_gather
def my_all_gather(chunks, rank, world):
    """Pass the finished chunks around the ring until every rank holds all of them."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        send, into = chunks[(rank + 1 - s) % world], chunks[(rank - s) % world]
        # The arriving chunk is already the full sum: receive it straight into its place.
        pending = [dist.isend(send, right), dist.irecv(into, left)]
        for work in pending:
            work.wait()

# %% topk_error_feedback
def my_compress(grad, residual, k):
    """The k largest |grad + residual| entries (values, indices), and what is left to send later."""
    full = grad + residual
    indices = full.abs().topk(k).indices
    values = full[indices]
    new_residual = full.clone()
    new_residual[indices] = 0  # sent now: not again
    return values, indices, new_residual

# %% halving_doubling
def my_halving_doubling(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    segment, steps = x.view(-1), []  # the part this rank still reduces; (partner, kept, given)
    distance = world // 2
    while distance:  # recursive halving: a reduce-scatter in log2 n steps
        partner = rank ^ distance
        low, high = segment.tensor_split(2)  # both partners hold this same segment
        keep, give = (low, high) if rank < partner else (high, low)
        incoming = torch.empty_like(keep)
        for work in (dist.isend(give, partner), dist.irecv(incoming, partner)):
            work.wait()
        keep += incoming
        steps.append((partner, keep, give))
        segment, distance = keep, distance // 2
    for partner, keep, give in reversed(steps):  # recursive doubling: the finished parts back
        for work in (dist.isend(keep, partner), dist.irecv(give, partner)):
            work.wait()  # `give` is a view into x: the partner's finished half lands in place
    return x
