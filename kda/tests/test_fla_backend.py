"""flash_kda.fla_backend without fla and without a GPU (CPU; runs in CI).

- The verifiers (``unsupported`` for fla 0.6's ``fused_recurrent_kda_fwd``, ``chunk_unsupported`` for its
  ``chunk_kda``) take exactly the calls that ``flash_kda.fwd`` computes (both gates, negative eigenvalues, grouped
  value heads, A_log or dt_bias None, either state dtype, varlen) and name the reason for every other one (the
  kernel's device check is stubbed, so CPU tensors stand in for CUDA ones; ``kernel_device`` itself is tested with
  a stubbed capability).
- The argument mappings (``fused_recurrent_kda_fwd`` and ``chunk_kda``, run on the CPU path): fla's return
  conventions (out, final state in place / new fp32 / None), the flat ``dt_bias``, the pool with a 1-D
  ``ssm_state_indices``, the gate fla picks from ``lower_bound``, strided inputs to chunk_kda; equal bit for bit to
  a direct ``flash_kda.fwd`` call, and close to a float64 re-enactment of fla's kernels (its index rules included).
- ``register()``: importing flash_kda imports no fla; a missing or too old fla is named; against a stand-in of
  fla 0.6's ``fla.backends`` (fla itself needs triton) it registers one backend of type "flash_kda" for the "kda"
  operation and one for ``chunk_kda``, replacing fla's own backend for this package there, and a second call
  leaves one of each.
GPU tests with the real fla: test_fla_recurrent.py, test_fla_layer.py.
"""

from __future__ import annotations

import sys
import types

import fresh_process
import pytest
import torch

import flash_kda
from flash_kda import fla_backend

D = 128
LOWER_BOUND = -5.0
FLAGS = dict(state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
             use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)


