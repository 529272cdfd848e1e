"""``flash_kda.fwd`` on CPU tensors (the fp32 chunked path) against the float64 ground truth (CPU; runs in CI).

Cases cover fixed lengths with partial chunks, varlen with empty sequences, B > 1, T = 0, every state I/O and
state dtype, and the adversarial input recipes. Every case NaN-poisons out/final_state, checks the inputs are
unchanged, and bounds the errors against float64.

Bounds, from measurement (this machine, torch 2.13 CPU, ~100 cases incl. every adversarial recipe of matrix.py
with ≤ 512 tokens): the fp32 path's own error is far below bf16 resolution (fp32 final_state vs float64:
worst 3.4e-7 relative L2), so the bf16 output's error is the error of rounding the exact output to bf16 (the
"floor", ≈1.66e-3) times at most 1.0000001; the same holds for windows and for a bf16 final_state. Hence:
out / windows / bf16 state ≤ FLOOR_FACTOR × floor, fp32 state ≤ FP32_STATE_REL_L2 (≈3× the worst measured).
"""

from __future__ import annotations

import matrix
import pytest
import torch

import flash_kda
from flash_kda import compare, reference

D = 128  # head dim (K = V)
FLOOR_FACTOR = 1.01  # measured worst ratio to the bf16-rounding floor: 1.0000001
FP32_STATE_REL_L2 = 1e-6  # measured worst: 3.4e-7
WINDOW = 32  # tokens per window: short, so per-window errors of short sequences are seen

FWD_NAMES = ("q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias", "lower_bound", "initial_state",
             "final_state", "cu_seqlens")  # fmt: skip


def _configs():
    return [(io, dt) for io in matrix.STATE_IO if io != "no_state" for dt in matrix.STATE_DTYPES] + [("no_state", "none")]


CASES = (
    [matrix.Case("smoke", H=4, T=97, seed=0)]
    + [matrix.Case("fixed_h1_h4", H=h, T=t, state_io=io, state_dtype=dt)
       for h in (1, 4) for t in (17, 64, 97) for io, dt in _configs()]
    + [matrix.Case("fixed_h1_h4", H=4, T=1024, state_dtype=dt) for dt in matrix.STATE_DTYPES]
    + [matrix.Case("varlen", H=4, seqlens=s, state_io=io, state_dtype=dt)
       for s in ((16,), (16, 16), (4, 8, 12), (20, 50, 100), (17, 33, 65)) for io, dt in _configs()]
    + [matrix.Case("varlen", H=2, seqlens=(1300, 547, 2048, 963, 271, 3063), state_dtype="fp32")]
    + [matrix.Case("batched", H=h, B=b, T=t, state_io=io, state_dtype=dt)
       for b, t, h in ((2, 64, 4), (4, 33, 1)) for io, dt in _configs()]
    + [c for c in matrix.cases("adversarial") if c.tokens <= 512]
)  # fmt: skip


