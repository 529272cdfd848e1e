"""The loops in each kernel's machine code and what their bodies hold (a development count, not a test): how many
instructions a token or a step costs, for counting before building and for reading what an edit moved.

Needs `cuobjdump` (and `nvdisasm` beside it) and c++filt, as tools/dev/sass_compare.py does. On the CPU machine:
  tools/bazel build //kda:py
  python3 tools/dev/sass_loops.py --cuobjdump /path/to/cuobjdump \
      bazel-bin/kda/_cuda_objs/kda_cuda_cu_objs/decode.pic.o --kernel "bfloat16, __nv_bfloat16, (kda::GateKind)0, false"
For each kernel whose demangled name contains --kernel (every kernel without it): its instruction count, its
--loops largest loops (a backward branch, from its target to the branch: the static body, conditional paths
included, so an instruction that a call skips still counts; an outer loop's count includes its inner loops), each
with its --top most frequent opcodes (predicate and modifiers dropped: `@!P0 FFMA.FTZ` counts as FFMA).
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

import sass_compare  # (beside this file: the same cuobjdump listing)

_BRANCH_TARGET = re.compile(r"\bBRA(?:\.[A-Z0-9]+)*\s+(?:[^,]*,\s*)?0x([0-9a-f]+)\b")


def loops(body: list[tuple[int, str]]) -> list[tuple[int, int, int]]:
    """(instructions, first address, branch address) of every backward branch's range, largest first."""
    addresses = [address for address, _ in body]
    found = []
    for index, (address, text) in enumerate(body):
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) <= address:
            start = int(target.group(1), 16)
            first = next((i for i, a in enumerate(addresses) if a >= start), index)
            found.append((index - first + 1, start, address))
    return sorted(found, reverse=True)


def opcode(text: str) -> str:
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("objects", nargs="+", metavar="OBJ")
    parser.add_argument("--cuobjdump", default="cuobjdump", help="path of cuobjdump")
    parser.add_argument("--cxxfilt", default="c++filt", help="path of c++filt")
    parser.add_argument("--kernel", default="", help="only kernels whose demangled name contains this")
    parser.add_argument("--loops", type=int, default=3, help="loops listed per kernel")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = parser.parse_args()
    code = sass_compare.listings(args.cuobjdump, args.cxxfilt, [pathlib.Path(p) for p in args.objects])
    shown = 0
    for name, body in sorted(code, key=lambda kernel: kernel[0]):
        if args.kernel not in name:
            continue
        shown += 1
        print(f"{name}: {len(body)} instructions")
        found = loops(body)
        for size, start, branch in found[: args.loops]:
            counts = collections.Counter(opcode(text) for address, text in body if start <= address <= branch)
            print(f"  loop {start:#x} .. {branch:#x}: {size} instructions: "
                  + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
    if not shown:
        print(f"no kernel name contains {args.kernel!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
