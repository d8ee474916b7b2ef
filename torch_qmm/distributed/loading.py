"""A checkpoint (an MLX folder, or transformers' save of a torch_qmm model) loaded straight into each rank's slices: the model is built with its
parameters on the meta device, its quantized layers are swapped in and partitioned by the plan,
and every rank then reads from the safetensors files only the slice its DTensors hold
(`safe_open(...).get_slice`); no rank ever holds a whole sharded tensor.

    with empty_parameters():
        model = LlamaForCausalLM(config)            # parameters on meta, buffers real
    # or `with torch.device("meta"):`, buffers too: the computed ones (rotary frequencies) are
    # computed again after the load (torch_qmm.interop.meta.compute_buffers)
    report = load_mlx_sharded(model, "mlx-model", mesh, tp_plan(model))
    # or load_pretrained_sharded(model, folder, ...) for transformers' save of a torch_qmm model
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..format_state import FORMAT_STATE_KEY
from ..interop.json_files import read_json_object
from ..interop.mlx import (_SAFETENSORS_DTYPES, QuantSpec, _check_dtype, _check_quantized_shapes, dequantized_weight,
                           is_router, model_type_of, parse_quantization)
from ..interop.meta import cast_stored, check_no_meta, compute_buffers
from ..interop.modules import QuantEmbedding, embedding_scale, replaceable_embedding
from ..interop.safetensors_io import Checkpoint
from ..nn import QuantLinear
from ..interop.experts import empty_quant_experts, fused_experts
from ..interop.mlx_experts import (PROJECTIONS, empty_stored_experts, from_mlx_key, mlx_experts_path, stored_parts,
                                   to_mlx_key)
from ..nn_moe import join_gate_up
from .partition import rows_of_rank
from .styles import parallelize


@contextlib.contextmanager
def empty_parameters():
    """Modules built inside get their parameters on the meta device (their buffers stay real: a
    non-persistent buffer such as a rotary embedding's frequencies is computed at construction and
    is in no checkpoint). A parameter is allocated uninitialised first and moved at once (as
    accelerate's init_empty_weights(include_buffers=False)); its initialisation then runs on meta."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@dataclasses.dataclass
class ShardedLoadReport:
    """What one rank loaded: quantized layers (name -> format) and the bytes it read from the files."""

    quantized: dict[str, str]
    bytes_read: int
    bytes_total: int  # of the tensors loaded, whole

    def __str__(self) -> str:
        return (f"{len(self.quantized)} quantized layers, {self.bytes_read / 2**20:.1f} MiB read of "
                f"{self.bytes_total / 2**20:.1f} MiB")


def _quantized_experts(model: nn.Module, ckpt: Checkpoint, model_type: str | None, spec_of, dtype: torch.dtype,
                       quantized: dict[str, str]) -> dict[str, str]:
    """Swaps the fused experts the checkpoint stores quantized (mlx_lm's SwitchGLU: gate_proj,
    up_proj, down_proj [E, out, in]) for a QuantFusedExperts on meta; returns {model path: mlx_lm
    path} of them."""
    experts = {}
    for name, module in fused_experts(model):
        prefix = mlx_experts_path(name, model_type)
        stored = {proj: f"{prefix}.{proj}.scales" in ckpt for proj in PROJECTIONS}
        if not any(stored.values()):
            if any(f"{prefix}.{proj}.weight" in ckpt for proj in PROJECTIONS):
                raise ValueError(f"{ckpt.path}: the experts {prefix} are stored float; a sharded load takes quantized "
                                 "experts (QuantExpertsParallel); load them with torch_qmm.interop.load_mlx")
            continue
        new, quantized[name] = empty_stored_experts(ckpt, module, prefix, spec_of, dtype, _check_quantized_shapes,
                                                    device="meta")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        experts[name] = prefix
    return experts


def _quantized_layers(model: nn.Module, ckpt: Checkpoint, config_path: Path, dtype: torch.dtype, routers: dict
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """Swaps the layers the checkpoint stores quantized for QuantLinear / QuantEmbedding /
    QuantFusedExperts on meta; returns ({path: format}, {experts path: mlx_lm path}). The MoE
    routers mlx_lm stores quantized stay float: routers gets {model key of the weight: (its
    checkpoint keys, its float32 values)} (each rank reads them whole: a router is small and
    replicated)."""
    config = read_json_object(config_path) if config_path.is_file() else {}
    default, overrides = parse_quantization(config, str(config_path))

    def spec_of(path: str):
        spec = overrides.get(path, default)
        if not isinstance(spec, QuantSpec):
            raise ValueError(f"{ckpt.path}: the checkpoint stores quantized layer {path!r} but {config_path} gives it "
                             f"no format ({spec!r})")
        return spec

    quantized: dict[str, str] = {}
    model_type = model_type_of(config, config_path)
    experts = _quantized_experts(model, ckpt, model_type, spec_of, dtype, quantized)
    taken = tuple(f"{prefix}." for prefix in experts.values())
    for key in ckpt.keys():
        if not key.endswith(".scales") or key.startswith(taken):
            continue
        path = key[: -len(".scales")]
        spec = overrides.get(path, default)
        if not isinstance(spec, QuantSpec):
            raise ValueError(f"{ckpt.path}: the checkpoint stores quantized layer {path!r} but {config_path} gives it "
                             f"no format ({spec!r})")
        try:
            module = model.get_submodule(from_mlx_key(path + ".", model_type)[:-1])
        except AttributeError:
            raise ValueError(f"{ckpt.path}: quantized layer {path!r} does not exist in the model") from None
        if is_router(module) or (isinstance(module, nn.Embedding) and not replaceable_embedding(module)):
            # (a router, or an embedding whose forward a QuantEmbedding does not do: float, as load_mlx)
            routers[f"{from_mlx_key(path + '.', model_type)[:-1]}.weight"] = (
                [f"{path}.{part}" for part in stored_parts(spec)], dequantized_weight(ckpt, path, spec, module))
            continue
        if isinstance(module, nn.Linear):
            _check_quantized_shapes(ckpt, path, spec, module.out_features, module.in_features)
            new = QuantLinear(module.in_features, module.out_features, bias=f"{path}.bias" in ckpt, bits=spec.bits,
                              group_size=spec.group_size, device="meta", dtype=dtype, mode=spec.mode)
        elif isinstance(module, nn.Embedding):
            _check_quantized_shapes(ckpt, path, spec, module.num_embeddings, module.embedding_dim)
            new = QuantEmbedding(module.num_embeddings, module.embedding_dim, spec.bits, spec.group_size,
                                 device="meta", dtype=dtype, mode=spec.mode, embed_scale=embedding_scale(module))
        else:
            raise ValueError(f"{ckpt.path}: quantized layer {path!r} is a {type(module).__name__}, expected nn.Linear "
                             "or nn.Embedding")
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        quantized[path] = str(spec)
    return quantized, experts


def _tied_heads(model: nn.Module) -> dict[str, str]:
    """{output layer path: embedding path} of the nn.Linear layers whose weight is an embedding's
    (a tied head), seen before any layer is replaced."""
    embedding_of = {id(m.weight): n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    return {n: embedding_of[id(m.weight)] for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m.weight) in embedding_of}


def _untie_heads(model: nn.Module, ckpt: Checkpoint, tied: dict[str, str], quantized: dict[str, str],
                 dtype: torch.dtype) -> dict[str, str]:
    """A checkpoint stores a tied head only as its embedding. The plan splits the head and the
    embedding with different styles (e.g. lm_head colwise, the embedding by vocabulary rows), so
    each becomes a layer of its own that reads the embedding's tensors: a QuantLinear in the
    embedding's format where the embedding is quantized, else the float weight. Returns
    {model key of the head: model key of the embedding tensor it reads}."""
    alias: dict[str, str] = {}
    for out, emb in tied.items():
        if f"{out}.weight" in ckpt or f"{out}.scales" in ckpt:
            continue  # stored untied: read as it is
        embedding = model.get_submodule(emb)
        if isinstance(embedding, QuantEmbedding):
            head = QuantLinear(embedding.embedding_dim, embedding.num_embeddings, bias=False, bits=embedding.bits,
                               group_size=embedding.group_size, device="meta", dtype=dtype, mode=embedding.mode)
            parent, _, child = out.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, head)
            quantized[out] = quantized[emb]
            alias.update({f"{out}.{t}": f"{emb}.{t}" for t in ("qweight", "scales", "biases")})
        else:
            alias[f"{out}.weight"] = f"{emb}.weight"
    return alias


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for every meta parameter and persistent buffer (a
    DTensor's local slice), which the checkpoint then fills. Non-persistent buffers are in no
    checkpoint: they stay on meta here and are computed after the load (compute_buffers)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if table is module._buffers and name in module._non_persistent_buffers_set:
                    continue
                if isinstance(t, DTensor):
                    local = torch.empty(t._local_tensor.shape, dtype=t.dtype, device=device)
                    new = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                             stride=t.stride())
                else:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                table[name] = nn.Parameter(new, requires_grad=t.requires_grad) if table is module._parameters else new


def _slices(t: torch.Tensor) -> tuple[slice, ...]:
    """The global index range of this rank's part of `t` (all of it for a plain tensor)."""
    if not isinstance(t, DTensor):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for n, o in zip(shape, offset))


