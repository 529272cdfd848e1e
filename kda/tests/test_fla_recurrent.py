"""fla 0.6.0's fused_recurrent_kda_fwd reaches flash_kda.fwd after flash_kda.fla_backend.register() (GPU; fla
from the pinned wheels, @fla_wheels//:fla).

fla dispatches ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` through ``fla.backends``; the module
fixture registers the backend (twice: the second call must change nothing). Each test counts the calls that reach
``flash_kda.fwd`` and runs fla's own Triton kernel on the same inputs with ``FLA_FLASH_KDA=0`` (the backend's
switch, read at every call). A call the backend takes must

- reach ``flash_kda.fwd`` once and return what fla returns (out; the pool or state itself in place, else a new
  fp32 [N, H, V, K] final state);
- equal a direct ``flash_kda.fwd`` call bit for bit (out and the final state or whole pool);
- agree with fla's kernel: relative L2 ≤ AGREE_REL_L2 on out and on the final states (the named slots of a pool;
  slots no sequence names stay untouched, bit for bit, on both paths);
- and stay within the correctness matrix's float64 bounds (test_matrix.py: the decode slice's for rows of at most
  16 tokens, the general ones otherwise).

The model options run the same checks: the softplus gate (``lower_bound=None``), negative eigenvalues and grouped
value heads (value heads G·H over H key heads), in pools and in rows. So does speculative verification: 2-D
``ssm_state_indices`` [N, L] with ``num_accepted_tokens`` (the state after each token in its own slot).

A call the backend refuses runs fla's kernel (no call reaches flash_kda.fwd). A fresh process shows that fla's
behaviour is unchanged until ``register()`` is called.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

import flash_kda
import flash_kda.fla_backend
from flash_kda import compare, reference
from flash_kda.api import fwd as direct_fwd  # (not the counting wrapper the tests put on flash_kda.fwd)
from fla_support import assert_fresh_process_ok, fla_own  # noqa: F401 (fla_own: a fixture)

pytestmark = pytest.mark.gpu

D = 128
H = 4
LOWER_BOUND = -5.0
SCALE = D**-0.5
FLAGS = dict(state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)
# Agreement with fla's kernel. Both compute in fp32 from the same bf16 inputs and round out (and a bf16 state) to
# bf16 once: each is within about 4.5e-3 of float64 here (the decode slice's bound for ours; fla's token loop keeps
# its state in fp32 registers the same way), so by the triangle inequality they differ by at most about 9e-3.
AGREE_REL_L2 = 1e-2
# Against float64, the bounds of test_matrix.py: rows of at most 16 tokens (the decode slice) and the model options
# (the option slices: the same numbers), others.
DECODE_OUT_REL_L2, DECODE_STATE_REL_L2 = 4.5e-3, {torch.bfloat16: 3.5e-3, torch.float32: 3.0e-3}
OUT_REL_L2, STATE_REL_L2 = 1e-2, 7.5e-3


def _fla_fwd():
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: PLC0415 -- fla needs triton and a GPU

    return fused_recurrent_kda_fwd


@pytest.fixture(scope="module", autouse=True)
def registered():
    flash_kda.fla_backend.register()
    flash_kda.fla_backend.register()  # a second call replaces the entry with an equal one


@pytest.fixture
def fwd_calls(monkeypatch) -> list:
    """Counts the calls of flash_kda.fwd (the backend looks the function up on the package at call time)."""
    monkeypatch.delenv("FLA_FLASH_KDA", raising=False)
    calls = []
    real = flash_kda.fwd

    def counting_fwd(*args, **kwargs):
        calls.append(kwargs.get("state_indices") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_kda, "fwd", counting_fwd)
    return calls


# The model options (fla's arguments): the softplus gate is lower_bound=None.
OPTIONS = {
    "lower_bound": dict(),
    "softplus": dict(lower_bound=None),
    "softplus_neg_eigval": dict(lower_bound=None, allow_neg_eigval=True),
    "lower_bound_neg_eigval": dict(allow_neg_eigval=True),
}


def _inputs(*, B=1, T=1, seqlens=None, seed=0, cu_dtype=torch.int64, G=1, options="lower_bound") -> dict:
    """Inputs on H key heads and G·H value heads, with fla's options (OPTIONS) in x["options"]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    N, cu = B, None
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=cu_dtype, device="cuda")
    HV = G * H
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, HV, D), g=randn(B, T, HV, D), beta=randn(B, T, HV),
        A_log=randn(HV, dtype=torch.float32), dt_bias=randn(HV * D, dtype=torch.float32),  # fla's flat layout
        cu_seqlens=cu, N=N, HV=HV, gen=gen, longest=T if seqlens is None else max(seqlens),
        options=OPTIONS[options],
    )  # fmt: skip


