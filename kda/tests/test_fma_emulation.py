"""numerics.fma_rn, the definition the twin's FMA helpers are checked against, rounds a·b + c once (CPU; runs in
CI): each result equals the fp32 nearest to the exact value, worked out with fractions, on fma_cases' operands."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import fma_cases
from flash_kda import numerics


def f32(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32)


def correctly_rounded(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The fp32 nearest to the exact a·b + c (ties to an even significand), element by element."""
    out = torch.empty_like(a)
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist())):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        guess = f32(float(exact))  # within one fp32 step of the answer
        candidates = [torch.nextafter(guess, f32(-float("inf"))), guess, torch.nextafter(guess, f32(float("inf")))]

        def distance_then_odd(t: torch.Tensor) -> tuple:
            return abs(Fraction(t.item()) - exact), int(t.view(torch.int32).item()) & 1

        out[i] = min((t for t in candidates if torch.isfinite(t).all()), key=distance_then_odd)
    return out


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert diff.numel() == 0, (f"{what}: {diff.numel()} of {got.numel()} differ, first at {int(diff[0])}: "
                               f"got {got[diff[0]].item()!r}, want {want[diff[0]].item()!r}")


@pytest.mark.parametrize("scale", [1.0, 2.0**-60, 2.0**-75, 2.0**40])
def test_random_operands(scale):
    a, b, c = fma_cases.random_cases(scale)
    assert_same_bits(numerics.fma_rn(a, b, c), correctly_rounded(a, b, c), f"scale {scale}")


def test_cancellation_and_subnormal_results():
    a, b, c = fma_cases.subnormal_cases()
    want = correctly_rounded(a, b, c)
    assert bool((want.abs() < 2.0**-126).any()), "the cases reach subnormal results"
    assert_same_bits(numerics.fma_rn(a, b, c), want, "subnormal")


def test_sums_next_to_a_halfway_point():
    a, b, c = fma_cases.halfway_cases()
    want = correctly_rounded(a, b, c)
    twice_rounded = (a.double() * b.double() + c.double()).float()
    assert int((twice_rounded != want).sum()) == 4, "the first four are cases double rounding gets wrong"
    assert_same_bits(numerics.fma_rn(a, b, c), want, "halfway")


def test_specials_follow_ieee():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([inf, 0.0, -0.0, 3.0e38, 1.0, 0.0], dtype=torch.float32)
    b = torch.tensor([1.0, 5.0, 5.0, 10.0, nan, inf], dtype=torch.float32)
    c = torch.tensor([1.0, -0.0, -0.0, 0.0, 1.0, 1.0], dtype=torch.float32)
    got = numerics.fma_rn(a, b, c)
    assert got[0].item() == inf
    assert got[1].item() == 0.0 and not got[1].signbit(), "+0·5 + −0 = +0"
    assert got[2].item() == 0.0 and got[2].signbit(), "−0·5 + −0 = −0"
    assert got[3].item() == inf, "overflow rounds to infinity"
    assert got[4].isnan() and got[5].isnan(), "nan operand and 0·inf"


def test_cpu_path_leaves_keep_the_kernel_order():
    # The CPU path's lane leaves sum in the kernel's order; on exact products they equal the single-rounded ones.
    a = torch.randint(-8, 8, (2, 3, 128)).float()
    b = torch.randint(-8, 8, (2, 128)).float()
    leaves = numerics.fp32_arithmetic().lane_leaves(a, b)
    assert leaves.shape == (2, 3, 32)
    assert torch.equal(leaves, numerics.lane_leaves_rn(a, b))
    assert torch.equal(numerics.halving_tree_32(leaves), (a * b[:, None, :]).sum(-1))
