"""What the first call of a Metal kernel compiles: the whole library source vs one kernel's source.

    python -m torch_qmm.bench.first_call [--out benchmarks/results/first-call-compile-metalsim.json]

Counts kernels and source bytes of both schemes (torch_qmm/metal_source.py) and times their
compile on metalsim with an empty build cache (clang -O2 of the staged C++; Apple's compiler
is a different program, so only the ratio says anything about a Mac, and no Mac number is
claimed here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from .. import metal_source
from .report import machine_info, write_json


def measure(sample: int = 8) -> dict:
    from ..metalsim import _api as metalsim

    kernels = metal_source.kernels()
    names = list(kernels)
    picked = [names[i * (len(names) - 1) // (sample - 1)] for i in range(sample)]  # spread over the table
    per_kernel = [len(metal_source.kernel_source(n).encode()) for n in names]
    whole = metal_source.flatten_libraries()  # all of metal/: the first call's source before
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TORCH_QMM_METALSIM_CACHE"] = cache  # cold: nothing built before
        t0 = time.perf_counter()
        lib = metalsim.compile(whole)
        whole_s = time.perf_counter() - t0
        assert sorted(lib.kernels) == sorted(names)
        times = {}
        for n in picked:
            t0 = time.perf_counter()
            assert metalsim.compile(metal_source.kernel_source(n)).kernels == [n]
            times[n] = round(time.perf_counter() - t0, 3)
    return {
        "before": {"scheme": "whole metal/ source at the first call", "kernels": len(names),
                   "source_bytes": len(whole.encode()), "metalsim_compile_s": round(whole_s, 2)},
        "after": {"scheme": "one kernel's source (library headers + its instantiation line) per first use",
                  "kernels": 1, "source_bytes_min": min(per_kernel), "source_bytes_max": max(per_kernel),
                  "metalsim_compile_s_median": statistics.median(times.values()),
                  "metalsim_compile_s": times},
        "libraries": {lib: {"kernels": sum(k.library == lib for k in kernels.values()),
                            "prelude_bytes": len(metal_source.prelude(lib).encode())}
                      for lib in metal_source.LIBRARIES},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_qmm.bench.first_call", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/first-call-compile-metalsim.json"))
    args = p.parse_args(argv)
    doc = {"machine": machine_info("metalsim", None), **measure()}
    write_json(args.out, doc)
    b, a = doc["before"], doc["after"]
    print(f"before: {b['kernels']} kernels, {b['source_bytes']} bytes, metalsim {b['metalsim_compile_s']} s")
    print(f"after:  1 kernel, {a['source_bytes_min']}-{a['source_bytes_max']} bytes, "
          f"metalsim {a['metalsim_compile_s_median']} s (median of {len(a['metalsim_compile_s'])})")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
