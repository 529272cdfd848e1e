"""flash_kda under torch.compile: ``torch.ops.flash_kda.fwd`` and its fake implementation.

CPU tests (CI): a module that calls ``flash_kda.fwd`` compiles with ``fullgraph=True`` (no graph break) and
gives bitwise the eager results on the CPU path, with the model options too (gate, allow_neg_eigval, grouped
value heads, absent A_log / dt_bias); the operator called directly equals ``fwd``; fake tensors on a CUDA device
(no GPU needed to trace) pass through the fake implementation, which raises the eager validation errors. GPU
test: the same module with CUDA tensors, compiled, equals eager bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_kda
from flash_kda import ops  # noqa: F401 -- registers torch.ops.flash_kda.fwd

D = 128


def make_inputs(device: str, *, B=1, T=40, H=2, seqlens=None, state=torch.float32, seed=0, G=1) -> dict:
    """Inputs of fwd on ``device``; G > 1: grouped value heads (q, k on H heads, the rest on G·H)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    N = B if seqlens is None else len(seqlens)
    cu = None
    if seqlens is not None:
        B, T = 1, sum(seqlens)
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int64, device=device)
    HV = G * H
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, HV, D), g=randn(B, T, HV, D), beta=randn(B, T, HV),
        A_log=randn(HV, dtype=torch.float32), dt_bias=randn(HV, D, dtype=torch.float32),
        initial_state=None if state is None else randn(N, HV, D, D, dtype=state), cu_seqlens=cu,
    )  # fmt: skip


class KdaLayer(torch.nn.Module):
    """The shape of a model's use: fresh output buffers, the forward, something computed from its results."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        out = torch.empty_like(v)
        final = None if initial_state is None else torch.empty_like(initial_state)
        flash_kda.fwd(q, k, v, g, beta, D**-0.5, out, A_log, dt_bias, -5.0, initial_state=initial_state,
                      final_state=final, cu_seqlens=cu_seqlens)
        return out * 2, final


class KdaOptionsLayer(torch.nn.Module):
    """A layer of a model with the options: the softplus gate without dt_bias, negative eigenvalues."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        out = torch.empty_like(v)
        final = None if initial_state is None else torch.empty_like(initial_state)
        flash_kda.fwd(q, k, v, g, beta, D**-0.5, out, A_log, None, None, initial_state=initial_state,
                      final_state=final, cu_seqlens=cu_seqlens, gate="softplus", allow_neg_eigval=True)
        return out * 2, final


def _run(module, x):
    return module(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"],
                  x["cu_seqlens"])


def _assert_same(compiled, eager):
    for a, b in zip(compiled, eager):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), f"compiled result differs from eager: max |diff| {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize(
    "shape", [dict(), dict(seqlens=(17, 0, 23), state=None)], ids=["fixed_fp32_state", "varlen_no_state"]
)
def test_compile_fullgraph_equals_eager_cpu(shape):
    torch._dynamo.reset()
    x = make_inputs("cpu", **shape)
    layer = KdaLayer()
    eager = _run(layer, x)
    compiled = _run(torch.compile(layer, fullgraph=True), x)  # fullgraph: a graph break raises
    _assert_same(compiled, eager)


@pytest.mark.parametrize("shape", [dict(G=2), dict(G=3, seqlens=(11, 0, 20), state=torch.bfloat16)],
                         ids=["gva_fixed", "gva_varlen"])
def test_compile_fullgraph_with_options_equals_eager_cpu(shape):
    torch._dynamo.reset()
    x = make_inputs("cpu", **shape)
    layer = KdaOptionsLayer()
    eager = _run(layer, x)
    compiled = _run(torch.compile(layer, fullgraph=True), x)
    _assert_same(compiled, eager)


