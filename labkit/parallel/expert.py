"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

A mixture-of-experts (MoE) layer replaces one MLP by ``E`` of them (the experts) and a small
linear router. The router scores every token against every expert; each token goes through
its ``top_k`` best experts only, and their outputs are summed with the router's weights.
Parameters grow with ``E``; the compute per token stays that of ``top_k`` MLPs.

Expert parallelism puts ``E / n`` experts on each of ``n`` ranks. It is combined with data
parallelism: every rank holds different tokens and a copy of the (small) router, routes its own
tokens, and sends each one to the rank that holds its expert:

1. route: router scores, softmax, top-k (:func:`route`);
2. sort the (token, expert) pairs by destination rank (:func:`dispatch_order`);
3. exchange how many rows each rank will send (one ``all_to_all_single`` of counts), then the
   rows themselves (a second one, with uneven split sizes);
4. the local experts run on what arrived (:func:`apply_experts`, with the capacity limit);
5. the results go back with the reverse exchange, are un-permuted and summed with the gates.

:class:`MoE` is the single-process reference, :class:`ExpertParallelMoE` the distributed layer
(:func:`expert_parallel` builds it from a reference), :func:`moe_check` compares the two and
counts the bytes, :func:`balance_sweep` shows what the load-balancing loss does.

``dist.all_to_all_single`` is not autograd-aware, so the exchange is a small autograd Function
(:func:`all_to_all_tokens`) whose backward is the reverse exchange. torch has one too,
``torch.distributed.nn.functional.all_to_all_single``, but torch 2.14 deprecates it (it warns,
pointing to the functional collectives); writing the two lines shows why the backward is what
it is.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from labkit._dist import collective_device
from labkit._sizes import divisors, multiples_near, whole

__all__ = ["MoE", "ExpertParallelMoE", "expert_parallel", "route", "expert_capacity",
           "apply_experts", "load_balancing_loss", "dispatch_order", "expert_owner",
           "AllToAllTokens", "all_to_all_tokens", "routing_bytes", "uniform_routing_bytes",
           "moe_check", "balance_sweep"]


# ---- the single-process layer ------------------------------------------------------------------


def _check_sizes(hidden, ffn, n_experts, top_k, capacity_factor):
    """The MoE's sizes, validated: clear messages for every impossible combination."""
    whole(hidden, "hidden")
    whole(ffn, "ffn")
    whole(n_experts, "n_experts")
    whole(top_k, "top_k")
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} but there are only {n_experts} experts: each token "
                         f"picks top_k different experts, so use top_k <= {n_experts}")
    if capacity_factor is not None and not (isinstance(capacity_factor, int | float)
                                            and not isinstance(capacity_factor, bool)
                                            and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a number > 0 (1.0 = exactly the fair share, "
                         f"1.25 is common) or None for no limit, got {capacity_factor!r}")


def route(router: nn.Linear, x, top_k: int):
    """``(probs, gate, expert_index)``: softmax router scores, the top-k weights and experts.

    ``probs`` is ``(tokens, E)``, ``gate`` and ``expert_index`` ``(tokens, top_k)``. With
    ``top_k > 1`` the gates are renormalised to sum to 1 over the chosen experts, as Mixtral
    does. With ``top_k == 1`` renormalising would make every gate exactly 1 and the router would
    get no gradient from the output, so the gate is the raw probability, as in the Switch
    Transformer.

    Example::

        >>> probs, gate, idx = route(nn.Linear(16, 4), torch.randn(8, 16), top_k=2)
        >>> gate.sum(-1)        # tensor([1., 1., ...]): renormalised
    """
    probs = torch.softmax(router(x).float(), dim=-1)
    gate, expert_index = probs.topk(top_k, dim=-1)
    if top_k > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    return probs, gate.to(x.dtype), expert_index


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor) -> int | None:
    """Rows one expert may take: ``ceil(capacity_factor * tokens * top_k / n_experts)``.

    ``None`` (no limit) without a capacity factor. 1.0 is exactly the fair share: with uneven
    routing, the busiest experts drop what is over it.

    Example::

        >>> expert_capacity(64, 2, 4, 1.25)
        40
    """
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def apply_experts(experts, rows, expert_of_row, capacity=None):
    """``(out, rows_per_expert, dropped)``: each row through its expert, in row order.

    Row ``i`` goes through ``experts[expert_of_row[i]]``; an expert keeps its first
    ``capacity`` rows (the earliest in ``rows``) and the rest get zeros, counted in
    ``dropped``. The reference and the expert-parallel layer both call this, with the rows of
    each expert in the same order, so both drop the same tokens.
    """
    # rows * 0, not zeros: the output keeps an autograd path to `rows` even when no row is kept,
    # so every rank runs the backward exchange (a rank that skipped it would hang the others).
    out = rows * 0
    where, results, counts, dropped = [], [], [], 0
    for e, expert in enumerate(experts):
        idx = (expert_of_row == e).nonzero().squeeze(1)  # ascending: the earliest rows first
        counts.append(len(idx))
        if capacity is not None and len(idx) > capacity:
            dropped += len(idx) - capacity
            idx = idx[:capacity]
        if len(idx):
            where.append(idx)
            results.append(expert(rows[idx]))
    if where:
        out = out.index_copy(0, torch.cat(where), torch.cat(results))
    return out, counts, dropped


