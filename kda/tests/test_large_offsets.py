"""Calls whose tensors hold more than 2^31 elements: every offset the kernels form must be 64-bit.

A 32-bit offset would wrap past 2,147,483,648 elements, which a 1M-token sequence reaches at 16 heads (q alone:
T · H · 128 elements) and a pool of bf16 states at 8,192 slot-heads. Heads are independent, so each case checks the
big call against calls that hold one head (or, for pools, dense states gathered from the pool) under the same
forced plan, bit for bit. A wrapped offset would corrupt every head's tokens past the 2^31st element of q (tokens
are the outer index of [B, T, H, K]) and the pool's top slots, where the indices point.

GPU only (``gpu``); the largest case holds about 70 GB of GPU memory, so the target runs alone (``exclusive``).
"""

from __future__ import annotations

import pytest
import torch

import flash_kda
from flash_kda.testing import force_plan

D = 128
ELEMENTS_31 = 1 << 31
TWO_STAGES = dict(v_split=1, segment_chunks=0, single_pass=False, lead_chunks=-1)

pytestmark = pytest.mark.gpu


def randn(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Standard normal values on the GPU, drawn in slices so that no float32 temporary of the whole is held."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.empty(shape, dtype=dtype, device="cuda")
    flat, step = t.view(-1), 1 << 28
    for i in range(0, flat.numel(), step):
        n = min(step, flat.numel() - i)
        flat[i : i + n] = torch.randn(n, generator=gen, device="cuda").to(dtype)
    return t


def tokens(B: int, T: int, H: int, seed: int) -> dict:
    """q, k, v, g, beta, out and the gate parameters of a call on the GPU."""
    return dict(
        q=randn((B, T, H, D), seed=seed), k=randn((B, T, H, D), seed=seed + 1), v=randn((B, T, H, D), seed=seed + 2),
        g=randn((B, T, H, D), seed=seed + 3), beta=randn((B, T, H), seed=seed + 4), scale=D**-0.5,
        out=torch.full((B, T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda"),
        A_log=randn((H,), torch.float32, seed + 5), dt_bias=randn((H, D), torch.float32, seed + 6), lower_bound=-5.0,
    )  # fmt: skip


def one_head(x: dict, h: int) -> dict:
    """The arguments of x restricted to head h (fresh outputs)."""
    y = {name: x[name][:, :, h : h + 1].contiguous() for name in ("q", "k", "v", "g", "beta")}
    y.update(scale=x["scale"], lower_bound=x["lower_bound"], cu_seqlens=x["cu_seqlens"],
             out=torch.full_like(y["q"], float("nan")), A_log=x["A_log"][h : h + 1].contiguous(),
             dt_bias=x["dt_bias"][h : h + 1].contiguous(), initial_state=x["initial_state"][:, h : h + 1].contiguous())
    y["final_state"] = torch.full_like(y["initial_state"], float("nan"))
    return y


@pytest.mark.parametrize(
    "T, H, seqlens, plan",
    [
        (1 << 20, 32, None, TWO_STAGES),
        (1 << 20, 32, None, dict(segment_chunks=512)),
        (1 << 20, 32, ((1 << 19) + 37, (1 << 19) - 37), dict(v_split=2, segment_chunks=0)),
        (1 << 18, 96, None, dict(lead_chunks=4000)),
    ],
    ids=["T1M_H32_two_stages", "T1M_H32_time_split", "varlen_2x512K_H32_vsplit2", "T256K_H96_overlap"],
)  # fmt: skip
def test_prefill_past_2_31_elements_equals_one_head_calls(T, H, seqlens, plan):
    assert T * H * D > ELEMENTS_31
    x = tokens(1, T, H, seed=1)
    N = 1 if seqlens is None else len(seqlens)
    x["cu_seqlens"] = None if seqlens is None else torch.tensor([0, seqlens[0], T], device="cuda")
    x["initial_state"] = randn((N, H, D, D), seed=9)
    x["final_state"] = torch.full_like(x["initial_state"], float("nan"))
    with force_plan(**plan):
        flash_kda.fwd(**x)
    torch.cuda.synchronize()
    assert flash_kda.last_error() is None
    for h in (0, H // 2, H - 1):
        y = one_head(x, h)
        with force_plan(**plan):
            flash_kda.fwd(**y)
        torch.cuda.synchronize()
        assert torch.equal(x["out"][:, :, h], y["out"][:, :, 0]), f"out of head {h}"
        assert torch.equal(x["final_state"][:, h], y["final_state"][:, 0]), f"final state of head {h}"


@pytest.mark.parametrize(
    "B, T, dtype, plan",
    [
        (128, 1, torch.bfloat16, None),
        (128, 1, torch.float32, None),
        (64, 4, torch.bfloat16, None),
        (64, 16, torch.bfloat16, None),
        (4, 300, torch.bfloat16, dict(decode=False)),
        (4, 300, torch.float32, dict(segment_chunks=4)),
    ],
    ids=["decode_T1_bf16", "decode_T1_fp32", "decode_T4_bf16", "decode_chunk_step_T16_bf16", "chunked_T300_bf16",
         "time_split_T300_fp32"],
)  # fmt: skip
def test_pool_past_2_31_elements_equals_dense_states(B, T, dtype, plan):
    P, H = 4200, 32
    assert P * H * D * D > ELEMENTS_31
    pool = randn((P, H, D, D), dtype, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    indices = (torch.randperm(200, generator=gen, device="cuda")[:B] + (P - 200)).to(torch.int32)  # the top slots
    x = {**tokens(B, T, H, seed=5), "cu_seqlens": None}
    dense = {**x, "out": torch.full_like(x["out"], float("nan")), "initial_state": pool[indices.long()].clone()}
    dense["final_state"] = torch.full_like(dense["initial_state"], float("nan"))
    with force_plan(**(plan or {})):
        flash_kda.fwd(**dense)
        flash_kda.fwd(**x, initial_state=pool, final_state=pool, state_indices=indices)
    torch.cuda.synchronize()
    assert flash_kda.last_error() is None
    assert torch.equal(x["out"], dense["out"])
    assert torch.equal(pool[indices.long()], dense["final_state"])
