"""flash_kda.fla_backend without fla and without a GPU (CPU; runs in CI).

- The verifier (``unsupported``) takes exactly the calls of fla 0.6's ``fused_recurrent_kda_fwd`` that
  ``flash_kda.fwd`` computes and names the reason for every other one (the kernel's device check is stubbed, so
  CPU tensors stand in for CUDA ones; ``kernel_device`` itself is tested with a stubbed capability).
- The argument mapping (``fused_recurrent_kda_fwd``, run on the CPU path): fla's return convention (out, final
  state in place / new fp32 / None), the flat ``dt_bias``, the pool with a 1-D ``ssm_state_indices``; equal bit for
  bit to a direct ``flash_kda.fwd`` call, and close to a float64 re-enactment of fla's kernel (its index rules
  included).
- ``register()``: importing flash_kda imports no fla; a missing or too old fla is named; against a stand-in of
  fla 0.6's ``fla.backends`` (fla itself needs triton) it registers one backend of type "flash_kda" for the "kda"
  operation, and a second call leaves one.
GPU tests with the real fla: test_fla_recurrent.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import flash_kda
from flash_kda import fla_backend

D = 128
LOWER_BOUND = -5.0
FLAGS = dict(state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)


def fla_args(*, B=1, T=4, H=2, seqlens=None, state=torch.float32, pool=None, index_dtype=torch.int32,
             seed=0, **changes) -> dict:
    """Keyword arguments of a supported fused_recurrent_kda_fwd call on CPU tensors (fla's layouts: flat
    dt_bias; with ``pool=P``, one token per sequence, a pool [P, H, V, K] and a 1-D slot permutation, in place)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    N, cu = B, None
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64)
    x = dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        A_log=randn(H, dtype=torch.float32), dt_bias=randn(H * D, dtype=torch.float32), cu_seqlens=cu,
        initial_state=None if state is None else randn(N if pool is None else pool, H, D, D, dtype=state),
        output_final_state=True, inplace_final_state=False, **FLAGS,
    )  # fmt: skip
    if pool is not None:
        x["ssm_state_indices"] = torch.randperm(pool, generator=gen)[:N].to(index_dtype)
        x["inplace_final_state"] = True
    x.update(changes)
    return x


@pytest.fixture
def any_device(monkeypatch):
    """The verifier's device check passes for CPU tensors (they stand in for CUDA tensors on an sm_90 GPU)."""
    monkeypatch.setattr(fla_backend, "kernel_device", lambda device: None)


# --- the verifier --------------------------------------------------------------------------------------------

ACCEPTED = {
    "fixed_fp32_state": dict(),
    "fixed_bf16_state": dict(state=torch.bfloat16),
    "no_state": dict(state=None),
    "no_final_state": dict(output_final_state=False),
    "in_place": dict(inplace_final_state=True),
    "varlen": dict(seqlens=(3, 0, 5)),
    "int32_cu_seqlens_on_cpu": dict(seqlens=(3, 5), cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)),
    "pool_fixed_T1": dict(B=5, T=1, pool=8),
    "pool_varlen_one_token_each": dict(seqlens=(1,) * 5, pool=7, state=torch.bfloat16, index_dtype=torch.int64),
    "pool_in_place_flag_only": dict(B=3, T=1, pool=4, output_final_state=False),
    "dt_bias_2d": dict(dt_bias=torch.zeros(2, D)),
    "bf16_params": dict(A_log=torch.zeros(2, dtype=torch.bfloat16), dt_bias=torch.zeros(2 * D, dtype=torch.half)),
    "scale_given": dict(scale=0.1),
    "int_lower_bound": dict(lower_bound=-1),
    "lower_bound_0": dict(lower_bound=0.0),
    "out_given": dict(out=torch.empty(1, 4, 2, D, dtype=torch.bfloat16)),
    "grad_inputs_without_grad_mode": dict(),  # (run under torch.no_grad below)
}


@pytest.mark.parametrize("case", list(ACCEPTED), ids=list(ACCEPTED))
def test_verifier_accepts(case, any_device):
    x = fla_args(**ACCEPTED[case])
    if case == "grad_inputs_without_grad_mode":
        x["q"].requires_grad_(True)
        with torch.no_grad():
            assert fla_backend.unsupported(**x) is None
        return
    assert fla_backend.unsupported(**x) is None


def _positional(x: dict) -> tuple:
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
    return tuple(x.pop(n) for n in names)


