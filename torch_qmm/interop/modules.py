"""Modules for imported checkpoints: QuantEmbedding (MLX's quantized embedding), TiedQuantLinear
(the tied output projection through it), GGUFLinear (GGUF K-quant and i-quant blocks, kept as they are) and
GGUFSwitchLinear (a stack of expert weights in those blocks)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..format_state import FormatState, QuantFormatState
from ..formats import SUPPORTED_DTYPES
from ..nn import check_positive_ints, follows_autocast, module_dtype, quantized_from, register_quantized_weight
from ..ops import dequantize, gguf_matmul, quantized_matmul
from .gguf_gather import gguf_gather_matmul
from .gguf_types import native_type, type_name

torch.fx.wrap("gguf_matmul")  # as nn.py does for quantized_matmul
torch.fx.wrap("quantized_matmul")


class QuantEmbedding(QuantFormatState, nn.Module):
    """nn.Embedding with its table [num_embeddings, dim] in one of MLX's formats (after MLX's
    QuantizedEmbedding): a lookup dequantizes only the rows it reads.

    Buffers: ``qweight`` uint32 [num, dim*bits/32], ``scales`` [num, dim/group_size] (in the
    compute dtype for mode "affine", then also ``biases``; uint8 codes for the fp modes); the
    format as ``_extra_state`` (QuantFormatState). Lookups return the compute dtype (`dtype`; it
    follows ``.to(dtype)``), as_linear returns x's dtype. ``embed_scale`` (a float, default None):
    lookups multiplied by it rounded to the compute dtype, as transformers' Gemma embeddings
    (embedding_scale) multiply theirs; as_linear (a tied head) reads the table unscaled, as they do.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bits: int | None = None,
        group_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        mode: str = "affine",
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        dtype = module_dtype(dtype)
        check_positive_ints(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        if embed_scale is not None and (type(embed_scale) not in (int, float) or not math.isfinite(embed_scale)):
            raise ValueError(f"argument 'embed_scale' must be a finite float or None, got {embed_scale!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._embed_scale = None if embed_scale is None else float(embed_scale)
        # ... rounded to each compute dtype, made once (a lookup multiplies by its dtype's)
        self._embed_scales = (None if embed_scale is None else
                              {t: _rounded(self._embed_scale, t) for t in SUPPORTED_DTYPES})
        register_quantized_weight(self, num_embeddings, embedding_dim, bits, group_size, mode, device, dtype,
                                  "embedding_dim")
        # Empty and not saved: carries the compute dtype through .to() (fp modes have no float buffer).
        self.register_buffer("_compute_dtype", torch.empty(0, dtype=dtype, device=device), persistent=False)

    @property
    def embed_scale(self) -> float | None:
        """The factor lookups are multiplied by (None: none), as given."""
        return self._embed_scale

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the lookups."""
        return self._compute_dtype.dtype

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)
        # load_state_dict(assign=True) replaces the saved buffers by the state's tensors (their
        # device, and for affine their float dtype, which is then the compute dtype); the unsaved
        # dtype carrier follows them, so that a module built on the meta device works and moves
        # (.to() cannot copy a carrier left on meta).
        carrier, scales = self._compute_dtype, self.scales
        dtype = scales.dtype if scales.is_floating_point() else carrier.dtype
        if carrier.device != scales.device or carrier.dtype != dtype:
            self._compute_dtype = torch.empty(0, dtype=dtype, device=scales.device)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, bits: int | None = None, group_size: int | None = None,
        dtype: torch.dtype | None = None, mode: str = "affine",
    ) -> "QuantEmbedding":
        if embedding.max_norm is not None:  # nn.Embedding renormalizes the rows it reads: another forward
            raise ValueError(f"argument 'embedding' must have max_norm=None (QuantEmbedding reads its rows as "
                             f"stored), got max_norm={embedding.max_norm}")
        if not replaceable_embedding(embedding):
            raise ValueError(f"argument 'embedding' must be an nn.Embedding or one of transformers' scaled embeddings "
                             f"(Gemma's: QuantEmbedding does what their forward does), got a "
                             f"{type(embedding).__name__}, whose forward may do more")
        return quantized_from(cls, embedding.weight, dtype, embedding.num_embeddings, embedding.embedding_dim, bits,
                              group_size, mode=mode, embed_scale=embedding_scale(embedding))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 or int32, each in [0, num_embeddings), as nn.Embedding takes them (other
        dtypes raise RuntimeError and ids out of range IndexError, as there; tensor indexing would
        otherwise wrap negative ids and read a bool tensor as a mask)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise RuntimeError(f"QuantEmbedding: argument 'ids' must be an int64 or int32 tensor, got {ids.dtype}")
        flat = ids.reshape(-1)
        # Inside a graph (no host sync) and for meta or fake ids (no values to read; nn.Embedding
        # gives their shape): a checking op instead, which checks real values when it runs.
        # torch.jit.trace records neither check (the op has no output it keeps, a host check runs on
        # the traced call's ids only): there the rows are read with index_select, which refuses ids
        # out of range when the traced graph runs (indexing would wrap negative ones). So too inside
        # a torch.func transform (vmap: batched ids have no values on the host, nor a checking op).
        compiling = torch.compiler.is_compiling()
        transformed = not compiling and torch._C._functorch.peek_interpreter_stack() is not None
        tracing = torch.jit.is_tracing() or transformed
        if tracing:
            pass
        elif compiling or flat.device.type == "meta" or is_fake(flat):
            torch._assert_async(((flat >= 0) & (flat < self.num_embeddings)).all(),
                                f"QuantEmbedding: argument 'ids' must be in [0, {self.num_embeddings})")
        elif flat.numel() != 0:
            lo, hi = torch.stack(torch.aminmax(flat)).tolist()  # one device sync
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"QuantEmbedding: argument 'ids' must be in [0, {self.num_embeddings}), got {bad}"
                )
        def rows_of(t: torch.Tensor) -> torch.Tensor:
            if not tracing:
                return t[flat]
            if transformed and t.dtype == torch.uint32:  # (vmap's index_select: a gather, no uint32 kernel)
                return t.view(torch.int32).index_select(0, flat).view(torch.uint32)
            return t.index_select(0, flat)

        biases = None if self.biases is None else rows_of(self.biases)
        rows = dequantize(rows_of(self.qweight), rows_of(self.scales), biases, group_size=self.group_size,
                          bits=self.bits, mode=self.mode, dtype=self.compute_dtype)
        if self._embed_scales is not None:
            rows = rows * self._embed_scales[rows.dtype]
        return rows.reshape(*ids.shape, self.embedding_dim)

    @follows_autocast
    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] @ table.T -> [..., num_embeddings]: the tied output projection (following
        torch.autocast as nn.Linear does: nn.follows_autocast)."""
        return quantized_matmul(x, self.qweight, self.scales, self.biases, transpose=True,
                                group_size=self.group_size, bits=self.bits, mode=self.mode)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}, bits={self.bits}, "
            f"mode={self.mode}, dtype={self.compute_dtype}"
            + ("" if self.embed_scale is None else f", embed_scale={self.embed_scale}")
        )


