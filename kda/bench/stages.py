"""Per-stage CUDA time of a FlashKDA call from torch.profiler (shared by profile_kernels and plan_sweep)."""

from __future__ import annotations

import collections
from typing import Callable

import torch

# Kernel name fragments, in the order they run (the overlap's prepare_tail runs beside the recurrence).
STAGES = ("prepare", "prepare_tail", "scan", "compose", "recurrence", "single_pass")


def stage_times(call: Callable[[], object], iters: int) -> dict[str, float]:
    """Mean ms per call of each stage over `iters` profiled calls (after 2 untimed ones); kernels whose name
    matches no stage (the boundary check, memsets) count as "other". Stages that run at the same time (the
    overlap) each count in full: their sum is then more than the call's time (bench_fwd.time_ms with a batch measures
    that)."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    per_stage: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            lowered = event.name.lower()
            stage = max((s for s in STAGES if s in lowered), key=len, default="other")  # the most specific
            per_stage[stage] += event.time_range.elapsed_us() / 1e3 / iters
    return dict(per_stage)

