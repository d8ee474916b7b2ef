"""Running calibration inputs through the real model, one block at a time, and collecting the
input statistics of its linear layers.

The inputs of the first block (the largest nn.ModuleList of the model, e.g. a decoder's layers)
are captured once by running the model up to it; afterwards every block is run on the outputs of
the previous, already quantized, block (the sequential scheme of GPTQ), so each layer's statistics
see the quantization error of everything before it. Only the statistics of the layers being
quantized are held at a time (sums such as X^T X, never the activations inside a block), and the
hidden states passed from block to block are held in memory up to IN_MEMORY_BYTES per block
boundary, beyond that in a temporary folder (one file per sample, read back one at a time), so
that the calibration's memory does not grow with the number of calibration tokens.
"""

from __future__ import annotations

import ctypes
import inspect
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

Sample = dict[str, Any]

# Block inputs (hidden states and the block's other arguments) held in memory per block boundary;
# the samples past it are kept on disk.
IN_MEMORY_BYTES = 256 * 2**20


def samples(calibration: Iterable) -> list[Sample]:
    """The calibration iterable as a list of model kwargs: a token-id tensor [B, T] (or [T]) becomes
    {"input_ids": ...}; a dict (any mapping, such as a tokenizer's BatchEncoding) is passed through
    as kwargs."""
    if isinstance(calibration, (torch.Tensor, str, bytes, Mapping)):
        raise TypeError("argument 'calibration' must be an iterable of model inputs (token-id tensors [1, T] "
                        f"or dicts of model kwargs), got a single {type(calibration).__name__}"
                        + (" (one sample's kwargs: pass [it])" if isinstance(calibration, Mapping) else ""))
    out: list[Sample] = []
    for i, item in enumerate(calibration):
        if isinstance(item, torch.Tensor):
            if item.dtype not in (torch.int32, torch.int64) or item.dim() not in (1, 2) or item.numel() == 0:
                raise ValueError(f"argument 'calibration': item {i} must be a non-empty integer token-id tensor [1, T], "
                                 f"got {item.dtype} of shape {tuple(item.shape)}")
            out.append({"input_ids": item if item.dim() == 2 else item.unsqueeze(0)})
        elif isinstance(item, Mapping):
            out.append(dict(item))
        else:
            raise TypeError(f"argument 'calibration': item {i} must be a token-id tensor or a dict of model kwargs, "
                            f"got {type(item).__name__}")
    if not out:
        raise ValueError("argument 'calibration' is empty")
    return out


def find_blocks(model: nn.Module, names: Iterable[str]) -> tuple[str, nn.ModuleList] | None:
    """The nn.ModuleList holding the most of the named layers (the repeated blocks), or None."""
    names = list(names)
    best, best_count = None, 0
    for list_name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            prefix = list_name + "." if list_name else ""
            count = sum(n.startswith(prefix) for n in names)
            if count > best_count:
                best, best_count = (list_name, m), count
    return best


class _Stop(Exception):
    pass


@dataclass
class BlockInput:
    """One sample's positional and keyword arguments of a block; args[0] or kwargs["hidden_states"]
    is the hidden state that flows from block to block."""

    args: tuple
    kwargs: dict = field(default_factory=dict)

    def hidden(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]

    def with_hidden(self, h: torch.Tensor) -> "BlockInput":
        if self.args:
            return BlockInput((h,) + tuple(self.args[1:]), self.kwargs)
        return BlockInput((), {**self.kwargs, "hidden_states": h})


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