def fla_args(*, B=1, T=4, H=2, G=1, seqlens=None, state=torch.float32, pool=None, index_dtype=torch.int32,
             seed=0, **changes) -> dict:
    """Keyword arguments of a supported fused_recurrent_kda_fwd call on CPU tensors (fla's layouts: flat
    dt_bias; H key heads and G·H value heads; with ``pool=P``, one token per sequence, a pool [P, HV, V, K] and a
    1-D slot permutation, in place)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    N, cu = B, None
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64)
    HV = G * H
    x = dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, HV, D), g=randn(B, T, HV, D), beta=randn(B, T, HV),
        A_log=randn(HV, dtype=torch.float32), dt_bias=randn(HV * D, dtype=torch.float32), cu_seqlens=cu,
        initial_state=None if state is None else randn(N if pool is None else pool, HV, D, D, dtype=state),
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
    # The model options: the softplus gate (lower_bound None), negative eigenvalues, grouped value heads.
    "softplus_gate": dict(lower_bound=None),
    "softplus_gate_neg_eigval": dict(lower_bound=None, allow_neg_eigval=True),
    "lower_bound_neg_eigval": dict(allow_neg_eigval=True),
    "lower_bound_without_A_log": dict(A_log=None),
    "without_dt_bias": dict(dt_bias=None),
    "softplus_without_dt_bias": dict(lower_bound=None, dt_bias=None),
    "gva_2": dict(G=2),
    "gva_4_softplus_varlen_bf16_state": dict(G=4, seqlens=(3, 0, 5), lower_bound=None, state=torch.bfloat16),
    "gva_pool": dict(G=2, B=5, T=1, pool=8, lower_bound=None, allow_neg_eigval=True),
    "gva_out_given": dict(G=2, out=torch.empty(1, 4, 4, D, dtype=torch.bfloat16)),
    # A decode batch padded to a CUDA graph's size: empty sequences, padding tokens past cu_seqlens[-1].
    "pool_padded_graph_batch": dict(seqlens=(1, 1, 1, 1), pool=4, cu_seqlens=torch.tensor([0, 1, 2, 2, 2])),
    "pool_empty_sequence": dict(seqlens=(1, 0, 1), pool=4),
    "padding_tokens_past_cu_seqlens": dict(seqlens=(3, 0, 5), cu_seqlens=torch.tensor([0, 3, 3, 6])),
    # Per-token slots [N, L] (speculative decoding), with and without num_accepted_tokens.
    "indices_2d": dict(B=2, T=1, pool=4, ssm_state_indices=torch.tensor([[0], [1]])),
    "spec_decoding_fixed": dict(B=2, T=3, pool=8, ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                                num_accepted_tokens=torch.tensor([2, 3], dtype=torch.int32)),
    "spec_decoding_varlen_softplus": dict(seqlens=(3, 1), pool=8, lower_bound=None,
                                          ssm_state_indices=torch.tensor([[0, 1, 2, 6], [3, 4, 5, 7]]),
                                          num_accepted_tokens=torch.tensor([1, 4])),
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
    x = fla_args(A_log=None, lower_bound=None)
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
    "softplus_without_A_log": (dict(lower_bound=None, A_log=None), "needs A_log"),
    "lower_bound_below_range": (dict(lower_bound=-6.0), "lower_bound"),
    "lower_bound_above_range": (dict(lower_bound=0.5), "lower_bound"),
    "lower_bound_nan": (dict(lower_bound=float("nan")), "lower_bound"),
    "lower_bound_bool": (dict(lower_bound=False), "lower_bound"),
    "scale_inf": (dict(scale=float("inf")), "scale"),
    "scale_past_fp32": (dict(scale=1e39), "scale"),
    "spec_decoding": (dict(B=2, T=1, pool=4, num_accepted_tokens=torch.ones(2, dtype=torch.int32)),
                      "num_accepted_tokens"),
    "unknown_argument": (dict(chunk_size=64), "chunk_size"),
    "in_place_without_state": (dict(state=None, inplace_final_state=True), "initial_state"),
    "indices_not_in_place": (dict(B=2, T=1, pool=4, inplace_final_state=False), "inplace_final_state"),
    "indices_2d_wrong_rows": (dict(B=2, T=1, pool=4, ssm_state_indices=torch.tensor([[0, 1]])), "N = 2 rows"),
    "num_accepted_wrong_shape": (dict(B=2, T=3, pool=8, ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                                      num_accepted_tokens=torch.ones(3, dtype=torch.int32)), "num_accepted_tokens"),
    "num_accepted_float": (dict(B=2, T=3, pool=8, ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                                num_accepted_tokens=torch.ones(2)), "num_accepted_tokens"),
    "indices_multi_token_fixed": (dict(B=2, T=3, pool=4), "one token per sequence"),
    "indices_multi_token_varlen": (dict(seqlens=(2, 1), pool=4), "one token per sequence"),
    # (T = N: only the contents say that sequence 0 has two tokens, where fla would write slot [n + t])
    "indices_multi_token_beside_empty": (dict(seqlens=(2, 0, 1), pool=4), "a sequence of 2 tokens"),
    "indices_float": (dict(B=2, T=1, pool=4, ssm_state_indices=torch.tensor([0.0, 1.0])), "ssm_state_indices"),
    "indices_list": (dict(B=2, T=1, pool=4, ssm_state_indices=[0, 1]), "ssm_state_indices must be a tensor"),
    "num_accepted_list": (dict(B=2, T=3, pool=8, ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]]),
                               num_accepted_tokens=[1, 2]), "num_accepted_tokens must be a tensor"),
    "q_fp32": (dict(q=torch.zeros(1, 4, 2, D)), "q must be bfloat16"),
    "beta_fp32": (dict(beta=torch.zeros(1, 4, 2)), "beta must be bfloat16"),
    "state_fp16": (dict(state=torch.float16), "initial_state"),
    "out_fp32": (dict(out=torch.empty(1, 4, 2, D)), "out must be bfloat16"),
    "params_fp64": (dict(A_log=torch.zeros(2, dtype=torch.float64)), "A_log"),
    "cu_seqlens_float": (dict(seqlens=(2, 2), cu_seqlens=torch.tensor([0.0, 2.0, 4.0])), "cu_seqlens"),
    "head_dim_64": (dict(q=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)), "q must be"),
    "value_dim_64": (dict(v=torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)), "v must be"),
    "value_heads_not_a_multiple": (dict(G=2, q=torch.zeros(1, 4, 3, D, dtype=torch.bfloat16),
                                        k=torch.zeros(1, 4, 3, D, dtype=torch.bfloat16)), "multiple"),
    "fewer_value_heads": (dict(v=torch.zeros(1, 4, 1, D, dtype=torch.bfloat16)), "multiple"),
    "k_heads_differ": (dict(k=torch.zeros(1, 4, 1, D, dtype=torch.bfloat16)), "k must have"),
    "gva_g_on_key_heads": (dict(G=2, g=torch.zeros(1, 4, 2, D, dtype=torch.bfloat16)), "g must be"),
    "gva_beta_on_key_heads": (dict(G=2, beta=torch.zeros(1, 4, 2, dtype=torch.bfloat16)), "beta must be"),
    "gva_A_log_on_key_heads": (dict(G=2, A_log=torch.zeros(2)), "A_log must be"),
    "gva_state_on_key_heads": (dict(G=2, initial_state=torch.zeros(1, 2, D, D)), "initial_state must be"),
    "gva_out_on_key_heads": (dict(G=2, out=torch.empty(1, 4, 2, D, dtype=torch.bfloat16)), "out must have"),
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
    """fla calls ``<function>_verifier`` and expects (accepted, reason); other functions of a registry find no
    method and pass on."""
    cls = fla_backend._backend_class(_FakeFla().BaseBackend)
    backend = cls()
    assert backend.fused_recurrent_kda_fwd_verifier(**fla_args()) == (True, None)
    accepted, reason = backend.fused_recurrent_kda_fwd_verifier(**fla_args(use_gate_in_kernel=False))
    assert accepted is False and "use_gate_in_kernel" in reason
    assert backend.chunk_kda_verifier(**chunk_args()) == (True, None)
    accepted, reason = backend.chunk_kda_verifier(**chunk_args(cp_context=object()))
    assert accepted is False and "cp_context" in reason
    assert getattr(backend, "chunk_kda_fwd_intra", None) is None
    assert getattr(backend, "chunk_kda_fwd_intra_verifier", None) is None


# --- the chunk_kda verifier -------------------------------------------------------------------------------------

CHUNK_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   state_v_first=True)


def chunk_args(*, B=1, T=5, H=2, G=1, seqlens=None, state=torch.float32, seed=0, **changes) -> dict:
    """Keyword arguments of a supported chunk_kda call on CPU tensors as fla's KimiDeltaAttention layer makes it
    with its default config (the softplus gate: no lower_bound, no safe_gate; flat dt_bias; A_log and dt_bias as
    keywords), with H key heads and G·H value heads."""
    x = fla_args(B=B, T=T, H=H, G=G, seqlens=seqlens, state=state, seed=seed)
    x = {name: x[name] for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")}
    x.update(output_final_state=True, lower_bound=None, **CHUNK_FLAGS)
    x.update(changes)
    return x


CHUNK_ACCEPTED = {
    "softplus_default_layer": dict(),
    "softplus_no_state": dict(state=None, output_final_state=False),
    "softplus_bf16_state": dict(state=torch.bfloat16),
    "softplus_no_final_state": dict(output_final_state=False),
    "softplus_without_dt_bias": dict(dt_bias=None),
    "softplus_scale_given": dict(scale=0.1),
    "neg_eigval": dict(allow_neg_eigval=True),
    "gva_2": dict(G=2),
    "gva_4_neg_eigval_varlen": dict(G=4, seqlens=(3, 0, 6), allow_neg_eigval=True),
    "varlen_int32_cu_seqlens_on_cpu": dict(seqlens=(2, 3), cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32)),
    "safe_gate_lower_bound": dict(safe_gate=True, lower_bound=-5.0),
    "lower_bound_without_safe_gate": dict(lower_bound=-1.0),
    "lower_bound_0_without_safe_gate": dict(lower_bound=0),
    "lower_bound_without_A_log": dict(safe_gate=True, lower_bound=-5.0, A_log=None),
    "lower_bound_gva_neg_eigval": dict(G=2, safe_gate=True, lower_bound=-5.0, allow_neg_eigval=True),
    "bf16_params": dict(A_log=torch.zeros(2, dtype=torch.bfloat16), dt_bias=torch.zeros(2 * D, dtype=torch.half)),
    "dt_bias_2d": dict(dt_bias=torch.zeros(2, D)),
    "chunk_size_32": dict(chunk_size=32),
    "disable_recompute": dict(disable_recompute=True),
    "cu_seqlens_cpu_hint": dict(seqlens=(2, 3), cu_seqlens_cpu=torch.tensor([0, 2, 5])),
    "use_graph": dict(seqlens=(2, 3, 0), use_graph=True, max_num_seqs=3),
    "transpose_state_layout": dict(state_v_first=False, transpose_state_layout=True),
    "strided_q": dict(q=torch.zeros(1, 2, 5, D, dtype=torch.bfloat16).transpose(1, 2)),
    "unaligned_g": dict(g=torch.zeros(1 * 5 * 2 * D + 1, dtype=torch.bfloat16)[1:].view(1, 5, 2, D)),
    "grad_inputs_without_grad_mode": dict(),  # (run under torch.no_grad below)
}


@pytest.mark.parametrize("case", list(CHUNK_ACCEPTED), ids=list(CHUNK_ACCEPTED))
def test_chunk_verifier_accepts(case, any_device):
    x = chunk_args(**CHUNK_ACCEPTED[case])
    if case == "grad_inputs_without_grad_mode":
        x["A_log"].requires_grad_(True)  # (a layer's parameter, under torch.no_grad: inference)
        with torch.no_grad():
            assert fla_backend.chunk_unsupported(**x) is None
        return
    assert fla_backend.chunk_unsupported(**x) is None


def test_chunk_verifier_reads_positional_arguments_in_fla_order(any_device):
    x = chunk_args()
    names = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
             "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound")
    x.update(scale=None, allow_neg_eigval=False, safe_gate=False)
    positional = tuple(x.pop(n) for n in names)
    assert fla_backend.chunk_unsupported(*positional, **x) is None
    assert "needs A_log" in fla_backend.chunk_unsupported(*positional, **{**x, "A_log": None})


CHUNK_REFUSED = {  # case: (changes to the supported call, words of the reason)
    "cp_context": (dict(cp_context=object()), "cp_context"),
    "intermediate_states": (dict(return_intermediate_states=True), "return_intermediate_states"),
    "state_k_first": (dict(state_v_first=False), "state_v_first"),
    "both_state_layout_names": (dict(transpose_state_layout=True), "transpose_state_layout"),
    "no_l2norm": (dict(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel"),
    "no_gate_in_kernel": (dict(use_gate_in_kernel=False), "use_gate_in_kernel"),
    "no_beta_sigmoid": (dict(use_beta_sigmoid_in_kernel=False), "use_beta_sigmoid_in_kernel"),
    "softplus_without_A_log": (dict(A_log=None), "needs A_log"),
    "safe_gate_without_lower_bound": (dict(safe_gate=True), "safe_gate"),
    "safe_gate_lower_bound_0": (dict(safe_gate=True, lower_bound=0.0), "safe_gate"),
    "lower_bound_below_range": (dict(lower_bound=-6.0), "lower_bound"),
    "lower_bound_nan": (dict(lower_bound=float("nan")), "lower_bound"),
    "scale_inf": (dict(scale=float("inf")), "scale"),
    "chunk_size_16": (dict(chunk_size=16), "chunk_size"),
    "chunk_size_tensor": (dict(chunk_size=torch.tensor([64, 32])), "chunk_size"),
    "unknown_argument": (dict(head_first=True), "head_first"),
    "use_graph_other_max_num_seqs": (dict(seqlens=(2, 3), use_graph=True, max_num_seqs=4), "max_num_seqs"),
    "q_fp32": (dict(q=torch.zeros(1, 5, 2, D)), "q must be bfloat16"),
    "state_fp16": (dict(state=torch.float16), "initial_state"),
    "params_fp64": (dict(dt_bias=torch.zeros(2 * D, dtype=torch.float64)), "dt_bias"),
    "head_dim_64": (dict(q=torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)), "q must be"),
    "value_dim_64": (dict(v=torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16)), "v must be"),
    "value_heads_not_a_multiple": (dict(v=torch.zeros(1, 5, 3, D, dtype=torch.bfloat16)), "multiple"),
    "gva_g_on_key_heads": (dict(G=2, g=torch.zeros(1, 5, 2, D, dtype=torch.bfloat16)), "g must be"),
    "gva_dt_bias_on_key_heads": (dict(G=2, dt_bias=torch.zeros(2 * D)), "dt_bias must be"),
    "headwise_beta": (dict(beta=torch.zeros(1, 5, 2, D, dtype=torch.bfloat16)), "beta must be"),
    "state_wrong_n": (dict(initial_state=torch.zeros(3, 2, D, D)), "initial_state must be"),
    "varlen_batch_2": (dict(B=2, cu_seqlens=torch.tensor([0, 5, 10])), "B = 1"),
}


@pytest.mark.parametrize("case", list(CHUNK_REFUSED), ids=list(CHUNK_REFUSED))
def test_chunk_verifier_refuses_with_reason(case, any_device):
    changes, words = CHUNK_REFUSED[case]
    reason = fla_backend.chunk_unsupported(**chunk_args(**changes))
    assert reason is not None and words in reason, f"{case}: {reason=}"


@pytest.mark.parametrize("name", ["q", "A_log", "initial_state"])
def test_chunk_verifier_refuses_grad_tracking_inputs(name, any_device):
    """Training (grad enabled, an input or a layer parameter requiring grad) runs fla's kernels."""
    x = chunk_args()
    x[name].requires_grad_(True)
    with torch.enable_grad():
        reason = fla_backend.chunk_unsupported(**x)
    assert reason is not None and f"{name} requires grad" in reason