# Our name of a QuantSwitchLinear tensor -> mlx_lm's.
_LEAVES = (("qweight", "weight"), ("scales", "scales"), ("biases", "biases"), ("bias", "bias"))


def _experts_keys(experts: dict[str, str]) -> dict[str, list[str]]:
    """Model key of each experts tensor -> its checkpoint keys (gate_up_proj: gate_proj's and up_proj's)."""
    keys = {}
    for path, prefix in experts.items():
        for leaf, stored in _LEAVES:
            keys[f"{path}.gate_up_proj.{leaf}"] = [f"{prefix}.gate_proj.{stored}", f"{prefix}.up_proj.{stored}"]
            keys[f"{path}.down_proj.{leaf}"] = [f"{prefix}.down_proj.{stored}"]
    return keys


def _gate_up_part(read, keys: list[str], dst: torch.Tensor, interleaved: bool, ckpt: Checkpoint) -> torch.Tensor:
    """This rank's part of a gate_up tensor from the stored gate and up tensors [E, I, ...]: the
    rows of its intermediate features of each (all of them when `dst` is not sharded), joined in
    the layer's row order (experts.packed_local's layout)."""
    inter = dst.shape[1] // 2
    want = (dst.shape[0], inter, *dst.shape[2:])
    start, n = 0, inter
    if isinstance(dst, DTensor) and not all(p.is_replicate() for p in dst.placements):
        start, n = rows_of_rank(inter, dst.device_mesh.get_local_rank(), dst.device_mesh.size())
    parts = []
    for key in keys:
        if tuple(ckpt.shape(key)) != want:
            raise ValueError(f"{ckpt.path}: tensor {key!r} has shape {list(ckpt.shape(key))}, the model expects "
                             f"{list(want)}")
        _check_dtype(ckpt, key, dst)
        parts.append(ckpt.finite_scales(key, read(key)[:, start:start + n]))
    return join_gate_up(*parts, interleaved)