class BlockInputs:
    """The block inputs of every calibration sample, in order: in memory while they fit in
    `budget` bytes, the rest saved in a temporary folder and loaded back one at a time while
    iterating. close() (or the end of the walk) removes the folder."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = IN_MEMORY_BYTES if budget is None else budget
        self._items: list[BlockInput | Path] = []
        self._bytes = 0
        self._dir: Path | None = None

    def append(self, x: BlockInput) -> None:
        size = _tensor_bytes((x.args, x.kwargs))
        if self._bytes + size <= self.budget:
            self._items.append(x)
            self._bytes += size
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="torch_qmm_calibration_"))
        path = self._dir / f"{len(self._items)}.pt"
        torch.save((x.args, x.kwargs), path)
        self._items.append(path)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        for item in self._items:
            if isinstance(item, Path):
                # Our own files, in a folder only this user can read (mkdtemp), of any argument type.
                args, kwargs = torch.load(item, weights_only=False)
                yield BlockInput(tuple(args), dict(kwargs))
            else:
                yield item

    @property
    def on_disk(self) -> int:
        return sum(isinstance(i, Path) for i in self._items)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._items.clear()
        self._bytes = 0


def _no_cache(model: nn.Module, kwargs: Sample) -> Sample:
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "use_cache" not in kwargs:
        return {**kwargs, "use_cache": False}
    return kwargs


def _check_token_ids(model: nn.Module, i: int, kwargs: Sample) -> None:
    """Token ids outside the model's input embedding (another tokenizer's) are a ValueError naming
    the sample, the id and the vocabulary size (the embedding would raise a bare IndexError)."""
    ids = kwargs.get("input_ids")
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or not isinstance(embedding, nn.Embedding):
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= embedding.num_embeddings:
        raise ValueError(f"argument 'calibration': sample {i} holds token id {low if low < 0 else high}, outside the "
                         f"model's vocabulary of {embedding.num_embeddings} ids (tokenized for another model?)")


@torch.no_grad()
def capture_block_inputs(model: nn.Module, first_block: nn.Module, data: list[Sample]) -> BlockInputs:
    """Runs the model on each sample until `first_block` and returns what it was called with."""
    captured = BlockInputs()

    def hook(_module, args, kwargs):
        captured.append(BlockInput(tuple(args), dict(kwargs)))
        raise _Stop

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for i, kwargs in enumerate(data):
            _check_token_ids(model, i, kwargs)
            try:
                model(**_no_cache(model, kwargs))
            except _Stop:
                continue
            except Exception as e:
                raise ValueError(f"argument 'calibration': the model's forward on sample {i} failed: "
                                 f"{type(e).__name__}: {e}") from e
            raise ValueError(f"argument 'calibration': sample {i} ran through the model without reaching its blocks")
    except BaseException:
        captured.close()
        raise
    finally:
        handle.remove()
    return captured


@torch.no_grad()
def run_block(block: nn.Module, inputs: BlockInputs) -> BlockInputs:
    """The block's outputs as the next block's inputs."""
    out = BlockInputs(inputs.budget)
    try:
        for x in inputs:
            y = block(*x.args, **x.kwargs)
            out.append(x.with_hidden(y[0] if isinstance(y, (tuple, list)) else y))
    except BaseException:
        out.close()
        raise
    return out


class InputStats:
    """Per linear input: H = sum x^T x (float32 [K, K]), sum |x| and the row count, accumulated by
    forward hooks. Linears that receive the very same input tensor share one entry (their `key`)."""

    def __init__(self, layers: dict[str, nn.Linear], hessian: bool = True,
                 producers: dict[str, nn.Module] | None = None) -> None:
        self.layers = layers
        # Modules whose output tensor is recorded: fed_by[key] names the one that produced a
        # layer's input (e.g. the norm in front of q/k/v), when one did.
        self.producers = producers or {}
        self.fed_by: dict[str, str] = {}
        self.hessian = hessian
        self.key: dict[str, str] = {}  # layer name -> the name whose entry holds its statistics
        self.h: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        # This pass's inputs, held (so that no address is reused) with the layer that saw them first.
        self._seen: list[tuple[torch.Tensor, str]] = []
        self._handles = []

    def __enter__(self) -> "InputStats":
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_hook(self._hook(name)))
        for name, module in self.producers.items():
            self._handles.append(module.register_forward_hook(self._producer_hook(name)))
        return self

    def _producer_hook(self, name: str):
        def hook(_module, _args, output):
            if isinstance(output, torch.Tensor):
                self._seen.append((output, name))
        return hook

    def __exit__(self, *exc) -> None:
        self._seen.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_pass(self) -> None:
        """Forget input identities (call before each sample: tensor addresses are reused)."""
        self._seen.clear()

    def _hook(self, name: str):
        def hook(_module, args, _output):
            x = args[0]
            matches = [n for t, n in self._seen if t is x]
            producer = next((n for n in matches if n in self.producers), None)
            owner = next((n for n in matches if n not in self.producers), None)
            if producer is not None:
                self.fed_by.setdefault(name, producer)
            if owner is not None and owner != name:
                self.key.setdefault(name, owner)
                return
            if owner is None:
                self._seen.append((x, name))
            self.key.setdefault(name, name)
            if self.key[name] != name:
                return
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            if name not in self.rows:
                k = x2.shape[-1]
                self.h[name] = torch.zeros(k, k) if self.hessian else torch.zeros(0)
                self.abs_sum[name] = torch.zeros(k)
                self.rows[name] = 0
            if self.hessian:
                self.h[name].addmm_(x2.T, x2)
            self.abs_sum[name] += x2.abs().sum(0)
            self.rows[name] += x2.shape[0]
        return hook

    def of(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(H, mean |x|, rows) of a layer's input."""
        k = self.key[name]
        return self.h[k], self.abs_sum[k] / max(self.rows[k], 1), self.rows[k]


