"""The overlap's lead against its time (a development probe, not a test): for fixed-length calls that the plan runs
with the overlap, the time of one call under each forced lead (testing.force_plan(lead_chunks=L); -1: no
overlap) beside the automatic plan's, from a CUDA graph replay (GPU time) with an explicit workspace, bf16 states.
The lead at which the time stops falling tells the tail's real rate (kda_plan.h, OverlapModel).

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/lead_sweep.py [ROWS]
ROWS: rows separated by ';', each HEADS:GATE:LEADS with LEADS comma-separated (default: DEFAULT_ROWS). A lead of 0
puts every record on the tail: its rate is then records / (tail SMs · time).
"""
import sys

import torch
from absl import flags

import bench_fwd
import flash_kda
from flash_kda import testing

flags.FLAGS(["lead_sweep"])
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0
DEFAULT_ROWS = "96:softplus:-1,300,340,380,422,474;64:softplus:-1,160,202,250,300,351;96:lower_bound:-1,380,422,474"


def parse_rows(spec: str) -> list[tuple[int, str, list[int]]]:
    rows = []
    for row in spec.split(";"):
        heads, gate, leads = row.split(":")
        rows.append((int(heads), gate, [int(lead) for lead in leads.split(",")]))
    return rows


def main() -> None:
    rows = parse_rows(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_ROWS)
    print("| call | plan's lead | auto ms | forced leads: ms |")
    for heads, gate, leads in rows:
        name = f"T8192 H{heads} {gate}"
        case = bench_fwd.Case(name, 1, 8192, heads, gate=gate)
        x = bench_fwd.make_inputs(case, "cuda")
        init = x["init"].to(torch.bfloat16)
        final = torch.empty_like(init)
        out = torch.empty_like(x["v"])
        lb = None if gate == "softplus" else LOWER_BOUND
        # One workspace for every plan timed: the largest that the automatic plan and the forced leads need.
        ws_bytes = flash_kda.workspace_bytes(x["v"], gate=gate)
        for lead in leads:
            with testing.force_plan(lead_chunks=lead):
                ws_bytes = max(ws_bytes, flash_kda.workspace_bytes(x["v"], gate=gate))
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")

        def call():
            flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, out, x["A_log"], x["dt_bias"], lb,
                          initial_state=init, final_state=final, workspace=ws, gate=gate)

        plan_lead = flash_kda.plan(x["v"], gate=gate).lead_chunks
        cells = [f"{bench_fwd.graph_time_ms(call, 30):.3f}"]
        for lead in leads:
            with testing.force_plan(lead_chunks=lead):
                cells.append(f"L {lead}: {bench_fwd.graph_time_ms(call, 30):.3f}")
        print(f"| {name} | {plan_lead} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
