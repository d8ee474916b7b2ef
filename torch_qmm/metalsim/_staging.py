"""Source staging: turn preprocessed MSL into C++ that the metal_stdlib shim can compile.

The input is the output of ``clang -E`` run with empty stand-ins for <metal_stdlib> (so user
macros such as MLX's ``instantiate_kernel`` are expanded but the shim is not).  Rewrites, all
on a copy (the user's source stays valid MSL):

* Metal attributes ``[[...]]`` are recorded and blanked.
* Kernels (``kernel void f(...)``, ``[[kernel]] void f(...)``, and template instantiations
  ``template [[host_name("x")]] [[kernel]] decltype(f<...>) f<...>;``) get a C entry point
  that builds their arguments from ``[[buffer(n)]]`` / ``[[threadgroup(n)]]`` / builtin
  attributes.
* ``threadgroup T x[N];`` inside a function body becomes a reference into the threadgroup arena.
* ``constant T x [[function_constant(i)]];`` becomes a runtime-read constant; namespace-scope
  constants initialised from function constants are evaluated lazily.
* Unsuffixed floating literals get an ``f`` (MSL has no double); ``1.0h`` becomes a half,
  ``1.0bf`` the bfloat of that value.
* Vector constructors and casts (``float4(h4)``, ``(float4)u``, ``static_cast<float4>(x)``)
  become value conversions (a clang vector cast would be a bitcast); casts whose type is a
  name (``T(h)``, ``(T)h``, ``static_cast<T>(h)``, ``bfloat(h)``) go through the shim, which
  converts half <-> bfloat as MSL does explicitly.
* Member functions overloaded on the address space of ``*this`` get renamed variants and
  forwarders with C++23 explicit object parameters.
"""
from __future__ import annotations

import dataclasses
import re

__all__ = ["StageError", "KernelInfo", "Param", "stage"]


class StageError(ValueError):
    """The MSL source uses a construct metalsim's staging cannot handle."""


class StrictError(StageError):
    """The MSL source breaks a rule of the language that Apple's compiler enforces (found while
    staging; raised to the caller as CompileError)."""


KERNEL_PTR_SPACES = {"device", "constant", "threadgroup", "threadgroup_imageblock", "object_data"}


