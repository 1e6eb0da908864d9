# Solutions to the exercises of notebooks/09_sequence_context_expert.ipynb.
# One block per exercise cell, each starting with `# %% <exercise id>`: labkit.check.solution(id)
# prints a block, and `python -m labkit.exercises` writes 09_sequence_context_expert_solution.ipynb,
# the notebook with these blocks in its exercise cells.

# %% sp_collectives
class MyGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())  # every rank's seq/t tokens
        return torch.cat(parts, dim=0)  # in rank order: the whole sequence

    @staticmethod
    def backward(ctx, grad):
        # Every rank used these tokens: their gradient is the sum over the ranks, of my rows.
        out = torch.empty_like(grad.chunk(dist.get_world_size())[0])
        dist.reduce_scatter(out, list(grad.contiguous().chunk(dist.get_world_size())))
        return out


class MyScatterSeq(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        # Partial sums of every token: keep my rows of their sum over the ranks.
        out = torch.empty_like(x.chunk(dist.get_world_size())[0])
        dist.reduce_scatter(out, list(x.contiguous().chunk(dist.get_world_size())))
        return out

    @staticmethod
    def backward(ctx, grad):
        # Each rank's partial sums fed every rank's rows: it needs every rank's gradient rows.
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, grad.contiguous())
        return torch.cat(parts, dim=0)

# %% online_softmax_merge
def my_merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) of the attention over both key sets, from each set's (out, lse)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: -inf - -inf is NaN
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # at most 1: exp cannot overflow
    total = w_a + w_b
    lse = m + torch.log(total)  # log(exp(lse_a) + exp(lse_b)); -inf where both sides are empty
    total = torch.where(total == 0, torch.ones_like(total), total)  # then out stays 0
    # lse is (batch, heads, seq), out (batch, heads, seq, head_dim): a trailing dim per weight
    out = (w_a / total).unsqueeze(-1) * out_a + (w_b / total).unsqueeze(-1) * out_b
    return out, lse

# %% expert_dispatch
def my_dispatch(expert_index, n_experts, world_size):
    """(order, send_counts): rows grouped by destination rank, by expert, in token order."""
    per_rank = n_experts // world_size  # rank r holds experts r*per_rank ... (r+1)*per_rank - 1
    # Ranks hold consecutive experts, so sorting by expert also sorts by rank; stable keeps
    # token order within an expert (the tokens kept under a capacity limit are the earliest).
    order = torch.argsort(expert_index, stable=True)
    send_counts = torch.bincount(expert_index // per_rank, minlength=world_size).tolist()
    return order, send_counts

# %% all_to_all_function
class MyAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts):
        world = dist.get_world_size()
        # Every rank must learn how many rows each other rank sends it: one small all-to-all.
        recv = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(recv, torch.tensor(send_counts, dtype=torch.int64))
        recv_counts = recv.tolist()
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=list(send_counts))
        ctx.send_counts, ctx.recv_counts = list(send_counts), recv_counts
        return out

    @staticmethod
    def backward(ctx, grad):
        # Rows only moved: each gradient row goes back to the rank its row came from.
        back = grad.new_empty((sum(ctx.send_counts), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send_counts,
                               input_split_sizes=ctx.recv_counts)
        return back, None