class _ScaledEmbedding(nn.Embedding):
    """The forward of transformers' scaled token embeddings (Gemma's, MiniCPM3's, ...): nn.Embedding's
    rows times embed_scale, a float32 scalar buffer made from the float `scalar_embed_scale` and
    rounded to the weight's dtype when multiplied. Never built: its forward's code is what a
    module's is compared with (_is_scaled_embedding)."""

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _same_code(f, g) -> bool:
    a, b = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return (a is not None and b is not None
            and (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts))


def _is_scaled_embedding(module: nn.Module) -> bool:
    return (type(module).__mro__[1] is nn.Embedding and _same_code(type(module).forward, _ScaledEmbedding.forward)
            and type(getattr(module, "scalar_embed_scale", None)) in (int, float))


def replaceable_embedding(module: nn.Module) -> bool:
    """Whether a QuantEmbedding does what `module`'s forward does: an nn.Embedding (not a subclass
    with a forward of its own) or one of transformers' scaled embeddings (embedding_scale)."""
    return type(module) is nn.Embedding or _is_scaled_embedding(module)


def embedding_scale(module: nn.Module) -> float | None:
    """The factor a replaceable embedding multiplies its rows by (QuantEmbedding's embed_scale):
    a scaled embedding's, None for an nn.Embedding."""
    return float(module.scalar_embed_scale) if _is_scaled_embedding(module) else None