def test_chunk_verifier_refuses_other_devices():
    assert "CUDA" in fla_backend.chunk_unsupported(**chunk_args())  # CPU tensors: fla's Triton kernels' business


# --- the mapping (CPU path) ----------------------------------------------------------------------------------


def fla_semantics(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state, inplace_final_state,
                  cu_seqlens, lower_bound, scale=None, ssm_state_indices=None, allow_neg_eigval=False, **flags):
    """float64 re-enactment of fla 0.6's KDA kernels (fused_recurrent_kda_fwd's token loop; chunk_kda computes the
    same recurrence) with state_v_first and the in-kernel norm, gate and beta sigmoid: (out, final_state),
    final_state as fla returns it (the pool itself, updated, in place). The gate is fla's choice: lower_bound given,
    lower_bound·sigmoid(a·(g + dt_bias)), else −a·softplus(g + dt_bias), with a = exp(A_log) (1 without A_log); β is
    2·sigmoid with allow_neg_eigval; value head hv reads key head hv // (HV / H). With a 1-D ssm_state_indices fla
    reads slot [n] and, after token i of sequence n, writes slot [n + i] (a slot per sequence for one token per
    sequence)."""
    f64 = torch.float64
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    bounds = [(n * T, n * T + T) for n in range(B)] if cu_seqlens is None else list(
        zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    q, k = (x.reshape(B * T, H, K).to(f64).repeat_interleave(HV // H, dim=1) for x in (q, k))
    v, g, beta = (x.reshape(B * T, *x.shape[2:]).to(f64) for x in (v, g, beta))
    a = A_log.to(f64).exp().view(HV, 1) if A_log is not None else torch.ones(HV, 1, dtype=f64)
    bias = dt_bias.to(f64).reshape(HV, K) if dt_bias is not None else torch.zeros(HV, K, dtype=f64)
    beta_scale = 2.0 if allow_neg_eigval else 1.0
    scale = K**-0.5 if scale is None else scale
    out = torch.zeros(B * T, HV, V, dtype=f64)
    if inplace_final_state:
        final = initial_state
    elif output_final_state:
        final = torch.zeros(len(bounds), HV, V, K, dtype=torch.float32)
    else:
        final = None

    def unit(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def log_decay(x):
        if lower_bound is not None:
            return lower_bound * torch.sigmoid(a * (x + bias))
        return -a * torch.nn.functional.softplus(x + bias)

    states = initial_state.clone() if initial_state is not None else None
    for n, (bos, eos) in enumerate(bounds):
        slot = n if ssm_state_indices is None else int(ssm_state_indices[n])
        S = torch.zeros(HV, V, K, dtype=f64) if states is None else states[slot].to(f64)
        for t in range(bos, eos):
            kt, qt = unit(k[t]), unit(q[t]) * scale
            S = S * torch.exp(log_decay(g[t])).unsqueeze(1)
            r = (v[t] - (S @ kt.unsqueeze(-1)).squeeze(-1)) * (beta_scale * torch.sigmoid(beta[t])).unsqueeze(-1)
            S = S + r.unsqueeze(-1) * kt.unsqueeze(1)
            out[t] = (S @ qt.unsqueeze(-1)).squeeze(-1)
            if ssm_state_indices is not None:
                final[int(ssm_state_indices[n + t - bos])] = S.to(final.dtype)
        if ssm_state_indices is None and final is not None:
            final[n] = S.to(final.dtype)
    return out.view(B, T, HV, V), final


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def _direct(x: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same call made to flash_kda.fwd by hand (fla's flat dt_bias as [HV, K], the gate from lower_bound)."""
    HV = x["v"].shape[2]
    init = x.get("initial_state")
    out = torch.empty_like(x["v"])
    N = x["q"].shape[0] if x.get("cu_seqlens") is None else x["cu_seqlens"].numel() - 1
    if x.get("inplace_final_state"):
        final = init
    elif x["output_final_state"]:
        final = torch.empty(N, HV, D, D, dtype=torch.float32)
    else:
        final = None
    dt_bias = None if x.get("dt_bias") is None else x["dt_bias"].contiguous().view(HV, D)
    lower_bound = x.get("lower_bound")
    flash_kda.fwd(x["q"].contiguous(), x["k"].contiguous(), x["v"].contiguous(), x["g"].contiguous(),
                  x["beta"].contiguous(), x.get("scale") or D**-0.5, out, x.get("A_log"), dt_bias,
                  lower_bound, initial_state=init, final_state=final, cu_seqlens=x.get("cu_seqlens"),
                  state_indices=x.get("ssm_state_indices"), gate="softplus" if lower_bound is None else "lower_bound",
                  allow_neg_eigval=x.get("allow_neg_eigval", False))
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
    "softplus": dict(B=2, T=3, lower_bound=None),
    "softplus_neg_eigval_without_dt_bias": dict(seqlens=(3, 0, 5), lower_bound=None, allow_neg_eigval=True,
                                                dt_bias=None),
    "lower_bound_neg_eigval_without_A_log": dict(B=2, T=3, allow_neg_eigval=True, A_log=None),
    "gva_2_softplus": dict(G=2, B=2, T=3, lower_bound=None),
    "gva_4_in_place": dict(G=4, B=2, T=2, state=torch.bfloat16, inplace_final_state=True),
    "gva_2_pool_softplus_neg_eigval": dict(G=2, B=5, T=1, pool=7, lower_bound=None, allow_neg_eigval=True),
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
        assert final.dtype == torch.float32 and final.shape == (N, x["v"].shape[2], D, D)
    else:
        assert final is None
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        if x[name] is not None:
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


CHUNK_MAPPED = {
    "softplus_fp32_state": dict(B=2, T=20),
    "softplus_bf16_state": dict(B=2, T=20, state=torch.bfloat16),
    "softplus_varlen_no_state": dict(seqlens=(7, 0, 19), state=None),
    "softplus_no_final_state": dict(output_final_state=False),
    "neg_eigval_without_dt_bias": dict(T=20, allow_neg_eigval=True, dt_bias=None),
    "gva_2": dict(G=2, B=2, T=20),
    "gva_4_neg_eigval_varlen": dict(G=4, seqlens=(5, 16), allow_neg_eigval=True, state=torch.bfloat16),
    "safe_gate": dict(T=20, safe_gate=True, lower_bound=-5.0),
    "lower_bound_without_A_log_scale_given": dict(T=20, lower_bound=-2.0, A_log=None, scale=0.05),
    "int32_cu_seqlens": dict(seqlens=(5, 16), cu_seqlens=torch.tensor([0, 5, 21], dtype=torch.int32)),
}


@pytest.mark.parametrize("case", list(CHUNK_MAPPED), ids=list(CHUNK_MAPPED))
def test_chunk_mapping_follows_fla_contract(case, any_device):
    x = chunk_args(**CHUNK_MAPPED[case])
    assert fla_backend.chunk_unsupported(**x) is None
    before = _copy(x)
    out, final = fla_backend.chunk_kda(**_copy(x))

    # fla's return convention: out like v (bf16), final_state a new fp32 [N, HV, V, K] tensor or None
    assert out.dtype == torch.bfloat16 and out.shape == x["v"].shape
    N = x["q"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    if x["output_final_state"]:
        assert final.dtype == torch.float32 and final.shape == (N, x["v"].shape[2], D, D)
    else:
        assert final is None

    direct_out, direct_final = _direct(_copy(x))
    assert torch.equal(out, direct_out)
    if final is not None:
        assert torch.equal(final, direct_final)

    fla_out, fla_final = fla_semantics(**{**before, "inplace_final_state": False, "output_final_state": True})
    assert _rel_l2(out, fla_out) <= BF16_BOUND
    if final is not None:
        assert _rel_l2(final, fla_final) <= FP32_STATE_BOUND


def test_chunk_mapping_copies_strided_and_unaligned_inputs(any_device):
    """chunk_kda takes any strides (fla's own path does): the call runs on dense copies, with the bits of a call on
    contiguous tensors, and leaves the inputs as they were."""
    x = chunk_args(B=2, T=20, G=2)
    strided = dict(x)
    for name in ("q", "v"):  # [B, T, H, D] stored as [B, H, T, D]
        strided[name] = x[name].transpose(1, 2).contiguous().transpose(1, 2)
    storage = torch.empty(x["g"].numel() + 1, dtype=torch.bfloat16)
    strided["g"] = storage[1:].view_as(x["g"])
    strided["g"].copy_(x["g"])
    strided["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not strided["q"].is_contiguous() and not strided["initial_state"].is_contiguous()
    assert fla_backend.chunk_unsupported(**strided) is None
    out, final = fla_backend.chunk_kda(**strided)
    dense_out, dense_final = fla_backend.chunk_kda(**_copy(x))
    assert torch.equal(out, dense_out) and torch.equal(final, dense_final)
    assert torch.equal(strided["g"], x["g"]) and torch.equal(strided["q"], x["q"])


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


def test_mapping_padding_tokens_get_zero_rows(any_device):
    """Padding tokens past cu_seqlens[-1] (a decode batch padded to a CUDA graph's size, empty padding sequences
    with no slot): the sequences' rows and slots are those of the call without the padding, the padding tokens' out
    rows zeros (as fla's kernel leaves them)."""
    x = fla_args(seqlens=(1, 1, 1, 1), pool=6, cu_seqlens=torch.tensor([0, 1, 2, 2, 2]))
    x["ssm_state_indices"] = torch.tensor([4, 1, -1, -1], dtype=torch.int32)
    plain = {**_copy(x), "cu_seqlens": torch.tensor([0, 1, 2])}
    plain["ssm_state_indices"] = x["ssm_state_indices"][:2].clone()
    for name in ("q", "k", "v", "g", "beta"):
        plain[name] = x[name][:, :2].contiguous()
    out, pool = fla_backend.fused_recurrent_kda_fwd(**x)
    plain_out, plain_pool = fla_backend.fused_recurrent_kda_fwd(**plain)
    assert torch.equal(out[:, :2], plain_out) and torch.equal(pool, plain_pool)
    assert torch.equal(out[:, 2:], torch.zeros_like(out[:, 2:]))


def test_verifier_refuses_inference_tensors_written_outside_inference_mode(any_device):
    """fwd refuses to write an inference tensor outside inference mode (PyTorch would): fla's kernel takes it."""
    with torch.inference_mode():
        x = fla_args(B=2, T=1, pool=4)
        given = torch.empty_like(x["v"])
    with torch.no_grad():
        assert "initial_state is an inference tensor" in fla_backend.unsupported(**x)
        fresh = fla_args(B=2, T=1, pool=4)
        assert "out is an inference tensor" in fla_backend.unsupported(**fresh, out=given)
    with torch.inference_mode():
        assert fla_backend.unsupported(**x) is None


# --- registration --------------------------------------------------------------------------------------------


def test_importing_flash_kda_imports_no_fla():
    code = ("import sys, flash_kda, flash_kda.fla_backend; "
            "loaded = sorted(m for m in sys.modules if m == 'fla' or m.startswith('fla.')); "
            "assert not loaded, loaded; print('fresh process ok')")
    fresh_process.assert_fresh_process_ok(code)


def test_register_without_fla_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla raises ImportError
    with pytest.raises(ImportError, match=r"needs fla \(pip install flash-linear-attention>=0.6\)"):
        fla_backend.register()


def test_mapping_gva_padding_slot_starts_from_zeros(any_device):
    """The pool rule with grouped value heads: every value head of a padding row starts from zeros."""
    x = fla_args(G=2, B=3, T=1, pool=4, lower_bound=None)
    x["ssm_state_indices"] = torch.tensor([2, -1, 0], dtype=torch.int32)
    pool = x["initial_state"].clone()
    out, final = fla_backend.fused_recurrent_kda_fwd(**x)
    assert torch.equal(final[[1, 3]], pool[[1, 3]])
    alone = fla_args(G=2, B=3, T=1, state=None, inplace_final_state=False, output_final_state=False, lower_bound=None)
    alone_out, _ = fla_backend.fused_recurrent_kda_fwd(**alone)
    assert torch.equal(out[1], alone_out[1])


class _FakeFla:
    """A stand-in for fla 0.6's package: ``fla.backends`` with BaseBackend and register (one backend per type
    per operation name or dispatched function, as fla keeps them; a function fla does not dispatch has no
    registry: KeyError), the modules of the dispatched functions, and fla's own chunk_kda backend for this package,
    registered as importing ``fla.ops.kda`` registers it."""

    class OwnChunkBackend:  # fla.ops.kda.backends.flash_kda.FlashKDABackend's registration, in short
        backend_type = "flash_kda"
        priority = 3
        verifier = None

    def __init__(self, *, version="0.6.0", backends=True, register=True, dispatch_disabled=False,
                 chunk_dispatched=True):
        self.fla = types.ModuleType("fla")
        self.fla.__version__ = version
        self.modules = {"fla": self.fla, "fla.backends": None}

        def chunk_kda(*args, **kwargs):
            return None

        self.chunk_kda = chunk_kda
        self.registries: dict[object, dict[str, object]] = {}
        if chunk_dispatched:
            self.registries[chunk_kda] = {"flash_kda": self.OwnChunkBackend()}
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
                        if dispatch_disabled and not isinstance(entry_point, str):
                            return implementation
                        instance = implementation()
                        instance.verifier = verifier
                        if isinstance(entry_point, str):
                            registry = self.registries.setdefault(entry_point, {})
                        else:
                            registry = self.registries[entry_point]  # KeyError: not a dispatched function
                        registry[instance.backend_type] = instance
                        return implementation

                    return decorator

                mod.register = register_
            self.BaseBackend = BaseBackend
            self.fla.backends = mod
            self.modules["fla.backends"] = mod
        recurrent = types.ModuleType(fla_backend._FLA_MODULE)
        recurrent.fused_recurrent_kda_fwd = lambda *args, **kwargs: None
        chunk = types.ModuleType(fla_backend._FLA_CHUNK_MODULE)
        chunk.chunk_kda = chunk_kda
        own = types.ModuleType(fla_backend._FLA_OWN_BACKEND_MODULE)
        self.modules.update({"fla.ops": types.ModuleType("fla.ops"), "fla.ops.kda": types.ModuleType("fla.ops.kda"),
                             fla_backend._FLA_MODULE: recurrent, fla_backend._FLA_CHUNK_MODULE: chunk,
                             fla_backend._FLA_OWN_BACKEND_MODULE: own})

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


def test_register_with_fla_not_dispatching_chunk_kda_registers_nothing(monkeypatch):
    fake = _FakeFla(version="0.6.x", chunk_dispatched=False).install(monkeypatch)
    with pytest.raises(ImportError, match=r"fla 0.6.x does not dispatch fla.ops.kda.chunk.chunk_kda"):
        fla_backend.register()
    assert fake.registries == {}


def test_register_adds_one_backend_each_and_twice_is_harmless(monkeypatch):
    fake = _FakeFla().install(monkeypatch)
    assert isinstance(fake.registries[fake.chunk_kda]["flash_kda"], _FakeFla.OwnChunkBackend)
    fla_backend.register()
    fla_backend.register()
    assert set(fake.registries) == {"kda", fake.chunk_kda}
    for entry_point in ("kda", fake.chunk_kda):
        assert list(fake.registries[entry_point]) == ["flash_kda"]  # fla's own chunk_kda backend replaced
        backend = fake.registries[entry_point]["flash_kda"]
        assert isinstance(backend, fake.BaseBackend)
        assert (backend.priority, backend.env_var, backend.package_name, backend.verifier) == (
            3, "FLA_FLASH_KDA", None, None)
        assert callable(backend.fused_recurrent_kda_fwd) and callable(backend.fused_recurrent_kda_fwd_verifier)
        assert callable(backend.chunk_kda) and callable(backend.chunk_kda_verifier)


def test_register_warns_when_fla_dispatch_is_disabled(monkeypatch):
    fake = _FakeFla(dispatch_disabled=True).install(monkeypatch)
    with pytest.warns(RuntimeWarning, match="FLA_DISABLE_BACKEND_DISPATCH"):
        fla_backend.register()
    assert "flash_kda" in fake.registries["kda"]