@torch.no_grad()
def collect(block: nn.Module, inputs: BlockInputs, layers: dict[str, nn.Linear], hessian: bool = True,
            producers: dict[str, nn.Module] | None = None) -> InputStats:
    """Runs the block on every input with statistics hooks on `layers` (and output tracking on
    `producers`)."""
    stats = InputStats(layers, hessian, producers)
    with stats:
        for x in inputs:
            stats.new_pass()
            block(*x.args, **x.kwargs)
    missing = [n for n in layers if n not in stats.key]
    if missing:
        raise RuntimeError(f"calibration never reached the layers {missing} (are they used in forward?)")
    release_freed_memory()  # the block's activations
    return stats


@torch.no_grad()
def collect_model(model: nn.Module, data: list[Sample], layers: dict[str, nn.Linear], hessian: bool = True) -> InputStats:
    """Statistics of `layers` from full forward passes of the model (layers outside the blocks)."""
    stats = InputStats(layers, hessian)
    with stats:
        for kwargs in data:
            stats.new_pass()
            model(**_no_cache(model, kwargs))
    missing = [n for n in layers if n not in stats.key]
    if missing:
        raise RuntimeError(f"calibration never reached the layers {missing} (are they used in forward?)")
    return stats


def _libc_malloc_trim():
    """glibc's malloc_trim, or None off glibc."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim() if sys.platform.startswith("linux") else None


def release_freed_memory() -> None:
    """Hands the heap memory freed by a block's work back to the system. glibc keeps freed
    allocations below its (adaptive, up to 32 MiB) mmap threshold in the heap, so without this the
    resident set would keep every block's peak of temporaries; a no-op off glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def walk(model: nn.Module, layers: Iterable[str], data: list[Sample], on_block, on_rest, after_block=None) -> None:
    """Visits the named layers block by block in execution order: on_block(block, prefix, inputs,
    layers of the block) -- which may quantize them -- then the block is run on `inputs` to give the
    next block's inputs, and after_block(layers of the block) is told that they are no longer run
    by the walk; layers outside the blocks go to on_rest(layers) at the end. Each block's layers
    are looked up in the model when it is reached, so the walk holds no layer of a block that is
    done (after_block may replace them)."""
    remaining = list(layers)
    found = find_blocks(model, remaining)
    if found is not None:
        list_name, blocks = found
        inputs = capture_block_inputs(model, blocks[0], data)
        try:
            for i, block in enumerate(blocks):
                prefix = f"{list_name}.{i}." if list_name else f"{i}."
                later = tuple(f"{list_name}.{j}." if list_name else f"{j}." for j in range(i, len(blocks)))
                mine = {n: model.get_submodule(n) for n in remaining if n.startswith(prefix)}
                if mine:
                    on_block(block, prefix, inputs, mine)
                    remaining = [n for n in remaining if n not in mine]
                    release_freed_memory()
                last = not any(n.startswith(later) for n in remaining)
                if not last:
                    outputs = run_block(block, inputs)
                    inputs.close()
                    inputs = outputs
                if mine and after_block is not None:
                    after_block(mine)
                del mine
                if last:
                    break
        finally:
            inputs.close()
    if remaining:
        on_rest({n: model.get_submodule(n) for n in remaining})


def groups(stats: InputStats) -> dict[str, list[str]]:
    """Layers by shared input, in the order the forward pass reached them: key -> member names."""
    out: dict[str, list[str]] = {}
    for name, key in stats.key.items():
        out.setdefault(key, []).append(name)
    return out


def from_text(tokenizer, text: str, seq_len: int = 512, max_samples: int = 32) -> list[torch.Tensor]:
    """Plain text as calibration samples: tokenized with the model's tokenizer (no special tokens)
    and cut into consecutive [1, seq_len] windows (the last one may be shorter), at most max_samples."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("calibration text is empty after tokenization")
    if len(ids) < 2:
        raise ValueError(f"calibration text is {len(ids)} token long after tokenization; a sample needs at least 2")
    windows = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)][:max_samples]
    return [torch.tensor([w], dtype=torch.int64) for w in windows if len(w) > 1]
