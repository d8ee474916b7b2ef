"""Mutation harness: plants each curated bug (tests/mutation/mutants.py) in a scratch copy of the
checkout, runs the tests meant to catch it, and reports which were killed and by which test.

    python -m tests.mutation                 # the fast mutants (Metal, Python): no C++ rebuild
    python -m tests.mutation --cpp           # the C++ ones too (each rebuilds its scratch copy)
    python -m tests.mutation -k mma -j 2     # a selection, two at a time

A scratch copy holds the tracked files of the checkout (git ls-files) plus its built extension
(torch_qmm/_C*.so), so the real checkout is never touched. The C++ mutants share one scratch copy
built once from source (setup.py build_ext --inplace), then each is applied, rebuilt
incrementally, tested and reverted. A mutant is killed when its tests fail (pytest exit status 1);
survived when they pass; crashed when the test process dies (found, but not by an assertion:
make the test run the call in a subprocess); an error when the patch no longer applies (the text it replaces is gone
or not unique) or pytest could not run, which the harness reports as a failure too, so the list
cannot go stale silently. The killing tests are output assertions (numeric, bitwise, route, error
message or metalsim's checked mode), never timing or traffic bounds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # path in the checkout
    old: str  # exact text, present once
    new: str
    tests: tuple[str, ...]  # pytest arguments (files, -k expressions) that must fail
    why: str = ""

    @property
    def area(self) -> str:
        if self.file.startswith("csrc/"):
            return "cpp"
        if self.file.startswith("metal/"):
            return "metal"
        return "python"

    @property
    def needs_build(self) -> bool:
        return self.area == "cpp"


@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str  # killed | survived | crashed | error
    killed_by: str = ""
    how: str = ""  # the exception the killing test raised (AssertionError, ValueError, KernelFault, ...)
    seconds: float = 0.0
    detail: str = ""


def _tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return [p for p in out.decode().split("\0") if p]


def scratch_copy(root: Path, dest: Path, with_extension: bool) -> None:
    """The checkout's tracked files (and its built extension) under dest."""
    for rel in _tracked_files(root):
        src = root / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    if with_extension:
        built = sorted((root / "torch_qmm").glob("_C*.so")) + sorted((root / "torch_qmm").glob("_C*.pyd"))
        if not built:
            raise RuntimeError(f"{root}/torch_qmm has no built extension (_C*.so): build the checkout first")
        for so in built:
            shutil.copy2(so, dest / "torch_qmm" / so.name)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.file
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.name}: the text to replace occurs {count} times in {mutant.file} (must be once)")
    path.write_text(text.replace(mutant.old, mutant.new))


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
# The first exception pytest reports ("E   AssertionError: ..."): what the kill was.
_RAISED = re.compile(r"^E\s+(?:([A-Za-z_.]*(?:Error|Exception|Fault|Failed))\b|(assert)\b)", re.M)
# Failures that mean the mutated code does not compile (Metal on metalsim) or import (Python).
_BROKEN = re.compile(r"\b(NameError|SyntaxError|IndentationError|ImportError|ModuleNotFoundError|CompileError|"
                     r"StageError|UnsupportedIR)\b")


def _pytest(mutant: Mutant, tree: Path, env: dict, timeout: float, start: float) -> Result:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
           *mutant.tests]
    try:
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Result(mutant, "error", detail=f"tests did not finish in {timeout:.0f} s", seconds=time.monotonic() - start)
    out = p.stdout + p.stderr
    if p.returncode == 0:
        return Result(mutant, "survived", seconds=time.monotonic() - start)
    if p.returncode == 1:
        broken = _BROKEN.search(out)
        if broken:  # the patch made code that does not build or run at all: not a kill
            return Result(mutant, "error", detail=f"the mutant does not compile or import ({broken.group(1)}):\n"
                          + out[-3000:], seconds=time.monotonic() - start)
        failed = _FAILED.findall(out)
        how = _RAISED.search(out)
        how = "?" if how is None else how.group(1) or "AssertionError"
        return Result(mutant, "killed", killed_by=failed[0] if failed else "?", how=how,
                      seconds=time.monotonic() - start)
    if p.returncode < 0:  # the test process died: a crash is found, but not by an assertion
        return Result(mutant, "crashed", detail=f"the tests died of signal {-p.returncode}:\n{out[-1500:]}",
                      seconds=time.monotonic() - start)
    return Result(mutant, "error", detail=f"pytest exit status {p.returncode}:\n{out[-3000:]}",
                  seconds=time.monotonic() - start)


