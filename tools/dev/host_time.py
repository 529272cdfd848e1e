"""Host time of pooled and per-token eager calls (a development probe, not a test): 128 sequences x 4 tokens, H32,
a bf16 pool in place; 200 fwd calls back to back timed with time.perf_counter (the GPU work queues behind them),
then a cProfile of 200 more, by internal time. Figures measured with it: docs/PERFORMANCE.md, "Per-token states".

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/host_time.py
"""
import cProfile
import io
import pstats
import time

import torch

import flash_kda

DEVICE = "cuda"
N, L, H = 128, 4, 32
CALLS = 200


def calls() -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    T = N * L
    q, k, v, g = (randn(1, T, H, 128).bfloat16() for _ in range(4))
    beta = randn(1, T, H).bfloat16()
    A_log = torch.rand(H, generator=gen).to(DEVICE)
    dt_bias = randn(H, 128) * 0.1
    cu_seqlens = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(v)
    pool = (randn(N * L + 8, H, 128, 128) * 0.1).bfloat16()
    token_slots = torch.randperm(N * L, generator=gen).view(N, L).to(torch.int32).to(DEVICE)
    accepted = torch.randint(1, L + 1, (N,), generator=gen).to(torch.int32).to(DEVICE)
    final_slots = token_slots[:, 0].contiguous()
    args = (q, k, v, g, beta, 128**-0.5, out, A_log, dt_bias, -5.0, pool, pool, cu_seqlens)
    return {
        "per-token": lambda: flash_kda.fwd(*args, state_indices=token_slots, num_accepted_tokens=accepted),
        "final-only pooled": lambda: flash_kda.fwd(*args, state_indices=final_slots),
    }


def main() -> None:
    for name, call in calls().items():
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        host_us = (time.perf_counter() - start) / CALLS * 1e6
        torch.cuda.synchronize()
        print(f"{name}: host {host_us:.1f} us per call (fwd)", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALLS):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        report = io.StringIO()
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(14)
        print(report.getvalue()[-3500:])


if __name__ == "__main__":
    main()
