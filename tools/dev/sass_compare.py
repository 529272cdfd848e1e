"""Whether two builds of a CUDA object hold the same machine code, kernel by kernel (a development check, not a
test). The kernels are sensitive to source changes that look neutral (docs/KERNEL.md: ptxas reschedules them), so
a refactor whose SASS is instruction for instruction the same needs no new GPU timing; one whose SASS moved does.

Needs `cuobjdump` (not in the hermetic toolchain: e.g. the nvidia-cuda-cuobjdump wheel, installed by name and
version with pip outside the repo). On the CPU machine, around the change:
  tools/bazel build //kda:py && cp bazel-bin/kda/_cuda_objs/kda_cuda_cu_objs/kda_prepare.pic.o /tmp/before.o
  ... edit, rebuild ...
  python3 tools/dev/sass_compare.py --cuobjdump /path/to/cuobjdump /tmp/before.o \
      bazel-bin/kda/_cuda_objs/kda_cuda_cu_objs/kda_prepare.pic.o
Prints one line per kernel (instruction counts and identical / differs, with the first differing instruction) and
exits 1 if any kernel differs or exists in one object only. Instructions are compared as text without addresses
and encodings; kernels are matched by mangled name, or by --rename OLD=NEW substrings for renamed templates.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\*")


def kernels(cuobjdump: str, path: str) -> dict[str, list[str]]:
    """Mangled kernel name -> its SASS instructions (text only) in the object at `path`."""
    listing = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in listing.splitlines():
        function = _FUNCTION.match(line)
        if function:
            current = found.setdefault(function.group(1), [])
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction and current is not None:
            current.append(instruction.group(1))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuobjdump", default="cuobjdump", help="path of cuobjdump")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="match kernel names of the first object with OLD replaced by NEW (repeatable)")
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    before, after = kernels(args.cuobjdump, args.before), kernels(args.cuobjdump, args.after)
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        parser.error("--rename takes OLD=NEW")
    same = True
    matched = set()
    for name, code in before.items():
        target = name
        for old, new in renames:
            target = target.replace(old, new)
        other = after.get(target)
        if other is None:
            print(f"only in {args.before}: {name}")
            same = False
            continue
        matched.add(target)
        if code == other:
            print(f"identical ({len(code)} instructions): {target}")
            continue
        same = False
        first = next((i for i, (x, y) in enumerate(zip(code, other)) if x != y), min(len(code), len(other)))
        print(f"differs ({len(code)} -> {len(other)} instructions, first at {first}): {target}")
        print(f"    {code[first] if first < len(code) else '(end)'}  ->  {other[first] if first < len(other) else '(end)'}")
    for name in after.keys() - matched:
        print(f"only in {args.after}: {name}")
        same = False
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
