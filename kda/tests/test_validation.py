"""Every validation error of ``flash_kda.fwd`` and its helpers, checked by type and message (CPU; runs in CI).

fwd validates in the order arch → dtype → device → layout → shape → scalar values; each message names the
argument and shows its offending value. The arch check is exercised by monkeypatching the capability seam.
The model options (gate, allow_neg_eigval, grouped value heads, absent A_log / dt_bias) are validated here too;
their computation is checked in test_cpu_path and test_reference.
"""

from __future__ import annotations

import math
import re
import warnings

import fresh_process
import numpy as np
import pytest
import torch

import flash_kda
from flash_kda import compare, planning, reference, testing, validation

B, T, H, D = 1, 5, 2, 128
N = 1


def inputs(*, B: int = B, T: int = T, H: int = H, state: torch.dtype | None = torch.float32, G: int = 1) -> dict:
    """A valid tiny CPU argument set for flash_kda.fwd (G > 1: grouped value heads, H key heads, G·H value heads)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype)

    n = B
    HV = G * H
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, HV, D), g=randn(B, T, HV, D),
        beta=randn(B, T, HV), scale=D**-0.5, out=torch.empty(B, T, HV, D, dtype=torch.bfloat16),
        A_log=randn(HV, dtype=torch.float32), dt_bias=randn(HV, D, dtype=torch.float32), lower_bound=-5.0,
        initial_state=None if state is None else randn(n, HV, D, D, dtype=state),
        final_state=None if state is None else torch.empty(n, HV, D, D, dtype=state),
        cu_seqlens=None,
    )  # fmt: skip


def varlen_inputs(seqlens=(2, 0, 3), cu_dtype=torch.int64) -> dict:
    x = inputs(T=sum(seqlens))
    n = len(seqlens)
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + s)
    x["cu_seqlens"] = torch.tensor(cu, dtype=cu_dtype)
    x["initial_state"] = torch.randn(n, H, D, D)
    x["final_state"] = torch.empty(n, H, D, D)
    return x


def raises(exc: type[Exception], pattern: str, **changes):
    """Calls fwd with the valid inputs changed as given and asserts exc with a message matching pattern."""
    x = {**inputs(), **changes}
    with pytest.raises(exc, match=pattern):
        flash_kda.fwd(**x)


# --- arch ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0), (9, 1)])
def test_arch_other_than_sm90_is_refused(monkeypatch, capability):
    monkeypatch.setattr(validation, "device_capability", lambda device: capability)
    with pytest.raises(RuntimeError, match=re.escape(f"capability {capability}")) as info:
        validation.check_arch(torch.device("cuda", 1))
    assert "cuda:1" in str(info.value) and "sm_90a" in str(info.value)


def test_arch_sm90_is_accepted(monkeypatch):
    monkeypatch.setattr(validation, "device_capability", lambda device: (9, 0))
    validation.check_arch(torch.device("cuda", 0))


def test_arch_is_not_checked_for_cpu_tensors(monkeypatch):
    def boom(device):
        raise AssertionError("capability queried for CPU tensors")

    monkeypatch.setattr(validation, "device_capability", boom)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        flash_kda.fwd(**{**inputs(), "q": inputs()["q"].float()})


@pytest.mark.gpu
def test_arch_checked_first_on_cuda(monkeypatch):
    """On a CUDA device reporting another capability, fwd refuses before any other check."""
    monkeypatch.setattr(validation, "device_capability", lambda device: (8, 0))
    x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in inputs().items()}
    x["k"] = x["k"].float()  # a dtype error too: arch must win
    with pytest.raises(RuntimeError, match=r"capability \(8, 0\)"):
        flash_kda.fwd(**x)


# --- dtype -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "out"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bf16_arguments(name, dtype):
    raises(TypeError, rf"{name} must be bfloat16, got {name}.dtype=torch.{str(dtype)[6:]}", **{name: inputs()[name].to(dtype)})


@pytest.mark.parametrize("name", ["A_log", "dt_bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_gate_parameter_dtypes(name, dtype):
    raises(TypeError, rf"{name} must be float32, bfloat16 or float16, got {name}.dtype=torch.{str(dtype)[6:]}",
           **{name: inputs()[name].to(dtype)})  # fmt: skip


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
def test_state_dtype(name):
    raises(TypeError, rf"{name} must be bfloat16 or float32, got {name}.dtype=torch.float16", **{name: inputs()[name].half()})


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("init, final", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_mixed_dtypes_equal_the_widened_call(init, final, param_dtype):
    """What fla and bf16 models hand over: a bf16 initial state with an fp32 final state (and the reverse), and
    bf16 / fp16 A_log and dt_bias. The call equals the one with fp32 parameters holding the same values (the
    CPU path here; on the GPU the mixed-dtype matrix cases check the kernel against the twin)."""
    x = inputs()
    x["A_log"], x["dt_bias"] = x["A_log"].to(param_dtype), x["dt_bias"].to(param_dtype)
    x["initial_state"] = x["initial_state"].to(init)
    x["final_state"] = torch.full(x["final_state"].shape, float("nan"), dtype=final)
    flash_kda.fwd(**x)
    y = dict(x, A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(), initial_state=x["initial_state"].float(),
             out=torch.empty_like(x["out"]), final_state=torch.empty(x["final_state"].shape))
    flash_kda.fwd(**y)
    assert torch.equal(x["out"], y["out"])
    assert torch.equal(x["final_state"], y["final_state"].to(final))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8])
def test_cu_seqlens_dtype(dtype):
    x = varlen_inputs()
    x["cu_seqlens"] = x["cu_seqlens"].to(dtype)
    with pytest.raises(TypeError, match=rf"cu_seqlens must be int64 or int32, got cu_seqlens.dtype=torch.{str(dtype)[6:]}"):
        flash_kda.fwd(**x)


def test_not_a_tensor():
    raises(TypeError, r"q must be a torch.Tensor or None, got type\(t\)=<class 'list'>", q=[1.0])


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "out"])
def test_required_arguments(name):
    raises(TypeError, rf"{name} is required, got {name}=None", **{name: None})


# --- device ----------------------------------------------------------------------------------------------


def test_meta_device_is_refused():
    x = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in inputs().items()}
    with pytest.raises(ValueError, match=r"tensors must be on a CUDA or CPU device, got q.device=device\(type='meta'\)"):
        flash_kda.fwd(**x)


def test_device_mismatch():
    raises(ValueError, r"all tensors must be on one device, got q.device=cpu but A_log.device=meta",
           A_log=inputs()["A_log"].to("meta"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["k", "out", "dt_bias", "final_state"])
def test_device_mismatch_cuda(name):
    x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in varlen_inputs().items()}
    x[name] = x[name].cpu()
    with pytest.raises(ValueError, match=rf"all tensors must be on one device, got q.device=cuda:0 but {name}.device=cpu"):
        flash_kda.fwd(**x)


# --- layout ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "v", "beta", "out", "initial_state", "final_state"])
def test_non_contiguous(name):
    t = inputs()[name]
    strided = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, column-major last two dims
    assert not strided.is_contiguous()
    raises(ValueError, rf"{name} must be contiguous, got {name}.stride\(\)={re.escape(str(strided.stride()))}", **{name: strided})


def test_non_contiguous_dt_bias_slice():
    wide = torch.zeros(H, 2 * D)
    raises(ValueError, r"dt_bias must be contiguous, got dt_bias.stride\(\)=\(256, 1\)", dt_bias=wide[:, :D])


# --- shape -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 256])
def test_head_dim_k_not_implemented(dim):
    x = inputs()
    for name in ("q", "k", "g"):
        x[name] = torch.zeros(B, T, H, dim, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"K = 128 only, got K={dim}"):
        flash_kda.fwd(**x)


@pytest.mark.parametrize("dim", [64, 256])
def test_head_dim_v_not_implemented(dim):
    x = inputs()
    x["v"] = torch.zeros(B, T, H, dim, dtype=torch.bfloat16)
    x["out"] = torch.zeros(B, T, H, dim, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"V = 128 only, got V={dim}"):
        flash_kda.fwd(**x)


def test_q_must_be_4d():
    raises(ValueError, r"q must be \[B, T, H, K\], got q.shape=torch.Size\(\[5, 2, 128\]\)", q=inputs()["q"][0])


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("k", (B, T + 1, H, D)),
        ("k", (B, T, 2 * H, D)),
        ("g", (B, T, H + 1, D)),
        ("v", (B, T + 1, H, D)),
        ("v", (B + 1, T, H, D)),
        ("out", (B, T + 1, H, D)),
        ("beta", (B, T, H, 1)),
        ("beta", (B, T)),
        ("A_log", (H, 1)),
        ("A_log", (H + 1,)),
    ],
)
def test_shapes(name, shape):
    dtype = inputs()[name].dtype
    raises(ValueError, rf"{name} must have shape .*got {name}.shape={re.escape(str(shape))}", **{name: torch.zeros(shape, dtype=dtype)})


@pytest.mark.parametrize("shape", [(H, D + 1), (H + 1, D), (H * D + 1,), (1, H, D)])
def test_dt_bias_shape(shape):
    raises(ValueError, rf"dt_bias must have shape \[{H}, {D}\].*got dt_bias.shape=torch.Size\({re.escape(str(list(shape)))}\)",
           dt_bias=torch.zeros(shape))  # fmt: skip


def test_dt_bias_flat_is_accepted():
    """A flat [H*K] dt_bias is read as [H, K]: the same bits as the 2-D call (the real CPU path)."""
    x = inputs()
    flash_kda.fwd(**x)
    flat = {**x, "dt_bias": x["dt_bias"].flatten(), "out": torch.full_like(x["out"], float("nan")),
            "final_state": torch.full_like(x["final_state"], float("nan"))}
    flash_kda.fwd(**flat)
    assert torch.equal(flat["out"], x["out"]) and torch.equal(flat["final_state"], x["final_state"])


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
@pytest.mark.parametrize("shape", [(N + 1, H, D, D), (N, H + 1, D, D), (N, H, D, D // 2), (H, D, D)])
def test_state_shape(name, shape):
    dtype = inputs()[name].dtype
    raises(ValueError, rf"{name} must have shape \[N, H, V, K\] = \[{N}, {H}, {D}, {D}\], got {name}.shape={re.escape(str(shape))}",
           **{name: torch.zeros(shape, dtype=dtype)})  # fmt: skip


def test_state_shape_varlen_counts_sequences():
    x = varlen_inputs((2, 3))
    x["final_state"] = torch.zeros(1, H, D, D)
    with pytest.raises(ValueError, match=r"final_state must have shape \[N, H, V, K\] = \[2, 2, 128, 128\]"):
        flash_kda.fwd(**x)


def test_cu_seqlens_requires_b1():
    x = inputs(B=2)
    x["cu_seqlens"] = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=r"cu_seqlens requires B == 1 .*got B=2"):
        flash_kda.fwd(**x)


@pytest.mark.parametrize("cu", [torch.tensor([0]), torch.tensor([[0, 5]]), torch.zeros(0, dtype=torch.int64)])
def test_cu_seqlens_shape(cu):
    raises(ValueError, rf"cu_seqlens must be 1-D \[N \+ 1\] with N >= 1, got cu_seqlens.shape={re.escape(str(cu.shape))}", cu_seqlens=cu)


# --- scalar values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [-5.0001, -6, 0.5, 1e-9, math.nan, math.inf, -math.inf, None, "x", True])
def test_lower_bound_range(lower_bound):
    raises(ValueError, rf"lower_bound must be a finite number in \[-5.0, 0.0\], got lower_bound={re.escape(repr(lower_bound))}",
           lower_bound=lower_bound)  # fmt: skip


@pytest.mark.parametrize("scale", [math.nan, math.inf, None, torch.tensor(1.0), 10**400, -(10**1000)], ids=str)
def test_scale_finite(scale):
    """An int too large for a float is refused by name like any other non-finite scale (not OverflowError), and
    the message stays short however many digits it has."""
    raises(ValueError, r"scale must be a finite real number, got scale=", scale=scale)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_lower_bound_too_large_for_a_float_is_refused_by_name(gate):
    raises(ValueError, r"lower_bound must be .*got lower_bound=an int of 1329 bits", gate=gate,
           lower_bound=-(10**400))


@pytest.mark.parametrize("name", ["scale", "lower_bound"])
def test_tensor_scalars_say_why(name):
    """A 0-d tensor is refused with the reason: reading its value would wait for its device."""
    value = torch.tensor(D**-0.5 if name == "scale" else -5.0)
    raises(ValueError, rf"{name} must be .*, got {name}=tensor\(.*a Python or NumPy number: a tensor's value is not read",
           **{name: value})  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_scalars_computed_without_warnings(dtype):
    """NumPy scale and lower_bound compute as the same Python floats do, with no warning (a NumPy float32 compared
    with the float32 overflow bound used to warn of an overflow in the cast)."""
    x = {**inputs(), "scale": 0.125, "lower_bound": -4.5}  # (both exact in float32)
    flash_kda.fwd(**x)
    y = {**inputs(), "scale": dtype(0.125), "lower_bound": dtype(-4.5)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_kda.fwd(**y)
    assert torch.equal(y["out"], x["out"]) and torch.equal(y["final_state"], x["final_state"])


@pytest.mark.parametrize("lower_bound", [-5.0, -5, -1e-3, 0.0, 0])
def test_lower_bound_edges_accepted(lower_bound):
    """The range's ends and ints compute (the real CPU path), within the CPU path's bounds of float64."""
    x = {**inputs(), "lower_bound": lower_bound}
    flash_kda.fwd(**x)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound")]
    ref_out, ref_state = reference.reference_loop(*args, initial_state=x["initial_state"])
    out_err = (x["out"].double() - ref_out).norm() / ref_out.norm()
    state_err = (x["final_state"].double() - ref_state).norm() / ref_state.norm()
    assert out_err < 4e-3 and state_err < 1e-4, (out_err, state_err)


# --- model options: the gate, negative eigenvalues, grouped value heads, absent A_log / dt_bias ---------------


G = 2  # value heads per key head in the grouped cases below (H = 2 key heads, HV = 4 value heads)
HV = G * H


def _full_args(x: dict) -> tuple:
    """validate's / well_formed's 20 positional arguments for the argument dict x (fwd's keywords included)."""
    return (*_args(x)[:13], x.get("workspace"), x.get("state_indices"), x.get("gate", "lower_bound"),
            x.get("allow_neg_eigval", False), x.get("num_accepted_tokens"), x.get("checkpoint_indices"),
            x.get("checkpoint_every", 0))


def assert_both_refuse(x: dict, exc=(TypeError, ValueError), match: str | None = None) -> None:
    """The fast check (well_formed) declines the call and the ordered checks (validate) refuse it."""
    assert validation.well_formed(*_full_args(x)) is None
    with pytest.raises(exc, match=match):
        validation.validate(*_full_args(x), concrete=True)


def accepted(x: dict, *, usual: bool = True) -> tuple:
    """validate's dims for x, asserting that the tight pass returns the same for a call of the usual kind (it
    leaves the unusual, e.g. an int lower_bound, to the ordered checks)."""
    dims = validation.validate(*_full_args(x), concrete=True)
    assert validation.well_formed(*_full_args(x)) == (dims if usual else None)
    return dims


@pytest.mark.parametrize("gate", ["Softplus", "sigmoid", "lower-bound", "", None, 0, ("softplus",)], ids=repr)
def test_gate_name_is_refused(gate):
    raises(ValueError, re.escape(f"gate must be one of ['lower_bound', 'softplus'], got gate={gate!r}"), gate=gate)


@pytest.mark.parametrize("value", [1, 0, "True", None, 1.0, torch.tensor(True)], ids=repr)
def test_allow_neg_eigval_must_be_a_bool(value):
    raises(TypeError, re.escape(f"allow_neg_eigval must be a bool, got allow_neg_eigval={value!r}"),
           allow_neg_eigval=value)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_gate_and_neg_eigval_are_accepted(gate, allow_neg_eigval):
    assert accepted({**inputs(), "gate": gate, "allow_neg_eigval": allow_neg_eigval}) == (B, T, H, N, H)


@pytest.mark.parametrize("lower_bound", [None, -5.0, 3.5, -100.0, 0, 7, 1e300])
def test_softplus_gate_takes_any_finite_lower_bound_or_none(lower_bound):
    """The softplus gate does not use lower_bound: None or any finite number (even outside [-5, 0])."""
    usual = lower_bound is None or type(lower_bound) is float
    assert accepted({**inputs(), "gate": "softplus", "lower_bound": lower_bound}, usual=usual) == (B, T, H, N, H)


@pytest.mark.parametrize("lower_bound", [math.nan, math.inf, -math.inf, "x", True, torch.tensor(-1.0)], ids=repr)
def test_softplus_gate_refuses_a_lower_bound_that_is_not_a_finite_number(lower_bound):
    raises(ValueError, re.escape("lower_bound must be None or a finite real number with gate='softplus' (which does "
                                 f"not use it), got lower_bound={lower_bound!r}"),
           gate="softplus", lower_bound=lower_bound)


def test_lower_bound_gate_refuses_none():
    raises(ValueError, r"lower_bound must be a finite number in \[-5.0, 0.0\], got lower_bound=None "
                       r"\(gate='lower_bound'; only gate='softplus' takes None\)", lower_bound=None)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("absent", [("A_log",), ("dt_bias",), ("A_log", "dt_bias")], ids="+".join)
def test_gate_parameters_may_be_none(gate, absent):
    """A_log None means exp(A_log) = 1 and dt_bias None means 0 (fla's gate without them), for either gate."""
    x = {**inputs(), "gate": gate, **{name: None for name in absent}}
    assert accepted(x) == (B, T, H, N, H)
    assert accepted({**inputs(G=G), "gate": gate, **{name: None for name in absent}}) == (B, T, HV, N, H)


@pytest.mark.parametrize("variant", ["fixed", "varlen", "pool", "no_state", "flat_dt_bias", "softplus_neg_eigval"])
def test_grouped_value_heads_are_accepted(variant):
    """q, k on H key heads; v, g, out, beta, A_log, dt_bias and the states on HV = G·H value heads: validate
    returns (B, T, HV, N, H)."""
    x = inputs(G=G, B=2, state=None if variant == "no_state" else torch.float32)
    n = 2
    if variant == "varlen":
        x = inputs(G=G, B=1, T=T)
        x["cu_seqlens"] = torch.tensor([0, 2, 2, T], dtype=torch.int32)
        n = 3
        x["initial_state"], x["final_state"] = torch.zeros(n, HV, D, D), torch.empty(n, HV, D, D)
    elif variant == "pool":
        x["initial_state"] = torch.zeros(P, HV, D, D)
        x["final_state"] = x["initial_state"]
        x["state_indices"] = torch.tensor([3, -1])
    elif variant == "flat_dt_bias":
        x["dt_bias"] = x["dt_bias"].reshape(-1)
    elif variant == "softplus_neg_eigval":
        x.update(gate="softplus", allow_neg_eigval=True, lower_bound=None)
    assert accepted(x) == (x["q"].shape[0], x["q"].shape[1], HV, n, H)


@pytest.mark.parametrize("heads", [1, 3, 5, 0])
def test_value_heads_must_be_a_multiple_of_key_heads(heads):
    """v with HV heads against q's H = 2: HV = G·H with an integer G >= 1, else the error names both shapes."""
    x = inputs()
    x["v"] = torch.zeros(B, T, heads, D, dtype=torch.bfloat16)
    raises(ValueError, re.escape(f"v's heads HV must be a multiple G >= 1 of q's heads H (grouped value heads: value "
                                 f"head hv reads key head hv // G), got HV={heads} from "
                                 f"v.shape=torch.Size([{B}, {T}, {heads}, {D}]) and H={H} from "
                                 f"q.shape=torch.Size([{B}, {T}, {H}, {D}])"), v=x["v"])


def test_key_heads_zero_need_value_heads_zero():
    x = inputs(H=0)
    x["v"] = torch.zeros(B, T, 2, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("got HV=2 from v.shape=torch.Size([1, 5, 2, 128]) and H=0")):
        flash_kda.fwd(**x)


@pytest.mark.parametrize(
    ("name", "shape", "pattern"),
    [
        ("k", (B, T, HV, D), r"k must have shape \[1, 5, 2, 128\] \(q's shape\), got k.shape=\(1, 5, 4, 128\)"),
        ("g", (B, T, H, D), r"g must have shape \[1, 5, 4, 128\] \(from q.shape=.* and v.shape=.*\), got g.shape="),
        ("out", (B, T, H, D), r"out must have shape \[1, 5, 4, 128\] .*got out.shape=\(1, 5, 2, 128\)"),
        ("beta", (B, T, H), r"beta must have shape \[1, 5, 4\] .*got beta.shape=\(1, 5, 2\)"),
        ("A_log", (H,), r"A_log must have shape \[4\] .*got A_log.shape=\(2,\)"),
        ("dt_bias", (H, D), r"dt_bias must have shape \[4, 128\] \(or flat \[512\]; one row per value head\), got "
                            r"dt_bias.shape=torch.Size\(\[2, 128\]\)"),
        ("dt_bias", (H * D,), r"dt_bias must have shape \[4, 128\]"),
        ("initial_state", (N, H, D, D), r"initial_state must have shape \[N, H, V, K\] = \[1, 4, 128, 128\]"),
        ("final_state", (N, H, D, D), r"final_state must have shape \[N, H, V, K\] = \[1, 4, 128, 128\]"),
    ],
    ids=["k", "g", "out", "beta", "A_log", "dt_bias", "dt_bias_flat", "initial_state", "final_state"],
)  # fmt: skip
def test_grouped_value_heads_shapes(name, shape, pattern):
    """With grouped value heads, everything but q and k is on the value heads (a key-head shape is refused)."""
    x = inputs(G=G)
    x[name] = torch.zeros(shape, dtype=x[name].dtype)
    with pytest.raises(ValueError, match=pattern):
        flash_kda.fwd(**x)


def test_grouped_value_heads_pool_shape():
    x = {**inputs(G=G, B=2, state=None), "initial_state": torch.zeros(P, H, D, D), "state_indices": torch.tensor([0, 1])}
    with pytest.raises(ValueError, match=re.escape(f"initial_state must be a pool [P, H, V, K] = [P, {HV}, {D}, {D}]")):
        flash_kda.fwd(**x)


# Calls that validate refuses, of the new options: the tight pass must not accept any of them.
OPTION_ERRORS = {
    "gate_name": dict(gate="Softplus"),
    "gate_none": dict(gate=None),
    "neg_eigval_int": dict(allow_neg_eigval=1),
    "neg_eigval_none": dict(allow_neg_eigval=None),
    "lower_bound_none": dict(lower_bound=None),
    "softplus_nan": dict(gate="softplus", lower_bound=math.nan),
    "softplus_inf": dict(gate="softplus", lower_bound=-math.inf),
    "softplus_str": dict(gate="softplus", lower_bound="-5"),
    "softplus_bool": dict(gate="softplus", lower_bound=False),
    "value_heads_3": dict(v=torch.zeros(B, T, 3, D, dtype=torch.bfloat16)),
    "value_heads_1": dict(v=torch.zeros(B, T, 1, D, dtype=torch.bfloat16)),
    "k_grouped": dict(k=torch.zeros(B, T, 2 * H, D, dtype=torch.bfloat16)),
    "A_log_list": dict(A_log=[0.0, 0.0]),
    "dt_bias_float": dict(dt_bias=0.0),
}


@pytest.mark.parametrize("changes", list(OPTION_ERRORS.values()), ids=list(OPTION_ERRORS))
def test_well_formed_never_accepts_what_validate_refuses(changes):
    x = {**inputs(), **changes}
    assert_both_refuse(x)


@pytest.mark.parametrize(
    "changes",
    [{"g": torch.zeros(B, T, H, D, dtype=torch.bfloat16)}, {"out": torch.zeros(B, T, H, D, dtype=torch.bfloat16)},
     {"beta": torch.zeros(B, T, H, dtype=torch.bfloat16)}, {"A_log": torch.zeros(H)}, {"dt_bias": torch.zeros(H, D)},
     {"initial_state": torch.zeros(N, H, D, D)}, {"k": torch.zeros(B, T, HV, D, dtype=torch.bfloat16)},
     {"q": torch.zeros(B, T, HV, D, dtype=torch.bfloat16)}],
    ids=["g", "out", "beta", "A_log", "dt_bias", "initial_state", "k", "q"],
)  # fmt: skip
def test_well_formed_never_accepts_key_head_shapes_with_grouped_value_heads(changes):
    x = {**inputs(G=G), **changes}
    assert_both_refuse(x, ValueError)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "out", "A_log", "dt_bias", "initial_state", "final_state"])
