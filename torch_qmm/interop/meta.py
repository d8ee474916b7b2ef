"""Loading into a model built on the meta device (``with torch.device("meta"): model = ...``).

A model built on meta holds shapes and dtypes but no values, so building it costs no memory. The
loaders (load_mlx, load_gguf_llama, load_mlx_sharded, load_mxfp4_checkpoint) then give it real
tensors from the file only: quantized layers are built from the file's tensors, every other
parameter or persistent buffer the file holds gets storage on the target device when it is filled
(MetaTensors.real), and the buffers that no file holds because the model computes them at
construction (non-persistent buffers, e.g. a rotary embedding's inverse frequencies) are computed
again (compute_buffers).
Whatever is still on meta after that is an error (check_no_meta): a loaded model never keeps a
meta tensor or an uninitialised one.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def cast_stored(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for what a file stores (parameters, persistent buffers); the float
    non-persistent buffers, which the model computes (a rotary embedding's inverse frequencies,
    float32 as transformers computes and keeps them), stay as they are. For a float model, before
    any torch_qmm layer is built in it."""
    computed = [(m, n, b) for m in model.modules() for n, b in m._buffers.items()
                if b is not None and n in m._non_persistent_buffers_set and b.is_floating_point()]
    model.to(dtype)
    for m, n, b in computed:
        m._buffers[n] = b


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of `model` on the meta device (a tied tensor under
    each of its names)."""
    return [name for name, t in (*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)) if t.is_meta]


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def resolve_device(model: nn.Module, device: torch.device | str | None, loader: str) -> torch.device | None:
    """The device a load gives the model's meta tensors: `device`, default the CPU; None when the
    model has no meta tensor (the load then copies into the model's own tensors, where they are,
    and `device` must not be given: move such a model with .to())."""
    if has_meta(model):
        target = torch.device(device if device is not None else "cpu")
        if target.type == "meta":
            raise ValueError(f"{loader}: argument 'device' must be a device that holds values (the model's tensors "
                             "are created there from the file), got 'meta'")
        return target
    if device is not None:
        raise ValueError(f"{loader}: argument 'device' applies to a model built on the meta device (where its "
                         f"tensors are then created); this model has its tensors in memory already: move it "
                         f"with model.to({str(device)!r}) instead")
    return None


class MetaTensors:
    """Gives the meta tensors of a model storage on `device` one at a time, as a loader fills
    them. A tensor shared by several modules (tied weights) is replaced in all of them by one new
    tensor, so ties hold."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        # id(meta tensor) -> its owners; the tensors are kept referenced, so no id is reused while
        # a loader replaces modules (dropping their meta tensors) and builds new ones.
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}
        self._kept: list[torch.Tensor] = []
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and t.is_meta:
                        self._owners.setdefault(id(t), []).append((module, name))
                        self._kept.append(t)
        self._done: dict[int, torch.Tensor] = {}

    def real(self, module: nn.Module, name: str) -> torch.Tensor:
        """The parameter or buffer `name` of `module`, given uninitialised storage on the device
        first when it is on meta (the caller fills it at once)."""
        t = module._parameters[name] if name in module._parameters else module._buffers[name]
        if not t.is_meta:
            return t
        if id(t) in self._done:
            return self._done[id(t)]
        new = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if isinstance(t, nn.Parameter):
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        owners = self._owners.get(id(t), [])
        if not any(owner is module and leaf == name for owner, leaf in owners):
            owners = [*owners, (module, name)]
        for owner, leaf in owners:
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            table[leaf] = new
        self._done[id(t)] = new
        return new

    def real_key(self, model: nn.Module, key: str) -> torch.Tensor:
        """As real, for a state_dict key of `model`."""
        module_name, _, leaf = key.rpartition(".")
        return self.real(model.get_submodule(module_name), leaf)


# Two fills of a buffer before it is computed: a computed buffer takes the same values from both;
# one that the computation does not write (or only partly) keeps a fill and differs.
def _fills(dtype: torch.dtype) -> tuple:
    if dtype == torch.bool:
        return False, True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan"), 1.0
    return 0, 1


