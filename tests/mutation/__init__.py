"""Mutation harness: plants each curated bug (tests/mutation/mutants.py) in a scratch copy of the
checkout, runs the tests meant to catch it, and reports which were killed and by which test.

    python -m tests.mutation                 # the fast mutants (Metal, Python): no C++ rebuild
    python -m tests.mutation --cpp           # the C++ ones too (each rebuilds its scratch copy)
    python -m tests.mutation -k mma -j 2     # a selection, two at a time
    python -m tests.mutation --fresh2        # the second audit list (tests/mutation/fresh2_mutants.py)
    python -m tests.mutation --fresh3        # the third (tests/mutation/fresh3_mutants.py)
    python -m tests.mutation --fresh4 -j 2 --timeout 300   # the fourth (tests/mutation/fresh4_mutants.py)
    python -m tests.mutation --fresh5 -j 2 --wall 600      # the fifth (tests/mutation/fresh5_mutants.py)
    python -m tests.mutation --fresh6 -j 2 --wall 600      # the sixth (tests/mutation/fresh6_mutants.py)
    python -m tests.mutation --fresh7 -j 2 --wall 900      # the seventh (tests/mutation/fresh7_mutants.py)
    python -m tests.mutation --fresh8 -j 1 --wall 600      # the eighth (tests/mutation/fresh8_mutants.py)
    python -m tests.mutation --fresh9 -j 1 --wall 600      # the ninth (tests/mutation/fresh9_mutants.py)
    python -m tests.mutation --fresh10 -j 1 --wall 600     # the tenth (tests/mutation/fresh10_mutants.py)
    python -m tests.mutation --fresh11 -j 1                # the eleventh (tests/mutation/fresh11_mutants.py)
    python -m tests.mutation --fresh12 -j 1                # the twelfth (tests/mutation/fresh12_mutants.py)
    python -m tests.mutation --fresh13 -j 1 --wall 600     # the thirteenth (tests/mutation/fresh13_mutants.py)
    python -m tests.mutation --fresh14 -j 1                # the fourteenth (tests/mutation/fresh14_mutants.py)

A scratch copy holds the tracked files of the checkout (git ls-files) plus its built extension
(torch_qmm/_C*.so), so the real checkout is never touched. Each of the `jobs` workers reuses one
scratch directory at a fixed path (its slot, refreshed from the checkout for every mutant): metalsim
caches its builds by the preprocessed source, whose line markers name the file's path, so at a
fixed path the kernels a mutant does not touch are built once per slot and then found in the
cache, while a mutated source hashes differently and is always built afresh. The C++ mutants
share one scratch copy, also at a fixed path and kept between runs, so its build directory
survives: built from source (setup.py build_ext --inplace) on first use, then each mutant is
applied, rebuilt incrementally, tested and reverted.

pytest runs with -x (a killed mutant stops at its first failing test) and without the cache
provider. A mutant is killed when its tests fail (pytest exit status 1); survived when they pass;
timeout when its tests ran past the limit below (not a kill: nothing failed); crashed when the
test process dies (found, but not by an assertion: make the test run the call in a subprocess);
an error when the patch no longer applies (the text it replaces is gone or not unique) or pytest
could not run, which the harness reports as a failure too, so the list cannot go stale silently. The killing tests are output assertions (numeric, bitwise, route, error
message or metalsim's checked mode), never timing or traffic bounds.

The time limit per mutant is a CPU-time budget (the pytest process and all its descendants, from
/proc), not a wall-clock one: on a shared machine the wall time of the same tests grows with the
load while their CPU time does not, so a limit in CPU seconds holds under load. A wall-clock cap
of WALL_FACTOR times the budget (or the `wall` seconds given: on a machine so loaded that a CPU
second takes many wall seconds) still stops tests that hang without using the CPU. Where /proc is
missing the budget is applied to wall time. The tests run in a session of their own (a limit stops
everything they started), which on Linux is also a new autogroup: it gets the caller's autogroup
nice value, so that a harness started at low priority stays there.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import queue
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
    status: str  # killed | survived | timeout | crashed | error
    killed_by: str = ""
    how: str = ""  # the exception the killing test raised (AssertionError, ValueError, KernelFault, ...)
    seconds: float = 0.0  # wall clock, the scratch copy included
    detail: str = ""
    cpu_seconds: float | None = None  # of the tests (pytest and its descendants; None without /proc)


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


# The wall-clock cap is this many times the CPU budget (for tests that hang without using the CPU).
WALL_FACTOR = 8
_PROC = Path("/proc")


def _cpu_seconds(root_pid: int) -> float | None:
    """CPU seconds used so far by process root_pid and its descendants: user + system time of the
    live ones plus what their finished children used (the c* fields). None without /proc."""
    if not (_PROC / "self" / "stat").is_file():
        return None
    parent, ticks = {}, {}
    for d in _PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # after the command: state, ppid, ... utime stime cutime cstime are fields 14-17 of stat(5)
        parent[int(d.name)] = int(fields[1])
        ticks[int(d.name)] = sum(int(f) for f in fields[11:15])
    total, todo, seen = 0, [root_pid], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in ticks:
            continue
        seen.add(pid)
        total += ticks[pid]
        todo.extend(c for c, pp in parent.items() if pp == pid)
    return total / os.sysconf("SC_CLK_TCK")


def _autogroup_nice() -> str | None:
    """The nice value of this process's autogroup (Linux /proc/self/autogroup: "/autogroup-N nice V"),
    or None where there is none."""
    try:
        return (_PROC / "self" / "autogroup").read_text().split()[-1]
    except (OSError, IndexError):
        return None


def _session_at(nice: str | None):
    """A preexec_fn giving the child's new session (and so its new autogroup, which starts at nice
    0) the caller's autogroup nice value: on a shared machine the tests yield the CPU as the caller does."""
    def set_nice() -> None:
        if nice is not None:
            try:
                with open("/proc/self/autogroup", "w") as f:
                    f.write(nice)
            except OSError:
                pass
    return set_nice


