"""Per-token states (speculative decoding): ``state_indices`` [N, L] and ``num_accepted_tokens`` [N] (GPU).

Every case runs ``flash_kda.fwd`` on a pool (NaN-poisoned where no state is written, or the initial pool itself in
place) and requires:
- out and the whole final pool equal to ``numerics.twin_forward`` bit for bit (the slots no token names included:
  they keep their bits);
- out and the written slots within the short-sequence bounds of float64 (``reference.reference_loop`` with the same
  pool arguments): per-token states come from the decode kernel's fp32 recurrence whatever the plan
  (docs/NUMERICS.md, "Per-token states"), so they carry only their own rounding to the pool's dtype.
Plans: the automatic one (the decode kernel for these lengths) and forced chunked plans, where a per-token pass
follows the chunked kernels.
"""

from __future__ import annotations

import dataclasses

import matrix
import pytest
import torch

import flash_kda
from flash_kda import compare, numerics, reference, testing

pytestmark = pytest.mark.gpu

OUT_REL_L2 = 4.5e-3  # the short-sequence bounds of the decode slice (test_matrix.py); the chunked plans' output
OUT_REL_L2_CHUNKED = 1e-2  # the rest of the matrix's, for the chunked plans' output
STATE_REL_L2 = {torch.bfloat16: 3.5e-3, torch.float32: 3.0e-3}


@dataclasses.dataclass(frozen=True)
class TokenCase:
    name: str
    H: int = 4
    B: int = 8
    T: int = 4
    seqlens: tuple | None = None
    L: int = 4
    accepted: str = "random"  # "random" in [1, L], "none" (no num_accepted_tokens), "host" (random, on the CPU)
    pool_dtype: torch.dtype = torch.bfloat16
    in_place: bool = True
    padding_rows: int = 0  # sequences whose every slot is negative
    negative_slots: bool = False  # a few negative entries inside rows (those tokens write nothing)
    G: int = 1
    gate: str = "lower_bound"
    plan: dict = dataclasses.field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.B


CASES = [
    TokenCase("decode_B8_T4_L4"),
    TokenCase("decode_B8_T4_L4_fp32_two_pools", pool_dtype=torch.float32, in_place=False),
    TokenCase("decode_varlen_shorter_than_L", seqlens=(1, 3, 0, 4, 2), L=4),
    TokenCase("decode_T2_L8_tokens_fewer_than_slots", T=2, L=8),
    TokenCase("decode_no_num_accepted", accepted="none"),
    TokenCase("decode_num_accepted_on_host", accepted="host"),
    TokenCase("decode_padding_rows_and_negative_slots", B=6, padding_rows=2, negative_slots=True),
    TokenCase("decode_gva2_softplus", H=8, G=2, gate="softplus", pool_dtype=torch.float32),
    TokenCase("chunked_T37_L8", B=3, T=37, L=8, plan=dict(decode=False)),
    TokenCase("chunked_vsplit2_varlen", seqlens=(20, 3, 0, 40), L=6, plan=dict(v_split=2)),
    TokenCase("chunked_time_split", B=2, T=100, L=5, plan=dict(segment_chunks=2), pool_dtype=torch.float32),
    TokenCase("chunked_two_pools_softplus", B=3, T=40, L=4, in_place=False, gate="softplus",
              plan=dict(decode=False)),
]