def _init_fn_of(model: nn.Module) -> dict[int, callable]:
    """{id(module): the weight initialization that applies to it}: the `_init_weights` of the
    innermost transformers model (PreTrainedModel) holding the module, as transformers'
    initialize_weights dispatches it."""
    out: dict[int, callable] = {}

    def walk(module: nn.Module, fn) -> None:
        own = getattr(module, "_init_weights", None)
        if callable(own) and hasattr(module, "config") and hasattr(module, "initialize_weights"):
            fn = own
        if fn is not None:
            out[id(module)] = fn
        for child in module.children():
            walk(child, fn)

    walk(model, None)
    return out


def compute_buffers(model: nn.Module, device: torch.device, where: str) -> list[str]:
    """Computes the non-persistent buffers of `model` still on meta on `device`; returns their
    names.

    No file holds these buffers: the model computes them when it is built (transformers' rotary
    embeddings: inv_freq and original_inv_freq from the config). A model built on meta computed
    nothing, so they are computed here as transformers' from_pretrained computes them: by the
    weight initialization of the transformers model that holds the module (its `_init_weights`,
    which sets a rotary embedding's frequencies from its config by the embedding's rope type).
    Only the module's meta buffers are written: its other tensors are hidden behind meta
    stand-ins while the initialization runs, so nothing loaded is re-initialized.

    The initialization runs twice, on two different fills of the buffers; a buffer it does not
    compute completely keeps a fill and the two results differ: ValueError naming it (so is a
    buffer no transformers model initializes). Empty buffers (a dtype carrier of no elements)
    hold no values and only get storage.
    """
    init_of = _init_fn_of(model)
    computed: list[str] = []
    failed: list[str] = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        names = [n for n, b in module._buffers.items()
                 if b is not None and b.is_meta and n in module._non_persistent_buffers_set]
        if not names:
            continue
        label = (lambda n: f"{module_name}.{n}") if module_name else (lambda n: n)
        for n in [n for n in names if module._buffers[n].numel() == 0]:
            b = module._buffers[n]
            module._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device=device)
            names.remove(n)
        if not names:
            continue
        init = init_of.get(id(module))
        values = _run_init(init, module, names, device) if init is not None else None
        if values is None:
            failed += [label(n) for n in names]
            continue
        module._buffers.update(values)
        computed += [label(n) for n in names]
    if failed:
        raise ValueError(
            f"{where}: the model was built on the meta device and its computed buffers {failed[:8]}"
            f"{' ...' if len(failed) > 8 else ''} are in no file; they could not be computed again (their "
            "module is not in a transformers model whose weight initialization sets them). Build the model with "
            "its buffers in memory (parameters on meta only: torch_qmm.distributed.empty_parameters() or "
            "accelerate's init_empty_weights(include_buffers=False))"
        )
    return computed


def _run_init(init, module: nn.Module, names: list[str], device: torch.device) -> dict[str, torch.Tensor] | None:
    """The buffers `names` of `module` as `init(module)` computes them on `device`, or None when
    they depend on what they held before (two fills, two results)."""
    params, buffers = dict(module._parameters), dict(module._buffers)
    results = []
    try:
        for k in range(2):
            for n, p in params.items():  # stand-ins: the initialization writes nothing that is loaded
                if p is not None:
                    module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad)
            for n, b in buffers.items():
                if b is None:
                    continue
                if n in names:
                    module._buffers[n] = torch.full(b.shape, _fills(b.dtype)[k], dtype=b.dtype, device=device)
                else:
                    module._buffers[n] = torch.empty_like(b, device="meta")
            try:
                with torch.no_grad():
                    init(module)
            except Exception:  # (on the stand-ins, say): not computable this way
                return None
            results.append({n: module._buffers[n] for n in names})
    finally:
        module._parameters.update(params)
        module._buffers.update(buffers)
    first, second = results
    for n in names:
        a, b = first[n], second[n]
        if not (isinstance(b, torch.Tensor) and b.device == device and b.shape == buffers[n].shape
                and b.dtype == buffers[n].dtype and torch.equal(a, b)):
            return None
    return second


def check_no_meta(model: nn.Module, loader: str, path: str | os.PathLike) -> None:
    """ValueError naming the tensors of `model` still on the meta device after a load from `path`."""
    left = meta_tensors(model)
    if left:
        raise ValueError(
            f"{loader}: {path}: the model was built on the meta device and {len(left)} of its tensors have no "
            f"values after the load (the file does not hold them): {left[:8]}{' ...' if len(left) > 8 else ''}"
        )
