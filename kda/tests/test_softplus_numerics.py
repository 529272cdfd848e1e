"""The softplus gate's chunked arithmetic on the CPU (runs in CI): the anchored intra-chunk products
(numerics._anchored_products) against the float64 token loop, up to per-token log-decays of −1000.

A softplus gate, log α = −exp(A_log)·softplus(g + dt_bias), is unbounded below, so a chunk's cumulative log₂ decay
can pass −126 and the factor 2^(−cum) of the lower-bound gate's products overflows. The anchored products keep
every exponent ≤ 0. With fp32 operands the result must be the output's own bf16 rounding; with bf16 tensor-core
operands (the CUDA kernel's rounding, emulated here) it must meet the short-sequence bounds of the matrix.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_kda import compare, numerics, reference

D = 128
SCALE = D**-0.5
OUT_REL_L2 = 4.5e-3
STATE_REL_L2 = {torch.bfloat16: 3.5e-3, torch.float32: 3.0e-3}
WINDOW_REL_L2 = 1.2e-2
ROUNDING_REL_L2 = 2.0e-3  # fp32 operands: the output's rounding to bf16 (1.66e-3) and nothing else
FP32_STATE_REL_L2 = 5e-5  # fp32 operands, fp32 state: MEASURED worst 1.1e-5 (the erasing case), 60x under the kernel's


def _inputs(*, T: int, g_scale: float, a_log_max: float, erase_every: int = 0, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    g = (randn(B, T, H, D) * g_scale).clamp(-50, 50)
    if erase_every:  # g + dt_bias ≈ 62 there: with A_log = ln 16 a log-decay of about −1000
        g[:, ::erase_every] = 50.0
    return dict(q=randn(B, T, H, D).bfloat16(), k=randn(B, T, H, D).bfloat16(), v=randn(B, T, H, D).bfloat16(),
                g=g.bfloat16(), beta=randn(B, T, H).bfloat16(), A_log=torch.rand(H, generator=gen) * a_log_max,
                dt_bias=randn(H, D) * (12.0 if erase_every else 1.0), init=randn(B, H, D, D))  # fmt: skip


def _bf16_operands() -> numerics.Arithmetic:
    """The kernel's operand rounding with exact exp2 / sigmoid and fp32 products of the rounded operands."""

    def matmul(a, b, c=None):
        product = torch.matmul(a.float(), b.float())
        return product if c is None else c + product

    return numerics.Arithmetic(exp2=torch.exp2, softplus2=numerics._softplus2, sigmoid=torch.sigmoid,
                               operand=lambda t: t.to(torch.bfloat16), matmul=matmul)


def _fp64_arithmetic() -> numerics.Arithmetic:
    return numerics.Arithmetic(exp2=torch.exp2, softplus2=numerics._softplus2, sigmoid=torch.sigmoid,
                               operand=lambda t: t, matmul=lambda a, b, c=None: a @ b)


CASES = {
    "mild": dict(T=200, g_scale=1.0, a_log_max=0.5),
    "g ±50, A_log ≤ ln 16": dict(T=200, g_scale=25.0, a_log_max=math.log(16)),
    "log-decay −1000 every 7th token": dict(T=200, g_scale=25.0, a_log_max=math.log(16), erase_every=7),
}


def _run(x: dict, ar: numerics.Arithmetic):
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["A_log"], x["dt_bias"], -5.0)
    ref = reference.reference_loop(*args, x["init"], gate_kind="softplus")
    got = numerics.chunked_forward(*args, x["init"], None, ar, gate_kind="softplus")
    return got, ref


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_operands_give_the_output_rounding(name):
    x = _inputs(**CASES[name])
    (out, state), (ref_out, ref_state) = _run(x, numerics.fp32_arithmetic())
    assert torch.isfinite(out.float()).all() and torch.isfinite(state).all()
    compare.compare(out, ref_out).check(rel_l2=ROUNDING_REL_L2, name="out vs float64")
    compare.compare(state, ref_state).check(rel_l2=FP32_STATE_REL_L2, name="fp32 state vs float64")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bf16_operands_meet_the_bounds(name, state_dtype):
    x = _inputs(**CASES[name])
    (out, state), (ref_out, ref_state) = _run(x, _bf16_operands())
    compare.compare(out, ref_out, window=64).check(rel_l2=OUT_REL_L2, window_rel_l2=WINDOW_REL_L2, name="out")
    compare.compare(state.to(state_dtype), ref_state).check(rel_l2=STATE_REL_L2[state_dtype], name="state")


