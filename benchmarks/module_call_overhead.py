"""The time of one call of a small quantized layer at one row of x, where the kernel's own work is
a microsecond or two and the rest is the call: QuantLinear (affine 4-bit, group size 64, 256 -> 64)
against nn.Linear of the same shape, under torch.no_grad (what `generate` runs in), with grad mode
on and nothing requiring grad, and under torch.inference_mode. Small models' layers are of this
kind at M=1 (a 576 x 1536 layer's products take tens of microseconds), so the fixed cost of a
call is a fair share of their time. Median of many calls; one thread.

To compare two builds, run it alternately with PYTHONPATH on each:

    PYTHONPATH=. python benchmarks/module_call_overhead.py [--calls 20000] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from torch_qmm.nn import QuantLinear
from x_preparation import median_us  # this folder: the script's own

K, N = 256, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of lines")
    args = ap.parse_args()
    torch.set_num_threads(1)
    linear = torch.nn.Linear(K, N)
    layers = {"nn.Linear": linear, "QuantLinear": QuantLinear.from_linear(linear, bits=4, group_size=64)}
    x = torch.randn(1, K)
    modes = {"no_grad": torch.no_grad, "grad mode, nothing requires grad": contextlib.nullcontext,
             "inference_mode": torch.inference_mode}
    result = {}
    for mode, context in modes.items():
        with context():
            for name, layer in layers.items():
                for _ in range(args.calls // 10):
                    layer(x)
                result[f"{name}, {mode}"] = round(median_us(lambda layer=layer: layer(x), args.calls), 2)
    if args.json:
        print(json.dumps({"k": K, "n": N, "median_us": result}))
    else:
        for name, us in result.items():
            print(f"{name:50s} {us:8.2f} us")


if __name__ == "__main__":
    main()
