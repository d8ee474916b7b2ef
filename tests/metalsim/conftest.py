"""Fixtures for the metalsim tests: the module itself, importable even when the parent
package's compiled extension is unavailable (metalsim's core needs no torch)."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PKG = Path(__file__).resolve().parents[2] / "torch_qmm" / "metalsim"


def _load_metalsim():
    try:
        from torch_qmm import metalsim  # noqa: F401

        return metalsim
    except Exception:  # the parent package failed to import; load metalsim on its own
        name = "torch_qmm_metalsim_standalone"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, _PKG / "__init__.py",
                                                      submodule_search_locations=[str(_PKG)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


@pytest.fixture(scope="session")
def metalsim():
    return _load_metalsim()
