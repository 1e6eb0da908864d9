"""Sequence parallelism the Megatron-LM way: tensor parallelism, then what it leaves replicated.

Megatron's tensor parallelism (TP, :mod:`labkit.parallel.tensor`) splits a transformer block's
attention by heads and its MLP by hidden features over ``t`` ranks: one all-reduce after each
row-parallel layer in forward (``g``), one at each column-parallel input in backward (``f``).
Everything between a ``g`` and the next ``f`` is *replicated*: every rank runs LayerNorm, the
dropouts and the residual adds on the whole ``(seq, batch, hidden)`` tensor and keeps the same
activations for backward, ``10 s b h`` bytes of the ``34 s b h`` a block keeps in fp16.

Sequence parallelism (SP) splits that replicated part along the sequence instead: each rank
holds ``seq / t`` tokens there. The all-reduce ``g`` becomes a reduce-scatter (each rank gets the
sums for its own tokens only) and the identity ``f`` becomes an all-gather (the column-parallel
layer needs every token). A ring all-reduce *is* a reduce-scatter followed by an all-gather, so
the bytes on the wire are the same as TP's; only the memory changes. With ``(seq, batch,
hidden)`` activations a rank's tokens are contiguous rows, which the collectives fill in place.

One subtlety: under SP each LayerNorm (and the bias added after each reduce-scatter) sees only
this rank's tokens, so its gradient is a *partial* sum over tokens. Megatron all-reduces those
gradients over the TP group after backward (:func:`allreduce_sequence_parallel_grads`); without
it the ranks' LayerNorms drift apart. TP needs no such step: every rank saw every token.

Activation memory (bytes autograd keeps for backward, one block, per rank) is derived op by op
in :func:`activation_bytes` and measured by :func:`sp_check`, exactly equal.

Inside a worker (``labkit.launch(sp_check, 16, 2, 32, 4, nproc=2)``) everything runs over the
default group; the blocks and functions accept ``group=`` (a TP group of a larger job).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._dist import all_gather_into, collective_device, reduce_scatter_into
from .._sizes import whole
from .memory import counting_saved_bytes
from .tensor import check_split, copy_to_tp, reduce_from_tp
from .transformer import Block, attention, block_input, check_heads, merge_heads, split_heads

__all__ = ["GatherSequence", "ReduceScatterSequence", "gather_sequence", "reduce_scatter_sequence",
           "split_sequence", "GatheredLinear", "gather_linear",
           "TPBlock", "SPBlock", "tp_block", "sp_block", "allreduce_sequence_parallel_grads",
           "check_sequence_split", "activation_bytes", "traffic_formula", "sp_check",
           "activation_rows"]


# ---- the communication: SP's conjugate pair along dim 0 --------------------------------------


def _degree(group) -> tuple[int, int]:
    """Ranks in ``group`` and this rank's index in it; ``(1, 0)`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_sequence_split(seq: int, tp: int) -> int:
    """``seq // tp`` (tokens per rank), or a ValueError saying which lengths or degrees work.

    Example::

        >>> check_sequence_split(16, 4)
        4
    """
    return check_split(whole(seq, "sequence length"), tp, "sequence length")


def _all_gather_seq(x, group):
    """Every rank's ``x`` stacked along dim 0 (the sequence), in rank order."""
    t, _ = _degree(group)
    if t == 1:
        return x
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group=group)  # rank r's rows land at r * len(x)
    return out