def load_balancing_loss(router_probs, expert_index, n_experts: int):
    """The Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i``; 1 when perfectly even.

    ``f_i`` is the fraction of the (token, expert) assignments that went to expert ``i`` (it
    has no gradient: it comes from a top-k), ``P_i`` the mean router probability of expert
    ``i`` (it has one). The product is smallest when both are uniform, and its gradient pushes
    the router's probability away from the experts that got more than their share.

    Example::

        >>> probs = torch.full((8, 4), 0.25)
        >>> load_balancing_loss(probs, torch.arange(8) % 4, 4)
        tensor(1.)
    """
    counts = torch.bincount(expert_index.reshape(-1), minlength=n_experts)
    f = counts.to(router_probs.dtype) / max(expert_index.numel(), 1)
    p = router_probs.reshape(-1, n_experts).mean(dim=0)
    return n_experts * (f * p).sum()


def _flat_tokens(x, hidden):
    """``x`` as ``(tokens, hidden)``, or a ValueError naming the shape it should have."""
    if x.dim() < 2 or x.shape[-1] != hidden:
        raise ValueError(f"expected tokens of shape (tokens, {hidden}) or (batch, seq, {hidden}), "
                         f"got {tuple(x.shape)}: the last dimension must be the hidden size")
    return x.reshape(-1, hidden)


def _expert_mlp(hidden, ffn):
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


class MoE(nn.Module):
    """A mixture-of-experts layer on one device: the reference the expert-parallel layer equals.

    A linear router (``hidden -> n_experts``), softmax, top-k (:func:`route`), each expert an
    MLP ``hidden -> ffn -> hidden``. With ``capacity_factor``, an expert takes at most
    :func:`expert_capacity` rows (first come, first served, in token order); the rest of its
    tokens get a zero contribution: the residual connection around the layer carries them.
    The router has a bias (Mixtral's has none) so that a lesson can steer tokens with it.

    After each forward, ``stats`` holds ``tokens_per_expert`` (assignments before the capacity
    limit), ``dropped`` (assignments over it), ``capacity`` and ``aux_loss`` (a float), and
    ``aux_loss`` the load-balancing loss as a tensor to add to the training loss.

    Example::

        >>> moe = MoE(hidden=16, ffn=32, n_experts=4, top_k=2, capacity_factor=1.25)
        >>> y = moe(torch.randn(64, 16))
        >>> moe.stats["tokens_per_expert"], moe.stats["dropped"]
        ([30, 41, 27, 30], 1)
    """

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None):
        super().__init__()
        _check_sizes(hidden, ffn, n_experts, top_k, capacity_factor)
        self.hidden, self.ffn, self.n_experts = hidden, ffn, n_experts
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(hidden, n_experts)
        self.experts = nn.ModuleList(_expert_mlp(hidden, ffn) for _ in range(n_experts))
        self.stats: dict = {}
        self.aux_loss = None

    def forward(self, x):
        tokens = _flat_tokens(x, self.hidden)  # (T, hidden): every token of the batch, one row each
        # probs (T, E) for the auxiliary loss; gate and expert_index (T, top_k): each token's
        # chosen experts and the weights their outputs are mixed with.
        probs, gate, expert_index = route(self.router, tokens, self.top_k)
        flat = expert_index.reshape(-1)  # pair j is token j // top_k: token-major order
        capacity = expert_capacity(len(tokens), self.top_k, self.n_experts, self.capacity_factor)
        # One row per (token, expert) pair: a token routed to top_k experts is computed top_k
        # times, once by each.
        rows = tokens.repeat_interleave(self.top_k, dim=0)
        out, counts, dropped = apply_experts(self.experts, rows, flat, capacity)
        y = (out.view(-1, self.top_k, self.hidden) * gate.unsqueeze(-1)).sum(dim=1)
        self.aux_loss = load_balancing_loss(probs, expert_index, self.n_experts)
        self.stats = {"tokens_per_expert": counts, "dropped": dropped, "capacity": capacity,
                      "aux_loss": self.aux_loss.item()}
        return y.view(x.shape)

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn={self.ffn}, n_experts={self.n_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}")