def test_verifier_reads_positional_arguments_in_fla_order(any_device):
    x = fla_args()
    assert fla_backend.unsupported(*_positional(dict(x)), **{k: v for k, v in x.items() if k not in (
        "q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}) is None
    x = fla_args(A_log=None)
    assert "A_log" in fla_backend.unsupported(*_positional(x), **x)


def _overlapping_out() -> dict:
    x = fla_args()
    x["out"] = x["v"]  # fla's kernel would tolerate it; flash_kda.fwd refuses overlapping outputs
    return x


REFUSED = {  # case: (changes to the supported call, words of the reason)
    "state_k_first": (dict(state_v_first=False), "state_v_first"),
    "no_l2norm": (dict(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel"),
    "no_gate_in_kernel": (dict(use_gate_in_kernel=False), "use_gate_in_kernel"),
    "no_beta_sigmoid": (dict(use_beta_sigmoid_in_kernel=False), "use_beta_sigmoid_in_kernel"),
    "neg_eigval": (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    "softplus_gate": (dict(lower_bound=None), "lower_bound"),
    "lower_bound_below_range": (dict(lower_bound=-6.0), "lower_bound"),
    "lower_bound_above_range": (dict(lower_bound=0.5), "lower_bound"),
    "lower_bound_nan": (dict(lower_bound=float("nan")), "lower_bound"),
    "lower_bound_bool": (dict(lower_bound=False), "lower_bound"),
    "no_A_log": (dict(A_log=None), "A_log"),
    "no_dt_bias": (dict(dt_bias=None), "dt_bias"),
    "scale_inf": (dict(scale=float("inf")), "scale"),
    "scale_past_fp32": (dict(scale=1e39), "scale"),
    "spec_decoding": (dict(B=2, T=1, pool=4, num_accepted_tokens=torch.ones(2, dtype=torch.int32)),
                      "num_accepted_tokens"),
    "unknown_argument": (dict(chunk_size=64), "chunk_size"),
    "in_place_without_state": (dict(state=None, inplace_final_state=True), "initial_state"),
    "indices_not_in_place": (dict(B=2, T=1, pool=4, inplace_final_state=False), "inplace_final_state"),
    "indices_2d": (dict(B=2, T=1, pool=4, ssm_state_indices=torch.tensor([[0], [1]])), "1-D"),
    "indices_multi_token_fixed": (dict(B=2, T=3, pool=4), "one token per sequence"),
    "indices_multi_token_varlen": (dict(seqlens=(2, 1), pool=4), "one token per sequence"),
    "indices_float": (dict(B=2, T=1, pool=4, ssm_state_indices=torch.tensor([0.0, 1.0])), "ssm_state_indices"),
    "q_fp32": (dict(q=torch.zeros(1, 4, 2, D)), "q must be bfloat16"),
    "beta_fp32": (dict(beta=torch.zeros(1, 4, 2)), "beta must be bfloat16"),
    "state_fp16": (dict(state=torch.float16), "initial_state"),
    "out_fp32": (dict(out=torch.empty(1, 4, 2, D)), "out must be bfloat16"),
    "params_fp64": (dict(A_log=torch.zeros(2, dtype=torch.float64)), "A_log"),
    "cu_seqlens_float": (dict(seqlens=(2, 2), cu_seqlens=torch.tensor([0.0, 2.0, 4.0])), "cu_seqlens"),
    "head_dim_64": (dict(q=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)), "q must be"),
    "value_dim_64": (dict(v=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)), "v must have"),
    "gva": (dict(v=torch.zeros(1, 4, 4, D, dtype=torch.bfloat16)), "v must have"),
    "headwise_beta": (dict(beta=torch.zeros(1, 4, 2, D, dtype=torch.bfloat16)), "beta must be"),
    "state_wrong_n": (dict(initial_state=torch.zeros(3, 2, D, D)), "initial_state must be"),
    "pool_wrong_heads": (dict(B=2, T=1, pool=4, initial_state=torch.zeros(4, 3, D, D)), "pool"),
    "varlen_batch_2": (dict(B=2, cu_seqlens=torch.tensor([0, 4, 8])), "B = 1"),
    "non_contiguous_q": (dict(q=torch.zeros(1, 2, 4, D, dtype=torch.bfloat16).transpose(1, 2)), "contiguous"),
    "unaligned_g": (dict(g=torch.zeros(1 * 4 * 2 * D + 1, dtype=torch.bfloat16)[1:].view(1, 4, 2, D)), "aligned"),
    "out_overlaps_v": (None, "out overlaps v"),
    "out_shape": (dict(out=torch.empty(1, 4, 2, 64, dtype=torch.bfloat16)), "out must have"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_verifier_refuses_with_reason(case, any_device):
    changes, words = REFUSED[case]
    x = _overlapping_out() if changes is None else fla_args(**changes)
    reason = fla_backend.unsupported(**x)
    assert reason is not None and words in reason, f"{case}: {reason=}"


def test_verifier_refuses_grad_tracking_inputs(any_device):
    x = fla_args()
    x["g"].requires_grad_(True)
    with torch.enable_grad():
        reason = fla_backend.unsupported(**x)
    assert reason is not None and "g requires grad" in reason


def test_verifier_refuses_other_devices_and_archs(monkeypatch):
    assert "CUDA" in fla_backend.unsupported(**fla_args())  # CPU tensors: fla's Triton kernel's business
    monkeypatch.setattr(fla_backend, "device_capability", lambda device: (8, 0))
    assert "(8, 0)" in fla_backend.kernel_device(torch.device("cuda", 0))
    monkeypatch.setattr(fla_backend, "device_capability", lambda device: (9, 0))
    assert fla_backend.kernel_device(torch.device("cuda", 0)) is None


def test_backend_answers_fla_protocol(any_device):
    """fla calls ``<function>_verifier`` and expects (accepted, reason); other functions of the operation find
    no method and pass on."""
    cls = fla_backend._backend_class(_FakeFla().BaseBackend)
    backend = cls()
    assert backend.fused_recurrent_kda_fwd_verifier(**fla_args()) == (True, None)
    accepted, reason = backend.fused_recurrent_kda_fwd_verifier(**fla_args(use_gate_in_kernel=False))
    assert accepted is False and "use_gate_in_kernel" in reason
    assert getattr(backend, "chunk_kda_fwd_intra", None) is None
    assert getattr(backend, "chunk_kda_fwd_intra_verifier", None) is None


# --- the mapping (CPU path) ----------------------------------------------------------------------------------


def fla_semantics(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state, inplace_final_state,
                  cu_seqlens, lower_bound, scale=None, ssm_state_indices=None, **flags):
    """float64 re-enactment of fla 0.6's fused_recurrent_kda_fwd kernel with state_v_first and the in-kernel norm,
    lower-bound gate and beta sigmoid: (out, final_state), final_state as fla returns it (the pool itself,
    updated, in place). With a 1-D ssm_state_indices fla reads slot [n] and, after token i of sequence n, writes
    slot [n + i] (a slot per sequence for one token per sequence)."""
    f64 = torch.float64
    B, T, H, K = q.shape
    bounds = [(n * T, n * T + T) for n in range(B)] if cu_seqlens is None else list(
        zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    flat = [x.reshape(B * T, *x.shape[2:]).to(f64) for x in (q, k, v, g, beta)]
    q, k, v, g, beta = flat
    a = A_log.to(f64).exp().view(H, 1)
    bias = dt_bias.to(f64).view(H, K)
    scale = K**-0.5 if scale is None else scale
    out = torch.zeros(B * T, H, v.shape[-1], dtype=f64)
    if inplace_final_state:
        final = initial_state
    elif output_final_state:
        final = torch.zeros(len(bounds), H, v.shape[-1], K, dtype=torch.float32)
    else:
        final = None

    def unit(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    states = initial_state.clone() if initial_state is not None else None
    for n, (bos, eos) in enumerate(bounds):
        slot = n if ssm_state_indices is None else int(ssm_state_indices[n])
        S = torch.zeros(H, v.shape[-1], K, dtype=f64) if states is None else states[slot].to(f64)
        for t in range(bos, eos):
            kt, qt = unit(k[t]), unit(q[t]) * scale
            S = S * torch.exp(lower_bound * torch.sigmoid(a * (g[t] + bias))).unsqueeze(1)
            r = (v[t] - (S @ kt.unsqueeze(-1)).squeeze(-1)) * torch.sigmoid(beta[t]).unsqueeze(-1)
            S = S + r.unsqueeze(-1) * kt.unsqueeze(1)
            out[t] = (S @ qt.unsqueeze(-1)).squeeze(-1)
            if ssm_state_indices is not None:
                final[int(ssm_state_indices[n + t - bos])] = S.to(final.dtype)
        if ssm_state_indices is None and final is not None:
            final[n] = S.to(final.dtype)
    return out.view(B, T, H, -1), final


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def _direct(x: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same call made to flash_kda.fwd by hand (fla's flat dt_bias as [H, K])."""
    H = x["q"].shape[2]
    init = x["initial_state"]
    out = torch.empty_like(x["v"])
    N = x["q"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    if x["inplace_final_state"]:
        final = init
    elif x["output_final_state"]:
        final = torch.empty(N, H, D, D, dtype=torch.float32)
    else:
        final = None
    flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("scale") or D**-0.5, out, x["A_log"],
                  x["dt_bias"].view(H, D), x["lower_bound"], initial_state=init, final_state=final,
                  cu_seqlens=x["cu_seqlens"], state_indices=x.get("ssm_state_indices"))
    return out, final


def _copy(x: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in x.items()}


# Bounds against fla's float64 re-enactment: out is rounded to bf16 (half an ulp is 2^-9 relative; the rms of the
# rounding is about a third of that), the fp32 CPU path adds ~1e-6 over these few tokens, and a bf16 state is
# rounded once per call like out; one bf16 ulp (2^-8 = 3.9e-3) bounds all of them.
BF16_BOUND = 2.0**-8
FP32_STATE_BOUND = 1e-4

MAPPED = {
    "fixed_fp32_state": dict(B=2, T=3),
    "fixed_bf16_state_in_fp32_out": dict(B=2, T=3, state=torch.bfloat16),
    "varlen_no_state": dict(seqlens=(3, 0, 5), state=None),
    "no_final_state": dict(output_final_state=False),
    "dense_in_place_bf16": dict(B=2, T=2, state=torch.bfloat16, inplace_final_state=True),
    "pool_fixed_fp32": dict(B=5, T=1, pool=9),
    "pool_varlen_bf16": dict(seqlens=(1,) * 6, pool=6, state=torch.bfloat16, index_dtype=torch.int64),
    "scale_given": dict(scale=0.05),
}


@pytest.mark.parametrize("case", list(MAPPED), ids=list(MAPPED))
def test_mapping_follows_fla_contract(case, any_device):
    x = fla_args(**MAPPED[case])
    assert fla_backend.unsupported(**x) is None
    before = _copy(x)
    ours_x, direct_x, fla_x = _copy(x), _copy(x), _copy(x)
    out, final = fla_backend.fused_recurrent_kda_fwd(**ours_x)

    # fla's return convention: out like v; final_state is the initial state itself in place, else new fp32 or None
    assert out.dtype == torch.bfloat16 and out.shape == x["v"].shape
    if x["inplace_final_state"]:
        assert final is ours_x["initial_state"]
    elif x["output_final_state"]:
        N = x["q"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
        assert final.dtype == torch.float32 and final.shape == (N, x["q"].shape[2], D, D)
    else:
        assert final is None
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        assert torch.equal(ours_x[name], before[name]), f"{name} changed"

    direct_out, direct_final = _direct(direct_x)
    assert torch.equal(out, direct_out)
    assert (final is None) == (direct_final is None)
    if final is not None:
        assert torch.equal(final, direct_final)

    fla_out, fla_final = fla_semantics(**fla_x)
    assert _rel_l2(out, fla_out) <= BF16_BOUND
    if final is not None:
        bound = FP32_STATE_BOUND if final.dtype == torch.float32 else BF16_BOUND
        assert _rel_l2(final, fla_final) <= bound
        if x.get("ssm_state_indices") is not None:  # slots no sequence names: untouched, bit for bit
            unnamed = torch.ones(final.shape[0], dtype=torch.bool)
            unnamed[x["ssm_state_indices"].long()] = False
            assert torch.equal(final[unnamed], before["initial_state"][unnamed])


def test_mapping_writes_given_out_and_reads_flat_or_2d_dt_bias(any_device):
    x = fla_args(B=2, T=3)
    given = torch.full_like(x["v"], float("nan"))
    out, final = fla_backend.fused_recurrent_kda_fwd(**_copy(x), out=given)
    assert out is given and torch.isfinite(out.float()).all()
    out_2d, final_2d = fla_backend.fused_recurrent_kda_fwd(**{**_copy(x), "dt_bias": x["dt_bias"].view(2, D)})
    assert torch.equal(out, out_2d) and torch.equal(final, final_2d)


def test_mapping_padding_slot_starts_from_zeros_and_writes_nothing(any_device):
    """A negative slot (a padding row; fla's kernel would index before the pool) follows flash_kda.fwd's pool
    rule: the row's output starts from a zero state and the pool is not written for it."""
    x = fla_args(B=3, T=1, pool=4)
    x["ssm_state_indices"] = torch.tensor([2, -1, 0], dtype=torch.int32)
    pool = x["initial_state"].clone()
    out, final = fla_backend.fused_recurrent_kda_fwd(**x)
    assert torch.equal(final[[1, 3]], pool[[1, 3]])
    alone = fla_args(B=3, T=1, state=None, inplace_final_state=False, output_final_state=False)
    alone_out, _ = fla_backend.fused_recurrent_kda_fwd(**alone)  # the same inputs (one seed), no state at all
    assert torch.equal(out[1], alone_out[1])


# --- registration --------------------------------------------------------------------------------------------


def test_importing_flash_kda_imports_no_fla():
    code = ("import sys, flash_kda, flash_kda.fla_backend; "
            "loaded = sorted(m for m in sys.modules if m == 'fla' or m.startswith('fla.')); "
            "assert not loaded, loaded")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_register_without_fla_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla raises ImportError
    with pytest.raises(ImportError, match=r"needs fla \(pip install flash-linear-attention>=0.6\)"):
        fla_backend.register()


class _FakeFla:
    """A stand-in for fla 0.6's package: ``fla.backends`` with BaseBackend and register (one backend per type
    per operation, as fla keeps them), and the module of the dispatched function."""

    def __init__(self, *, version="0.6.0", backends=True, register=True, dispatch_disabled=False):
        self.registries: dict[str, dict[str, object]] = {}
        self.fla = types.ModuleType("fla")
        self.fla.__version__ = version
        self.modules = {"fla": self.fla, "fla.backends": None}
        if backends:
            mod = types.ModuleType("fla.backends")

            class BaseBackend:
                backend_type = "base"
                env_var = None
                priority = 5
                implementation = None
                verifier = None

                def __init__(self, *, env_var=None):
                    if env_var is not None:
                        self.env_var = env_var

            mod.BaseBackend = BaseBackend
            mod._DISPATCH_DISABLED = dispatch_disabled
            if register:
                def register_(entry_point, *, backend=None, verifier=None, env_var=None):
                    def decorator(implementation):
                        instance = implementation()
                        instance.verifier = verifier
                        self.registries.setdefault(entry_point, {})[instance.backend_type] = instance
                        return implementation

                    return decorator

                mod.register = register_
            self.BaseBackend = BaseBackend
            self.fla.backends = mod
            self.modules["fla.backends"] = mod
        recurrent = types.ModuleType(fla_backend._FLA_MODULE)
        recurrent.fused_recurrent_kda_fwd = lambda *args, **kwargs: None
        self.modules.update({"fla.ops": types.ModuleType("fla.ops"), "fla.ops.kda": types.ModuleType("fla.ops.kda"),
                             fla_backend._FLA_MODULE: recurrent})

    def install(self, monkeypatch) -> "_FakeFla":
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self


def test_register_with_fla_without_backends_names_the_version(monkeypatch):
    _FakeFla(version="0.5.0", backends=False).install(monkeypatch)
    with pytest.raises(ImportError, match=r"fla 0.5.0 has none"):
        fla_backend.register()
    _FakeFla(version="0.5.1", register=False).install(monkeypatch)
    with pytest.raises(ImportError, match=r"fla 0.5.1 lacks them"):
        fla_backend.register()


def test_register_adds_one_backend_and_twice_is_harmless(monkeypatch):
    fake = _FakeFla().install(monkeypatch)
    fla_backend.register()
    fla_backend.register()
    assert list(fake.registries) == ["kda"] and list(fake.registries["kda"]) == ["flash_kda"]
    backend = fake.registries["kda"]["flash_kda"]
    assert isinstance(backend, fake.BaseBackend)
    assert (backend.priority, backend.env_var, backend.package_name, backend.verifier) == (3, "FLA_FLASH_KDA",
                                                                                          None, None)
    assert callable(backend.fused_recurrent_kda_fwd) and callable(backend.fused_recurrent_kda_fwd_verifier)


def test_register_warns_when_fla_dispatch_is_disabled(monkeypatch):
    fake = _FakeFla(dispatch_disabled=True).install(monkeypatch)
    with pytest.warns(RuntimeWarning, match="FLA_DISABLE_BACKEND_DISPATCH"):
        fla_backend.register()
    assert "flash_kda" in fake.registries["kda"]
