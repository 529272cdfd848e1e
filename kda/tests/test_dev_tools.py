"""The development tools that copy kernel sources with exact text replacements still find their text (CPU; runs in CI).

tools/dev/decode_ws_knockouts.py (the warp-specialised decode kernel with one part knocked out) and
tools/dev/issue_bound_proxy.py (decode kernels without their final-state copies) refuse to run once a kernel has
changed under them, and the prepared variants (tools/dev/*.patch) stop applying; these tests make such a change fail
here rather than on the GPU machine.
"""

from __future__ import annotations

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
    assert len(builds) == 6
    copies = set()
    for files in builds:
        assert list(files) == [WS_KERNEL]
        text = files[WS_KERNEL].read_text()
        assert text != source
        copies.add(text)
    assert len(copies) == 6, "two knock-outs wrote the same copy"


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


def _apply_patch(patch: str, read) -> dict[str, str]:
    """A unified diff applied to the files read(path) gives: the patched texts, by path. Every hunk's old lines
    must stand in the file as written (at the hunk's line or shifted by an earlier hunk's growth), as git apply
    without fuzz requires; pure Python, so that the test needs no git or patch program."""
    patched: dict[str, list[str]] = {}
    path, lines, shift = None, [], 0
    body = patch.splitlines()
    i = 0
    while i < len(body):
        line = body[i]
        if line.startswith("+++ b/"):
            path = line[len("+++ b/"):]
            lines, shift = read(path).splitlines(), 0
            patched[path] = lines
        elif line.startswith("@@ "):
            # @@ -start,count +start,count @@: exactly `count` old and new lines follow (a "\ No newline" note aside).
            old_range, new_range = line.split()[1:3]
            start = int(old_range.split(",")[0][1:])
            old_left = int(old_range.split(",")[1]) if "," in old_range else 1
            new_left = int(new_range.split(",")[1]) if "," in new_range else 1
            old, new = [], []
            i += 1
            while old_left or new_left:
                tag, text = body[i][:1], body[i][1:]
                if tag in (" ", "-"):
                    old.append(text)
                    old_left -= 1
                if tag in (" ", "+"):
                    new.append(text)
                    new_left -= 1
                i += 1
            at = start - 1 + shift if old else start + shift
            assert lines[at:at + len(old)] == old, f"{path}: the hunk at line {start} no longer matches"
            lines[at:at + len(old)] = new
            shift += len(new) - len(old)
            continue
        i += 1
    return {p: "\n".join(t) + "\n" for p, t in patched.items()}


PATCHES = sorted(p.name for p in (ROOT / "tools/dev").glob("*.patch"))


def test_patches_found():
    assert PATCHES, "no tools/dev/*.patch found (a missing data dependency would skip every case below)"


@pytest.mark.parametrize("name", PATCHES)
def test_patch_applies(name):
    patched = _apply_patch((ROOT / "tools/dev" / name).read_text(), lambda path: (ROOT / path).read_text())
    assert patched, f"{name} names no file"
    for path, text in patched.items():
        assert text != (ROOT / path).read_text(), f"{name} leaves {path} as it is"