# ---- the dispatch: who sends what where --------------------------------------------------------


def expert_owner(expert, n_experts: int, world: int):
    """The rank that holds ``expert``: ranks hold consecutive blocks of ``n_experts / world``."""
    return expert // (n_experts // world)


def _check_split(n_experts, world):
    if n_experts % world:
        ok = ", ".join(map(str, divisors(n_experts, 4)))
        raise ValueError(f"{n_experts} experts do not split over {world} ranks: use a multiple "
                         f"of {world} experts (e.g. {multiples_near(n_experts, world)}), or a "
                         f"number of ranks that divides {n_experts} (e.g. {ok})")
    return n_experts // world


def dispatch_order(expert_index, n_experts: int, world: int):
    """``(order, send_counts)``: the permutation that sends each token to its expert's rank.

    ``expert_index`` holds the expert of each (token, slot) pair, flattened token-major (pair
    ``j`` is token ``j // top_k``). ``rows[order]`` lists the pairs grouped by destination rank
    (rank ``r`` holds experts ``r * E/world ... (r+1) * E/world - 1``), in expert order within a
    rank and in token order within an expert (a stable sort: the receiver drops the same
    tokens over capacity as the single-process layer). ``send_counts[r]`` is how many rows go
    to rank ``r``: the input split sizes of ``all_to_all_single``.

    Example::

        >>> dispatch_order(torch.tensor([3, 0, 1, 3, 2, 0]), n_experts=4, world=2)
        (tensor([1, 5, 2, 4, 0, 3]), [3, 3])
    """
    _check_split(n_experts, world)
    flat = expert_index.reshape(-1)
    # Ranks hold consecutive experts, so sorting by expert also groups by rank.
    order = torch.argsort(flat, stable=True)
    send_counts = torch.bincount(expert_owner(flat, n_experts, world), minlength=world)
    return order, send_counts.tolist()


# ---- the exchange: all_to_all_single, made differentiable ----------------------------------------


