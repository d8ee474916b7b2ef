"""Audit list 12: 15 Python mutants written from the product sources alone (torch_qmm/; by someone
who had not read the tests that cover them), none of them a bug of an earlier list, concentrated on
the code changed in d195af8: load_mxfp4_checkpoint and _read_experts taking a model built on the
meta device (interop/mxfp4_blocks.py: the `device` argument, where the experts are built, the float
tensors created from the file, the computed buffers, the meta leftovers, the dtype of a meta-built
model and its experts) and the helpers of interop/meta.py they use (resolve_device's refusal of
device='meta', has_meta, compute_buffers' choice of buffers and its empty ones, _run_init's restore
of the stand-ins and the errors it turns into a ValueError).

Selections are two test files chosen by their names and by which of them name the function under
test (`grep -l`, not reading them), the likeliest first: pytest runs with -x, so a kill stops at the
first failing test. Results: tests/mutation/README.md ("Audit list 12")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

MXFP4 = _files("tests/test_load_meta.py", "tests/test_moe_gpt_oss_mxfp4.py")
META = _files("tests/test_load_meta.py", "tests/test_hostile_files.py")

MUTANTS: list[Mutant] = [
    # ---- mxfp4_blocks.py: load_mxfp4_checkpoint of a model built on meta ---------------------------
    Mutant("m12-mxfp4-device-argument-dropped", "torch_qmm/interop/mxfp4_blocks.py",
           '    dev = resolve_device(model, device, "load_mxfp4_checkpoint")',
           '    dev = resolve_device(model, None, "load_mxfp4_checkpoint")', MXFP4,
           "load_mxfp4_checkpoint ignores its `device`: a meta-built model always lands on the CPU, "
           "device='meta' is not refused and a device given for a model in memory is silently ignored"),
    Mutant("m12-mxfp4-experts-built-on-meta", "torch_qmm/interop/mxfp4_blocks.py",
           "        filled = _read_experts(ckpt, name, experts, dtype, used, dev)",
           "        filled = _read_experts(ckpt, name, experts, dtype, used)", MXFP4,
           "the QuantFusedExperts of a meta-built model are built where the float experts are (meta): "
           "the blocks and scales are copied into tensors without storage"),
    Mutant("m12-mxfp4-float-tensors-copied-into-meta", "torch_qmm/interop/mxfp4_blocks.py",
           "            (state[k] if meta is None else meta.real_key(model, k)).copy_(t)",
           "            state[k].copy_(t)", MXFP4,
           "the float tensors of a meta-built model (embeddings, norms, attention, router, sinks) are "
           "copied into their meta tensors (a no-op) instead of being created from the file"),
    Mutant("m12-mxfp4-buffers-not-computed", "torch_qmm/interop/mxfp4_blocks.py",
           '        compute_buffers(model, dev, f"load_mxfp4_checkpoint: {ckpt.path}")\n',
           "", MXFP4,
           "the rotary embedding's frequencies of a meta-built model are not computed again: every "
           "meta-built load fails on them (or keeps them on meta)"),
    Mutant("m12-mxfp4-meta-leftovers-unchecked", "torch_qmm/interop/mxfp4_blocks.py",
           '        check_no_meta(model, "load_mxfp4_checkpoint", ckpt.path)\n',
           "", MXFP4,
           "a tensor of a meta-built model that the file lacks (strict=False) is not named: the "
           "model.to(device) that follows fails on the meta tensor with torch's NotImplementedError"),
    Mutant("m12-mxfp4-meta-model-not-cast", "torch_qmm/interop/mxfp4_blocks.py",
           "    cast_stored(model, dtype)\n    meta = MetaTensors(model, dev) if dev is not None else None\n",
           "    if dev is None:\n        cast_stored(model, dtype)\n    meta = MetaTensors(model, dev) if dev is not None else None\n",
           MXFP4,
           "a meta-built model is not cast to `dtype` (its tensors hold no values to convert): its "
           "float tensors are created in the dtype it was built with, not the checkpoint's (a float32 "
           "model loading a bfloat16 checkpoint computes in float32 where the in-memory load is bfloat16)"),
    Mutant("m12-mxfp4-meta-experts-build-dtype", "torch_qmm/interop/mxfp4_blocks.py",
           '    new = empty_quant_layers(experts, 4, GROUP_SIZE, "mxfp4", dtype, device)',
           '    new = empty_quant_layers(experts, 4, GROUP_SIZE, "mxfp4", dtype if device is None else '
           "next(experts.parameters()).dtype, device)", MXFP4,
           "the experts of a meta-built model take the dtype the model was built with (their meta "
           "float weights', read before the model is cast) instead of `dtype`: their biases and "
           "outputs are float32 in a bfloat16 load"),
    # Equivalent on a machine whose only device that holds values is the CPU (this one: no CUDA, no
    # MPS): resolve_device refuses device='meta', so `device` is the CPU, where the tensors a partly
    # meta-built model had in memory already are, and model.to(device) returns every one of them
    # unchanged. Only a second device (a partly meta-built model in CPU memory loaded with
    # device='cuda' or 'mps') tells the two apart.
    Mutant("m12-mxfp4-partial-model-not-moved", "torch_qmm/interop/mxfp4_blocks.py",
           "        model.to(dev)  # the tensors the model had in memory before (a model only partly on meta)\n",
           "", MXFP4,
           "the tensors a partly meta-built model had in memory stay where they were instead of moving "
           "to `device` with the tensors created from the file"),
    # ---- meta.py: the helpers the mxfp4 loader uses -------------------------------------------------
    Mutant("m12-meta-device-meta-accepted", "torch_qmm/interop/meta.py",
           '        if target.type == "meta":\n            raise ValueError(',
           "        if False:\n            raise ValueError(", META,
           "device='meta' is accepted: the load builds its layers and tensors on meta and only "
           "check_no_meta fails, after the model has changed, without naming the argument"),
    Mutant("m12-meta-has-meta-sees-buffers-only", "torch_qmm/interop/meta.py",
           "    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))",
           "    return any(t.is_meta for t in model.buffers())", META,
           "a model whose parameters only are on meta (empty_parameters(): buffers in memory) is taken "
           "as a model in memory: device= is refused and the load copies into meta parameters"),
    Mutant("m12-meta-empty-buffers-initialized", "torch_qmm/interop/meta.py",
           "        for n in [n for n in names if module._buffers[n].numel() == 0]:",
           "        for n in []:", META,
           "an empty non-persistent buffer (a dtype carrier) goes through the weight initialization like "
           "a computed one: outside a transformers model it is refused as not computable"),
    Mutant("m12-meta-memory-buffers-recomputed", "torch_qmm/interop/meta.py",
           "                 if b is not None and b.is_meta and n in module._non_persistent_buffers_set]",
           "                 if b is not None and n in module._non_persistent_buffers_set]", META,
           "compute_buffers also recomputes the non-persistent buffers already in memory (a model with "
           "its parameters only on meta): one no initialization computes fails the load, one the model "
           "changed since it was built is overwritten"),
    Mutant("m12-meta-persistent-buffers-computed", "torch_qmm/interop/meta.py",
           "b.is_meta and n in module._non_persistent_buffers_set]",
           "b.is_meta]", META,
           "compute_buffers also computes persistent buffers left on meta (a file lacking them, "
           "strict=False): the initialization's values stand in for the file's instead of check_no_meta "
           "naming them"),
    Mutant("m12-meta-init-stand-ins-kept", "torch_qmm/interop/meta.py",
           "        module._parameters.update(params)\n",
           "", META,
           "after the initialization computed a module's buffers, its parameters stay the meta "
           "stand-ins it ran on: a module holding loaded parameters and computed buffers loses the "
           "loaded values"),
    Mutant("m12-meta-init-errors-escape", "torch_qmm/interop/meta.py",
           "            except Exception:  # (on the stand-ins, say): not computable this way",
           "            except (ValueError, TypeError):  # (on the stand-ins, say): not computable this way",
           META,
           "an initialization that fails on the stand-ins with another error (NotImplementedError, "
           "RuntimeError, KeyError) escapes compute_buffers instead of the ValueError naming the buffer"),
]