def _reduce_scatter_seq(x, group):
    """This rank's rows (along dim 0) of ``x`` summed over the ranks."""
    t, _ = _degree(group)
    if t == 1:
        return x
    rows = check_sequence_split(x.shape[0], t)
    out = x.new_empty((rows, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group=group)
    return out


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter of the gradient backward.

    ``GatherSequence.apply(x, group)``; :func:`gather_sequence` is the usual way to call it.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group) if _degree(group)[0] > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used all the tokens, this rank's included, with its own slice of the
        # weights: the gradient of this rank's tokens is the SUM over the ranks, of its rows.
        return _reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward.

    ``ReduceScatterSequence.apply(x, group)``; see :func:`reduce_scatter_sequence`.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group) if _degree(group)[0] > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Rank r's output rows are the sum of every rank's partial rows: each partial gets
        # the gradient of those rows unchanged, so each rank needs every rank's gradient rows.
        return _all_gather_seq(grad, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    """This rank's rows forward (the input is the same on every rank); all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, rank = _degree(group)
        if t == 1:
            return x.view_as(x)
        rows = check_sequence_split(x.shape[0], t)
        return x[rank * rows:(rank + 1) * rows].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


def gather_sequence(x, group=None):
    """Every rank's tokens: all-gather ``x`` along dim 0 forward; reduce-scatter backward.

    Where the sequence-parallel region hands over to a column-parallel layer (before QKV and
    before fc1). TP's ``f`` (identity forward, all-reduce backward), made sequence parallel.

    Example::

        >>> gather_sequence(torch.full((2, 1, 3), dist.get_rank()))[:, 0, 0]   # on 2 ranks
        tensor([0, 0, 1, 1])
    """
    return GatherSequence.apply(x, group)


def reduce_scatter_sequence(x, group=None):
    """This rank's tokens of the sum: reduce-scatter ``x`` along dim 0; all-gather backward.

    Where a row-parallel layer's partial outputs return to the sequence-parallel region
    (after the attention projection and after fc2). TP's ``g`` (all-reduce forward, identity
    backward), made sequence parallel.

    Example::

        >>> reduce_scatter_sequence(torch.ones(4, 1, 3))[:, 0, 0]   # on 2 ranks
        tensor([2., 2.])
    """
    return ReduceScatterSequence.apply(x, group)


def split_sequence(x, group=None):
    """This rank's ``seq / t`` rows of a tensor every rank holds whole; all-gather backward.

    Where a model enters the sequence-parallel region (after the embedding), and how a test
    gives each rank its shard.

    Example::

        >>> split_sequence(torch.arange(4.0).view(4, 1, 1))[:, 0, 0]   # rank 1 of 2
        tensor([2., 3.])
    """
    return _SplitSequence.apply(x, group)


class GatheredLinear(torch.autograd.Function):
    """All-gather then ``F.linear``, keeping only this rank's shard of the input for backward.

    ``GatheredLinear.apply(x, weight, bias, group)``; see :func:`gather_linear`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        # x: this rank's (seq/t, batch, in) shard; weight: its column slice, (out/t, in).
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # the shard, not the gathered tensor: t times smaller
        # -> (seq, batch, out/t): every token, this rank's output features.
        return F.linear(_all_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        # grad: (seq, batch, out/t), the gradient of this rank's output features, every token.
        x, weight = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group)  # again: the price of keeping only the shard
        grad_in = grad @ weight  # (seq, batch, in): this rank's share of dL/d(gathered input)
        # The weight gradient needs every token's input: (out/t, in), this rank's slice only,
        # so no communication for it (the ranks' slices are different weights).
        grad_w = grad.flatten(0, -2).t() @ full.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        # Each rank's share covers every token: sum the shares, keep this rank's seq/t rows.
        return _reduce_scatter_seq(grad_in, ctx.group), grad_w, grad_b, None


def gather_linear(x, weight, bias=None, group=None):
    """``F.linear(gather_sequence(x), weight, bias)``, saving the shard, not the gathered input.

    Megatron's choice: the linear layer after an all-gather keeps only the rank's ``seq / t``
    rows for backward and all-gathers them again there (Megatron overlaps that all-gather
    with the input-gradient GEMM). One more all-gather per layer in backward buys ``(t-1)/t``
    of that input's memory.

    Example::

        >>> y = gather_linear(x_shard, fc.weight, fc.bias)   # (seq, batch, out/t) on each rank
    """
    return GatheredLinear.apply(x, weight, bias, group)


# ---- the blocks -------------------------------------------------------------------------------


