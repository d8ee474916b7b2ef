"""Make every device/threadgroup access of the instrumented build visible to the runtime's hooks.

clang's `-fsanitize-coverage=trace-loads,trace-stores` calls `__sanitizer_cov_load{1,2,4,8,16}` /
`__sanitizer_cov_store*` before plain IR loads and stores of exactly those sizes, and nothing else.
Two kinds of access slip past it, and checked mode then reports false faults (a threadgroup
array zero-filled by a loop that clang turned into `memset` reads as uninitialised) or misses
real ones (an out-of-bounds `memcpy`, a struct copied from a device buffer), and the byte
counters come out short:

* memory intrinsics `llvm.memcpy/memmove/memset`: clang emits them for struct and array copies
  and zero-initialisation; the backend then expands them inline or calls libc, both unseen.
  They are rewritten here into calls to the runtime's `__msim_memcpy/memmove/memset`
  (runtime.c), which trace the source and destination ranges, then do the operation.
* loads/stores of other sizes (`<8 x float>` is 32 bytes, `<3 x float>` 12): a call to
  `__msim_trace` is inserted before each.

Compiler-made versions of these (loop idiom recognition, store merging into memset, the loop and
SLP vectorizers) are switched off in the instrumented build instead (see _build.INSTR), so the
traced accesses are the ones the kernel source asks for, element by element.
"""
from __future__ import annotations

import re

_MEM = re.compile(r"@llvm\.(memcpy|memmove|memset)(\.inline)?\.([\w.]+)\(")
_DECLS = """
declare void @__msim_memcpy(ptr, ptr, i64)
declare void @__msim_memmove(ptr, ptr, i64)
declare void @__msim_memset(ptr, i8, i64)
declare void @__msim_trace(ptr, i64, i32)
"""
_SCALAR = {"half": 2, "bfloat": 2, "float": 4, "double": 8, "ptr": 8, "x86_fp80": 16, "fp128": 16}
_TRACED_BY_SANCOV = {1, 2, 4, 8, 16}
_LOAD = re.compile(r"^(\s*)%[-\w.$]+ = load (?:volatile )?(<\d+ x \w+>|i\d+|\w+), ptr (%[-\w.$]+)")
_STORE = re.compile(r"^(\s*)store (?:volatile )?(<\d+ x \w+>|i\d+|\w+) .*?, ptr (%[-\w.$]+)")


class UnsupportedIR(RuntimeError):
    """The instrumented build holds a memory operation the hooks cannot trace."""


def _size(ty: str):
    """Store size in bytes of an IR first-class type, or None when it is not one we trace."""
    m = re.fullmatch(r"<(\d+) x (\w+)>", ty)
    if m:
        elem = _size(m.group(2))
        return None if elem is None or m.group(2) == "i1" else int(m.group(1)) * elem
    m = re.fullmatch(r"i(\d+)", ty)
    if m:
        return (int(m.group(1)) + 7) // 8
    return _SCALAR.get(ty)


def _rewrite_mem_call(line: str) -> str:
    m = _MEM.search(line)
    kind, overload = m.group(1), m.group(3)
    # Only the generic address space with 64-bit lengths exists on x86-64 (device/threadgroup
    # pointers lower to address space 0); anything else must fail loudly, not go untraced.
    expect = "p0.i64" if kind == "memset" else "p0.p0.i64"
    if overload != expect:
        raise UnsupportedIR(f"cannot trace @llvm.{kind}.{overload}: {line.strip()}")
    start = m.end()
    close = line.rindex(")")
    args = line[start:close]
    # drop the trailing `i1 <isvolatile>` immediate: the hooks take (dst, src|value, length)
    args = re.sub(r",\s*i1 (?:immarg )?(?:true|false)\s*$", "", args)
    return line[:m.start()] + f"@__msim_{kind}(" + args + line[close:]


def rewrite(ir: str) -> str:
    """Returns the module text with memory intrinsics routed to the runtime and odd-sized
    loads/stores preceded by a trace call (see the module docstring)."""
    out = []
    for line in ir.splitlines():
        if line.startswith("declare") or "@llvm.mem" not in line:
            m = _LOAD.match(line) or _STORE.match(line)
            if m and " atomic " not in line:
                n = _size(m.group(2))
                if n is not None and n not in _TRACED_BY_SANCOV:
                    store = 1 if _STORE.match(line) else 0
                    out.append(f"{m.group(1)}call void @__msim_trace(ptr {m.group(3)}, i64 {n}, i32 {store})")
            out.append(line)
            continue
        if _MEM.search(line) and re.search(r"\bcall\b", line):
            line = _rewrite_mem_call(line)
        out.append(line)
    text = "\n".join(out) + "\n" + _DECLS
    left = [ln.strip() for ln in text.splitlines() if _MEM.search(ln) and not ln.startswith("declare")]
    if left:
        raise UnsupportedIR(f"untraceable memory intrinsic left in the instrumented build: {left[0]}")
    return text
