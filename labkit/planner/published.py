"""Published training runs, described for the planner, with where each figure comes from."""

from __future__ import annotations

from dataclasses import dataclass

from .describe import Cluster, Degrees, Model
from .search import Plan, plan

__all__ = ["Published", "PUBLISHED"]


@dataclass(frozen=True)
class Published:
    """A published training run: its model, its cluster, its layout, where the figures come from."""

    model: Model
    cluster: Cluster
    degrees: Degrees
    source: str
    notes: str = ""

    def plan(self) -> Plan:
        return plan(self.model, self.cluster, self.degrees)


_A100 = {"memory_gib": 80, "devices_per_node": 8, "intra_GBps": 300.0, "inter_GBps": 25.0,
         "tflops": 150.0}  # DGX A100: NVLink 3 (600 GB/s both ways), 8 x 200 Gb/s HDR per node
_H100 = {"memory_gib": 80, "devices_per_node": 8, "intra_GBps": 450.0, "inter_GBps": 50.0,
         "tflops": 400.0}  # NVLink 4 (900 GB/s both ways), 400 Gb/s per GPU

def _megatron_2021(name: str, *, params: float, layers: int, hidden: int, heads: int, gpus: int,
                   dp: int, pp: int, source: str, notes: str) -> Published:
    """A row of Megatron-LM's 2021 table (SC21): what every row shares is written here once.

    2048-token sequences, vocabulary 51200, tensor parallelism 8 (one DGX A100 node), one
    sequence per micro-batch (assumed) and so ``batch / dp`` micro-batches per replica, the
    batch being one sequence per GPU; full activation recomputation (assumed); neither
    sequence parallelism nor a distributed optimizer, which came later.
    """
    return Published(
        Model(name, params=params, layers=layers, hidden=hidden, heads=heads, seq_len=2048,
              micro_batch=1, vocab=51200, activation_checkpointing=True),
        Cluster(devices=gpus, name=f"{gpus} A100 80GB", **_A100),
        Degrees(dp=dp, tp=8, pp=pp, zero=0, microbatches=gpus // dp, sp=False),
        source, notes)


PUBLISHED = {
    "gpt3-175b": _megatron_2021(
        "GPT-3 175B", params=175e9, layers=96, hidden=12288, heads=96, gpus=1536, dp=24, pp=8,
        source="Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
        "Clusters Using Megatron-LM' (SC21), Table 1: 96 layers, hidden 12288, 96 heads, t=8, "
        "p=8, 1536 A100 80GB GPUs, batch 1536 sequences of 2048 tokens, vocabulary 51200.",
        notes="Assumed, not from the table: micro-batch 1 (so 64 micro-batches per replica) and "
        "full activation recomputation, which the paper uses to fit its largest models: without "
        "it this plan needs about 92 GiB. 2021 Megatron had neither sequence parallelism nor a "
        "distributed optimizer (sp=False, zero=0). The paper's interleaved schedule is not "
        "modelled (it holds a little more in flight)."),
    "megatron-1t": _megatron_2021(
        "Megatron 1T", params=1008e9, layers=128, hidden=25600, heads=160, gpus=3072, dp=6,
        pp=64, source="Narayanan et al. 2021 (SC21), Table 1, the largest row: 1008B parameters, "
        "128 layers, hidden 25600, 160 heads, t=8, p=64, 3072 A100 80GB GPUs (502 PFLOP/s, the "
        "abstract), batch 3072 sequences of 2048 tokens.",
        notes="Assumed as for GPT-3: micro-batch 1 (512 micro-batches per replica) and full "
        "activation recomputation."),
    "llama3-405b": Published(
        Model("Llama 3 405B", params=405e9, layers=126, hidden=16384, heads=128, kv_heads=8,
              ffn=53248, seq_len=8192, micro_batch=1, vocab=128256, flash_attention=True,
              dropout=False, gated_mlp=True),
        Cluster(devices=16384, name="16384 H100 80GB", **_H100),
        Degrees(dp=128, tp=8, pp=16, cp=1, zero=3, keep_gathered=True, microbatches=16,
                stage_layers=(7,) + (8,) * 14 + (7,)),
        "Dubey et al. 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783): Table 3, 126 "
        "layers, model dimension 16384, FFN dimension 53248, 128 attention heads with 8 "
        "key/value heads, SwiGLU; Table 4, the 16384-GPU pre-training layout TP 8, CP 1, PP 16, "
        "DP 128, sequence 8192, 16M tokens per batch (2048 sequences: 16 per data-parallel "
        "rank); section 3.3.2: 'we reduce one Transformer layer each from the first and the "
        "last stages' (stage_layers 7, 8, ..., 8, 7), and FSDP that 'shards optimizer states "
        "and gradients, but for model shards we do not reshard after forward computation' "
        "(zero=3, keep_gathered=True).",
        "Assumed: micro-batch 1 (16 micro-batches per replica) and nothing recomputed. Not "
        "modelled: the embedding and output layers on the first and last stages (which is why "
        "those stages have a layer fewer), the interleaved schedule (its V is not given), the "
        "fused kernels and whatever else the run kept out of memory. With these inputs the "
        "plan does not fit: its activations, counted op by op the GPT way, are most of it. The "
        "paper orders its groups [TP, CP, PP, DP], not Megatron's."),
}
