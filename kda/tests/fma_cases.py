"""Operands (a, b, c) of fp32 a·b + c that tell a single rounding from two: random values over many magnitudes,
subnormal results with cancellation, and sums that sit just off a halfway point between two fp32 numbers, where
rounding the float64 sum again picks the wrong neighbour. Used by test_fma_emulation (against fractions, CPU) and
test_helpers (the extension's FMA helpers, GPU)."""

from __future__ import annotations

import torch


def random_cases(scale: float, n: int = 3000, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen) * scale
    b = torch.randn(n, generator=gen)
    c = torch.randn(n, generator=gen) * scale * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    return a, b, c


def subnormal_cases(n: int = 2000, seed: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen) * 2.0**-70
    b = torch.randn(n, generator=gen) * 2.0**-70  # products below fp32's smallest normal (2^-126)
    c = torch.where(torch.rand(n, generator=gen) < 0.5, -(a * b), torch.randn(n, generator=gen) * 2.0**-135)
    return a, b, c


def halfway_cases() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1 + 2^-23)·2^-24 times (1 − 2^-23) is 2^-24 − 2^-70: float64 drops the 2^-70 tail and lands the sum with c
    exactly halfway between two fp32 numbers; the tail decides the side, and c's odd last bit makes ties-to-even
    pick the other one. The last case is exactly halfway (ties to even either way)."""
    u = 2.0**-23
    cases = [
        ((1 + u) * 2.0**-24, 1 - u, 1 + u),  # just below the midpoint above an odd c: c
        (-(1 + u) * 2.0**-24, 1 - u, 1 + 3 * u),  # just above the midpoint below an odd c: c
        ((1 + u) * 2.0**-24, 1 - u, -(1 + u)),
        (-(1 + u) * 2.0**-24, 1 - u, -(1 + 3 * u)),
        (2.0**-24, 1.0, 1 + u),
    ]
    return tuple(torch.tensor([case[i] for case in cases], dtype=torch.float32) for i in range(3))