def test_an_argument_that_requires_grad_is_refused_under_grad_mode(name):
    """fwd has no backward: under grad mode a tensor that requires grad would get no gradient (or, written in
    place, leave autograd unaware), so the call is refused by name, before anything is written."""
    x = inputs()
    x[name] = x[name].detach().requires_grad_()
    out_bits = x["out"].detach().view(torch.int16).clone()  # (bits: the buffer is uninitialised)
    with pytest.raises(RuntimeError, match=rf"flash_kda.fwd has no backward, got {name}.requires_grad=True"):
        flash_kda.fwd(**x)
    assert torch.equal(x["out"].detach().view(torch.int16), out_bits)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_arguments_that_require_grad_run_without_grad_mode(mode):
    """Model parameters (A_log, dt_bias as nn.Parameter) under no_grad / inference_mode: the usual inference call."""
    x = inputs()
    expected = inputs()
    flash_kda.fwd(**expected)
    x["A_log"] = torch.nn.Parameter(x["A_log"])
    x["dt_bias"] = torch.nn.Parameter(x["dt_bias"])
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        flash_kda.fwd(**x)
    assert torch.equal(x["out"], expected["out"])
    assert torch.equal(x["final_state"], expected["final_state"])


def test_fake_implementation_refuses_an_argument_that_requires_grad():
    """Traced (torch.compile's fake tensors), the operator refuses it with fwd's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_kda import ops

    x = inputs()
    x["A_log"] = torch.nn.Parameter(x["A_log"])
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        assert fake["A_log"].requires_grad
        with pytest.raises(RuntimeError, match="flash_kda.fwd has no backward, got A_log.requires_grad=True"):
            ops._fwd_fake(*_full_args(fake))


def test_fake_implementation_checks_the_options():
    """The operator's fake implementation refuses a bad gate and a bad value-head count with fwd's messages."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_kda import ops

    x = inputs(G=G)
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        ops._fwd_fake(*_full_args({**fake, "gate": "softplus", "lower_bound": None, "allow_neg_eigval": True}))
        with pytest.raises(ValueError, match="gate must be one of"):
            ops._fwd_fake(*_full_args({**fake, "gate": "relu"}))
        fake["v"] = mode.from_tensor(torch.zeros(B, T, 3, D, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="v's heads HV must be a multiple G >= 1 of q's heads H"):
            ops._fwd_fake(*_full_args(fake))


def test_plan_and_workspace_take_the_value_heads():
    """plan / workspace_bytes count the kernels' programs per value head: heads=HV, or v in place of q."""
    x = inputs(G=G, T=8192, state=None)
    assert planning.plan(x["q"], heads=HV) == planning.plan(x["v"]) == planning.plan(x["g"])
    assert flash_kda.workspace_bytes(x["q"], heads=HV) == flash_kda.workspace_bytes(x["v"])
    assert flash_kda.workspace_bytes(x["q"]) == flash_kda.workspace_bytes(x["v"], heads=H)
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="heads must be None or the call's value heads"):
            planning.plan(x["q"], heads=bad)


def test_plan_and_workspace_refuse_what_fwd_refuses():
    """The host-only helpers check shapes and dtypes as fwd does (no tensor reads): they never return a plan or a
    byte count for a call that fwd would refuse, nor let an extension's argument error through."""
    q = torch.zeros(1, 64, 2, D)
    for cu, pattern in ((torch.tensor([], dtype=torch.int64), "N >= 1"), (torch.tensor([0]), "N >= 1"),
                        (torch.tensor([0.0, 32.0, 64.0]), "int64 or int32")):
        with pytest.raises(ValueError, match=f"cu_seqlens must be .*{pattern}"):
            flash_kda.workspace_bytes(q, cu)
    with pytest.raises(ValueError, match=r"cu_seqlens needs B = 1"):
        flash_kda.plan(torch.zeros(2, 64, 2, D), torch.tensor([0, 32, 64]))
    cu = torch.tensor([0, 32, 64])
    for indices in (torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2), torch.zeros(3, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"state_indices must be int64 or int32 \[N\] or \[N, L\] with N = 2"):
            flash_kda.workspace_bytes(q, cu, indices)
    with pytest.raises(ValueError, match=r"at most 2\^31 - 1 heads"):
        flash_kda.plan(q, heads=2**31)
    with testing.force_plan(single_pass=True), pytest.raises(ValueError, match="single pass runs the lower-bound"):
        flash_kda.plan(q, gate="softplus")
    with pytest.raises(ValueError, match=r"total_tokens must be an int in \[0, "):
        planning.decode_chunk_runs(2**63, 1)


def test_force_plan_takes_numpy_ints_and_refuses_sizes_past_int32():
    q = torch.zeros(1, 4096, 2, D)
    with testing.force_plan(v_split=np.int64(2)):
        assert flash_kda.plan(q).v_split == 2
    for name in ("segment_chunks", "lead_chunks"):
        with pytest.raises(ValueError, match=rf"{name} must be None .*2\^31"), testing.force_plan(**{name: 2**31}):
            pass


def test_plan_takes_the_gate():
    """The single pass runs the lower-bound gate only: a shape it would take runs two stages with the softplus gate
    (plan, workspace_bytes and the cached plan_for all follow the gate)."""
    q = torch.zeros(64, 128, 32, D, dtype=torch.bfloat16)  # 64 sequences of 8 chunks, 32 heads: the single pass
    assert planning.plan(q).single_pass and planning.plan(q, gate="lower_bound").single_pass
    softplus = planning.plan(q, gate="softplus")
    assert not softplus.single_pass and not softplus.decode
    assert planning.plan_for(64, 128, 32, 64, False, 132, validation.GATE_CODES["softplus"])[0] == softplus
    assert flash_kda.workspace_bytes(q, gate="softplus") > flash_kda.workspace_bytes(q) == 0
    with pytest.raises(ValueError, match=re.escape("gate must be one of ['lower_bound', 'softplus'], got gate='x'")):
        planning.plan(q, gate="x")


