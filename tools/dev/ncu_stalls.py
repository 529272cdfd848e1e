"""Where a kernel's warps wait, from the per-instruction page that tools/dev/ncu_kernels.sh writes (a development
count, not a test): the stall reasons' shares of all samples, the instructions executed per work unit by opcode,
and the samples and instructions of each block of consecutive instructions executed equally often (a loop body,
an item's start, a branch's path; blocks run less than half a time per unit are left out), so that a loop's serial
points show up beside its arithmetic.

  python3 tools/dev/ncu_stalls.py OUT/kda_decode_kernel_sass.csv --units 16384
      (--units: warps times items per warp, e.g. 8,192 items x 2 warps; counts are printed per unit)
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

from sass_loops import opcode  # (beside this file: `@!P0 FFMA.FTZ R1, ...` -> FFMA)


def read_page(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path, newline="")))
    for index, row in enumerate(rows):
        if "Source" in row and "Instructions Executed" in row:
            return row, rows[index + 1:]
    sys.exit(f"{path}: no per-instruction header (Source, Instructions Executed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass_csv")
    parser.add_argument("--units", type=float, required=True, help="work units (warps x items) to count per")
    parser.add_argument("--opcodes", type=int, default=20, help="most executed opcodes to print")
    parser.add_argument("--block", type=int, default=30, help="instructions per printed block")
    parser.add_argument("--min_share", type=float, default=0.0,
                        help="print only blocks holding at least this %% of the samples (a short report)")
    args = parser.parse_args()

    header, rows = read_page(args.sass_csv)
    source, executed = header.index("Source"), header.index("Instructions Executed")
    samples = header.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    value = lambda row, i: float(row[i] or 0)  # noqa: E731
    total_samples = sum(value(row, samples) for row in rows) or 1.0

    by_reason = {header[i][len("stall_"):]: sum(value(row, i) for row in rows) for i in reasons}
    reason_total = sum(by_reason.values()) or 1.0
    print("stall reasons (% of samples):")
    for name, count in sorted(by_reason.items(), key=lambda item: -item[1])[:12]:
        print(f"  {name:20s} {100 * count / reason_total:5.1f}")

    by_opcode = collections.Counter()
    for row in rows:
        by_opcode[opcode(row[source])] += value(row, executed)
    print(f"instructions per unit: {sum(by_opcode.values()) / args.units:.1f}")
    for name, count in by_opcode.most_common(args.opcodes):
        print(f"  {name:8s} {count / args.units:8.1f}")

    # Blocks of consecutive instructions with the same execution count per unit (rounded to 0.1).
    print(f"blocks of up to {args.block} instructions executed equally often"
          f"{f' holding at least {args.min_share:g} % of the samples' if args.min_share else ''}: "
          "first-last index, times per unit, % of samples, top stall reasons, top opcodes")
    times = [round(value(row, executed) / args.units, 1) for row in rows]
    runs: list[list[int]] = []
    for index in range(len(rows)):
        if times[index] < 0.5:
            continue
        last = runs[-1] if runs else None
        if last and len(last) < args.block and last[-1] == index - 1 and times[last[0]] == times[index]:
            last.append(index)
        else:
            runs.append([index])
    for run in runs:
        if len(run) < 3:
            continue
        share = sum(value(rows[i], samples) for i in run) / total_samples
        if 100 * share < args.min_share:
            continue
        stalls = collections.Counter({header[c][len("stall_"):]: sum(value(rows[i], c) for i in run) for c in reasons})
        ops = collections.Counter(opcode(rows[i][source]) for i in run)
        print(f"  {run[0]:5d}-{run[-1]:5d} x{times[run[0]]:4.1f} {100 * share:5.1f}% "
              f"{', '.join(f'{k} {100 * v / reason_total:.1f}' for k, v in stalls.most_common(3))} | "
              f"{', '.join(f'{k} {v}' for k, v in ops.most_common(4))}")


if __name__ == "__main__":
    main()
