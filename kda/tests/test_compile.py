"""flash_kda under torch.compile: ``torch.ops.flash_kda.fwd`` and its fake implementation.

CPU tests (CI): a module that calls ``flash_kda.fwd`` compiles with ``fullgraph=True`` (no graph break) and
gives bitwise the eager results on the CPU path; the operator called directly equals ``fwd``; fake tensors on
a CUDA device (no GPU needed to trace) pass through the fake implementation, which raises the eager
validation errors. GPU test: the same module with CUDA tensors, compiled, equals eager bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_kda
from flash_kda import ops  # noqa: F401 -- registers torch.ops.flash_kda.fwd

D = 128


def make_inputs(device: str, *, B=1, T=40, H=2, seqlens=None, state=torch.float32, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    N = B if seqlens is None else len(seqlens)
    cu = None
    if seqlens is not None:
        B, T = 1, sum(seqlens)
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int64, device=device)
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        A_log=randn(H, dtype=torch.float32), dt_bias=randn(H, D, dtype=torch.float32),
        initial_state=None if state is None else randn(N, H, D, D, dtype=state), cu_seqlens=cu,
    )  # fmt: skip


class KdaLayer(torch.nn.Module):
    """The shape of a model's use: fresh output buffers, the forward, something computed from its results."""

    def forward(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        out = torch.empty_like(v)
        final = None if initial_state is None else torch.empty_like(initial_state)
        flash_kda.fwd(q, k, v, g, beta, D**-0.5, out, A_log, dt_bias, -5.0, initial_state=initial_state,
                      final_state=final, cu_seqlens=cu_seqlens)
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


def test_operator_equals_fwd_cpu():
    x = make_inputs("cpu")
    out_a, out_b = torch.empty_like(x["v"]), torch.empty_like(x["v"])
    fin_a, fin_b = torch.empty_like(x["initial_state"]), torch.empty_like(x["initial_state"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5)
    flash_kda.fwd(*args, out_a, x["A_log"], x["dt_bias"], -5.0, x["initial_state"], fin_a)
    torch.ops.flash_kda.fwd(*args, out_b, x["A_log"], x["dt_bias"], -5.0, x["initial_state"], fin_b, None, None,
                            None)
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
    torch.ops.flash_kda.fwd(*args, out_b, x["A_log"], x["dt_bias"], -5.0, pool_b, pool_b, None, None, indices)
    assert torch.equal(out_a, out_b) and torch.equal(pool_a, pool_b)


def _fake_cuda_call(**changes):
    with FakeTensorMode():
        q = torch.empty(1, 32, 4, D, dtype=torch.bfloat16, device="cuda")
        args = dict(q=q, k=torch.empty_like(q), v=torch.empty_like(q), g=torch.empty_like(q),
                    beta=torch.empty(1, 32, 4, dtype=torch.bfloat16, device="cuda"), scale=0.1,
                    out=torch.empty_like(q), A_log=torch.empty(4, device="cuda"),
                    dt_bias=torch.empty(4, D, device="cuda"), lower_bound=-5.0, initial_state=None,
                    final_state=None, cu_seqlens=None, workspace=None, state_indices=None)  # fmt: skip
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
    assert len(schema.arguments) == 15 and schema.arguments[-1].name == "state_indices"


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
    ],
    ids=["dtype", "shape", "lower_bound", "state_shape"],
)  # fmt: skip
def test_fake_implementation_validates(changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _fake_cuda_call(**changes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [dict(T=300, H=4), dict(seqlens=(100, 0, 37), state=torch.bfloat16)], ids=["fixed", "varlen_bf16"]
)
def test_compile_fullgraph_equals_eager_cuda(shape):
    torch._dynamo.reset()
    x = make_inputs("cuda", **shape)
    layer = KdaLayer()
    eager = _run(layer, x)
    compiled = _run(torch.compile(layer, fullgraph=True), x)
    torch.cuda.synchronize()
    _assert_same(compiled, eager)
