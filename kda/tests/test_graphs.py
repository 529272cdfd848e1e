"""CUDA graphs as a server uses them (GPU): capture flash_kda.fwd once, change the inputs' contents in place,
replay, and get bit for bit what an eager call on the new contents gives — for varlen too, with new
`cu_seqlens` boundaries (same N and T): the kernel reads them on the device at every launch (the longest-first
order too). The shapes cover the plans: V split, single pass, the overlap (its programmatic dependent launches
and zeroed flags), longest first.
"""

from __future__ import annotations

import pytest
import torch

import flash_kda

pytestmark = pytest.mark.gpu

D = 128


def _fill(x: dict, gen: torch.Generator) -> None:
    """New random contents for every input buffer, in place (a captured graph keeps the addresses)."""
    for name in ("q", "k", "v", "g", "beta"):
        x[name].copy_(torch.randn(x[name].shape, generator=gen, device="cuda").to(torch.bfloat16))
    x["A_log"].copy_(torch.randn(x["A_log"].shape, generator=gen, device="cuda"))
    x["dt_bias"].copy_(torch.randn(x["dt_bias"].shape, generator=gen, device="cuda"))
    if x["initial_state"] is not None:
        x["initial_state"].copy_(torch.randn(x["initial_state"].shape, generator=gen, device="cuda"))


def _buffers(B, T, H, N, cu_seqlens, state_dtype) -> dict:
    bf16 = torch.bfloat16
    x = dict(
        q=torch.empty(B, T, H, D, dtype=bf16, device="cuda"), k=torch.empty(B, T, H, D, dtype=bf16, device="cuda"),
        v=torch.empty(B, T, H, D, dtype=bf16, device="cuda"), g=torch.empty(B, T, H, D, dtype=bf16, device="cuda"),
        beta=torch.empty(B, T, H, dtype=bf16, device="cuda"), A_log=torch.empty(H, device="cuda"),
        dt_bias=torch.empty(H, D, device="cuda"),
        initial_state=None if state_dtype is None else torch.empty(N, H, D, D, dtype=state_dtype, device="cuda"),
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    x["out"] = torch.empty_like(x["v"])
    x["final_state"] = None if state_dtype is None else torch.empty(N, H, D, D, dtype=state_dtype, device="cuda")
    return x


def _call(x: dict, out, final, workspace=None) -> None:
    flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, out, x["A_log"], x["dt_bias"], -5.0,
                  initial_state=x["initial_state"], final_state=final, cu_seqlens=x["cu_seqlens"],
                  workspace=workspace)


def _eager(x: dict) -> tuple:
    out = torch.full_like(x["out"], float("nan"))
    final = None if x["final_state"] is None else torch.full_like(x["final_state"], float("nan"))
    _call(x, out, final)
    return out, final


@pytest.mark.parametrize(
    "shape",
    [dict(B=2, T=300, H=8, seqlens=None, state_dtype=torch.bfloat16),
     dict(B=1, T=0, H=4, seqlens=(120, 0, 37, 203), state_dtype=torch.float32),
     dict(B=1, T=0, H=96, seqlens=(64,) * 16, state_dtype=None),
     dict(B=1, T=2048, H=96, seqlens=None, state_dtype=torch.bfloat16),
     dict(B=1, T=0, H=96, seqlens=(300, 40, 700, 90), state_dtype=torch.float32)],
    ids=["fixed_bf16", "varlen_fp32", "varlen_h96_no_state", "overlap_h96", "longest_first_h96"],
)  # fmt: skip
def test_replay_after_new_contents_equals_eager(shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    seqlens = shape["seqlens"]
    B, T, H = shape["B"], shape["T"], shape["H"]
    cu = None
    N = B
    if seqlens is not None:
        T, N = sum(seqlens), len(seqlens)
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int64, device="cuda")
    x = _buffers(B, T, H, N, cu, shape["state_dtype"])
    _fill(x, gen)
    plan = flash_kda.plan(x["q"], cu)
    if H == 96 and seqlens is None:
        assert plan.lead_chunks >= 0, plan  # the case is there for the overlap
    if seqlens is not None and len(seqlens) == 4 and H == 96:
        assert plan.longest_first, plan

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        workspace = torch.empty(flash_kda.workspace_bytes(x["q"], cu), dtype=torch.uint8, device="cuda")
        _call(x, x["out"], x["final_state"], workspace)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            _call(x, x["out"], x["final_state"], workspace)
    torch.cuda.current_stream().wait_stream(side)

    for step in range(3):
        _fill(x, gen)
        if cu is not None and step > 0:  # new boundaries, same N and T: rotate the lengths
            lens = torch.tensor(seqlens[step:] + seqlens[:step])
            cu.copy_(torch.tensor([0] + lens.cumsum(0).tolist(), dtype=torch.int64, device="cuda"))
        x["out"].fill_(float("nan"))
        if x["final_state"] is not None:
            x["final_state"].fill_(float("nan"))
        graph.replay()
        eager_out, eager_final = _eager(x)
        torch.cuda.synchronize()
        assert torch.equal(x["out"], eager_out), f"replay {step}: out differs from an eager call"
        if eager_final is not None:
            assert torch.equal(x["final_state"], eager_final), f"replay {step}: final_state differs"


@pytest.mark.parametrize("per_token", [False, True], ids=["decode_pool", "per_token_states"])
def test_capture_needing_no_workspace_on_a_fresh_stream(per_token):
    """A decode call (the state in registers: no workspace) captured on a stream flash_kda has never seen, without
    reserve_workspace or workspace=: nothing to allocate, so the capture works; the replay equals an eager call."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    N, H, L = 8, 4, 4
    x = _buffers(N, 1 if not per_token else 2, H, N, None, None)
    _fill(x, gen)
    pool = torch.randn(N * L, H, D, D, generator=gen, device="cuda").to(torch.bfloat16)
    indices = torch.randperm(N * L, generator=gen, device="cuda").to(torch.int32)
    indices = indices.view(N, L) if per_token else indices[:N]
    assert flash_kda.workspace_bytes(x["q"], None) == 0 and flash_kda.plan(x["q"], None).decode

    def call(state_pool):
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, x["out"], x["A_log"], x["dt_bias"], -5.0,
                      initial_state=state_pool, final_state=state_pool, state_indices=indices)

    captured = pool.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        call(captured)
    torch.cuda.current_stream().wait_stream(side)
    captured.copy_(pool)
    graph.replay()
    replay_out = x["out"].clone()
    eager = pool.clone()
    call(eager)
    torch.cuda.synchronize()
    assert torch.equal(replay_out, x["out"]), "out of the replay differs from an eager call"
    assert torch.equal(captured, eager), "pool of the replay differs from an eager call"
