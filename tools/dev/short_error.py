"""Errors of short sequences against float64 on the GPU (a development probe, not a test): per sequence length
(1, 2, 3, 5, 8, 15, 16 tokens, B64 H32, bench_fwd's inputs) and state mode, the relative L2 of out and the final
state for the decode kernel and for a chunked plan, and, to find where a chunked call's error comes from, the
chunked twin with one of its approximations made exact at a time (docs/NUMERICS.md, "Where a one-token
sequence's error comes from in the chunked kernels").

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/short_error.py
"""
import dataclasses

import torch
from absl import flags

import bench_fwd
import flash_kda
from flash_kda import compare, numerics, reference, testing

flags.FLAGS(["short_error"])
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0
LENGTHS = (1, 2, 3, 5, 8, 15, 16)


def rel(a, b) -> float:
    return compare.compare(a, b).rel_l2


def run_kernel(x, init, decode: bool, state_dtype):
    out = torch.empty_like(x["v"])
    initial = None if init is None else init.to(state_dtype)
    final = None if init is None else torch.empty_like(initial)
    with testing.force_plan(decode=decode):
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, out, x["A_log"], x["dt_bias"], LOWER_BOUND,
                      initial_state=initial, final_state=final)
    return out, final


def main() -> None:
    exact_exp2 = dataclasses.replace(numerics.kernel_arithmetic(), exp2=torch.exp2)
    exact_sigmoid = dataclasses.replace(numerics.kernel_arithmetic(), sigmoid=torch.sigmoid)
    exact_both = dataclasses.replace(exact_exp2, sigmoid=torch.sigmoid)
    fp32_operands = dataclasses.replace(numerics.kernel_arithmetic(), operand=lambda t: t,
                                        matmul=numerics.fp32_arithmetic().matmul, hi_lo_update=lambda lb: False)
    variants = {"twin": numerics.kernel_arithmetic(), "exact exp2": exact_exp2, "exact sigmoid": exact_sigmoid,
                "exact both": exact_both, "fp32 operands": fp32_operands, "fp32 path": numerics.fp32_arithmetic()}
    print("| T | state | decode out | decode state | chunked out | chunked state | chunked = twin | "
          + " | ".join(f"{v} out" for v in variants if v != "twin") + " |")
    for T in LENGTHS:
        for mode in ("bf16", "fp32", "none"):
            case = bench_fwd.Case(f"B64 T{T} H32", 64, T, 32, state="bf16" if mode == "none" else mode)
            x = bench_fwd.make_inputs(case, "cuda")
            init = None if mode == "none" else x["init"]
            dtype = bench_fwd.STATE_DTYPES["bf16" if mode == "none" else mode]
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["A_log"], x["dt_bias"], LOWER_BOUND)
            ref_out, ref_state = reference.reference_chunked(*args, initial_state=init)
            d_out, d_state = run_kernel(x, init, True, dtype)
            c_out, c_state = run_kernel(x, init, False, dtype)
            twin_in = None if init is None else init.to(dtype)
            cells = [f"{rel(d_out, ref_out):.2e}", "—" if init is None else f"{rel(d_state, ref_state):.2e}",
                     f"{rel(c_out, ref_out):.2e}", "—" if init is None else f"{rel(c_state, ref_state):.2e}"]
            twin_out, _ = numerics.chunked_forward(*args, twin_in, None, variants["twin"])
            cells.append("yes" if torch.equal(twin_out, c_out) else "NO")
            for name, ar in variants.items():
                if name != "twin":
                    out, _ = numerics.chunked_forward(*args, twin_in, None, ar)
                    cells.append(f"{rel(out, ref_out):.2e}")
            print(f"| {T} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
