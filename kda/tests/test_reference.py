"""Self-checks of the float64 ground truth (CPU; runs in CI).

- The chunked algebra (docs/SPEC.md §2) equals the token loop (docs/SPEC.md §1) to ~1e-12 on varied shapes: partial chunks,
  varlen with empty sequences, B > 1, bf16/fp32/no initial state, natural-log and base-2 gates, several C.
- C = 1 reduces the chunked algebra to the recurrence itself.
- Tiny cases worked out by hand from the definition, with math (not torch) doing the arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_kda import reference

D = 128
# Agreement of two float64 evaluations of the same function; the measured worst over these cases is 4.2e-15
# relative (chunked vs loop), so 1e-12 leaves room for platform BLAS differences without hiding real errors.
AGREE_REL = 1e-12


def make(B, T, H, *, gen, seqlens=None, state=torch.float32, lower_bound=-5.0):
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    if seqlens is not None:
        B, T = 1, sum(seqlens)
    n = len(seqlens) if seqlens is not None else B
    cu = None
    if seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64)
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        scale=D**-0.5, A_log=randn(H, dtype=torch.float32), dt_bias=randn(H, D, dtype=torch.float32),
        lower_bound=lower_bound, initial_state=None if state is None else randn(n, H, D, D, dtype=state),
        cu_seqlens=cu,
    )  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


SHAPES = [
    dict(B=1, T=1, H=1),
    dict(B=1, T=17, H=2),
    dict(B=1, T=64, H=1),
    dict(B=1, T=97, H=3, state=torch.bfloat16),
    dict(B=3, T=33, H=2, state=None),
    dict(B=1, T=0, H=2, seqlens=(0, 16, 0, 33, 0)),
    dict(B=1, T=0, H=2, seqlens=(17, 33, 65), state=torch.bfloat16),
    dict(B=1, T=0, H=1, seqlens=(5,), lower_bound=-1e-3),
    dict(B=2, T=0, H=2),
    dict(B=1, T=0, H=2, seqlens=(0, 0)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("chunk", "base2"), [(64, False), (16, True), (5, False), (128, True)])
def test_chunked_equals_loop(shape, chunk, base2, gen):
    x = make(**shape, gen=gen)
    out_loop, state_loop = reference.reference_loop(**x)
    out_chunk, state_chunk = reference.reference_chunked(**x, chunk=chunk, base2=base2)
    assert out_loop.dtype == state_loop.dtype == torch.float64
    assert out_chunk.shape == x["v"].shape
    assert rel(out_chunk, out_loop) <= AGREE_REL
    assert rel(state_chunk, state_loop) <= AGREE_REL


def test_chunk_one_is_the_recurrence(gen):
    x = make(1, 23, 2, gen=gen)
    out_loop, state_loop = reference.reference_loop(**x)
    out_c1, state_c1 = reference.reference_chunked(**x, chunk=1)
    assert rel(out_c1, out_loop) <= 1e-14
    assert rel(state_c1, state_loop) <= 1e-14


def test_batched_equals_varlen(gen):
    """B rows of T tokens are the same problem as B packed sequences of length T."""
    x = make(3, 20, 2, gen=gen)
    out_b, state_b = reference.reference_chunked(**x)
    packed = {**x, "cu_seqlens": torch.tensor([0, 20, 40, 60])}
    for name in ("q", "k", "v", "g", "beta"):
        packed[name] = x[name].reshape(1, 60, *x[name].shape[2:])
    out_v, state_v = reference.reference_chunked(**packed)
    assert torch.equal(out_v.reshape(3, 20, 2, D), out_b)
    assert torch.equal(state_v, state_b)


def test_sequences_are_independent(gen):
    """Each sequence of a varlen batch equals that sequence run alone; an empty one passes its state through."""
    seqlens = (7, 0, 19)
    x = make(1, 0, 2, seqlens=seqlens, gen=gen)
    out, state = reference.reference_chunked(**x)
    start = 0
    for n, length in enumerate(seqlens):
        alone = {name: x[name][:, start : start + length] for name in ("q", "k", "v", "g", "beta")}
        alone.update({name: x[name] for name in ("scale", "A_log", "dt_bias", "lower_bound")})
        o, s = reference.reference_loop(**alone, initial_state=x["initial_state"][n : n + 1])
        assert rel(out[:, start : start + length], o) <= AGREE_REL
        assert rel(state[n : n + 1], s) <= AGREE_REL
        start += length
    assert torch.equal(state[1], x["initial_state"][1].double())


def test_empty_sequence_state_passthrough_and_zero_default(gen):
    x = make(1, 0, 2, seqlens=(0,), gen=gen)
    out, state = reference.reference_loop(**x)
    assert out.shape == (1, 0, 2, D) and torch.equal(state, x["initial_state"].double())
    out, state = reference.reference_chunked(**{**x, "initial_state": None})
    assert torch.equal(state, torch.zeros(1, 2, D, D, dtype=torch.float64))


def test_initial_state_is_not_modified(gen):
    x = make(1, 9, 1, gen=gen)
    before = x["initial_state"].clone()
    reference.reference_loop(**x)
    reference.reference_chunked(**x)
    assert torch.equal(x["initial_state"], before)


def _unit(i: int) -> torch.Tensor:
    e = torch.zeros(D)
    e[i] = 1.0
    return e


def _one_token(q, k, v, g, beta_logit, A_log, dt_bias, lower_bound, scale, initial_state=None):
    shape = (1, len(q) // D, 1, D)
    return dict(
        q=q.reshape(shape), k=k.reshape(shape), v=v.reshape(shape), g=g.reshape(shape),
        beta=torch.tensor(beta_logit, dtype=torch.float64).reshape(1, -1, 1), scale=scale,
        A_log=torch.tensor([A_log], dtype=torch.float64), dt_bias=torch.full((1, D), dt_bias, dtype=torch.float64),
        lower_bound=lower_bound, initial_state=initial_state,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["loop", "chunked"])
def test_hand_checked_first_token(form):
    """T = 1 from zero state: S = β v k̂ᵀ (the decay of a zero state is moot), o = β v (k̂·q̂) scale."""
    q, k = 2.0 * _unit(0), 3.0 * _unit(0) + 4.0 * _unit(1)
    v = torch.arange(D, dtype=torch.float64) / D
    x = _one_token(q, k, v, torch.zeros(D), [0.0], A_log=0.0, dt_bias=0.0, lower_bound=-1.0, scale=0.5)
    fn = reference.reference_loop if form == "loop" else reference.reference_chunked
    out, state = fn(**x)
    q0 = 2.0 / math.sqrt(4.0 + 1e-6)
    k0, k1 = 3.0 / math.sqrt(25.0 + 1e-6), 4.0 / math.sqrt(25.0 + 1e-6)
    beta = 0.5  # sigmoid(0)
    torch.testing.assert_close(out[0, 0, 0], beta * v * (k0 * q0) * 0.5, rtol=1e-15, atol=0)
    expected_state = torch.zeros(D, D, dtype=torch.float64)
    expected_state[:, 0], expected_state[:, 1] = beta * v * k0, beta * v * k1
    torch.testing.assert_close(state[0, 0], expected_state, rtol=1e-15, atol=0)


@pytest.mark.parametrize("form", ["loop", "chunked"])
def test_hand_checked_decay_and_delta(form):
    """Two tokens along one key direction with an initial state: decay, delta correction and output by hand."""
    q = torch.cat([_unit(0), _unit(1)])
    k = torch.cat([_unit(0), _unit(0)])
    v = torch.cat([torch.full((D,), 1.0), torch.full((D,), -2.0)])
    g = torch.cat([torch.zeros(D), torch.full((D,), 1.0)])
    s0 = torch.zeros(1, 1, D, D, dtype=torch.float64)
    s0[..., 0], s0[..., 1] = 0.25, -0.5  # every row v: S[v, 0] = 0.25, S[v, 1] = -0.5
    x = _one_token(q, k, v, g, [1.0, -2.0], A_log=math.log(2.0), dt_bias=0.5, lower_bound=-3.0, scale=1.0,
                   initial_state=s0)  # fmt: skip
    fn = reference.reference_loop if form == "loop" else reference.reference_chunked
    out, state = fn(**x)

    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    n = 1.0 / math.sqrt(1.0 + 1e-6)  # |e_i| after the epsilon-inside-sqrt normalisation
    alpha = [math.exp(-3.0 * sig(2.0 * (gv + 0.5))) for gv in (0.0, 1.0)]  # exp(A_log) = 2
    betas = [sig(1.0), sig(-2.0)]
    c0, c1 = 0.25, -0.5  # columns 0 and 1 of S (all rows alike)
    # token 1: decay, then delta on column 0 only (k̂ = n e_0); output reads column 0 (q̂ = n e_0)
    c0, c1 = c0 * alpha[0], c1 * alpha[0]
    c0 += betas[0] * (1.0 - c0 * n) * n
    o1 = c0 * n
    # token 2: decay, delta with v = -2 along k̂ = n e_0; output reads column 1 (q̂ = n e_1)
    c0, c1 = c0 * alpha[1], c1 * alpha[1]
    c0 += betas[1] * (-2.0 - c0 * n) * n
    o2 = c1 * n
    torch.testing.assert_close(out[0, :, 0], torch.tensor([[o1] * D, [o2] * D], dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(state[0, 0, :, 0], torch.full((D,), c0, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(state[0, 0, :, 1], torch.full((D,), c1, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(state[0, 0, :, 2:], torch.zeros(D, D - 2, dtype=torch.float64))


def test_chunk_bounds():
    x = make(1, 4, 1, gen=torch.Generator().manual_seed(0))
    for chunk in (0, 129):
        with pytest.raises(ValueError, match=rf"chunk must be in \[1, 128\].*got chunk={chunk}"):
            reference.reference_chunked(**x, chunk=chunk)


def test_malformed_cu_seqlens_rejected():
    x = make(1, 0, 1, seqlens=(3, 4), gen=torch.Generator().manual_seed(0))
    x["cu_seqlens"] = torch.tensor([0, 5, 4])
    with pytest.raises(ValueError, match="non-decreasing"):
        reference.reference_loop(**x)