def _exchange(x, send_counts, recv_counts, group):
    """One ``all_to_all_single`` of the rows of ``x``: ``send_counts[r]`` rows go to rank ``r``."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return out


class AllToAllTokens(torch.autograd.Function):
    """All-to-all of rows forward; the reverse all-to-all of their gradients backward.

    Example::

        >>> y = AllToAllTokens.apply(x, [3, 1], [3, 5], None)   # see all_to_all_tokens
    """

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        # x: (sum(send_counts), hidden), grouped by destination rank; the result is
        # (sum(recv_counts), hidden), grouped by source rank. Every rank must call it, even
        # with nothing to send: an all-to-all is collective.
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        return _exchange(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        # The exchange only moves rows: row i of my input became row j on rank r. So the
        # gradient of my row i is the gradient of row j on rank r: the same exchange with the
        # split sizes swapped sends every gradient row home.
        send_counts, recv_counts = ctx.counts
        return _exchange(grad, recv_counts, send_counts, ctx.group), None, None, None


def all_to_all_tokens(x, send_counts, recv_counts, group=None):
    """Rows of ``x`` exchanged: ``send_counts[r]`` to rank ``r``, ``recv_counts[r]`` from it.

    Differentiable (``dist.all_to_all_single`` is not): the backward is the reverse exchange.
    Split sizes may be uneven and may be zero.

    Example::

        >>> y = all_to_all_tokens(x, [3, 1], [3, 5])   # rank 0 of 2: keeps 3, sends 1, gets 5
    """
    return AllToAllTokens.apply(x, list(send_counts), list(recv_counts), group)


def _check_dispatch(order, send_counts, per_rank_counts, n_rows, world):
    """The dispatch's answer, or a ValueError: bad counts would hang the exchange, not fail it."""
    if not (torch.is_tensor(order) and order.dim() == 1 and len(order) == n_rows
            and not order.is_floating_point()):
        raise ValueError(f"dispatch must return an integer tensor of {n_rows} row indices as "
                         f"its order, got {order!r:.80}")
    counts = [int(c) for c in send_counts]
    if counts != per_rank_counts:
        raise ValueError(f"dispatch's send_counts {counts} are not the rows the routing sends "
                         f"to each of the {world} ranks ({per_rank_counts})")
    return order.to(torch.long), counts


# ---- the expert-parallel layer -----------------------------------------------------------------