def _call(x: dict, **kwargs):
    """fla's fused_recurrent_kda_fwd on x as a serving engine calls it (inference mode, keywords)."""
    with torch.inference_mode():
        return _fla_fwd()(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"],
                          dt_bias=x["dt_bias"], scale=SCALE, cu_seqlens=x["cu_seqlens"],
                          **{**FLAGS, **x["options"], **kwargs})


def _gate(x: dict) -> tuple[float | None, str, bool]:
    """(lower_bound, gate, allow_neg_eigval) of flash_kda.fwd for x's options."""
    lower_bound = x["options"].get("lower_bound", LOWER_BOUND)
    return lower_bound, "softplus" if lower_bound is None else "lower_bound", x["options"].get("allow_neg_eigval",
                                                                                             False)


def _direct(x: dict, initial_state, final_state, state_indices=None, num_accepted_tokens=None) -> torch.Tensor:
    out = torch.empty_like(x["v"])
    lower_bound, gate, neg = _gate(x)
    direct_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, out, x["A_log"], x["dt_bias"].view(x["HV"], D),
               lower_bound, initial_state=initial_state, final_state=final_state, cu_seqlens=x["cu_seqlens"],
               state_indices=state_indices, num_accepted_tokens=num_accepted_tokens, gate=gate, allow_neg_eigval=neg)
    return out


def _reference(x: dict, initial_state, state_indices=None, num_accepted_tokens=None):
    lower_bound, gate, neg = _gate(x)
    return reference.reference_loop(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["A_log"], x["dt_bias"],
                                    lower_bound, initial_state, x["cu_seqlens"], state_indices=state_indices,
                                    num_accepted_tokens=num_accepted_tokens, gate_kind=gate,
                                    beta_scale=2.0 if neg else 1.0)


def _check(x: dict, ours: tuple, fla: tuple, ref: tuple, state_dtype, rows=None) -> None:
    """Agreement with fla and the float64 bounds; ``rows`` selects the final states compared (a pool's named
    slots). Collects every failure before raising."""
    tight = x["longest"] <= 16 or x["options"] or x["HV"] != H  # the decode slice's or the option slices' bounds
    out_bound = DECODE_OUT_REL_L2 if tight else OUT_REL_L2
    state_bound = DECODE_STATE_REL_L2[state_dtype] if tight else STATE_REL_L2
    pick = (lambda s: s) if rows is None else (lambda s: s[rows])
    reports = {
        "out vs fla": (compare.compare(ours[0], fla[0]), AGREE_REL_L2),
        "final state vs fla": (compare.compare(pick(ours[1]), pick(fla[1])), AGREE_REL_L2),
        "out vs float64": (compare.compare(ours[0], ref[0]), out_bound),
        "final state vs float64": (compare.compare(pick(ours[1]), pick(ref[1])), state_bound),
    }
    fla_errors = f"fla vs float64: out {compare.compare(fla[0], ref[0]).rel_l2:.3e}, " \
                 f"state {compare.compare(pick(fla[1]), pick(ref[1])).rel_l2:.3e}"
    failures = [f"{name}: rel L2 {r.rel_l2:.3e} > {bound:.1e} ({r})" for name, (r, bound) in reports.items()
                if not r.rel_l2 <= bound]
    assert not failures, "\n".join(failures + [fla_errors])


# --- decode: one token per sequence, a pool and 1-D ssm_state_indices, in place -----------------------------

