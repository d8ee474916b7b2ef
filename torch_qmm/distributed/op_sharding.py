"""DTensor sharding rules for torch_qmm's qmm op, registered with PyTorch's own mechanism for custom
ops (torch.distributed.tensor.experimental.register_sharding): a QuantLinear whose buffers are
DTensors then runs its unchanged forward, and autograd's dx (qmm with the other transpose) is
placed by the same rules.

With W [N, K] stored as wq [N, K*bits/32] and scales / biases [N, K/group_size] (transpose=True,
y = x @ W.T):
  - wq, scales, biases Shard(0) (rows: N), x Replicate            -> y Shard(-1)   (colwise)
  - wq, scales, biases Shard(1) (whole groups of K), x Shard(-1)  -> y Partial     (rowwise)
transpose=False (y = x @ W, W [K, N] quantized along N; the backward of the above):
  - Shard(0) (rows: K), x Shard(-1)                               -> y Partial
  - Shard(1) (whole groups of N), x Replicate                     -> y Shard(-1)
plus all-Replicate and x sharded on a leading dim with replicated weights. A Shard(1) split is only
meaningful in whole groups; the styles (styles.py) check that before they shard, DTensor cannot
(it splits the packed words and the scales independently).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from .. import ops  # noqa: F401  (the op and its autograd rule are registered there)

_QMM = torch.ops.torch_qmm.qmm.default


@register_sharding(_QMM)
def _qmm_sharding(x, wq, scales, biases, mode, bits, group_size, transpose=True):
    # One placement per argument of the call (non-tensors None); `transpose` may be omitted.
    n_args = 8
    last = x.ndim - 1

    def strategy(out, x_placement, w_placement):
        weights = [w_placement, w_placement, None if biases is None else w_placement]
        return [out], ([x_placement, *weights] + [None] * (n_args - 4))

    rows_out = Shard(last) if transpose else Partial()
    rows_x = Replicate() if transpose else Shard(last)
    cols_out = Partial() if transpose else Shard(last)
    cols_x = Shard(last) if transpose else Replicate()
    strategies = [
        strategy(Replicate(), Replicate(), Replicate()),
        strategy(rows_out, rows_x, Shard(0)),
        strategy(cols_out, cols_x, Shard(1)),
    ]
    strategies += [strategy(Shard(d), Shard(d), Replicate()) for d in range(last)]
    return strategies
