"""Strictness: constructs Apple's Metal compiler rejects are rejected here too, with a message.

Two mechanisms, each used where it can tell exactly:

* clang diagnostics (compile flags below; the shim builds with -fno-rtti, so `typeid` and
  `dynamic_cast` are clang errors; -fno-exceptions does not reject `try`/`throw` in clang's
  SYCL device mode, so those are keyword rules below): implicit float -> bfloat
  conversions arrive as clang's -Wimplicit-float-conversion warnings, and those whose
  destination is bfloat in user code become errors (MSL: "neither float nor half can be
  implicitly converted to bfloat"; half -> bfloat is a clang error already). Implicit
  float -> half and int -> bfloat stay legal: the rule names float and half only.
* a bfloat declared with a float constant as initialiser (`bfloat b = 0.5f;`) or a float
  constant returned from a function returning bfloat (`return 0.5f;`), on the same tokens:
  clang does not warn for constants bfloat represents exactly.
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

FLAGS = ["-Wimplicit-float-conversion"]
INCLUDE = Path(__file__).resolve().parent / "include"

# clang's text for the conversions that MSL forbids; the destination is the quoted type after "to"
_BFLOAT_CONV = re.compile(r"implicit conversion (?:loses floating-point precision: |from )'([^']+)'"
                          r"(?: \(aka '[^']+'\))? to '(bfloat|__bf16|bfloat16_t)'")
# an integer source converts implicitly (the specification's rule names float and half only)
_FLOATING_SOURCE = re.compile(r"float|half|_Float16|bf16|double")
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
        if c and _FLOATING_SOURCE.search(c.group(1)):
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
    bad = [f"{_location(pre, toks[i].start)}: error: {BFLOAT_CONSTANT}"
           for i in sorted(set(_bfloat_constant_inits(toks)) | set(_bfloat_constant_returns(toks)))]
    for i, t in enumerate(toks):
        if t.kind != "id" or t.text not in KEYWORD_RULES:
            continue
        prev = toks[i - 1].text if i else ""
        if t.text in ("new", "delete") and prev == "operator":
            pass  # `operator new` declarations are allocation too
        elif t.text == "delete" and prev == "=":
            continue  # a deleted function, not a delete expression
        bad.append(f"{_location(pre, t.start)}: error: {KEYWORD_RULES[t.text]}")
    bad += [f"{_location(pre, toks[i].start)}: error: {PROGRAM_SCOPE}" for i in _program_scope_variables(toks)]
    if bad:
        raise CompileError("metalsim strictness: Apple's compiler rejects this:\n" + "\n".join(bad[:20]))


PROGRAM_SCOPE = ("a variable at program scope in the device or threadgroup address space: variables in program "
                 "scope must be declared in the constant address space (threadgroup memory is declared in a "
                 "kernel, or passed as a [[threadgroup(n)]] argument)")
_DECL_START = {";", "{", "}", "static", "extern", "volatile", "const", "inline"}


def _program_scope_variables(toks):
    """Token indices of `device` / `threadgroup` starting a variable declaration at namespace
    scope (outside every function and class body): `threadgroup float buf[64];`. A declaration
    whose first top-level `(` comes before its `;`, `=`, `[` or `{` is a function (its return
    type may be a pointer into an address space) and is not matched."""
    stack = []  # True for a namespace (or extern "C") brace
    parens = 0  # parameter lists and other parentheses
    n = len(toks)
    for i, t in enumerate(toks):
        if t.kind == "pp":
            continue
        if t.text == "(":
            parens += 1
        elif t.text == ")":
            parens = max(parens - 1, 0)
        elif t.text == "{":
            prev = toks[i - 1] if i else None
            ns = prev is not None and (prev.text == "namespace" or (i >= 2 and toks[i - 2].text == "namespace")
                                       or (prev.kind == "str" and i >= 2 and toks[i - 2].text == "extern"))
            stack.append(ns)
        elif t.text == "}":
            if stack:
                stack.pop()
        elif t.text in ("device", "threadgroup") and parens == 0 and all(stack):
            prev = toks[i - 1] if i else None
            if prev is not None and prev.kind != "pp" and prev.text not in _DECL_START:
                continue
            depth = 0
            for k in range(i + 1, n):
                x = toks[k].text
                if x == "<":
                    depth += 1
                elif x == ">" and depth:
                    depth -= 1
                elif depth == 0 and x in ("(", ";", "=", "[", "{"):
                    if x != "(" and x != "{":
                        yield i
                    break


BFLOAT_CONSTANT = ("implicit conversion of a float constant to bfloat: Metal converts float to bfloat only "
                   "explicitly (write bfloat(...) or static_cast<bfloat>(...))")
_FLOAT_LITERAL = re.compile(r"(?i)(?:\d+\.\d*|\.\d+|\d+(?=e))(?:e[+-]?\d+)?f?|\d+f|0x[0-9a-f.]*p[+-]?\d+f?")
_DECL_BEFORE = {";", "{", "}", "(", ",", "const", "constexpr", "static", "thread", "volatile"}


def _bfloat_constant_inits(toks):
    """Token indices of `bfloat name = <float literal>` (`;`, `,` or `)` after it): a
    copy-initialisation of a bfloat from a float constant. clang's conversion warnings skip
    constants that bfloat represents exactly, so this exact form is matched on tokens; other
    float constants converted implicitly to bfloat (`b = 0.5f;` to a declared variable,
    `f(0.5f)`) pass."""
    n = len(toks)
    for i in range(n - 3):
        if toks[i].text != "bfloat" or (i and toks[i - 1].text not in _DECL_BEFORE and toks[i - 1].kind != "pp"):
            continue
        if toks[i + 1].kind != "id" or toks[i + 2].text != "=":
            continue
        k = i + 3
        if toks[k].text in ("-", "+") and k + 1 < n:
            k += 1
        if toks[k].kind == "num" and _FLOAT_LITERAL.fullmatch(toks[k].text) and k + 1 < n \
                and toks[k + 1].text in (";", ",", ")"):
            yield k


def _is_float_constant(toks, k):
    """toks[k:] starts with a float literal, optionally signed, then `;`: its index, else None."""
    if k < len(toks) and toks[k].text in ("-", "+"):
        k += 1
    if k + 1 < len(toks) and toks[k].kind == "num" and _FLOAT_LITERAL.fullmatch(toks[k].text) \
            and toks[k + 1].text == ";":
        return k
    return None


def _bfloat_constant_returns(toks):
    """Token indices of `return <float literal>;` in the body of a function whose return type is
    `bfloat` (`bfloat f(...) {`): the returned float converts implicitly to bfloat. Braces of a
    class or lambda inside the body are skipped (their returns are not the function's)."""
    n = len(toks)
    for i in range(n - 3):
        if toks[i].text != "bfloat" or toks[i + 1].kind != "id" or toks[i + 2].text != "(":
            continue
        if i and toks[i - 1].text in ("::", ".", "->", "<", ",", "(") or toks[i - 1].text == "operator":
            continue
        try:
            j = _staging._match(toks, i + 2, "(", ")") + 1
        except _staging.StageError:
            continue
        while j < n and toks[j].text in ("const", "noexcept") + _staging.ADDRSPACES:
            j += 1
        if j >= n or toks[j].text != "{":
            continue
        end = _staging._match(toks, j, "{", "}")
        k = j + 1
        while k < end:
            t = toks[k].text
            if t == "{" and _foreign_brace(toks, k):
                k = _staging._match(toks, k, "{", "}") + 1
                continue
            if t == "return":
                lit = _is_float_constant(toks, k + 1)
                if lit is not None:
                    yield lit
            k += 1


def _foreign_brace(toks, k):
    """The `{` at toks[k] opens a class body or a lambda body (not a block of the function)."""
    prev = toks[k - 1].text
    if prev == "]":
        return True
    if prev == ")":
        try:
            o = next(m for m in range(k - 1, -1, -1)
                     if toks[m].text == "(" and _staging._match(toks, m, "(", ")") == k - 1)
        except (StopIteration, _staging.StageError):
            return False
        return o > 0 and toks[o - 1].text == "]"
    m = k - 1
    while m > 0 and toks[m].text not in (";", "{", "}"):
        if toks[m].text in ("struct", "class", "union", "->"):
            return True
        m -= 1
    return False


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


# ---- rules checked on the optimised LLVM IR of a build (every build: plain and instrumented) ----
_DEFINE = re.compile(r"^define\b[^@]*@(\"[^\"]+\"|[-\w.$]+)\(")
_CALL = re.compile(r"\b(?:call|invoke)\b(?!\s+void\s+asm)(?:[^@%;]|%\w+\s*\*|\([^()]*\))*?([@%](?:\"[^\"]+\"|[-\w.$]+))\(")
ENTRY_PREFIX = "__msim_entry_"


def _demangle(names):
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60)
        out = r.stdout.splitlines()
        if r.returncode == 0 and len(out) == len(names):
            return dict(zip(names, out))
    except (OSError, subprocess.SubprocessError):
        pass
    return {n: n for n in names}


