"""The course's running example: a small pre-LayerNorm transformer block, written to be split.

One block computes, on activations ``x`` of shape ``(seq, batch, hidden)``::

    x = x + drop(proj(attention(ln1(x))))        # self-attention, heads side by side
    x = x + drop(fc2(gelu(fc1(ln2(x)))))         # the MLP, 4 x hidden wide

Why ``(seq, batch, hidden)`` and not PyTorch's usual ``(batch, seq, hidden)``: it is Megatron-LM's
layout, chosen for sequence (and context) parallelism. With the sequence as dimension 0, rank
``r``'s share of the tokens, rows ``r * seq/t ... (r+1) * seq/t``, is one contiguous block of
memory, so an all-gather can write every rank's shard straight into its place in the output
(``all_gather_into_tensor``) and a reduce-scatter can hand each rank its rows of the sum
(``reduce_scatter_tensor``), with no copies to interleave the batch. Attention itself wants
``(batch, heads, seq, head_dim)``; :func:`split_heads` and :func:`merge_heads` convert.

The fused QKV projection is laid out head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (also
Megatron's choice): a contiguous chunk of its output features is whole heads, so tensor
parallelism shards it by heads with a plain column split.

Dropout is reproducible across layouts (:class:`SlicedDropout`): each mask is drawn for the
whole ``(seq, batch, hidden)`` tensor from a generator seeded the same way on every rank, and a
rank that holds only some of the tokens applies the matching rows. That lets the tensor- and
sequence-parallel copies of a block (:mod:`labkit.parallel.sequence`) be checked *equal* to the
dense block with dropout on.

Example::

    >>> block = Block(64, heads=4, dropout=0.1)
    >>> x = block_input(16, 2, 64, seed=0)        # (seq, batch, hidden)
    >>> block(x).shape
    torch.Size([16, 2, 64])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit._sizes import multiples_near, whole

__all__ = ["attention", "split_heads", "merge_heads", "SlicedDropout", "Block", "block_input",
           "block_stack", "check_heads"]


def check_heads(hidden: int, heads: int) -> int:
    """``hidden // heads`` (the head size), or a ValueError naming sizes that would work.

    Example::

        >>> check_heads(64, 4)
        16
    """
    whole(hidden, "hidden")
    whole(heads, "heads")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} does not split into {heads} heads: use a hidden size "
                         f"that is a multiple of {heads} (e.g. {multiples_near(hidden, heads)})")
    return hidden // heads


def attention(q, k, v, causal: bool = True):
    """Scaled dot-product attention, written out: ``softmax(q k^T / sqrt(d)) v``.

    ``q``, ``k``, ``v``: ``(batch, heads, seq, head_dim)``. With ``causal``, token ``i`` attends
    to tokens ``0 ... i`` only (the mask assumes ``q`` and ``k`` cover the same positions). The
    dense reference that ring attention is checked against.

    Example::

        >>> q = k = v = torch.randn(2, 4, 16, 8)
        >>> torch.allclose(attention(q, k, v), F.scaled_dot_product_attention(q, k, v,
        ...                                                                 is_causal=True))
        True
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (b, heads, s, s)
    if causal:
        s_q, s_k = scores.shape[-2:]
        future = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))  # never attend to a later token
    probs = torch.softmax(scores, dim=-1)
    return probs @ v


