"""Shared pytest setup for the FlashKDA tests.

- ``--kda-slice=NAME[,NAME...]`` picks the slices of the correctness matrix (matrix.py) that test_matrix.py
  runs; default: all of them. Tests outside the matrix that belong to a slice carry ``@pytest.mark.kda_slice``.
- Marker ``gpu``: the test needs an sm_90 GPU. tools/pytest/kda_plugin.py owns it (skipped loudly without one;
  a failure under ``KDA_REQUIRE_GPU=1``); the Bazel runner loads that plugin, and this file registers it for
  plain ``pytest`` runs.
- Fixtures: ``kda_case`` (a matrix.Case, parametrised), ``seed`` and ``gen`` (seeded per test id).
- After every test the process hands its cached GPU memory back (``release_gpu_cache``): several test processes
  share one GPU, and each would otherwise keep its largest case's float64 references (10-20 GB) for good.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
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
    if not config.pluginmanager.has_plugin("kda_plugin"):  # plain pytest, not the Bazel runner
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "pytest"))
        import kda_plugin  # noqa: PLC0415

        config.pluginmanager.register(kda_plugin, "kda_plugin")
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


@pytest.fixture(autouse=True)
def release_gpu_cache() -> Iterator[None]:
    """Returns PyTorch's cached GPU blocks to the driver after each test, so that the test processes sharing
    the GPU only hold what their running cases need."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