BUILTINS = {
    "thread_position_in_grid": 0,
    "threadgroup_position_in_grid": 1,
    "thread_position_in_threadgroup": 2,
    "threads_per_threadgroup": 3,
    "threadgroups_per_grid": 4,
    "threads_per_grid": 5,
    "grid_size": 5,
    "thread_index_in_threadgroup": 6,
    "thread_index_in_simdgroup": 7,
    "thread_index_in_quadgroup": 13,
    "simdgroup_index_in_threadgroup": 8,
    "simdgroups_per_threadgroup": 9,
    "thread_execution_width": 10,
    "threads_per_simdgroup": 10,
    "dispatch_threads_per_threadgroup": 11,
    "quadgroup_index_in_threadgroup": 12,
    "quadgroups_per_threadgroup": 14,
    "grid_origin": 15,
}
STD_ATTRS = {"maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn", "deprecated"}
SCALARS = ["bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "float", "bfloat"]
VEC_NAMES = {f"{s}{n}" for s in SCALARS for n in (2, 3, 4, 8, 16)}
VEC_NAMES |= {f"packed_{s}{n}" for s in SCALARS for n in (2, 3, 4)}
# static_cast<bfloat>(x) of a half x is legal MSL; clang allows half <-> bfloat only through float
BFLOAT_NAMES = {"bfloat", "bfloat16_t", "metal::bfloat"}
# static_cast<T>(x) with T a single (possibly qualified) name: resolved by the shim's __msim_cast
_NAMED_TYPE = re.compile(r"(?:\w+::)*[A-Za-z_]\w*")
_BUILTIN_TYPES = {"void", "bool", "char", "short", "int", "long", "float", "unsigned", "signed", "size_t",
                  "uint", "ushort", "uchar", "ulong", "ptrdiff_t"} | {f"{p}int{b}_t" for p in ("", "u")
                                                                       for b in (8, 16, 32, 64)}
COLLECTIVE_RE = re.compile(
    r"\b(threadgroup_barrier|simdgroup_barrier|simd_\w+|quad_\w+|simdgroup_multiply\w*)\s*[(<]")

_TOKEN_RE = re.compile(
    r"""(?P<pp>^[ \t]*\#[^\n]*)
      |(?P<ws>\s+)
      |(?P<str>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
      |(?P<num>\.?\d(?:[eEpP][+-]|[\w.])*)
      |(?P<id>[A-Za-z_]\w*)
      |(?P<p2>::|->|\+\+|--)
      |(?P<p>.)""",
    re.X | re.M | re.S,
)


@dataclasses.dataclass
class Tok:
    kind: str
    text: str
    start: int
    end: int


@dataclasses.dataclass
class Param:
    name: str
    kind: str  # "buffer", "threadgroup", "builtin"
    index: int
    attr: str
    optional: bool = False  # guarded by [[function_constant(...)]]

    @property
    def code(self) -> str:
        """C++ constant expression: kind * 1000 + index (the index may be a named constant)."""
        return f"{ {'buffer': 0, 'threadgroup': 1, 'builtin': 2}[self.kind] * 1000} + ({self.index})"


@dataclasses.dataclass
class KernelInfo:
    name: str  # host name
    symbol: str  # C entry point in the shared library
    function: str  # C++ expression naming the function (e.g. "ns::f<float, 4>")
    params: list

    @property
    def buffer_indices(self) -> list:
        return [p.index for p in self.params if p.kind == "buffer"]

    @property
    def threadgroup_indices(self) -> list:
        return [p.index for p in self.params if p.kind == "threadgroup"]


@dataclasses.dataclass
class FunctionConstant:
    name: str
    index: int
    type: str


@dataclasses.dataclass
class Staged:
    source: str
    kernels: list
    function_constants: list
    needs_fibers: bool


def tokenize(text: str) -> list:
    toks = []
    for m in _TOKEN_RE.finditer(text):
        k = m.lastgroup
        if k == "ws":
            continue
        if k == "p2":
            k = "p"
        toks.append(Tok(k, m.group(), m.start(), m.end()))
    return toks


class _Edits:
    def __init__(self, text: str):
        self.text = text
        self.edits = []  # (start, end, replacement)

    def replace(self, start: int, end: int, new: str) -> None:
        self.edits.append((start, end, new))

    def replace_span(self, start: int, end: int, new: str) -> None:
        """Replace [start, end), dropping earlier edits that lie inside it."""
        self.edits = [e for e in self.edits if not (e[0] >= start and e[1] <= end)]
        self.edits.append((start, end, new))

    def insert(self, pos: int, new: str) -> None:
        self.edits.append((pos, pos, new))

    def blank(self, start: int, end: int) -> None:
        seg = self.text[start:end]
        self.replace(start, end, re.sub(r"[^\n]", " ", seg))

    def apply(self) -> str:
        out, pos = [], 0
        # stable order: by start, inserts (empty spans) before replacements at the same place
        for s, e, new in sorted(self.edits, key=lambda x: (x[0], x[1] != x[0])):
            if s < pos:
                raise StageError(f"internal staging conflict near: {self.text[s:s + 60]!r}")
            out.append(self.text[pos:s])
            out.append(new)
            pos = e
        out.append(self.text[pos:])
        return "".join(out)


def _match(toks, i, open_, close):
    """Index of the token closing the bracket opened at toks[i]."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j].text
        if toks[j].kind != "p":
            continue
        if t == open_:
            depth += 1
        elif t == close:
            depth -= 1
            if depth == 0:
                return j
    raise StageError(f"unbalanced {open_!r} near: {toks[i].text}")


def _match_angle(toks, i):
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind != "p":
            continue
        if t.text in "([{":
            j2 = _match(toks, j, t.text, {"(": ")", "[": "]", "{": "}"}[t.text])
            continue
        if t.text == "<":
            depth += 1
        elif t.text == ">":
            depth -= 1
            if depth == 0:
                return j
        elif t.text in ";{}":
            break
    raise StageError("unbalanced '<' in template argument list")


def _attr_groups(toks, lo, hi):
    """(start, end) token indices of each [[...]] group in toks[lo:hi]."""
    out = []
    i = lo
    while i < hi - 1:
        if toks[i].text == "[" and toks[i + 1].text == "[" and toks[i].kind == "p":
            j = _match(toks, i, "[", "]")
            out.append((i, j))
            i = j + 1
        else:
            i += 1
    return out


def _attr_items(toks, i, j):
    """Attribute items (name, args text) of the group toks[i..j]."""
    inner = toks[i + 2 : j - 1]
    items, cur = [], []
    depth = 0
    for t in inner:
        if t.text == "(":
            depth += 1
        elif t.text == ")":
            depth -= 1
        if t.text == "," and depth == 0:
            items.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        items.append(cur)
    res = []
    for it in items:
        if not it:
            continue
        name = it[0].text
        k = 1
        while k + 1 < len(it) and it[k].text == "::":
            name += "::" + it[k + 1].text
            k += 2
        args = " ".join(t.text for t in it[k + 1 : -1]) if k < len(it) and it[k].text == "(" else ""
        res.append((name, args))
    return res


def _split_top(toks, lo, hi, sep=","):
    parts, start, depth = [], lo, 0
    for k in range(lo, hi):
        t = toks[k].text
        if toks[k].kind != "p":
            continue
        if t in "([{<":
            depth += 1
        elif t in ")]}>":
            depth -= 1
        elif t == sep and depth == 0:
            parts.append((start, k))
            start = k + 1
    if start < hi:
        parts.append((start, hi))
    return parts


def _parse_params(toks, lo, hi, fname):
    params = []
    for a, b in _split_top(toks, lo, hi):
        if b <= a or (b - a == 1 and toks[a].text == "void"):
            continue
        groups = _attr_groups(toks, a, b)
        attrs = [it for gi, gj in groups for it in _attr_items(toks, gi, gj)]
        in_group = set()
        for gi, gj in groups:
            in_group.update(range(gi, gj + 1))
        ids = [toks[k].text for k in range(a, b) if k not in in_group and toks[k].kind == "id"]
        pname = ids[-1] if ids else "?"
        p = None
        for name, args in attrs:
            if name == "buffer":
                p = Param(pname, "buffer", _index(args), f"buffer({args})")
            elif name == "threadgroup":
                p = Param(pname, "threadgroup", _index(args), f"threadgroup({args})")
            elif name in BUILTINS:
                p = Param(pname, "builtin", BUILTINS[name], name)
            elif name == "function_constant" and p is not None:
                p.optional = True
            elif name in ("texture", "sampler", "stage_in", "visible_function_table", "intersection_function_table",
                          "instance_acceleration_structure", "primitive_acceleration_structure"):
                raise StageError(f"kernel {fname}: parameter {pname!r} uses [[{name}]], which metalsim does not support")
        if p is not None and any(nm == "function_constant" for nm, _ in attrs):
            p.optional = True
        if p is None or p.kind != "builtin":
            words = [toks[k].text for k in range(a, b) if k not in in_group]
            if any(w in ("*", "&", "&&") for w in words) and not KERNEL_PTR_SPACES.intersection(words):
                raise StrictError(f"kernel {fname}: parameter {pname!r} is a pointer or reference without an "
                                  f"address space: a kernel's pointer and reference arguments must be declared "
                                  f"device, constant or threadgroup")
        if p is None:
            # MSL gives a resource argument without a location attribute the first free index
            p = Param(pname, "buffer", None, "buffer")
        params.append(p)
    _assign_implicit_buffers(params, fname)
    return params


def _assign_implicit_buffers(params, fname):
    """Buffer arguments without [[buffer(n)]] take, in order, the lowest index no other
    buffer argument of the kernel uses (MSL's implicit location assignment)."""
    used = set()
    for p in params:
        if p.kind == "buffer" and p.index is not None:
            if not isinstance(p.index, int):
                if any(q.kind == "buffer" and q.index is None for q in params):
                    raise StageError(f"kernel {fname}: implicit buffer indices cannot be combined with named "
                                     f"index constants ([[buffer({p.index})]]); give every index as a number")
                continue
            used.add(p.index)
    nxt = 0
    for p in params:
        if p.kind == "buffer" and p.index is None:
            while nxt in used:
                nxt += 1
            p.index = nxt
            p.attr = f"buffer({nxt})"
            used.add(nxt)


def _index(args: str):
    """An attribute index: an int, or a C++ constant expression resolved after compiling."""
    try:
        return int(args, 0)
    except ValueError:
        return args


def _const_int(expr: str):
    """Value of an integer constant expression of literals and + - * / % << >> | & ( ), or None."""
    import ast
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr.strip())
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Div: lambda a, b: int(a / b), ast.Mod: lambda a, b: a % b,
           ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b, ast.BitOr: lambda a, b: a | b,
           ast.BitAnd: lambda a, b: a & b}

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError
    try:
        return ev(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def _bfloat_literal(spelling: str) -> str:
    """A float literal of exactly the value of the bfloat literal `spelling` (`5.0bf`, `1e-3BF`,
    `0x1.8p3bf`): the decimal value rounded once to bfloat, to nearest even (8 significant bits,
    exponents -126..127 with subnormals down to 2**-133, overflow to infinity)."""
    from fractions import Fraction
    body = spelling[:-2]
    if body.lower().startswith("0x"):
        x = Fraction(float.fromhex(body))  # a hex literal with more than 53 bits is not supported
    else:
        x = Fraction(body)
    if x == 0:
        return "0.0f"
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    q = Fraction(2) ** (max(e, -126) - 7)
    v = round(x / q) * q  # Fraction rounds half to even
    if v >= Fraction(2) ** 128:
        return "__builtin_inff()"
    return float(v).hex() + "f"


def _unary_end(toks, i):
    """Index one past the end of the unary-expression starting at toks[i] (C-style cast operand)."""
    n = len(toks)
    if i >= n:
        raise StageError("cast without operand")
    t = toks[i]
    if t.kind == "p" and t.text in ("-", "+", "!", "~", "*", "&", "++", "--"):
        return _unary_end(toks, i + 1)
    if t.kind == "p" and t.text == "(":
        j = _match(toks, i, "(", ")") + 1
        # a nested cast "(T)x": parenthesised type followed by an operand
        if j < n and (toks[j].kind in ("id", "num") or toks[j].text == "(") and _looks_like_type(toks, i + 1, j - 1):
            return _unary_end(toks, j)
    elif t.kind in ("num", "str"):
        j = i + 1
    elif t.kind == "id":
        j = i + 1
        while j + 1 < n and toks[j].text == "::" and toks[j + 1].kind == "id":
            j += 2
        if j < n and toks[j].text == "<":
            try:
                k = _match_angle(toks, j)
                if k + 1 < n and toks[k + 1].text in ("(", "::"):
                    j = k + 1
            except StageError:
                pass
    else:
        raise StageError(f"cannot parse cast operand near {t.text!r}")
    while j < n:
        s = toks[j].text
        if s in (".", "->") and j + 1 < n:
            j += 2
        elif s == "[":
            j = _match(toks, j, "[", "]") + 1
        elif s == "(":
            j = _match(toks, j, "(", ")") + 1
        elif s in ("++", "--"):
            j += 1
        else:
            break
    return j


def _looks_like_type(toks, a, b):
    if b - a == 1 and toks[a].kind == "id":
        return toks[a].text in VEC_NAMES or toks[a].text in SCALARS
    return False


# T(x) and (T)x with T one of these, a template type parameter or an alias: resolved by the
# shim's __msim_ccast (clang refuses half <-> bfloat casts, which Metal allows explicitly)
SCALAR_CAST_NAMES = {"bfloat", "half"}
# keywords that end a return type before a qualified name, never a scope of it
_NOT_A_SCOPE = {"void", "kernel", "bool", "char", "short", "int", "long", "float", "half", "bfloat", "unsigned",
                "signed", "auto", "const", "volatile", "inline", "static", "extern"}
_TYPE_LEAD = {"const", "volatile", "device", "constant", "threadgroup", "thread", "unsigned", "signed",
              "typename", "struct", "class", "enum"}


def _type_names(toks):
    """Names the source declares as types that may stand for bfloat, half or a vector: template
    type parameters (`template <typename T, class U>`), `typedef ... name;` and `using name = ...;`."""
    names = set(SCALAR_CAST_NAMES)
    n = len(toks)
    for i, t in enumerate(toks):
        if t.kind != "id":
            continue
        if t.text == "template" and i + 1 < n and toks[i + 1].text == "<":
            try:
                close = _match_angle(toks, i + 1)
            except StageError:
                continue
            for a, b in _split_top(toks, i + 2, close):
                if b - a >= 2 and toks[a].text in ("typename", "class"):
                    k = a + 1
                    if toks[k].text == "...":
                        k += 1
                    if k < b and toks[k].kind == "id":
                        names.add(toks[k].text)
        elif t.text == "using" and i + 2 < n and toks[i + 1].kind == "id" and toks[i + 2].text == "=":
            names.add(toks[i + 1].text)
        elif t.text == "typedef":
            k = i + 1
            while k < n and toks[k].text not in (";", "{", "("):
                k += 1
            if k < n and toks[k].text == ";" and toks[k - 1].kind == "id":
                names.add(toks[k - 1].text)
    return names


def _names_a_type(toks, a, b, type_names):
    """toks[a:b] (the inside of `T(...)`) is a type or a parameter declaration (`T(int)`,
    `T(const device float*)`, `T(U x)`): T(...) is then a function type, not a cast."""
    first = toks[a]
    if first.kind != "id":
        return False
    if first.text in _TYPE_LEAD:
        return True
    if first.text in type_names or first.text in _BUILTIN_TYPES or first.text in VEC_NAMES \
            or first.text in SCALARS:
        return b - a == 1 or toks[a + 1].text in ("*", "&", "&&") or toks[a + 1].kind == "id"
    return False


def _functional_cast(toks, i, type_names, args=1):
    """toks[i] names a type from `type_names` and starts a functional cast `T(x)` of one
    argument (not a declarator `T (*f)(...)`, a function type `T(int)`, a member or a
    qualified name): the index of the closing parenthesis, else None. With args=2: a
    construction `T(a, b, ...)` of two or more arguments instead, none of them a type."""
    n = len(toks)
    if i + 2 >= n or toks[i + 1].text != "(" or toks[i + 2].text == ")":
        return None
    prev = toks[i - 1] if i else None
    if prev is not None:
        if prev.kind == "id" and prev.text not in ("return", "case", "else", "do"):
            return None
        if prev.text in (".", "->", "~", "::") and not (prev.text == "::" and i >= 2 and toks[i - 2].text == "metal"):
            return None
    try:
        close = _match(toks, i + 1, "(", ")")
    except StageError:
        return None
    parts = _split_top(toks, i + 2, close)
    if args == 2:
        if len(parts) < 2 or any(b <= a or _names_a_type(toks, a, b, type_names) for a, b in parts):
            return None
        return close
    if len(parts) != 1 or _names_a_type(toks, i + 2, close, type_names):
        return None
    if toks[i + 2].text in ("*", "&", "^") and close == i + 4 and toks[i + 3].kind == "id" \
            and close + 1 < n and toks[close + 1].text in ("(", "["):
        return None  # T (*name)(...) declares a function pointer
    return close


def stage(text: str) -> Staged:
    toks = tokenize(text)
    ed = _Edits(text)
    kernels: list = []
    templates: dict = {}  # template kernel name -> params
    fcs: list = []
    needs_fibers = bool(COLLECTIVE_RE.search(text))
    n = len(toks)
    type_names = _type_names(toks)

    # ---- pass 1: float literals, vector conversions ----
    for gi, gj in _attr_groups(toks, 0, n):
        items = _attr_items(toks, gi, gj)
        if not all(nm in STD_ATTRS or nm.startswith("clang::") or nm.startswith("gnu::") for nm, _ in items):
            ed.blank(toks[gi].start, toks[gj].end)
    for i, t in enumerate(toks):
        if t.kind == "num":
            low = t.text.lower()
            if low.startswith("0x"):
                m = re.fullmatch(r"(0x[0-9a-f.]*p[+-]?\d+)([a-z]*)", low)
                body, suf, is_float = (m.group(1), m.group(2), True) if m else (low, "", False)
            else:
                m = re.fullmatch(r"(\d*\.?\d*(?:e[+-]?\d+)?)([a-z]*)", low)
                if not m:
                    continue
                body, suf = m.groups()
                is_float = "." in body or "e" in body
            if suf == "h":
                ed.replace(t.start, t.end, f"((half){body}{'' if is_float else '.0'}f)")
            elif suf == "bf":
                ed.replace(t.start, t.end, f"((bfloat){_bfloat_literal(t.text)})")
            elif is_float and suf == "":
                ed.replace(t.start, t.end, t.text + "f")
        elif t.kind == "id" and i + 1 < n:
            prev = toks[i - 1].text if i else ""
            if t.text in VEC_NAMES and toks[i + 1].text == "(" and prev not in ("operator", ".", "->", "typedef"):
                start = t.start
                if prev == "::" and i >= 2 and toks[i - 2].text == "metal":
                    start = toks[i - 2].start
                ed.replace(start, t.end, f"__msim_make<{t.text}>")
            elif t.text in type_names and _functional_cast(toks, i, type_names) is not None:
                start = toks[i - 2].start if prev == "::" else t.start
                ed.replace(start, t.end, f"__msim_ccast<{t.text}>")
            elif t.text in type_names and _functional_cast(toks, i, type_names, args=2) is not None:
                # T(a, b, ...) with T a template parameter or alias that may be a vector (clang's
                # vectors have no constructor of several arguments)
                start = toks[i - 2].start if prev == "::" else t.start
                ed.replace(start, t.end, f"__msim_ctor<{t.text}>")
            elif t.text == "vec" and toks[i + 1].text == "<" and prev not in ("operator", "using", "struct"):
                try:
                    k = _match_angle(toks, i + 1)
                except StageError:
                    continue
                if k + 1 < n and toks[k + 1].text == "(":
                    start = t.start
                    if prev == "::" and i >= 2 and toks[i - 2].text == "metal":
                        start = toks[i - 2].start
                    ed.replace(start, toks[k].end, f"__msim_make<{text[t.start:toks[k].end]}>")
            elif t.text == "static_cast" and toks[i + 1].text == "<":
                try:
                    k = _match_angle(toks, i + 1)
                except StageError:
                    continue
                inner = text[toks[i + 2].start : toks[k - 1].end].strip() if k > i + 2 else ""
                if (inner in VEC_NAMES or inner.startswith("vec<") or inner.startswith("metal::vec<")
                        or inner.removeprefix("metal::") in VEC_NAMES or inner in BFLOAT_NAMES):
                    ed.replace(t.start, toks[k].end, f"__msim_make<{inner}>")
                elif _NAMED_TYPE.fullmatch(inner) and inner not in _BUILTIN_TYPES:
                    # a template parameter or type alias that may be bfloat, half or a vector
                    ed.replace(t.start, toks[k].end, f"__msim_cast<{inner}>")
        elif t.kind == "p" and t.text == "(" and i + 2 < n and toks[i + 2].text == ")" \
                and toks[i + 1].kind == "id" and (toks[i + 1].text in VEC_NAMES or toks[i + 1].text in type_names):
            # C-style cast (float4)x -> __msim_make<float4>(x), (T)x -> __msim_ccast<T>(x),
            # unless it is a call "f(float4)", "sizeof(T)" etc.
            prev = toks[i - 1] if i else None
            if prev is not None and (prev.kind == "id" and prev.text not in ("return", "case") or prev.text in (")", "]")):
                continue
            if i + 3 >= n or not (toks[i + 3].kind in ("id", "num") or toks[i + 3].text in ("(", "-", "+", "!", "~", "*", "&")):
                continue
            end = _unary_end(toks, i + 3)
            conv = "__msim_make" if toks[i + 1].text in VEC_NAMES else "__msim_ccast"
            ed.replace(t.start, toks[i + 2].end, f"{conv}<{toks[i + 1].text}>(")
            ed.insert(toks[end - 1].end, ")")

    _merge_addrspace_methods(toks, ed, text)
    _decay_array_params(toks, ed)

    # ---- pass 2: structure (namespaces, kernels, threadgroup declarations, function constants) ----
    stack: list = []  # entries: ("ns", name) or ("blk", None)
    decl_start = 0  # token index where the current namespace-scope declaration starts
    tg_id = 0
    fc_names: set = set()
    i = 0

    def at_ns_scope():
        return all(k == "ns" for k, _ in stack)

    def ns_prefix():
        return "".join(nm + "::" for k, nm in stack if k == "ns" and nm)

    while i < n:
        t = toks[i]
        if t.kind == "pp":
            i += 1
            if at_ns_scope() and decl_start == i - 1:
                decl_start = i
            continue
        if t.kind == "p" and t.text == "[" and i + 1 < n and toks[i + 1].text == "[":
            i = _match(toks, i, "[", "]") + 1
            continue
        if t.kind == "p" and t.text == "{":
            # what opens here?
            kind, name = "blk", None
            k = i - 1
            if k >= 0 and toks[k].kind == "id" and k >= 1 and toks[k - 1].text == "namespace":
                kind, name = "ns", toks[k].text
            elif k >= 0 and toks[k].text == "namespace":
                kind, name = "ns", ""
            elif k >= 0 and toks[k].kind == "str" and k >= 1 and toks[k - 1].text == "extern":
                kind, name = "ns", ""
            if at_ns_scope() and kind == "blk":
                # a function (or class) body at namespace scope: is it a kernel definition?
                _maybe_kernel(toks, decl_start, i, ed, kernels, templates, ns_prefix(), text, body=True)
                j = _match(toks, i, "{", "}")
                # threadgroup declarations inside the body
                tg_id = _rewrite_tg_decls(toks, i + 1, j, ed, tg_id, text)
                # skip to the end of the body; a class body ends with ';' (handled as a declaration)
                i = j + 1
                if i < n and toks[i].text == ";":
                    i += 1
                decl_start = i
                continue
            stack.append((kind, name))
            i += 1
            decl_start = i
            continue
        if t.kind == "p" and t.text == "}":
            if stack:
                stack.pop()
            i += 1
            decl_start = i
            continue
        if t.kind == "p" and t.text == ";" and at_ns_scope():
            _maybe_kernel(toks, decl_start, i, ed, kernels, templates, ns_prefix(), text, body=False)
            _maybe_constant(toks, decl_start, i, ed, fcs, fc_names, text)
            i += 1
            decl_start = i
            continue
        if t.kind == "p" and t.text == "(" and at_ns_scope():
            i = _match(toks, i, "(", ")") + 1
            continue
        i += 1

    # ---- entry points ----
    lines = ["", "// ---- metalsim entry points ----"]
    for k, kinfo in enumerate(kernels):
        codes = ", ".join(str(p.code) for p in kinfo.params)
        lines.append(f"{kernel_guard(k)}(MSIM_ENTRY void {kinfo.symbol}(const msim_launch *L, const msim_thread *t) "
                     f"{{ __msim_invoke<{codes}>(&{kinfo.function}, L, t); }}")
        lines.append(f"extern \"C\" __attribute__((visibility(\"default\"))) const int {kinfo.symbol}_codes[] = "
                     f"{{{codes}{', ' if codes else ''}-1}};)")
    staged = ed.apply() + "\n".join(lines) + "\n"
    return Staged(staged, kernels, fcs, needs_fibers)


ADDRSPACES = ("device", "constant", "threadgroup", "thread")
_AS_PREFERENCE = {"thread": 0, "device": 1, "constant": 2, "threadgroup": 3}
_CLASS_KEYS = ("struct", "class", "union")
_SPECIFIERS = {"constexpr", "METAL_FUNC", "inline", "static", "explicit", "friend"}


def _class_name(toks, brace):
    """Name of the class whose body opens at toks[brace] (`struct S ... {`), or None."""
    k = brace - 1
    while k >= 0 and toks[k].text not in (";", "{", "}"):
        if toks[k].text in _CLASS_KEYS and (k == 0 or toks[k - 1].text != "enum"):
            m = k + 1
            while m < brace and (toks[m].kind != "id" or toks[m].text in ("alignas", "final")):
                m = _match(toks, m, "(", ")") + 1 if toks[m].text == "(" else m + 1
            return toks[m].text if m < brace and toks[m].kind == "id" else None
        k -= 1
    return None


def _member_name(toks, start, po):
    """(kind, name tokens start) of the member function whose parameter list opens at toks[po]:
    kind "id" (a named function), "op" (an operator symbol: `operator[]`, `operator+=`) or
    "conv" (a conversion function `operator T`); None when it is none of these."""
    k = next((m for m in range(start, po) if toks[m].text == "operator"), None)
    if k is None:
        return ("id", po - 1) if toks[po - 1].kind == "id" else None
    if k + 1 < po and toks[k + 1].kind == "id" and toks[k + 1].text not in ("new", "delete"):
        return "conv", k
    return "op", k


def _merge_addrspace_methods(toks, ed, text):
    """Member functions overloaded on the address space of `*this` (`float get() const device`).

    clang has no address-space qualifier on member functions outside OpenCL C++, so each
    variant becomes an ordinary member under its own name (`__msim_device_get`), and a
    forwarding member with a C++23 explicit object parameter in that address space
    (`get(this const device S& self, args...)`) takes its place in overload resolution: a call
    resolves on the address space of the object as in MSL (a member with no qualifier is the
    `thread` variant). Member templates forward their explicit template arguments; a
    declaration in the class and its definition outside it (`float S::get() const device {}`)
    are renamed alike. Constructors take a tag per address space (_tag_constructors).
    Destructors, member templates mixing type and non-type parameters,
    returning a type in an address space or being operators other than `()` and `[]` (template
    conversion operators: MLX's complex_t), and conversion operators defined outside the class
    keep one variant per signature (thread first) with the qualifier removed."""
    n = len(toks)
    enclosing, stack = [0] * n, [-1]
    for k, t in enumerate(toks):
        enclosing[k] = stack[-1]
        if t.kind == "p" and t.text == "{":
            stack.append(k)
        elif t.kind == "p" and t.text == "}" and len(stack) > 1:
            stack.pop()
    groups, members, outside = {}, {}, []
    for k, t in enumerate(toks):
        if t.kind != "p" or t.text != ")":
            continue
        j, quals, space = k + 1, [], None
        while j < n and toks[j].kind == "id" and toks[j].text in ("const", "volatile") + ADDRSPACES:
            if toks[j].text in ADDRSPACES:
                space = j
            quals.append(toks[j].text)
            j += 1
        if j >= n or toks[j].text not in ("{", ";", ":", "=", "->"):
            continue
        if space is None and (toks[j].text not in ("{", "->", ";") or enclosing[k] < 0):
            continue
        try:
            po = next(m for m in range(k, -1, -1) if toks[m].text == "(" and _match(toks, m, "(", ")") == k)
        except (StopIteration, StageError):
            continue
        start = po - 1
        while start > 0:
            pt = toks[start - 1]
            if pt.text in (";", "{", "}") or (pt.text == ":" and start >= 2 and toks[start - 2].text in
                                              ("public", "private", "protected")):
                break
            start -= 1
        end = _member_end(toks, j)
        if end is None:
            continue
        name = _member_name(toks, start, po) if po >= 1 else None
        cls = _class_name(toks, enclosing[k]) if enclosing[k] >= 0 else None
        if name is not None and cls is None and space is not None:
            qual = _qualifying_class(toks, name[1], start)
            if qual is not None:
                kind, ns = name
                key = text[toks[ns].start:toks[po].start].strip() if kind != "id" else toks[ns].text
                outside.append(dict(cls=qual, key=key, name_kind=kind, name_tok=ns, po=po, space=toks[space].text,
                                    space_tok=space, start=start, end=end, close=k, quals=quals,
                                    enclosing=enclosing[k]))
                continue
        if name is None or cls is None:
            if space is not None:
                groups.setdefault((enclosing[k], text[toks[start].start:toks[k].end], "const" in quals),
                                  []).append((toks[space].text, start, end, space))
            continue
        kind, ns = name
        key = text[toks[ns].start:toks[po].start].strip() if kind != "id" else toks[ns].text
        v = dict(space=toks[space].text if space is not None else "thread", space_tok=space, start=start, end=end,
                 po=po, close=k, name_kind=kind, name_tok=ns, quals=[q for q in quals if q not in ADDRSPACES],
                 cls=cls, body=toks[j].text in ("{", "->"),
                 template=_template_pack(toks, start, po),
                 ctor=kind == "id" and key in (cls, "~"), dtor=toks[ns - 1].text == "~",
                 defaulted=toks[j].text == "=")
        members.setdefault((enclosing[k], key), []).append(v)
    split = {}  # (class name, member key) -> stem of the renamed variants
    tagged = set()  # classes whose constructors have variants for other address spaces
    for (_, key), vs in members.items():
        if vs[0]["ctor"] and not any(v["dtor"] for v in vs) and \
                any(v["space_tok"] is not None and v["space"] != "thread" for v in vs):
            _tag_constructors(toks, ed, text, vs)
            tagged.add(vs[0]["cls"])
            continue
        if not any(v["space_tok"] is not None and v["space"] != "thread" for v in vs):
            vs = [v for v in vs if v["space_tok"] is not None]
            for v in vs:
                ed.replace(toks[v["space_tok"]].start, toks[v["space_tok"]].end, " " * len(v["space"]))
            continue
        if any(v["ctor"] or v["template"] == "mixed" or (v["template"] and (_return_spaces(toks, v) or not (
                v["name_kind"] == "id" or key.replace(" ", "") in ("operator()", "operator[]")))) for v in vs):
            for v in vs:
                if v["space_tok"] is not None:
                    sig = text[toks[v["start"]].start:toks[v["close"]].end]
                    groups.setdefault((enclosing[v["close"]], sig, "const" in v["quals"]), []).append(
                        (v["space"], v["start"], v["end"], v["space_tok"]))
            continue
        split[(vs[0]["cls"], key)] = _split_addrspace_variants(toks, ed, text, key, vs)
    for o in outside:
        if o["key"] == o["cls"] and o["cls"] in tagged:
            _tag_constructors(toks, ed, text, [dict(o, defaulted=False)])
            continue
        stem = split.get((o["cls"], o["key"]))
        if stem is None or o["name_kind"] == "conv":
            groups.setdefault((o["enclosing"], text[toks[o["start"]].start:toks[o["close"]].end], "const" in o["quals"]),
                              []).append((o["space"], o["start"], o["end"], o["space_tok"]))
            continue
        # the definition of a renamed variant: the same name, no qualifier, the return type generic
        ed.replace(toks[o["name_tok"]].start, toks[o["po"] - 1].end, f"__msim_{o['space']}_{stem}")
        ed.replace(toks[o["space_tok"]].start, toks[o["space_tok"]].end, " " * len(o["space"]))
        for m in _return_spaces(toks, o):
            ed.replace(toks[m].start, toks[m].end, " " * len(toks[m].text))
    if tagged:
        _construct_in_spaces(toks, ed, text)
    for variants in groups.values():
        variants.sort(key=lambda v: _AS_PREFERENCE[v[0]])
        for rank, (_, start, end, space) in enumerate(variants):
            if rank == 0:
                ed.replace_span(toks[space].start, toks[space].end, " " * len(toks[space].text))
            else:
                seg = text[toks[start].start:toks[end].end]
                ed.replace_span(toks[start].start, toks[end].end, re.sub(r"[^\n]", " ", seg))


def _tag_constructors(toks, ed, text, vs):
    """Constructors overloaded on the address space of the object they construct (`S(float)
    constant`): C++ has no explicit object parameter for a constructor, so a variant for device,
    constant or threadgroup memory takes a leading tag argument instead (`S(__msim_in_constant,
    float)`), which _construct_in_spaces passes where such an object is initialised; the thread
    variant stays the plain constructor. A defaulted or deleted variant for another address
    space is dropped (a tag cannot be defaulted)."""
    for v in vs:
        st = v["space_tok"]
        if st is None:
            continue
        ed.replace(toks[st].start, toks[st].end, " " * len(v["space"]))
        if v["space"] == "thread":
            continue
        if v.get("defaulted"):
            seg = text[toks[v["start"]].start:toks[v["end"]].end]
            ed.replace_span(toks[v["start"]].start, toks[v["end"]].end, re.sub(r"[^\n]", " ", seg))
            continue
        po = v["po"]
        ed.insert(toks[po].end, f"__msim_in_{v['space']}" + ("" if v["close"] == po + 1 else ", "))


def _construct_in_spaces(toks, ed, text):
    """`constant T x = T(args);` and `constant T x(args);` (the object in constant memory)
    construct with T's constant variant when it has one (__msim_construct_in in the shim)."""
    n = len(toks)
    for k, t in enumerate(toks):
        if t.kind != "id" or t.text != "constant" or (k and toks[k - 1].text in ("(", ",", "<")):
            continue
        semi = next((m for m in range(k, n) if toks[m].text in (";", "{", "}")), None)
        if semi is None or toks[semi].text != ";":
            continue
        a = k + 1
        while a < semi and toks[a].text in ("static", "constexpr", "inline", "const"):
            a += 1
        eq = next((m for m in range(a, semi) if toks[m].text == "="), None)
        if eq is not None:
            name, init = eq - 1, eq + 1
            typ = text[toks[a].start:toks[name - 1].end] if name > a else ""
            m = init
            got = []
            while m < semi and toks[m].text != "(":
                got.append(toks[m].text)
                m += 1
            if not typ or m >= semi or "".join(got) != re.sub(r"\s+", "", typ) \
                    or _match(toks, m, "(", ")") != semi - 1 or _value_type(typ):
                continue
            ed.replace_span(toks[init].start, toks[m - 1].end, f"__msim_construct_in<__msim_in_constant, {typ}>")
        else:
            po = next((m for m in range(a, semi) if toks[m].text == "("), None)
            if po is None or po - 1 <= a or toks[po - 1].kind != "id" or _match(toks, po, "(", ")") != semi - 1:
                continue
            typ = text[toks[a].start:toks[po - 2].end]
            if _value_type(typ):
                continue
            ed.insert(toks[po - 1].end, f" = __msim_construct_in<__msim_in_constant, {typ}>")


def _value_type(typ):
    """A scalar or vector type (converted by value, never a class with constructors)."""
    t = typ.strip().removeprefix("metal::")
    return t in VEC_NAMES or t in SCALARS or t in _BUILTIN_TYPES or t.startswith("vec<")


def _qualifying_class(toks, name_tok, start):
    """The class name qualifying a member defined outside its class (`S::get`, `S<T>::get`,
    `ns::S::operator[]`), or None."""
    k = name_tok - 1
    if k <= start or toks[k].text != "::":
        return None
    k -= 1
    if toks[k].text == ">":
        depth = 0
        while k > start:
            if toks[k].text == ">":
                depth += 1
            elif toks[k].text == "<":
                depth -= 1
                if depth == 0:
                    break
            k -= 1
        k -= 1
    return toks[k].text if k >= start and toks[k].kind == "id" else None


def _template_pack(toks, start, po):
    """For a member template (`template <...>` before the name): "class" when its parameters are
    all types, "auto" when all are values, "mixed" otherwise; "" for a plain member."""
    k = next((m for m in range(start, po) if toks[m].text == "template"), None)
    if k is None or toks[k + 1].text != "<":
        return ""
    close = _match_angle(toks, k + 1)
    kinds = {"class" if toks[a].text in ("typename", "class") else "auto" for a, b in _split_top(toks, k + 2, close)}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _return_spaces(toks, v):
    """Token indices of address-space qualifiers in the return type of member `v`."""
    return [m for m in range(v["start"], v["name_tok"]) if toks[m].kind == "id" and toks[m].text in ADDRSPACES
            and not (m > v["start"] and toks[m - 1].text == "::")]


def _stem(key, name_kind):
    return key if name_kind == "id" else "op_" + "".join(
        c if c.isalnum() else f"{ord(c):x}" for c in key.replace("operator", "", 1).replace(" ", ""))


def _split_addrspace_variants(toks, ed, text, key, vs):
    """Rename each variant of member `key` to `__msim_<space>_<stem>` and add one forwarding
    member per (address space, cv, kind of call) with an explicit object parameter; the stem."""
    stem = _stem(key, vs[0]["name_kind"])
    made = set()
    # a member template in an address space: that space's forwarder passes explicit template arguments on
    templated = {(v["space"], " ".join(v["quals"])): v["template"] for v in vs if v["template"]}
    for v in vs:
        new = f"__msim_{v['space']}_{stem}"
        nt, po = v["name_tok"], v["po"]
        specs = [m for m in range(v["start"], nt) if toks[m].text in ("explicit", "constexpr", "static")]
        for m in specs:
            if toks[m].text == "explicit":
                ed.replace(toks[m].start, toks[m].end, " " * 8)
        if v["name_kind"] == "conv":
            conv = text[toks[nt + 1].start:toks[po - 1].end]
            ed.replace(toks[nt].start, toks[po - 1].end, f"{conv} {new}")
        else:
            ed.replace(toks[nt].start, toks[po - 1].end, new)
        if v["space_tok"] is not None:
            ed.replace(toks[v["space_tok"]].start, toks[v["space_tok"]].end, " " * len(v["space"]))
        # a return type in an address space: generic in the renamed variant, cast back by the forwarder
        ret = [m for m in range(v["start"], nt) if toks[m].kind == "id" and toks[m].text not in _SPECIFIERS]
        ret_as = _return_spaces(toks, v)
        for m in ret_as:
            ed.replace(toks[m].start, toks[m].end, " " * len(toks[m].text))
        rtype = text[toks[ret[0]].start:toks[nt - 1].end] if ret_as else None
        nparams = len(_split_top(toks, po + 1, v["close"]))
        cv = " ".join(v["quals"])
        space = "" if v["space"] == "thread" else v["space"]
        self_t = f"this {cv} {space} {v['cls']}& __msim_self".replace("  ", " ")
        lead = ("constexpr " if any(toks[m].text == "constexpr" for m in specs) else "") + \
            ("explicit " if any(toks[m].text == "explicit" for m in specs) else "")
        res = rtype or "decltype(auto)"
        fwd_args = "static_cast<__msim_A&&>(__msim_a)..."

        def wrap(call, rtype=rtype):
            return f"__msim_as_result<{rtype}>({call})" if rtype else call

        pack = templated.get((v["space"], cv))
        if pack:
            sig = (v["space"], cv, "call")
            fwd = (f"template <{pack}... __msim_T, class... __msim_A> {lead}__attribute__((always_inline)) "
                   f"decltype(auto) {key}({self_t}, __msim_A&&... __msim_a) {{ "
                   f"if constexpr (sizeof...(__msim_T) == 0) return __msim_self.{new}({fwd_args}); "
                   f"else return __msim_self.template {new}<__msim_T...>({fwd_args}); }}")
        elif v["name_kind"] == "conv":
            sig = (v["space"], cv, "conv", key)
            fwd = (f"{lead}__attribute__((always_inline)) {key}({self_t}) {{ return __msim_self.{new}(); }}")
        elif v["name_kind"] == "id" or key.replace(" ", "") in ("operator()", "operator[]"):
            sig = (v["space"], cv, "call")
            fwd = (f"template <class... __msim_A> {lead}__attribute__((always_inline)) {res} "
                   f"{key}({self_t}, __msim_A&&... __msim_a) "
                   f"{{ return {wrap(f'__msim_self.{new}({fwd_args})')}; }}")
        elif nparams == 0:
            sig = (v["space"], cv, "unary")
            fwd = (f"{lead}__attribute__((always_inline)) {res} {key}({self_t}) "
                   f"{{ return {wrap(f'__msim_self.{new}()')}; }}")
        else:
            sig = (v["space"], cv, "binary")
            fwd = (f"template <class __msim_A> {lead}__attribute__((always_inline)) {res} "
                   f"{key}({self_t}, __msim_A&& __msim_a) "
                   f"{{ return {wrap(f'__msim_self.{new}(static_cast<__msim_A&&>(__msim_a))')}; }}")
        if sig not in made:
            made.add(sig)
            ed.insert(toks[v["end"]].end, " " + fwd)
    return stem


def _decay_array_params(toks, ed):
    """A parameter `constant const T name[N]` becomes `constant const T *name`: MSL adjusts an
    array parameter to a pointer into its address space, clang rejects the qualified array."""
    n = len(toks)
    for k in range(1, n - 1):
        if toks[k].text != "[" or toks[k].kind != "p" or toks[k - 1].kind != "id":
            continue
        if toks[k + 1].text == "[":
            continue
        try:
            close = _match(toks, k, "[", "]")
        except StageError:
            continue
        if close + 1 >= n or toks[close + 1].text not in (",", ")"):
            continue
        # the declaration before the name is made of identifiers and `::` / template arguments only
        m, space = k - 2, False
        while m >= 0 and toks[m].text not in (",", "(", ";", "{", "}"):
            if toks[m].kind == "id" and toks[m].text in ("device", "constant", "threadgroup"):
                space = True
            elif toks[m].kind != "id" and toks[m].text not in ("::", "<", ">"):
                space = False
                break
            m -= 1
        if not space or m < 0 or toks[m].text not in (",", "("):
            continue
        ed.insert(toks[k - 1].start, "*")
        ed.replace(toks[k].start, toks[close].end, "")


def _member_end(toks, j):
    """Index of the last token of a member function declaration whose qualifiers end before toks[j]."""
    n = len(toks)
    t = toks[j].text
    if t == ";":
        return j
    if t == "=":
        return next((m for m in range(j, n) if toks[m].text == ";"), None)
    if t == ":":  # constructor initialiser list, then the body
        m = j + 1
        while m < n:
            while m < n and (toks[m].kind == "id" or toks[m].text == "::"):
                m += 1
            if m < n and toks[m].text == "<":
                m = _match_angle(toks, m) + 1
            if m >= n or toks[m].text not in ("(", "{"):
                return None
            m = _match(toks, m, toks[m].text, ")" if toks[m].text == "(" else "}") + 1
            if m < n and toks[m].text == ",":
                m += 1
                continue
            break
        j = m
        if j >= n or toks[j].text != "{":
            return None
    elif t == "->":
        j = next((m for m in range(j, n) if toks[m].text in ("{", ";")), None)
        if j is None or toks[j].text == ";":
            return j
    end = _match(toks, j, "{", "}")
    if end + 1 < n and toks[end + 1].text == ";":
        end += 1
    return end


def kernel_guard(k: int) -> str:
    """Macro wrapping kernel k's instantiation and entry point; a build defines it to expand
    its argument for the kernels it compiles and to nothing for the others (selection())."""
    return f"__MSIM_K{k}"


def selection(nkernels: int, wanted) -> str:
    """Definitions of the kernel guards for a build of `wanted` (kernel indices; None: all)."""
    keep = set(range(nkernels)) if wanted is None else set(wanted)
    return "".join(f"#define {kernel_guard(k)}(...){' __VA_ARGS__' if k in keep else ''}\n" for k in range(nkernels))


def _is_kernel_decl(toks, lo, hi):
    for k in range(lo, hi):
        t = toks[k]
        if t.kind == "id" and t.text == "kernel":
            return True
        if t.text == "[" and k + 1 < hi and toks[k + 1].text == "[":
            j = _match(toks, k, "[", "]")
            if any(nm == "kernel" for nm, _ in _attr_items(toks, k, j)):
                return True
    return False


def _host_name(toks, lo, hi):
    for gi, gj in _attr_groups(toks, lo, hi):
        for nm, args in _attr_items(toks, gi, gj):
            if nm == "host_name":
                parts = re.findall(r'"((?:\\.|[^"\\])*)"', args)
                return "".join(parts) if parts else args.strip()
    return None


def _maybe_kernel(toks, lo, hi, ed, kernels, templates, ns, text, body):
    if hi <= lo or not _is_kernel_decl(toks, lo, hi):
        return
    in_attr = set()
    for gi, gj in _attr_groups(toks, lo, hi):
        in_attr.update(range(gi, gj + 1))
    plain = [k for k in range(lo, hi) if k not in in_attr]
    explicit_inst = (toks[plain[0]].text == "template" and len(plain) > 1 and toks[plain[1]].text != "<")
    host = _host_name(toks, lo, hi)
    if explicit_inst:
        # template [[host_name("x")]] [[kernel]] decltype(f<...>) f<...>;   or   ... void f<...>(params);
        k = plain[1]
        if toks[k].text == "decltype":
            close = _match(toks, k + 1, "(", ")")
            fexpr = text[toks[close + 1].start : toks[hi - 1].end].strip()
        else:
            # find the declarator: last "name<...>" before the parameter list
            po = next((m for m in plain[1:] if toks[m].text == "("), None)
            if po is None:
                # `template [[host_name("x")]] kernel fn_type f<...>;` (a typedef of the function type)
                po = hi
            q = po - 1
            if toks[q].text == ">":
                depth = 0
                while q > lo:
                    if toks[q].text == ">":
                        depth += 1
                    elif toks[q].text == "<":
                        depth -= 1
                        if depth == 0:
                            break
                    q -= 1
                q -= 1
            while q - 1 >= lo and toks[q - 1].text == "::":
                if q - 2 < lo or toks[q - 2].kind != "id" or toks[q - 2].text in _NOT_A_SCOPE:
                    q -= 1  # a leading `::` (`kernel void ::ns::f<...>(...)`): the global scope
                    break
                q -= 2
            fexpr = text[toks[q].start : toks[po - 1].end].strip()
        base = re.sub(r"<.*", "", fexpr).strip().split("::")[-1]
        params = templates.get(base)
        if params is None:
            raise StageError(f"kernel instantiation {host or fexpr}: no template kernel named {base!r} seen before it")
        if fexpr.startswith("::"):
            qual = fexpr
        elif "::" in re.sub(r"<.*", "", fexpr):
            qual = fexpr
        else:
            qual = ns + fexpr
        name = host or fexpr
        # the instantiation is compiled only in builds that want this kernel (see kernel_guard)
        ed.insert(toks[lo].start, f"{kernel_guard(len(kernels))}(")
        ed.insert(toks[hi].end, ")")
        kernels.append(KernelInfo(name, f"__msim_entry_{len(kernels)}", qual, params))
        return
    # definition or declaration: find the name before the first top-level '(' after any
    # template parameter list (which may hold function-pointer parameters)
    after = plain[0]
    if toks[plain[0]].text == "template" and len(plain) > 1 and toks[plain[1]].text == "<":
        after = _match_angle(toks, plain[1])
    po = next((m for m in plain if m > after and toks[m].text == "("), None)
    if po is None or toks[po - 1].kind != "id":
        raise StageError("cannot parse kernel declaration near " + " ".join(toks[m].text for m in plain[:12]))
    fname = toks[po - 1].text
    pc = _match(toks, po, "(", ")")
    params = _parse_params(toks, po + 1, pc, fname)
    is_template = toks[plain[0]].text == "template"
    if is_template:
        templates[fname] = params
        return
    if not body:
        return  # a prototype; the definition registers it
    # internal linkage: emitted only by builds whose entry point calls it
    ed.insert(toks[lo].start, "static inline ")
    kernels.append(KernelInfo(host or fname, f"__msim_entry_{len(kernels)}", ns + fname, params))


_TG_DECL = re.compile(r"threadgroup\s+(?P<type>[\w:<>,\s]+?)\s+(?P<name>\w+)\s*(?P<dims>(?:\[[^\]\[;]*\]\s*)*);", re.S)


def _rewrite_tg_decls(toks, lo, hi, ed, tg_id, text):
    """Rewrite `threadgroup T x[N]...;` statements in a function body to arena references."""
    for k in range(lo, hi):
        t = toks[k]
        if t.kind != "id" or t.text != "threadgroup":
            continue
        prev = toks[k - 1].text if k > 0 else ";"
        if prev not in (";", "{", "}", ")", ":") and not (toks[k - 1].kind == "pp"):
            continue  # e.g. a cast "(threadgroup T*)p" or a parameter/qualifier
        if prev == ")" :
            # "if (...) threadgroup ..." is not a declaration context we support; skip casts like ")threadgroup"
            continue
        m = _TG_DECL.match(text, t.start)
        if not m or m.end() > toks[hi].start:
            continue
        typ, name, dims = m.group("type").strip(), m.group("name"), re.sub(r"\s+", "", m.group("dims"))
        if typ in ("const",) or typ.endswith("*") or "(" in typ:
            continue
        new = f'auto &{name} = __msim_tg<{typ}{dims}>({tg_id}, "{name}");'
        # keep line structure
        new += "\n" * text[m.start() : m.end()].count("\n")
        ed.replace_span(m.start(), m.end(), new)
        tg_id += 1
    return tg_id


_FC_TYPES = {"bool", "char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "half", "float", "bfloat",
             "int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t", "size_t"}


def _maybe_constant(toks, lo, hi, ed, fcs, fc_names, text):
    """Namespace-scope `constant T name [[function_constant(i)]];` and constants derived from them."""
    if hi - lo < 3 or toks[lo].text != "constant":
        return
    groups = _attr_groups(toks, lo, hi)
    fc_index = None
    for gi, gj in groups:
        for nm, args in _attr_items(toks, gi, gj):
            if nm == "function_constant":
                fc_index = _const_int(args)
                if fc_index is None or not 0 <= fc_index < 65536:
                    raise StageError(f"function constant index {args!r}: expected an integer constant 0..65535")
    if fc_index is not None:
        name_tok = toks[groups[0][0] - 1]
        typ = text[toks[lo + 1].start : name_tok.start].strip()
        name = name_tok.text
        fcs.append(FunctionConstant(name, fc_index, typ))
        fc_names.add(name)
        ed.replace_span(toks[lo].start, toks[hi].end,
                   f"static constexpr __msim_fc<{typ}, {fc_index}> {name}{{}};")
        return
    # constant T name = init;  with init referring to function constants: evaluate lazily
    eq = next((k for k in range(lo, hi) if toks[k].text == "="), None)
    if eq is None:
        return
    init_ids = {toks[k].text for k in range(eq + 1, hi) if toks[k].kind == "id"}
    if not (init_ids & fc_names or "is_function_constant_defined" in init_ids):
        return
    name = toks[eq - 1].text
    typ = text[toks[lo + 1].start : toks[eq - 1].start].strip()
    init = text[toks[eq + 1].start : toks[hi - 1].end]
    fc_names.add(name)
    ed.replace_span(toks[lo].start, toks[hi].end,
               f"struct __msim_lazy_{name} {{ MSIM_INLINE operator {typ}() const {{ return ({typ})({init}); }} }}; "
               f"static constexpr __msim_lazy_{name} {name}{{}};")
