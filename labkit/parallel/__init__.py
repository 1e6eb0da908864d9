"""Teaching implementations of the parallelisms, each meant to be read beside its notebook.

Notebook 03:

- :mod:`labkit.parallel.pipeline`: stages, micro-batches, the naive / GPipe / 1F1B schedules as
  plain lists of actions, run with point-to-point sends, the bubble measured against
  ``(p - 1) / (m + p - 1)``, and the same step with ``torch.distributed.pipelining``;
- :mod:`labkit.parallel.tensor`: Megatron-style column- and row-parallel linear layers and
  their conjugate communication functions, the same MLP with DTensor, collectives counted;
- :mod:`labkit.parallel.memory`: the ZeRO / FSDP memory estimator, FSDP2 bytes per rank
  measured, activation checkpointing measured.

Notebook 06: :mod:`~labkit.parallel.collectives` (ring and recursive-doubling all-reduce by
hand), :mod:`~labkit.parallel.parameter_server`, :mod:`~labkit.parallel.compression`.

Notebook 09: :mod:`~labkit.parallel.transformer` (the block every section splits),
:mod:`~labkit.parallel.sequence` (Megatron's sequence parallelism), :mod:`~labkit.parallel.context`
(ring attention), :mod:`~labkit.parallel.expert` (a mixture of experts over ranks).

Notebook 10: :mod:`~labkit.parallel.compose` (FSDP2 x TP and DP x PP on a 2-D mesh),
:mod:`~labkit.parallel.schedules` (interleaved 1F1B, zero bubble), :mod:`~labkit.parallel.zero`
(ZeRO-1 and ZeRO-2 from reduce-scatter and all-gather), :mod:`~labkit.parallel.dryrun` (a model's
real layers built on ``meta`` and sharded FSDP2 x TP over a fake process group of up to 65,536
ranks in one process: the bytes each rank holds, read from its DTensor shards).

Shared: :mod:`~labkit.parallel.traffic` counts what each rank sends, call by call, so that every
byte count in these notebooks is measured, then compared with its formula.

They import torch, so ``import labkit`` does not import them: ``from labkit.parallel import
pipeline``. They teach; the production paths are torch's own (``torch.distributed.pipelining``,
``torch.distributed.tensor.parallel``, ``torch.distributed.fsdp.fully_shard``).
"""
