"""Tensor parallelism for torch_qmm's layers on torch.distributed (DeviceMesh, DTensor,
parallelize_module): the styles QuantColwiseParallel / QuantRowwiseParallel (QuantExpertsParallel for MoE experts), a tensor-parallel
plan for transformers models, and loading a checkpoint (MLX, or transformers' save) straight into each rank's slices.
docs/distributed.md describes the design and how to run a model across machines."""

from .experts import QuantExpertsParallel
from .styles import QuantColwiseParallel, QuantRowwiseParallel, ReplicatedGradAllReduce, parallelize, shard_locally
from .plan import tp_plan
from .loading import ShardedLoadReport, empty_parameters, load_mlx_sharded, load_pretrained_sharded

__all__ = [
    "QuantColwiseParallel", "QuantExpertsParallel", "QuantRowwiseParallel", "ReplicatedGradAllReduce", "ShardedLoadReport", "empty_parameters", "load_mlx_sharded",
    "load_pretrained_sharded", "parallelize", "shard_locally", "tp_plan",
]