def _world_and_rank(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ExpertParallelMoE(nn.Module):
    """An :class:`MoE` whose experts are spread over the ranks of ``group``; the router replicated.

    Rank ``r`` holds experts ``r * E/n ... (r+1) * E/n - 1``. Each rank routes its own tokens
    (expert parallelism goes with data parallelism), and two ``all_to_all_single`` calls move
    them, with a third, small one for the counts. ``dispatch(expert_index, n_experts, world)
    -> (order, send_counts)`` replaces :func:`dispatch_order` (a learner's, in the exercise).

    Gradients: the router's are this rank's tokens' share (sum them over the ranks, as data
    parallelism does); an expert's already hold every rank's tokens. With DDP's *mean* over
    ranks, divide the experts' gradients by ``n`` too, or the two disagree by that factor.
    Every rank must call forward and backward, with inputs that agree on ``requires_grad``.

    Example::

        >>> torch.manual_seed(0); moe = MoE(16, 32, n_experts=4)   # the same on every rank
        >>> ep = expert_parallel(moe)                             # inside a worker, 2 ranks
        >>> [type(e).__name__ for e in ep.experts], ep.first_expert
        (['Sequential', 'Sequential'], 2)                          # on rank 1
    """

    def __init__(self, moe: MoE, group=None, dispatch=None):
        super().__init__()
        if not isinstance(moe, MoE):
            raise ValueError(f"expert_parallel needs a labkit MoE (e.g. MoE(16, 32, 4)), got "
                             f"{type(moe).__name__}")
        self.world, self.rank = _world_and_rank(group)
        self.per_rank = _check_split(moe.n_experts, self.world)
        self.group, self.dispatch = group, dispatch or dispatch_order
        self.hidden, self.n_experts, self.top_k = moe.hidden, moe.n_experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.first_expert = self.rank * self.per_rank
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[self.first_expert + i])
                                     for i in range(self.per_rank))
        self.stats: dict = {}
        self.aux_loss = None

    def _exchange_counts(self, per_expert, n_tokens, device):
        """``(world, per_rank + 1)``: row s = the rows rank s sends to each of my experts, then
        how many tokens rank s routed (every rank needs the global batch for the capacity)."""
        send = torch.cat([per_expert.view(self.world, self.per_rank),
                          torch.full((self.world, 1), n_tokens, device=device)], dim=1)
        if self.world == 1:
            return send
        return _exchange(send.reshape(-1), [self.per_rank + 1] * self.world,
                         [self.per_rank + 1] * self.world, self.group).view(self.world, -1)

    def forward(self, x):
        # x: this rank's tokens only (its data-parallel batch); the router is replicated, the
        # experts are not: this rank holds experts first_expert .. first_expert + E/n - 1.
        tokens = _flat_tokens(x, self.hidden)
        probs, gate, expert_index = route(self.router, tokens, self.top_k)
        flat = expert_index.reshape(-1)
        per_expert = torch.bincount(flat, minlength=self.n_experts)
        # order: the (token, expert) rows sorted by the rank that owns their expert;
        # send_counts[r]: how many go to rank r (possibly 0).
        order, send_counts = _check_dispatch(
            *self.dispatch(flat, self.n_experts, self.world),
            per_expert.view(self.world, self.per_rank).sum(1).tolist(), len(flat), self.world)

        # A first, small exchange of counts: a receiver cannot size its buffer otherwise, and
        # the capacity is computed from every rank's tokens, as the single-process MoE does.
        incoming = self._exchange_counts(per_expert, len(tokens), tokens.device)
        from_rank = incoming[:, :self.per_rank]  # [s, i]: rows rank s sends to my expert i
        recv_counts = from_rank.sum(1).tolist()
        capacity = expert_capacity(int(incoming[:, -1].sum()), self.top_k, self.n_experts,
                                   self.capacity_factor)

        # Dispatch: every row travels to the rank of its expert (all-to-all, uneven splits).
        rows = tokens.repeat_interleave(self.top_k, dim=0)[order]
        received = self._all_to_all(rows, send_counts, recv_counts)
        # Arrivals are grouped by sender, then by expert: sender-major order is the order of
        # the concatenated batch, so an expert keeps the same first `capacity` rows as MoE.
        local = torch.arange(self.per_rank, device=tokens.device).repeat(self.world)
        expert_of_row = local.repeat_interleave(from_rank.reshape(-1))
        out, counts, dropped = apply_experts(self.experts, received, expert_of_row, capacity)
        if torch.is_grad_enabled() and not out.requires_grad and any(
                p.requires_grad for p in self.parameters()):
            out.requires_grad_()  # nothing arrived here: still take part in the backward
        # Combine: the reverse all-to-all (counts swapped) brings every result home, in the
        # order the rows left in.
        back = self._all_to_all(out, recv_counts, send_counts)

        # Undo the sort by owner: row j of `back` is row order[j] of the token-major rows.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        combined = back[inverse].view(-1, self.top_k, self.hidden)
        y = (combined * gate.unsqueeze(-1)).sum(dim=1)
        self.aux_loss = load_balancing_loss(probs, expert_index, self.n_experts)  # my tokens
        self.stats = {"tokens_per_expert": counts, "dropped": dropped, "capacity": capacity,
                      "send_counts": send_counts, "recv_counts": recv_counts,
                      "aux_loss": self.aux_loss.item()}
        return y.view(x.shape)

    def _all_to_all(self, rows, send_counts, recv_counts):
        if self.world == 1:
            return rows
        return all_to_all_tokens(rows, send_counts, recv_counts, self.group)

    def extra_repr(self):
        last = self.first_expert + self.per_rank - 1
        return (f"hidden={self.hidden}, n_experts={self.n_experts} (experts {self.first_expert}"
                f"..{last} on rank {self.rank} of {self.world}), top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}")


def expert_parallel(moe: MoE, group=None, *, dispatch=None) -> ExpertParallelMoE:
    """This rank's part of ``moe``: the router (copied) and its ``E / n`` experts (copied).

    Example::

        >>> ep = expert_parallel(MoE(16, 32, n_experts=4))   # inside a worker with 2 ranks
        >>> ep(torch.randn(32, 16)).shape                    # this rank's 32 tokens
        torch.Size([32, 16])
    """
    return ExpertParallelMoE(moe, group, dispatch)


# ---- bytes ---------------------------------------------------------------------------------------