POOL_CASES = {
    "fixed_N16": dict(B=16, T=1),
    "varlen_N13_int32_cu": dict(seqlens=(1,) * 13, cu_dtype=torch.int32),  # (a serving engine's query_start_loc)
    # The model options (a serving engine's Kimi Linear: softplus gate, value heads twice the key heads).
    "fixed_N16_softplus": dict(B=16, T=1, options="softplus"),
    "varlen_N13_gva2_softplus": dict(seqlens=(1,) * 13, G=2, options="softplus"),
    "fixed_N9_gva4_softplus_neg_eigval": dict(B=9, T=1, G=4, options="softplus_neg_eigval"),
    "fixed_N16_lower_bound_neg_eigval": dict(B=16, T=1, options="lower_bound_neg_eigval"),
}


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("case", list(POOL_CASES), ids=list(POOL_CASES))
def test_decode_with_pool_reaches_flash_kda(case, state_dtype, fwd_calls, fla_own):
    x = _inputs(**POOL_CASES[case])
    N = x["N"]
    P = 2 * N + 3
    pool = torch.randn(P, x["HV"], D, D, generator=x["gen"], device="cuda").to(state_dtype)
    indices = torch.randperm(P, generator=x["gen"], device="cuda")[:N].to(torch.int32)
    unnamed = torch.ones(P, dtype=torch.bool, device="cuda")
    unnamed[indices.long()] = False

    fla_pool = pool.clone()
    fla_out, fla_final = fla_own(lambda: _call(x, initial_state=fla_pool, inplace_final_state=True,
                                              ssm_state_indices=indices))
    assert fwd_calls == [], "FLA_FLASH_KDA=0 still reached flash_kda.fwd"
    assert fla_final is fla_pool

    our_pool = pool.clone()
    out, final = _call(x, initial_state=our_pool, inplace_final_state=True, ssm_state_indices=indices)
    assert fwd_calls == [True], f"expected one flash_kda.fwd call with state_indices, got {fwd_calls}"
    assert final is our_pool, "in place, fla returns the pool itself"
    assert out.dtype == torch.bfloat16 and out.shape == x["v"].shape

    direct_pool = pool.clone()
    direct_out = _direct(x, direct_pool, direct_pool, indices)
    compare.assert_bitwise_equal(out, direct_out, "out")
    compare.assert_bitwise_equal(our_pool, direct_pool, "pool")
    compare.assert_bitwise_equal(our_pool[unnamed], pool[unnamed], "unnamed slots (ours)")
    compare.assert_bitwise_equal(fla_pool[unnamed], pool[unnamed], "unnamed slots (fla)")
    _check(x, (out, our_pool), (fla_out, fla_pool), _reference(x, pool, indices), state_dtype, rows=indices.long())


# --- speculative verification: 2-D ssm_state_indices [N, L] and num_accepted_tokens [N], in place ----------