def _packed_part(read, key: str, dst: torch.Tensor, interleaved: bool, ckpt: Checkpoint) -> torch.Tensor:
    """This rank's part of a gate_up tensor stored whole [E, 2I, ...] (experts.packed_local's
    layout): the rows of its intermediate features of the gate and of the up rows, read as slices
    (interleaved rows: one run of rows; else two)."""
    if tuple(ckpt.shape(key)) != tuple(dst.shape):
        raise ValueError(f"{ckpt.path}: tensor {key!r} has shape {list(ckpt.shape(key))}, the model expects "
                         f"{list(dst.shape)}")
    _check_dtype(ckpt, key, dst)
    inter = dst.shape[1] // 2
    start, n = 0, inter
    if isinstance(dst, DTensor) and not all(p.is_replicate() for p in dst.placements):
        start, n = rows_of_rank(inter, dst.device_mesh.get_local_rank(), dst.device_mesh.size())
    view = read(key)
    if interleaved:
        return ckpt.finite_scales(key, view[:, 2 * start:2 * (start + n)])
    gate, up = view[:, start:start + n], view[:, inter + start:inter + start + n]
    return ckpt.finite_scales(key, join_gate_up(gate, up, interleaved))


def _load_slices(model: nn.Module, ckpt: Checkpoint, mesh: DeviceMesh, plan, device, quantized: dict[str, str],
                 key_of, experts: dict[str, str] | None = None, loader: str = "load_mlx_sharded",
                 routers: dict | None = None, packed_gate_up: dict[str, bool] | None = None) -> ShardedLoadReport:
    """Partitions `model` by `plan`, allocates each rank's slices and reads them. key_of: model
    key -> checkpoint key; experts: {QuantFusedExperts path: mlx_lm path} stored as mlx_lm's
    three SwitchLinear layers; routers: {model key: (checkpoint keys, float32 values)} of the
    routers stored quantized; packed_gate_up: {model key: interleaved} of the gate_up tensors of quantized
    experts stored as the layer holds them (gate and up rows in one tensor)."""
    _check_same_checkpoint(ckpt, mesh)
    parallelize(model, mesh, plan)
    _materialize(model, torch.device(device))
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if k.rpartition(".")[2] != FORMAT_STATE_KEY}
    packed = _experts_keys(experts or {})
    routers, packed_gate_up = routers or {}, packed_gate_up or {}
    packed.update({k: keys for k, (keys, _) in routers.items()})
    keys = {k: packed.get(k) or [key_of(k)] for k in state}  # model key -> checkpoint keys
    missing = sorted(k for k, ks in keys.items() if any(key not in ckpt for key in ks))
    used = {key for ks in keys.values() for key in ks}
    unexpected = sorted(k for k in set(ckpt.keys()) - used if k.rpartition(".")[2] != FORMAT_STATE_KEY)
    if missing or unexpected:
        raise ValueError(f"{ckpt.path}: checkpoint does not match the model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    report = ShardedLoadReport(quantized=quantized, bytes_read=0, bytes_total=0)
    with torch.no_grad(), contextlib.ExitStack() as files:
        opened = {}

        def read(key: str):
            file = ckpt.where[key]
            if file not in opened:
                opened[file] = files.enter_context(safe_open(file, framework="pt"))
            return opened[file].get_slice(key)

        for k, dst in state.items():
            ks = keys[k]
            if k in routers:
                part = routers[k][1].to(dst.dtype)[_slices(dst)]
            elif k in packed_gate_up:
                part = _packed_part(read, ks[0], dst, packed_gate_up[k], ckpt)
            elif len(ks) == 2:
                layer = model.get_submodule(k.rpartition(".gate_up_proj.")[0])
                part = _gate_up_part(read, ks, dst, layer.interleaved, ckpt)
            else:
                (key,) = ks
                if tuple(ckpt.shape(key)) != tuple(dst.shape):
                    raise ValueError(f"{ckpt.path}: tensor {key!r} has shape {list(ckpt.shape(key))}, the model "
                                     f"expects {list(dst.shape)}")
                _check_dtype(ckpt, key, dst)
                part = ckpt.finite_scales(key, read(key)[_slices(dst)])
            local = dst._local_tensor if isinstance(dst, DTensor) else dst
            local.copy_(part)
            report.bytes_read += part.numel() * part.element_size()
            report.bytes_total += sum(ckpt.nbytes(key) for key in ks)
    compute_buffers(model, torch.device(device), f"{loader}: {ckpt.path}")
    check_no_meta(model, loader, ckpt.path)
    return report


def _check_same_checkpoint(ckpt: Checkpoint, mesh: DeviceMesh) -> None:
    """Every rank must read its slices of one checkpoint: ranks given folders of other formats or
    configs (a path that differs from machine to machine) would each load without error and
    compute together wrong numbers. The ranks compare a digest of the tensors' names, dtypes and
    shapes and of config.json (two copies that differ only in their values are not told apart)."""
    folder = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
    digest = hashlib.sha256(json.dumps([(k, ckpt.dtype_name(k), ckpt.shape(k)) for k in sorted(ckpt.keys())]).encode())
    if (folder / "config.json").is_file():
        digest.update((folder / "config.json").read_bytes())
    mine = (digest.hexdigest(), str(ckpt.path))
    every: list = [None] * mesh.size()
    dist.all_gather_object(every, mine, group=mesh.get_group())
    if len({d for d, _ in every}) > 1:
        raise ValueError(f"{ckpt.path}: the ranks were given different checkpoints (tensor names, dtypes, shapes or "
                         "config.json differ): " + "; ".join(f"rank {r}: {p} ({d[:12]})" for r, (d, p) in
                                                             enumerate(every)))


def _checkpoint_dtype(ckpt: Checkpoint) -> torch.dtype:
    floats = Counter(_SAFETENSORS_DTYPES[ckpt.dtype_name(k)] for k in ckpt.keys()
                     if ckpt.dtype_name(k) in _SAFETENSORS_DTYPES)
    return floats.most_common(1)[0][0] if floats else torch.float32


def load_mlx_sharded(model: nn.Module, path: str | os.PathLike, mesh: DeviceMesh, plan,
                     dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> ShardedLoadReport:
    """Loads an MLX model folder into `model` (parameters on meta, see empty_parameters; or built
    wholly on meta, `with torch.device("meta")`: the buffers it computes rather than stores, a
    rotary embedding's frequencies, are then computed after the load by the model's transformers
    initialization, torch_qmm.interop.meta.compute_buffers), partitioned by `plan` (parallelize_module's plan, e.g. tp_plan(model)) over `mesh`; each rank
    reads only its slices. Every model tensor must be in the checkpoint and every checkpoint tensor
    used (the format of a quantized layer comes from config.json). The quantized experts of a MoE
    block (mlx_lm's switch_mlp gate_proj / up_proj / down_proj, the names by config.json's
    model_type) become a QuantFusedExperts, each rank reading its rows of gate_proj and up_proj and
    its columns of down_proj; the routers mlx_lm stores quantized stay float (dequantized, as
    load_mlx does), read whole by every rank. An output layer tied to the embedding (stored once, as the
    embedding) becomes a layer of its own reading the embedding's tensors, each split as the plan
    says (a rank holds its slices of that table twice). dtype: the compute dtype
    (default: the checkpoint's most common float dtype); device: where the slices go.
    """
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    ckpt = Checkpoint(path)
    dtype = dtype or _checkpoint_dtype(ckpt)
    cast_stored(model, dtype)
    config = read_json_object(folder / "config.json") if (folder / "config.json").is_file() else {}
    model_type = model_type_of(config, folder / "config.json")
    tied = _tied_heads(model)
    routers: dict = {}
    quantized, experts = _quantized_layers(model, ckpt, folder / "config.json", dtype, routers)
    alias = _untie_heads(model, ckpt, tied, quantized, dtype)
    weights = {f"{p}.qweight": f"{p}.weight" for p in quantized}

    def key_of(k: str) -> str:
        k = alias.get(k, k)
        return to_mlx_key(weights.get(k, k), model_type)

    return _load_slices(model, ckpt, mesh, plan, device, quantized, key_of, experts, routers=routers)


def load_pretrained_sharded(model: nn.Module, folder: str | os.PathLike, mesh: DeviceMesh, plan,
                            dtype: torch.dtype | None = None,
                            device: str | torch.device = "cpu") -> ShardedLoadReport:
    """As load_mlx_sharded, for a folder saved by transformers' save_pretrained with torch_qmm's
    quantization_config (quant_method "torch_qmm"): the layers it stores as QuantLinear or
    QuantEmbedding (`<layer>.qweight`) become those in the saved format (a head tied to a quantized
    embedding: a QuantLinear reading its tensors, as load_mlx_sharded), checked against each layer's saved
    format state (`_extra_state`), and the quantized experts of MoE blocks (their QuantFusedExperts
    buffers, gate_up packed; under the names transformers' save gives them: a Mixtral block is
    block_sparse_moe) become QuantFusedExperts, each rank reading its rows of gate_up (two runs
    of rows, or one where they interleave) and its columns of down_proj."""
    folder = Path(folder)
    config = read_json_object(folder / "config.json")
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "torch_qmm":
        raise ValueError(f"{folder / 'config.json'}: 'quantization_config' must have quant_method 'torch_qmm', "
                         f"got {q!r}")
    from ..interop.transformers import experts_bits_keys, stored_key  # (transformers: the folder is its save)

    ckpt = Checkpoint(folder)
    stored = stored_key(model, ckpt)
    dtype = dtype or _checkpoint_dtype(ckpt)
    cast_stored(model, dtype)
    bits = q.get("bits")
    if bits is not None and not isinstance(bits, (int, dict)):
        raise ValueError(f"{folder / 'config.json'}: quantization_config 'bits' must be an integer, a mapping layer -> "
                         f"bits or null, got {bits!r}")
    tied = _tied_heads(model)
    quantized = {}

    def bits_of(name: str):
        return bits if not isinstance(bits, dict) else bits.get(name, bits.get("*"))

    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear and not isinstance(module, nn.Embedding):
            continue
        if stored(f"{name}.qweight") not in ckpt:
            continue
        layer_bits, group_size, mode = bits_of(name), q.get("group_size"), q.get("mode", "affine")
        try:  # the format's checks (bits, group_size, mode and how they go together) name the argument
            if isinstance(module, nn.Embedding):  # (the embeddings the config lists; a tied head: _untie_heads)
                if not replaceable_embedding(module):
                    raise ValueError(f"a {type(module).__name__} has a forward of its own, which a QuantEmbedding "
                                     "does not do")
                new = QuantEmbedding(module.num_embeddings, module.embedding_dim, layer_bits, group_size,
                                     device="meta", dtype=dtype, mode=mode, embed_scale=embedding_scale(module))
            else:
                new = QuantLinear(module.in_features, module.out_features, bias=stored(f"{name}.bias") in ckpt,
                                  bits=layer_bits, group_size=group_size, device="meta", dtype=dtype, mode=mode)
        except ValueError as e:
            raise ValueError(f"{folder / 'config.json'}: quantization_config of layer {name!r}: {e}") from None
        state_key = stored(f"{name}.{FORMAT_STATE_KEY}")
        if state_key in ckpt:
            new._check_format_state(ckpt.get(state_key), f"{ckpt.path}: {state_key!r}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        quantized[name] = f"{new.mode} b{new.bits} gs{new.group_size}"
    gate_up = {}  # model key of a gate_up tensor stored packed -> whether its rows interleave
    for name, module in fused_experts(model):
        if stored(f"{name}.gate_up_proj.qweight") not in ckpt:
            continue  # float experts: read as any float tensor
        gate_up_bits, down_bits = (bits_of(key) for key in experts_bits_keys(bits, name))
        try:
            new = empty_quant_experts(module, gate_up_bits, q.get("group_size"), q.get("mode", "affine"), dtype,
                                      device="meta", down=(down_bits, q.get("group_size"), q.get("mode", "affine")))
        except ValueError as e:
            raise ValueError(f"{folder / 'config.json'}: quantization_config of the experts {name!r}: {e}") from None
        for proj in ("gate_up_proj", "down_proj"):
            state_key = stored(f"{name}.{proj}.{FORMAT_STATE_KEY}")
            if state_key in ckpt:
                getattr(new, proj)._check_format_state(ckpt.get(state_key), f"{ckpt.path}: {state_key!r}")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        widths = "/".join(map(str, sorted({new.gate_up_proj.bits, new.down_proj.bits})))
        quantized[name] = f"{new.down_proj.mode} b{widths} gs{new.down_proj.group_size}"
        gate_up.update({f"{name}.gate_up_proj.{leaf}": new.interleaved for leaf in ("qweight", "scales", "biases", "bias")})
    alias = _untie_heads(model, ckpt, tied, quantized, dtype)
    return _load_slices(model, ckpt, mesh, plan, device, quantized, lambda k: stored(alias.get(k, k)),
                        loader="load_pretrained_sharded", packed_gate_up=gate_up)