def _run_limited(cmd: list[str], tree: Path, env: dict, budget: float,
                 wall_limit: float | None = None) -> tuple[int | None, str, str, float | None]:
    """Runs cmd; (exit status, or None when it used more than `budget` CPU seconds or ran past
    WALL_FACTOR * budget wall seconds; the limit's description; output; CPU seconds used)."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, preexec_fn=_session_at(_autogroup_nice()))
        t0 = time.monotonic()
        limit, cpu, status = "", None, None
        while status is None:
            for _ in range(10):  # reaped here (wait4), so that its own resource usage is known
                pid, wstatus, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    status = os.waitstatus_to_exitcode(wstatus)
                    cpu = usage.ru_utime + usage.ru_stime
                    p.returncode = status  # Popen must not wait for it again
                    break
                time.sleep(0.5)
            if status is not None:
                break
            cpu = _cpu_seconds(p.pid)
            wall = time.monotonic() - t0
            if cpu is not None and cpu > budget:
                limit = f"used more than {budget:.0f} CPU seconds ({wall:.0f} s wall)"
            elif wall > (wall_limit or (budget if cpu is None else WALL_FACTOR * budget)):
                limit = f"did not finish in {wall:.0f} s wall" + ("" if cpu is None else f" ({cpu:.0f} CPU s)")
            if limit:
                os.killpg(p.pid, 9)  # its own session: pytest and what it started
                p.wait()
                break
        out.seek(0)
        return (None if limit else status), limit, out.read(), cpu


def _pytest(mutant: Mutant, tree: Path, env: dict, timeout: float, start: float, wall: float | None = None) -> Result:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
           *mutant.tests]
    returncode, limit, out, cpu = _run_limited(cmd, tree, env, timeout, wall)
    r = _classify(mutant, returncode, limit, out, start)
    r.cpu_seconds = cpu
    return r


def _classify(mutant: Mutant, returncode: int | None, limit: str, out: str, start: float) -> Result:
    if returncode is None:  # stopped by the limit: not a kill, nothing failed
        return Result(mutant, "timeout", detail=f"the tests {limit}", seconds=time.monotonic() - start)
    p = subprocess.CompletedProcess([], returncode)
    if p.returncode == 0:
        return Result(mutant, "survived", seconds=time.monotonic() - start)
    if p.returncode == 1:
        # only what the tests raised ("E   NameError: ..."), not an expected exception a test names
        # ("Failed: DID NOT RAISE <class '...CompileError'>")
        raised = "\n".join(line for line in out.splitlines()
                           if line.startswith("E ") and "DID NOT RAISE" not in line)
        broken = _BROKEN.search(raised)
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


def slot_dir(slot: int | str) -> Path:
    """The fixed scratch directory of one worker (see the module's docstring)."""
    return Path(tempfile.gettempdir()) / f"qmm-mutant-slot-{slot}"


def _refresh(root: Path, dest: Path, with_extension: bool) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    scratch_copy(root, dest, with_extension)


def run_one(mutant: Mutant, root: Path = ROOT, timeout: float = 900, keep: bool = False,
            slot: int | str | None = None, wall: float | None = None) -> Result:
    """A Metal or Python mutant in a scratch copy (with the checkout's built extension): the slot's
    fixed directory when a slot is given, else a fresh temporary one."""
    start = time.monotonic()
    if slot is None:
        tmp = Path(tempfile.mkdtemp(prefix=f"qmm-mutant-{mutant.name}-"))
        scratch_copy(root, tmp, with_extension=True)
    else:
        tmp = slot_dir(slot)
        _refresh(root, tmp, with_extension=True)
    try:
        try:
            apply(mutant, tmp)
        except ValueError as e:
            return Result(mutant, "error", detail=str(e), seconds=time.monotonic() - start)
        return _pytest(mutant, tmp, _env(), timeout, start, wall)
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        elif slot is None:
            shutil.rmtree(tmp, ignore_errors=True)


def _sync(root: Path, dest: Path) -> None:
    """dest's tracked files made equal to the checkout's, touching only those that differ (so the
    build directory's timestamps stay valid and ninja rebuilds only what changed)."""
    for rel in _tracked_files(root):
        src, dst = root / rel, dest / rel
        if not src.is_file():
            continue
        if dst.is_file() and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)  # a new mtime: ninja rebuilds what depends on it