SPEC_CASES = {
    "varlen_N8_4_tokens": dict(seqlens=(4,) * 8),
    # fewer tokens than slots in some rows (those slots stay as they were); a serving engine's Kimi Linear
    "varlen_N6_mixed_gva2_softplus": dict(seqlens=(4, 1, 3, 4, 2, 4), G=2, options="softplus"),
}
SPEC_SLOTS = 4  # L: slots per sequence


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("case", list(SPEC_CASES), ids=list(SPEC_CASES))
def test_spec_decoding_token_states_reach_flash_kda(case, state_dtype, fwd_calls, fla_own):
    """fla's contract: sequence n starts from slot ssm_state_indices[n, num_accepted_tokens[n] − 1] and the state
    after its token t goes to slot ssm_state_indices[n, t]. One flash_kda.fwd call, equal bit for bit to a direct
    call; the written slots agree with fla's Triton kernel and meet the float64 bounds; other slots keep their bits."""
    x = _inputs(**SPEC_CASES[case])
    N, L = x["N"], SPEC_SLOTS
    P = N * L + 3
    pool = torch.randn(P, x["HV"], D, D, generator=x["gen"], device="cuda").to(state_dtype)
    indices = torch.randperm(P, generator=x["gen"], device="cuda")[:N * L].view(N, L).to(torch.int32)
    accepted = torch.randint(1, L + 1, (N,), generator=x["gen"], device="cuda", dtype=torch.int32)
    lengths = torch.tensor(SPEC_CASES[case]["seqlens"], device="cuda")
    written = indices.long()[torch.arange(L, device="cuda").view(1, L) < lengths.view(N, 1)]
    unnamed = torch.ones(P, dtype=torch.bool, device="cuda")
    unnamed[written] = False
    spec = dict(ssm_state_indices=indices, num_accepted_tokens=accepted)

    fla_pool = pool.clone()
    fla_out, _ = fla_own(lambda: _call(x, initial_state=fla_pool, inplace_final_state=True, **spec))
    assert fwd_calls == [], "FLA_FLASH_KDA=0 still reached flash_kda.fwd"

    our_pool = pool.clone()
    out, final = _call(x, initial_state=our_pool, inplace_final_state=True, **spec)
    assert fwd_calls == [True], f"expected one flash_kda.fwd call with state_indices, got {fwd_calls}"
    assert final is our_pool, "in place, fla returns the pool itself"

    direct_pool = pool.clone()
    direct_out = _direct(x, direct_pool, direct_pool, indices, accepted)
    compare.assert_bitwise_equal(out, direct_out, "out")
    compare.assert_bitwise_equal(our_pool, direct_pool, "pool")
    compare.assert_bitwise_equal(our_pool[unnamed], pool[unnamed], "slots no token names (ours)")
    ref = _reference(x, pool, indices, accepted)
    _check(x, (out, our_pool), (fla_out, fla_pool), ref, state_dtype, rows=written)


# --- multi-token varlen rows (and fixed length) without indices ----------------------------------------------

ROW_CASES = {
    "varlen_short": dict(seqlens=(1, 7, 16, 0, 3, 12)),  # at most 16 tokens a row: the decode kernel
    "varlen_long": dict(seqlens=(200, 1, 37, 0)),  # the chunked kernels
    "fixed_B3_T5": dict(B=3, T=5),
    # The model options (fla's KimiDeltaAttention runs fused_recurrent_kda for at most 64 tokens in inference).
    "varlen_short_softplus": dict(seqlens=(1, 7, 16, 0, 3, 12), options="softplus"),
    "varlen_long_gva2_softplus": dict(seqlens=(200, 1, 37, 0), G=2, options="softplus"),
    "fixed_B3_T40_gva4_softplus_neg_eigval": dict(B=3, T=40, G=4, options="softplus_neg_eigval"),
    "varlen_short_lower_bound_neg_eigval": dict(seqlens=(1, 7, 16, 0, 3, 12), options="lower_bound_neg_eigval"),
}