def check_ir(ir: str) -> None:
    """Reject calls through function pointers in the functions the kernels of a build reach
    (its optimised IR): MSL calls functions through pointers only when they are [[visible]]
    functions (visible function tables, which metalsim does not support). A function pointer
    the optimizer resolves to its target (a template argument, a constant) is a direct call,
    as it is for Apple's compiler. Recursive calls are allowed, as Apple's compiler allows them
    (metalsim/README.md, Strictness)."""
    from ._build import CompileError

    calls, indirect, cur = {}, {}, None
    for line in ir.splitlines():
        m = _DEFINE.match(line)
        if m:
            cur = m.group(1).strip('"')
            calls[cur], indirect[cur] = set(), False
            continue
        if cur is None:
            continue
        if line.startswith("}"):
            cur = None
            continue
        for c in _CALL.finditer(line):
            target = c.group(1)
            if target.startswith("%"):
                indirect[cur] = True
            elif not target.startswith("@llvm."):
                calls[cur].add(target[1:].strip('"'))
    reach, todo = set(), [f for f in calls if f.startswith(ENTRY_PREFIX)]
    while todo:
        f = todo.pop()
        if f in reach:
            continue
        reach.add(f)
        todo.extend(g for g in calls[f] if g in calls)
    # the shim calls the kernel function through a pointer when not optimised (-O0)
    bad_ptr = sorted(f for f in reach if indirect[f] and "__msim_invoke" not in f)
    if not bad_ptr:
        return
    names = _demangle(bad_ptr)
    msgs = [f"error: a call through a function pointer in {names[f]}: the Metal Shading Language calls "
            f"functions through pointers only when they are [[visible]] functions (visible function "
            f"tables), which metalsim does not support" for f in bad_ptr]
    raise CompileError("metalsim strictness: Apple's compiler rejects this:\n" + "\n".join(msgs[:20]))