def _sliced_linear(dense: nn.Linear, *, rows=None, cols=None) -> nn.Linear:
    """A copy of ``dense`` with only ``rows`` (output features) or ``cols`` (input features)."""
    weight = dense.weight.detach()
    weight = weight[rows] if rows is not None else weight[:, cols]
    layer = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    layer.weight = nn.Parameter(weight.clone())
    bias = dense.bias.detach()
    layer.bias = nn.Parameter((bias[rows] if rows is not None else bias).clone())
    return layer


class _ShardedBlock(nn.Module):
    """This rank's share of a dense :class:`~labkit.parallel.transformer.Block`.

    QKV (whole heads, thanks to its head-by-head layout) and fc1 are split by output rows
    (column parallel); proj and fc2 by input columns (row parallel, whole bias); the
    LayerNorms and the dropouts are copies.
    """

    def __init__(self, dense: Block, group=None):
        super().__init__()
        if not isinstance(dense, Block):
            raise ValueError(f"expected a labkit.parallel.transformer.Block, e.g. Block(64, 4); "
                             f"got {type(dense).__name__}")
        self.group = group
        self.tp, self.rank = _degree(group)
        heads = check_split(dense.heads, self.tp, "number of heads")
        self.heads, self.causal = heads, dense.causal
        hidden, mlp = dense.hidden, dense.mlp_ratio * dense.hidden
        mine = lambda width: slice(self.rank * width // self.tp,  # noqa: E731
                                   (self.rank + 1) * width // self.tp)
        self.ln1, self.ln2 = copy.deepcopy(dense.ln1), copy.deepcopy(dense.ln2)
        self.qkv = _sliced_linear(dense.qkv, rows=mine(3 * hidden))
        self.proj = _sliced_linear(dense.proj, cols=mine(hidden))
        self.fc1 = _sliced_linear(dense.fc1, rows=mine(mlp))
        self.fc2 = _sliced_linear(dense.fc2, cols=mine(mlp))
        self.drop1, self.drop2 = copy.deepcopy(dense.drop1), copy.deepcopy(dense.drop2)

    def _attention(self, qkv):
        """This rank's heads of self-attention, on every token: ``(seq, batch, hidden / t)``."""
        q, k, v = split_heads(qkv, self.heads)
        return merge_heads(attention(q, k, v, self.causal))


class TPBlock(_ShardedBlock):
    """Megatron tensor parallelism of a block: heads and MLP features split, the rest replicated.

    Input and output: the whole ``(seq, batch, hidden)`` tensor, the same on every rank.
    Forward: one all-reduce after each row-parallel layer (``g``); backward: one at each
    column-parallel input (``f``). LayerNorm, dropout and the residual adds run on every token
    on every rank. Build it with :func:`tp_block`.

    Example::

        >>> torch.manual_seed(0); block = tp_block(Block(64, 4))   # inside a worker
        >>> block(block_input(16, 2, 64)).shape
        torch.Size([16, 2, 64])
    """

    def forward(self, x):
        # x: (seq, batch, hidden), the same on every rank; each rank holds heads/t heads of
        # qkv and proj, and ffn/t features of fc1 and fc2.
        g = self.group
        h = copy_to_tp(self.ln1(x), g)                      # f: all-reduce of dL/dh backward
        a = F.linear(self._attention(self.qkv(h)), self.proj.weight)  # a partial sum
        x = x + self.drop1(reduce_from_tp(a, g) + self.proj.bias)     # g, then the bias once
        h = copy_to_tp(self.ln2(x), g)                      # f
        m = F.linear(F.gelu(self.fc1(h)), self.fc2.weight)  # a partial sum
        return x + self.drop2(reduce_from_tp(m, g) + self.fc2.bias)   # g


class SPBlock(_ShardedBlock):
    """Tensor plus sequence parallelism: LayerNorm, dropout and residuals on ``seq / t`` tokens.

    Input and output: this rank's sequence shard, ``(seq / t, batch, hidden)``. An all-gather
    before QKV and before fc1 (backward: reduce-scatter), a reduce-scatter after the attention
    projection and after fc2 (backward: all-gather). The LayerNorms and the two row-parallel
    biases see only this rank's tokens: call :func:`allreduce_sequence_parallel_grads` after
    backward. ``regather=True`` keeps only the shard of QKV's and fc1's input for backward and
    all-gathers it again there (:func:`gather_linear`, Megatron's way). Build it with
    :func:`sp_block`.

    Example::

        >>> torch.manual_seed(0); block = sp_block(Block(64, 4))   # inside a worker, 2 ranks
        >>> block(block_input(8, 2, 64)).shape                     # 8 of the 16 tokens
        torch.Size([8, 2, 64])
    """

    # Gradients that are partial sums over this rank's tokens (Megatron's "sequence_parallel"
    # parameters): the LayerNorms and the biases added after a reduce-scatter.
    SEQUENCE_PARALLEL = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "proj.bias",
                         "fc2.bias")

    def __init__(self, dense: Block, group=None, *, regather: bool = False):
        super().__init__(dense, group)
        self.regather = regather

    def _gathered(self, h, linear):
        """``linear`` applied to every rank's tokens of ``h``."""
        if self.regather:
            return gather_linear(h, linear.weight, linear.bias, self.group)
        return linear(gather_sequence(h, self.group))   # saves the gathered input

    def forward(self, x):
        # x: (seq/t, batch, hidden), this rank's tokens (rank r holds rows r*seq/t onwards).
        g, full_seq = self.group, x.shape[0] * self.tp
        # Dropout draws its mask for the whole sequence and keeps these rows, so that the
        # t shards together drop exactly what the dense block would.
        rows = dict(start=self.rank * x.shape[0], full_seq=full_seq)  # my tokens' dropout rows
        # LayerNorm on the shard (it normalises each token alone); all-gather the tokens for
        # attention, which needs every token: (seq, batch, 3 * hidden/t) from QKV.
        a = F.linear(self._attention(self._gathered(self.ln1(x), self.qkv)), self.proj.weight)
        # a: (seq, batch, hidden), a partial sum. Reduce-scatter sums it and hands each rank
        # its seq/t rows: the same bytes as TP's all-reduce, a t-th of the result kept.
        x = x + self.drop1(reduce_scatter_sequence(a, g) + self.proj.bias, **rows)
        m = F.linear(F.gelu(self._gathered(self.ln2(x), self.fc1)), self.fc2.weight)
        return x + self.drop2(reduce_scatter_sequence(m, g) + self.fc2.bias, **rows)


