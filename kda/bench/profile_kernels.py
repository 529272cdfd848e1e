"""Where the forward's time goes: per-kernel CUDA time (prepare vs recurrence) from torch.profiler.

    tools/bazel run //kda/bench:profile_kernels -- --cases=0,3,7,11 --iters=5

(--cases, --case_names and --iters are bench_fwd's flags: indices into bench_fwd.CASES, a name filter, calls
profiled per shape; each case runs in its own state mode, bf16 unless its name says otherwise.)

Prints one row per shape: the mean time per call of each FlashKDA kernel and of the whole call. A program
for choosing the next performance lever, not a test.
"""

from __future__ import annotations

import collections

import torch
from absl import app, flags

import bench_fwd

FLAGS = flags.FLAGS


def profile_case(case: bench_fwd.Case, iters: int) -> dict[str, float]:
    inp = bench_fwd.make_inputs(case, "cuda")
    call, _ = bench_fwd.run_flash_kda(inp, case.state, bench_fwd.HEAD_DIM**-0.5, -5.0)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            # every kernel whose name says prepare / recurrence counts there (several launches of either add up)
            lowered = event.name.lower()
            name = "prepare" if "prepare" in lowered else "recurrence" if "recurrence" in lowered else "other"
            per_kernel[name] += event.time_range.elapsed_us() / 1e3 / iters  # µs -> ms per call
    return dict(per_kernel)


def main(argv: list[str]) -> None:
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("profile_kernels needs a visible sm_90 GPU (H100/H200)")
    print("| case | prepare ms | recurrence ms | other ms | chunks/seq | recurrence µs per chunk |")
    print("|---|---:|---:|---:|---:|---:|")
    cases = bench_fwd.select_cases()
    for case in cases:
        t = profile_case(case, FLAGS.iters)
        longest = max(case.seqlens) if case.seqlens else case.seqlen
        chunks = -(-longest // 16)
        rec = t.get("recurrence", 0.0)
        print(f"| {case.name} | {t.get('prepare', 0.0):.3f} | {rec:.3f} | {t.get('other', 0.0):.3f} | {chunks} | "
              f"{1e3 * rec / chunks:.2f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
