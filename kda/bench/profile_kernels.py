"""Where the forward's time goes: per-stage CUDA time (prepare, scan, compose, recurrence) from torch.profiler.

    tools/bazel run //kda/bench:profile_kernels -- --cases=0,3,7,11 --iters=5

(--cases, --case_names, --iters and --force_v_split / --force_segment_chunks are bench_fwd's flags: indices
into bench_fwd.CASES, a name filter, calls profiled per shape, a forced plan; each case runs in its own state
mode, bf16 unless its name says otherwise.)

Prints one row per shape: the plan and the mean time per call of each FlashKDA stage (prepare, the time
split's scan and compose, the recurrence's finishing pass). A program for choosing the next performance lever
and for measuring the plan's cost model, not a test.
"""

from __future__ import annotations

import torch
from absl import app, flags

import bench_fwd
from stages import STAGES, stage_times

FLAGS = flags.FLAGS


def profile_case(case: bench_fwd.Case, iters: int) -> tuple[dict[str, float], object]:
    """(ms per call of each stage, the plan the calls ran under)."""
    import flash_kda

    inp = bench_fwd.make_inputs(case, "cuda")
    call, _ = bench_fwd.run_flash_kda(inp, case.state, bench_fwd.HEAD_DIM**-0.5, -5.0)
    return stage_times(call, iters), flash_kda.plan(inp["v"], inp["cu_seqlens"], gate=case.gate)


def main(argv: list[str]) -> None:
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("profile_kernels needs a visible sm_90 GPU (H100/H200)")
    print("| case | plan (v, scan v, L, single) | " + " | ".join(f"{s.replace('_', ' ')} ms" for s in STAGES) +
          " | other ms | steps | recurrence µs per step |")
    print("|---|---|" + "---:|" * (len(STAGES) + 4))
    cases = bench_fwd.select_cases()
    forced = bench_fwd.forced_plan()  # bench_fwd's --force_* flags
    forced.__enter__()
    for case in cases:
        t, plan = profile_case(case, FLAGS.iters)
        longest = max(case.seqlens) if case.seqlens else case.seqlen
        steps = -(-longest // 16)
        if plan.segment_chunks:
            steps = min(steps, plan.segment_chunks)  # the finishing pass runs one segment per CTA
        rec = t.get("recurrence", 0.0) or t.get("single_pass", 0.0)
        cells = " | ".join(f"{t.get(stage, 0.0):.3f}" for stage in (*STAGES, "other"))
        print(f"| {case.name} | {tuple(plan)} | {cells} | {steps} | {1e3 * rec / steps:.2f} |",
              flush=True)


if __name__ == "__main__":
    app.run(main)
