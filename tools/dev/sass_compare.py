"""Whether two builds of the CUDA objects hold the same machine code, kernel by kernel (a development check, not a
test). The kernels are sensitive to source changes that look neutral (docs/DESIGN.md, "The step": ptxas reschedules
them), so a refactor whose SASS is instruction for instruction the same needs no new GPU timing; one whose SASS
moved does.

Needs `cuobjdump` and the `nvdisasm` beside it (not in the hermetic toolchain: e.g. the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels, downloaded by name and version with pip outside the repo), and c++filt (binutils).
On the CPU machine, around the change:
  tools/bazel build //kda:py && cp -r bazel-bin/kda/_cuda_objs/kda_cuda_cu_objs /tmp/before
  ... edit, rebuild ...
  python3 tools/dev/sass_compare.py --cuobjdump /path/to/cuobjdump \
      --before /tmp/before --after bazel-bin/kda/_cuda_objs/kda_cuda_cu_objs
Each side is one or more objects or directories (a directory stands for its *.o files), so kernels may move between
objects: the comparison is over the union of each side's kernels. Prints one line per kernel (instruction counts
and identical / differs, with the first differing instruction), then a summary, and exits 1 if any kernel differs,
exists on one side only or twice on one side. Instructions are compared as text without addresses and encodings.
Kernels are matched by their demangled names without "(anonymous namespace)::" (nvcc names an anonymous namespace
after its translation unit, so a kernel moved to another .cu file, or out of an anonymous namespace, keeps its
identity), or by --rename OLD=NEW substrings of those names for renamed templates. `sass_compare.py A.o B.o` is
short for `--before A.o --after B.o`.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\*")


def objects(paths: list[str]) -> list[pathlib.Path]:
    """The objects named by `paths`, a directory standing for its *.o files."""
    found = []
    for path in map(pathlib.Path, paths):
        found += sorted(path.glob("*.o")) if path.is_dir() else [path]
    return found


def listings(cuobjdump: str, cxxfilt: str, paths: list[pathlib.Path]) -> list[tuple[str, list[tuple[int, str]]]]:
    """Every kernel of the objects `paths` in order, as (identity, its SASS instructions as (address, text)); the
    identity is the demangled name without "(anonymous namespace)::" (tools/dev/sass_loops.py reads these too)."""
    found = []
    for path in paths:
        listing = subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True, text=True).stdout
        mangled: list[str] = []
        bodies: list[list[tuple[int, str]]] = []
        for line in listing.splitlines():
            function = _FUNCTION.match(line)
            if function:
                mangled.append(function.group(1))
                bodies.append([])
                continue
            instruction = _INSTRUCTION.match(line)
            if instruction and bodies:
                bodies[-1].append((int(instruction.group(1), 16), instruction.group(2)))
        if not mangled:
            continue
        names = subprocess.run([cxxfilt], input="\n".join(mangled) + "\n", check=True, capture_output=True,
                               text=True).stdout.splitlines()
        found += [(name.replace("(anonymous namespace)::", ""), body) for name, body in zip(names, bodies)]
    return found


def kernels(cuobjdump: str, cxxfilt: str, paths: list[pathlib.Path]) -> tuple[dict[str, list[str]], list[str]]:
    """Kernel identity -> its SASS instructions (text only) over the objects `paths`, and the identities that occur
    more than once."""
    code: dict[str, list[str]] = {}
    duplicates = []
    for name, body in listings(cuobjdump, cxxfilt, paths):
        if name in code:
            duplicates.append(name)
        code[name] = [text for _, text in body]
    return code, duplicates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuobjdump", default="cuobjdump", help="path of cuobjdump")
    parser.add_argument("--cxxfilt", default="c++filt", help="path of c++filt")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="match kernel names of the before side with OLD replaced by NEW (repeatable)")
    parser.add_argument("--before", nargs="+", default=[], metavar="OBJ_OR_DIR")
    parser.add_argument("--after", nargs="+", default=[], metavar="OBJ_OR_DIR")
    parser.add_argument("pair", nargs="*", metavar="BEFORE AFTER", help="one object each (the short form)")
    args = parser.parse_args()
    if args.pair:
        if len(args.pair) != 2 or args.before or args.after:
            parser.error("give BEFORE AFTER or --before ... --after ...")
        args.before, args.after = [args.pair[0]], [args.pair[1]]
    if not args.before or not args.after:
        parser.error("both sides need objects")
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        parser.error("--rename takes OLD=NEW")
    before, before_twice = kernels(args.cuobjdump, args.cxxfilt, objects(args.before))
    after, after_twice = kernels(args.cuobjdump, args.cxxfilt, objects(args.after))
    failures = [f"twice in before: {name}" for name in before_twice]
    failures += [f"twice in after: {name}" for name in after_twice]
    identical = 0
    matched = set()
    for name, code in sorted(before.items()):
        target = name
        for old, new in renames:
            target = target.replace(old, new)
        other = after.get(target)
        if other is None:
            failures.append(f"only in before: {name}")
            continue
        matched.add(target)
        if code == other:
            print(f"identical ({len(code)} instructions): {target}")
            identical += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(code, other)) if x != y), min(len(code), len(other)))
        failures.append(f"differs ({len(code)} -> {len(other)} instructions, first at {first}): {target}\n"
                        f"    {code[first] if first < len(code) else '(end)'}  ->  "
                        f"{other[first] if first < len(other) else '(end)'}")
    failures += [f"only in after: {name}" for name in sorted(after.keys() - matched)]
    for failure in failures:
        print(failure)
    print(f"{len(before)} kernels before, {len(after)} after: {identical} identical, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
