"""What prefix-cache checkpoints cost (a development probe, not a test): for T8192 H32 and T131072 H1, one call
without pools, pooled, pooled with checkpoints every 1024 and every 256, and pooled with C past the sequence (the
checkpoint kernels, no checkpoint written); per variant the eager time between CUDA events and each kernel's time
from torch.profiler. Figures measured with it: docs/PERFORMANCE.md, "Checkpoints".

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/checkpoint_cost.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

import bench_fwd  # kda/bench: time_ms, bench_fwd's CUDA-event timing of one eager call
import flash_kda

DEVICE = "cuda"
SCALE, LOWER_BOUND = 128**-0.5, -5.0


def kernel_us(call, reps: int = 10) -> dict:
    """Kernel name -> (launches per call, µs per call), from torch.profiler."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    rows = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            duration = event.device_time if hasattr(event, "device_time") else event.cuda_time
            rows.setdefault(event.name[:70], []).append(duration)
    return {name: (len(times) / reps, sum(times) / reps) for name, times in rows.items()}


def variants(T: int, H: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    q, k, v, g = (randn(1, T, H, 128).bfloat16() for _ in range(4))
    beta = randn(1, T, H).bfloat16()
    A_log = torch.rand(H, generator=gen).to(DEVICE)
    dt_bias = randn(H, 128) * 0.1
    out = torch.empty_like(v)
    M = T // 1024
    dense = (randn(1, H, 128, 128) * 0.1).bfloat16()
    dense_final = torch.empty_like(dense)
    pool = (randn(1 + M, H, 128, 128) * 0.1).bfloat16()  # slot 0: the final state; 1 .. M: the checkpoints
    pool_final = torch.empty_like(pool)
    slot = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    every_1024 = torch.arange(1, 1 + M, dtype=torch.int32, device=DEVICE).view(1, M)
    every_256 = (torch.arange(4 * M, dtype=torch.int32, device=DEVICE) % M + 1).view(1, 4 * M)

    def call(**kw):
        return lambda: flash_kda.fwd(q, k, v, g, beta, SCALE, out, A_log, dt_bias, LOWER_BOUND, **kw)

    pooled = dict(initial_state=pool, final_state=pool_final, state_indices=slot)
    return {
        "plain": call(initial_state=dense, final_state=dense_final),
        "pooled": call(**pooled),
        "pooled+ckpt1024": call(**pooled, checkpoint_indices=every_1024, checkpoint_every=1024),
        "pooled+ckpt_never": call(**pooled, checkpoint_indices=every_1024[:, :1].contiguous(), checkpoint_every=2 * T),
        "pooled+ckpt256": call(**pooled, checkpoint_indices=every_256, checkpoint_every=256),
    }


def main() -> None:
    for T, H in ((8192, 32), (131072, 1)):
        for name, call in variants(T, H).items():
            ms = bench_fwd.time_ms(call, iters=40, warmup=5)
            kernels = sorted(kernel_us(call).items(), key=lambda row: -row[1][1])
            listed = "; ".join(f"{kernel.split('<')[0].split('(')[0]} x{count:g} {us:.1f}us"
                               for kernel, (count, us) in kernels)
            print(f"T{T} H{H} {name}: event {ms:.3f} ms; kernels {listed}", flush=True)


if __name__ == "__main__":
    main()
