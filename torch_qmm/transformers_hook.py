"""Registers quant_method "torch_qmm" with transformers once both are imported, in either order.

A folder saved from a model with torch_qmm layers records quant_method "torch_qmm" in its
config.json. transformers only warns about a quant_method it does not know and builds float layers
with random weights, so `import torch_qmm` alone must be enough for `from_pretrained` to load such
a folder. `import torch_qmm` itself does not import transformers: when transformers is not imported
yet, a finder on sys.meta_path registers the integration (torch_qmm.interop.transformers) right
after transformers' own import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings


def register() -> None:
    """Imports torch_qmm.interop.transformers (which registers the config and quantizer); a failure
    (an unsupported transformers) is a warning, never an error of `import transformers`."""
    try:
        importlib.import_module("torch_qmm.interop.transformers")
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"torch_qmm could not register quant_method 'torch_qmm' with transformers "
                      f"({type(e).__name__}: {e}); folders saved with torch_qmm layers will not reload with "
                      "from_pretrained", stacklevel=2)


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Finds transformers through the other finders and wraps its loader so that register() runs
    when its import completes; a mere find_spec (an availability check) registers nothing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            register()

        loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Registers now when transformers is already imported, else after its import."""
    if "transformers" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterTransformersImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersImport())