def routing_bytes(send_counts, recv_counts, rank: int, hidden: int, element_bytes: int,
                  per_rank: int, count_bytes: int = 8) -> dict:
    """Bytes this rank sends, from its routing: rows for other ranks times the bytes of a row.

    Forward: the dispatch (my rows to other ranks) and the return (the results of rows other
    ranks sent me), plus the counts exchange (``per_rank + 1`` integers to each other rank).
    Backward: the same two exchanges reversed, so the same bytes, and no counts.
    """
    world = len(send_counts)
    row = hidden * element_bytes
    dispatch = (sum(send_counts) - send_counts[rank]) * row
    ret = (sum(recv_counts) - recv_counts[rank]) * row
    counts = (world - 1) * (per_rank + 1) * count_bytes if world > 1 else 0
    return {"dispatch": dispatch, "return": ret, "counts": counts,
            "forward": dispatch + ret + counts, "backward": dispatch + ret}


def uniform_routing_bytes(tokens: int, top_k: int, hidden: int, element_bytes: int,
                          world: int) -> float:
    """Expected bytes one rank sends in one exchange with uniform routing.

    ``tokens * top_k`` rows of ``hidden * element_bytes`` bytes, of which ``(n-1)/n`` go to
    other ranks: ``tokens * top_k * hidden * element_bytes * (n-1) / n``.

    Example::

        >>> uniform_routing_bytes(1024, 2, 512, 2, world=8)   # bf16, per direction
        1835008.0
    """
    return tokens * top_k * hidden * element_bytes * (world - 1) / world


# ---- checks --------------------------------------------------------------------------------------


def _grads(module) -> dict:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
            for n, p in module.named_parameters()}


def _worst(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _worst_relative(grad, ref) -> float:
    """The largest difference over the largest reference entry (at least 1): gradients sum over
    every token, so their size (and float32's rounding) grows with the batch."""
    return _worst(grad, ref) / max(ref.abs().max().item() if ref.numel() else 0.0, 1.0)


def moe_check(tokens_per_rank: int, hidden: int, ffn: int, n_experts: int, top_k: int = 2,
              capacity_factor: float | None = None, seed: int = 0, *, router_bias=None,
              dispatch=None) -> dict:
    """Worker function: the expert-parallel layer against the reference on all ranks' tokens.

    Every rank builds the same :class:`MoE` and the same batch of ``world * tokens_per_rank``
    tokens (one seed); the reference runs on all of it in this process, the expert-parallel
    layer on this rank's slice (rank order). Both take the same upstream gradient. Returns:

    - ``output``: the largest difference of this rank's outputs;
    - ``grads``: the same for every gradient (the input's; the router's, summed over ranks; the
      experts', on the rank that holds them), each divided by the largest entry of the
      reference gradient (at least 1): gradients sum over tokens, so they grow with the batch;
    - ``tokens_per_expert``, ``dropped``, ``capacity``: for this rank's experts (``reference``:
      the single-process layer's ``stats``, every expert);
    - ``send_counts`` / ``recv_counts``: the rows this rank sends to / receives from each rank;
    - ``bytes``: what it sent, counted by ``labkit.parallel.traffic`` (``measured``), from the
      routing (``from_routing``, :func:`routing_bytes`) and by the uniform formula.

    ``router_bias`` (``n_experts`` numbers) is added to the router's bias, e.g. ``-1e4`` keeps
    every token away from an expert. ``dispatch`` replaces :func:`dispatch_order`.

    Example::

        >>> r = labkit.launch(moe_check, 32, 16, 32, 4, nproc=2).values[0]
        >>> r["output"] < 1e-5, r["bytes"]["measured"] == r["bytes"]["from_routing"]
        (True, True)
    """
    from labkit.parallel import traffic

    device = collective_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens_per_rank = whole(tokens_per_rank, "tokens_per_rank", low=0)
    torch.manual_seed(seed)
    moe = MoE(hidden, ffn, n_experts, top_k, capacity_factor).to(device)
    if router_bias is not None:
        with torch.no_grad():
            moe.router.bias += torch.as_tensor(router_bias, dtype=torch.float32, device=device)
    x = torch.randn(world * tokens_per_rank, hidden, device=device)
    upstream = torch.randn(world * tokens_per_rank, hidden, device=device)
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)

    ep = expert_parallel(moe, dispatch=dispatch)  # copies, before the reference's backward
    # The layer sits inside a model: its input has a gradient, so both exchanges run backward.
    x_ref = x.clone().requires_grad_()
    y_ref = moe(x_ref)
    (y_ref * upstream).sum().backward()
    ref = _grads(moe)

    x_mine = x[mine].clone().requires_grad_()
    with traffic.count_traffic() as fwd:
        y = ep(x_mine)
    with traffic.count_traffic() as bwd:
        (y * upstream[mine]).sum().backward()
    got = _grads(ep)
    router = {n: g.clone() for n, g in got.items() if n.startswith("router.")}
    for g in router.values():  # data parallelism's all-reduce (a sum: the loss is a sum)
        dist.all_reduce(g)
    grads = {"input": _worst_relative(x_mine.grad, x_ref.grad[mine])}
    grads.update({n: _worst_relative(g, ref[n]) for n, g in router.items()})
    for i in range(ep.per_rank):
        for n in ep.experts[i].state_dict():
            grads[f"experts.{ep.first_expert + i}.{n}"] = _worst_relative(
                got[f"experts.{i}.{n}"], ref[f"experts.{ep.first_expert + i}.{n}"])

    s = ep.stats
    computed = routing_bytes(s["send_counts"], s["recv_counts"], rank, hidden,
                             x.element_size(), ep.per_rank)
    return {"rank": rank, "world": world, "output": _worst(y.detach(), y_ref[mine].detach()),
            "grads": grads, "reference": dict(moe.stats),
            "experts": list(range(ep.first_expert, ep.first_expert + ep.per_rank)),
            "tokens_per_expert": s["tokens_per_expert"], "dropped": s["dropped"],
            "capacity": s["capacity"], "send_counts": s["send_counts"],
            "recv_counts": s["recv_counts"],
            "bytes": {"measured": {"forward": fwd.sent_bytes(), "backward": bwd.sent_bytes()},
                      "from_routing": {k: computed[k] for k in ("forward", "backward")},
                      "routing": computed,
                      "uniform_per_exchange": uniform_routing_bytes(
                          tokens_per_rank, top_k, hidden, x.element_size(), world),
                      "calls": {"forward": fwd.counts(), "backward": bwd.counts()}}}