def _inputs(case: TokenCase, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    N, H, L = case.num_seqs, case.H, case.L
    T = sum(case.seqlens) if case.seqlens is not None else case.T
    B = 1 if case.seqlens is not None else case.B

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x = dict(q=randn(B, T, H // case.G, 128), k=randn(B, T, H // case.G, 128), v=randn(B, T, H, 128),
             g=randn(B, T, H, 128), beta=randn(B, T, H), A_log=torch.rand(H, generator=gen, device="cuda"),
             dt_bias=randn(H, 128, dtype=torch.float32) * 0.1)
    P = N * L + 3  # every slot distinct, and a few no sequence names
    slots = torch.randperm(P, generator=host)[: N * L].view(N, L)
    if case.negative_slots:
        slots[torch.rand(N, L, generator=host) < 0.2] = -1
    slots[:case.padding_rows] = -1
    x["state_indices"] = slots.to(torch.int32).cuda()
    accepted = torch.randint(1, L + 1, (N,), generator=host)
    x["num_accepted_tokens"] = (None if case.accepted == "none"
                                else accepted if case.accepted == "host" else accepted.cuda())
    pool = (torch.randn(P, H, 128, 128, generator=gen, device="cuda") * 0.1).to(case.pool_dtype)
    x["initial_state"] = pool
    x["final_state"] = pool if case.in_place else torch.full_like(pool, float("nan"))
    x["cu_seqlens"] = None
    if case.seqlens is not None:
        x["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], device="cuda")
    x["gate"] = case.gate
    x["lower_bound"] = -5.0 if case.gate == "lower_bound" else None
    return x


def _written_slots(case: TokenCase, x: dict) -> torch.Tensor:
    lengths = list(case.seqlens) if case.seqlens is not None else [case.T] * case.num_seqs
    slots = x["state_indices"].cpu().long()
    keep = torch.arange(case.L).view(1, -1) < torch.tensor(lengths).view(-1, 1)
    chosen = slots[keep & (slots >= 0)]
    return chosen


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_token_states_equal_the_twin_and_meet_the_bounds(case: TokenCase) -> None:
    x = _inputs(case, seed=len(case.name))
    before = x["final_state"].clone()
    initial_before = x["initial_state"].clone()
    out = torch.full_like(x["v"], float("nan"))
    args = dict(state_indices=x["state_indices"], num_accepted_tokens=x["num_accepted_tokens"])
    with testing.force_plan(**case.plan):
        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, out, x["A_log"], x["dt_bias"],
                      x["lower_bound"], x["initial_state"], x["final_state"], x["cu_seqlens"], gate=case.gate, **args)
        twin_out, twin_pool = numerics.twin_forward(
            x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["A_log"], x["dt_bias"], x["lower_bound"],
            initial_before, x["cu_seqlens"], final_state=before, gate_kind=case.gate, **args)
    assert matrix.same_bits(out, twin_out), compare.bitwise_mismatch(out, twin_out)
    # The written slots against the twin; the others against the pool as it was, bit for bit (not through the twin's
    # fp32 pool: converting a bf16 NaN to fp32 and back on the GPU gives the canonical NaN 0x7FFF, not the poison's
    # 0x7FC0).
    written = _written_slots(case, x).cuda()
    untouched = torch.ones(x["final_state"].shape[0], dtype=torch.bool, device="cuda")
    untouched[written] = False
    twin_pool = twin_pool.to(case.pool_dtype)
    assert matrix.same_bits(x["final_state"][written], twin_pool[written]), \
        compare.bitwise_mismatch(x["final_state"][written], twin_pool[written])
    assert matrix.same_bits(x["final_state"][untouched], before[untouched]), "slots no token names changed"

    ref_out, ref_pool = reference.reference_loop(
        x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["A_log"], x["dt_bias"], x["lower_bound"],
        initial_before, x["cu_seqlens"], final_state=before, gate_kind=case.gate, **args)
    out_bound = OUT_REL_L2_CHUNKED if case.plan else OUT_REL_L2
    compare.compare(out, ref_out).check(rel_l2=out_bound, name="out vs float64")
    if written.numel():
        compare.compare(x["final_state"][written], ref_pool[written]).check(
            rel_l2=STATE_REL_L2[case.pool_dtype], name="written slots vs float64")


def test_num_accepted_out_of_range_is_reported_and_starts_from_zeros() -> None:
    """A CUDA num_accepted_tokens outside [1, L] is not checked on the host: that sequence starts from zeros (memory
    stays safe) and flash_kda.last_error names it."""
    case = TokenCase("accepted_out_of_range", B=3, T=3, L=3)
    x = _inputs(case, seed=7)
    flash_kda.last_error()  # (reset)
    bad = x["num_accepted_tokens"].clone()
    bad[1] = 9
    out = torch.empty_like(x["v"])
    flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, out, x["A_log"], x["dt_bias"], -5.0,
                  x["initial_state"], x["final_state"], None, state_indices=x["state_indices"],
                  num_accepted_tokens=bad)
    message = flash_kda.last_error()
    assert message is not None and "[1]" in message, message
