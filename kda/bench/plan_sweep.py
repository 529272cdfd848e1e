"""The cost model's measurements: every stage's time under forced plans (time split and V splits), per shape.

    tools/bazel run //kda/bench:plan_sweep -- --cases=2,6,7,8 --segments=0,32,64,128,256 --v_splits=1,2,4,8

Per case (bench_fwd's --cases / --case_names) and per plan in segments x v_splits x scan_v_splits (or, with
--leads, per forced overlap lead), prints the mean CUDA time per call of each stage from torch.profiler (prepare,
prepare_tail, scan, compose, recurrence), their sum and the GPU time per call of calls issued back to back (the
call's span: what the overlap's concurrent stages take together), then the automatic plan's row and the best
forced row (by span). The constants of kda_plan.h's SplitCostModel come from
these tables (docs/DESIGN.md, "The plan"). A program, not a test; our kernel only (no peers).
"""

from __future__ import annotations

import itertools

import torch
from absl import app, flags

import bench_fwd
from stages import STAGES, stage_times

FLAGS = flags.FLAGS
flags.DEFINE_list("segments", ["0", "32", "64", "128", "256"], "time splits to force (chunks per segment; 0: none)")
flags.DEFINE_list("v_splits", ["1", "2", "4", "8"], "finishing-pass V splits to force")
flags.DEFINE_list("scan_v_splits", ["1", "2", "4"], "scan-pass V splits to force (time-split plans only)")
flags.DEFINE_integer("profile_iters", 5, "profiled calls per plan")
flags.DEFINE_bool("single_pass", True, "also force the single pass (one kernel, no time split, v_split 1)")
flags.DEFINE_list("leads", [], "instead of the segments x v_splits plans: the overlap forced with these leads "
                  "(chunks; -1: without the overlap)")

def main(argv: list[str]) -> None:
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("plan_sweep needs a visible sm_90 GPU (H100/H200)")
    import flash_kda
    from flash_kda import testing

    segments = [int(x) for x in FLAGS.segments]
    v_splits = [int(x) for x in FLAGS.v_splits]
    scan_v_splits = [int(x) for x in FLAGS.scan_v_splits]
    print("| case | plan (v, scan v, L, single) | " + " | ".join(s.replace("_", " ") for s in STAGES) +
          " | other | sum ms | span ms |")
    print("|---|---|" + "---:|" * (len(STAGES) + 3))
    for case in bench_fwd.select_cases():
        inp = bench_fwd.make_inputs(case, "cuda")
        call, _ = bench_fwd.run_flash_kda(inp, case.state, bench_fwd.HEAD_DIM**-0.5, -5.0)
        rows = []
        plans = [("auto", None)]
        if FLAGS.leads:
            plans += [("forced", ("lead", int(x))) for x in FLAGS.leads]
        else:
            for L, v in itertools.product(segments, v_splits):
                for sv in scan_v_splits if L else [0]:
                    plans.append(("forced", (v, L, sv)))
            if FLAGS.single_pass:
                plans.append(("forced", "single"))
        for label, forced in plans:
            if forced is None:
                kwargs = {}
            elif forced == "single":
                kwargs = {"single_pass": True}
            elif forced[0] == "lead":
                kwargs = {"lead_chunks": forced[1]}
            else:
                kwargs = {"v_split": forced[0], "segment_chunks": forced[1], "scan_v_split": forced[2]}
            with testing.force_plan(**kwargs):
                plan = flash_kda.plan(inp["v"], inp["cu_seqlens"], gate=case.gate)  # how the call ran
                t = stage_times(call, FLAGS.profile_iters)
                span = bench_fwd.time_ms(call, 5, warmup=2, batch=20)
            total = sum(t.values())
            rows.append((span, label, plan))
            cells = " | ".join(f"{t.get(s, 0.0):.3f}" for s in (*STAGES, "other"))
            print(f"| {case.name} | {label} {tuple(plan)} | {cells} | {total:.3f} | {span:.3f} |", flush=True)
        best = min(r for r in rows if r[1] == "forced")
        auto = next(r for r in rows if r[1] == "auto")
        print(f"| {case.name} | **auto {tuple(auto[2])} {auto[0]:.3f} ms; best {tuple(best[2])} {best[0]:.3f} ms** "
              "| | | | | | |", flush=True)


if __name__ == "__main__":
    app.run(main)
