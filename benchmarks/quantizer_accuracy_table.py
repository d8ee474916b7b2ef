"""Markdown table of quantizer_accuracy.py results: python benchmarks/quantizer_accuracy_table.py RESULT.json..."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the torch_qmm of this checkout


def main(paths: list[str]) -> None:
    rows = [r for p in paths for r in json.load(open(p))["rows"] if "error" not in r]
    floats = [r["perplexity"] for r in rows if r["method"] == "float"]
    base = floats[0]
    configs = []
    for r in rows:
        if r["method"] != "float" and (r["bits"], r["group_size"]) not in configs:
            configs.append((r["bits"], r["group_size"]))
    from torch_qmm.quantizers import names

    seen = {r["method"] for r in rows} - {"float"}
    methods = [m for m in names() if m in seen] + sorted(seen - set(names()))
    print(f"float: {base:.2f}\n")
    print("| bits, group | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for bits, group in configs:
        cells = []
        for m in methods:
            r = next((r for r in rows if r["method"] == m and (r["bits"], r["group_size"]) == (bits, group)), None)
            if r is None:
                cells.append("")
                continue
            extra = f", {r['average_bits']:.2f} b" if "average_bits" in r else ""
            memory = f", +{r['quantize_extra_mib']:.0f} MiB" if "quantize_extra_mib" in r else ""
            change = 100 * (r['perplexity'] / base - 1)
            change = f"{change:+.1f}%" if abs(change) < 100 else f"{change:+.0f}%"  # goals are +8% and +40%
            cells.append(f"{r['perplexity']:.2f} ({change}{extra}; "
                         f"{r['quantize_s']:.0f} s{memory})")
        print(f"| {bits}, g{group} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