def run(case: matrix.Case) -> tuple[dict, dict]:
    x = matrix.make_inputs(case, "cpu")
    before = {n: x[n].clone() for n in matrix.INPUT_NAMES if x[n] is not None}
    flash_kda.fwd(**{n: x[n] for n in FWD_NAMES})
    return x, before


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cpu_path_matches_float64(case: matrix.Case) -> None:
    x, before = run(case)
    for name, saved in before.items():
        if name == "initial_state" and case.inplace_state:
            continue  # it is final_state by design
        assert torch.equal(x[name], saved), f"input {name} modified: {compare.bitwise_mismatch(x[name], saved)}"

    args = {**matrix.twin_args(x), "initial_state": before.get("initial_state")}
    ref_out, ref_state = reference.reference_chunked(**args)
    end = case.covered  # (padding tokens past cu_seqlens[-1]: their rows are left as they were, NaN)
    assert matrix.same_bits(x["out"][:, end:], torch.full_like(x["out"][:, end:], float("nan"))), \
        "out rows of the padding tokens past cu_seqlens[-1] were written"
    out, ref_out = x["out"][:, :end], ref_out[:, :end]
    report = compare.compare(out, ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
    report.check(rel_l2=FLOOR_FACTOR * floor.rel_l2, window_rel_l2=FLOOR_FACTOR * floor.window_rel_l2, name="out")
    if case.has_final:
        state = compare.compare(x["final_state"], ref_state)
        if x["final_state"].dtype == torch.float32:
            state.check(rel_l2=FP32_STATE_REL_L2, name="fp32 final_state")
        else:
            state_floor = compare.compare(ref_state.to(torch.bfloat16), ref_state).rel_l2
            state.check(rel_l2=FLOOR_FACTOR * state_floor, name="bf16 final_state")


@pytest.mark.parametrize(
    "case",
    [
        matrix.Case("fixed_h1_h4", H=2, T=37, state_dtype="fp32"),
        matrix.Case("adversarial", H=2, seqlens=(0, 16, 0, 33, 0), state_dtype="fp32"),
        matrix.Case("batched", H=1, B=3, T=20, state_io="out_only", state_dtype="fp32"),
    ],
    ids=lambda c: c.id,
)
def test_cpu_path_matches_token_loop(case: matrix.Case) -> None:
    """The literal recurrence (reference_loop) as the second witness, on small cases."""
    x, before = run(case)
    out, state = reference.reference_loop(**{**matrix.twin_args(x), "initial_state": before.get("initial_state")})
    floor = compare.compare(out.to(torch.bfloat16), out).rel_l2
    compare.compare(x["out"], out).check(rel_l2=FLOOR_FACTOR * floor, name="out")
    compare.compare(x["final_state"], state).check(rel_l2=FP32_STATE_REL_L2, name="final_state")


def test_no_final_state_writes_nothing_else() -> None:
    """With final_state=None only out is written; every output element is written (no NaN left)."""
    case = matrix.Case("fixed_h1_h4", H=2, T=37, state_io="in_only")
    x, _ = run(case)
    assert torch.isfinite(x["out"].float()).all()


def test_empty_sequences_pass_state_through() -> None:
    """An empty sequence's final state is its initial state, bit for bit (or zeros without one)."""
    case = matrix.Case("adversarial", H=2, seqlens=(0, 5, 0), state_dtype="fp32")
    x, before = run(case)
    assert torch.equal(x["final_state"][0], before["initial_state"][0])
    assert torch.equal(x["final_state"][2], before["initial_state"][2])
    case = matrix.Case("adversarial", H=2, seqlens=(0, 5, 0), state_io="out_only", state_dtype="bf16")
    x, _ = run(case)
    assert torch.equal(x["final_state"][0], torch.zeros_like(x["final_state"][0]))


def test_deterministic() -> None:
    case = matrix.Case("varlen", H=2, seqlens=(20, 50, 100), state_dtype="fp32")
    first, _ = run(case)
    second, _ = run(case)
    compare.assert_bitwise_equal(second["out"], first["out"], "out")
    compare.assert_bitwise_equal(second["final_state"], first["final_state"], "final_state")


def test_int32_cu_seqlens_same_as_int64() -> None:
    base = matrix.Case("varlen", H=2, seqlens=(20, 50, 100), state_dtype="fp32")
    x64, _ = run(base)
    x = matrix.make_inputs(base, "cpu")
    x["cu_seqlens"] = x["cu_seqlens"].to(torch.int32)
    flash_kda.fwd(**{n: x[n] for n in FWD_NAMES})
    compare.assert_bitwise_equal(x["out"], x64["out"], "out")
    compare.assert_bitwise_equal(x["final_state"], x64["final_state"], "final_state")


# --- the time split's algebra (numerics.chunked_forward with segment_chunks), in fp32 on the CPU ---------------


@pytest.mark.parametrize(
    "case, segment_chunks",
    [
        (matrix.Case("smoke", H=2, T=97, lower_bound=-0.01), 1),
        (matrix.Case("smoke", H=1, B=2, T=64, lower_bound=-0.01), 2),
        (matrix.Case("smoke", H=1, seqlens=(17, 0, 100, 33), lower_bound=-0.01), 3),
        (matrix.Case("smoke", H=1, seqlens=(300,), lower_bound=-0.01, state_io="no_state"), 5),
    ],
    ids=lambda x: x.id if isinstance(x, matrix.Case) else f"L{x}",
)
def test_time_split_composes_to_the_unsplit_forward(case: matrix.Case, segment_chunks: int) -> None:
    """Scan + compose + finish (the CUDA path's time split, re-enacted by the twin) computes the same function as
    the unsplit recurrence: in fp32 the two differ only by rounding. lower_bound -0.01 decays slowly, so the
    segment maps carry the start state far (at -5 the state forgets within a chunk and any map looks right)."""
    from flash_kda import numerics  # noqa: PLC0415

    x = matrix.make_inputs(case, "cpu")
    args = matrix.twin_args(x)
    ar = numerics.fp32_arithmetic()
    positional = [args[n] for n in ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound")]
    out0, state0 = numerics.chunked_forward(*positional, args["initial_state"], args["cu_seqlens"], ar, 0)
    out1, state1 = numerics.chunked_forward(*positional, args["initial_state"], args["cu_seqlens"], ar,
                                            segment_chunks)
    assert compare.compare(state1, state0).rel_l2 < 1e-5  # fp32 rounding (measured 1.4e-7 .. 3.1e-7)
    assert compare.compare(out1, out0).rel_l2 < 1e-3  # bf16 outputs: a few roundings flip (measured ≤ 3.3e-5)
    # and the start state matters here (a split that dropped it would fail the bounds above)
    if args["initial_state"] is not None:
        _, state_zero = numerics.chunked_forward(*positional, None, args["cu_seqlens"], ar, segment_chunks)
        assert compare.compare(state_zero, state0).rel_l2 > 1e-2


# --- pooled states (state_indices) -------------------------------------------------------------------------


def _pool_cases() -> list[matrix.Case]:
    """The pool slice's shapes and pools on the CPU (plans do not exist here: one case per id without them)."""
    cases: dict[str, matrix.Case] = {}
    for c in matrix.cases("pool"):
        c = matrix.replace(c, v_split=0, segment_chunks=-1, single_pass=None, lead_chunks=-2, indices_on_host=False)
        cases.setdefault(c.id, c)
    return list(cases.values())


POOL_CASES = _pool_cases()


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: c.id)
def test_pooled_call_equals_the_dense_call_on_gathered_states(case: matrix.Case) -> None:
    """fwd with pools == fwd with the dense states of the named slots (zeros for padding rows), bit for bit; the
    final states land in the named slots and every other slot keeps its bits (NaN poison or initial values)."""
    from flash_kda import pools  # noqa: PLC0415

    x = matrix.make_inputs(case, "cpu")
    indices = x["state_indices"]
    initial_before = None if x["initial_state"] is None else x["initial_state"].clone()
    final_before = x["final_state"].clone() if x["final_state"] is not None else None
    flash_kda.fwd(**{n: x[n] for n in matrix.FWD_NAMES})
    assert torch.equal(x["state_indices"], indices) and x["state_indices"].dtype == indices.dtype

    dense = {**x, "out": torch.full_like(x["out"], float("nan")), "state_indices": None}
    dense["initial_state"] = None if initial_before is None else pools.gather(initial_before, indices)
    dense["final_state"] = None
    if case.has_final:
        dense["final_state"] = torch.full((case.num_seqs, *x["final_state"].shape[1:]), float("nan"),
                                          dtype=x["final_state"].dtype)
    flash_kda.fwd(**{n: dense[n] for n in matrix.FWD_NAMES})
    assert matrix.same_bits(x["out"], dense["out"]), "out"  # (padding tokens' rows: NaN in both, unwritten)
    if not case.has_final:
        if initial_before is not None:
            assert torch.equal(x["initial_state"], initial_before), "initial_state modified"
        return
    sequences, slots = pools.named(indices, case.pool)
    compare.assert_bitwise_equal(x["final_state"][slots], dense["final_state"][sequences], "named slots")
    untouched = torch.ones(case.pool, dtype=torch.bool)
    untouched[slots] = False
    base = initial_before if case.inplace_state else final_before
    assert matrix.same_bits(x["final_state"][untouched], base[untouched]), "slots no sequence names changed"
    if initial_before is not None and not case.inplace_state:
        assert torch.equal(x["initial_state"], initial_before), "initial_state modified"


@pytest.mark.parametrize("case", POOL_CASES[::5], ids=lambda c: c.id)
def test_pooled_cpu_path_matches_pooled_float64(case: matrix.Case) -> None:
    """The references take pools too (gather, run, scatter): the CPU path's pool against float64's."""
    x = matrix.make_inputs(case, "cpu")
    args = matrix.twin_args(x)
    if x["initial_state"] is not None:
        args["initial_state"] = x["initial_state"].clone()
    if case.has_final:
        args["final_state"] = x["final_state"].clone()
    flash_kda.fwd(**{n: x[n] for n in matrix.FWD_NAMES})
    ref_out, ref_pool = reference.reference_chunked(**args)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out).rel_l2
    end = case.covered  # (the padding tokens past cu_seqlens[-1] belong to no sequence)
    compare.compare(x["out"][:, :end], ref_out[:, :end]).check(rel_l2=FLOOR_FACTOR * floor, name="out")
    if case.has_final:
        named = ~torch.isnan(ref_pool.flatten(1)).any(1)  # slots the call wrote (others keep NaN or initial values)
        if case.inplace_state:
            named = torch.ones(case.pool, dtype=torch.bool)
        got, want = x["final_state"][named], ref_pool[named]
        bound = FP32_STATE_REL_L2 if got.dtype == torch.float32 else (
            FLOOR_FACTOR * compare.compare(want.to(torch.bfloat16), want).rel_l2)
        compare.compare(got, want).check(rel_l2=bound, name="final pool")


