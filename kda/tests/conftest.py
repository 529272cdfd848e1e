"""Shared pytest setup for the FlashKDA tests.

- ``--kda-slice=NAME[,NAME...]`` picks the slices of the correctness matrix (matrix.py) that test_matrix.py
  runs; default: all of them. Tests outside the matrix that belong to a slice carry ``@pytest.mark.kda_slice``.
- Marker ``gpu``: the test needs an sm_90 GPU and the compiled extension. Without one it is skipped with the
  reason (loudly, in the summary); with ``KDA_REQUIRE_GPU=1`` it fails instead. (The Bazel runner registers and
  enforces the same marker; doing it here too keeps plain ``pytest`` runs honest.)
- Fixtures: ``kda_case`` (a matrix.Case, parametrised), ``seed`` and ``gen`` (seeded per test id).
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import matrix` however pytest was started

import matrix  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kda-slice",
        action="store",
        default=os.environ.get("KDA_SLICE", ""),
        help=f"comma-separated matrix slices to run (default: all): {', '.join(matrix.SLICES)}",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an sm_90 GPU and the compiled extension (KDA_REQUIRE_GPU=1: fail)")
    config.addinivalue_line("markers", "kda_slice(name): the matrix slice a non-parametrised test belongs to")


def _selected_slices(config: pytest.Config) -> set[str] | None:
    value = config.getoption("--kda-slice")
    if not value or value == "all":
        return None
    return {c.slice for c in matrix.cases(value)} | set(value.split(","))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kda_case" in metafunc.fixturenames:
        cases = matrix.cases(metafunc.config.getoption("--kda-slice") or None)
        metafunc.parametrize("kda_case", cases, ids=[c.id for c in cases])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = _selected_slices(config)
    if wanted is None:
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("kda_slice")
        (drop if marker is not None and marker.args[0] not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def require_gpu() -> bool:
    return os.environ.get("KDA_REQUIRE_GPU", "") == "1"


def gpu_unavailable_reason() -> str | None:
    """Why the gpu tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch"
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        return f"CUDA device 0 is {torch.cuda.get_device_name()} with capability {capability}, not sm_90"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    if require_gpu():
        pytest.fail(f"KDA_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(f"GPU test skipped: {reason}")


def seed_of(nodeid: str) -> int:
    """A stable seed per test id (crc32: the same across runs, machines and Python hash seeds)."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    return seed_of(request.node.nodeid.split("::", 1)[-1])


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded from the test id."""
    return torch.Generator().manual_seed(seed)
