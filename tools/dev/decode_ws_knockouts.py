"""Knock-out builds of the warp-specialised decode kernel: what each part of it costs (a development measurement on
the GPU machine, not a test; the knock-outs compute wrong results on purpose).

Writes copies of kda/csrc/decode_warp_specialised.cu with one part removed into OUT_DIR and prints the KDA_VARIANT
value that has tools/dev/gpu_iterate.sh build and time each of them after the tree as it is:

  python3 tools/dev/decode_ws_knockouts.py OUT_DIR
  KDA_TESTS= KDA_PROFILE= KDA_BENCH="--peers= --cases=17 --iters=50" KDA_VARIANT="$(python3 ... OUT_DIR)" \\
      tools/dev/gpu_iterate.sh

Variants (docs/PERFORMANCE.md at tag measurements-2026-12-07, "Where the warp-specialised kernel waits"):
  prep_free         the preparing warps publish constant tokens: no loads, no gate or norm arithmetic
  arithmetic_free   the state warps skip the per-token sweeps (same handshakes, same output stores)
  sweeps_once_per_head  the sweeps on each head's first token only, the other tokens as in arithmetic_free: the
                    state warps' side of a step that took a head's tokens together at one token's cost
  memory_free       no initial-state copies and no final-state stores
  no_final_store    no final-state stores
  no_initial_copy   no initial-state copies (the stage barrier gets a plain arrival)
  stage_conflict_free  the state rows' stage loads and stores at lane-contiguous addresses (2 shared-memory
                    wavefronts an access where the row layout takes 4; the rows land permuted)

Each edit is an exact replacement of the kernel's text and fails loudly once the kernel has changed under it.
"""
from __future__ import annotations

import pathlib
import sys

# Not resolved: in a test's runfiles (kda/tests/test_dev_tools.py) the kernel sources lie beside the link.
ROOT = pathlib.Path(__file__).absolute().parents[2]
KERNEL = "kda/csrc/decode_warp_specialised.cu"

PREP_OLD = """        const RawTokenChannels raw = load_token_channels(p, b.bos + (pos - item_start), h, hk, ch0);
        const LaneKeys lk = prepare_keys<kGate>(p, hg, raw, raw.beta);
        float v[4];
        prep::unpack4(raw.v, v);
"""
PREP_NEW = """        (void)hk;
        (void)hg;
        const LaneKeys lk{{0.5f, 0.5f, 0.5f, 0.5f}, {0.01f, 0.01f, 0.01f, 0.01f}, {0.01f, 0.01f, 0.01f, 0.01f}, 0.5f};
        const float v[4] = {0.1f, 0.1f, 0.1f, 0.1f};
"""
SWEEPS_OLD = """      float leaves[kLaneRows][kLaneLeaves];
      decay_and_key_leaves(s, leaves, tok.alpha, tok.k_hat, col);
      float sums[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_4(leaves[r]);
      const float u_mine = __fmul_rn(beta, __fsub_rn(v_in, octet_reduce_scatter(sums)));
      // Register row r's u is that of lane ^ 2r, whose own row it is (both lanes of a pair hold their row's u);
      // r = 0 shuffles too (xor 0): u_mine kept aside cost registers and spills.
      float u[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) u[r] = __shfl_xor_sync(0xffffffffu, u_mine, 2 * r);

      // S += u·k̂ᵀ; then the output partials o = S·q̃.
      update_and_query_leaves(s, leaves, u, tok.k_hat, tok.q_tilde, col);
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = lane_tree_4(leaves[r]);
"""
SWEEPS_NEW = """      float sums[kLaneRows];
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) sums[r] = __fmaf_rn(s[r][0][0], beta, v_in);
"""
# The sweeps on a head's first token only (the other tokens as in arithmetic_free): about what a step taking a
# head's 4 tokens at once in one token's instructions would leave to the state warps.
SWEEPS_ONCE_NEW = ("      float sums[kLaneRows];\n      if (left == head.len) {\n"
                   + SWEEPS_OLD.replace("      float sums[kLaneRows];\n", "")
                   + "      } else {\n"
                   + SWEEPS_NEW.replace("      float sums[kLaneRows];\n", "")
                   + "      }\n")
COPY_OLD = "  if (p.initial_state != nullptr && offset >= 0) {\n    constexpr"
COPY_NEW = "  if (false && offset >= 0) {\n    constexpr"
STORE_OLD = "    if (p.final_state != nullptr && head.state_offset >= 0) {"
STORE_NEW = "    if (false && head.state_offset >= 0) {"
# Each (r, k) access of a warp at 32 consecutive 8-byte words: what the stage's bank conflicts cost.
STAGE_LOAD_OLD = "load4(src + row_of(r) * kHeadDim + col(k), s[r][k]);"
STAGE_LOAD_NEW = "load4(src + (r * kLaneLeaves + k) * kHeadDim + 4 * lane, s[r][k]);"
STAGE_STORE_OLD = "store4(rows + row_of(r) * kHeadDim + col(k), s[r][k]);"
STAGE_STORE_NEW = "store4(rows + (r * kLaneLeaves + k) * kHeadDim + 4 * lane, s[r][k]);"

VARIANTS = {
    "prep_free": [(PREP_OLD, PREP_NEW)],
    "arithmetic_free": [(SWEEPS_OLD, SWEEPS_NEW)],
    "sweeps_once_per_head": [(SWEEPS_OLD, SWEEPS_ONCE_NEW)],
    "memory_free": [(COPY_OLD, COPY_NEW), (STORE_OLD, STORE_NEW)],
    "no_final_store": [(STORE_OLD, STORE_NEW)],
    "no_initial_copy": [(COPY_OLD, COPY_NEW)],
    "stage_conflict_free": [(STAGE_LOAD_OLD, STAGE_LOAD_NEW), (STAGE_STORE_OLD, STAGE_STORE_NEW)],
}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = (ROOT / KERNEL).read_text()
    specs = []
    for name, edits in VARIANTS.items():
        text = source
        for old, new in edits:
            if text.count(old) != 1:
                sys.exit(f"{name}: the text to replace occurs {text.count(old)} times in {KERNEL}; refresh this tool")
            text = text.replace(old, new)
        path = out / f"decode_ws_{name}.cu"
        path.write_text(text)
        specs.append(f"{KERNEL}={path}")
    print(",".join(specs))


if __name__ == "__main__":
    main()
