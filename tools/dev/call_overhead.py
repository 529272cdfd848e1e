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
(eleventh session, call 59: docs/MEASUREMENTS.md).
"""
import statistics, sys, torch
from absl import flags
import bench_fwd, flash_kda
flags.FLAGS(["probe"])
def timed(fn, iters=30, sleep_cycles=0):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles: torch.cuda._sleep(sleep_cycles)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)
print("| case | bench ms | GPU busy before ms | graph replay ms | span ms | bench - busy | busy - span |")
print("|---|---:|---:|---:|---:|---:|---:|")
for i in [int(x) for x in sys.argv[1].split(",")]:
    case = bench_fwd.CASES[i]
    inp = bench_fwd.make_inputs(case, "cuda")
    call, _ = bench_fwd.run_flash_kda(inp, case.state, bench_fwd.HEAD_DIM**-0.5, -5.0)
    it = 30 if case.token_heads <= bench_fwd.LONG_TOKEN_HEADS else 8
    a = timed(call, it)
    b = timed(call, it, sleep_cycles=2_000_000)  # ~1 ms of sleep: the whole call is enqueued before it starts
    c = bench_fwd.time_ms(call, 5, warmup=2, batch=20)
    # graph: the same call with an explicit workspace, captured once
    ws = torch.empty(flash_kda.workspace_bytes(inp["q"], inp["cu_seqlens"]) + 64, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(inp["v"]); st = bench_fwd.STATE_DTYPES[case.state]
    init = None if st is None else inp["init"].to(st); fin = None if init is None else torch.empty_like(init)
    def gcall():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], bench_fwd.HEAD_DIM**-0.5, out, inp["A_log"],
                      inp["dt_bias"], -5.0, initial_state=init, final_state=fin, cu_seqlens=inp["cu_seqlens"], workspace=ws)
    gcall(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gcall()
    d = timed(g.replay, it)
    print(f"| {case.name} | {a:.3f} | {b:.3f} | {d:.3f} | {c:.3f} | {1e3*(a-b):.0f} µs | {1e3*(b-c):.0f} µs |", flush=True)
    del inp, call, ws, g
    torch.cuda.empty_cache()