@pytest.mark.parametrize("in_place", [False, True], ids=["two_pools", "in_place"])
def test_pooled_call_without_tokens_copies_named_slots(in_place) -> None:
    case = matrix.Case("pool", H=2, B=3, T=0, state_dtype="bf16", pool=5, inplace_state=in_place)
    x = matrix.make_inputs(case, "cpu")
    x["state_indices"] = torch.tensor([4, -1, 1], dtype=torch.int32)
    initial = x["initial_state"].clone()
    flash_kda.fwd(**{n: x[n] for n in matrix.FWD_NAMES})
    assert torch.equal(x["final_state"][[4, 1]], initial[[4, 1]])
    if in_place:
        assert torch.equal(x["final_state"], initial)
    else:
        assert torch.isnan(x["final_state"][[0, 2, 3]].float()).all()


DECODE_CASES = [
    matrix.Case("decode", H=4, T=t, state_dtype=dt) for t in (1, 2, 3, 5, 8, 15, 16) for dt in matrix.STATE_DTYPES
] + [matrix.Case("decode", H=2, seqlens=s, state_io=io, state_dtype="fp32")
     for s in ((1, 1, 1, 1), (1, 2, 3, 5, 8, 15), (0, 3, 0, 16)) for io in ("in+out", "out_only")]  # fmt: skip


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_decode_recurrence_in_fp32_matches_float64(case: matrix.Case) -> None:
    """The decode kernel's token-by-token recurrence (numerics.recurrent_forward: its order of operations, here
    with exact exp2 and sigmoid; the twin runs the same code with the kernel's approximate instructions) is as
    accurate as the fp32 chunked path: out within the bf16 rounding floor, the fp32 state far below it."""
    from flash_kda import numerics  # noqa: PLC0415

    x = matrix.make_inputs(case, "cpu")
    names = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound")
    args = [x[n] for n in names]
    out, state = numerics.recurrent_forward(*args, x["initial_state"], x["cu_seqlens"])
    ref_out, ref_state = reference.reference_loop(*args, initial_state=x["initial_state"],
                                                  cu_seqlens=x["cu_seqlens"])
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out).rel_l2
    compare.compare(out, ref_out).check(rel_l2=FLOOR_FACTOR * floor, name=f"{case.id} out")
    compare.compare(state, ref_state).check(rel_l2=FP32_STATE_REL_L2, name=f"{case.id} state")


# --- the model options: the softplus gate, negative eigenvalues, grouped value heads, absent A_log / dt_bias -------


def option_inputs(*, H=2, G=1, B=1, T=97, seqlens=None, state=torch.float32, pool=0, seed=0, **options) -> dict:
    """CPU inputs of fwd with the model options: q, k on H key heads; v, g, beta, A_log, dt_bias and the states on
    HV = G·H value heads (fla's distributions, as matrix.make_inputs), NaN-poisoned outputs; ``options`` holds
    fwd's gate / allow_neg_eigval / lower_bound and A_log=None / dt_bias=None."""
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    cu = None
    if seqlens is not None:
        B, T = 1, sum(seqlens)
        cu = torch.tensor([0, *torch.tensor(seqlens, dtype=torch.int64).cumsum(0).tolist()])
    N = B if seqlens is None else len(seqlens)
    HV = G * H
    rows = pool or N
    x = dict(q=randn(B, T, H, D, dtype=bf16), k=randn(B, T, H, D, dtype=bf16), v=randn(B, T, HV, D, dtype=bf16),
             g=randn(B, T, HV, D, dtype=bf16), beta=randn(B, T, HV, dtype=bf16), scale=D**-0.5,
             out=torch.full((B, T, HV, D), float("nan"), dtype=bf16), A_log=randn(HV), dt_bias=randn(HV, D),
             lower_bound=-5.0, initial_state=None if state is None else randn(rows, HV, D, D, dtype=state),
             final_state=None if state is None else torch.full((rows, HV, D, D), float("nan"), dtype=state),
             cu_seqlens=cu)  # fmt: skip
    if pool:
        x["state_indices"] = torch.randperm(pool, generator=gen)[:N]
        x["state_indices"][0] = -1  # a padding row
    x.update(options)
    return x