def run_cpp(mutants: list[Mutant], root: Path = ROOT, timeout: float = 900, keep: bool = False,
            on_result=None, wall: float | None = None) -> list[Result]:
    """C++ mutants one after another in one scratch copy: built once in full, then each mutant is
    applied, rebuilt incrementally, tested and reverted."""
    env = _env()
    tmp = slot_dir("cpp")
    results = []
    try:
        _sync(root, tmp)
        b = _build(tmp, env, timeout * 8)
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
                        r = _pytest(m, tmp, env, timeout, start, wall)
                finally:
                    path.write_text(original)
            results.append(r)
            if on_result is not None:
                on_result(r)
        return results
    finally:
        print(f"the C++ scratch copy stays in {tmp} (its build directory is reused next time)", file=sys.stderr)


def run(mutants: list[Mutant], jobs: int = 1, root: Path = ROOT, timeout: float = 900, keep: bool = False,
        on_result=None, wall: float | None = None) -> list[Result]:
    """Every mutant: the fast ones `jobs` at a time (one slot directory each), then the C++ ones
    (run_cpp). Results in list order."""
    slots: queue.Queue = queue.Queue()
    locks = []  # held while this run uses the slots (another run at the same time takes others)
    i = 0
    while len(locks) < max(1, jobs):
        f = open(Path(tempfile.gettempdir()) / f"qmm-mutant-slot-{i}.lock", "w")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
        else:
            locks.append(f)
            slots.put(i)
        i += 1

    def one(m):
        slot = slots.get()
        try:
            r = run_one(m, root, timeout, keep, slot=slot, wall=wall)
        finally:
            slots.put(slot)
        if on_result is not None:
            on_result(r)
        return r

    fast = [m for m in mutants if not m.needs_build]
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            done = dict(zip(fast, pool.map(one, fast)))
    finally:
        for f in locks:
            f.close()
    cpp = [m for m in mutants if m.needs_build]
    if cpp:
        done.update(zip(cpp, run_cpp(cpp, root, timeout, keep, on_result, wall)))
    return [done[m] for m in mutants]


def table(results: list[Result]) -> str:
    rows = ["| mutant | area | file | result | killed by | raised | s | CPU s |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cpu = "" if r.cpu_seconds is None else f"{r.cpu_seconds:.0f}"
        rows.append(f"| {r.mutant.name} | {r.mutant.area} | {r.mutant.file} | {r.status} | {r.killed_by} | {r.how} "
                    f"| {r.seconds:.0f} | {cpu} |")
    killed = sum(r.status == "killed" for r in results)
    finished = sum(r.status in ("killed", "survived") for r in results)
    rate = f" ({100 * killed / finished:.0f}% of the {finished} that finished)" if finished else ""
    others = {s: sum(r.status == s for r in results) for s in ("timeout", "crashed", "error")}
    rows.append(f"\n{killed} of {len(results)} killed{rate}; "
                + ", ".join(f"{n} {s}" for s, n in others.items()) + " (none of them counted as killed)")
    return "\n".join(rows)
