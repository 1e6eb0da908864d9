"""Teaching implementations of model parallelism, each meant to be read beside notebook 03.

- :mod:`labkit.parallel.pipeline`: stages, micro-batches, the naive / GPipe / 1F1B schedules as
  plain lists of actions, run with point-to-point sends, the bubble measured against
  ``(p - 1) / (m + p - 1)``, and the same step with ``torch.distributed.pipelining``;
- :mod:`labkit.parallel.tensor`: Megatron-style column- and row-parallel linear layers and
  their conjugate communication functions, the same MLP with DTensor, collectives counted;
- :mod:`labkit.parallel.memory`: the ZeRO / FSDP memory estimator, FSDP2 bytes per rank
  measured, activation checkpointing measured.

They import torch, so ``import labkit`` does not import them: ``from labkit.parallel import
pipeline``. They teach; the production paths are torch's own (``torch.distributed.pipelining``,
``torch.distributed.tensor.parallel``, ``torch.distributed.fsdp.fully_shard``).
"""