def test_compile_fullgraph_takes_numpy_float64_scalars_and_a_huge_checkpoint_every_cpu():
    """NumPy float64 scale / lower_bound arguments of the compiled function, and a checkpoint_every past int64 (no
    sequence reaches it: no checkpoint written), trace into the operator and equal eager."""
    import numpy as np  # noqa: PLC0415

    torch._dynamo.reset()
    x = make_inputs("cpu", state=None)
    pool = torch.full((2, 2, D, D), float("nan"))

    def call(q, k, v, g, beta, scale, lower_bound, pool, every):
        out = torch.empty_like(v)
        flash_kda.fwd(q, k, v, g, beta, scale, out, None, None, lower_bound, None, pool,
                      state_indices=torch.tensor([0]), checkpoint_indices=torch.tensor([[1]]), checkpoint_every=every)
        return out, pool

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    eager = call(*args, D**-0.5, -5.0, pool.clone(), 2**63)
    compiled = torch.compile(call, fullgraph=True)(*args, np.float64(D**-0.5), np.float64(-5.0), pool.clone(), 2**63)
    _assert_same((compiled[0], compiled[1][0]), (eager[0], eager[1][0]))  # out and the final state's slot
    assert torch.isnan(compiled[1][1]).all(), "a checkpoint past every sequence's end was written"


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
def test_compile_refuses_a_tensor_requiring_grad_under_grad_mode_cpu(fullgraph):
    """The operator runs with grad mode off (its fake implementation too), so fwd refuses a tensor that requires
    grad before it, as in eager, rather than leaving a parameter without a gradient: the eager RuntimeError where the
    graph may break; under fullgraph, Dynamo's own error (with torch 2.13, Unsupported, whose text carries the
    message)."""
    torch._dynamo.reset()
    x = make_inputs("cpu", state=None)
    A_log = torch.nn.Parameter(torch.zeros(2))

    def call(q, k, v, g, beta, A_log):
        out = torch.empty_like(v)
        flash_kda.fwd(q, k, v, g, beta, D**-0.5, out, A_log, None, -5.0)
        return out

    compiled = torch.compile(call, backend="eager", fullgraph=fullgraph)
    refusal = r"flash_kda.fwd has no backward, got A_log.requires_grad=True"
    if fullgraph:
        with pytest.raises(Exception):  # (the error a traced raise becomes is Dynamo's, by torch version)
            compiled(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log)
    else:
        with pytest.raises(RuntimeError, match=refusal):
            compiled(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log)
    with torch.no_grad():  # (and without grad mode the call runs)
        torch.testing.assert_close(compiled(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log),
                                   call(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log), rtol=0, atol=0)


