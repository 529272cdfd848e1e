"""What the tests of fla's paths share (test_fla, test_fla_recurrent, test_fla_layer): fla's kernels on demand,
fla's KimiDeltaAttention layer without importing every fla layer, and a script run in a fresh process."""

from __future__ import annotations

import os
import sys
import types

import fresh_process
import pytest


@pytest.fixture
def fla_own(monkeypatch):
    """Runs ``fn()`` with fla's dispatch to flash_kda switched off (FLA_FLASH_KDA=0): fla's own Triton kernels."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setenv("FLA_FLASH_KDA", "0")
            return fn()

    return run


def kda_layer_class():
    """fla.layers.kda.KimiDeltaAttention without fla.layers/__init__.py, which imports every layer and with them
    `transformers` (not a dependency of these tests; the KDA layer itself needs only fla and einops)."""
    import fla  # noqa: PLC0415

    if "fla.layers" not in sys.modules:
        package = types.ModuleType("fla.layers")
        package.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
        sys.modules["fla.layers"] = package
    from fla.layers.kda import KimiDeltaAttention  # noqa: PLC0415

    return KimiDeltaAttention


def assert_fresh_process_ok(script: str) -> None:
    """``fresh_process.assert_fresh_process_ok`` with fla's dispatch switch unset: what fla does before anything
    here has registered a backend."""
    fresh_process.assert_fresh_process_ok(script, unset=("FLA_FLASH_KDA",))
