"""The extension's helpers that the numerics twin is built from (GPU).

ex2/tanh/sigmoid approximations are close to the exact functions within the PTX ISA's documented accuracy and
bitwise deterministic; mma_bf16 equals a float64 matmul of its bf16 inputs within fp32-accumulation error, is
deterministic, and chains its 16-wide k-steps in order (so splitting k reproduces it bit for bit); the decode
kernel's FMA steps (lane_leaves, row_fma) round each FMA once, bit for bit as numerics.fma_rn defines it
(test_fma_emulation checks that definition against exact fractions); the norms' branch-free 1/sqrt (rcp_sqrt_rn)
equals PyTorch's correctly rounded sqrt then reciprocal for every input a norm can give it; device_info/build_info
report the device and the compiled arch.
"""

from __future__ import annotations

import pytest
import torch

import fma_cases
from flash_kda import _ext, compare, numerics

pytestmark = pytest.mark.gpu

# Documented worst-case accuracy of the PTX approximations (PTX ISA, "Floating point instructions"):
# ex2.approx.f32 about 2^-22 relative; tanh.approx.f32 about 2^-11 relative. The bounds below leave a factor 2-4
# for the fp32 rounding of the reference and for how the extension composes sigmoid from them.
EX2_REL = 2.0**-20
TANH_REL = 2.0**-10
SIGMOID_ABS = 2.0**-10  # sigmoid = 0.5 + 0.5·tanh(x/2) style formulas cancel for x ≪ 0: bound absolute error