# --- cu_seqlens contents (CPU: validated inline; anywhere: check_cu_seqlens) ------------------------------


def test_check_cu_seqlens_names_total_tokens_and_keeps_its_message_short():
    with pytest.raises(ValueError, match=r"total_tokens must be in \[0, 2\^63\), got total_tokens=-1"):
        flash_kda.check_cu_seqlens(torch.tensor([0, -1]), -1)
    with pytest.raises(ValueError, match=r"total_tokens must be in \[0, 2\^63\)"):
        flash_kda.check_cu_seqlens(torch.tensor([0, 3, 5]), 2**70)
    with pytest.raises(TypeError, match=r"total_tokens must be an int"):
        flash_kda.check_cu_seqlens(torch.tensor([0, 1]), "1")
    cu = torch.arange(100_001)
    cu[0] = 1
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0") as raised:
        flash_kda.check_cu_seqlens(cu, 100_000)
    assert len(str(raised.value)) < 200


def test_compare_windows_check_their_boundaries_and_window():
    """Boundaries that leave tokens out would report a worst window over part of the tensor: refused."""
    x = torch.randn(1, 10, 3)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must equal the number of tokens 10"):
        compare.compare(x, x + 0.1, window=4, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0"):
        compare.compare(x, x + 0.1, window=4, cu_seqlens=torch.tensor([3, 10]))
    for window in (2.5, True, "3"):
        with pytest.raises(TypeError, match="window must be an int"):
            compare.compare(x, x + 0.1, window=window)
    assert compare.compare(x, x + 0.1, window=4, cu_seqlens=torch.tensor([0, 4, 10])).window_rel_l2 > 0


@pytest.mark.parametrize("call", ["last_error", "reserve_workspace", "device_info"])
def test_device_helpers_refuse_a_bool_or_negative_device_by_name(call):
    fn = {"last_error": lambda d: flash_kda.last_error(d), "reserve_workspace": lambda d: flash_kda.reserve_workspace(16, d),
          "device_info": lambda d: flash_kda.device_info(d)}[call]
    with pytest.raises(TypeError, match=rf"{call} needs a CUDA device .*got device=True"):
        fn(True)
    with pytest.raises(ValueError, match=rf"{call} needs a CUDA device index >= 0"):
        fn(-1)
    with pytest.raises(TypeError, match=rf"{call} needs a CUDA device .*got device=1.5"):
        fn(1.5)
    with pytest.raises(ValueError, match=rf"{call} needs a CUDA device, got device='garbage'"):
        fn("garbage")
    with pytest.raises(ValueError, match=rf"{call} needs a CUDA device, got device=device\(type='cpu'\)"):
        fn("cpu")


BAD_CU = [
    ([1, 3, 5], r"cu_seqlens\[0\] must be 0, got 1"),
    ([0, 4, 2, 5], r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\]=4 > cu_seqlens\[2\]=2"),
    ([0, 2, 6], r"cu_seqlens\[-1\] must be at most the number of tokens 5 \(tokens past it are padding\), got "
                r"cu_seqlens\[-1\]=6"),
    ([0, -1, 5], r"non-decreasing, got cu_seqlens\[0\]=0 > cu_seqlens\[1\]=-1"),
]


@pytest.mark.parametrize(("cu", "pattern"), BAD_CU)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_check_cu_seqlens(cu, pattern, dtype):
    with pytest.raises(ValueError, match=pattern):
        flash_kda.check_cu_seqlens(torch.tensor(cu, dtype=dtype), 5)


def test_check_cu_seqlens_refuses_a_tensor_without_contents():
    with pytest.raises(ValueError, match="cu_seqlens must be on the CPU or a CUDA device, got .*meta"):
        flash_kda.check_cu_seqlens(torch.tensor([0, 5, 20], device="meta"), 20)


@pytest.mark.parametrize(("cu", "pattern"), BAD_CU)
def test_cpu_fwd_validates_cu_seqlens_contents(cu, pattern):
    x = inputs()
    n = len(cu) - 1
    x["initial_state"] = torch.zeros(n, H, D, D)
    x["final_state"] = torch.zeros(n, H, D, D)
    x["cu_seqlens"] = torch.tensor(cu)
    with pytest.raises(ValueError, match=pattern):
        flash_kda.fwd(**x)


@pytest.mark.parametrize("cu", [[0, 5], [0, 0, 5], [0, 5, 5], [0, 2, 2, 5], [0, 2, 4], [0, 0], [0, 1, 1, 1]])
def test_check_cu_seqlens_accepts(cu):
    flash_kda.check_cu_seqlens(torch.tensor(cu), 5)
    flash_kda.check_cu_seqlens(torch.tensor(cu, dtype=torch.int32), 5)


def test_check_cu_seqlens_types():
    with pytest.raises(TypeError, match="cu_seqlens must be an int64 or int32 tensor"):
        flash_kda.check_cu_seqlens(torch.tensor([0.0, 5.0]), 5)
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D \[N \+ 1\] with N >= 1"):
        flash_kda.check_cu_seqlens(torch.tensor([0]), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q", "v", "out", "dt_bias", "initial_state"])
def test_misaligned_view_cuda(name):
    x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in inputs().items()}
    t = x[name]
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape)  # 2 or 4 bytes off
    x[name] = shifted
    with pytest.raises(ValueError, match=rf"{name} must start at a 16-byte aligned address on CUDA"):
        flash_kda.fwd(**x)


# --- cu_seqlens on the host with CUDA tensors, and the checked mode -------------------------------------


def _cuda(x: dict) -> dict:
    return {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


@pytest.mark.gpu
def test_host_cu_seqlens_equals_device_cu_seqlens():
    x = _cuda(varlen_inputs((20, 0, 45)))
    on_host = {**x, "cu_seqlens": x["cu_seqlens"].cpu(), "out": torch.empty_like(x["out"]),
               "final_state": torch.empty_like(x["final_state"])}  # fmt: skip
    flash_kda.fwd(**x)
    flash_kda.fwd(**on_host)
    assert torch.equal(on_host["out"], x["out"]) and torch.equal(on_host["final_state"], x["final_state"])
    need = flash_kda.workspace_bytes(x["q"], on_host["cu_seqlens"])
    assert need == flash_kda.workspace_bytes(x["q"], x["cu_seqlens"]) + 32  # 4 int64 boundaries, 16-byte granules
    small = torch.empty(need - 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=rf"workspace must hold at least {need} bytes"):
        flash_kda.fwd(**on_host, workspace=small)


def _padded(x: dict, tail: int) -> dict:
    """x with ``tail`` padding tokens appended after its last sequence (cu_seqlens unchanged), outputs NaN."""
    y = dict(x)
    for name in ("q", "k", "v", "g", "beta"):
        y[name] = torch.cat([x[name], torch.randn_like(x[name][:, :tail], dtype=torch.float32).to(x[name].dtype)], 1)
    y["out"] = torch.full_like(y["v"], float("nan"))
    y["final_state"] = torch.full_like(x["final_state"], float("nan"))
    return y


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "pool"])
def test_padding_tokens_past_the_last_boundary(pool):
    """Tokens past cu_seqlens[-1] (a CUDA-graph batch padded to its captured size, as serving engines pad them)
    belong to no sequence: the call equals the one without them, bit for bit, and leaves their out rows."""
    x = varlen_inputs((2, 0, 3))
    if pool:  # the engines' form: empty padding sequences with no slot, and padding tokens
        x = varlen_inputs((2, 0, 3, 0))
        x["state_indices"] = torch.tensor([2, 0, 1, -1])
        x["final_state"] = torch.full_like(x["final_state"], float("nan"))  # (slot 3 is not written)
    padded = _padded(x, 4)
    flash_kda.fwd(**x)
    flash_kda.fwd(**padded)
    assert torch.equal(padded["out"][:, :5], x["out"])
    assert torch.isnan(padded["out"][:, 5:].float()).all(), "the padding tokens' out rows were written"
    # (bits: the pool's unnamed slot 3 keeps its NaN in both)
    assert torch.equal(padded["final_state"].view(torch.int32), x["final_state"].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_padding_tokens_past_the_last_boundary_cuda(where):
    """As above on the kernels, with cu_seqlens on the device (the kernels skip the padding; no error is
    recorded) and on the host (the kernels skip the padding likewise), under the decode and the chunked plans."""
    for seqlens, tail in (((2, 0, 3, 0), 4), ((40, 0, 17), 30)):
        x = _cuda(varlen_inputs(seqlens))
        if where == "host":
            x["cu_seqlens"] = x["cu_seqlens"].cpu()
        padded = _cuda(_padded(x, tail))
        end = sum(seqlens)
        flash_kda.fwd(**x)
        flash_kda.fwd(**padded)
        torch.cuda.synchronize()
        assert flash_kda.last_error() is None
        assert torch.equal(padded["out"][:, :end], x["out"]), seqlens
        assert torch.isnan(padded["out"][:, end:].float()).all(), "the padding tokens' out rows were written"
        assert torch.equal(padded["final_state"], x["final_state"]), seqlens


@pytest.mark.gpu
def test_padded_call_plans_all_its_tokens_wherever_cu_seqlens_is():
    """A padded call (cu_seqlens[-1] < T) runs the plan of all T tokens, flash_kda.plan's, with cu_seqlens on the
    host as on the device (which the host cannot read), so the two give the same bits: 4 sequences of 16 tokens
    padded to T = 100 at H32 plan the single pass, the 64 covered tokens alone the decode plan."""
    heads, T, end = 32, 100, 64
    gen = torch.Generator().manual_seed(11)
    x = {n: torch.randn(1, T, heads, D, generator=gen).to(torch.bfloat16).cuda() for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T, heads, generator=gen).to(torch.bfloat16).cuda()
    A_log, dt_bias = torch.zeros(heads, device="cuda"), torch.zeros(heads, D, device="cuda")
    cu = torch.tensor([0, 16, 32, 48, end])
    assert flash_kda.plan(x["q"], cu) == flash_kda.plan(x["q"], cu.cuda())
    assert flash_kda.plan(x["q"], cu).single_pass and flash_kda.plan(x["q"][:, :end], cu).decode
    results = []
    for where in (cu, cu.cuda()):
        out = torch.full_like(x["v"], float("nan"))
        fin = torch.full((4, heads, D, D), float("nan"), device="cuda")
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, out, A_log, dt_bias, -5.0, None, fin, where)
        results.append((out, fin))
    torch.cuda.synchronize()
    assert flash_kda.last_error() is None
    (host_out, host_fin), (device_out, device_fin) = results
    assert torch.equal(host_out[:, :end], device_out[:, :end]) and torch.equal(host_fin, device_fin)
    assert torch.isnan(host_out[:, end:].float()).all() and torch.isnan(device_out[:, end:].float()).all()


@pytest.mark.gpu
def test_padded_decode_call_takes_one_kernel_wherever_cu_seqlens_is():
    """The decode plan's kernel choice counts all T tokens too: 128 one-token sequences padded to T = 2048 at H32
    average 16 tokens and take the chunk step (kda_plan.h, decode_chunk_runs) with cu_seqlens on the host as on the
    device: both give the twin's bits for the whole padded shape."""
    from flash_kda import numerics

    heads, T, N = 32, 2048, 128
    assert planning.decode_chunk_runs(T, N) and not planning.decode_chunk_runs(N, N)
    gen = torch.Generator().manual_seed(12)
    x = {n: torch.randn(1, T, heads, D, generator=gen).to(torch.bfloat16).cuda() for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(1, T, heads, generator=gen).to(torch.bfloat16).cuda()
    A_log, dt_bias = torch.zeros(heads, device="cuda"), torch.zeros(heads, D, device="cuda")
    init = torch.randn(N, heads, D, D, generator=gen).to(torch.bfloat16).cuda()
    cu = torch.arange(N + 1)
    assert flash_kda.plan(x["q"], cu) == flash_kda.plan(x["q"], cu.cuda()) and flash_kda.plan(x["q"], cu).decode
    results = []
    for where in (cu, cu.cuda()):
        out = torch.full_like(x["v"], float("nan"))
        fin = torch.full_like(init, float("nan"))
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, out, A_log, dt_bias, -5.0, init, fin, where)
        results.append((out, fin))
    torch.cuda.synchronize()
    assert flash_kda.last_error() is None
    twin_out, twin_fin = numerics.twin_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, A_log, dt_bias,
                                               -5.0, init, cu.cuda(), decode=True, final_dtype=torch.bfloat16)
    for out, fin in results:
        assert torch.equal(out[:, :N], twin_out[:, :N]) and torch.equal(fin, twin_fin.to(fin.dtype))
        assert torch.isnan(out[:, N:].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cu, pattern", [([0, 30, 20, 65], r"cu_seqlens\[1\]=30 > cu_seqlens\[2\]=20"),
                                         ([0, 20, 20, 66], r"cu_seqlens\[-1\] must be at most the number of tokens 65")])
def test_malformed_host_cu_seqlens_is_refused_by_index(cu, pattern):
    x = _cuda(varlen_inputs((20, 0, 45)))
    x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    with pytest.raises(ValueError, match=pattern):
        flash_kda.fwd(**x)


@pytest.mark.gpu
def test_checked_mode_refuses_malformed_device_cu_seqlens(monkeypatch):
    x = _cuda(varlen_inputs((20, 0, 45)))
    x["cu_seqlens"] = torch.tensor([0, 30, 20, 65], dtype=torch.int64, device="cuda")
    flash_kda.fwd(**x)  # default: no check on the host (the kernel clamps; the result is unspecified)
    torch.cuda.synchronize()
    monkeypatch.setenv(validation.CHECK_CU_SEQLENS_ENV, "1")
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\]=30"):
        flash_kda.fwd(**x)


def test_host_cu_seqlens_with_cpu_tensors_needs_no_extra_workspace():
    x = varlen_inputs((2, 0, 3))
    assert not validation.cu_seqlens_on_host(x["q"], x["cu_seqlens"])
    assert planning.host_cu_seqlens_bytes(3) == 32 and planning.host_cu_seqlens_bytes(1) == 16


# --- the execution plan (host-side rule; needs the extension, not a GPU) --------------------------------


@pytest.mark.parametrize(
    "num_seqs, heads, expected",
    [(1, 96, 1), (1, 64, 2), (1, 32, 4), (1, 16, 8), (1, 8, 8), (1, 1, 8), (8, 32, 1), (64, 32, 1), (6, 4, 4),
     (1, 66, 2), (1, 67, 1), (0, 4, 8)],
)  # fmt: skip
def test_default_v_split(num_seqs, heads, expected):
    from flash_kda import testing

    assert testing.default_v_split(num_seqs, heads, 132) == expected


@pytest.mark.parametrize("v_split", [3, 16, -1, True, 2.0])
def test_force_plan_refuses_bad_v_split(v_split):
    from flash_kda import testing

    with pytest.raises(ValueError, match=r"v_split must be 0 \(automatic\) or one of \[1, 2, 4, 8\]"):
        with testing.force_plan(v_split=v_split):
            pass
    with pytest.raises(ValueError, match=r"scan_v_split must be 0 \(automatic\)"):
        with testing.force_plan(scan_v_split=v_split):
            pass