def test_operator_equals_fwd_cpu():
    x = make_inputs("cpu")
    out_a, out_b = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    fin_a, fin_b = torch.empty_like(x["initial_state"]), torch.empty_like(x["initial_state"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5)
    flash_kda.fwd(*args, out_a, x["A_log"], x["dt_bias"], -5.0, x["initial_state"], fin_a)
    torch.ops.flash_kda.fwd(*args, out_b, x["A_log"], x["dt_bias"], -5.0, x["initial_state"], fin_b, None, None,
                            None, "lower_bound", False, None, None, 0)
    assert torch.equal(out_a, out_b) and torch.equal(fin_a, fin_b)


def test_operator_equals_fwd_cpu_with_options():
    """The operator's 16th and 17th arguments, gate and allow_neg_eigval, with grouped value heads and no A_log."""
    x = make_inputs("cpu", G=2)
    out_a, out_b = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    fin_a, fin_b = torch.empty_like(x["initial_state"]), torch.empty_like(x["initial_state"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5)
    flash_kda.fwd(*args, out_a, None, x["dt_bias"], None, x["initial_state"], fin_a, gate="softplus",
                  allow_neg_eigval=True)
    torch.ops.flash_kda.fwd(*args, out_b, None, x["dt_bias"], None, x["initial_state"], fin_b, None, None, None,
                            "softplus", True, None, None, 0)
    assert torch.equal(out_a, out_b) and torch.equal(fin_a, fin_b)


def test_operator_equals_fwd_cpu_with_pools():
    """The operator's 15th argument, state_indices: pools of 3 slots, one padding row, in place."""
    x = make_inputs("cpu", B=3)
    indices = torch.tensor([2, -1, 0])
    pool = torch.randn(3, *x["initial_state"].shape[1:]).to(x["initial_state"].dtype)
    pool_a, pool_b = pool.clone(), pool.clone()
    out_a, out_b = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5)
    flash_kda.fwd(*args, out_a, x["A_log"], x["dt_bias"], -5.0, pool_a, pool_a, state_indices=indices)
    torch.ops.flash_kda.fwd(*args, out_b, x["A_log"], x["dt_bias"], -5.0, pool_b, pool_b, None, None, indices,
                            "lower_bound", False, None, None, 0)
    assert torch.equal(out_a, out_b) and torch.equal(pool_a, pool_b)


def test_operator_equals_fwd_cpu_with_per_token_states():
    """The operator's 18th argument, num_accepted_tokens, with per-token state_indices [N, L]: in place."""
    x = make_inputs("cpu", B=3)
    indices = torch.tensor([[2, 5], [-1, 1], [0, 4]])
    accepted = torch.tensor([2, 1, 1], dtype=torch.int32)
    pool = torch.randn(6, *x["initial_state"].shape[1:]).to(x["initial_state"].dtype)
    pool_a, pool_b = pool.clone(), pool.clone()
    out_a, out_b = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5)
    flash_kda.fwd(*args, out_a, x["A_log"], x["dt_bias"], -5.0, pool_a, pool_a, state_indices=indices,
                  num_accepted_tokens=accepted)
    torch.ops.flash_kda.fwd(*args, out_b, x["A_log"], x["dt_bias"], -5.0, pool_b, pool_b, None, None, indices,
                            "lower_bound", False, accepted, None, 0)
    assert torch.equal(out_a, out_b) and torch.equal(pool_a, pool_b)
    assert all(not torch.equal(pool_a[slot], pool[slot]) for slot in (2, 5, 1, 0, 4))  # written
    assert torch.equal(pool_a[3], pool[3])  # named by no entry


def _fake_cuda_call(**changes):
    with FakeTensorMode():
        q = torch.empty(1, 32, 4, D, dtype=torch.bfloat16, device="cuda")
        args = dict(q=q, k=torch.empty_like(q), v=torch.empty_like(q), g=torch.empty_like(q),
                    beta=torch.empty(1, 32, 4, dtype=torch.bfloat16, device="cuda"), scale=0.1,
                    out=torch.empty_like(q), A_log=torch.empty(4, device="cuda"),
                    dt_bias=torch.empty(4, D, device="cuda"), lower_bound=-5.0, initial_state=None,
                    final_state=None, cu_seqlens=None, workspace=None, state_indices=None, gate="lower_bound",
                    allow_neg_eigval=False, num_accepted_tokens=None, checkpoint_indices=None,
                    checkpoint_every=0)  # fmt: skip
        args.update({name: make(q) if callable(make) else make for name, make in changes.items()})
        result = torch.ops.flash_kda.fwd(**args)
        return result, args


def test_fake_cuda_tensors_trace_without_a_gpu():
    """Fake CUDA tensors pass the fake implementation (it reads no data and no device), the call returns nothing
    and leaves its outputs as they were, and the operator declares exactly what it writes (torch.compile's graph
    orders the kernel's mutations by that declaration)."""
    result, args = _fake_cuda_call()
    assert result is None
    assert args["out"].shape == (1, 32, 4, D) and args["out"].dtype == torch.bfloat16 and args["out"].is_cuda
    schema = torch.ops.flash_kda.fwd.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"out", "final_state", "workspace"}, written
    assert len(schema.arguments) == 20 and [a.name for a in schema.arguments[-6:]] == [
        "state_indices", "gate", "allow_neg_eigval", "num_accepted_tokens", "checkpoint_indices", "checkpoint_every"]
    optional = {a.name for a in schema.arguments if isinstance(a.type, torch.OptionalType)}
    assert {"A_log", "dt_bias", "lower_bound", "initial_state", "final_state"} <= optional
    assert all(not a.has_default_value() for a in schema.arguments)  # (ops.py: no defaults)


