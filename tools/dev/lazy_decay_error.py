"""The token step with the decay kept aside (a development probe, not a test; CPU): how accurate and how far from
fp32's range a "lazy decay" form of the decode recurrence would be, before building it.

Today each token costs a state lane 64 FMULs for S ← S·Diag(α) before the key sweep (docs/PERFORMANCE.md, "Where the
warp-specialised kernel waits"). Kept aside, the state is S̃ = S·Diag(D)⁻¹ with D the running product of α since the
last renormalisation, and per token

    D ⊙= α;  r = v − S̃·(D ⊙ k̂);  u = β·r;  S̃ += u·(k̂ ⊘ D)ᵀ;  o = S̃·(D ⊙ q̃)

(three sweeps of the state instead of four; D ⊙ k̂, k̂ ⊘ D and D ⊙ q̃ are per-token vectors that a preparing warp
forms), with S = S̃·Diag(D) and D = 1 every R tokens and at the sequence's end. Both forms run in fp32 with the CPU
path's arithmetic (numerics.fp32_arithmetic: the same sweeps and trees as the kernels); the float64 loop is the
ground truth. Printed per length and lower bound: relative L2 of out and of the final state for both forms, and the
largest |S̃| and smallest D reached (log2), against fp32's 2^128 and 2^-126.

  PYTHONPATH=kda/python:kda/bench python3 tools/dev/lazy_decay_error.py [--renorm 16]
"""
import argparse

import torch

import bench_fwd
from flash_kda import compare, numerics, reference

SCALE = bench_fwd.HEAD_DIM**-0.5


def rel(got, ref) -> float:
    return compare.compare(got, ref).rel_l2


def lazy_forward(x, lower_bound: float, renorm: int):
    """The lazy-decay recurrence in fp32 on equal-length sequences [B, T]: (out bf16, final fp32, max log2 |S̃|,
    min log2 D)."""
    ar = numerics.fp32_arithmetic()
    B, T, H, K = x["v"].shape
    k_hat, q_t, alpha, beta = numerics._prepare_tokens(x["q"], x["k"], x["g"], x["beta"], SCALE, x["A_log"],
                                                       x["dt_bias"], lower_bound, ar)
    v = x["v"].float()
    s = x["init"].clone() if x["init"] is not None else torch.zeros(B, H, K, K)
    d = torch.ones(B, H, K)
    out = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    s_max, d_min = 0.0, 0.0
    for t in range(T):
        d = d * alpha[:, t]
        d_min = min(d_min, float(torch.log2(d.min())))
        k_d, k_inv, q_d = k_hat[:, t] * d, k_hat[:, t] / d, q_t[:, t] * d
        r = v[:, t] - numerics.halving_tree_32(ar.lane_leaves(s, k_d))
        u = beta[:, t][..., None] * r
        s = ar.row_fma(u, k_inv, s)
        s_max = max(s_max, float(torch.log2(s.abs().max())))
        out[:, t] = numerics.halving_tree_32(ar.lane_leaves(s, q_d)).to(torch.bfloat16)
        if (t + 1) % renorm == 0 or t == T - 1:
            s = s * d[:, :, None, :]
            d = torch.ones_like(d)
    return out, s, s_max, d_min


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--renorm", type=int, default=16, help="tokens between renormalisations (R)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    print(f"B{args.batch} H{args.heads}, bf16-valued initial state, R = {args.renorm}, fp32 CPU arithmetic")
    print("| T | lower bound | direct out | lazy out | direct state | lazy state | max log2 abs S~ | min log2 D |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for lower_bound in (-5.0, -1.0, -0.01):
        for T in (1, 2, 4, 8, 16, 17, 64):
            x = bench_fwd.make_inputs(bench_fwd.Case(f"B{args.batch} T{T}", args.batch, T, args.heads), "cpu")
            a = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["A_log"], x["dt_bias"], lower_bound)
            ref_out, ref_state = reference.reference_loop(*a, initial_state=x["init"])
            d_out, d_state = numerics.recurrent_forward(*a, x["init"], None, numerics.fp32_arithmetic())
            l_out, l_state, s_max, d_min = lazy_forward(x, lower_bound, args.renorm)
            print(f"| {T} | {lower_bound:g} | {rel(d_out, ref_out):.3e} | {rel(l_out, ref_out):.3e} | "
                  f"{rel(d_state, ref_state):.3e} | {rel(l_state, ref_state):.3e} | {s_max:.1f} | "
                  f"{d_min:.1f} |", flush=True)
    print("fp32: largest finite 2^128, smallest normal 2^-126")


if __name__ == "__main__":
    main()
