"""The development tools that copy kernel sources with exact text replacements still find their text (CPU; runs in CI).

tools/dev/decode_ws_knockouts.py (the warp-specialised decode kernel with one part knocked out) and
tools/dev/issue_bound_proxy.py (decode kernels without their final-state copies, or with their states in L2) refuse
to run once a kernel has changed under them, and the prepared variants (tools/dev/*.patch, which
tools/dev/patch_variants.py applies) stop applying; these tests make such a change fail here rather than on the GPU
machine. tools/dev/variant_table.py, which sums up such a run, is checked on a made-up run's JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# The runfiles' workspace under Bazel (the tools and the kernel sources are this test's data), else the checkout.
if os.environ.get("TEST_SRCDIR") and os.environ.get("TEST_WORKSPACE"):
    ROOT = pathlib.Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"]
else:
    ROOT = pathlib.Path(__file__).absolute().parents[2]
sys.path.insert(0, str(ROOT / "tools/dev"))
import patch_variants  # noqa: E402  (tools/dev/patch_variants.py: the patches applied as git apply applies them)

WS_KERNEL = "kda/csrc/decode_warp_specialised.cu"
STREAM_PASS = "kda/csrc/stream_pass.cuh"


def _run(tool: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "tools/dev" / tool), *args], capture_output=True, text=True)
    assert done.returncode == 0, f"{tool} {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout.strip().splitlines()[-1]


def _copies(variants: str) -> list[dict[str, pathlib.Path]]:
    """A KDA_VARIANT value as its builds: each a map from the tree's path to the copy that replaces it."""
    builds = []
    for build in variants.split(","):
        files = {}
        for part in build.split("+"):
            path, copy = part.split("=", 1)
            files[path] = pathlib.Path(copy) if os.path.isabs(copy) else ROOT / copy
        builds.append(files)
    return builds


def test_decode_ws_knockouts_apply(tmp_path):
    builds = _copies(_run("decode_ws_knockouts.py", str(tmp_path)))
    source = (ROOT / WS_KERNEL).read_text()
    assert len(builds) == 7
    copies = set()
    for files in builds:
        assert list(files) == [WS_KERNEL]
        text = files[WS_KERNEL].read_text()
        assert text != source
        copies.add(text)
    assert len(copies) == 7, "two knock-outs wrote the same copy"


@pytest.mark.parametrize("keep_stage", [False, True], ids=["storeless", "keep_stage"])
def test_issue_bound_proxy_applies(tmp_path, keep_stage):
    args = [str(tmp_path), "", "--baseline"] + (["--keep-stage"] if keep_stage else [])
    (files,) = _copies(_run("issue_bound_proxy.py", *args))
    assert sorted(files) == [WS_KERNEL, STREAM_PASS]
    for path, copy in files.items():
        source, text = (ROOT / path).read_text(), copy.read_text()
        assert text != source
        # One condition knocked out on one line, nothing else changed.
        changed = [(a, b) for a, b in zip(source.splitlines(), text.splitlines()) if a != b]
        assert len(source.splitlines()) == len(text.splitlines()) and len(changed) == 1, changed
        assert "if (false && " in changed[0][1], changed


def test_issue_bound_proxy_l2_states(tmp_path):
    (files,) = _copies(_run("issue_bound_proxy.py", str(tmp_path), "", "--baseline", "--l2-states"))
    assert sorted(files) == [WS_KERNEL, STREAM_PASS]
    stand_ins = {WS_KERNEL: "(first % stride) * kHeadElems", STREAM_PASS: "return static_cast<int>(blockIdx.x);"}
    for path, copy in files.items():
        source, text = (ROOT / path).read_text(), copy.read_text()
        # Where the state lies in the pools, on one line; every store, copy and wait kept.
        changed = [(a, b) for a, b in zip(source.splitlines(), text.splitlines()) if a != b]
        assert len(source.splitlines()) == len(text.splitlines()) and len(changed) == 1, changed
        assert stand_ins[path] in changed[0][1], changed


PATCHES = sorted(p.name for p in (ROOT / "tools/dev").glob("*.patch"))


def test_patches_found():
    assert PATCHES, "no tools/dev/*.patch found (a missing data dependency would skip every case below)"


@pytest.mark.parametrize("name", PATCHES)
def test_patch_applies(name):
    patch = (ROOT / "tools/dev" / name).read_text()
    patched = patch_variants.apply_patch(patch, lambda path: (ROOT / path).read_text())
    assert patched, f"{name} names no file"
    for path, text in patched.items():
        assert text != (ROOT / path).read_text(), f"{name} leaves {path} as it is"


def test_patch_variants_alternate_with_the_tree(tmp_path):
    patches = [str(ROOT / "tools/dev" / name) for name in PATCHES]
    builds = _copies(_run("patch_variants.py", str(tmp_path), *patches, "--baseline", "--repeat", "2"))
    assert len(builds) == 2 * 2 * len(PATCHES)
    for i, files in enumerate(builds):
        for path, copy in files.items():
            same = copy.read_text() == (ROOT / path).read_text()
            # Even builds are the patches' (each changes every file it names), odd ones the tree's own files.
            assert same == (i % 2 == 1), (i, path, copy)
    assert builds[: 2 * len(PATCHES)] == builds[2 * len(PATCHES):], "the second round differs from the first"


def test_variant_table(tmp_path):
    def bench(graph: float, eager: float) -> str:
        rows = [{"case": "decode varlen 128x4 H32", "flash_kda_ms": eager, "flash_kda_graph_ms": graph}]
        return json.dumps({"meta": {}, "rows": rows})

    (tmp_path / "bench.json").write_text(bench(0.118, 0.154))
    for i, (graph, eager) in enumerate([(0.117, 0.142), (0.119, 0.18), (0.1169, 0.159)], start=1):
        (tmp_path / f"bench_variant{i}.json").write_text(bench(graph, eager))
    (tmp_path / "bench_variant10.json").write_text(bench(0.2, 0.3))  # after 3, not after 1
    variants = ",".join(["kda/csrc/d.cu=ab/in_out/kda/csrc/d.cu", "kda/csrc/d.cu=ab2/tree/d.cu+kda/csrc/s.cuh=x/s.cuh",
                         "kda/csrc/d.cu=/tmp/d_v20.cu"])
    done = subprocess.run([sys.executable, str(ROOT / "tools/dev/variant_table.py"), str(tmp_path), "--variants",
                           variants], capture_output=True, text=True, check=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| the tree as built | 0.1180 (0.1540) |",
        "| 1: in_out | 0.1170 (0.1420) |",
        "| 2: tree | 0.1190 (0.1800) |",
        "| 3: d_v20.cu | 0.1169 (0.1590) |",
        "| variant 10 | 0.2000 (0.3000) |",
    ], done.stdout