def _skewed_tokens(n, hidden, generator, skew):
    """Tokens that share one strong direction: a fresh router sends most of them the same way."""
    direction = torch.randn(hidden, generator=generator)
    return torch.randn(n, hidden, generator=generator) + skew * direction / direction.norm()


def balance_sweep(n_experts: int = 8, hidden: int = 16, ffn: int = 32, tokens: int = 256,
                  steps: int = 40, top_k: int = 2, capacity_factor: float | None = 1.25,
                  aux_weight: float = 0.5, skew: float = 6.0, lr: float = 0.01,
                  seed: int = 0) -> list[dict]:
    """Train an MoE on skewed tokens with and without the load-balancing loss (one process).

    The tokens share a strong common direction, so the router starts with a favourite expert
    or two. The task is to learn a fixed random map of the tokens (MSE, Adam); with the loss,
    ``aux_weight * load_balancing_loss`` is added. Returns one row per step and setting:
    ``{"aux": bool, "step", "tokens_per_expert", "dropped", "aux_loss", "task_loss"}``.

    Example::

        >>> rows = balance_sweep(steps=20)
        >>> [r["dropped"] for r in rows if r["step"] == 19]     # without, with the loss
        [120, 8]
    """
    whole(steps, "steps")
    rows = []
    for aux in (False, True):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # the same layer and data for both settings
        moe = MoE(hidden, ffn, n_experts, top_k, capacity_factor)
        x = _skewed_tokens(tokens, hidden, gen, skew)
        target = x @ torch.randn(hidden, hidden, generator=gen) / math.sqrt(hidden)
        opt = torch.optim.Adam(moe.parameters(), lr=lr)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            task = nn.functional.mse_loss(x + moe(x), target)  # the residual carries drops
            loss = task + aux_weight * moe.aux_loss if aux else task
            loss.backward()
            opt.step()
            rows.append({"aux": aux, "step": step, **{k: moe.stats[k] for k in (
                "tokens_per_expert", "dropped", "aux_loss")}, "task_loss": task.item()})
    return rows
