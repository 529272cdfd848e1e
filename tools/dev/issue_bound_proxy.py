"""Issue-bound copies of decode kernel sources (store-less, or with the states in L2), for timing issue-side changes on
an H100 (a development measurement on the GPU machine, not a test; the copies compute wrong results on purpose).

On an H100 the decode rows run at 78-83 % of the memory floor, so a change that saves issue slots does not show there,
while on the H200 (1.4x the bandwidth, the same SMs and clocks) the same kernels run at 59-64 % and are bound by issue.
With the final-state stores knocked out (a third of the state traffic) the H100 is bound by issue too: the warp-
specialised kernel's head table ran varlen 128 x 4 H32 in 0.121 ms against v35's 0.121 as built, and 0.098 / 0.095
against 0.105 / 0.102 store-less (docs/bench-h100-2026-12-06-head-table.md at tag measurements-2026-12-07).

For each variant of a KDA_VARIANT value (tools/dev/gpu_iterate.sh) this writes the store-less copies of its files
into OUT_DIR, and of the tree's own file where a variant does not replace it, and prints the KDA_VARIANT value that
times them all; so every build, the baseline included, loses the same stores. OUT_DIR inside the workspace (and not
git-ignored) travels with the tree to the GPU machine; its paths are printed relative to the workspace:

  python3 tools/dev/issue_bound_proxy.py OUT_DIR "kda/csrc/decode_warp_specialised.cu=ab/new.cu" --baseline
  KDA_TESTS= KDA_PROFILE= KDA_BENCH="--peers= --cases=17,18,15 --iters=50 --noaccuracy" KDA_VARIANT="$(...)" \\
      tools/dev/gpu_iterate.sh OUT

--baseline adds the tree's files, rewritten the same way, as the first variant and again after each other one (A, B,
A for one).
--keep-stage knocks out only the copies from the stage to global memory and keeps each warp's stores of its rows
into the stage: the proxy for a change whose cost is in those shared-memory stores (a change of the stage's layout).
--l2-states keeps every store, copy and wait and moves the state traffic out of DRAM instead: in the warp-specialised
kernel every head of a group reads and writes one head state of the group's own (the group's index in the pool), in
the stream pass every item of a CTA one of the CTA's own (its bf16 tensor-map copies), so the states of a call stay
in L2 (264 groups or 132 CTAs x 32 KB: 8.4 or 4.2 MB) and DRAM carries only the tokens and outputs. The proxy for a
change to a serial point on the state's way in or out (a wait for a copy, the start of a stream), which the
store-less copies remove from every build or do not touch; it needs a pool of at least as many head states as the
grid has groups or CTAs (the bench's decode rows have 2,048 or more).
Files it knows: kda/csrc/decode_warp_specialised.cu and kda/csrc/stream_pass.cuh (one final-state store each); any
other file a variant replaces (a header both include) is copied as it is, and the tree's copy goes into the builds
that do not replace it.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys

# Not resolved: in a test's runfiles (kda/tests/test_dev_tools.py) the kernel sources lie beside the link.
ROOT = pathlib.Path(__file__).absolute().parents[2]
# The condition around each kernel's final-state store: exactly one per file.
STORE = re.compile(r"if \(p\.final_state != nullptr && (head\.state_offset|slot) >= 0\) \{")
# The lane issuing the final state's copies from the stage to global memory (lanes 0..15, a row each, in the
# stage-pitch variant of 555e934): exactly one per file.
STAGE_COPY = re.compile(
    r"if \(lane (?:== 0|< kRowsPerWarp)\) \{"
    r"(?=\s+(?:const int plane = [^;]*;\s+)?(?:bulk_copy_s2g|tensor_copy_3d_s2g)\()")
KNOWN = ("kda/csrc/decode_warp_specialised.cu", "kda/csrc/stream_pass.cuh")
# Per file, the expression that places a head's state in the pools (exactly one each) and its --l2-states stand-in:
# the warp-specialised kernel's table entry (fill_head_table; first % stride is the group's index) and the stream
# pass's tensor-map plane (state_plane).
L2_STATES = {
    "kda/csrc/decode_warp_specialised.cu": ("static_cast<int64_t>(state_offset(p, slot, h))",
                                            "(first % stride) * kHeadElems"),
    "kda/csrc/stream_pass.cuh": ("return static_cast<int>(slot * p.heads + h);",
                                 "return static_cast<int>(blockIdx.x);"),
}


def l2_states(path: str, source: pathlib.Path, out: pathlib.Path) -> None:
    text = source.read_text()
    placed, stand_in = L2_STATES[path]
    if text.count(placed) != 1:
        sys.exit(f"{source}: {text.count(placed)} state placements matched, expected 1")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace(placed, stand_in))


def storeless(source: pathlib.Path, out: pathlib.Path, keep_stage: bool) -> None:
    text = source.read_text()
    if keep_stage:
        pattern, knocked_out = STAGE_COPY, lambda m: m.group(0).replace("if (", "if (false && ", 1)
    else:
        pattern, knocked_out = STORE, lambda m: f"if (false && {m.group(1)} >= 0) {{"
    found = pattern.findall(text)
    if len(found) != 1:
        sys.exit(f"{source}: {len(found)} final-state stores matched, expected 1")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(pattern.sub(knocked_out, text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("variants", nargs="?", default="", help="a KDA_VARIANT value: PATH=FILE[+PATH=FILE...][,...]")
    parser.add_argument("--baseline", action="store_true", help="the tree's files as variant A, alternated")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--keep-stage", action="store_true", help="keep the stores into the stage (see above)")
    mode.add_argument("--l2-states", action="store_true", help="keep every store; the states stay in L2 (see above)")
    args = parser.parse_args()
    out = pathlib.Path(args.out_dir).resolve()
    variants = [v for v in args.variants.split(",") if v]
    paths = sorted({part.split("=", 1)[0] for v in variants for part in v.split("+")} | set(KNOWN))

    def build(name: str, files: dict[str, pathlib.Path]) -> str:
        parts = []
        for path in paths:
            target = out / name / pathlib.Path(path).name
            source = files.get(path, ROOT / path)
            if path in KNOWN and args.l2_states:
                l2_states(path, source, target)
            elif path in KNOWN:
                storeless(source, target, args.keep_stage)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            shown = target.relative_to(ROOT) if target.is_relative_to(ROOT) else target
            parts.append(f"{path}={shown}")
        return "+".join(parts)

    baseline = build("tree", {}) if args.baseline else None
    built = []
    for i, v in enumerate(variants, start=1):
        files = {}
        for part in v.split("+"):
            path, file = part.split("=", 1)
            files[path] = ROOT / file  # (an absolute FILE stays itself)
        built.append(build(f"variant{i}", files))
    order = []
    if baseline:
        order.append(baseline)
    for b in built:
        order.append(b)
        if baseline:
            order.append(baseline)
    print(",".join(order))


if __name__ == "__main__":
    main()