@pytest.mark.parametrize("segment_chunks", [-1, True, 2.5, "4"])
def test_force_plan_refuses_bad_segment_chunks(segment_chunks):
    from flash_kda import testing

    with pytest.raises(ValueError, match="segment_chunks must be None"):
        with testing.force_plan(segment_chunks=segment_chunks):
            pass


def test_force_plan_restores():
    from flash_kda import testing

    with testing.force_plan(v_split=4, segment_chunks=3):
        assert planning.forced_plan() == planning.PlanOverrides(v_split=4, segment_chunks=3)
        with testing.force_plan(v_split=8, scan_v_split=2):
            assert planning.forced_plan() == planning.PlanOverrides(v_split=8, scan_v_split=2)
        assert planning.forced_plan() == planning.PlanOverrides(v_split=4, segment_chunks=3)
    assert planning.forced_plan() == planning.PlanOverrides()


# (total tokens, T, N, H, varlen): the grid cases of bench_fwd
_FULL_GPU = [(8192, 8192, 1, 96, False), (8192, 8192, 1, 64, False), (8192, 1024, 8, 32, False),
             (16384, 512, 32, 32, False), (8192, 8192, 6, 96, True), (8192, 8192, 8, 96, True),
             (8192, 8192, 64, 32, True)]  # the last: many short sequences (the split would only add launches)
_FEW_HEADS = [(131072, 131072, 1, 1, False), (1 << 20, 1 << 20, 1, 1, False), (32768, 32768, 1, 8, False),
              (8192, 8192, 1, 16, False), (139264, 139264, 65, 4, True)]