@pytest.mark.parametrize("in_place", [False, True], ids=["new_final_state", "in_place"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16_state", "fp32_state"])
@pytest.mark.parametrize("case", list(ROW_CASES), ids=list(ROW_CASES))
def test_rows_reach_flash_kda(case, state_dtype, in_place, fwd_calls, fla_own):
    x = _inputs(**ROW_CASES[case])
    state = torch.randn(x["N"], x["HV"], D, D, generator=x["gen"], device="cuda").to(state_dtype)
    kwargs = dict(output_final_state=True, inplace_final_state=in_place)

    fla_state = state.clone()
    fla_out, fla_final = fla_own(lambda: _call(x, initial_state=fla_state, **kwargs))
    assert fwd_calls == []

    our_state = state.clone()
    out, final = _call(x, initial_state=our_state, **kwargs)
    assert fwd_calls == [False], f"expected one flash_kda.fwd call, got {fwd_calls}"
    if in_place:
        assert final is our_state and fla_final is fla_state
    else:
        assert final.dtype == fla_final.dtype == torch.float32 and final.shape == fla_final.shape
        compare.assert_bitwise_equal(our_state, state, "initial_state (not in place)")

    direct_state = state.clone()
    direct_final = direct_state if in_place else torch.empty(x["N"], x["HV"], D, D, dtype=torch.float32,
                                                             device="cuda")
    direct_out = _direct(x, direct_state, direct_final)
    compare.assert_bitwise_equal(out, direct_out, "out")
    compare.assert_bitwise_equal(final, direct_final, "final state")
    _check(x, (out, final), (fla_out, fla_final), _reference(x, state), final.dtype)


def test_public_fused_recurrent_kda_reaches_flash_kda(fwd_calls):
    """fla's public entry (what its KimiDeltaAttention layer runs in fused_recurrent mode), outside inference
    mode with inputs that need no grad: taken, and equal to a direct call."""
    from fla.ops.kda import fused_recurrent_kda  # noqa: PLC0415

    x = _inputs(seqlens=(3, 1, 9))
    state = torch.randn(x["N"], H, D, D, generator=x["gen"], device="cuda")
    out, final = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                                     dt_bias=x["dt_bias"], scale=SCALE, initial_state=state, output_final_state=True,
                                     cu_seqlens=x["cu_seqlens"], **FLAGS)
    assert len(fwd_calls) == 1
    direct_final = torch.empty(x["N"], H, D, D, dtype=torch.float32, device="cuda")
    compare.assert_bitwise_equal(out, _direct(x, state, direct_final), "out")
    compare.assert_bitwise_equal(final, direct_final, "final state")


# --- what the backend refuses runs fla's kernel --------------------------------------------------------------


def _refused_call(case: str, x: dict):
    state = torch.randn(x["N"], H, D, D, generator=x["gen"], device="cuda")
    if case == "no_gate_in_kernel":  # g is then a log decay
        return _call({**x, "g": F.logsigmoid(x["g"].float()).to(torch.bfloat16)}, initial_state=state,
                     output_final_state=True, inplace_final_state=False, use_gate_in_kernel=False)
    if case == "softplus_without_A_log":  # fla's kernel then takes exp(A_log) as e
        with torch.inference_mode():
            return _fla_fwd()(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=None, dt_bias=x["dt_bias"],
                              initial_state=state, output_final_state=True, inplace_final_state=False,
                              cu_seqlens=x["cu_seqlens"], **{**FLAGS, "lower_bound": None})
    if case == "requires_grad":
        q = x["q"].clone().requires_grad_(True)
        with torch.enable_grad():
            return _fla_fwd()(q, x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                              scale=SCALE, initial_state=state, output_final_state=True, inplace_final_state=False,
                              cu_seqlens=x["cu_seqlens"], **FLAGS)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["no_gate_in_kernel", "softplus_without_A_log", "requires_grad"])
def test_refused_calls_run_fla_kernel(case, fwd_calls):
    x = _inputs(seqlens=(2, 2, 2))
    out, final = _refused_call(case, x)
    torch.cuda.synchronize()
    assert fwd_calls == [], f"{case}: the backend took a call it cannot compute"
    assert torch.isfinite(out.float()).all() and torch.isfinite(final.float()).all()


# --- registration: nothing changes until it is called ------------------------------------------------------

_FRESH_PROCESS = textwrap.dedent("""
    import torch, flash_kda
    calls = []
    real = flash_kda.fwd
    flash_kda.fwd = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1]
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def call():
        g = torch.Generator(device="cuda").manual_seed(0)
        r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, generator=g, device="cuda").to(dtype)
        N, H, D = 4, 2, 128
        pool = r(8, H, D, D, dtype=torch.float32)
        with torch.inference_mode():
            return fused_recurrent_kda_fwd(
                r(N, 1, H, D), r(N, 1, H, D), r(N, 1, H, D), r(N, 1, H, D), r(N, 1, H), A_log=r(H, dtype=torch.float32),
                dt_bias=r(H * D, dtype=torch.float32), initial_state=pool, inplace_final_state=True,
                ssm_state_indices=torch.tensor([5, 0, 7, 2], dtype=torch.int32, device="cuda"), state_v_first=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)

    call()
    assert calls == [], f"flash_kda.fwd reached before register(): {calls}"
    import flash_kda.fla_backend
    flash_kda.fla_backend.register()
    flash_kda.fla_backend.register()
    call()
    assert calls == [1], f"after register() (twice) one call must reach flash_kda.fwd once, got {calls}"
    print("fresh process ok")
""")


def test_fla_unchanged_until_register_in_fresh_process():
    assert_fresh_process_ok(_FRESH_PROCESS)
