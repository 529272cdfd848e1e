"""Estimates, without a GPU, the error against float64 of the chunked plans' arithmetic on short fixed-length
sequences (--T; the stream pass's calls are T = 16), per decode-slice shape and state configuration, over several
seeds.

The twin's exact arithmetic needs CUDA (its exp2, sigmoid and products come from the extension); this stands in
for it on the CPU with the same operand rounding (tensor-core operands rounded to bf16, fp32 accumulation) and
PyTorch's exp2 and sigmoid, so its figures are estimates of the kernel's, not its bits. A program, not a test:

    PYTHONPATH=<package>:kda/tests python3 tools/dev/chunked_short_error.py --seeds 12
    PYTHONPATH=<package>:kda/tests python3 tools/dev/chunked_short_error.py --stream-pass-cases
    PYTHONPATH=<package>:kda/tests python3 tools/dev/chunked_short_error.py --slice gate_softplus

The second form estimates the matrix's own stream-pass cases (matrix._stream_pass_cases, their seeds; a pool as
the dense states it holds); the third every case of a matrix slice up to --max-token-heads (one line per distinct
input: the slice's forced-plan copies of a case share its estimate), with the worst 64-token window.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import matrix
from flash_kda import compare, numerics, reference


def bf16_operand_arithmetic() -> numerics.Arithmetic:
    """The chunked kernels' rounding of tensor-core operands, with PyTorch's fp32 functions elsewhere."""
    def matmul(a, b, c=None):
        product = torch.matmul(a.float(), b.float())
        return product if c is None else c + product

    return dataclasses.replace(numerics.fp32_arithmetic(), operand=lambda x: x.to(torch.bfloat16), matmul=matmul,
                               hi_lo_update=lambda lower_bound: lower_bound is not None and lower_bound > -4)


def estimate(case: matrix.Case, ar: numerics.Arithmetic) -> tuple[float, float | None]:
    """Relative L2 errors of out and of the final state (None without one) of ``case`` against float64."""
    x = matrix.make_inputs(case, "cpu")
    twin = matrix.twin_args(x)
    out, state = numerics.chunked_forward(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["A_log"], x["dt_bias"], x["lower_bound"],
        twin.get("initial_state"), x["cu_seqlens"], ar, 0, twin.get("gate_kind", "lower_bound"),
        twin.get("beta_scale", 1.0))
    ref_out, ref_state = reference.reference_chunked(**twin)
    state_error = compare.compare(state.to(x["final_state"].dtype), ref_state).rel_l2 if case.has_final else None
    return compare.compare(out, ref_out).rel_l2, state_error


def estimate_slice(ar: numerics.Arithmetic, slice_: str, max_token_heads: int) -> None:
    print("| case | out | worst 64-token window | final state |")
    print("|---|---:|---:|---:|")
    seen = set()
    for case in matrix.cases(slice_):
        tokens = case.B * (case.T if case.seqlens is None else sum(case.seqlens))
        if tokens * case.H > max_token_heads:
            continue
        x = matrix.make_inputs(case, "cpu")
        twin = matrix.twin_args(x)
        signature = (tuple(x["q"].shape), case.seqlens, case.inputs, case.state_dtype, case.state_io, case.gate,
                     case.seed, twin.get("beta_scale"), case.pool, case.padding)
        if signature in seen:
            continue
        seen.add(signature)
        out, state = numerics._forward_on(
            twin.get("initial_state"), twin.get("final_state"), twin.get("state_indices"),
            lambda initial: numerics.chunked_forward(
                x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["A_log"], x["dt_bias"], x["lower_bound"],
                initial, x["cu_seqlens"], ar, 0, twin.get("gate_kind", "lower_bound"), twin.get("beta_scale", 1.0)))
        ref_out, ref_state = reference.reference_chunked(**twin)
        c = compare.compare(out, ref_out, window=64)
        state_error = ""
        if case.has_final and twin.get("state_indices") is None:
            state_error = f"{compare.compare(state.to(x['final_state'].dtype), ref_state).rel_l2:.2e}"
        print(f"| {case.id} | {c.rel_l2:.2e} | {c.window_rel_l2:.2e} | {state_error} |",
              flush=True)


def estimate_stream_pass_cases(ar: numerics.Arithmetic) -> None:
    print("| case | out | final state |")
    print("|---|---:|---:|")
    for case in matrix._stream_pass_cases():
        dense = dataclasses.replace(case, pool=0, padding=0, inplace_state=False) if case.pool else case
        out, state = estimate(dense, ar)
        print(f"| {case.id} | {out:.2e} | {'' if state is None else f'{state:.2e}'} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--T", type=int, default=16)
    parser.add_argument("--stream-pass-cases", action="store_true", help="the matrix's stream-pass cases instead")
    parser.add_argument("--slice", help="every case of this matrix slice instead")
    parser.add_argument("--max-token-heads", type=int, default=40000, help="with --slice: larger cases are skipped")
    args = parser.parse_args()
    ar = bf16_operand_arithmetic()
    if args.stream_pass_cases:
        estimate_stream_pass_cases(ar)
        return
    if args.slice:
        estimate_slice(ar, args.slice, args.max_token_heads)
        return
    print("| shape | state in/out | final dtype | out max | out mean | state max | state mean |")
    print("|---|---|---|---:|---:|---:|---:|")
    for H, B in ((1, 1), (4, 1), (32, 1), (4, 3)):
        for io in ("in+out", "out_only"):
            for dt in ("bf16", "fp32"):
                outs, states = [], []
                for seed in range(args.seeds):
                    case = matrix.Case("decode", H=H, B=B, T=args.T, state_io=io, state_dtype=dt, seed=1000 + seed)
                    out, state = estimate(case, ar)
                    outs.append(out)
                    states.append(state)
                print(f"| B{B} T{args.T} H{H} | {io} | {dt} | {max(outs):.2e} | {sum(outs) / len(outs):.2e} | "
                      f"{max(states):.2e} | {sum(states) / len(states):.2e} |", flush=True)


if __name__ == "__main__":
    main()
