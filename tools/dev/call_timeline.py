"""The timeline of isolated flash_kda.fwd calls (a development probe, not a test): when the host issues each
runtime call and when each GPU operation runs, relative to the call's start event, from a torch.profiler trace.

Per bench_fwd case (indices into bench_fwd.CASES, comma-separated first argument):
  - medians over the profiled calls, µs after the start event's cudaEventRecord returned: each runtime call's
    start (host) and each GPU operation's start and end (device), so a late launch or a serialised dependent
    shows as a gap;
  - the bench's timing with the host given a head start: a torch.cuda._sleep of s µs before the start event,
    for several s (the time falls with s while the host is the long pole, then stays at the GPU time).

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/call_timeline.py 0,1,8
"""
import collections
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from absl import flags
from torch.profiler import ProfilerActivity, profile

import bench_fwd

flags.FLAGS(["call_timeline"])
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0
PROFILED_CALLS = 12
HEAD_STARTS_US = (0, 10, 20, 30, 45, 60, 100, 1000)
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def isolated(call) -> None:
    """One call as bench_fwd.time_ms times it: start event, the call, end event, wait."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()


def short(name: str) -> str:
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.replace("void ", "").replace("kda::", "").replace("(anonymous namespace)::", "")[:34]


def trace_of(call) -> list[dict]:
    for _ in range(3):
        isolated(call)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            isolated(call)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def timeline(events: list[dict]) -> list[tuple[str, float, float]]:
    """(label, median start µs, median end µs) per host call and GPU operation, in order of start."""
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    records = [e for e in host if e["name"].startswith("cudaEventRecord")]
    rows = collections.defaultdict(list)
    for i in range(0, len(records) - 1, 2):
        t0 = records[i]["ts"] + records[i]["dur"]
        t1 = records[i + 1]["ts"]
        seen = collections.Counter()
        for e in host:
            if t0 <= e["ts"] <= t1 + 1 and not e["name"].startswith("cudaEventRecord"):
                label = "host " + short(e["name"])
                seen[label] += 1
                rows[f"{label} #{seen[label]}"].append((e["ts"] - t0, e["ts"] + e["dur"] - t0))
        rows["host end-event record"].append((t1 - t0, t1 - t0))
        for e in gpu:
            if t0 <= e["ts"] and (i + 2 >= len(records) or e["ts"] < records[i + 2]["ts"]):
                label = "GPU  " + short(e["name"])
                seen[label] += 1
                rows[f"{label} #{seen[label]}"].append((e["ts"] - t0, e["ts"] + e["dur"] - t0))
    out = [(label, statistics.median(s for s, _ in v), statistics.median(x for _, x in v))
           for label, v in rows.items() if len(v) >= PROFILED_CALLS // 2]
    return sorted(out, key=lambda r: r[1])


def head_start_ms(call, head_start_us: float, cycles_per_us: float, iters: int = 30) -> tuple[float, float]:
    """(bench-style ms, host µs inside the call) with a head start of head_start_us for the host."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if head_start_us:
            torch.cuda._sleep(int(head_start_us * cycles_per_us))
        start.record()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), 1e6 * statistics.median(host)


def sleep_cycles_per_us() -> float:
    cycles = 20_000_000
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def main() -> None:
    rate = sleep_cycles_per_us()
    print(f"torch.cuda._sleep: {rate:.0f} cycles per µs")
    summary = []
    for index in (int(x) for x in sys.argv[1].split(",")):
        case = bench_fwd.CASES[index]
        inp = bench_fwd.make_inputs(case, "cuda")
        call, _ = bench_fwd.run_flash_kda(inp, case.state, SCALE, LOWER_BOUND, case.inplace)
        if os.environ.get("TIMELINE_PROFILE", "1") == "1":
            print(f"\n## {case.name}: median of {PROFILED_CALLS} profiled isolated calls, µs after the start event")
            print("| what | start | end |\n|---|---:|---:|")
            for label, s, e in timeline(trace_of(call)):
                print(f"| {label} | {s:.1f} | {e:.1f} |")
        timed = [head_start_ms(call, us, rate) for us in HEAD_STARTS_US]
        summary.append((case.name, timed))
        del inp, call
        torch.cuda.empty_cache()
    print("\n## summary: bench-style ms (host µs inside the call) with the host given a head start of s µs, in run order")
    print("| case | " + " | ".join(f"s={us}" for us in HEAD_STARTS_US) + " |")
    for name, timed in summary:
        print(f"| {name} | " + " | ".join(f"{t:.3f} ({h:.0f})" for t, h in timed) + " |")


if __name__ == "__main__":
    main()