def test_the_inverse_factor_overflows_where_the_anchored_products_do_not():
    x = _inputs(T=16, erase_every=7, **{k: v for k, v in CASES["g ±50, A_log ≤ ln 16"].items() if k != "T"})
    gamma = numerics._gate_log2(x["g"].float(), x["A_log"], x["dt_bias"], -5.0, numerics.fp32_arithmetic(),
                                "softplus")
    cum = gamma[0].cumsum(0)  # [16, H, K]: the first chunk of sequence 0
    assert torch.isinf(torch.exp2(-cum)).any()
    k_hat = x["k"][0].float().transpose(0, 1)  # [H, 16, K]
    a, m = numerics._anchored_products(k_hat, k_hat, cum.transpose(0, 1), numerics.fp32_arithmetic())
    assert torch.isfinite(a).all() and torch.isfinite(m).all()


def test_anchored_products_equal_the_factorised_ones_where_both_are_finite():
    x = _inputs(T=16, g_scale=1.0, a_log_max=0.5)
    gamma = numerics._gate_log2(x["g"].float(), x["A_log"], x["dt_bias"], -5.0, numerics.fp32_arithmetic(),
                                "softplus")
    cum = gamma[0].cumsum(0).transpose(0, 1).double()  # [H, 16, K]
    k_hat = x["k"][0].double().transpose(0, 1)
    a, _ = numerics._anchored_products(k_hat, k_hat, cum, _fp64_arithmetic())
    factorised = (k_hat * torch.exp2(cum)) @ (k_hat * torch.exp2(-cum)).transpose(-1, -2)
    strict = torch.tril(torch.ones(16, 16, dtype=torch.bool), -1)
    assert torch.allclose(a.double()[..., strict], factorised[..., strict], rtol=1e-5, atol=1e-5)


def _first_chunk(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k̂, q̂ and the running log₂ decay [H, 16, K] of sequence 0's first chunk, in float64."""
    gamma = numerics._gate_log2(x["g"].float(), x["A_log"], x["dt_bias"], -5.0, numerics.fp32_arithmetic(),
                                "softplus")
    cum = gamma[0, :16].cumsum(0).transpose(0, 1).double()
    k = x["k"][0, :16].double().transpose(0, 1)
    q = x["q"][0, :16].double().transpose(0, 1)
    return k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True), cum


@pytest.mark.parametrize("log2_scale", [100, -30, -100])
def test_anchored_products_take_any_scale(log2_scale):
    # The queries enter the anchored products as q̃ = q̂ · scale and every exponent there is ≤ 0: a power-of-two
    # scale, large or tiny, leaves Mqk finite, also where the chunk decays by 2^−400, and multiplies it exactly where
    # the products stay in fp32's normal range (a mild chunk).
    x = _inputs(T=16, g_scale=1.0, a_log_max=0.5)
    k_hat, q_hat, mild = (t.float() for t in _first_chunk(x))
    steep = torch.linspace(-400 / 16, -400, 16)[None, :, None].expand_as(mild).clone()
    causal = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    for ar in (numerics.fp32_arithmetic(), _bf16_operands()):
        for cum in (mild, steep):
            _, scaled = numerics._anchored_products(k_hat, q_hat * 2.0**log2_scale, cum, ar)
            assert torch.isfinite(scaled[..., causal]).all()
        _, unit = numerics._anchored_products(k_hat, q_hat, mild, ar)
        _, scaled = numerics._anchored_products(k_hat, q_hat * 2.0**log2_scale, mild, ar)
        assert torch.equal(scaled[..., causal], unit[..., causal] * 2.0**log2_scale)


def test_softplus_output_scales_exactly_with_a_power_of_two_scale():
    # The whole forward (CPU path's twin arithmetic, fp32 operands): scale 2^100 gives the unit scale's output
    # times 2^100, rounded to bf16, with nothing non-finite.
    x = _inputs(T=64, g_scale=1.0, a_log_max=math.log(4))
    ar = numerics.fp32_arithmetic()

    def out(scale):
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["A_log"], x["dt_bias"], -5.0)
        return numerics.chunked_forward(*args, x["init"], None, ar, gate_kind="softplus")[0]

    unit, big = out(1.0), out(2.0**100)
    assert torch.isfinite(big.float()).all()
    assert torch.equal(big, (unit.float() * 2.0**100).to(big.dtype))