def _env() -> dict:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _build(tree: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    # --force: setuptools would skip the build when only a header changed; ninja still recompiles
    # only what depends on the changed file.
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--force"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_one(mutant: Mutant, root: Path = ROOT, timeout: float = 900, keep: bool = False) -> Result:
    """A Metal or Python mutant in its own scratch copy (with the checkout's built extension)."""
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"qmm-mutant-{mutant.name}-"))
    try:
        scratch_copy(root, tmp, with_extension=True)
        try:
            apply(mutant, tmp)
        except ValueError as e:
            return Result(mutant, "error", detail=str(e), seconds=time.monotonic() - start)
        return _pytest(mutant, tmp, _env(), timeout, start)
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run_cpp(mutants: list[Mutant], root: Path = ROOT, timeout: float = 900, keep: bool = False,
            on_result=None) -> list[Result]:
    """C++ mutants one after another in one scratch copy: built once in full, then each mutant is
    applied, rebuilt incrementally, tested and reverted."""
    env = _env()
    tmp = Path(tempfile.mkdtemp(prefix="qmm-mutants-cpp-"))
    results = []
    try:
        scratch_copy(root, tmp, with_extension=False)
        b = _build(tmp, env, timeout * 4)
        if b.returncode != 0:
            raise RuntimeError("the unmutated scratch copy does not build:\n" + b.stderr[-3000:])
        for m in mutants:
            start = time.monotonic()
            path = tmp / m.file
            original = path.read_text()
            try:
                apply(m, tmp)
            except ValueError as e:
                r = Result(m, "error", detail=str(e), seconds=time.monotonic() - start)
            else:
                try:
                    b = _build(tmp, env, timeout * 2)
                    if b.returncode != 0:  # a mutant that does not compile is broken, not killed
                        r = Result(m, "error", detail="build failed:\n" + (b.stdout + b.stderr)[-3000:],
                                   seconds=time.monotonic() - start)
                    else:
                        r = _pytest(m, tmp, env, timeout, start)
                finally:
                    path.write_text(original)
            results.append(r)
            if on_result is not None:
                on_result(r)
        return results
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run(mutants: list[Mutant], jobs: int = 1, root: Path = ROOT, timeout: float = 900, keep: bool = False,
        on_result=None) -> list[Result]:
    """Every mutant: the fast ones `jobs` at a time, then the C++ ones (run_cpp). Results in list order."""
    def one(m):
        r = run_one(m, root, timeout, keep)
        if on_result is not None:
            on_result(r)
        return r

    fast = [m for m in mutants if not m.needs_build]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = dict(zip(fast, pool.map(one, fast)))
    cpp = [m for m in mutants if m.needs_build]
    if cpp:
        done.update(zip(cpp, run_cpp(cpp, root, timeout, keep, on_result)))
    return [done[m] for m in mutants]


def table(results: list[Result]) -> str:
    rows = ["| mutant | area | file | result | killed by | raised | s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.mutant.name} | {r.mutant.area} | {r.mutant.file} | {r.status} | {r.killed_by} | {r.how} "
                    f"| {r.seconds:.0f} |")
    killed = sum(r.status == "killed" for r in results)
    rows.append(f"\n{killed} of {len(results)} killed")
    return "\n".join(rows)
