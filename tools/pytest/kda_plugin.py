"""pytest plugin loaded by runner.py (-p kda_plugin): Bazel sharding and the `gpu` marker.

`@pytest.mark.gpu` tests need a CUDA device of compute capability 9.0 (the kernels are sm_90a machine code).
Where torch sees none they are SKIPPED with the reason ("no CUDA device visible: ..."), unless
KDA_REQUIRE_GPU=1, which turns the skip into a failure (GPU machines). kda/tests/conftest.py registers this
plugin too when pytest runs without the Bazel runner, so plain `pytest` runs follow the same rules.
A banner at the end says how many GPU tests were skipped.
"""

import os

import pytest

_state = {"cuda": None, "skipped_gpu": 0}


def _cuda_problem():
    """None if a CUDA device is usable, else why not (cached)."""
    if _state["cuda"] is None:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                capability = torch.cuda.get_device_capability(0)
                _state["cuda"] = "" if capability == (9, 0) else (
                    "CUDA device 0 is %s with compute capability %s; the kernels need 9.0 (sm_90a)"
                    % (torch.cuda.get_device_name(0), capability))
            else:
                built = getattr(torch.version, "cuda", None)
                _state["cuda"] = "no CUDA device visible: torch %s (built for CUDA %s) reports %d device(s), " \
                    "CUDA_VISIBLE_DEVICES=%r" % (torch.__version__, built, torch.cuda.device_count(),
                                                 os.environ.get("CUDA_VISIBLE_DEVICES"))
        except Exception as e:  # torch missing or broken
            _state["cuda"] = "no CUDA device visible: torch unusable (%s: %s)" % (type(e).__name__, e)
    return _state["cuda"] or None


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs an sm_90 CUDA device; skipped loudly without one, a failure instead when KDA_REQUIRE_GPU=1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Bazel sharding: keep every TEST_TOTAL_SHARDS-th test id, starting at TEST_SHARD_INDEX.

    Runs last, so -k / -m deselection has already happened and the shards split what is selected.
    """
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1") or 1)
    if total <= 1:
        return
    index = int(os.environ.get("TEST_SHARD_INDEX", "0") or 0)
    ids = sorted(item.nodeid for item in items)
    mine = {nodeid for i, nodeid in enumerate(ids) if i % total == index}
    keep = [item for item in items if item.nodeid in mine]
    drop = [item for item in items if item.nodeid not in mine]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
    print("\nkda_plugin: shard %d/%d runs %d of %d selected tests" % (index + 1, total, len(keep), len(ids)))


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    problem = _cuda_problem()
    if problem is None:
        return
    if os.environ.get("KDA_REQUIRE_GPU", "") == "1":
        pytest.fail("KDA_REQUIRE_GPU=1 but %s" % problem, pytrace=False)
    pytest.skip("GPU test SKIPPED -- %s" % problem)


def pytest_runtest_logreport(report):
    # Counts every skipped gpu-marked test, whoever skipped it (this plugin or a conftest.py).
    if report.skipped and "gpu" in report.keywords:
        _state["skipped_gpu"] += 1
        if not _state.get("reason"):
            longrepr = report.longrepr
            _state["reason"] = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = _state["skipped_gpu"]
    if n:
        line = "!!! %d GPU test(s) SKIPPED (%s). Set KDA_REQUIRE_GPU=1 on GPU machines to make this fail. !!!" % (
            n, _state.get("reason") or _state["cuda"])
        terminalreporter.write_sep("!", "GPU TESTS SKIPPED", red=True, bold=True)
        terminalreporter.write_line(line, red=True, bold=True)
