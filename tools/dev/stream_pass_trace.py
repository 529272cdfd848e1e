"""Where the stream pass's warps spend their cycles (a development measurement on the GPU machine, not a test).

Applies stream_pass_trace.patch (beside this file: clock64 at the phase boundaries of the preparing and the step
warps, printed by CTAs 0 and 77 of every launch), builds through the offline bundle, runs one bench_fwd case,
prints the mean cycles of each phase per warp role, and takes the patch back out. The patch is written against the
v34 stream pass; after a change to stream_pass.cuh or prepare_chunk.cuh it may need refreshing.

  python3 tools/dev/stream_pass_trace.py [--case 18]        (18: B64 T16 H32)
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCH = ROOT / "tools/dev/stream_pass_trace.patch"
BAZEL = str(ROOT / "tools/offline/bazel-offline")


def patch(reverse: bool) -> None:
    """Applies (or takes out) the patch with `patch`, or with `git apply` where `patch` is missing."""
    try:
        args = ["patch", "-p1", "--forward", "--quiet"] + (["--reverse"] if reverse else [])
        subprocess.run(args, cwd=ROOT, stdin=PATCH.open(), check=True)
    except FileNotFoundError:
        subprocess.run(["git", "apply"] + (["-R"] if reverse else []) + [str(PATCH)], cwd=ROOT, check=True)


def summarise(lines: list[str]) -> None:
    """Mean of every counter over the printed lines, per role (prep, step)."""
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: collections.Counter = collections.Counter()
    for line in lines:
        role = line.split()[1]
        counts[role] += 1
        for key, value in re.findall(r"([a-z_0-9]+) (-?\d+)", line.replace("|", " ")):
            if key not in ("cta", "w"):
                sums[role][key] += int(value)
    for role, total in sums.items():
        means = ", ".join(f"{key} {value / counts[role]:,.0f}" for key, value in total.items())
        print(f"{role} ({counts[role]} warps): {means}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="18", help="bench_fwd case index (a fixed-length 16-token decode call)")
    args = parser.parse_args()
    patch(reverse=False)
    try:
        subprocess.run([BAZEL, "build", "//kda:py", "//kda/bench:all"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run = subprocess.run([BAZEL, "run", "//kda/bench:bench_fwd", "--", "--peers=", "--noaccuracy",
                              f"--cases={args.case}", "--iters=3", "--warmup=1"], cwd=ROOT, capture_output=True,
                             text=True, check=False)
    finally:
        patch(reverse=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("TRACE ")]
    if not lines:
        sys.exit(f"no TRACE lines (bench exit status {run.returncode}):\n{run.stderr[-2000:]}")
    summarise(lines)


if __name__ == "__main__":
    main()