def _rounded(scale: float, dtype: torch.dtype) -> float:
    """`scale` as float32, then rounded to `dtype` (as the scaled embeddings round their buffer)."""
    return torch.tensor(scale, dtype=torch.float32, device="cpu").to(dtype).item()


class TiedQuantLinear(nn.Module):
    """An output projection that shares a QuantEmbedding's table (tie_word_embeddings).

    Holds no state of its own (the embedding is not registered as a child, so the table is stored
    once in state_dict and saved checkpoints have no output weight, as MLX writes them).
    """

    def __init__(self, embedding: QuantEmbedding) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # deliberately not a submodule
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.bias = None

    @property
    def embedding(self) -> QuantEmbedding:
        return self._embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._embedding.as_linear(x)

    def extra_repr(self) -> str:
        return f"tied to QuantEmbedding({self._embedding.extra_repr()})"


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts `new` in `model` at the dotted path `name` (its parent's attribute)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def tie_output(model: nn.Module, out_name: str, embedding: QuantEmbedding) -> None:
    """The output projection of `model` at `out_name` replaced by a TiedQuantLinear over `embedding`.
    The head is tied by construction: the transformers models in `model` stop listing
    `out_name`.weight among the weights their tie_weights() ties (it would assign the embedding's
    `.weight`, which a QuantEmbedding does not have: AttributeError). The entries are set aside on
    the model instances, for tie_float_output."""
    replace_module(model, out_name, TiedQuantLinear(embedding))
    for sub, attr, key in _tied_keys(model, out_name):
        mapping = getattr(sub, attr)
        vars(sub).setdefault("_torch_qmm_set_aside", {}).setdefault(attr, {})[key] = mapping[key]
        setattr(sub, attr, {k: v for k, v in mapping.items() if k != key})


def listed_as_tied(model: nn.Module, name: str) -> set[str]:
    """The modules the transformers models in `model` list as tied to the weight of the module
    `name` (their tied-weight mappings, which from_pretrained applies only after loading)."""
    return {(f"{prefix}.{target}" if prefix else target).rpartition(".")[0]
            for prefix, sub in model.named_modules()
            for target, source in (getattr(sub, "all_tied_weights_keys", None) or {}).items()
            if (f"{prefix}.{source}" if prefix else source) == f"{name}.weight"}


def tied_to_embedding(model: nn.Module, name: str) -> list[str]:
    """The modules tied to the float embedding `name`: those that share its weight, and those a
    transformers model lists as tied to it (listed_as_tied)."""
    old = model.get_submodule(name).weight
    listed = listed_as_tied(model, name)
    return [n for n, m in model.named_modules()
            if n != name and (getattr(m, "weight", None) is old or n in listed)]


def replace_embedding(model: nn.Module, name: str, new: QuantEmbedding) -> list[str]:
    """Puts the QuantEmbedding `new` in `model` at `name` in place of a float embedding; the
    nn.Linear output layers tied to it (tied_to_embedding) become TiedQuantLinear over it
    (tie_output). Returns their names."""
    heads = [n for n in tied_to_embedding(model, name) if type(model.get_submodule(n)) is nn.Linear]
    replace_module(model, name, new)
    for head in heads:
        tie_output(model, head, new)
    return heads


def tie_float_output(model: nn.Module, out_name: str, embedding: nn.Embedding) -> None:
    """The float output projection at `out_name` shares the float `embedding`'s weight, as transformers
    ties them, and the entries tie_output set aside are listed again (save_pretrained writes the
    shared tensor once by them)."""
    model.get_submodule(out_name).weight = embedding.weight
    for _, sub in model.named_modules():
        for attr, keys in vars(sub).pop("_torch_qmm_set_aside", {}).items():
            setattr(sub, attr, {**getattr(sub, attr), **keys})


# transformers' tied-weight mappings {target: source}: the class's, and post_init's expansion over
# the submodels (which tie_weights(recompute_mapping=False) and init_weights read).
_TIED_KEY_ATTRS = ("_tied_weights_keys", "all_tied_weights_keys")


def _tied_keys(model: nn.Module, out_name: str) -> list[tuple[nn.Module, str, str]]:
    """(module, mapping attribute, key): where a module of `model` lists `out_name`.weight, as key."""
    found = []
    for prefix, sub in model.named_modules():
        if prefix and not out_name.startswith(prefix + "."):
            continue
        key = f"{out_name[len(prefix) + 1:] if prefix else out_name}.weight"
        for attr in _TIED_KEY_ATTRS:
            mapping = getattr(sub, attr, None)
            if isinstance(mapping, dict) and key in mapping:
                found.append((sub, attr, key))
    return found


class GGUFFormatState(FormatState):
    """The GGUF type of a module holding GGUF blocks, as its state_dict's ``_extra_state``."""

    FORMAT_FIELDS = ("ggml_type",)

    def describe_format(self, values) -> str:
        return ", ".join(f"ggml_type={v} ({type_name(v)})" for v in values)


class GGUFLinear(GGUFFormatState, nn.Module):
    """y = x @ W.T + bias with W [out, in] kept as GGUF blocks (the native types Q2_K .. Q6_K, IQ4_XS,
    the lattice i-quants IQ1_S .. IQ3_S), decoded in-kernel.

    Buffer ``blocks`` uint8 [out, in/256 * block_bytes]: each row of W is its super-blocks exactly as
    llama.cpp writes them (so a GGUF tensor's data is the buffer, no re-encoding). x may be float32,
    float16 or bfloat16; the output has x's dtype (float32 accumulation; inside torch.autocast, x
    and the output take the autocast dtype, as nn.Linear's do: nn.follows_autocast). The GGUF type is in
    state_dict as ``_extra_state`` (FormatState): the shapes cannot tell, Q4_K blocks with
    in_features=8960 have the shape of Q6_K blocks with 6144. Differentiable in x (gguf_qmm's
    backward, torch_qmm/ops.py); the blocks are frozen.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ggml_type: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dtype = module_dtype(dtype)
        check_positive_ints(in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.ggml_type, row_bytes = native_type(ggml_type, in_features)
        self.register_buffer("blocks", torch.zeros(out_features, row_bytes, dtype=torch.uint8, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @follows_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gguf_matmul(x, self.blocks, self.ggml_type, self.out_features, self.in_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={type_name(self.ggml_type)}, bias={self.bias is not None}"
        )


class GGUFSwitchLinear(GGUFFormatState, nn.Module):
    """y = x @ W[indices].T for a stack of expert weights W [num_experts, out, in] kept as GGUF
    blocks (the native types Q2_K .. Q6_K, IQ4_XS, the lattice i-quants): the GGUF counterpart of QuantSwitchLinear, which QuantFusedExperts takes
    as either of its projections.

    Buffer ``blocks`` uint8 [E, out, in/256 * block_bytes]: expert e's rows exactly as a GGUF file's
    3-D expert tensor (llama.cpp's ``ffn_*_exps``) holds them. The GGUF type is in state_dict as
    ``_extra_state`` (FormatState), as GGUFLinear's. forward(x [..., M, in], indices) ->
    [..., M, out] in x's dtype: each expert's rows of x through gguf_matmul
    (torch_qmm.interop.gguf_gather), plus ``bias[indices]`` where the layer has one (gpt-oss's
    experts: ``bias`` [E, out] in `dtype`, as QuantSwitchLinear's).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, ggml_type: int,
                 device: torch.device | str | None = None, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = module_dtype(dtype)
        check_positive_ints(num_experts=num_experts, in_features=in_features, out_features=out_features)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.ggml_type, row_bytes = native_type(ggml_type, in_features)
        self.register_buffer("blocks", torch.zeros(num_experts, out_features, row_bytes, dtype=torch.uint8,
                                                   device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(num_experts, out_features, dtype=dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @follows_autocast
    def forward(self, x: torch.Tensor, indices: torch.Tensor, sorted_indices: bool = False) -> torch.Tensor:
        # sorted_indices: QuantSwitchLinear's argument; the rows are grouped by expert either way.
        y = gguf_gather_matmul(x, self.blocks, self.ggml_type, self.out_features, self.in_features, indices)
        if self.bias is not None:
            y = y + self.bias[indices.long()].unsqueeze(-2).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, format={type_name(self.ggml_type)}")
