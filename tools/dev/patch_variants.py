"""Patched copies of the tree's files, for timing prepared kernel variants on the GPU machine (a development tool, not
a test).

For each PATCH (a unified diff such as tools/dev/*.patch) this writes the files it changes, patched, into
OUT_DIR/<patch name>/ and prints the KDA_VARIANT value with which tools/dev/gpu_iterate.sh builds and times each after
the tree as it is; --baseline puts the tree's own files between them (A, B1, A, B2, A) and --repeat runs the whole
order again, so that several variants are alternated with the kept design on one machine:

  python3 tools/dev/patch_variants.py OUT_DIR A.patch B.patch --baseline --repeat 2
  KDA_TESTS= KDA_PROFILE= KDA_BENCH="--peers= --cases=15,17 --iters=50 --noaccuracy" KDA_VARIANT="$(...)" \\
      tools/dev/gpu_iterate.sh

Without --baseline its output is a variant list that tools/dev/issue_bound_proxy.py takes as it is. A patch is applied
as `git apply` applies it without fuzz (every hunk's old lines as written), in Python, so that a patch that no longer
applies fails here, before any GPU time; kda/tests/test_dev_tools.py checks every tools/dev/*.patch the same way.
OUT_DIR inside the workspace travels with the tree to the GPU machine; its paths are printed relative to the workspace.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
from typing import Callable

# Not resolved: in a test's runfiles (kda/tests/test_dev_tools.py) the kernel sources lie beside the link.
ROOT = pathlib.Path(__file__).absolute().parents[2]


def apply_patch(patch: str, read: Callable[[str], str]) -> dict[str, str]:
    """The texts, by path, that a unified diff makes of the files read(path). Every hunk's old lines must stand in
    the file as written, at the hunk's line or shifted by the earlier hunks' growth (AssertionError otherwise)."""
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


def _shown(path: pathlib.Path) -> pathlib.Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("patches", nargs="+", type=pathlib.Path)
    parser.add_argument("--baseline", action="store_true", help="the tree's files between the variants (A, B1, A, ...)")
    parser.add_argument("--repeat", type=int, default=1, help="how many times the whole order runs")
    args = parser.parse_args()
    out = pathlib.Path(args.out_dir).absolute()

    variants, changed = [], set()
    for patch in args.patches:
        texts = apply_patch(patch.read_text(), lambda path: (ROOT / path).read_text())
        if not texts:
            parser.error(f"{patch} changes no file")
        parts = []
        for path, text in sorted(texts.items()):
            target = out / patch.name.removesuffix(".patch") / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            parts.append(f"{path}={_shown(target)}")
            changed.add(path)
        variants.append("+".join(parts))

    order = variants
    if args.baseline:
        # Every file some variant changes, as the tree has it: the build between two variants is the tree's.
        parts = []
        for path in sorted(changed):
            target = out / "tree" / path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / path, target)
            parts.append(f"{path}={_shown(target)}")
        tree = "+".join(parts)
        order = [build for variant in variants for build in (variant, tree)]
    print(",".join(order * args.repeat))


if __name__ == "__main__":
    main()
