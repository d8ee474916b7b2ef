"""Audit list 11: 16 Python mutants written from the product sources alone (torch_qmm/; by someone
who had not read the tests that cover them), none of them a bug of an earlier list, concentrated on
the code changed since a96ca65: the transformers loader's missing-tensor check
(_check_every_buffer_loaded), zero-dim tensors and non-matrix layers of GGUF files (gguf.py) and
safetensors checkpoints (safetensors_io.py), MixedBits' type checks (quantizers/mixed.py), the MoE
experts' dtype checks (mlx_experts.py), the tokenizer warning of a GGUF convert (gguf_tokenizer.py),
the MLX loaders' presence checks (mlx.py's _check_quantized_shapes) and the sharded loaders' config
checks (distributed/loading.py).

Selections are one or two test files chosen by their names and by which of them name the function
under test (`grep -l`, not reading them), the likeliest first: pytest runs with -x, so a kill stops
at the first failing test. Results: tests/mutation/README.md ("Audit list 11")."""

from __future__ import annotations

from . import Mutant
from .fresh_mutants import _files

HF = _files("tests/test_interop_transformers.py", "tests/test_hostile_files.py")
GGUF = _files("tests/test_hostile_files.py", "tests/test_interop_gguf.py")
SAFETENSORS = _files("tests/test_hostile_files.py", "tests/test_interop_mlx.py")
MIXED = _files("tests/test_quantizers.py", "tests/test_interop_transformers.py")
EXPERTS = _files("tests/test_hostile_files.py", "tests/test_moe_mlx_lm.py")
MLX = _files("tests/test_hostile_files.py", "tests/test_interop_mlx.py")
SHARDED = _files("tests/test_hostile_files.py", "tests/test_distributed.py")
TOKENIZER = _files("tests/test_interop_mlx_lm.py")