@pytest.mark.parametrize("shape", _FULL_GPU, ids=str)
def test_plan_keeps_full_gpus_unsplit(shape):
    """Where sequences x heads already fill the H200, the time split would only add work."""
    from flash_kda import testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    assert plan.segment_chunks == 0
    short = -(-total // (16 * N)) <= 8  # mean sequence of at most 8 chunks: see the next test
    assert plan.single_pass == short
    overlap = plan.lead_chunks >= 0  # T8192 H96 and H64: see test_plan_overlaps_where_sms_are_left_free
    assert plan.v_split == plan.scan_v_split == (1 if short or overlap else testing.default_v_split(N, H, 132))


@pytest.mark.parametrize(
    "shape, expected",
    [((8192, 8192, 1, 96, False), True), ((8192, 8192, 1, 64, False), True), ((16384, 8192, 2, 48, False), True),
     ((8192, 8192, 1, 40, False), True), ((8192, 8192, 1, 112, False), True), ((8192, 8192, 1, 124, False), False),
     ((8192, 8192, 1, 128, False), False), ((8192, 8192, 1, 32, False), False), ((2048, 2048, 1, 33, False), False),
     ((8192, 1024, 8, 32, False), False), ((512, 512, 1, 96, False), False), ((8192, 8192, 6, 96, True), False)],
    ids=str,
)  # fmt: skip
def test_plan_overlaps_where_sms_are_left_free(shape, expected):
    """Fixed-length batches without a time split whose (sequence, head) pairs outnumber a quarter of the SMs and
    leave at least 8 free run one 8-warp CTA per pair and the preparation's tail on the free SMs meanwhile
    (kda_plan.h, overlap_pays): a lead that grows as fewer SMs are free, the tail on every free SM; where the lead
    would be the whole sequence (8 free SMs at H124), the ordinary two stages."""
    from flash_kda import testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    assert (plan.lead_chunks >= 0) == expected
    if expected:
        chunks = -(-T // 16)
        assert plan.v_split == 1 and plan.segment_chunks == 0 and not plan.single_pass
        assert 0 < plan.lead_chunks < chunks
        assert plan.tail_ctas == 132 - N * H
    else:
        assert plan.lead_chunks == -1 and plan.tail_ctas == 0


def test_overlap_lead_grows_as_free_sms_shrink():
    from flash_kda import testing

    leads = [testing.default_plan(8192, 8192, 1, H, False, 132).lead_chunks for H in (66, 80, 96, 112)]
    assert leads == sorted(leads) and leads[0] < leads[-1]


def test_force_plan_overlap():
    """A forced lead runs the overlap on any fixed-length batch (v_split 1, one tail CTA at least), never on a
    varlen one; it refuses the splits and the single pass."""
    from flash_kda import _ext, testing

    C = _ext.load()
    assert C.choose_plan(16384, 512, 32, 32, False, 132, lead_chunks=3) == flash_kda.Plan(1, 1, 0, False, 3, 1)
    assert C.choose_plan(8192, 8192, 1, 4, False, 132, lead_chunks=0) == flash_kda.Plan(1, 1, 0, False, 0, 128)
    assert C.choose_plan(8192, 8192, 6, 96, True, 132, lead_chunks=3).lead_chunks == -1
    assert C.choose_plan(8192, 8192, 1, 96, False, 132, lead_chunks=-1).lead_chunks == -1
    for kwargs in ({"v_split": 2}, {"segment_chunks": 4}, {"scan_v_split": 2}, {"single_pass": True}):
        with pytest.raises(ValueError, match="lead_chunks >= 0 runs v_split 1"):
            with testing.force_plan(lead_chunks=2, **kwargs):
                pass
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="lead_chunks must be"):
            with testing.force_plan(lead_chunks=bad):
                pass


@pytest.mark.parametrize(
    "shape, expected",
    [((8192, 8192, 6, 96, True), True), ((8192, 8192, 8, 96, True), True), ((8192, 8192, 2, 96, True), True),
     ((8192, 8192, 6, 16, True), False), ((8192, 8192, 64, 32, True), False), ((139264, 139264, 65, 4, True), False),
     ((8192, 8192, 300, 96, True), False), ((8192, 8192, 6, 96, False), False)],
    ids=str,
)  # fmt: skip
def test_plan_runs_longest_sequences_first(shape, expected):
    """A varlen batch whose unsplit finishing pass takes more than one wave of 8-warp CTAs starts the longest
    sequences first (kda_plan.h, longest_first_pays); not fixed-length batches, not the single pass (64 x 128),
    not the time split (one long sequence among 64 short ones), not more than 256 sequences."""
    from flash_kda import testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    assert plan.longest_first == expected
    if expected:
        assert plan.v_split == 1 and plan.segment_chunks == 0 and not plan.single_pass


def test_workspace_grows_with_the_longest_first_order():
    from flash_kda import _ext

    C = _ext.load()
    assert C.workspace_bytes(8192, 6, 96, 0, False, 0, True) == C.workspace_bytes(8192, 6, 96) + 6 * 4


def test_workspace_grows_with_the_overlap():
    """The overlap's ready flags, one uint32 per tail record (kda_params.h), follow the records."""
    from flash_kda import _ext

    C = _ext.load()
    assert C.overlap_tail_items(8192, 2, 96, 100) == (512 - 100) * 2 * 96
    assert C.overlap_tail_items(8192, 2, 96, 512) == 0
    assert C.overlap_tail_items(8192, 2, 96, -1) == 0
    assert C.workspace_bytes(16384, 2, 96, 0, False, 1000) == C.workspace_bytes(16384, 2, 96) + 4000


@pytest.mark.parametrize(
    "shape, expected",
    [((8192, 8192, 64, 32, True), True), ((8192, 128, 64, 32, False), True), ((4096, 64, 64, 4, False), True),
     ((8192, 1024, 8, 32, False), False), ((16384, 512, 32, 32, False), False), ((8192, 144, 57, 32, True), False),
     ((1024, 128, 8, 4, False), False)],
    ids=str,
)  # fmt: skip
def test_plan_runs_many_short_sequences_in_one_pass(shape, expected):
    """Where one 8-warp CTA per (sequence, head) over-fills the GPU and the sequences are at most 8 chunks long
    (mean), the single pass runs them (kda_plan.h); longer ones, and grids that fit, keep the two stages."""
    from flash_kda import testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    v = testing.default_v_split(N, H, 132)
    expected_plan = flash_kda.Plan(1, 1, 0, True) if expected else flash_kda.Plan(v, v, 0, False)
    assert plan._replace(longest_first=False) == expected_plan


def test_two_stage_plan_splits_v_for_many_short_sequences():
    """With the single pass forbidden, many short sequences get two 4-warp CTAs per pair (kda_plan.h,
    split_short_sequences); forcing it on gives the single pass's own plan whatever the shape."""
    from flash_kda import _ext

    C = _ext.load()
    assert C.choose_plan(8192, 8192, 64, 32, True, 132, single_pass=False) == flash_kda.Plan(2, 2, 0, False)
    assert C.choose_plan(8192, 8192, 1, 96, False, 132, single_pass=True) == flash_kda.Plan(1, 1, 0, True)
    assert C.choose_plan(131072, 131072, 1, 1, False, 132, single_pass=True) == flash_kda.Plan(1, 1, 0, True)


def test_force_plan_refuses_a_single_pass_with_splits():
    """The single pass owns all 128 state rows of a whole sequence: no V split, no time split."""
    from flash_kda import testing

    for kwargs in ({"v_split": 2}, {"segment_chunks": 4}, {"scan_v_split": 2}):
        with pytest.raises(ValueError, match="single_pass=True"):
            with testing.force_plan(single_pass=True, **kwargs):
                pass
    with pytest.raises(ValueError, match="single_pass must be"):
        with testing.force_plan(single_pass=1):
            pass


@pytest.mark.parametrize("shape", _FEW_HEADS, ids=str)
def test_plan_splits_long_sequences_on_few_heads(shape):
    """Long sequences on few heads are cut in time, into enough segments to spread over the GPU."""
    from flash_kda import testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    chunks = -(-(total if varlen else T) // 16)
    assert plan.segment_chunks > 0 and chunks // plan.segment_chunks >= 2
    assert plan.v_split in (1, 2, 4, 8) and plan.scan_v_split in (1, 2, 4, 8)


def test_skewed_varlen_gets_the_segments_of_its_long_sequence():
    """One 131072-token sequence among 64 of 128 tokens (issue 7's case): the mean is long enough to split, and
    the segment length is the one the long sequence would get alone."""
    from flash_kda import testing

    skewed = testing.default_plan(139264, 139264, 65, 4, True, 132)
    alone = testing.default_plan(139264, 139264, 1, 4, True, 132)
    assert skewed.segment_chunks == alone.segment_chunks > 0


def test_forced_time_split_picks_its_own_v_splits():
    """Forcing no time split on a shape the plan would split gives the V split of the unsplit shape."""
    from flash_kda import _ext, testing

    plan = _ext.load().choose_plan(131072, 131072, 1, 1, False, 132, segment_chunks=0)
    assert plan == flash_kda.Plan(testing.default_v_split(1, 1, 132), testing.default_v_split(1, 1, 132), 0, False)
    forced = _ext.load().choose_plan(8192, 8192, 1, 96, False, 132, segment_chunks=4)
    assert forced.segment_chunks == 4


def test_workspace_grows_with_the_time_split():
    """Each window of a split call stores its segment's map (kda_params.h): 192 KiB per window and head."""
    from flash_kda import _ext

    C = _ext.load()
    base = C.workspace_bytes(131072, 1, 2)
    assert C.workspace_bytes(131072, 1, 2, 0) == base
    windows = -(-(131072 // 16 + 1) // 128)
    table = -(-(windows * 8) // 128) * 128
    assert C.workspace_bytes(131072, 1, 2, 128) == base + table + windows * 2 * 196608


def test_single_pass_needs_no_workspace():
    """The single pass keeps its records in shared memory (single_pass.cuh): no workspace at all."""
    from flash_kda import _ext

    C = _ext.load()
    assert C.workspace_bytes(8192, 64, 32, 0, True) == 0
    assert C.workspace_bytes(8192, 64, 32, 0, False) > 0


# --- workspace -------------------------------------------------------------------------------------------


def test_workspace_must_be_uint8_on_q_device():
    with pytest.raises(TypeError, match="workspace must be a uint8 tensor"):
        flash_kda.fwd(**inputs(), workspace=torch.zeros(16, dtype=torch.float32))
    with pytest.raises(ValueError, match="workspace must be on q's device"):
        flash_kda.fwd(**inputs(), workspace=torch.zeros(16, dtype=torch.uint8, device="meta"))


def test_reserve_workspace_refuses_cpu_and_negative():
    with pytest.raises(ValueError, match=r"nbytes must be a non-negative int, got nbytes=-1"):
        flash_kda.reserve_workspace(-1, "cpu")
    with pytest.raises(ValueError, match=r"reserve_workspace needs a CUDA device, got device=device\(type='cpu'\)"):
        flash_kda.reserve_workspace(16, "cpu")


@pytest.mark.parametrize("nbytes", [torch.zeros(2), 16.0, True, "16"], ids=["tensor", "float", "bool", "str"])
def test_reserve_workspace_refuses_a_size_that_is_not_an_int(nbytes):
    """By type only: a tensor passed in place of its byte count is named by its type, not printed."""
    with pytest.raises(TypeError, match=rf"nbytes must be a non-negative int \(e.g. workspace_bytes\(v, cu_seqlens\)\), "
                                        rf"got {type(nbytes).__name__}$"):
        flash_kda.reserve_workspace(nbytes, "cpu")


def test_last_error_before_any_cuda_call_is_none_without_cuda():
    """A query before any CUDA call (the CPU path's users, machines without CUDA) has nothing to report: None, and
    CUDA stays uninitialised. In a fresh process, since this one may have made CUDA calls."""
    code = ("import torch, flash_kda; "
            "q = torch.zeros(1, 20, 1, 128, dtype=torch.bfloat16); "
            "b = torch.zeros(1, 20, 1, dtype=torch.bfloat16); "
            "flash_kda.fwd(q, q, q, q, b, 0.1, torch.empty_like(q), None, None, -5.0); "
            "assert flash_kda.last_error() is None; "
            "assert not torch.cuda.is_initialized(), 'last_error initialised CUDA'; "
            "print('fresh process ok')")
    fresh_process.assert_fresh_process_ok(code)
    with pytest.raises(ValueError, match=r"last_error needs a CUDA device, got device=device\(type='cpu'\)"):
        flash_kda.last_error("cpu")


def test_last_error_on_a_named_cuda_device_before_any_call_is_none():
    """An explicit CUDA device before any CUDA call: nothing to report (no CUDA needed to say so)."""
    code = ("import torch, flash_kda; "
            "assert flash_kda.last_error(0) is None and flash_kda.last_error('cuda') is None; "
            "assert not torch.cuda.is_initialized(), 'last_error initialised CUDA'; "
            "print('fresh process ok')")
    fresh_process.assert_fresh_process_ok(code)


def test_plan_queries_name_a_non_tensor():
    for call, name in ((lambda: flash_kda.workspace_bytes([1, 2]), "q"),
                       (lambda: flash_kda.plan(torch.zeros(4, 128)), "q"),
                       (lambda: flash_kda.workspace_bytes(torch.zeros(1, 8, 2, 128), [0, 8]), "cu_seqlens"),
                       (lambda: flash_kda.workspace_bytes(torch.zeros(1, 8, 2, 128), None, [0]), "state_indices")):
        with pytest.raises(TypeError, match=rf"^{name} must be"):
            call()


def test_cuda_queries_without_cuda_name_themselves(monkeypatch):
    """Without a CUDA device, the calls that default to the current one say so by name (not torch's assertion).
    (torch.cuda.is_available patched to False, so that this runs on GPU machines too.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call, name in ((lambda: flash_kda.reserve_workspace(16), "reserve_workspace"),
                       (lambda: flash_kda.device_info(), "device_info")):
        with pytest.raises(RuntimeError, match=rf"^{name} needs a CUDA device and torch sees none"):
            call()


def test_release_workspace_drops_the_cache_and_keeps_what_graphs_use(monkeypatch):
    """release_workspace() empties the per-(device, stream) cache; a buffer a captured graph uses moves to the
    buffers held for the life of the process (CPU tensors stand in for the cached CUDA buffers)."""
    from flash_kda import launch  # noqa: PLC0415

    plain, captured = torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    monkeypatch.setattr(launch, "_workspaces", {(0, 1): plain, (1, 5): captured})
    monkeypatch.setattr(launch, "_captured", {captured.data_ptr()})
    monkeypatch.setattr(launch, "_held_by_graphs", [])
    assert flash_kda.release_workspace() is None
    assert launch._workspaces == {}
    assert len(launch._held_by_graphs) == 1 and launch._held_by_graphs[0] is captured
    assert flash_kda.release_workspace() is None  # (nothing cached: nothing to do, no CUDA asked)
    with pytest.raises(TypeError, match="release_workspace needs a CUDA device"):
        flash_kda.release_workspace(1.5)
    with pytest.raises(ValueError, match="release_workspace needs a CUDA device"):
        flash_kda.release_workspace("cpu")


@pytest.mark.gpu
def test_workspace_too_small():
    # T = 40: a chunked plan, which needs a workspace (sequences of at most 16 tokens run the decode kernel, which
    # needs none).
    x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in inputs(T=40).items()}
    need = flash_kda.workspace_bytes(x["q"])
    assert need > 0 and not flash_kda.plan(x["q"]).decode
    with pytest.raises(ValueError, match=rf"workspace must hold at least {need} bytes for this call, got workspace.numel\(\)={need - 1}"):
        flash_kda.fwd(**x, workspace=torch.empty(need - 1, dtype=torch.uint8, device="cuda"))


# --- the extension is optional for import --------------------------------------------------------------


def test_import_without_extension_and_clear_error(monkeypatch):
    from flash_kda import _ext

    monkeypatch.setattr(_ext, "_import", lambda: ImportError("No module named 'flash_kda._C'"))
    assert not _ext.available()
    with pytest.raises(ImportError, match=r"flash_kda._C \(the CUDA extension\) is not importable"):
        _ext.build_info()


# --- the tight acceptance pass of _validate (host time per call) -----------------------------------------


def _args(x: dict) -> tuple:
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"], x["dt_bias"],
            x["lower_bound"], x["initial_state"], x["final_state"], x.get("cu_seqlens"), None)


@pytest.mark.parametrize("variant", ["states", "no_state", "bf16_states", "flat_dt_bias", "varlen", "bf16_params"])
def test_well_formed_accepts_what_validate_accepts(variant):
    """The tight pass returns the same (B, T, HV, N, H) as the ordered checks on well-formed calls of every kind."""
    x = inputs(state=None if variant == "no_state" else torch.bfloat16 if variant == "bf16_states" else torch.float32)
    if variant == "flat_dt_bias":
        x["dt_bias"] = x["dt_bias"].reshape(-1)
    if variant == "bf16_params":
        x["A_log"], x["dt_bias"] = x["A_log"].to(torch.bfloat16), x["dt_bias"].to(torch.float16)
    if variant == "varlen":
        x = inputs(B=1, T=T, state=torch.float32)
        x["cu_seqlens"] = torch.tensor([0, 3, T], dtype=torch.int32)
        x["initial_state"] = torch.zeros(2, H, D, D)
        x["final_state"] = torch.empty(2, H, D, D)
    dims = validation.well_formed(*_args(x))
    assert dims is not None
    assert dims == validation.validate(*_args(x), concrete=True)


@pytest.mark.parametrize(
    "changes",
    [
        {"scale": 1},  # an int: valid, but left to the ordered checks (numbers.Real)
        {"scale": float("nan")},
        {"lower_bound": -5.5},
        {"lower_bound": float("nan")},
        {"q": None},
        {"k": "not a tensor"},
        {"beta": torch.zeros(B, T, H + 1, dtype=torch.bfloat16)},
        {"A_log": torch.zeros(H + 1)},
        {"dt_bias": torch.zeros(H, D, dtype=torch.float64)},
        {"initial_state": torch.zeros(B + 1, H, D, D)},
        {"final_state": torch.zeros(B, H, D, D, dtype=torch.float16)},
        {"out": torch.empty(B, T, H, D, dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)},
        {"lower_bound": None},
        {"v": torch.zeros(B, T, H + 1, D, dtype=torch.bfloat16)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_well_formed_leaves_the_unusual_to_the_ordered_checks(changes):
    """Anything unusual or wrong is not accepted by the tight pass (so _validate names it, or accepts an int)."""
    x = {**inputs(), **changes}
    assert validation.well_formed(*_args(x)) is None


# --- pooled states (state_indices) -------------------------------------------------------------------------

P = 4  # pool slots of the pooled calls below (N = B = 2 sequences)


def pool_inputs(*, indices=(3, 0), index_dtype=torch.int64, P: int = P, state=torch.float32) -> dict:
    """Valid pooled CPU arguments: B = 2 sequences with slots ``indices`` of two pools of ``P`` slots."""
    x = inputs(B=2, state=None)
    x["initial_state"] = torch.randn(P, H, D, D).to(state)
    x["final_state"] = torch.zeros(P, H, D, D, dtype=state)
    x["state_indices"] = torch.tensor(indices, dtype=index_dtype)
    return x


def pool_raises(exc: type[Exception], pattern: str, **changes):
    with pytest.raises(exc, match=pattern):
        flash_kda.fwd(**{**pool_inputs(), **changes})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_state_indices_dtype(dtype):
    pool_raises(TypeError, rf"state_indices must be int64 or int32, got state_indices.dtype={dtype}",
                state_indices=torch.tensor([3, 0]).to(dtype))


@pytest.mark.parametrize("shape", [(3,), (1,), (1, 2), (3, 2), (2, 0), (2, 1, 1), ()])
def test_state_indices_shape(shape):
    pool_raises(ValueError, re.escape("state_indices must be 1-D [N] = [2] (one slot per sequence) or 2-D [N, L] = "
                                      "[2, L] with L >= 1 (a slot per token), got "
                                      f"state_indices.shape=torch.Size({list(shape)})"),
                state_indices=torch.zeros(shape, dtype=torch.int64))


def test_state_indices_shape_varlen_counts_sequences():
    x = varlen_inputs()  # N = 3
    x["state_indices"] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=re.escape("state_indices must be 1-D [N] = [3]")):
        flash_kda.fwd(**x)


def test_state_indices_device():
    pool_raises(ValueError, r"all tensors must be on one device, got q.device=cpu but state_indices.device=meta",
                state_indices=torch.zeros(2, dtype=torch.int64, device="meta"))


def test_state_indices_not_a_tensor():
    pool_raises(TypeError, r"state_indices must be a torch.Tensor or None, got type\(t\)=<class 'list'>",
                state_indices=[3, 0])


def test_state_indices_non_contiguous():
    pool_raises(ValueError, r"state_indices must be contiguous, got state_indices.stride\(\)=\(2,\)",
                state_indices=torch.tensor([3, 1, 0, 2])[::2])


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("indices, n, value", [((4, 0), 0, 4), ((0, 9), 1, 9), ((-1, 4), 1, 4)])
def test_state_indices_past_the_pool_are_refused_on_the_host(indices, n, value, index_dtype):
    pool_raises(ValueError, re.escape(f"state_indices[{n}] = {value} is past the pool's last slot (P = 4"),
                state_indices=torch.tensor(indices, dtype=index_dtype))


def test_duplicate_state_indices_are_refused_when_written():
    pool_raises(ValueError, re.escape("state_indices[0] and state_indices[1] both name slot 2; with final_state given"),
                state_indices=torch.tensor([2, 2]))


def test_duplicate_state_indices_are_accepted_when_only_read():
    x = pool_inputs(indices=(2, 2))
    x["final_state"] = None
    flash_kda.fwd(**x)


def test_padding_indices_may_repeat():
    x = pool_inputs(indices=(-1, -1))
    before = x["final_state"].clone()
    flash_kda.fwd(**x)
    assert torch.equal(x["final_state"], before)  # no slot named: nothing written


def test_check_state_indices_names_the_first_duplicate_pair():
    with pytest.raises(ValueError, match=re.escape("state_indices[1] and state_indices[4] both name slot 5")):
        validation.check_state_indices(torch.tensor([0, 5, -1, 2, 5, -1]), 6, writes=True)
    validation.check_state_indices(torch.tensor([0, 5, -1, 2, 5, -1]), 6, writes=False)
    validation.check_state_indices(torch.tensor([-3, -3, 1]), 2, writes=True)


def test_state_indices_need_a_pool():
    pool_raises(ValueError, r"state_indices needs initial_state or final_state \(the pools \[P, H, V, K\] it "
                r"indexes\), got neither", initial_state=None, final_state=None)


@pytest.mark.parametrize("name", ["initial_state", "final_state"])
@pytest.mark.parametrize("shape", [(0, H, D, D), (P, H + 1, D, D), (P, H, D, D // 2), (H, D, D)])
def test_pool_shape(name, shape):
    other = "final_state" if name == "initial_state" else "initial_state"
    pool_raises(ValueError, re.escape(f"{name} must be a pool [P, H, V, K] = [P, {H}, {D}, {D}] with P >= 1"),
                **{name: torch.zeros(shape), other: None})


def test_pools_of_two_sizes_are_refused():
    pool_raises(ValueError, r"initial_state and final_state must be pools of one size P",
                final_state=torch.zeros(P + 1, H, D, D))


def test_pools_may_be_smaller_than_the_batch():
    x = pool_inputs(indices=(0, -1), P=1)
    flash_kda.fwd(**x)


def test_pool_overlapping_state_indices_is_refused():
    x = pool_inputs()
    x["state_indices"] = x["final_state"].view(-1)[:2].view(torch.int32)  # two int32 zeros inside the pool
    with pytest.raises(ValueError, match="final_state overlaps state_indices in memory"):
        flash_kda.fwd(**x)


def test_pool_in_place_is_accepted_and_other_overlaps_refused():
    x = pool_inputs()
    x["final_state"] = x["initial_state"]
    flash_kda.fwd(**x)
    x = pool_inputs()
    both = torch.zeros(P + 1, H, D, D)
    x["initial_state"], x["final_state"] = both[:P], both[1:]  # one slot apart: not in place
    with pytest.raises(ValueError, match="final_state overlaps initial_state in memory"):
        flash_kda.fwd(**x)


def test_host_copies_layout():
    # cu_seqlens copy first (16-byte granules), then the state indices' int64 copy, then num_accepted_tokens' int64
    # copy, all 16-byte aligned
    assert planning.host_copies(100, 3, False, False) == (112, 112, 112, 100)
    assert planning.host_copies(100, 3, True, False) == (112, 144, 144, 144)
    assert planning.host_copies(100, 3, False, True) == (112, 112, 144, 144)
    assert planning.host_copies(100, 3, True, True) == (112, 144, 176, 176)
    assert planning.host_copies(100, 3, True, True, True) == (112, 144, 176, 208)
    assert planning.host_copies(100, 3, False, False, True) == (112, 112, 112, 144)
    # per-token indices [N, L]: N·L int64 slots (3 x 5 = 15: 120 bytes, 128 with the granule)
    assert planning.host_copies(100, 3, False, True, False, 5) == (112, 112, 240, 240)
    assert planning.host_copies(100, 3, True, True, True, 5) == (112, 144, 272, 304)
    assert planning.host_copies(100, 3, True, False, True, 5) == (112, 144, 144, 176)
    assert planning.host_state_indices_bytes(1) == 16 and planning.host_state_indices_bytes(3) == 32
    assert planning.host_num_accepted_tokens_bytes(1) == 16 and planning.host_num_accepted_tokens_bytes(3) == 32


def test_state_indices_with_cpu_tensors_need_no_extra_workspace():
    x = pool_inputs()
    assert flash_kda.workspace_bytes(x["q"], None, x["state_indices"]) == flash_kda.workspace_bytes(x["q"])


@pytest.mark.parametrize("variant", ["pool", "pool_int32", "pool_in_place", "pool_initial_only", "pool_final_only"])
def test_well_formed_accepts_pooled_calls(variant):
    x = pool_inputs(index_dtype=torch.int32 if variant == "pool_int32" else torch.int64)
    if variant == "pool_in_place":
        x["final_state"] = x["initial_state"]
    elif variant == "pool_initial_only":
        x["final_state"] = None
    elif variant == "pool_final_only":
        x["initial_state"] = None
    args = (*_args(x), x["state_indices"])
    dims = validation.well_formed(*args)
    assert dims == (2, T, H, 2, H)
    assert dims == validation.validate(*args, concrete=True)


@pytest.mark.parametrize(
    "changes",
    [
        {"state_indices": torch.tensor([3.0, 0.0])},
        {"state_indices": torch.tensor([3, 0, 1])},
        {"state_indices": torch.tensor([3, 1, 0, 2])[::2]},
        {"initial_state": None, "final_state": None},
        {"final_state": torch.zeros(P + 1, H, D, D)},
        {"initial_state": torch.zeros(0, H, D, D), "final_state": None},
    ],
    ids=["dtype", "shape", "strided", "no_pool", "two_sizes", "empty_pool"],
)
def test_well_formed_leaves_bad_state_indices_to_the_ordered_checks(changes):
    x = {**pool_inputs(), **changes}
    assert validation.well_formed(*_args(x), x["state_indices"]) is None
    with pytest.raises((TypeError, ValueError)):
        validation.validate(*_args(x), x["state_indices"], concrete=True)


def test_fake_implementation_checks_state_indices():
    """The operator's fake implementation (what torch.compile traces) refuses bad indices with fwd's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_kda import ops

    x = pool_inputs()
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        fake["state_indices"] = mode.from_tensor(torch.tensor([0, 1, 2]))
        with pytest.raises(ValueError, match=re.escape("state_indices must be 1-D [N] = [2]")):
            ops._fwd_fake(*_args(fake), fake["state_indices"])


# --- per-token states (state_indices [N, L], num_accepted_tokens) ---------------------------------------------

L = 3  # slots per sequence of the per-token calls below (N = B = 2 sequences of T = 5 tokens, pools of P = 8)
TOKEN_P = 8


def token_inputs(*, indices=((3, 1, 5), (0, 2, 7)), accepted=(1, 3), index_dtype=torch.int64,
                 accepted_dtype=torch.int64) -> dict:
    """Valid per-token CPU arguments: B = 2 sequences, state_indices [2, L] into two pools of TOKEN_P slots."""
    x = pool_inputs(P=TOKEN_P)
    x["state_indices"] = torch.tensor(indices, dtype=index_dtype)
    x["num_accepted_tokens"] = None if accepted is None else torch.tensor(accepted, dtype=accepted_dtype)
    return x


def token_raises(exc: type[Exception], pattern: str, **changes):
    x = {**token_inputs(), **changes}
    before = x["out"].clone()
    with pytest.raises(exc, match=pattern):
        flash_kda.fwd(**x)
    assert torch.equal(x["out"].view(torch.int16), before.view(torch.int16)), "a refused call must write nothing"


def token_varlen_inputs(seqlens=(2, 0, 4), cu_dtype=torch.int64) -> dict:
    """Per-token varlen arguments: N = 3 sequences (one empty) with state_indices [3, L] into pools of TOKEN_P
    slots."""
    x = varlen_inputs(seqlens, cu_dtype)
    x["initial_state"] = torch.randn(TOKEN_P, H, D, D)
    x["final_state"] = torch.zeros(TOKEN_P, H, D, D)
    x["state_indices"] = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, -1]])
    x["num_accepted_tokens"] = None
    return x


TOKEN_VARIANTS = {
    "int64": {},
    "int32": dict(index_dtype=torch.int32, accepted_dtype=torch.int32),
    "mixed_dtypes": dict(index_dtype=torch.int32, accepted_dtype=torch.int64),
    "no_accepted": dict(accepted=None),
    "L1": dict(indices=((3,), (0,)), accepted=(1, 1)),
    "padding": dict(indices=((-1, -1, 5), (-1, 2, -1)), accepted=(1, 2)),
    "L_past_T": dict(indices=((0, 1, 2, 3, 4, 5, 5), (6, 7, -1, -1, -1, 5, 5)), accepted=(7, 1)),
}


@pytest.mark.parametrize("variant", list(TOKEN_VARIANTS))
def test_per_token_state_indices_are_accepted(variant):
    """[N, L] indices with or without num_accepted_tokens: the tight pass accepts them (no fallback) and agrees with
    the ordered checks; the call runs (the CPU path). L past T: the entries of tokens t >= T are never written, so
    they may repeat."""
    x = token_inputs(**TOKEN_VARIANTS[variant])
    assert accepted(x) == (2, T, H, 2, H)
    flash_kda.fwd(**x)


@pytest.mark.parametrize("variant", ["in_place", "final_only", "bf16_fp32", "gva", "varlen", "varlen_int32"])
def test_per_token_state_indices_are_accepted_with_other_options(variant):
    x = token_inputs()
    n = 2
    if variant == "in_place":
        x["final_state"] = x["initial_state"]
    elif variant == "final_only":
        x["initial_state"] = None
    elif variant == "bf16_fp32":
        x["initial_state"] = x["initial_state"].to(torch.bfloat16)
    elif variant == "gva":
        x = {**inputs(G=G, B=2, state=None), "initial_state": torch.zeros(TOKEN_P, HV, D, D),
             "final_state": torch.zeros(TOKEN_P, HV, D, D), "state_indices": x["state_indices"],
             "num_accepted_tokens": x["num_accepted_tokens"], "gate": "softplus", "lower_bound": None}
        assert accepted(x) == (2, T, HV, 2, H)
        flash_kda.fwd(**x)
        return
    elif variant.startswith("varlen"):
        x = token_varlen_inputs(cu_dtype=torch.int32 if variant == "varlen_int32" else torch.int64)
        x["num_accepted_tokens"] = torch.tensor([2, 1, 3])
        n = 3
    assert accepted(x) == (x["q"].shape[0], x["q"].shape[1], H, n, H)
    flash_kda.fwd(**x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_num_accepted_tokens_dtype(dtype):
    token_raises(TypeError, re.escape(f"num_accepted_tokens must be int64 or int32, got "
                                      f"num_accepted_tokens.dtype={dtype}"),
                 num_accepted_tokens=torch.tensor([1, 2]).to(dtype))


def test_num_accepted_tokens_not_a_tensor():
    token_raises(TypeError, r"num_accepted_tokens must be a torch.Tensor or None, got type\(t\)=<class 'list'>",
                 num_accepted_tokens=[1, 2])


def test_num_accepted_tokens_device():
    token_raises(ValueError, r"all tensors must be on one device, got q.device=cpu but num_accepted_tokens.device=meta",
                 num_accepted_tokens=torch.ones(2, dtype=torch.int64, device="meta"))


def test_num_accepted_tokens_non_contiguous():
    token_raises(ValueError, r"num_accepted_tokens must be contiguous, got num_accepted_tokens.stride\(\)=\(2,\)",
                 num_accepted_tokens=torch.tensor([1, 9, 2, 9])[::2])


def test_per_token_state_indices_non_contiguous():
    token_raises(ValueError, r"state_indices must be contiguous, got state_indices.stride\(\)=\(1, 2\)",
                 state_indices=torch.tensor([[3, 0], [1, 2], [5, 7]]).t())


@pytest.mark.parametrize("shape", [(3,), (1,), (2, 1), ()])
def test_num_accepted_tokens_shape(shape):
    token_raises(ValueError, re.escape("num_accepted_tokens must be 1-D [N] = [2] (one count per sequence), got "
                                       f"num_accepted_tokens.shape=torch.Size({list(shape)})"),
                 num_accepted_tokens=torch.ones(shape, dtype=torch.int64))


def test_num_accepted_tokens_shape_varlen_counts_sequences():
    x = token_varlen_inputs()
    x["num_accepted_tokens"] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens must be 1-D [N] = [3]")):
        flash_kda.fwd(**x)


def test_num_accepted_tokens_needs_per_token_state_indices():
    accepted_counts = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens needs per-token state_indices [N, L] (it "
                                                   "picks each sequence's starting slot among its L), got "
                                                   "state_indices=None")):
        flash_kda.fwd(**inputs(B=2), num_accepted_tokens=accepted_counts)
    pool_raises(ValueError, re.escape("num_accepted_tokens needs per-token state_indices [N, L] (it picks each "
                                      "sequence's starting slot among its L), got "
                                      "state_indices.shape=torch.Size([2])"),
                num_accepted_tokens=accepted_counts)


def test_per_token_state_indices_need_final_state():
    token_raises(ValueError, re.escape("state_indices [N, L] (per-token states) writes the state after each token into "
                                       "final_state, got final_state=None with state_indices.shape=torch.Size([2, 3]) "
                                       "(pass final_state=initial_state to write the pool in place)"),
                 final_state=None)


def test_per_token_state_indices_need_a_pool():
    token_raises(ValueError, r"state_indices needs initial_state or final_state \(the pools \[P, H, V, K\] it "
                 r"indexes\), got neither", initial_state=None, final_state=None)


def test_per_token_pools_of_two_sizes_are_refused():
    token_raises(ValueError, r"initial_state and final_state must be pools of one size P",
                 final_state=torch.zeros(TOKEN_P + 1, H, D, D))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "indices, entry, value", [(((8, 1, 5), (0, 2, 7)), "[0, 0]", 8), (((3, 1, 5), (0, 2, 99)), "[1, 2]", 99)],
)
def test_per_token_state_indices_past_the_pool_are_refused_on_the_host(indices, entry, value, index_dtype):
    token_raises(ValueError, re.escape(f"state_indices{entry} = {value} is past the pool's last slot (P = 8"),
                 state_indices=torch.tensor(indices, dtype=index_dtype))


def test_per_token_index_past_the_pool_is_refused_even_where_nothing_is_written():
    """Every index is checked against P, also those of tokens past a sequence's end (T = 5 < L = 6 here)."""
    token_raises(ValueError, re.escape("state_indices[1, 5] = 8 is past the pool's last slot (P = 8"),
                 state_indices=torch.tensor([[0, 1, 2, 3, 4, -1], [5, 6, 7, -1, -1, 8]]), num_accepted_tokens=None)


@pytest.mark.parametrize(
    "indices, first, second, slot",
    [(((3, 1, 5), (0, 1, 7)), "[0, 1]", "[1, 1]", 1), (((3, 3, 5), (0, 2, 7)), "[0, 0]", "[0, 1]", 3),
     (((3, 1, 5), (0, 2, 3)), "[0, 0]", "[1, 2]", 3)],
)  # fmt: skip
def test_per_token_duplicate_written_slots_are_refused(indices, first, second, slot):
    token_raises(ValueError, re.escape(f"state_indices{first} and state_indices{second} both name slot {slot}; each "
                                       "slot may be written once"),
                 state_indices=torch.tensor(indices))


def test_per_token_duplicates_among_unwritten_entries_are_accepted():
    """Varlen (2, 0, 4) with L = 3: sequence 0 writes t < 2, sequence 1 nothing, sequence 2 t < 3; the other entries
    may name written slots (they only may be read: as a starting slot)."""
    x = token_varlen_inputs()
    x["state_indices"] = torch.tensor([[0, 1, 1], [0, 1, 2], [2, 3, 4]])
    x["num_accepted_tokens"] = torch.tensor([3, 2, 1])
    flash_kda.fwd(**x)
    x["state_indices"] = torch.tensor([[0, 1, 1], [0, 1, 2], [2, 3, 1]])  # (2, 2) is written, as is (0, 1)
    with pytest.raises(ValueError, match=re.escape("state_indices[0, 1] and state_indices[2, 2] both name slot 1")):
        flash_kda.fwd(**x)


@pytest.mark.parametrize("variant", ["in_place", "two_pools", "empty_reader", "own_slot"])
def test_per_token_starting_slot_written_by_another_sequence(variant):
    """Varlen (2, 0, 4) with L = 3. In place, a slot that one sequence starts from and another writes is read and
    written by different CTAs in no fixed order: refused where the host knows the lengths. Two pools are read and
    written apart; an empty sequence reads nothing; a sequence's own written slot is read before it is written."""
    x = token_varlen_inputs()
    x["state_indices"] = torch.tensor([[0, 1, 6], [3, 4, 5], [6, 7, 2]])  # sequence 0 starts from slot 6 ...
    x["num_accepted_tokens"] = torch.tensor([3, 1, 1])  # ... which sequence 2 writes (its token 0)
    if variant != "two_pools":
        x["final_state"] = x["initial_state"]
    if variant == "empty_reader":
        x["state_indices"] = torch.tensor([[0, 1, 2], [3, 6, 5], [6, 7, 4]])
        x["num_accepted_tokens"] = torch.tensor([3, 2, 1])  # sequence 1 (no token) names slot 6
    if variant == "own_slot":
        x["num_accepted_tokens"] = torch.tensor([2, 1, 1])  # sequence 0 starts from its own slot 1
    if variant != "in_place":
        flash_kda.fwd(**x)
        return
    with pytest.raises(ValueError, match=re.escape("state_indices[0, 2] = 6, sequence 0's starting slot, is written by "
                                                   "state_indices[2, 0] (another sequence's token state)")):
        flash_kda.fwd(**x)
    with pytest.raises(ValueError, match=re.escape("state_indices[0, 2] = 6, sequence 0's starting slot")):
        validation.check_token_state_reads(x["state_indices"], TOKEN_P, torch.tensor([2, 0, 4]),
                                           x["num_accepted_tokens"])


def test_check_state_indices_per_token():
    indices = torch.tensor([[0, 5, -1], [2, -1, 5], [-1, -1, 4]])
    with pytest.raises(ValueError, match=re.escape("state_indices[0, 1] and state_indices[1, 2] both name slot 5")):
        validation.check_state_indices(indices, 6, writes=True, lengths=torch.tensor([3, 3, 3]))
    validation.check_state_indices(indices, 6, writes=True, lengths=torch.tensor([3, 2, 3]))  # (1, 2) not written
    validation.check_state_indices(indices, 6, writes=True, lengths=torch.tensor([1, 9, 0]))  # (0, 1) not written
    validation.check_state_indices(indices, 6, writes=True)  # lengths unknown (a CUDA cu_seqlens): no duplicate check
    validation.check_state_indices(indices, 6, writes=False, lengths=torch.tensor([3, 3, 3]))
    with pytest.raises(ValueError, match=re.escape("state_indices[2, 2] = 4 is past the pool's last slot (P = 4")):
        validation.check_state_indices(torch.tensor([[0, 1, -1], [2, -1, 3], [-1, -1, 4]]), 4, writes=False)
    assert validation.sequence_lengths(None, 3, 7).tolist() == [7, 7, 7]
    assert validation.sequence_lengths(torch.tensor([0, 2, 2, 6], dtype=torch.int32), 1, 6).tolist() == [2, 0, 4]


@pytest.mark.parametrize("accepted_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("counts, n, value", [((0, 1), 0, 0), ((1, 4), 1, 4), ((3, -2), 1, -2), ((-1, 9), 0, -1)])
def test_num_accepted_tokens_outside_one_to_L_are_refused_on_the_host(counts, n, value, accepted_dtype):
    token_raises(ValueError, re.escape(f"num_accepted_tokens[{n}] = {value} is outside [1, L] = [1, {L}] (L: "
                                       "state_indices.shape[1]; sequence n starts from slot "
                                       "state_indices[n, num_accepted_tokens[n] - 1])"),
                 num_accepted_tokens=torch.tensor(counts, dtype=accepted_dtype))


def test_check_num_accepted_tokens():
    validation.check_num_accepted_tokens(torch.tensor([1, 2, 3]), 3)
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens[2] = 3 is outside [1, L] = [1, 2]")):
        validation.check_num_accepted_tokens(torch.tensor([1, 2, 3], dtype=torch.int32), 2)


def test_per_token_state_indices_overlapping_an_output_are_refused():
    x = token_inputs()
    x["num_accepted_tokens"] = x["final_state"].view(-1)[:2].view(torch.int32)  # two int32 zeros inside the pool
    with pytest.raises(ValueError, match="final_state overlaps num_accepted_tokens in memory"):
        flash_kda.fwd(**x)


def test_per_token_state_indices_with_cpu_tensors_need_no_extra_workspace():
    x = token_inputs()
    assert (flash_kda.workspace_bytes(x["q"], None, x["state_indices"], num_accepted_tokens=x["num_accepted_tokens"])
            == flash_kda.workspace_bytes(x["q"]))


def test_workspace_counts_the_host_copies_of_per_token_indices(monkeypatch):
    """CPU state_indices [N, L] and num_accepted_tokens beside CUDA q: N·L and N int64 copies behind the kernels'
    bytes (fake CUDA tensors: no GPU needed; the SM count is given)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setitem(planning._sm_counts, 0, 132)
    indices = torch.zeros(3, 5, dtype=torch.int32)
    one_per_sequence = indices[:, 0].contiguous()
    counts = torch.ones(3, dtype=torch.int32)
    with FakeTensorMode():
        q = torch.empty(3, 40, 2, D, dtype=torch.bfloat16, device="cuda:0")
        kernel = flash_kda.workspace_bytes(q)
        base = -(-kernel // 16) * 16
        assert flash_kda.workspace_bytes(q, None, one_per_sequence) == base + 32
        assert flash_kda.workspace_bytes(q, None, indices) == base + 128  # 15 slots: 120 bytes in 16-byte granules
        assert flash_kda.workspace_bytes(q, None, indices, num_accepted_tokens=counts) == base + 128 + 32
        assert flash_kda.workspace_bytes(q, None, None, num_accepted_tokens=counts) == base + 32


# Calls with per-token indices that validate refuses: the tight pass must not accept any of them.
TOKEN_ERRORS = {
    "accepted_without_2d": dict(state_indices=torch.tensor([3, 0]), num_accepted_tokens=torch.tensor([1, 1])),
    "accepted_dtype": dict(num_accepted_tokens=torch.tensor([1.0, 1.0])),
    "accepted_shape": dict(num_accepted_tokens=torch.tensor([1, 1, 1])),
    "accepted_2d": dict(num_accepted_tokens=torch.tensor([[1], [1]])),
    "accepted_strided": dict(num_accepted_tokens=torch.tensor([1, 9, 1, 9])[::2]),
    "accepted_list": dict(num_accepted_tokens=[1, 1]),
    "accepted_meta": dict(num_accepted_tokens=torch.ones(2, dtype=torch.int64, device="meta")),
    "no_final_state": dict(final_state=None),
    "L0": dict(state_indices=torch.zeros(2, 0, dtype=torch.int64)),
    "N_mismatch": dict(state_indices=torch.zeros(3, 2, dtype=torch.int64)),
    "3d": dict(state_indices=torch.zeros(2, 1, 1, dtype=torch.int64)),
    "strided": dict(state_indices=torch.tensor([[3, 0], [1, 2], [5, 7]]).t()),
    "indices_dtype": dict(state_indices=torch.zeros(2, 3, dtype=torch.int16)),
    "no_pool": dict(initial_state=None, final_state=None),
}


@pytest.mark.parametrize("changes", list(TOKEN_ERRORS.values()), ids=list(TOKEN_ERRORS))
def test_well_formed_never_accepts_bad_per_token_arguments(changes):
    x = {**token_inputs(), **changes}
    assert_both_refuse(x)


def test_well_formed_never_accepts_num_accepted_tokens_without_state_indices():
    x = {**inputs(B=2), "num_accepted_tokens": torch.tensor([1, 1])}
    assert_both_refuse(x, ValueError, match="num_accepted_tokens needs per-token state_indices")


def test_fake_implementation_checks_per_token_arguments():
    """The operator's fake implementation accepts per-token indices with num_accepted_tokens and refuses bad ones
    with fwd's messages (contents are not read while tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_kda import ops

    x = token_inputs(accepted=(0, 99))  # out of range: a content check, not done on fake tensors
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        ops._fwd_fake(*_full_args(fake))
        with pytest.raises(ValueError, match=re.escape("num_accepted_tokens must be 1-D [N] = [2]")):
            ops._fwd_fake(*_full_args({**fake, "num_accepted_tokens": mode.from_tensor(torch.ones(3, dtype=torch.int64))}))
        with pytest.raises(ValueError, match="per-token states\\) writes the state after each token into final_state"):
            ops._fwd_fake(*_full_args({**fake, "final_state": None}))


# --- the decode kernel's plan -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, expected",
    [((128, 1, 128, 32, False), True), ((512, 1, 512, 8, False), True), ((1024, 16, 64, 32, False), True),
     ((1088, 17, 64, 32, False), False), ((512, 512, 128, 32, True), True), ((2048, 2048, 128, 32, True), True),
     ((2049, 2049, 128, 32, True), False), ((0, 0, 4, 4, True), True), ((16, 16, 1, 96, False), True),
     ((8192, 8192, 64, 32, True), False), ((8192, 8192, 1, 96, False), False)],
    ids=str,
)  # fmt: skip
def test_plan_runs_short_sequences_on_the_decode_kernel(shape, expected):
    """Fixed-length batches of at most 16 tokens and varlen batches of at most 16 tokens per sequence (mean: the
    host never reads cu_seqlens) run the decode kernel, whose plan is nothing else and needs no workspace."""
    from flash_kda import _ext, testing

    total, T, N, H, varlen = shape
    plan = testing.default_plan(total, T, N, H, varlen, 132)
    assert plan.decode == expected
    if expected:
        assert plan == flash_kda.Plan(decode=True) == flash_kda.Plan(1, 1, 0, False, -1, 0, False, True)
        B = 1 if varlen else N
        assert planning.plan_for(B, total // B if B else 0, H, N, varlen, 132) == (plan, 0)
        assert _ext.load().workspace_bytes(total, N, H, 0, False, 0, False, True) == 0


def test_decode_plan_needs_no_workspace():
    q = torch.zeros(128, 1, 32, 128, dtype=torch.bfloat16)
    assert flash_kda.plan(q).decode
    assert flash_kda.workspace_bytes(q) == 0
    cu = torch.arange(0, 129 * 4, 4, dtype=torch.int64)  # 128 sequences of 4 tokens
    q = torch.zeros(1, 512, 32, 128, dtype=torch.bfloat16)
    assert flash_kda.plan(q, cu).decode
    assert flash_kda.workspace_bytes(q, cu) == 0


def test_force_plan_decode():
    """decode=True runs the decode kernel on any shape; decode=False, or forcing any other part, a chunked plan."""
    from flash_kda import _ext, testing

    C = _ext.load()
    decode = flash_kda.Plan(decode=True)
    assert C.choose_plan(8192, 8192, 1, 96, False, 132, decode=True) == decode
    assert not C.choose_plan(128, 1, 128, 32, False, 132, decode=False).decode
    for kwargs in ({"v_split": 2}, {"segment_chunks": 0}, {"single_pass": False}, {"single_pass": True},
                   {"lead_chunks": -1}, {"lead_chunks": 0}, {"scan_v_split": 2}):
        assert not C.choose_plan(128, 1, 128, 32, False, 132, **kwargs).decode, kwargs
    long_q = torch.zeros(1, 8192, 96, 128, dtype=torch.bfloat16)
    short_q = torch.zeros(128, 1, 32, 128, dtype=torch.bfloat16)
    with testing.force_plan(decode=True):
        assert flash_kda.plan(long_q) == decode
        assert flash_kda.workspace_bytes(long_q) == 0
    with testing.force_plan(decode=False):
        assert not flash_kda.plan(short_q).decode  # (the single pass here: no workspace either)
    with testing.force_plan(v_split=2):
        assert flash_kda.plan(short_q) == flash_kda.Plan(2, 2, 0, False)
    with testing.force_plan(v_split=2, decode=False):
        assert flash_kda.plan(short_q) == flash_kda.Plan(2, 2, 0, False)
    assert flash_kda.plan(short_q) == decode


def test_decode_chunk_step_choice():
    """Under a decode plan the chunk step runs calls of at least 16 tokens per sequence on average without per-token
    states, checkpoints or not; the token-by-token kernel runs the rest (kda_plan.h, decode_chunk_runs)."""
    from flash_kda import planning

    assert planning.decode_chunk_runs(64 * 16, 64)
    assert planning.decode_chunk_runs(8192, 1)
    assert not planning.decode_chunk_runs(64 * 16 - 1, 64)
    assert not planning.decode_chunk_runs(128 * 4, 128)
    assert not planning.decode_chunk_runs(128, 128)
    assert not planning.decode_chunk_runs(0, 0)
    assert not planning.decode_chunk_runs(64 * 16, 64, state_tokens=4)


def test_stream_pass_choice():
    """Under a decode plan the stream pass runs fixed-length calls of exactly 16 tokens per sequence without per-token
    states, checkpoints or an fp32 final state, of at least one (sequence, head) item per SM and fewer than 2^31
    items (kda_plan.h, stream_pass_runs); every other call keeps the decode kernels."""
    from flash_kda import planning

    def runs(varlen=False, seqlen=16, state_tokens=0, checkpoints=False, fp32_final=False, items=64 * 32, sms=132):
        return planning.stream_pass_runs(varlen, seqlen, state_tokens, checkpoints, fp32_final=fp32_final,
                                         items=items, sm_count=sms)

    assert runs()
    assert runs(items=132)
    assert not runs(items=131)
    assert not runs(items=32)  # one sequence of 32 heads: the decode slice's small cases stay on the chunk step
    assert not runs(fp32_final=True)
    assert not runs(varlen=True)
    assert not runs(seqlen=15)
    assert not runs(seqlen=1)
    assert not runs(state_tokens=4)
    assert not runs(checkpoints=True)
    assert not runs(items=0, sms=0)
    assert runs(items=2**31 - 1)
    assert not runs(items=2**31)  # its preparing warps count items in 32 bits
    with pytest.raises(ValueError, match="items"):
        runs(items=-1)


def test_stream_pass_cases_take_the_route_they_name():
    """The matrix's stream-pass cases reach the stream pass on a 132-SM H100 or H200 (every one but the fp32 final
    state), so a route that broke alike in the kernel and the twin cannot leave the matrix green on the chunk step."""
    import matrix

    cases = matrix._stream_pass_cases()
    stays = [c for c in cases if not matrix.stream_pass_route(c, 132)]
    assert [(c.final_dtype or c.state_dtype, c.gate, c.T) for c in stays] == [("fp32", "lower_bound", 16)]
    assert len(cases) - len(stays) == 9


@pytest.mark.parametrize(
    "kwargs",
    [{"v_split": 2}, {"scan_v_split": 2}, {"segment_chunks": 0}, {"single_pass": True}, {"single_pass": False},
     {"lead_chunks": -1}, {"lead_chunks": 3}],
    ids=str,
)  # fmt: skip
def test_force_plan_refuses_decode_with_other_choices(kwargs):
    from flash_kda import testing

    with pytest.raises(ValueError, match="decode=True runs the decode kernel alone"):
        with testing.force_plan(decode=True, **kwargs):
            pass


@pytest.mark.parametrize("decode", [1, 0, "yes"])
def test_force_plan_refuses_bad_decode(decode):
    from flash_kda import testing

    with pytest.raises(ValueError, match="decode must be None"):
        with testing.force_plan(decode=decode):
            pass


def test_plan_type_has_the_decode_field():
    """flash_kda.Plan behaves like a NamedTuple with the decode field last: repr, eq, hash, iter, _asdict,
    _replace and pickling all see it."""
    import pickle

    plan = flash_kda.Plan(decode=True)
    chunked = flash_kda.Plan()
    assert plan.decode and not chunked.decode
    assert repr(plan) == ("Plan(v_split=1, scan_v_split=1, segment_chunks=0, single_pass=False, lead_chunks=-1, "
                          "tail_ctas=0, longest_first=False, decode=True)")
    assert plan != chunked and hash(plan) != hash(chunked)
    assert tuple(plan) == (1, 1, 0, False, -1, 0, False, True)
    assert list(plan._asdict()) == ["v_split", "scan_v_split", "segment_chunks", "single_pass", "lead_chunks",
                                    "tail_ctas", "longest_first", "decode"]
    assert chunked._replace(decode=True) == plan and plan._replace(decode=False) == chunked
    assert plan._replace(v_split=2).decode
    assert pickle.loads(pickle.dumps(plan)) == plan


# --- prefix-cache checkpoints (checkpoint_indices [N, M], checkpoint_every) ------------------------------------------

CHECKPOINT_P = 8  # pool slots of the checkpoint calls below (N = B = 2 sequences in slots 3 and 0)


def checkpoint_inputs(*, indices=((4, 5), (6, -1)), index_dtype=torch.int64, every=16, T: int = T) -> dict:
    """Valid checkpoint CPU arguments: B = 2 sequences of T tokens in slots (3, 0) of two pools of CHECKPOINT_P slots,
    checkpoint_indices [2, M] = ``indices`` every ``every`` tokens."""
    x = pool_inputs(P=CHECKPOINT_P)
    if T != x["q"].shape[1]:
        x = {**inputs(B=2, T=T, state=None), **{n: x[n] for n in ("initial_state", "final_state", "state_indices")}}
    x["checkpoint_indices"] = torch.tensor(indices, dtype=index_dtype).reshape(2, -1)
    x["checkpoint_every"] = every
    return x


def checkpoint_raises(exc: type[Exception], pattern: str, **changes):
    """fwd with the checkpoint arguments changed as given raises exc matching pattern, and writes nothing."""
    x = {**checkpoint_inputs(), **changes}
    before = x["out"].clone()
    pool = None if x["final_state"] is None else x["final_state"].clone()
    with pytest.raises(exc, match=pattern):
        flash_kda.fwd(**x)
    assert torch.equal(x["out"].view(torch.int16), before.view(torch.int16)), "a refused call must write nothing"
    if pool is not None:
        assert torch.equal(x["final_state"], pool), "a refused call must write nothing"


CHECKPOINT_VARIANTS = {
    "int64": {},
    "int32": dict(index_dtype=torch.int32),
    "M0": dict(indices=((), ())),
    "M1": dict(indices=((4,), (5,))),
    "negative": dict(indices=((-1, -7), (-1, -2))),
    "every_1024": dict(every=1024),
    "written": dict(T=40, indices=((4, 5, 6), (7, -1, 1))),  # two checkpoints each (16, 32 <= 40 tokens)
}


@pytest.mark.parametrize("variant", list(CHECKPOINT_VARIANTS))
def test_checkpoints_are_accepted(variant):
    """checkpoint_indices [N, M] with state_indices [N]: the tight pass accepts them (no fallback) and agrees with
    the ordered checks; the call runs (the CPU path)."""
    x = checkpoint_inputs(**CHECKPOINT_VARIANTS[variant])
    assert accepted(x) == (2, x["q"].shape[1], H, 2, H)
    flash_kda.fwd(**x)


# Slots written twice in one call (T = 32, C = 16: both checkpoints of each sequence are written, the second at its
# very end; the sequences' final slots are 3 and 0).
CHECKPOINT_COLLISIONS = {
    "two_sequences": (((4, 5), (5, 6)), "checkpoint_indices[0, 1] and checkpoint_indices[1, 0] both write slot 5"),
    "another_final": (((4, 0), (6, 7)),
                      "state_indices[1] (sequence 1's final state) and checkpoint_indices[0, 1] both write slot 0"),
    "one_sequence_twice": (((4, 4), (6, 7)), "checkpoint_indices[0, 0] and checkpoint_indices[0, 1] both write slot 4"),
}


@pytest.mark.parametrize("variant", list(CHECKPOINT_COLLISIONS))
def test_checkpoint_slots_written_twice_are_refused(variant):
    """Different CTAs write the checkpoints and the final states in no fixed order (two sequences, or two segments
    of one under the time split): a slot written twice would be unspecified on CUDA, so the CPU path refuses it and
    names both writes."""
    indices, message = CHECKPOINT_COLLISIONS[variant]
    x = checkpoint_inputs(T=32, indices=indices)
    checkpoint_raises(ValueError, re.escape(message) + r"; each slot may be written once per call", **x)
    with pytest.raises(ValueError, match=re.escape(message)):
        validation.check_checkpoint_indices(x["checkpoint_indices"], CHECKPOINT_P, x["state_indices"],
                                            torch.tensor([32, 32]), 16)


@pytest.mark.parametrize("indices, T", [(((4, 3), (6, 0)), 32), (((3, 5), (0, 7)), 32), (((4, 5), (6, 5)), 20),
                                       (((4, -1), (-1, 5)), 32)],
                         ids=["own_final_at_the_end", "own_final_mid_sequence", "shared_but_not_written",
                              "negative_entries"])
def test_checkpoint_slots_that_are_not_written_twice_are_accepted(indices, T):
    """A checkpoint may name its own sequence's final slot, at the end or before it (the kernels leave that slot to
    the final state); a shared slot of an entry past its sequence's length is never written; negative entries
    write nothing. The final slots hold what the call without checkpoints leaves there, bit for bit."""
    x = checkpoint_inputs(T=T, indices=indices)
    plain = {**x, "final_state": x["final_state"].clone(), "out": x["out"].clone(),
             "checkpoint_indices": torch.full_like(x["checkpoint_indices"], -1)}
    flash_kda.fwd(**x)
    flash_kda.fwd(**plain)
    finals = x["state_indices"]
    assert torch.equal(x["final_state"][finals], plain["final_state"][finals])


@pytest.mark.parametrize("variant", ["in_place", "final_only", "bf16_pools", "gva_softplus", "varlen_int32"])
def test_checkpoints_are_accepted_with_other_options(variant):
    x = checkpoint_inputs()
    dims = (2, T, H, 2, H)
    if variant == "in_place":
        x["final_state"] = x["initial_state"]
    elif variant == "final_only":
        x["initial_state"] = None
    elif variant == "bf16_pools":
        x["initial_state"], x["final_state"] = x["initial_state"].bfloat16(), x["final_state"].bfloat16()
    elif variant == "gva_softplus":
        x = {**inputs(G=G, B=2, state=None), "initial_state": torch.zeros(CHECKPOINT_P, HV, D, D),
             "final_state": torch.zeros(CHECKPOINT_P, HV, D, D), "gate": "softplus", "lower_bound": None,
             **{n: x[n] for n in ("state_indices", "checkpoint_indices", "checkpoint_every")}}
        dims = (2, T, HV, 2, H)
    elif variant == "varlen_int32":
        x = {**varlen_inputs(cu_dtype=torch.int32), "initial_state": torch.zeros(CHECKPOINT_P, H, D, D),
             "final_state": torch.zeros(CHECKPOINT_P, H, D, D), "state_indices": torch.tensor([0, 1, 2]),
             "checkpoint_indices": torch.tensor([[3], [4], [-1]], dtype=torch.int32), "checkpoint_every": 16}
        dims = (1, T, H, 3, H)
    assert accepted(x) == dims
    flash_kda.fwd(**x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.uint8, torch.bool])
def test_checkpoint_indices_dtype(dtype):
    checkpoint_raises(TypeError, re.escape(f"checkpoint_indices must be int64 or int32, got "
                                           f"checkpoint_indices.dtype={dtype}"),
                      checkpoint_indices=torch.tensor([[4, 5], [6, 7]]).to(dtype))


def test_checkpoint_indices_not_a_tensor():
    checkpoint_raises(TypeError, r"checkpoint_indices must be a torch.Tensor or None, got type\(t\)=<class 'list'>",
                      checkpoint_indices=[[4, 5], [6, -1]])


def test_checkpoint_indices_device():
    checkpoint_raises(ValueError, r"all tensors must be on one device, got q.device=cpu but "
                      r"checkpoint_indices.device=meta",
                      checkpoint_indices=torch.zeros(2, 2, dtype=torch.int64, device="meta"))


def test_checkpoint_indices_on_the_host_beside_cuda_tensors_are_refused(monkeypatch):
    """A CUDA call reads checkpoint_indices on the device at every launch (never copied from the host): a CPU tensor
    beside CUDA q is refused by name (fake CUDA tensors: no GPU needed; the GPU test runs the real call)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = checkpoint_inputs()
    host = x["checkpoint_indices"]
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {n: mode.from_tensor(t).to("cuda:0") if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        fake["checkpoint_indices"] = mode.from_tensor(host)  # stays on the CPU
        with pytest.raises(ValueError, match=re.escape(
                "checkpoint_indices must be on q's device (the kernels read it at every launch; it is not copied "
                "from the host), got checkpoint_indices.device=cpu with q.device=cuda:0")):
            validation.validate(*_full_args(fake), concrete=False)
        # the host index arguments may stay on the CPU: only checkpoint_indices is refused there
        fake["checkpoint_indices"] = mode.from_tensor(host).to("cuda:0")
        fake["state_indices"] = mode.from_tensor(x["state_indices"])
        assert validation.validate(*_full_args(fake), concrete=False) == (2, T, H, 2, H)


def test_checkpoint_indices_non_contiguous():
    checkpoint_raises(ValueError, r"checkpoint_indices must be contiguous, got checkpoint_indices.stride\(\)=\(1, 2\)",
                      checkpoint_indices=torch.tensor([[4, 6], [5, -1]]).t())


@pytest.mark.parametrize("shape", [(2,), (3, 2), (1, 2), (2, 1, 1), (), (0, 2)])
def test_checkpoint_indices_shape(shape):
    checkpoint_raises(ValueError, re.escape("checkpoint_indices must be 2-D [N, M] = [2, M] (a slot for each of a "
                                            "sequence's M checkpoints, M >= 0), got "
                                            f"checkpoint_indices.shape=torch.Size({list(shape)})"),
                      checkpoint_indices=torch.full(shape, -1, dtype=torch.int64))


def test_checkpoint_indices_shape_varlen_counts_sequences():
    x = varlen_inputs()  # N = 3
    x.update(initial_state=torch.zeros(CHECKPOINT_P, H, D, D), final_state=torch.zeros(CHECKPOINT_P, H, D, D),
             state_indices=torch.tensor([0, 1, 2]), checkpoint_indices=torch.tensor([[3], [4]]), checkpoint_every=16)
    with pytest.raises(ValueError, match=re.escape("checkpoint_indices must be 2-D [N, M] = [3, M]")):
        flash_kda.fwd(**x)


def test_checkpoint_indices_need_state_indices():
    """Checkpoints go into the pool: dense states have none to write them to."""
    x = {**inputs(B=2), "checkpoint_indices": torch.tensor([[0], [1]]), "checkpoint_every": 16}
    before = x["final_state"].clone()
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint_indices needs state_indices [N] (one slot per sequence; checkpoints are written into the pool "
            "it indexes), got state_indices=None with checkpoint_indices.shape=torch.Size([2, 1])")):
        flash_kda.fwd(**x)
    # (bits, not values: the buffer is uninitialised and may hold NaN patterns, which never compare equal)
    assert torch.equal(x["final_state"].view(torch.int32), before.view(torch.int32)), "a refused call must write nothing"


def test_checkpoint_indices_refuse_per_token_state_indices():
    checkpoint_raises(ValueError, re.escape("checkpoint_indices needs state_indices [N] (one slot per sequence; "
                                            "checkpoints are written into the pool it indexes), got "
                                            "state_indices.shape=torch.Size([2, 3])"),
                      state_indices=torch.tensor([[3, 1, 2], [0, 7, -1]]))


def test_checkpoint_indices_need_final_state():
    checkpoint_raises(ValueError, re.escape("checkpoint_indices writes each checkpoint into the pool final_state, got "
                                            "final_state=None with checkpoint_indices.shape=torch.Size([2, 2]) (pass "
                                            "final_state=initial_state to write the pool in place)"),
                      final_state=None)


@pytest.mark.parametrize("every", [True, False, 16.0, "16", None, torch.tensor(16), np.float64(16), np.bool_(True)],
                         ids=repr)
def test_checkpoint_every_must_be_an_int(every):
    checkpoint_raises(TypeError, re.escape(f"checkpoint_every must be an int (tokens between checkpoints), got "
                                           f"checkpoint_every={every!r} of type(checkpoint_every)={type(every)!r}"),
                      checkpoint_every=every)


@pytest.mark.parametrize("every", [np.int64(16), np.int32(16), np.uint16(16)], ids=repr)
def test_checkpoint_every_may_be_a_numpy_integer(every):
    """A NumPy integer (e.g. read from a config array) is taken as the int it holds: the same call, the same bits."""
    x = checkpoint_inputs(every=every)
    plain = {**x, "checkpoint_every": 16, "out": x["out"].clone(), "final_state": x["final_state"].clone()}
    flash_kda.fwd(**x)
    flash_kda.fwd(**plain)
    assert torch.equal(x["final_state"], plain["final_state"]) and torch.equal(x["out"], plain["out"])


@pytest.mark.parametrize("every", [0, 8, 15, 17, 24, -16, 1000])
def test_checkpoint_every_must_be_a_positive_multiple_of_16(every):
    checkpoint_raises(ValueError, re.escape(f"checkpoint_every must be a positive multiple of 16 (checkpoints fall on "
                                            f"chunk boundaries), got checkpoint_every={every} with "
                                            "checkpoint_indices given"),
                      checkpoint_every=every)


@pytest.mark.parametrize("every", [16, -16, 7])
def test_checkpoint_every_needs_checkpoint_indices(every):
    checkpoint_raises(ValueError, re.escape(f"checkpoint_every needs checkpoint_indices (the slots the checkpoints go "
                                            f"to), got checkpoint_every={every} with checkpoint_indices=None"),
                      checkpoint_indices=None, checkpoint_every=every)
    x = {**inputs(), "checkpoint_every": every}  # (dense states too)
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_indices"):
        flash_kda.fwd(**x)


def test_checkpoint_every_zero_without_checkpoint_indices_is_the_plain_call():
    x = {**pool_inputs(), "checkpoint_indices": None, "checkpoint_every": 0}
    assert accepted(x) == (2, T, H, 2, H)
    flash_kda.fwd(**x)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "indices, entry, value",
    [(((8, 5), (6, -1)), "[0, 0]", 8), (((4, 5), (6, 99)), "[1, 1]", 99), (((4, 8), (9, -1)), "[0, 1]", 8)],
)
def test_checkpoint_indices_past_the_pool_are_refused_on_the_host(indices, entry, value, index_dtype):
    """Every entry is checked against P, also those whose checkpoint lies past the sequence's end (T = 5 < 16 here:
    nothing would be written)."""
    checkpoint_raises(ValueError, re.escape(f"checkpoint_indices{entry} = {value} is past the pool's last slot "
                                            f"(P = {CHECKPOINT_P}: the final_state pool's first dimension); negative "
                                            "entries mean no checkpoint"),
                      checkpoint_indices=torch.tensor(indices, dtype=index_dtype))


def test_check_checkpoint_indices():
    validation.check_checkpoint_indices(torch.tensor([[0, 5, -1], [2, -9, 5]]), 6)  # (repeats are not refused)
    validation.check_checkpoint_indices(torch.zeros(3, 0, dtype=torch.int32), 1)  # M = 0
    with pytest.raises(ValueError, match=re.escape("checkpoint_indices[1, 2] = 6 is past the pool's last slot (P = 6")):
        validation.check_checkpoint_indices(torch.tensor([[0, 5, -1], [2, -9, 6]], dtype=torch.int32), 6)
    with pytest.raises(ValueError, match=re.escape("checkpoint_indices[0, 0] = 3 is past the pool's last slot (P = 3")):
        validation.check_checkpoint_indices(torch.tensor([[3], [7]]), 3)


def test_checkpoint_indices_overlapping_an_output_are_refused():
    x = checkpoint_inputs()
    x["checkpoint_indices"] = x["final_state"].view(-1)[:4].view(torch.int32).view(2, 2)  # int32 zeros in the pool
    with pytest.raises(ValueError, match="final_state overlaps checkpoint_indices in memory"):
        flash_kda.fwd(**x)
    x = checkpoint_inputs()
    x["checkpoint_indices"] = x["out"].view(-1)[:8].view(torch.int32).view(2, 2)
    with pytest.raises(ValueError, match="out overlaps checkpoint_indices in memory"):
        flash_kda.fwd(**x)


# Calls with checkpoints that validate refuses: the tight pass must not accept any of them.
CHECKPOINT_ERRORS = {
    "dtype": dict(checkpoint_indices=torch.zeros(2, 2, dtype=torch.int16)),
    "list": dict(checkpoint_indices=[[4, 5], [6, 7]]),
    "meta": dict(checkpoint_indices=torch.zeros(2, 2, dtype=torch.int64, device="meta")),
    "strided": dict(checkpoint_indices=torch.tensor([[4, 6], [5, -1]]).t()),
    "1d": dict(checkpoint_indices=torch.tensor([4, 5])),
    "N_mismatch": dict(checkpoint_indices=torch.zeros(3, 2, dtype=torch.int64)),
    "no_state_indices": dict(state_indices=None, initial_state=torch.zeros(2, H, D, D),
                             final_state=torch.zeros(2, H, D, D)),
    "per_token": dict(state_indices=torch.tensor([[3, 1], [0, 7]])),
    "no_final_state": dict(final_state=None),
    "every_0": dict(checkpoint_every=0),
    "every_24": dict(checkpoint_every=24),
    "every_bool": dict(checkpoint_every=True),
    "every_float": dict(checkpoint_every=16.0),
    "every_without_indices": dict(checkpoint_indices=None),
    "every_float_zero_without_indices": dict(checkpoint_indices=None, checkpoint_every=0.0),
    "every_false_without_indices": dict(checkpoint_indices=None, checkpoint_every=False),
}


@pytest.mark.parametrize("changes", list(CHECKPOINT_ERRORS.values()), ids=list(CHECKPOINT_ERRORS))
def test_well_formed_never_accepts_bad_checkpoint_arguments(changes):
    x = {**checkpoint_inputs(), **changes}
    assert_both_refuse(x)


def test_fake_implementation_checks_checkpoint_arguments():
    """The operator's fake implementation accepts checkpoints and refuses bad ones with fwd's messages (contents are
    not read while tracing: an entry past the pool passes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_kda import ops

    x = checkpoint_inputs(indices=((99, 5), (6, -1)))
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
        ops._fwd_fake(*_full_args(fake))
        with pytest.raises(ValueError, match=re.escape("checkpoint_indices must be 2-D [N, M] = [2, M]")):
            ops._fwd_fake(*_full_args({**fake, "checkpoint_indices": mode.from_tensor(torch.zeros(3, 1,
                                                                                            dtype=torch.int64))}))
        with pytest.raises(ValueError, match="checkpoint_indices writes each checkpoint into the pool final_state"):
            ops._fwd_fake(*_full_args({**fake, "final_state": None}))
        with pytest.raises(ValueError, match="checkpoint_every must be a positive multiple of 16"):
            ops._fwd_fake(*_full_args({**fake, "checkpoint_every": 40}))


def test_compiled_call_takes_a_checkpoint_every_that_changes():
    """torch.compile traces an int argument that changed between calls as a symbol (a SymInt reaches the fake
    implementation): it is accepted as an int, and each compiled call equals the eager one (the CPU path)."""
    x = checkpoint_inputs(T=40, indices=((4, 5), (6, 7)))

    def call(out, final_state, every):
        flash_kda.fwd(**{**x, "out": out, "final_state": final_state, "checkpoint_every": every})
        return out

    compiled = torch.compile(call, fullgraph=True)
    for every in (16, 32, 48):
        got = (torch.empty_like(x["out"]), torch.full_like(x["final_state"], float("nan")))
        want = (torch.empty_like(x["out"]), torch.full_like(x["final_state"], float("nan")))
        compiled(*got, every)
        call(*want, every)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].isnan(), want[1].isnan()) and torch.equal(got[1].nan_to_num(), want[1].nan_to_num())


@pytest.mark.parametrize("overrides, pattern", [
    (planning.PlanOverrides(v_split=3), r"v_split must be None or one of \[1, 2, 4, 8\], got v_split=3"),
    (planning.PlanOverrides(segment_chunks=-5), r"segment_chunks must be None or an int in \[0, 2\^31\)"),
    (planning.PlanOverrides(decode=1), r"decode must be None, True or False"),
    ((2, None, None, None, None, None), r"overrides must be a planning.PlanOverrides, got tuple"),
], ids=["v_split_3", "segment_chunks_negative", "decode_int", "tuple"])
def test_planning_forced_checks_each_override(overrides, pattern):
    """planning.forced (public) refuses an override no plan has, before any plan is chosen under it."""
    exc = TypeError if isinstance(overrides, tuple) and not isinstance(overrides, planning.PlanOverrides) else ValueError
    with pytest.raises(exc, match=pattern), planning.forced(overrides):
        pass
