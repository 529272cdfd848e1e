"""Self-checks of the float64 ground truth (CPU; runs in CI).

- The chunked algebra (docs/SPEC.md §2) equals the token loop (docs/SPEC.md §1) to ~1e-12 on varied shapes: partial chunks,
  varlen with empty sequences, B > 1, bf16/fp32/no initial state, natural-log and base-2 gates, several C.
- C = 1 reduces the chunked algebra to the recurrence itself.
- Tiny cases worked out by hand from the definition, with math (not torch) doing the arithmetic, for both gates
  and both β scales.
- The model options: grouped value heads (value head hv reads key head hv // G) equal the call on expanded keys
  and each value head run alone with its key head; absent A_log / dt_bias mean exp(A_log) = 1 / dt_bias = 0.
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


def make(B, T, H, *, gen, seqlens=None, state=torch.float32, lower_bound=-5.0, G=1, a_log_scale=1.0):
    """Random inputs; G > 1: grouped value heads (q, k on H key heads, the rest on G·H value heads)."""

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    if seqlens is not None:
        B, T = 1, sum(seqlens)
    n = len(seqlens) if seqlens is not None else B
    cu = None
    if seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64)
    HV = G * H
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, HV, D), g=randn(B, T, HV, D), beta=randn(B, T, HV),
        scale=D**-0.5, A_log=a_log_scale * randn(HV, dtype=torch.float32), dt_bias=randn(HV, D, dtype=torch.float32),
        lower_bound=lower_bound, initial_state=None if state is None else randn(n, HV, D, D, dtype=state),
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
@pytest.mark.parametrize("gate_kind", ["lower_bound", "softplus"])
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_hand_checked_decay_and_delta(form, gate_kind, beta_scale):
    """Two tokens along one key direction with an initial state: decay, delta correction and output by hand.
    beta_scale 2 (fwd's allow_neg_eigval) makes the first token's β = 2·sigmoid(1) > 1: a negative eigenvalue."""
    q = torch.cat([_unit(0), _unit(1)])
    k = torch.cat([_unit(0), _unit(0)])
    v = torch.cat([torch.full((D,), 1.0), torch.full((D,), -2.0)])
    g = torch.cat([torch.zeros(D), torch.full((D,), 1.0)])
    s0 = torch.zeros(1, 1, D, D, dtype=torch.float64)
    s0[..., 0], s0[..., 1] = 0.25, -0.5  # every row v: S[v, 0] = 0.25, S[v, 1] = -0.5
    x = _one_token(q, k, v, g, [1.0, -2.0], A_log=math.log(2.0), dt_bias=0.5, lower_bound=-3.0, scale=1.0,
                   initial_state=s0)  # fmt: skip
    fn = reference.reference_loop if form == "loop" else reference.reference_chunked
    out, state = fn(**x, gate_kind=gate_kind, beta_scale=beta_scale)

    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    n = 1.0 / math.sqrt(1.0 + 1e-6)  # |e_i| after the epsilon-inside-sqrt normalisation
    if gate_kind == "lower_bound":
        alpha = [math.exp(-3.0 * sig(2.0 * (gv + 0.5))) for gv in (0.0, 1.0)]  # exp(A_log) = 2
    else:
        alpha = [math.exp(-2.0 * math.log1p(math.exp(gv + 0.5))) for gv in (0.0, 1.0)]  # −exp(A_log)·softplus
    betas = [beta_scale * sig(1.0), beta_scale * sig(-2.0)]
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


# --- the model options -----------------------------------------------------------------------------------------


OPTION_SHAPES = [
    dict(B=1, T=37, H=2, G=2),
    dict(B=2, T=20, H=1, G=3, state=None),
    dict(B=1, T=0, H=2, G=2, seqlens=(0, 17, 5, 0), state=torch.bfloat16),
    dict(B=1, T=33, H=3, G=1),
]


@pytest.mark.parametrize("shape", OPTION_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize(("gate_kind", "beta_scale"), [("lower_bound", 2.0), ("softplus", 1.0), ("softplus", 2.0)])
@pytest.mark.parametrize(("chunk", "base2"), [(16, True), (5, False)])
def test_chunked_equals_loop_with_options(shape, gate_kind, beta_scale, chunk, base2, gen):
    """The chunked algebra holds for either gate, β up to 2 and grouped value heads (softplus decays moderate:
    A_log scaled by 0.3, so e^{±G} stays far inside float64 over a chunk)."""
    x = make(**shape, gen=gen, a_log_scale=0.3)
    options = dict(gate_kind=gate_kind, beta_scale=beta_scale)
    out_loop, state_loop = reference.reference_loop(**x, **options)
    out_chunk, state_chunk = reference.reference_chunked(**x, **options, chunk=chunk, base2=base2)
    assert out_loop.shape == x["v"].shape and state_loop.shape[1] == x["v"].shape[2]
    assert rel(out_chunk, out_loop) <= AGREE_REL
    assert rel(state_chunk, state_loop) <= AGREE_REL


@pytest.mark.parametrize("gate_kind", ["lower_bound", "softplus"])
@pytest.mark.parametrize("form", ["loop", "chunked"])
def test_grouped_value_heads_equal_expanded_keys(gate_kind, form, gen):
    """q, k on H key heads with G·H value heads is the call on q, k repeated G times along the heads
    (repeat_interleave: value head hv reads key head hv // G), bit for bit."""
    x = make(1, 0, 2, G=3, seqlens=(9, 0, 20), gen=gen, a_log_scale=0.3)
    expanded = {**x, "q": x["q"].repeat_interleave(3, dim=-2), "k": x["k"].repeat_interleave(3, dim=-2)}
    fn = reference.reference_loop if form == "loop" else reference.reference_chunked
    out, state = fn(**x, gate_kind=gate_kind, beta_scale=2.0)
    out_e, state_e = fn(**expanded, gate_kind=gate_kind, beta_scale=2.0)
    assert torch.equal(out, out_e) and torch.equal(state, state_e)


def test_each_value_head_reads_key_head_hv_div_g(gen):
    """Each value head alone (one head, its key head hv // G) gives that head's slice of the grouped call; a
    mapping hv % H (the other common convention) would fail here."""
    H, G = 2, 3
    x = make(2, 13, H, G=G, gen=gen)
    out, state = reference.reference_loop(**x)
    for hv in range(G * H):
        h = hv // G
        alone = {**x, "q": x["q"][:, :, h : h + 1], "k": x["k"][:, :, h : h + 1], "v": x["v"][:, :, hv : hv + 1],
                 "g": x["g"][:, :, hv : hv + 1], "beta": x["beta"][:, :, hv : hv + 1], "A_log": x["A_log"][hv : hv + 1],
                 "dt_bias": x["dt_bias"][hv : hv + 1], "initial_state": x["initial_state"][:, hv : hv + 1]}  # fmt: skip
        o, s = reference.reference_loop(**alone)
        # (rounding only: the batched products run over a different number of heads)
        assert rel(o, out[:, :, hv : hv + 1]) <= AGREE_REL and rel(s, state[:, hv : hv + 1]) <= AGREE_REL, hv


@pytest.mark.parametrize("gate_kind", ["lower_bound", "softplus"])
@pytest.mark.parametrize("absent", ["A_log", "dt_bias"])
def test_absent_gate_parameters(gate_kind, absent, gen):
    """A_log None is exp(A_log) = 1 (A_log = 0), dt_bias None is 0; and the softplus gate ignores lower_bound."""
    x = make(1, 21, 2, G=2, gen=gen)
    zeros = {**x, absent: torch.zeros_like(x[absent])}
    for fn in (reference.reference_loop, reference.reference_chunked):
        out, state = fn(**{**x, absent: None}, gate_kind=gate_kind)
        out_z, state_z = fn(**zeros, gate_kind=gate_kind)
        assert torch.equal(out, out_z) and torch.equal(state, state_z)
    if gate_kind == "softplus":
        out, state = reference.reference_loop(**{**x, "lower_bound": None}, gate_kind=gate_kind)
        out_b, state_b = reference.reference_loop(**{**x, "lower_bound": -1.0}, gate_kind=gate_kind)
        assert torch.equal(out, out_b) and torch.equal(state, state_b)


def test_gate_needs_lower_bound_and_a_known_kind():
    g = torch.zeros(1, 2, D)
    with pytest.raises(ValueError, match="the lower_bound gate needs a lower_bound, got lower_bound=None"):
        reference.gate(g, None, None, None)
    with pytest.raises(ValueError, match="gate kind must be one of"):
        reference.gate(g, None, None, -1.0, kind="sigmoid")
    torch.testing.assert_close(reference.gate(g, None, None, None, kind="softplus"),
                               torch.full((1, 2, D), -math.log(2.0), dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("heads", [3, 1])
def test_value_heads_must_be_a_multiple_of_key_heads(heads, gen):
    x = make(1, 4, 2, gen=gen, state=None)
    x["v"] = torch.zeros(1, 4, heads, D)
    with pytest.raises(ValueError, match="v's heads must be a multiple of q's"):
        reference.reference_loop(**x)


def test_pooled_references_pass_the_options_through(gen):
    """With state_indices the references run the dense call on the gathered slots with the same options."""
    x = make(2, 9, 1, G=2, gen=gen, state=None)
    pool = torch.randn(3, 2, D, D, generator=gen, dtype=torch.float64)
    indices = torch.tensor([2, 0])
    options = dict(gate_kind="softplus", beta_scale=2.0)
    for fn in (reference.reference_loop, reference.reference_chunked):
        out, final_pool = fn(**{**x, "initial_state": pool}, state_indices=indices, **options)
        dense_out, dense_state = fn(**{**x, "initial_state": pool[indices]}, **options)
        assert torch.equal(out, dense_out) and torch.equal(final_pool[indices], dense_state)


def _strong_softplus(gen, *, erase_every: int) -> dict:
    """The softplus gate at its extremes: g up to ±50, exp(A_log) up to 16 (log-decays of hundreds per token),
    every ``erase_every``-th token g = 50 (a log-decay near −1000: that token erases the state)."""
    x = make(2, 150, 2, G=2, gen=gen, state=torch.float32)
    x["g"] = (25.0 * torch.randn(x["g"].shape, generator=gen)).clamp(-50, 50)
    if erase_every:
        x["g"][:, ::erase_every] = 50.0
    x["A_log"] = torch.rand(x["A_log"].shape, generator=gen) * math.log(16.0)
    x["lower_bound"] = None
    return x


@pytest.mark.parametrize("erase_every", [0, 7])
@pytest.mark.parametrize(("chunk", "base2"), [(64, False), (128, True), (16, True)])
def test_chunked_equals_loop_for_strong_softplus_decays(erase_every, chunk, base2, gen):
    """A chunk whose decay passes e^-600 (e^-G would overflow float64) forms its products from pairwise
    coefficients e^(G_i − G_j) <= 1: finite, and the same function as the loop."""
    x = _strong_softplus(gen, erase_every=erase_every)
    options = dict(gate_kind="softplus", beta_scale=2.0)
    out_loop, state_loop = reference.reference_loop(**x, **options)
    out_chunk, state_chunk = reference.reference_chunked(**x, **options, chunk=chunk, base2=base2)
    assert torch.isfinite(out_chunk).all() and torch.isfinite(state_chunk).all()
    assert rel(out_chunk, out_loop) <= AGREE_REL
    assert rel(state_chunk, state_loop) <= AGREE_REL


@pytest.mark.parametrize("shape", OPTION_SHAPES[:3], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("gate_kind", ["lower_bound", "softplus"])
def test_anchored_products_equal_the_plain_ones(shape, gate_kind, gen, monkeypatch):
    """The anchored form taken everywhere (its threshold lowered) equals the plain e^{±G} form on moderate decays."""
    x = make(**shape, gen=gen, a_log_scale=0.3)
    plain = reference.reference_chunked(**x, gate_kind=gate_kind, chunk=16)
    monkeypatch.setattr(reference, "_SAFE_DECAY", -1.0)  # every block: e^Γ >= e^1 never holds
    anchored = reference.reference_chunked(**x, gate_kind=gate_kind, chunk=16)
    for a, b in zip(anchored, plain):
        assert rel(a, b) <= AGREE_REL


# --- per-token states (state_indices [N, L], num_accepted_tokens) -------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [dict(B=1, T=0, H=1, seqlens=(3, 0, 5, 1)), dict(B=2, T=2, H=2), dict(B=1, T=0, H=1, G=2, seqlens=(6, 2))],
    ids=["varlen", "fixed_shorter_than_L", "gva"],
)
@pytest.mark.parametrize("accepted", ["counts", "none"])
def test_per_token_states_are_the_final_states_of_prefixes(shape, accepted, gen):
    """reference_loop with state_indices [N, L]: slot state_indices[n, t] holds the final state of sequence n's first
    t + 1 tokens, run alone from the slot state_indices[n, a_n - 1] (zeros where that entry is negative), for every
    t < min(L, length); no other slot changes; out is that of the dense call from the same starting states."""
    L = 4
    x = make(**shape, gen=gen, state=None)
    del x["initial_state"]
    x["lower_bound"] = -0.5  # slow decay: the starting state stays visible in every prefix
    N = len(shape["seqlens"]) if "seqlens" in shape else shape["B"]
    HV = x["v"].shape[2]
    P = N * L + 2
    pool = torch.randn(P, HV, D, D, generator=gen, dtype=torch.float64)
    indices = torch.randperm(P, generator=gen)[: N * L].view(N, L)
    indices[0, 1] = -1
    counts = torch.tensor([2, 1, 4, 3][:N]) if accepted == "counts" else None
    columns = (counts - 1) if counts is not None else torch.zeros(N, dtype=torch.int64)
    start_slots = indices[torch.arange(N), columns]
    options = dict(gate_kind="softplus", beta_scale=2.0) if "G" in shape else {}
    if "G" in shape:
        x["lower_bound"] = None
    out, final_pool = reference.reference_loop(**x, initial_state=pool.clone(), state_indices=indices,
                                               num_accepted_tokens=counts, **options)
    starts = torch.stack([pool[s] if s >= 0 else torch.zeros_like(pool[0]) for s in start_slots.tolist()])
    dense_out, _ = reference.reference_loop(**x, initial_state=starts, **options)
    assert torch.equal(out, dense_out)

    cu = x["cu_seqlens"]
    bounds = [(int(cu[n]), int(cu[n + 1])) for n in range(N)] if cu is not None else None
    written = torch.zeros(P, dtype=torch.bool)
    for n in range(N):
        for t in range(L):
            length = (bounds[n][1] - bounds[n][0]) if bounds else x["q"].shape[1]
            if t >= length or indices[n, t] < 0:
                continue
            if bounds:
                row, tokens = 0, slice(bounds[n][0], bounds[n][0] + t + 1)
            else:
                row, tokens = n, slice(0, t + 1)
            prefix = {name: (x[name][row : row + 1, tokens] if name in ("q", "k", "v", "g", "beta") else x[name])
                      for name in x if name != "cu_seqlens"}
            _, state = reference.reference_loop(**prefix, initial_state=starts[n : n + 1], **options)
            slot = int(indices[n, t])
            assert rel(final_pool[slot], state[0]) <= AGREE_REL, (n, t)
            written[slot] = True
    assert written.any()
    assert torch.equal(final_pool[~written], pool[~written])


# --- prefix-cache checkpoints (checkpoint_indices [N, M], checkpoint_every) ------------------------------------------


def _checkpoint_call(x: dict, *, C: int, M: int, gen, negative=(), past_the_pool=(), own_slot=()) -> dict:
    """Pool arguments with checkpoints every C tokens: state_indices [N] and checkpoint_indices [N, M] name distinct
    random slots of a float64 pool (two more slots nothing names, NaN); the entries ``negative`` are -1, those
    ``past_the_pool`` P, those ``own_slot`` the sequence's state slot."""
    N = x["initial_state"].shape[0]
    HV = x["v"].shape[2]
    P = N + N * M + 2
    slots = torch.randperm(P, generator=gen)
    indices = slots[N : N + N * M].view(N, M).clone()
    for n, m in negative:
        indices[n, m] = -1
    for n, m in past_the_pool:
        indices[n, m] = P
    pool = torch.randn(P, HV, D, D, generator=gen, dtype=torch.float64)
    pool[slots[:N]] = x["initial_state"].to(torch.float64)
    for n, m in own_slot:
        indices[n, m] = slots[n]
    return dict(initial_state=pool, final_state=torch.full_like(pool, float("nan")), state_indices=slots[:N],
                checkpoint_indices=indices, checkpoint_every=C)


CHECKPOINT_SHAPES = [
    dict(B=1, T=100, H=2),
    dict(B=3, T=48, H=1, state=torch.bfloat16),
    dict(B=1, T=0, H=2, seqlens=(70, 0, 15, 33, 128)),
    dict(B=1, T=0, H=1, G=2, seqlens=(40, 64)),
]


@pytest.mark.parametrize("shape", CHECKPOINT_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("C", [16, 32, 48])
@pytest.mark.parametrize(("chunk", "base2"), [(64, False), (16, True), (5, False), (128, True)])
def test_chunked_checkpoints_equal_the_loop(shape, C, chunk, base2, gen):
    """reference_chunked's checkpoints (inside its chunks: the chunk's update cut at that row) are the token loop's,
    whatever the chunk size; the other slots as the loop leaves them (NaN where nothing is written)."""
    x = make(**shape, gen=gen)
    options = dict(gate_kind="softplus", beta_scale=2.0, lower_bound=None) if "G" in shape else {}
    pools = _checkpoint_call(x, C=C, M=3, gen=gen, negative=((0, 1),))
    args = {**x, **options, **pools}
    out_loop, pool_loop = reference.reference_loop(**args)
    out_chunk, pool_chunk = reference.reference_chunked(**args, chunk=chunk, base2=base2)
    assert rel(out_chunk, out_loop) <= AGREE_REL
    written = ~torch.isnan(pool_loop.flatten(1)).any(1)
    assert torch.equal(written, ~torch.isnan(pool_chunk.flatten(1)).any(1))
    assert rel(pool_chunk[written], pool_loop[written]) <= AGREE_REL
    for slot in torch.nonzero(written).flatten().tolist():  # each slot, not only on the whole
        assert rel(pool_chunk[slot], pool_loop[slot]) <= AGREE_REL, slot


@pytest.mark.parametrize("erase_every", [0, 7])
@pytest.mark.parametrize(("chunk", "base2"), [(64, False), (16, True)])
def test_chunked_checkpoints_equal_the_loop_for_strong_softplus_decays(erase_every, chunk, base2, gen):
    """Checkpoints inside chunks that take the anchored products (decays past e^-600) are finite and the loop's."""
    x = _strong_softplus(gen, erase_every=erase_every)
    args = {**x, **_checkpoint_call(x, C=32, M=4, gen=gen), "gate_kind": "softplus", "beta_scale": 2.0}
    _, pool_loop = reference.reference_loop(**args)
    _, pool_chunk = reference.reference_chunked(**args, chunk=chunk, base2=base2)
    written = ~torch.isnan(pool_loop.flatten(1)).any(1)
    assert torch.isfinite(pool_chunk[written]).all()
    assert rel(pool_chunk[written], pool_loop[written]) <= AGREE_REL


@pytest.mark.parametrize("form", ["loop", "chunked"])
def test_checkpoints_are_the_final_states_of_prefixes(form, gen):
    """Slot checkpoint_indices[n, m] holds the final state of sequence n's first (m+1)·C tokens run alone, for every
    (m+1)·C <= its length; negative entries and entries >= P write nothing; a checkpoint naming its sequence's own
    state slot gives way to the final state; out and the final states are those of the call without checkpoints."""
    fn = reference.reference_loop if form == "loop" else reference.reference_chunked
    seqlens = (50, 16, 0, 33)
    x = make(1, 0, 1, seqlens=seqlens, gen=gen, lower_bound=-0.5)
    C, M = 16, 4
    pools = _checkpoint_call(x, C=C, M=M, gen=gen, negative=((0, 1),), past_the_pool=((3, 0),),
                             own_slot=((0, 2),))
    out, pool = fn(**{**x, **pools})
    plain_out, plain_pool = fn(**{**x, **pools, "checkpoint_indices": None, "checkpoint_every": 0})
    assert torch.equal(out, plain_out)
    finals = pools["state_indices"]
    assert torch.equal(pool[finals], plain_pool[finals])

    cu = x["cu_seqlens"].tolist()
    written = torch.zeros(pool.shape[0], dtype=torch.bool)
    written[finals] = True
    for n, length in enumerate(seqlens):
        for m in range(M):
            slot = int(pools["checkpoint_indices"][n, m])
            if (m + 1) * C > length or not 0 <= slot < pool.shape[0] or slot == int(finals[n]):
                continue
            tokens = slice(cu[n], cu[n] + (m + 1) * C)
            prefix = {name: x[name][:, tokens] for name in ("q", "k", "v", "g", "beta")}
            rest = {name: x[name] for name in ("scale", "A_log", "dt_bias", "lower_bound")}
            _, state = reference.reference_loop(**prefix, **rest,
                                                initial_state=pools["initial_state"][finals[n]].unsqueeze(0))
            assert rel(pool[slot], state[0]) <= AGREE_REL, (n, m)
            written[slot] = True
    assert written.sum() == len(finals) + 3  # (0, 0), (0, 1) is negative, (0, 2) is the final slot; (1, 0); (3, 1)
    assert torch.isnan(pool[~written]).all()


def test_checkpoints_need_pools(gen):
    x = make(2, 32, 1, gen=gen)
    for fn in (reference.reference_loop, reference.reference_chunked):
        with pytest.raises(ValueError, match=r"checkpoint_indices needs state_indices \[N\]"):
            fn(**x, checkpoint_indices=torch.zeros(2, 1, dtype=torch.int64), checkpoint_every=16)


@pytest.mark.parametrize("changes, pattern", [
    (dict(checkpoint_every=0), r"checkpoint_every must be a positive multiple of 16, got checkpoint_every=0"),
    (dict(checkpoint_every=24), r"checkpoint_every must be a positive multiple of 16"),
    (dict(checkpoint_indices=torch.tensor([1, -1])), r"checkpoint_indices must be \[N, M\] with N = 2"),
    (dict(checkpoint_indices=torch.tensor([[1]])), r"checkpoint_indices must be \[N, M\] with N = 2"),
], ids=["C=0", "C=24", "1-D", "N=1"])
def test_checkpoint_arguments_are_refused_by_name(changes, pattern):
    """The references take checkpoints as fwd does: C a positive multiple of 16, indices [N, M]."""
    gen = torch.Generator().manual_seed(0)
    T, H, D = 32, 1, 128
    x = [torch.randn(1, T, H, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    beta = torch.randn(1, T, H, generator=gen, dtype=torch.float64)
    args = dict(initial_state=None, cu_seqlens=torch.tensor([0, 16, 32]), state_indices=torch.tensor([0, 2]),
                final_state=torch.zeros(3, H, D, D, dtype=torch.float64), checkpoint_indices=torch.tensor([[1], [-1]]),
                checkpoint_every=16)
    with pytest.raises(ValueError, match=pattern):
        reference.reference_loop(*x, beta, D**-0.5, None, None, -5.0, **{**args, **changes})


@pytest.mark.parametrize("name, shape, pattern", [
    ("v", (1, 5, 1, 128), r"v must be \[1, 20, 1, 128\]"),
    ("g", (1, 20, 1, 64), r"g must be \[1, 20, 1, 128\]"),
    ("beta", (1, 20, 2), r"beta must be \[1, 20, 1\]"),
    ("A_log", (3,), r"A_log must be \[1\]"),
    ("dt_bias", (3, 128), r"dt_bias must be \[H, K\] or flat \[H·K\] = 128 elements"),
], ids=["v", "g", "beta", "A_log", "dt_bias"])
def test_mis_shaped_inputs_are_refused_by_name(name, shape, pattern):
    """A wrong shape names its argument (it used to surface as a reshape error naming none)."""
    gen = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(1, 20, 1, 128, generator=gen), k=torch.randn(1, 20, 1, 128, generator=gen),
                v=torch.randn(1, 20, 1, 128, generator=gen), g=torch.randn(1, 20, 1, 128, generator=gen),
                beta=torch.randn(1, 20, 1, generator=gen), scale=128**-0.5, A_log=torch.zeros(1),
                dt_bias=torch.zeros(1, 128), lower_bound=-5.0)
    args[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=pattern):
        reference.reference_loop(**args)