def _grid(lo: float, hi: float, n: int = 1 << 20) -> torch.Tensor:
    x = torch.linspace(lo, hi, n, device="cuda", dtype=torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    return torch.cat([x, (hi - lo) * torch.rand(n, generator=gen, device="cuda") + lo])


def _max_rel(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((actual.double() - exact).abs() / exact.abs().clamp_min(1e-300)).max())


def test_ex2_approx():
    x = _grid(-120.0, 120.0)  # results stay normal (ftz flushes subnormals)
    y = _ext.ex2_approx(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    rel = _max_rel(y, torch.exp2(x.double()))
    assert rel <= EX2_REL, f"ex2_approx max relative error {rel:.3e} > {EX2_REL:.3e}"
    assert float(_ext.ex2_approx(torch.zeros(1, device="cuda"))) == 1.0
    compare.assert_bitwise_equal(_ext.ex2_approx(x), y, "ex2_approx second call")


def test_tanh_approx():
    x = _grid(-12.0, 12.0)
    x = x[x.abs() > 1e-6]  # relative error near 0 compares against a tiny reference
    y = _ext.tanh_approx(x)
    rel = _max_rel(y, torch.tanh(x.double()))
    assert rel <= TANH_REL, f"tanh_approx max relative error {rel:.3e} > {TANH_REL:.3e}"
    compare.assert_bitwise_equal(_ext.tanh_approx(x), y, "tanh_approx second call")


def test_sigmoid_approx():
    x = _grid(-30.0, 30.0)
    y = _ext.sigmoid_approx(x)
    err = float((y.double() - torch.sigmoid(x.double())).abs().max())
    assert err <= SIGMOID_ABS, f"sigmoid_approx max absolute error {err:.3e} > {SIGMOID_ABS:.3e}"
    assert bool(((y >= 0) & (y <= 1)).all()), "sigmoid_approx left [0, 1]"
    compare.assert_bitwise_equal(_ext.sigmoid_approx(x), y, "sigmoid_approx second call")


def test_rcp_sqrt_rn_is_two_rounded_steps_for_every_norm_input():
    """The norms' branch-free 1/sqrt (device_math.cuh, rcp_sqrt_rn) against PyTorch's sqrt then reciprocal, each
    IEEE-rounded (what the twin computes), for every fp32 x from kNormEps (the smallest sum of squares plus ε) to
    +inf, and for NaN: bit for bit."""
    first = int(torch.tensor(numerics.NORM_EPS, dtype=torch.float32).view(torch.int32))
    last = 0x7F800000  # +inf
    step = 1 << 26
    checked = 0
    for start in range(first, last + 1, step):
        x = torch.arange(start, min(start + step, last + 1), device="cuda", dtype=torch.int32).view(torch.float32)
        mismatch = compare.bitwise_mismatch(_ext.rcp_sqrt_rn(x), torch.reciprocal(torch.sqrt(x)))
        assert mismatch.count == 0, f"rcp_sqrt_rn, x from {float(x[0])!r} (index i: x[0]'s bits + i): {mismatch}"
        checked += x.numel()
    assert checked == last - first + 1
    assert float(_ext.rcp_sqrt_rn(torch.tensor([float("inf")], device="cuda"))) == 0.0
    assert bool(_ext.rcp_sqrt_rn(torch.tensor([float("nan")], device="cuda")).isnan().all())


def test_elementwise_keeps_shape_and_rejects_bad_input():
    x = torch.randn(3, 5, 7, device="cuda")
    assert _ext.ex2_approx(x).shape == (3, 5, 7)
    assert _ext.ex2_approx(torch.empty(0, device="cuda")).numel() == 0
    with pytest.raises(TypeError, match="x must be float32"):
        _ext.tanh_approx(x.double())
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        _ext.tanh_approx(x.cpu())


def _fma_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = [fma_cases.random_cases(scale) for scale in (1.0, 2.0**-60, 2.0**40)]
    parts += [fma_cases.subnormal_cases(), fma_cases.halfway_cases()]
    return tuple(torch.cat([p[i] for p in parts]).cuda() for i in range(3))


def test_row_fma_rounds_once():
    a, b, c = _fma_operands()  # as [G, 1, 128] rows: k[g, 0] = b, the other channels random
    n = a.numel()
    k = torch.randn(n, 128, device="cuda")
    k[:, 0] = b
    s = torch.randn(n, 1, 128, device="cuda")
    s[:, 0, 0] = c
    got = _ext.row_fma(a[:, None], k, s)
    compare.assert_bitwise_equal(got, numerics.fma_rn(a[:, None, None].expand_as(s), k[:, None, :].expand_as(s), s),
                                 "row_fma")
    twice = (s[:, 0, 0].double() + a.double() * b.double()).float()
    assert bool((got[:, 0, 0] != twice).any()), "the operands include sums that a second rounding changes"


def test_lane_leaves_round_each_fma_once():
    x, y, z = _fma_operands()  # leaf 0 of group g starts fma(x, y, z): a₁ = x, b₁ = y after a₀·b₀ = z·1
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(x.numel(), 1, 128, device="cuda", generator=gen)
    b = torch.randn(x.numel(), 128, device="cuda", generator=gen)
    a[:, 0, 0], b[:, 0] = z, 1.0
    a[:, 0, 1], b[:, 1] = x, y
    compare.assert_bitwise_equal(_ext.lane_leaves(a, b), numerics.lane_leaves_rn(a, b), "lane_leaves, hard operands")


@pytest.mark.parametrize("rows", [1, 16, 128])
def test_lane_leaves_shapes(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    a = torch.randn(3, 2, rows, 128, device="cuda", generator=gen)
    b = torch.randn(3, 2, 128, device="cuda", generator=gen)
    leaves = _ext.lane_leaves(a, b)
    assert leaves.shape == (3, 2, rows, 32)
    compare.assert_bitwise_equal(leaves, numerics.lane_leaves_rn(a, b), f"lane_leaves, {rows} rows")


def test_fma_helpers_reject_bad_shapes():
    a = torch.zeros(2, 4, 128, device="cuda")
    with pytest.raises(ValueError, match="lane_leaves"):
        _ext.lane_leaves(a, torch.zeros(3, 128, device="cuda"))
    with pytest.raises(ValueError, match="row_fma"):
        _ext.row_fma(torch.zeros(2, 5, device="cuda"), torch.zeros(2, 128, device="cuda"), a)
    with pytest.raises(TypeError, match="float32"):
        _ext.lane_leaves(a.double(), torch.zeros(2, 128, device="cuda"))


@pytest.mark.parametrize(("batch", "m", "n", "k"), [((), 16, 8, 16), ((3,), 16, 128, 128), ((2, 4), 32, 16, 48)])
@pytest.mark.parametrize("with_c", [False, True])
def test_mma_bf16_matches_float64(batch, m, n, k, with_c):
    gen = torch.Generator(device="cuda").manual_seed(m * n * k)
    a = torch.randn(*batch, m, k, generator=gen, device="cuda").bfloat16()
    b = torch.randn(*batch, k, n, generator=gen, device="cuda").bfloat16()
    c = torch.randn(*batch, m, n, generator=gen, device="cuda") if with_c else None
    d = _ext.mma_bf16(a, b, c)
    assert d.dtype == torch.float32 and d.shape == (*batch, m, n)
    exact = a.double() @ b.double() + (0 if c is None else c.double())
    # bf16×bf16 products are exact in fp32; each of the k accumulations rounds (or truncates) once.
    scale = a.double().abs() @ b.double().abs() + (0 if c is None else c.double().abs())
    bound = (k + 2) * 2.0**-23 * scale
    excess = float(((d.double() - exact).abs() - bound).max())
    assert excess <= 0, f"mma_bf16 error exceeds the fp32 accumulation bound by {excess:.3e}"
    compare.assert_bitwise_equal(_ext.mma_bf16(a, b, c), d, "mma_bf16 second call")


def test_mma_bf16_chains_k_steps_in_order():
    """D = C + A·B with k = 48 equals three chained 16-wide calls, bit for bit (the twin relies on it)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(2, 16, 48, generator=gen, device="cuda").bfloat16()
    b = torch.randn(2, 48, 32, generator=gen, device="cuda").bfloat16()
    c = torch.randn(2, 16, 32, generator=gen, device="cuda")
    chained = c
    for s in range(0, 48, 16):
        chained = _ext.mma_bf16(a[..., s : s + 16], b[..., s : s + 16, :], chained)
    compare.assert_bitwise_equal(_ext.mma_bf16(a, b, c), chained, "mma_bf16 vs chained k-steps")


def test_mma_bf16_rejects_bad_shapes():
    a = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"m % 16 == 0, n % 8 == 0, k % 16 == 0, got m=16 n=4 k=16"):
        _ext.mma_bf16(a, torch.zeros(16, 4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"a \[\.\.\., m, k\] and b \[\.\.\., k, n\]"):
        _ext.mma_bf16(a, torch.zeros(2, 16, 8, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="b must be bfloat16"):
        _ext.mma_bf16(a, torch.zeros(16, 8, device="cuda"))


def test_device_info():
    info = _ext.device_info(0)
    for key in ("name", "major", "minor", "sm_count", "driver_version", "runtime_version"):
        assert key in info, f"device_info lacks {key!r}: {info}"
    assert (info["major"], info["minor"]) == (9, 0), info
    assert info["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count > 0, info


def test_build_info_lists_sm90a():
    info = _ext.build_info()
    assert "sm_90a" in repr(info), f"build_info does not mention sm_90a: {info}"