def split_heads(qkv, heads: int):
    """``(seq, batch, heads * 3 * head_dim)`` QKV output -> q, k, v ``(batch, heads, seq, d)``.

    The features are laid out head by head (``q_0 k_0 v_0 q_1 ...``), so ``heads`` may be the
    heads of a tensor-parallel shard. Each of q, k, v is made contiguous (a copy).

    Example::

        >>> q, k, v = split_heads(torch.randn(16, 2, 3 * 64), heads=4)
        >>> q.shape
        torch.Size([2, 4, 16, 16])
    """
    s, b, width = qkv.shape
    per_head = qkv.view(s, b, heads, 3, width // (3 * heads))
    return tuple(per_head[..., i, :].permute(1, 2, 0, 3).contiguous() for i in range(3))


def merge_heads(out):
    """``(batch, heads, seq, head_dim)`` -> ``(seq, batch, heads * head_dim)`` (a copy).

    Example::

        >>> merge_heads(torch.randn(2, 4, 16, 8)).shape
        torch.Size([16, 2, 32])
    """
    b, heads, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class _ApplyMask(torch.autograd.Function):
    """``x * mask * scale``, saving the boolean mask (1 byte per element) for backward."""

    @staticmethod
    def forward(ctx, x, mask, scale):
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


class SlicedDropout(nn.Module):
    """Dropout whose mask is drawn for the whole ``(seq, batch, hidden)`` tensor, then sliced.

    Like ``nn.Dropout(p)``: in training, each element is kept with probability ``1 - p`` and
    scaled by ``1 / (1 - p)``; in eval mode, or with ``p = 0``, the identity. The difference is
    where the randomness comes from. With an integer ``seed``, the ``n``-th call draws its mask
    from ``torch.Generator().manual_seed(seed * 2**32 + n)`` for the *full* tensor, whose rows
    ``start ... start + len(x)`` this ``x`` is (``full_seq`` rows in all; by default ``x`` is
    the whole tensor). Every rank, dense or parallel, gets the same mask for the same tokens.

    Megatron instead keeps one RNG state per tensor-parallel rank (its ``CudaRNGStatesTracker``)
    and draws only the rows it needs, on the GPU: cheaper, but no longer equal to a dense run.
    Drawing the full mask on the CPU and slicing it is a teaching simplification that makes
    the parallel blocks checkable against the dense one. ``seed=None`` draws from torch's
    global RNG, exactly as ``nn.Dropout`` does.

    Example::

        >>> drop = SlicedDropout(0.5, seed=0)
        >>> full = drop(torch.ones(4, 1, 2))                       # call 0, all 4 rows
        >>> drop.calls = 0                                         # replay call 0 ...
        >>> torch.equal(drop(torch.ones(2, 1, 2), start=2, full_seq=4), full[2:])
        True
    """

    def __init__(self, p: float = 0.0, seed: int | None = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self.p, self.seed, self.calls = float(p), seed, 0

    def forward(self, x, start: int = 0, full_seq: int | None = None):
        if not self.training or self.p == 0.0:
            return x
        if self.seed is None:
            return F.dropout(x, self.p, training=True)
        full_seq = x.shape[0] if full_seq is None else full_seq
        gen = torch.Generator().manual_seed(self.seed * 2**32 + self.calls)
        self.calls += 1
        keep = torch.rand((full_seq, *x.shape[1:]), generator=gen) >= self.p
        # clone: a slice would keep the whole mask's storage alive for backward
        mask = keep[start:start + x.shape[0]].clone().to(x.device)
        return _ApplyMask.apply(x, mask, 1.0 / (1.0 - self.p))

    def extra_repr(self):
        return f"p={self.p}, seed={self.seed}"


class Block(nn.Module):
    """A pre-LayerNorm transformer block on ``(seq, batch, hidden)`` activations.

    ``x + drop(proj(attention(ln1(x))))``, then ``x + drop(fc2(gelu(fc1(ln2(x)))))``, with
    ``heads`` attention heads and an MLP ``mlp_ratio`` times as wide as ``hidden``. The two
    dropouts are :class:`SlicedDropout` s seeded ``2 * dropout_seed`` and ``2 * dropout_seed +
    1`` (``None``: torch's global RNG, as ``nn.Dropout``). Parameters are drawn from torch's
    global RNG like any ``nn.Module``: seed it first for the same block on every rank.

    Example::

        >>> torch.manual_seed(0); block = Block(64, heads=4)
        >>> block(torch.randn(16, 2, 64)).shape
        torch.Size([16, 2, 64])
    """

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 causal: bool = True, dropout_seed: int | None = 0):
        super().__init__()
        check_heads(hidden, heads)
        whole(mlp_ratio, "mlp_ratio")
        self.hidden, self.heads, self.mlp_ratio, self.causal = hidden, heads, mlp_ratio, causal
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)  # head by head: q_0 k_0 v_0 q_1 k_1 v_1 ...
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, mlp_ratio * hidden)
        self.fc2 = nn.Linear(mlp_ratio * hidden, hidden)
        seeds = (None, None) if dropout_seed is None else (2 * dropout_seed, 2 * dropout_seed + 1)
        self.drop1 = SlicedDropout(dropout, seeds[0])
        self.drop2 = SlicedDropout(dropout, seeds[1])

    def forward(self, x):
        # x: (seq, batch, hidden). q, k, v: (batch, heads, seq, hidden/heads) after the split.
        # Pre-norm: LayerNorm before each sublayer, the residual added around it.
        q, k, v = split_heads(self.qkv(self.ln1(x)), self.heads)
        # Attention mixes tokens (the only place they meet: what SP and CP must communicate);
        # everything else works on each token alone.
        x = x + self.drop1(self.proj(merge_heads(attention(q, k, v, self.causal))))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


def block_input(seq: int, batch: int, hidden: int, seed: int = 0, device=None,
                dtype=torch.float32):
    """A random ``(seq, batch, hidden)`` activation, the same for a seed on every rank.

    Example::

        >>> block_input(16, 2, 64, seed=0).shape
        torch.Size([16, 2, 64])
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(seq, batch, hidden, generator=gen, dtype=dtype).to(device)


def block_stack(layers: int, hidden: int, heads: int, *, mlp_ratio: int = 4,
                dropout: float = 0.0, causal: bool = True, seed: int | None = 0) -> nn.Sequential:
    """``layers`` transformer :class:`Block` s in an ``nn.Sequential``, on ``(seq, batch, hidden)``.

    With an integer ``seed`` the parameters are drawn from it (torch's global RNG is left as
    it was), so every rank builds the same stack; each block's dropout has its own seeds.

    Example::

        >>> model = block_stack(2, 64, 4)
        >>> model(block_input(16, 2, 64)).shape
        torch.Size([16, 2, 64])
    """
    whole(layers, "layers")

    def build():
        return nn.Sequential(*[
            Block(hidden, heads, mlp_ratio, dropout, causal,
                  dropout_seed=None if seed is None else seed * layers + i)
            for i in range(layers)])

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
