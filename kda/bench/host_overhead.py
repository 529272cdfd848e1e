"""Host time per call of flash_kda.fwd: the direct call vs the torch.ops.flash_kda.fwd operator (the path
torch.compile takes). A program, not a test:

    tools/bazel run //kda/bench:host_overhead -- --calls=3000

On a tiny problem (T = 16, H = 1: the GPU finishes each launch long before the host issues the next) the
host's wall time per call is the cost of validation, dispatch and the two launches. Prints µs per call
(median of 5 rounds) for both paths, with and without the state buffers and with cu_seqlens, then where a
direct call's time goes (each step of launch.run timed alone, next to the torch calls it avoids).
"""

from __future__ import annotations

import statistics
import time

import torch
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("calls", 3000, "calls per timed round")
flags.DEFINE_integer("rounds", 5, "timed rounds (the median is printed)")

D = 128


def _inputs(state: bool, varlen: bool) -> dict:
    bf16 = torch.bfloat16
    T, H = 16, 1
    x = dict(q=torch.randn(1, T, H, D, device="cuda").to(bf16), k=torch.randn(1, T, H, D, device="cuda").to(bf16),
             v=torch.randn(1, T, H, D, device="cuda").to(bf16), g=torch.randn(1, T, H, D, device="cuda").to(bf16),
             beta=torch.randn(1, T, H, device="cuda").to(bf16), scale=D**-0.5, A_log=torch.randn(H, device="cuda"),
             dt_bias=torch.randn(H, D, device="cuda"), lower_bound=-5.0)  # fmt: skip
    x["out"] = torch.empty_like(x["v"])
    n = 2 if varlen else 1
    x["initial_state"] = torch.randn(n, H, D, D, device="cuda").to(bf16) if state else None
    x["final_state"] = torch.empty_like(x["initial_state"]) if state else None
    x["cu_seqlens"] = torch.tensor([0, 7, T], dtype=torch.int64, device="cuda") if varlen else None
    return x


def _per_call_us(fn, x: dict, *extra, **keywords) -> float:
    """Host µs per call of fn with the inputs x (as flash_kda.fwd takes them) and any extra arguments."""
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"], x["dt_bias"],
            x["lower_bound"], x["initial_state"], x["final_state"], x["cu_seqlens"], *extra)
    return _loop_us(lambda: fn(*args, **keywords))


def _loop_us(fn) -> float:
    """Host µs per call of fn() (no GPU work, or GPU work far shorter than the host's): median of the rounds."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(FLAGS.rounds):
        t0 = time.perf_counter()
        for _ in range(FLAGS.calls):
            fn()
        rounds.append((time.perf_counter() - t0) / FLAGS.calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def _enter_device(device: torch.device) -> None:
    with torch.cuda.device(device):
        pass


def _launch_arguments(C, call) -> tuple:
    """The arguments launch.run passes to the extension's fwd during call() (which runs it once), taken from the
    call itself so that they always match the binding (kda/csrc/binding.cpp)."""
    captured = []
    launch = C.fwd
    C.fwd = lambda *groups: (captured.append(groups), launch(*groups))[1]
    try:
        call()
    finally:
        C.fwd = launch
    return captured[0]


def _breakdown(x: dict) -> None:
    """Where a direct call's host time goes: each step of launch.run timed alone."""
    from flash_kda import _ext, api, planning, validation

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"], x["dt_bias"],
            x["lower_bound"], x["initial_state"], x["final_state"], x["cu_seqlens"], None)
    q = x["q"]
    index = q.device.index
    C = _ext.load()
    dims = (q.shape[0], q.shape[1], q.shape[2], q.shape[0], False)  # B, T, H, N, varlen
    launch_args = _launch_arguments(C, lambda: api.fwd(*args[:13]))
    steps = {
        "whole flash_kda.fwd": lambda: api.fwd(*args[:13]),
        "validation.validate": lambda: validation.validate(*args, concrete=True),
        "api.plan (cached)": lambda: api.plan(q),
        "_ext.current_stream": lambda: _ext.current_stream(index),
        "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream(q.device).cuda_stream,
        "with torch.cuda.device(q.device): pass": lambda: _enter_device(q.device),
        "planning.plan_for (cached)": lambda: planning.plan_for(*dims, planning.sm_count_of(index)),
        "C.fwd (launches only)": lambda: C.fwd(*launch_args),
    }
    print("\n| step of a direct call (no state) | µs |\n|---|---:|")
    for label, fn in steps.items():
        print(f"| {label} | {_loop_us(fn):.1f} |", flush=True)


def main(argv: list[str]) -> None:
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("host_overhead times CUDA launches and needs a visible GPU")
    import flash_kda
    from flash_kda import ops  # noqa: F401 -- registers torch.ops.flash_kda.fwd

    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {FLAGS.calls} calls x {FLAGS.rounds} rounds")
    print("| call | flash_kda.fwd µs | torch.ops.flash_kda.fwd µs |")
    print("|---|---:|---:|")
    for state, varlen in ((False, False), (True, False), (True, True)):
        x = _inputs(state, varlen)
        direct = _per_call_us(flash_kda.fwd, x)
        op = _per_call_us(torch.ops.flash_kda.fwd, x, None, None, "lower_bound", False, None, None, 0)  # all 20
        label = ("bf16 state in+out" if state else "no state") + (", cu_seqlens" if varlen else "")
        print(f"| {label} | {direct:.1f} | {op:.1f} |", flush=True)
    # A serving engine's call: the states in a pool of 4 slots, updated in place at slot 2.
    x = _inputs(True, False)
    x["initial_state"] = x["final_state"] = torch.zeros(4, *x["initial_state"].shape[1:], dtype=torch.bfloat16,
                                                        device="cuda")
    indices = torch.tensor([2], dtype=torch.int32, device="cuda")
    direct = _per_call_us(flash_kda.fwd, x, state_indices=indices)
    op = _per_call_us(torch.ops.flash_kda.fwd, x, None, indices, "lower_bound", False, None, None, 0)
    print(f"| bf16 pool in place, state_indices | {direct:.1f} | {op:.1f} |", flush=True)
    _breakdown(_inputs(False, False))


if __name__ == "__main__":
    app.run(main)
