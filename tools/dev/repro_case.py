"""Runs one correctness-matrix case (kda/tests/matrix.py) several times and prints how kernel and twin differ.

    cd bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda && python3 <repo>/tools/dev/repro_case.py CASE_ID [REPEATS]

A debugging aid for intermittent mismatches (a race shows as a count that changes between repeats).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kda", "tests"))
import matrix  # noqa: E402

import flash_kda  # noqa: E402
from flash_kda import compare, numerics, testing  # noqa: E402


def main() -> None:
    case_id, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    only_mismatches = len(sys.argv) > 3
    case = next(c for c in matrix.all_cases() if c.id == case_id)
    x = matrix.make_inputs(case, "cuda")
    twin_out, twin_state = numerics.twin_forward(
        **matrix.twin_args(x), final_dtype=x["final_state"].dtype if case.has_final else None)
    for i in range(repeats):
        out = torch.full_like(x["out"], float("nan"))
        fin = None if x["final_state"] is None else torch.full_like(x["final_state"], float("nan"))
        args = {**matrix.twin_args(x), "out": out, "final_state": fin}
        del args["cu_seqlens"]
        with testing.force_plan(v_split=case.v_split):
            flash_kda.fwd(**args, cu_seqlens=x["cu_seqlens"])
        torch.cuda.synchronize()
        m_out = compare.bitwise_mismatch(out, twin_out)
        line = f"[{case_id} {i}] out: {m_out}"
        bad = m_out.count > 0
        if fin is not None:
            m_state = compare.bitwise_mismatch(fin, twin_state.to(fin.dtype))
            bad = bad or m_state.count > 0
            line += f" | state: {m_state}"
        if bad or not only_mismatches:
            print(line[:900], flush=True)


if __name__ == "__main__":
    main()