MUTANTS: list[Mutant] = [
    # ---- transformers.py: the missing-tensor check ---------------------------------------------------
    Mutant("m11-hf-unmarked-taken-as-loaded", "torch_qmm/interop/transformers.py",
           'getattr(model.get_buffer(k), "_is_hf_initialized", False)',
           'getattr(model.get_buffer(k), "_is_hf_initialized", True)', HF,
           "a torch_qmm buffer transformers did not mark as loaded counts as loaded: a checkpoint lacking "
           "some of the layers' codes or scales loads with uninitialized memory in them"),
    Mutant("m11-hf-none-marked-is-an-error", "torch_qmm/interop/transformers.py",
           "    if not missing or len(missing) == len(buffers):\n        return\n",
           "    if not missing:\n        return\n", HF,
           "the check no longer steps aside when no tensor of the layers is marked (a way of loading "
           "that does not mark them): every such load is refused as missing all its tensors"),
    Mutant("m11-hf-sharded-named-by-first-file", "torch_qmm/interop/transformers.py",
           'f"{files[0]}: " if len(files) == 1 else',
           'f"{files[0]}: " if len(files) >= 1 else', HF,
           "the missing-tensor error of a sharded checkpoint names its first shard as if it were the "
           "checkpoint, not the folder and the number of files"),
    # ---- gguf.py: zero-dim tensors, non-matrix layers ------------------------------------------------
    Mutant("m11-gguf-dequantize-zero-rows-only", "torch_qmm/interop/gguf.py",
           "    if math.prod(t.shape) == 0:  # a dim of 0 (the header allows it)",
           "    if t.shape[0] == 0:  # a dim of 0 (the header allows it)", GGUF,
           "dequantize returns the empty tensor only for 0 rows: rows of 0 values go to the decoder"),
    Mutant("m11-gguf-check-finite-zero-dim-decoded", "torch_qmm/interop/gguf.py",
           "    if math.prod(t.shape) == 0:  # no values to check (rows of 0 values, or 0 rows)\n        return True\n",
           "", GGUF,
           "check_finite of a GGUF tensor with a dim of 0 decodes it slice by slice like any other"),
    Mutant("m11-gguf-matrix-zero-dim-accepted", "torch_qmm/interop/gguf.py",
           "    if len(t.shape) != 2 or 0 in t.shape:",
           "    if len(t.shape) != 2:", GGUF,
           "a GGUF linear weight or embedding table with a dim of 0 is accepted as a matrix"),
    Mutant("m11-gguf-embedding-not-checked", "torch_qmm/interop/gguf.py",
           '    _check_matrix(t, "an embedding table", "[vocab >= 1, dim >= 1]")\n',
           "", GGUF,
           "embedding_from_gguf does not check that its table is a matrix with no dim of 0 (1-D, 3-D "
           "or empty tables reach the unpacking `n, k = t.shape`)"),
    # ---- safetensors_io.py -------------------------------------------------------------------------
    Mutant("m11-safetensors-finite-zero-dim-read", "torch_qmm/interop/safetensors_io.py",
           "        if math.prod(shape) == 0:  # a dim of 0: no values, however many rows the other dims give\n"
           "            return True\n",
           "", SAFETENSORS,
           "Checkpoint.check_finite reads a tensor with a dim of 0 slice by slice like any other"),
    # ---- mixed.py: MixedBits' type checks -----------------------------------------------------------
    Mutant("m11-mixed-average-bool-accepted", "torch_qmm/quantizers/mixed.py",
           "        if isinstance(self.average, bool) or not isinstance(self.average, numbers.Real):",
           "        if not isinstance(self.average, numbers.Real):", MIXED,
           "MixedBits(average=True) is accepted as an average of 1 bit"),
    Mutant("m11-mixed-float-widths-accepted", "torch_qmm/quantizers/mixed.py",
           "(isinstance(value, bool) or not isinstance(value, numbers.Integral)):",
           "(isinstance(value, bool) or not isinstance(value, numbers.Real)):", MIXED,
           "MixedBits low / high of a float (4.5, or 4.0 from a JSON file) are accepted"),
    # ---- mlx_experts.py: the dtype of stored expert tensors -----------------------------------------
    Mutant("m11-experts-quantized-dtype-unchecked", "torch_qmm/interop/mlx_experts.py",
           "                    for k in keys:\n                        check_dtype(ckpt, k, dst)\n",
           "", EXPERTS,
           "the quantized experts' stored qweight / scales / biases / bias are copied whatever their "
           "dtype (copy_ converts int32 codes or integer scales into other values)"),
    Mutant("m11-experts-float-dtype-unchecked", "torch_qmm/interop/mlx_experts.py",
           "                    if spec is None:\n                        check_dtype(ckpt, k, dst)\n",
           "                    if spec is None:\n", EXPERTS,
           "float (unquantized) experts' weights stored as integers are converted by copy_ instead of refused"),
    # ---- mlx.py: presence of a quantized layer's tensors --------------------------------------------
    Mutant("m11-mlx-weight-presence-unchecked", "torch_qmm/interop/mlx.py",
           '    for part in ("weight", *parts):',
           "    for part in parts:", MLX,
           "a quantized layer stored with scales but without its weight is not named: a KeyError of the "
           "bare tensor name (load_mlx, load_mlx_sharded, the MoE experts)"),
    # ---- distributed/loading.py -----------------------------------------------------------------------
    Mutant("m11-sharded-missing-layer-attributeerror", "torch_qmm/distributed/loading.py",
           "        try:\n            module = model.get_submodule(from_mlx_key(path + \".\", model_type)[:-1])\n"
           "        except AttributeError:\n"
           "            raise ValueError(f\"{ckpt.path}: quantized layer {path!r} does not exist in the model\") from None\n",
           "        module = model.get_submodule(from_mlx_key(path + \".\", model_type)[:-1])\n", SHARDED,
           "load_mlx_sharded meets a quantized layer the model lacks with get_submodule's AttributeError "
           "naming no file"),
    Mutant("m11-sharded-star-bits-ignored", "torch_qmm/distributed/loading.py",
           "bits.get(name, bits.get(\"*\"))",
           "bits.get(name)", SHARDED,
           "load_pretrained_sharded ignores the '*' default of a per-layer bits mapping: layers not named "
           "get bits=None"),
    # ---- gguf_tokenizer.py ---------------------------------------------------------------------------
    Mutant("m11-tokenizer-narrow-except", "torch_qmm/interop/gguf_tokenizer.py",
           "    except Exception as e:  # transformers' builders",
           "    except (ValueError, KeyError, IndexError, TypeError, OSError) as e:  # transformers' builders",
           TOKENIZER,
           "a tokenizer transformers cannot build for an error of another kind (huggingface_hub's "
           "validation error of a float special token id) stops the convert instead of a warning"),
]
