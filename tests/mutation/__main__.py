"""python -m tests.mutation [--cpp | --only-cpp] [--fresh | --fresh2 | --fresh3 | --fresh4 | --fresh5 | --fresh6 | --fresh7 | --fresh8 | --fresh9 | --fresh10 | --fresh11 | --fresh12 | --fresh13 | --fresh14] [-k SUBSTRING] [--tests FILE] [-j JOBS] [--timeout CPU_S] [--wall S] [--list] [--keep]

Exit status 0 only when every selected mutant is killed (see tests/mutation/__init__.py)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from . import run, table
from .mutants import MUTANTS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpp", action="store_true", help="also run the C++ mutants (each rebuilds a scratch copy: minutes)")
    ap.add_argument("--only-cpp", action="store_true", help="run only the C++ mutants")
    ap.add_argument("--fresh", action="store_true",
                    help="use the independent audit list (tests/mutation/fresh_mutants.py) instead of the curated one")
    ap.add_argument("--fresh2", action="store_true",
                    help="use the second independent audit list (tests/mutation/fresh2_mutants.py)")
    ap.add_argument("--fresh3", action="store_true",
                    help="use the third independent audit list (tests/mutation/fresh3_mutants.py)")
    ap.add_argument("--fresh4", action="store_true",
                    help="use the fourth independent audit list (tests/mutation/fresh4_mutants.py)")
    ap.add_argument("--fresh5", action="store_true",
                    help="use the fifth independent audit list (tests/mutation/fresh5_mutants.py)")
    ap.add_argument("--fresh6", action="store_true",
                    help="use the sixth independent audit list (tests/mutation/fresh6_mutants.py)")
    ap.add_argument("--fresh7", action="store_true",
                    help="use the seventh independent audit list (tests/mutation/fresh7_mutants.py)")
    ap.add_argument("--fresh8", action="store_true",
                    help="use the eighth independent audit list (tests/mutation/fresh8_mutants.py)")
    ap.add_argument("--fresh9", action="store_true",
                    help="use the ninth independent audit list (tests/mutation/fresh9_mutants.py)")
    ap.add_argument("--fresh10", action="store_true",
                    help="use the tenth independent audit list (tests/mutation/fresh10_mutants.py)")
    ap.add_argument("--fresh11", action="store_true",
                    help="use the eleventh independent audit list (tests/mutation/fresh11_mutants.py)")
    ap.add_argument("--fresh12", action="store_true",
                    help="use the twelfth independent audit list (tests/mutation/fresh12_mutants.py)")
    ap.add_argument("--fresh13", action="store_true",
                    help="use the thirteenth independent audit list (tests/mutation/fresh13_mutants.py)")
    ap.add_argument("--fresh14", action="store_true",
                    help="use the fourteenth independent audit list (tests/mutation/fresh14_mutants.py)")
    ap.add_argument("-k", action="append", default=[], help="run mutants whose name contains this (repeatable)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=900,
                    help="CPU seconds per mutant's tests, descendants included (default 900; the wall-clock cap is "
                         "8 times that)")
    ap.add_argument("--wall", type=float, default=None, metavar="SECONDS",
                    help="wall-clock limit per mutant's tests (default: 8 times --timeout); past it the mutant is "
                         "a timeout, not a kill")
    ap.add_argument("--tests", action="append", default=[], metavar="FILE",
                    help="run these test files instead of each mutant's selection (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (paths on stderr)")
    args = ap.parse_args(argv)

    lists = [name for name in ("fresh", "fresh2", "fresh3", "fresh4", "fresh5", "fresh6", "fresh7", "fresh8", "fresh9", "fresh10", "fresh11", "fresh12", "fresh13", "fresh14") if getattr(args, name)]
    if len(lists) > 1:
        ap.error("give one of --fresh, --fresh2, --fresh3, --fresh4, --fresh5, --fresh6, --fresh7, --fresh8, --fresh9, --fresh10, --fresh11, --fresh12, --fresh13 and --fresh14")
    mutants = importlib.import_module(f".{lists[0]}_mutants", __package__).MUTANTS if lists else MUTANTS
    chosen = [m for m in mutants if (m.area == "cpp") == args.only_cpp or (args.cpp and m.area == "cpp")]
    if args.k:
        chosen = [m for m in chosen if any(s in m.name for s in args.k)]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name:40s} {m.area:6s} {m.file}  -> {' '.join(m.tests)}")
        return 0
    if not chosen:
        print("no mutant selected", file=sys.stderr)
        return 2

    def progress(r):
        print(f"{r.status:8s} {r.mutant.name} ({r.seconds:.0f} s) {r.killed_by} {r.how}{(': ' + r.detail) if r.detail else ''}",
              flush=True)

    results = run(chosen, jobs=args.jobs, timeout=args.timeout, keep=args.keep, on_result=progress, wall=args.wall)
    print(table(results))
    return 0 if all(r.status == "killed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