def test_fake_cuda_grouped_value_heads_and_options_trace():
    """Grouped value heads (4 key heads, 8 value heads) with the softplus gate, no A_log / dt_bias / lower_bound
    and negative eigenvalues trace; v with 6 value heads is refused at trace time with fwd's message."""
    value = lambda heads: lambda q: torch.empty(1, 32, heads, D, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    grouped = dict(v=value(8), g=value(8), out=value(8),
                   beta=lambda q: torch.empty(1, 32, 8, dtype=torch.bfloat16, device="cuda"), A_log=None,
                   dt_bias=None, lower_bound=None, gate="softplus", allow_neg_eigval=True,
                   final_state=lambda q: torch.empty(1, 8, D, D, device="cuda"))  # fmt: skip
    result, _ = _fake_cuda_call(**grouped)
    assert result is None
    with pytest.raises(ValueError, match=r"v's heads HV must be a multiple G >= 1 of q's heads H"):
        _fake_cuda_call(**{**grouped, "v": value(6)})


def test_fake_cuda_pools_trace_and_bad_indices_are_refused():
    """Pools with CUDA or CPU indices trace; a bad index tensor fails at trace time with fwd's message."""
    pool = lambda q: torch.empty(6, 4, D, D, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    for device in ("cuda", "cpu"):
        result, _ = _fake_cuda_call(initial_state=pool, final_state=pool,
                                    state_indices=lambda q, d=device: torch.empty(1, dtype=torch.int32, device=d))
        assert result is None
    with pytest.raises(ValueError, match=re.escape("state_indices must be 1-D [N] = [1]")):
        _fake_cuda_call(initial_state=pool, state_indices=lambda q: torch.empty(2, dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize(
    "changes, exc, pattern",
    [
        (dict(A_log=lambda q: torch.empty(4, dtype=torch.float64, device="cuda")), TypeError,
         r"A_log must be float32, bfloat16 or float16, got A_log.dtype=torch.float64"),
        (dict(out=lambda q: torch.empty(1, 32, 4, 64, dtype=torch.bfloat16, device="cuda")), ValueError,
         r"out must have shape \[1, 32, 4, 128\]"),
        (dict(lower_bound=-7.0), ValueError, r"lower_bound must be a finite number in \[-5.0, 0.0\]"),
        (dict(final_state=lambda q: torch.empty(2, 4, D, D, device="cuda")), ValueError,
         r"final_state must have shape \[N, H, V, K\] = \[1, 4, 128, 128\]"),
        (dict(gate="sigmoid"), ValueError, r"gate must be one of \['lower_bound', 'softplus'\], got gate='sigmoid'"),
        (dict(lower_bound=None), ValueError, r"lower_bound must be a finite number in \[-5.0, 0.0\], got lower_bound=None"),
    ],
    ids=["dtype", "shape", "lower_bound", "state_shape", "gate", "lower_bound_none"],
)  # fmt: skip
def test_fake_implementation_validates(changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _fake_cuda_call(**changes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, layer",
    [(dict(T=300, H=4), KdaLayer), (dict(seqlens=(100, 0, 37), state=torch.bfloat16), KdaLayer),
     (dict(T=300, H=2, G=2), KdaOptionsLayer)],
    ids=["fixed", "varlen_bf16", "gva_softplus_neg_eigval"],
)  # fmt: skip
def test_compile_fullgraph_equals_eager_cuda(shape, layer):
    torch._dynamo.reset()
    x = make_inputs("cuda", **shape)
    layer = layer()
    eager = _run(layer, x)
    compiled = _run(torch.compile(layer, fullgraph=True), x)
    torch.cuda.synchronize()
    _assert_same(compiled, eager)
