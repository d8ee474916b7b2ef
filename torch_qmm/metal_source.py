"""The Metal source of one kernel, as both executors compile it on first use.

A library file of metal/ (quant.metal, gguf.metal) is `#include`s of headers plus instantiation
macros: a cell macro (QUANT_INSTANTIATE_CELL in quant_kernels.h, GGUF_INSTANTIATE_CELL in
gguf.metal) writes one `KERNEL_INSTANTIATE(name, func, ...)` line per kernel. Compiling a whole
library compiles every instantiation (hundreds of kernels); a call needs one. So a kernel's source is

    prelude(library)  +  "\\n"  +  its one instantiation line  +  "\\n"

where the prelude is the library's headers flattened into one text (newLibraryWithSource cannot
open our headers; each header once, `#pragma once` dropped) and the line is read from the
library's own macros: this module expands them (function-like macros, `#`, `##`) down to the
calls whose body instantiates a `[[kernel]]`, so the kernel table exists only in metal/. The
kernel names come out of the same macros (KERNEL_NAME in metal/kernel_names.h, the spelling
plan.cpp's kernel_name() follows; tests check the planner's names against these and the macros'
expansion against clang's).

csrc/mps/embed_metal.py writes the preludes and lines into the MPS build (metal_executor.mm
concatenates them the same way); torch_qmm/metalsim_backend.py compiles kernel_source(name) with
metalsim, so CI runs the exact text a Mac compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

# The library files, in the order the MPS build embeds them.
LIBRARIES = ("quant.metal", "gguf.metal")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*(//.*)?$')  # a trailing // comment is allowed
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)\(([^)]*)\)\s?(.*)$", re.S)
_IDENT = re.compile(r"[A-Za-z_]\w*")


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str  # host name ([[host_name]])
    library: str  # one of LIBRARIES
    line: str  # the instantiation line, in the library's own macros


def metal_dir() -> Path:
    """metal/: package data next to this file when installed (torch_qmm/metal), else the checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "metal", here.parent / "metal"):
        if (candidate / LIBRARIES[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"torch_qmm: metal/{LIBRARIES[0]} not found next to {here} (package data missing from the install?)"
    )


def _flatten(path: Path, seen: set, out: list) -> None:
    for line in path.read_text().splitlines():
        m = _INCLUDE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc not in seen:
                seen.add(inc)
                out.append(f"// ---- {inc.name} ----")
                _flatten(inc, seen, out)
        elif line.strip() != "#pragma once":
            out.append(line)


def _headers(library: str, directory: Path) -> list[Path]:
    """The headers a library file includes directly, in order."""
    found = []
    for line in (directory / library).read_text().splitlines():
        m = _INCLUDE.match(line)
        if m:
            found.append((directory / m.group(1)).resolve())
    return found


@functools.lru_cache(maxsize=None)
def prelude(library: str, directory: Path | None = None) -> str:
    """The headers of `library` flattened into one source (no instantiation in it)."""
    directory = directory or metal_dir()
    seen: set = set()
    out: list = [f"// torch_qmm: headers of metal/{library}"]
    for header in _headers(library, directory):
        if header not in seen:
            seen.add(header)
            out.append(f"// ---- {header.name} ----")
            _flatten(header, seen, out)
    return "\n".join(out) + "\n"


def flatten_libraries(libraries=LIBRARIES, directory: Path | None = None) -> str:
    """The library files with their headers inlined, each header once: one source holding every
    instantiation (what a single newLibraryWithSource of all of metal/ compiles)."""
    directory = directory or metal_dir()
    seen: set = set()
    out: list = []
    for library in libraries:
        _flatten(directory / library, seen, out)
    return "\n".join(out) + "\n"


# ---- the macro expansion (enough of C's rules for instantiation macros) ---------------------------

def _logical_lines(text: str) -> list[str]:
    text = re.sub(r"//[^\n]*", "", text.replace("\\\n", " "))
    return text.splitlines()


def _macros(paths) -> dict:
    """name -> (parameters, body) of every function-like #define in the files."""
    macros = {}
    for path in paths:
        for line in _logical_lines(path.read_text()):
            m = _DEFINE.match(line)
            if m:
                params = [p.strip() for p in m.group(2).split(",")] if m.group(2).strip() else []
                macros[m.group(1)] = (params, m.group(3).strip())
    return macros


def _call_args(text: str, open_paren: int) -> tuple[list[str], int]:
    """The top-level comma-separated arguments of the call whose '(' is at open_paren, and the
    index after its ')'."""
    depth, args, start = 0, [], open_paren + 1
    for i in range(open_paren, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
    raise ValueError(f"unbalanced macro call in {text!r}")


def _substitute(params: list[str], body: str, args: list[str], expand) -> str:
    variadic = params and params[-1] == "..."
    names = params[:-1] if variadic else params
    values = dict(zip(names, args))
    if variadic:
        values["__VA_ARGS__"] = ", ".join(args[len(names):])
    # Operands of # and ## take the argument as written; every other use, macro-expanded.
    out = re.sub(r"(?<!#)#\s*(\w+)", lambda m: '"' + values.get(m.group(1), m.group(1)) + '"'
                 if m.group(1) in values else m.group(0), body)
    pasted = set()
    for m in re.finditer(r"(\w+)\s*##|##\s*(\w+)", out):
        pasted.add(m.group(1) or m.group(2))
    out = _IDENT.sub(lambda m: m.group(0) if m.group(0) not in values else
                     (values[m.group(0)] if m.group(0) in pasted else expand(values[m.group(0)])), out)
    return re.sub(r"\s*##\s*", "", out)


def _expand(text: str, macros: dict, leaves: list | None) -> str:
    """text with its macro calls expanded; a call of a macro whose body instantiates a
    [[kernel]] is appended to `leaves` as written (and dropped from the result) when leaves is
    a list, expanded otherwise."""
    out, pos = [], 0
    while True:
        m = _IDENT.search(text, pos)
        if m is None:
            out.append(text[pos:])
            return "".join(out)
        name, end = m.group(0), m.end()
        rest = text[end:]
        if name not in macros or not rest.lstrip().startswith("("):
            out.append(text[pos:end])
            pos = end
            continue
        open_paren = end + len(rest) - len(rest.lstrip())
        args, after = _call_args(text, open_paren)
        out.append(text[pos:m.start()])
        params, body = macros[name]
        if leaves is not None and "[[kernel]]" in body:
            leaves.append(text[m.start():after])
        else:
            sub = _substitute(params, body, args, lambda a: _expand(a, macros, None))
            out.append(_expand(sub, macros, leaves))
        pos = after


@functools.lru_cache(maxsize=None)
def kernels(directory: Path | None = None) -> dict[str, Kernel]:
    """Every kernel of every library: host name -> Kernel (in instantiation order)."""
    directory = directory or metal_dir()
    table: dict[str, Kernel] = {}
    for library in LIBRARIES:
        seen: set = set()
        out: list = []
        _flatten(directory / library, seen, out)  # only to learn which headers it reads
        macros = _macros([directory / library] + sorted(seen))
        body = "\n".join(line for line in _logical_lines((directory / library).read_text())
                         if not line.lstrip().startswith("#"))
        leaves: list = []
        _expand(body, macros, leaves)
        for line in leaves:
            args, _ = _call_args(line, line.index("("))
            name = _expand(args[0], macros, None).strip()
            if not (name.startswith('"') and name.endswith('"')):
                raise ValueError(f"metal/{library}: the name of {line!r} does not expand to a string: {name}")
            name = name[1:-1]
            if name in table:
                raise ValueError(f"metal/{library}: kernel {name} is instantiated twice")
            table[name] = Kernel(name, library, line)
    return table


def kernel_source(name: str) -> str:
    """The source that compiles exactly kernel `name` (prelude + its instantiation line)."""
    k = kernels().get(name)
    if k is None:
        raise KeyError(f"torch_qmm: no Metal kernel named {name!r} in metal/{' or metal/'.join(LIBRARIES)}")
    return prelude(k.library) + "\n" + k.line + "\n"
