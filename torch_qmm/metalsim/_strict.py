"""Strictness: constructs Apple's Metal compiler rejects are rejected here too, with a message.

Two mechanisms, each used where it can tell exactly:

* clang diagnostics (compile flags below; the shim builds with -fno-rtti, so `typeid` and
  `dynamic_cast` are clang errors; -fno-exceptions does not reject `try`/`throw` in clang's
  SYCL device mode, so those are keyword rules below): implicit
  conversions to bfloat arrive as clang's -Wimplicit-float-conversion /
  -Wimplicit-int-float-conversion warnings, and those whose destination is bfloat in user
  code become errors (MSL: bfloat converts implicitly only to a type of greater rank).
  Implicit float -> half stays legal, as in MSL.
* keywords of C++ that MSL removes (`goto`, `virtual`, `new`, `delete` expressions,
  `double`, `try`, `catch`, `throw`): checked on the tokens of the preprocessed user source. They are keywords, so a
  token match is exact (no identifier can be spelled like them).

README.md (section "Strictness") lists the rules; tests/metalsim/test_metalsim_strict.py has
one test per rule.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from . import _staging

FLAGS = ["-Wimplicit-float-conversion", "-Wimplicit-int-float-conversion"]
INCLUDE = Path(__file__).resolve().parent / "include"

# clang's text for the conversions that MSL forbids; the destination is the quoted type after "to"
_BFLOAT_CONV = re.compile(r"implicit conversion (?:loses floating-point precision: |from )'([^']+)'"
                          r"(?: \(aka '[^']+'\))? to '(bfloat|__bf16|bfloat16_t)'")
_DIAG = re.compile(r"^(?P<loc>[^\s:][^:]*:\d+:\d+): (?P<kind>warning|error): (?P<msg>.*)$", re.M)

KEYWORD_RULES = {
    "goto": "goto is not supported by the Metal Shading Language",
    "virtual": "virtual functions are not supported by the Metal Shading Language",
    "new": "dynamic allocation (new) is not supported by the Metal Shading Language",
    "delete": "dynamic allocation (delete) is not supported by the Metal Shading Language",
    "double": "double is not supported by the Metal Shading Language (use float)",
    "try": "exceptions (try) are not supported by the Metal Shading Language",
    "catch": "exceptions (catch) are not supported by the Metal Shading Language",
    "throw": "exceptions (throw) are not supported by the Metal Shading Language",
}


def run(cmd, what):
    """Run a clang compile of staged user code; its errors, and warnings that are errors in
    MSL, raise CompileError (imported lazily to keep one definition in _build)."""
    from ._build import CompileError

    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip()}\n(command: {' '.join(cmd)})")
    bad = []
    for m in _DIAG.finditer(r.stderr):
        if m.group("kind") != "warning" or str(INCLUDE) in m.group("loc"):
            continue
        c = _BFLOAT_CONV.search(m.group("msg"))
        if c:
            bad.append(f"{m.group('loc')}: error: implicit conversion from '{c.group(1)}' to bfloat: "
                       f"Metal converts to bfloat only explicitly (write static_cast<bfloat>(...))")
    if bad:
        raise CompileError(f"{what} failed (metalsim strictness: Apple's compiler rejects this):\n"
                           + "\n".join(bad) + "\n\nclang's diagnostics:\n" + r.stderr.strip())
    return r.stdout


def check_tokens(pre: str) -> None:
    """Reject MSL-removed keywords in preprocessed user code (`pre`, with clang's line markers)."""
    from ._build import CompileError

    toks = _staging.tokenize(pre)
    bad = []
    for i, t in enumerate(toks):
        if t.kind != "id" or t.text not in KEYWORD_RULES:
            continue
        prev = toks[i - 1].text if i else ""
        if t.text in ("new", "delete") and prev == "operator":
            pass  # `operator new` declarations are allocation too
        elif t.text == "delete" and prev == "=":
            continue  # a deleted function, not a delete expression
        bad.append(f"{_location(pre, t.start)}: error: {KEYWORD_RULES[t.text]}")
    if bad:
        raise CompileError("metalsim strictness: Apple's compiler rejects this:\n" + "\n".join(bad[:20]))


_LINEMARK = re.compile(r'^#\s*(\d+)\s+"([^"]*)"', re.M)


def _location(pre: str, offset: int) -> str:
    """file:line of a character offset of `clang -E` output, from its line markers."""
    last = None
    for m in _LINEMARK.finditer(pre, 0, offset):
        last = m
    if last is None:
        return f"<source>:{pre.count(chr(10), 0, offset) + 1}"
    line = int(last.group(1)) + pre.count("\n", last.end(), offset) - 1
    return f"{last.group(2)}:{line}"