OPTION_CASES = {
    "softplus": dict(gate="softplus", lower_bound=None),
    "softplus_lower_bound_ignored": dict(gate="softplus", lower_bound=-1.0),
    "neg_eigval": dict(allow_neg_eigval=True),
    "softplus_neg_eigval": dict(gate="softplus", lower_bound=None, allow_neg_eigval=True),
    "gva_G2": dict(G=2),
    "gva_G4_H1_softplus": dict(G=4, H=1, gate="softplus"),
    "gva_G2_varlen_softplus_neg_eigval": dict(G=2, seqlens=(17, 0, 40, 5), gate="softplus", allow_neg_eigval=True,
                                              state=torch.bfloat16),
    "gva_G3_batched_neg_eigval_no_state": dict(G=3, B=2, T=33, allow_neg_eigval=True, state=None),
    "no_A_log": dict(A_log=None),
    "no_dt_bias_softplus": dict(dt_bias=None, gate="softplus"),
    "no_gate_parameters_gva": dict(A_log=None, dt_bias=None, G=2),
    "gva_T0": dict(G=2, T=0),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_cpu_path_with_options_matches_token_loop(name: str) -> None:
    """Each option (and their combinations) on the CPU path against the float64 token loop given the same options:
    out within the bf16 rounding floor, the state as the fp32 / bf16 bounds above."""
    x = option_inputs(**OPTION_CASES[name])
    before = {n: x[n].clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
              if x[n] is not None}
    flash_kda.fwd(**x)
    for n, saved in before.items():
        assert torch.equal(x[n], saved), f"input {n} modified"
    gate = x.get("gate", "lower_bound")
    beta_scale = 2.0 if x.get("allow_neg_eigval") else 1.0
    names = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "initial_state", "cu_seqlens")
    ref_out, ref_state = reference.reference_loop(**{n: x[n] for n in names}, gate_kind=gate, beta_scale=beta_scale)
    assert x["out"].shape == ref_out.shape
    if ref_out.numel():
        floor = compare.compare(ref_out.to(torch.bfloat16), ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
        compare.compare(x["out"], ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"]).check(
            rel_l2=FLOOR_FACTOR * floor.rel_l2, window_rel_l2=FLOOR_FACTOR * floor.window_rel_l2, name=f"{name} out")
    if x["final_state"] is not None:
        state = compare.compare(x["final_state"], ref_state)
        if x["final_state"].dtype == torch.float32:
            state.check(rel_l2=FP32_STATE_REL_L2, name=f"{name} fp32 final_state")
        else:
            state_floor = compare.compare(ref_state.to(torch.bfloat16), ref_state).rel_l2
            state.check(rel_l2=FLOOR_FACTOR * state_floor, name=f"{name} bf16 final_state")


@pytest.mark.parametrize("options", [dict(gate="softplus", allow_neg_eigval=True), dict()], ids=["softplus_neg", "plain"])
def test_grouped_value_heads_with_pools_match_pooled_float64(options) -> None:
    """Grouped value heads with pooled states (a padding row, in place): the named slots against the pooled
    float64 references with the same options; the other slots keep their bits."""
    x = option_inputs(G=2, B=3, T=20, pool=5, **options)
    x["final_state"] = x["initial_state"]
    initial = x["initial_state"].clone()
    flash_kda.fwd(**x)
    names = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "cu_seqlens")
    ref_out, ref_pool = reference.reference_chunked(
        **{n: x[n] for n in names}, initial_state=initial, state_indices=x["state_indices"],
        gate_kind=x.get("gate", "lower_bound"), beta_scale=2.0 if x.get("allow_neg_eigval") else 1.0)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out).rel_l2
    compare.compare(x["out"], ref_out).check(rel_l2=FLOOR_FACTOR * floor, name="out")
    compare.compare(x["final_state"], ref_pool).check(rel_l2=FP32_STATE_REL_L2, name="final pool")
    untouched = torch.ones(5, dtype=torch.bool)
    untouched[x["state_indices"][x["state_indices"] >= 0]] = False
    assert torch.equal(x["final_state"][untouched], initial[untouched])


# --- per-token states (speculative decoding: state_indices [N, L], num_accepted_tokens) --------------------------


def token_inputs(*, L: int, P: int = 24, accepted="random", padding=(), index_dtype=torch.int64,
                 accepted_dtype=torch.int64, initial_dtype=None, in_place=False, initial=True, **kwargs) -> dict:
    """``option_inputs`` with pools of P slots and per-token state_indices [N, L] (distinct random slots, the
    entries ``padding`` set to -1), num_accepted_tokens ``accepted`` ("random": each in [1, L]; None; or the
    counts), the final pool NaN-poisoned (or the initial pool itself, ``in_place``)."""
    x = option_inputs(pool=P, **kwargs)
    gen = torch.Generator().manual_seed(kwargs.get("seed", 0) + 1)
    N = x["state_indices"].shape[0]
    indices = torch.randperm(P, generator=gen)[: N * L].view(N, L)
    for n, t in padding:
        indices[n, t] = -1
    x["state_indices"] = indices.to(index_dtype)
    if isinstance(accepted, str):
        accepted = torch.randint(1, L + 1, (N,), generator=gen)
    x["num_accepted_tokens"] = None if accepted is None else torch.as_tensor(accepted).to(accepted_dtype)
    if initial_dtype is not None:
        x["initial_state"] = x["initial_state"].to(initial_dtype)
    if not initial:
        x["initial_state"] = None
    if in_place:
        x["final_state"] = x["initial_state"]
    return x


def written_slots(x: dict) -> torch.Tensor:
    """The pool slots a per-token call writes: state_indices[n, t] >= 0 for t < min(L, length of sequence n)."""
    indices = x["state_indices"].to(torch.int64)
    N, L = indices.shape
    B, T = x["v"].shape[:2]
    cu = x["cu_seqlens"]
    lengths = torch.full((N,), T) if cu is None else cu[1:] - cu[:-1]
    written = (torch.arange(L).view(1, L) < lengths.view(N, 1)) & (indices >= 0)
    return indices[written]


TOKEN_CASES = {
    "fixed_L3": dict(L=3, B=2, T=6, accepted=None),
    "accepted_in_place_int32": dict(L=4, B=3, T=4, in_place=True, index_dtype=torch.int32,
                                    accepted_dtype=torch.int32),
    "padding_bf16": dict(L=3, B=2, T=5, padding=((0, 0), (1, 1), (1, 2)), accepted=(1, 2), state=torch.bfloat16),
    "shorter_than_L": dict(L=5, B=2, T=2, accepted=(4, 5)),
    "varlen_empty_bf16_in_place": dict(L=3, seqlens=(3, 0, 1, 6), state=torch.bfloat16, in_place=True),
    "bf16_initial_fp32_final": dict(L=2, B=3, T=3, initial_dtype=torch.bfloat16),
    "final_pool_only": dict(L=3, B=2, T=4, initial=False, accepted=(2, 3)),
    "gva_softplus_neg_eigval": dict(L=2, G=2, B=2, T=5, gate="softplus", lower_bound=None, allow_neg_eigval=True),
    "L1": dict(L=1, B=3, T=7),
    "chunked_T97": dict(L=4, B=1, T=97, accepted=(3,)),
    "varlen_long": dict(L=2, seqlens=(40, 1, 0, 70), padding=((2, 0),)),
}  # fmt: skip


def _pooled_fwd(x: dict, index_names: tuple) -> tuple[dict, torch.Tensor]:
    """Runs fwd(**x) on a pool and checks that it left its inputs alone (the initial pool excepted when it is the
    final pool: in place); returns the inputs and the final pool as they were before the call."""
    before = {n: x[n].clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", *index_names)
              if x[n] is not None}
    pool_before = x["final_state"].clone()
    flash_kda.fwd(**x)
    for n, saved in before.items():
        if n == "initial_state" and x["final_state"] is x["initial_state"]:
            continue  # it is final_state by design
        assert torch.equal(x[n], saved) and x[n].dtype == saved.dtype, f"input {n} modified"
    return before, pool_before