def tp_block(dense: Block, group=None) -> TPBlock:
    """This rank's tensor-parallel share of ``dense`` (copied; heads and MLP features split).

    Example::

        >>> block = tp_block(Block(64, 4))   # inside a worker: 2 of the 4 heads on 2 ranks
    """
    return TPBlock(dense, group)


def sp_block(dense: Block, group=None, *, regather: bool = False) -> SPBlock:
    """This rank's tensor- and sequence-parallel share of ``dense`` (see :class:`SPBlock`).

    Example::

        >>> block = sp_block(Block(64, 4))   # inside a worker: feed it split_sequence(x)
    """
    return SPBlock(dense, group, regather=regather)


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum, over the TP group, the gradients that SP leaves partial; returns how many tensors.

    Every :class:`SPBlock`'s LayerNorm weights and biases and its two row-parallel biases saw
    only this rank's tokens, so each rank holds a part of their gradient. One all-reduce of
    all of them flattened together (Megatron also coalesces them). Call it after backward,
    before the optimizer step.

    Example::

        >>> block(x_shard).backward(grad_shard)
        >>> allreduce_sequence_parallel_grads(block)   # now every rank has the dense gradients
        6
    """
    # These weights are replicated on every TP rank, but each rank's backward saw only its
    # own seq/t tokens: its gradient is a partial sum, and the ranks' sum is the dense one.
    grads = [p.grad for m in model.modules() if isinstance(m, SPBlock)
             for name, p in m.named_parameters() if name in SPBlock.SEQUENCE_PARALLEL
             and p.grad is not None]
    if grads and _degree(group)[0] > 1:
        # One flat buffer, one all-reduce: six small tensors would pay six latencies.
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(summed.view_as(g))
    return len(grads)


# ---- the formulas -------------------------------------------------------------------------------


def activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                     sequence_parallel: bool = False, *, dtype_bytes: int = 4,
                     dropout: bool = True, causal: bool = True, mlp_ratio: int = 4,
                     regather: bool = False) -> dict:
    """Bytes one block keeps for backward on one rank, by region, counted op by op.

    With ``E = seq * batch * hidden`` elements of ``dtype_bytes`` each, ``t = tp`` and ``a``
    heads, what autograd saves in :class:`~labkit.parallel.transformer.Block`'s forward:

    ===============================  ==========================  =========  ===========
    op (what it saves)               dense                       TP         TP + SP
    ===============================  ==========================  =========  ===========
    ln1 (its input x)                E                           E          E/t
    qkv (its input, ln1's output)    E                           E          E (E/t [1])
    q @ k^T (q and k)                2E                          2E/t       2E/t
    softmax (its output P)           a s^2 b                     / t        / t
    P @ v (P again: shared; v)       E                           E/t        E/t
    proj (its input)                 E                           E/t        E/t
    ln2 (its input)                  E                           E          E/t
    fc1 (its input, ln2's output)    E                           E          E (E/t [1])
    gelu (its input)                 r E                         r E/t      r E/t
    fc2 (its input, gelu's output)   r E                         r E/t      r E/t
    ===============================  ==========================  =========  ===========

    in ``dtype_bytes`` each (``r = mlp_ratio``, 4), plus small terms: each dropout's boolean
    mask (1 byte per element: ``2E``, ``2E`` and ``2E/t``), each LayerNorm's mean and
    1/std (``seq * batch`` float32 each, ``/t`` under SP) and the causal mask (``s^2``
    booleans, ``masked_fill`` keeps it). [1] Plain SP saves the *gathered* input of QKV and
    fc1; ``regather=True`` saves the shard (:func:`gather_linear`).

    In fp16 (2 bytes) with ``r = 4`` and without the small terms, per block:
    dense ``s b h (34 + 2 a s / h)``, TP ``s b h (10 + 24/t + 2 a s / (h t))``, TP + SP with
    ``regather`` ``s b h / t (34 + 2 a s / h)``. Megatron's paper (Korthikanti et al., 2022)
    has ``10 + 24/t + 5 a s / (h t)`` and ``(34 + 5 a s / h) / t``: its block also drops out
    the attention probabilities, which keeps a mask (1 byte) and the dropped-out copy (2
    bytes) of every score; this block does not, so 2 instead of 5. Plain SP keeps the two
    gathered inputs whole: ``s b h (4 + 30/t + ...)``.

    Returns ``{"layernorm", "attention", "mlp", "dropout", "total"}`` in bytes.

    Example::

        >>> activation_bytes(16, 2, 32, 4)["total"]       # what sp_check measures, dense
        76544
    """
    for name, value in (("seq", seq), ("batch", batch), ("dtype_bytes", dtype_bytes),
                        ("mlp_ratio", mlp_ratio)):
        whole(value, name)
    check_heads(hidden, heads)
    t = whole(tp, "tp")
    check_split(heads, t, "number of heads")
    if sequence_parallel:
        check_sequence_split(seq, t)
    e, E, tokens = dtype_bytes, seq * batch * hidden, seq * batch
    sp = t if sequence_parallel else 1   # what the replicated region is divided by
    gathered = E // t if (sequence_parallel and regather) else E  # QKV's and fc1's input
    stats = 2 * 2 * (tokens // sp) * max(e, 4)  # mean and 1/std of 2 LayerNorms, float32+
    regions = {
        "layernorm": 2 * (E // sp) * e + stats,
        "attention": (gathered + 3 * E // t + E // t) * e + heads * seq * seq * batch // t * e
                     + (seq * seq if causal else 0),
        "mlp": (gathered + 2 * mlp_ratio * E // t) * e,
        "dropout": 2 * (E // sp) if dropout else 0,
    }
    regions["total"] = sum(regions.values())
    return regions


def traffic_formula(seq: int, batch: int, hidden: int, tp: int, *, sequence_parallel: bool,
                    regather: bool = False, dtype_bytes: int = 4, mlp_ratio: int = 4) -> dict:
    """Bytes one rank sends for one block: forward, backward and the gradient all-reduce.

    With ``S = seq * batch * hidden * dtype_bytes``: an all-reduce sends ``2(t-1)/t S``, an
    all-gather (output ``S``) or a reduce-scatter (input ``S``) ``(t-1)/t S`` each, so TP's
    two all-reduces and SP's two all-gathers plus two reduce-scatters cost the same, each way.
    ``regather`` adds two all-gathers in backward; SP's gradient all-reduce carries the
    LayerNorms' and the two row biases' ``6 hidden`` values.

    Example::

        >>> traffic_formula(16, 2, 32, 2, sequence_parallel=False)
        {'forward': 8192, 'backward': 8192, 'grad_sync': 0}
    """
    del mlp_ratio  # the MLP's width never crosses the wire: only (seq, batch, hidden) tensors
    t, S = whole(tp, "tp"), seq * batch * hidden * dtype_bytes
    pair = 2 * (t - 1) * S // t  # one all-reduce = one all-gather + one reduce-scatter
    out = {"forward": 2 * pair, "backward": 2 * pair, "grad_sync": 0}
    if sequence_parallel:
        out["backward"] += 2 * (t - 1) * S // t if regather else 0
        out["grad_sync"] = 2 * (t - 1) * (6 * hidden * dtype_bytes) // t
    return out


# ---- checking ------------------------------------------------------------------------------------


def _gather_dim(t, dim, group):
    """Every rank's ``t`` concatenated along ``dim`` (to compare shards with the dense tensor)."""
    n, _ = _degree(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


# How each parameter of a sharded block is split: 0 = output rows, 1 = input columns.
_SPLIT_DIM = {"qkv.weight": 0, "qkv.bias": 0, "proj.weight": 1, "fc1.weight": 0, "fc1.bias": 0,
              "fc2.weight": 1}


def _run(model, x, grad_out, params):
    """Output, input gradient, bytes saved for backward and the traffic of each pass."""
    from . import traffic

    x = x.detach().clone().requires_grad_()
    with counting_saved_bytes(exclude=params) as saved, traffic.count_traffic() as fwd:
        out = model(x)
    with traffic.count_traffic() as bwd:
        out.backward(grad_out)
    passes = {"forward": fwd, "backward": bwd}
    return {"out": out.detach(), "input_grad": x.grad, "saved_bytes": saved["bytes"],
            "collectives": {k: v.counts() for k, v in passes.items()},
            "sent_bytes": {k: v.sent_bytes() for k, v in passes.items()}}


def sp_check(seq: int = 16, batch: int = 2, hidden: int = 32, heads: int = 4,
             dropout: float = 0.1, seed: int = 0) -> dict:
    """Worker function: TP and SP copies of one block against the dense block, measured.

    Every rank builds the same dense :class:`~labkit.parallel.transformer.Block` (one seed,
    ``dropout`` on, masks shared through :class:`~labkit.parallel.transformer.SlicedDropout`),
    the same input and upstream gradient, then its :class:`TPBlock`, :class:`SPBlock` and
    ``SPBlock(regather=True)`` over all ranks, and runs one forward and backward of each.
    Returns, per version: the largest absolute differences from the dense block of the
    output, the input gradient and every parameter gradient (shards gathered; for SP after
    :func:`allreduce_sequence_parallel_grads`, and ``unsynced``: the worst of those gradients
    before it); the collectives and bytes sent forward, backward and in the gradient sync;
    the bytes saved for backward; and beside them :func:`activation_bytes` and
    :func:`traffic_formula`. ``r["dense"]["scale"]`` holds the largest magnitude of each
    dense tensor, for relative tolerances at large sizes.

    Example::

        >>> r = labkit.launch(sp_check, 16, 2, 32, 4, nproc=2).values[0]
        >>> r["sp"]["collectives"]["forward"]
        {'all_gather': 2, 'reduce_scatter': 2}
    """
    from . import traffic

    device = collective_device()
    t, rank = _degree(None)
    check_heads(hidden, heads)
    check_split(heads, t, "number of heads")
    rows = check_sequence_split(seq, t)
    mine = slice(rank * rows, (rank + 1) * rows)
    torch.manual_seed(seed)
    dense = Block(hidden, heads, dropout=dropout, dropout_seed=seed).to(device)
    versions = {"tp": tp_block(dense), "sp": sp_block(dense),
                "sp_regather": sp_block(dense, regather=True)}  # built before dense runs: same
    x = block_input(seq, batch, hidden, seed, device)              # dropout calls
    dy = block_input(seq, batch, hidden, seed + 1, device)
    ref = _run(dense, x, dy, list(dense.parameters()))
    ref_grads = {name: p.grad for name, p in dense.named_parameters()}
    worst = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
    sizes = dict(seq=seq, batch=batch, hidden=hidden, heads=heads, tp=t,
                 dropout=dropout > 0)
    scale = lambda v: v.abs().max().item()  # noqa: E731
    result = {"rank": rank, "degree": t, "sizes": sizes,
              "dense": {"saved_bytes": ref["saved_bytes"],
                        "formula_bytes": activation_bytes(**{**sizes, "tp": 1}),
                        "scale": {"output": scale(ref["out"]),
                                  "input_grad": scale(ref["input_grad"]),
                                  "grads": {k: scale(g) for k, g in ref_grads.items()}}}}
    for name, model in versions.items():
        is_sp = name != "tp"
        shard = mine if is_sp else slice(None)
        run = _run(model, x[shard], dy[shard], list(model.parameters()))
        grads = dict(model.named_parameters())
        entry = {"unsynced": None, "grad_sync": {}, "grad_sync_bytes": 0}
        if is_sp:
            entry["unsynced"] = max(worst(grads[k].grad, ref_grads[k])
                                    for k in SPBlock.SEQUENCE_PARALLEL)
            with traffic.count_traffic() as sync:
                allreduce_sequence_parallel_grads(model)
            entry["grad_sync"], entry["grad_sync_bytes"] = sync.counts(), sync.sent_bytes()
        full = {k: _gather_dim(p.grad, _SPLIT_DIM[k], None) if k in _SPLIT_DIM else p.grad
                for k, p in grads.items()}
        formula = dict(sequence_parallel=is_sp, regather=name == "sp_regather")
        entry.update(
            output=worst(run["out"], ref["out"][shard]),
            input_grad=worst(run["input_grad"], ref["input_grad"][shard]),
            grads={k: worst(full[k], ref_grads[k]) for k in ref_grads},
            collectives=run["collectives"], sent_bytes=run["sent_bytes"],
            saved_bytes=run["saved_bytes"], formula_bytes=activation_bytes(**sizes, **formula),
            formula_traffic=traffic_formula(seq, batch, hidden, t, **formula))
        result[name] = entry
    return result


def activation_rows(result: dict) -> list[dict]:
    """One rank's :func:`sp_check` result as rows: bytes by region and measured, per version.

    ``[{"version": "dense", "layernorm": ..., "attention": ..., "mlp": ..., "dropout": ...,
    "measured": ...}, ...]`` for dense, TP, TP + SP and TP + SP with ``regather``; what
    ``plots.sp_activation_bytes`` draws.

    Example::

        >>> [r["version"] for r in activation_rows(r0)]
        ['dense', 'TP', 'TP + SP', 'TP + SP, regather']
    """
    names = {"dense": "dense", "tp": "TP", "sp": "TP + SP", "sp_regather": "TP + SP, regather"}
    rows = []
    for key, version in names.items():
        regions = result[key]["formula_bytes"]
        rows.append({"version": version, **{k: v for k, v in regions.items() if k != "total"},
                     "formula": regions["total"], "measured": result[key]["saved_bytes"]})
    return rows
