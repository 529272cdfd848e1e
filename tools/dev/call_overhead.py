"""Where a single flash_kda.fwd call's time goes beyond its kernels (a development probe, not a test).

Per bench_fwd case (indices into bench_fwd.CASES, comma-separated argument), ms per call:
  bench              the bench_fwd timing: one call between two CUDA events, the GPU idle before it;
  GPU busy before    the same, after a ~1 ms torch.cuda._sleep on the stream, so the host has enqueued the whole
                     call before its first kernel can start: the call's GPU time alone;
  graph replay       one CUDA-graph replay of the call (explicit workspace), between two events;
  span               20 calls back to back per timing (bench_fwd.time_ms(batch=20)).
"bench - busy" is what the host's validation and launches add to an isolated call on an idle GPU.

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/call_overhead.py 0,1,2
The "busy" timing is call_timeline.head_start_ms at a 1 ms head start (a 2,000,000-cycle sleep); figures measured
with it are in docs/PERFORMANCE.md.
"""
import sys

import torch
from absl import flags

import bench_fwd
import call_timeline  # tools/dev, beside this script
import flash_kda

flags.FLAGS(["call_overhead"])
HEAD_START_US = 1000  # the "GPU busy before" sleep: the whole call is enqueued before its first kernel starts
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0


def graph_of_call(inp: dict, case: bench_fwd.Case) -> torch.cuda.CUDAGraph:
    """One call as bench_fwd.run_flash_kda makes it (its gate and β scale included), with an explicit workspace
    (capture allocates nothing)."""
    workspace = torch.empty(flash_kda.workspace_bytes(inp["v"], inp["cu_seqlens"], gate=inp["gate"]),
                            dtype=torch.uint8, device="cuda")
    out = torch.empty_like(inp["v"])
    dtype = bench_fwd.STATE_DTYPES[case.state]
    init = None if dtype is None else inp["init"].to(dtype)
    final = None if init is None else torch.empty_like(init)

    def call():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], SCALE, out, inp["A_log"], inp["dt_bias"],
                      None if inp["gate"] == "softplus" else LOWER_BOUND, initial_state=init, final_state=final,
                      cu_seqlens=inp["cu_seqlens"], workspace=workspace, gate=inp["gate"],
                      allow_neg_eigval=inp["neg_eigval"])

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


cycles_per_us = call_timeline.sleep_cycles_per_us()
print("| case | bench ms | GPU busy before ms | graph replay ms | span ms | bench - busy | busy - span |")
print("|---|---:|---:|---:|---:|---:|---:|")
for index in (int(x) for x in sys.argv[1].split(",")):
    case = bench_fwd.CASES[index]
    inp = bench_fwd.make_inputs(case, "cuda")
    call, _ = bench_fwd.run_flash_kda(inp, case.state, SCALE, LOWER_BOUND)
    iters = 30 if case.token_heads <= bench_fwd.LONG_TOKEN_HEADS else 8
    bench = bench_fwd.time_ms(call, iters)
    busy = call_timeline.head_start_ms(call, HEAD_START_US, cycles_per_us, iters)[0]
    span = bench_fwd.time_ms(call, 5, warmup=2, batch=20)
    graph = graph_of_call(inp, case)
    replay = bench_fwd.time_ms(graph.replay, iters)
    print(f"| {case.name} | {bench:.3f} | {busy:.3f} | {replay:.3f} | {span:.3f} | {1e3 * (bench - busy):.0f} µs | "
          f"{1e3 * (busy - span):.0f} µs |", flush=True)
    del inp, call, graph
    torch.cuda.empty_cache()