@pytest.mark.parametrize("name", list(TOKEN_CASES))
def test_per_token_states_match_the_token_loop(name: str) -> None:
    """fwd with state_indices [N, L] (and num_accepted_tokens) against the float64 token loop with the same
    arguments: out within the bf16 rounding floor, the written slots within the fp32 / bf16 bounds above, every
    other slot with its bits (NaN poison, or its initial value in place), the inputs unchanged."""
    x = token_inputs(**TOKEN_CASES[name])
    before, pool_before = _pooled_fwd(x, ("state_indices", "num_accepted_tokens"))

    names = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "cu_seqlens", "state_indices",
             "num_accepted_tokens")
    ref_out, ref_pool = reference.reference_loop(
        **{n: x[n] for n in names}, initial_state=before.get("initial_state"), final_state=pool_before,
        gate_kind=x.get("gate", "lower_bound"), beta_scale=2.0 if x.get("allow_neg_eigval") else 1.0)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
    compare.compare(x["out"], ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"]).check(
        rel_l2=FLOOR_FACTOR * floor.rel_l2, window_rel_l2=FLOOR_FACTOR * floor.window_rel_l2, name=f"{name} out")

    slots = written_slots(x)
    assert slots.numel(), "the case writes no slot"
    got, want = x["final_state"][slots], ref_pool[slots]
    if got.dtype == torch.float32:
        compare.compare(got, want).check(rel_l2=FP32_STATE_REL_L2, name=f"{name} written fp32 slots")
    else:
        state_floor = compare.compare(want.to(torch.bfloat16), want).rel_l2
        compare.compare(got, want).check(rel_l2=FLOOR_FACTOR * state_floor, name=f"{name} written bf16 slots")
    untouched = torch.ones(x["final_state"].shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert matrix.same_bits(x["final_state"][untouched], pool_before[untouched]), "slots nothing writes changed"


def test_per_token_start_slot_is_chosen_by_num_accepted_tokens() -> None:
    """Sequence n starts from slot state_indices[n, a_n - 1]: the call equals the dense call on those slots' states
    (zeros where the chosen entry is negative), out bit for bit; without num_accepted_tokens, column 0."""
    from flash_kda import pools  # noqa: PLC0415

    x = token_inputs(L=3, B=3, T=9, accepted=(3, 1, 2), padding=((2, 1),))
    initial = x["initial_state"].clone()
    for counts, columns in (((3, 1, 2), (2, 0, 1)), (None, (0, 0, 0))):
        y = {**x, "out": torch.full_like(x["out"], float("nan")), "final_state": torch.full_like(x["final_state"],
             float("nan")), "num_accepted_tokens": None if counts is None else torch.tensor(counts)}
        flash_kda.fwd(**y)
        starts = x["state_indices"][torch.arange(3), torch.tensor(columns)]
        assert pools.start_slots(x["state_indices"], y["num_accepted_tokens"]).tolist() == starts.tolist()
        dense = {**x, "out": torch.full_like(x["out"], float("nan")), "state_indices": None,
                 "num_accepted_tokens": None, "initial_state": pools.gather(initial, starts), "final_state": None}
        flash_kda.fwd(**dense)
        compare.assert_bitwise_equal(y["out"], dense["out"], "out")


def test_per_token_out_equals_the_one_slot_call() -> None:
    """out does not depend on how states are written: [N, L] indices whose first column is the [N] call's slots
    give its out bit for bit."""
    x = token_inputs(L=4, B=3, T=21, accepted=None, padding=((1, 0),))
    one_slot = {**x, "out": torch.full_like(x["out"], float("nan")), "state_indices": x["state_indices"][:, 0].clone(),
                "num_accepted_tokens": None, "final_state": torch.full_like(x["final_state"], float("nan"))}
    flash_kda.fwd(**x)
    flash_kda.fwd(**one_slot)
    compare.assert_bitwise_equal(x["out"], one_slot["out"], "out")


@pytest.mark.parametrize("in_place", [False, True], ids=["two_pools", "in_place"])
def test_per_token_call_without_tokens_writes_nothing(in_place) -> None:
    """T = 0 (or only empty sequences): no token, so no state is written; every slot keeps its bits."""
    for shape in (dict(B=2, T=0), dict(seqlens=(0, 0))):
        x = token_inputs(L=2, in_place=in_place, state=torch.bfloat16, **shape)
        pool = x["final_state"].clone()
        flash_kda.fwd(**x)
        assert matrix.same_bits(x["final_state"], pool)


# --- prefix-cache checkpoints (checkpoint_indices [N, M], checkpoint_every) ------------------------------------------


def checkpoint_inputs(*, C: int, M: int, extra: int = 3, negative=(), own_slot=(), index_dtype=torch.int64,
                      pool_dtype=torch.float32, in_place=False, initial=True, **kwargs) -> dict:
    """``option_inputs`` with pools and checkpoints every C tokens: state_indices [N] and checkpoint_indices [N, M]
    name distinct random slots of a pool with ``extra`` slots nothing names; the entries ``negative`` (n, m) are -1
    and the entries ``own_slot`` (n, m) name sequence n's own state slot. The final pool is NaN-poisoned (or the
    initial pool itself, ``in_place``); ``options`` as in ``option_inputs``."""
    N = len(kwargs["seqlens"]) if kwargs.get("seqlens") is not None else kwargs.get("B", 1)
    P = N + N * M + extra
    x = option_inputs(pool=P, state=pool_dtype, **kwargs)
    gen = torch.Generator().manual_seed(kwargs.get("seed", 0) + 2)
    slots = torch.randperm(P, generator=gen)
    x["state_indices"] = slots[:N].clone()
    checkpoints = slots[N : N + N * M].view(N, M).clone()
    for n, m in negative:
        checkpoints[n, m] = -1
    for n, m in own_slot:
        checkpoints[n, m] = x["state_indices"][n]
    x["checkpoint_indices"] = checkpoints.to(index_dtype)
    x["checkpoint_every"] = C
    if not initial:
        x["initial_state"] = None
    if in_place:
        x["final_state"] = x["initial_state"]
    return x


def checkpoint_slots(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(checkpoint slots written, final slots written) of a checkpoint call: checkpoint_indices[n, m] >= 0 for every
    (m+1)·C <= length of sequence n, and state_indices[n] >= 0."""
    indices = x["checkpoint_indices"].to(torch.int64)
    N, M = indices.shape
    B, T = x["v"].shape[:2]
    cu = x["cu_seqlens"]
    lengths = torch.full((N,), T) if cu is None else cu[1:] - cu[:-1]
    ends = torch.arange(1, M + 1).view(1, M) * x["checkpoint_every"]
    written = (ends <= lengths.view(N, 1)) & (indices >= 0)
    finals = x["state_indices"][x["state_indices"] >= 0]
    return indices[written], finals


CHECKPOINT_CASES = {
    "C16_fixed": dict(C=16, M=5, B=2, T=70),  # checkpoints 16..64 of 70 tokens; the fifth (80) is past the end
    "C32_varlen_short_and_empty_bf16": dict(C=32, M=3, seqlens=(40, 5, 0, 97, 31), pool_dtype=torch.bfloat16),
    "C64_varlen_in_place": dict(C=64, M=3, seqlens=(130, 64, 63, 0), in_place=True),
    "C16_negative_int32": dict(C=16, M=4, B=3, T=64, negative=((0, 1), (1, 0), (2, 3)), index_dtype=torch.int32),
    "C16_bf16_in_place_negative": dict(C=16, M=3, B=2, T=50, pool_dtype=torch.bfloat16, in_place=True,
                                       negative=((1, 1),)),
    "C32_final_pool_only": dict(C=32, M=2, B=2, T=80, initial=False),
    "C32_gva_softplus_neg_eigval": dict(C=32, M=2, G=2, B=2, T=70, gate="softplus", lower_bound=None,
                                        allow_neg_eigval=True),
    "C16_slow_decay": dict(C=16, M=6, B=1, T=100, lower_bound=-0.01),  # the state carries far
}  # fmt: skip


def _reference_pool(x: dict, initial, pool_before, **changes):
    names = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "cu_seqlens", "state_indices",
             "checkpoint_indices", "checkpoint_every")
    args = {**{n: x[n] for n in names}, **changes}
    return reference.reference_loop(**args, initial_state=initial, final_state=pool_before,
                                    gate_kind=x.get("gate", "lower_bound"),
                                    beta_scale=2.0 if x.get("allow_neg_eigval") else 1.0)


def _check_state(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """The fp32 / bf16 state bounds above: fp32 within FP32_STATE_REL_L2, bf16 within the rounding floor."""
    if got.dtype == torch.float32:
        compare.compare(got, want).check(rel_l2=FP32_STATE_REL_L2, name=f"{name} (fp32)")
    else:
        floor = compare.compare(want.to(torch.bfloat16), want).rel_l2
        compare.compare(got, want).check(rel_l2=FLOOR_FACTOR * floor, name=f"{name} (bf16)")


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_checkpoints_match_the_token_loop(name: str) -> None:
    """fwd with checkpoint_indices against the float64 token loop with the same arguments: the checkpoint slots (the
    exact state after each (m+1)·C tokens) and the final slots within the fp32 / bf16 bounds above, out within the
    bf16 rounding floor, every slot nothing names with its bits (NaN poison, or its initial value in place), the
    inputs unchanged."""
    x = checkpoint_inputs(**CHECKPOINT_CASES[name])
    before, pool_before = _pooled_fwd(x, ("state_indices", "checkpoint_indices"))

    ref_out, ref_pool = _reference_pool(x, before.get("initial_state"), pool_before)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
    compare.compare(x["out"], ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"]).check(
        rel_l2=FLOOR_FACTOR * floor.rel_l2, window_rel_l2=FLOOR_FACTOR * floor.window_rel_l2, name=f"{name} out")
    checkpoints, finals = checkpoint_slots(x)
    assert checkpoints.numel(), "the case writes no checkpoint"
    _check_state(x["final_state"][checkpoints], ref_pool[checkpoints], f"{name} checkpoint slots")
    _check_state(x["final_state"][finals], ref_pool[finals], f"{name} final slots")
    untouched = torch.ones(x["final_state"].shape[0], dtype=torch.bool)
    untouched[checkpoints] = False
    untouched[finals] = False
    assert matrix.same_bits(x["final_state"][untouched], pool_before[untouched]), "slots nothing names changed"


@pytest.mark.parametrize("name", ["C16_fixed", "C32_varlen_short_and_empty_bf16", "C64_varlen_in_place"])
def test_checkpoints_leave_out_and_final_states_unchanged(name: str) -> None:
    """out and the final slots are those of the same call without checkpoints, bit for bit."""
    x = checkpoint_inputs(**CHECKPOINT_CASES[name])
    plain = {**x, "out": torch.full_like(x["out"], float("nan")), "checkpoint_indices": None, "checkpoint_every": 0,
             "initial_state": x["initial_state"].clone()}
    in_place = x["final_state"] is x["initial_state"]
    plain["final_state"] = plain["initial_state"] if in_place else x["final_state"].clone()
    flash_kda.fwd(**x)
    flash_kda.fwd(**plain)
    compare.assert_bitwise_equal(x["out"], plain["out"], "out")
    _, finals = checkpoint_slots(x)
    assert matrix.same_bits(x["final_state"][finals], plain["final_state"][finals]), "final slots differ"


def test_checkpoint_is_the_state_of_the_prefix() -> None:
    """Checkpoint m of sequence n is the state after its first (m+1)·C tokens: the final state of the call on those
    tokens alone (float64: the same to 1e-12; the CPU path within its fp32 bound of it)."""
    x = checkpoint_inputs(C=32, M=3, seqlens=(100, 70), lower_bound=-0.01)
    initial = x["initial_state"].clone()
    flash_kda.fwd(**x)
    _, ref_pool = _reference_pool(x, initial, torch.full_like(initial, float("nan")))
    bos = x["cu_seqlens"][:-1].tolist()
    for n, length in enumerate((100, 70)):
        for m in range(3):
            end = (m + 1) * 32
            if end > length:
                continue
            prefix = {name: x[name][:, bos[n] : bos[n] + end] for name in ("q", "k", "v", "g", "beta")}
            names = ("scale", "A_log", "dt_bias", "lower_bound")
            _, state = reference.reference_loop(**prefix, **{k: x[k] for k in names},
                                                initial_state=initial[x["state_indices"][n]].unsqueeze(0))
            slot = int(x["checkpoint_indices"][n, m])
            assert compare.compare(ref_pool[slot], state[0]).rel_l2 < 1e-12, (n, m)
            _check_state(x["final_state"][slot], state[0], f"checkpoint ({n}, {m}) vs the prefix's final state")


def test_resuming_from_a_checkpoint_continues_the_sequence() -> None:
    """The prefix-cache use: a call on a sequence's remaining tokens, started from its checkpoint slot, continues it:
    its out and final state are the full call's float64 ones within the bounds above."""
    x = checkpoint_inputs(C=32, M=2, B=1, T=90, lower_bound=-0.01)
    initial = x["initial_state"].clone()
    flash_kda.fwd(**x)
    resume_at = 64  # the second checkpoint
    slot = int(x["checkpoint_indices"][0, 1])
    rest = {**x, **{n: x[n][:, resume_at:].contiguous() for n in ("q", "k", "v", "g", "beta")},
            "out": torch.full_like(x["out"][:, resume_at:], float("nan")), "initial_state": x["final_state"].clone(),
            "final_state": torch.full_like(x["final_state"], float("nan")), "state_indices": torch.tensor([slot]),
            "checkpoint_indices": None, "checkpoint_every": 0}
    flash_kda.fwd(**rest)
    ref_out, ref_pool = _reference_pool(x, initial, torch.full_like(initial, float("nan")))
    ref_rest = ref_out[:, resume_at:]
    floor = compare.compare(ref_rest.to(torch.bfloat16), ref_rest).rel_l2
    compare.compare(rest["out"], ref_rest).check(rel_l2=FLOOR_FACTOR * floor, name="resumed out")
    _check_state(rest["final_state"][slot], ref_pool[int(x["state_indices"][0])], "resumed final state")


def test_checkpoint_at_a_sequence_end_is_its_final_state() -> None:
    """A length that is a multiple of C: its last checkpoint and its final state are the same bits."""
    x = checkpoint_inputs(C=32, M=3, seqlens=(96, 64, 40), pool_dtype=torch.bfloat16)
    flash_kda.fwd(**x)
    for n, m in ((0, 2), (1, 1)):
        slot, final = int(x["checkpoint_indices"][n, m]), int(x["state_indices"][n])
        assert matrix.same_bits(x["final_state"][slot], x["final_state"][final]), (n, m)


@pytest.mark.parametrize("T, own_slot", [(32, ((0, 1), (1, 1))), (40, ((0, 0), (1, 1)))],
                         ids=["at_the_end", "before_the_end"])
def test_a_checkpoint_in_its_own_final_slot_leaves_it_the_final_state(T, own_slot) -> None:
    """A checkpoint may name its own sequence's state slot, at the sequence's end or before it: the slot holds the
    final state (on CUDA every checkpoint writer skips it, so that under the time split a checkpoint from another
    CTA cannot land after the final state; docs/DESIGN.md). The sequences' other checkpoints are written."""
    x = checkpoint_inputs(C=16, M=3, B=2, T=T, own_slot=own_slot)
    plain = {**x, "out": torch.full_like(x["out"], float("nan")), "final_state": x["final_state"].clone(),
             "checkpoint_indices": None, "checkpoint_every": 0}
    flash_kda.fwd(**x)
    flash_kda.fwd(**plain)
    finals = x["state_indices"]
    assert matrix.same_bits(x["final_state"][finals], plain["final_state"][finals])
    others = [(n, m) for n in range(2) for m in range(T // 16) if (n, m) not in own_slot]
    for n, m in others:
        assert not torch.isnan(x["final_state"][int(x["checkpoint_indices"][n, m])]).any(), (n, m)


def test_checkpoints_of_a_padding_row_are_written() -> None:
    """checkpoint_indices do not depend on state_indices: a sequence without a state slot (negative: it starts from
    zeros, writes no final state) still writes its checkpoints."""
    x = checkpoint_inputs(C=16, M=2, B=2, T=40)
    x["state_indices"][0] = -1
    pool_before = x["final_state"].clone()
    flash_kda.fwd(**x)
    _, ref_pool = _reference_pool(x, x["initial_state"], pool_before)
    slots = x["checkpoint_indices"][0]
    _check_state(x["final_state"][slots], ref_pool[slots], "a padding row's checkpoints")


@pytest.mark.parametrize("in_place", [False, True], ids=["two_pools", "in_place"])
def test_checkpoints_of_a_call_without_tokens(in_place) -> None:
    """T = 0 (or only empty sequences): no checkpoint is written; the named slots get their initial states."""
    for shape in (dict(B=2, T=0), dict(seqlens=(0, 0))):
        x = checkpoint_inputs(C=16, M=2, in_place=in_place, pool_dtype=torch.bfloat16, **shape)
        pool = x["final_state"].clone()
        initial = x["initial_state"].clone()
        flash_kda.fwd(**x)
        unnamed = torch.ones(pool.shape[0], dtype=torch.bool)
        unnamed[x["state_indices"]] = False
        assert matrix.same_bits(x["final_state"][unnamed], pool[unnamed])
        assert matrix.same_bits(x["final_state"][x["state_indices"]], initial[x["state_indices"]])


def test_checkpoint_indices_past_the_pool_are_refused_before_any_write() -> None:
    x = checkpoint_inputs(C=16, M=2, B=2, T=40)
    x["checkpoint_indices"][1, 1] = x["final_state"].shape[0]
    pool = x["final_state"].clone()
    with pytest.raises(ValueError, match=r"checkpoint_indices\[1, 1\] = \d+ is past the pool's last slot"):
        flash_kda.fwd(**x)
    assert matrix.same_bits(x["final_state"], pool)


# The plans' checkpoints on the CPU, in fp32 (the twin runs the same code with the kernel's arithmetic on the GPU).


def _numerics_args(x: dict) -> list:
    return [x[n] for n in ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound")]


@pytest.mark.parametrize("segment_chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("C", [16, 32, 64])
def test_time_split_checkpoints_come_from_the_finishing_units(segment_chunks: int, C: int) -> None:
    """Under the time split each checkpoint is the finishing unit's state after its chunk (numerics._chunked, as the
    kernels' finish pass): the same function as the unsplit stepping's (fp32 rounding apart), and at a segment end
    that unit's own end state, not the composed start of the next segment: with the composition perturbed, the
    checkpoints of the first segment (which starts from the initial state itself) keep their bits and the later
    ones move."""
    from flash_kda import numerics  # noqa: PLC0415

    x = checkpoint_inputs(C=C, M=4, seqlens=(150, 17, 0, 64), lower_bound=-0.01)
    lengths = (150, 17, 0, 64)
    entries = [(n, (m + 1) * C) for n, length in enumerate(lengths) for m in range(4) if (m + 1) * C <= length]
    ar = numerics.fp32_arithmetic()
    args = [*_numerics_args(x), x["initial_state"][:4].clone(), x["cu_seqlens"], ar]
    _, state0, unsplit = numerics._chunked(*args, 0, checkpoints=entries)
    _, state1, split = numerics._chunked(*args, segment_chunks, checkpoints=entries)
    assert compare.compare(split, unsplit).rel_l2 < 1e-5  # fp32 rounding (as the time split's final states)
    for e, (n, t) in enumerate(entries):
        if t == lengths[n]:  # the checkpoint at a sequence's end is its final state, bit for bit
            assert torch.equal(split[e], state1[n]) and torch.equal(unsplit[e], state0[n]), (n, t)

    compose = numerics._compose
    try:
        numerics._compose = lambda state, m, q, ar: compose(state, m, q, ar) * 1.001
        _, _, perturbed = numerics._chunked(*args, segment_chunks, checkpoints=entries)
    finally:
        numerics._compose = compose
    for e, (n, t) in enumerate(entries):
        first_segment = t // 16 <= segment_chunks
        assert torch.equal(perturbed[e], split[e]) == first_segment, (n, t, segment_chunks)


@pytest.mark.parametrize("C", [16, 32])
def test_decode_recurrence_checkpoints_match_float64(C: int) -> None:
    """The decode kernel's recurrence (numerics._recurrent, fp32 here) records the state after token (m+1)·C - 1:
    within the fp32 bound of float64, and at a sequence's end its final state bit for bit."""
    from flash_kda import numerics  # noqa: PLC0415

    lengths = (48, 17, 0, 40, 96)
    x = checkpoint_inputs(C=C, M=3, seqlens=lengths)
    entries = [(n, (m + 1) * C) for n, length in enumerate(lengths) for m in range(3) if (m + 1) * C <= length]
    initial = x["initial_state"][:5].clone()
    out, state, recorded = numerics._recurrent_checkpoints(*_numerics_args(x), initial, x["cu_seqlens"],
                                                           numerics.fp32_arithmetic(), "lower_bound", 1.0, entries)
    assert recorded.shape[0] == len(entries)
    for e, (n, t) in enumerate(entries):
        bos = int(x["cu_seqlens"][n])
        prefix = {name: x[name][:, bos : bos + t] for name in ("q", "k", "v", "g", "beta")}
        rest = {k: x[k] for k in ("scale", "A_log", "dt_bias", "lower_bound")}
        _, ref_state = reference.reference_loop(**prefix, **rest, initial_state=initial[n : n + 1])
        compare.compare(recorded[e], ref_state[0]).check(rel_l2=FP32_STATE_REL_L2, name=f"checkpoint {(n, t)}")
        if t == lengths[n]:
            assert torch.equal(recorded[e], state[n])
    plain_out, plain_state = numerics.recurrent_forward(*_numerics_args(x), initial, x["cu_seqlens"])
    assert torch.equal(out, plain_out) and torch.equal(state, plain_state)


@pytest.mark.parametrize(
    "gate, A_log, g",
    [("lower_bound", 89.0, 0.0), ("lower_bound", 89.0, 0.5), ("lower_bound", -110.0, 3.0),
     ("softplus", 89.0, -200.0), ("softplus", 89.0, 0.0), ("softplus", -110.0, 30.0)],
    ids=str,
)
def test_a_log_past_fp32_range_stays_finite_and_exact(gate: str, A_log: float, g: float) -> None:
    """e^A_log past fp32's range (A_log beyond about ±88) is held in its normal range (gate.cuh), so that neither
    ∞·0 (a gate input of 0, a softplus that underflows) nor 0·∞ makes a NaN: out and the state are finite and
    match the float64 recurrence, whose e^A_log does not overflow."""
    T, H = 16, 2
    gen = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    q, k, v = (torch.randn(1, T, H, D, generator=gen).to(bf) for _ in range(3))
    beta = torch.randn(1, T, H, generator=gen).to(bf)
    gate_in = torch.full((1, T, H, D), g, dtype=bf)
    a_log = torch.full((H,), A_log)
    init = torch.randn(1, H, D, D, generator=gen) * 0.1
    out, fin = torch.empty(1, T, H, D, dtype=bf), torch.empty(1, H, D, D)
    lower_bound = -5.0 if gate == "lower_bound" else None
    flash_kda.fwd(q, k, v, gate_in, beta, D**-0.5, out, a_log, None, lower_bound, init, fin, gate=gate)
    assert torch.isfinite(out.float()).all() and torch.isfinite(fin).all()
    ref_out, ref_state = reference.reference_loop(q, k, v, gate_in, beta, D**-0.5, a_log, None, lower_bound, init,
                                                  gate_kind=gate)
    floor = compare.compare(ref_out.to(bf), ref_out).rel_l2
    compare.compare(out, ref_out).check(rel_l2=FLOOR_FACTOR * floor, name="out")
    compare.compare(fin, ref_state).check(rel_l2=FP32_STATE_REL_L2, name="final_state")


def test_cpu_autocast_leaves_the_fp32_path_alone():
    """A model forward under CPU autocast calls fwd inside it: the CPU path still computes in fp32, the same bits."""
    case = matrix.Case("varlen", H=2, seqlens=(20, 0, 13), state_dtype="fp32")
    x = matrix.make_inputs(case, "cpu")
    y = {**x, "out": x["out"].clone(), "final_state": x["final_state"].clone()}
    flash_kda.fwd(**{n: x[n] for n in FWD_NAMES})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flash_kda.fwd(**{n: y[n] for n in FWD_NAMES})
    compare.assert_bitwise_equal(y["out"], x["out"], "out under autocast")
    compare.assert_bitwise_equal(y["final_state"], x["final_state"], "final_state under autocast")


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_a_non_finite_input_stays_in_its_sequence_and_head(name: str) -> None:
    """Inputs are not checked for NaN or ±Inf (docs/SPEC.md §3, "Guarantees"): one at token 20 of the first of two
    sequences (40 tokens each) reaches at most that sequence's rows from the start of its 16-token chunk (token 16;
    its own row alone for q) and that sequence's final state; the other sequence, the other head and the earlier rows
    are the call's without it, bit for bit."""
    T, H, bad = 80, 2, 20
    gen = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    x = {n: torch.randn(1, T, H, D, generator=gen).to(bf) for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T, H, generator=gen).to(bf)
    cu = torch.tensor([0, 40, 80])
    init = torch.randn(2, H, D, D, generator=gen) * 0.1

    def run(inputs):
        out, fin = torch.empty(1, T, H, D, dtype=bf), torch.empty(2, H, D, D)
        flash_kda.fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], D**-0.5, out,
                      torch.zeros(H), torch.zeros(H, D), -1.0, init, fin, cu)
        return out, fin

    clean_out, clean_fin = run(x)
    poisoned = {**x, name: x[name].clone()}
    poisoned[name][0, bad, 0] = float("nan")
    out, fin = run(poisoned)
    first = bad if name == "q" else bad // 16 * 16
    compare.assert_bitwise_equal(out[:, :first], clean_out[:, :first], "rows before the poisoned chunk")
    compare.assert_bitwise_equal(out[:, 40:], clean_out[:, 40:], "the other sequence")
    compare.assert_bitwise_equal(out[..., 1, :], clean_out[..., 1, :], "the other head")
    compare.assert_bitwise_equal(fin[1], clean_fin[1], "the other sequence's final state")
    compare.assert_bitwise_equal(fin[0, 1], clean_fin[0, 1], "the other head's final state")
    assert not torch.isfinite(out[0, bad, 0].float()).all()
