"""Prefix-cache checkpoints: ``checkpoint_indices`` [N, M] with ``checkpoint_every`` = C beside ``state_indices`` [N]
(GPU).

Every case runs ``flash_kda.fwd`` on a pool (NaN-poisoned where nothing is written, or the initial pool itself in
place) with its checkpoints, under the automatic plan or a forced one, and requires:
- out and the written slots (checkpoints and final states) equal to ``numerics.twin_forward`` bit for bit (the twin
  re-enacts where each plan takes a checkpoint: the chunked stepping, under the time split the unit that finishes
  the segment, or the decode kernel's recurrence); every slot nothing names with the bits it had (against the pool
  before the call, not through the twin's fp32 pool: a bf16 NaN converted to fp32 and back on the GPU comes back as
  the canonical NaN 0x7FFF, not the poison's 0x7FC0);
- out and the final slots equal to those of the same call without checkpoints, bit for bit;
- out, every written checkpoint and every final slot within the bounds of float64 (``reference.reference_chunked``
  with the same pool arguments): test_matrix.py's standing bounds under the chunked plans, the decode slice's under
  the decode plan.
Beside them: an entry >= P of a CUDA ``checkpoint_indices`` writes nothing and ``flash_kda.last_error()`` names it;
a CUDA graph replay reads new ``checkpoint_indices`` contents; a CPU ``checkpoint_indices`` beside CUDA tensors is
refused.
"""

from __future__ import annotations

import dataclasses

import matrix
import pytest
import torch

import flash_kda
from flash_kda import compare, numerics, reference, testing

pytestmark = pytest.mark.gpu

# The standing bounds of test_matrix.py (chunked plans) and of its decode slice (the decode plan).
OUT_REL_L2 = 1e-2
STATE_REL_L2 = 7.5e-3
DECODE_OUT_REL_L2 = 4.5e-3
DECODE_STATE_REL_L2 = {torch.bfloat16: 3.5e-3, torch.float32: 3.0e-3}
EXTRA_SLOTS = 3  # pool slots nothing names


@dataclasses.dataclass(frozen=True)
class CheckpointCase:
    name: str
    C: int  # checkpoint_every
    H: int = 4
    B: int = 1
    T: int = 0
    seqlens: tuple | None = None
    pool_dtype: str = "bf16"
    in_place: bool = False
    negative: bool = False  # about a fifth of the entries negative (no checkpoint)
    own_slot: bool = False  # one checkpoint before each sequence's end names the sequence's own final slot
    index_dtype: torch.dtype = torch.int32
    gate: str = "lower_bound"
    G: int = 1
    plan: dict = dataclasses.field(default_factory=dict)  # flash_kda.testing.force_plan's arguments
    expect: dict = dataclasses.field(default_factory=dict)  # fields the plan must have (beside the forced ones)

    @property
    def matrix_case(self) -> matrix.Case:
        """The inputs: matrix.py's recipe for a pool of N + N·M + EXTRA_SLOTS slots."""
        N = len(self.seqlens) if self.seqlens is not None else self.B
        shape = dict(seqlens=self.seqlens) if self.seqlens is not None else dict(B=self.B, T=self.T)
        return matrix.Case("pool", H=self.H, **shape, state_dtype=self.pool_dtype, inplace_state=self.in_place,
                           pool=N + N * self.M + EXTRA_SLOTS, gate=self.gate, G=self.G)

    @property
    def lengths(self) -> tuple:
        return self.seqlens if self.seqlens is not None else (self.T,) * self.B

    @property
    def M(self) -> int:
        """Checkpoints per sequence: up to the longest sequence, and one past it (never written)."""
        return max(self.lengths, default=0) // self.C + 1


CASES = [
    # the automatic plan
    CheckpointCase("auto_C256_T2600_H8", C=256, H=8, T=2600),
    CheckpointCase("auto_C512_varlen_shorter_than_C_fp32_in_place", C=512, seqlens=(2100, 300, 0, 700, 511),
                   pool_dtype="fp32", in_place=True),
    CheckpointCase("auto_C1024_B2_T3000_fp32_negative_int64", C=1024, B=2, T=3000, pool_dtype="fp32",
                   negative=True, index_dtype=torch.int64),
    CheckpointCase("auto_C256_varlen_softplus_gva", C=256, H=8, G=2, seqlens=(2300, 40, 256, 0, 600),
                   gate="softplus"),
    CheckpointCase("auto_C16_B4_T50", C=16, B=4, T=50, negative=True),
    CheckpointCase("auto_C64_varlen_short", C=64, seqlens=(130, 64, 5, 0, 70), pool_dtype="fp32", in_place=True),
    CheckpointCase("auto_decode_C16_B8_T16", C=16, B=8, T=16, expect=dict(decode=True)),
    # forced plans
    CheckpointCase("vsplit2_C256_varlen", C=256, seqlens=(2100, 600, 0, 300, 255), plan=dict(v_split=2)),
    CheckpointCase("vsplit2_C64_B3_T200_fp32", C=64, B=3, T=200, pool_dtype="fp32", plan=dict(v_split=2)),
    CheckpointCase("tsplit16_C256_aligned_T2600_fp32", C=256, T=2600, pool_dtype="fp32",
                   plan=dict(segment_chunks=16)),
    CheckpointCase("tsplit16_C512_varlen_in_place", C=512, seqlens=(2500, 700, 0, 1024), in_place=True,
                   plan=dict(segment_chunks=16)),
    CheckpointCase("tsplit24_C256_unaligned_T2900", C=256, T=2900, negative=True, plan=dict(segment_chunks=24)),
    CheckpointCase("tsplit24_C1024_B2_T2200_fp32_in_place", C=1024, B=2, T=2200, pool_dtype="fp32", in_place=True,
                   plan=dict(segment_chunks=24)),
    CheckpointCase("single_pass_C16_B2_T100", C=16, B=2, T=100, plan=dict(single_pass=True)),
    CheckpointCase("single_pass_C64_varlen_fp32", C=64, seqlens=(130, 0, 64, 40), pool_dtype="fp32",
                   plan=dict(single_pass=True)),
    CheckpointCase("overlap8_C256_T2100_H32", C=256, H=32, T=2100, plan=dict(lead_chunks=8)),
    CheckpointCase("overlap8_C512_B2_T2200_H32_fp32_in_place", C=512, H=32, B=2, T=2200, pool_dtype="fp32",
                   in_place=True, plan=dict(lead_chunks=8)),
    CheckpointCase("decode_C16_varlen", C=16, seqlens=(50, 7, 33, 0, 16), plan=dict(decode=True)),
    CheckpointCase("decode_C32_B3_T70_fp32_in_place", C=32, B=3, T=70, pool_dtype="fp32", in_place=True,
                   negative=True, plan=dict(decode=True)),
    # a checkpoint in its own sequence's final slot, before the end: the slot keeps the final state (under the time
    # split another CTA writes that checkpoint; the automatic plan of T2064 H4 splits into segments of 32 chunks)
    CheckpointCase("tsplit32_C512_T2064_own_final_slot_in_place", C=512, T=2064, in_place=True, own_slot=True,
                   plan=dict(segment_chunks=32)),
    CheckpointCase("single_pass_C16_B2_T100_own_final_slot", C=16, B=2, T=100, own_slot=True,
                   plan=dict(single_pass=True)),
    CheckpointCase("decode_chunk_step_C16_B3_T70_own_final_slot", C=16, B=3, T=70, own_slot=True,
                   plan=dict(decode=True)),
    CheckpointCase("decode_tokens_C16_varlen_own_final_slot", C=16, seqlens=(40, 5, 3, 0, 1), own_slot=True,
                   plan=dict(decode=True)),
]


def _inputs(case: CheckpointCase) -> dict:
    """matrix.make_inputs for the case's pool, with checkpoint_indices [N, M] (CUDA) naming distinct slots that
    state_indices does not name (a fifth of them -1 with ``negative``; with ``own_slot``, the middle one of the
    checkpoints before each sequence's end names the sequence's own slot)."""
    x = matrix.make_inputs(case.matrix_case, "cuda")
    N, M = len(case.lengths), case.M
    P = x["initial_state"].shape[0]
    host = torch.Generator().manual_seed(case.matrix_case.seed + 1)
    named = set(x["state_indices"].tolist())
    free = torch.tensor([s for s in range(P) if s not in named])
    slots = free[torch.randperm(free.numel(), generator=host)[: N * M]].view(N, M)
    if case.negative:
        slots[torch.rand(N, M, generator=host) < 0.2] = -1
    if case.own_slot:
        for n, length in enumerate(case.lengths):
            before_end = (length - 1) // case.C  # checkpoints m with (m + 1)·C < length
            if before_end > 0:
                slots[n, before_end // 2] = int(x["state_indices"][n])
    x["checkpoint_indices"] = slots.to(case.index_dtype).cuda()
    x["checkpoint_every"] = case.C
    return x


def _written_checkpoints(case: CheckpointCase, x: dict) -> torch.Tensor:
    """The slots the call writes checkpoints into (int64, CPU): entries >= 0 of every (m+1)·C <= length."""
    indices = x["checkpoint_indices"].cpu().long()
    ends = torch.arange(1, case.M + 1).view(1, -1) * case.C
    written = (ends <= torch.tensor(case.lengths).view(-1, 1)) & (indices >= 0)
    return indices[written]


def _fwd_args(x: dict) -> dict:
    return {**matrix.fwd_args(x), "checkpoint_indices": x["checkpoint_indices"],
            "checkpoint_every": x["checkpoint_every"]}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_checkpoints_equal_the_twin_and_meet_the_bounds(case: CheckpointCase) -> None:
    x = _inputs(case)
    before = {n: x[n].clone() for n in (*matrix.INPUT_NAMES, "checkpoint_indices") if x[n] is not None}
    pool_before = x["final_state"].clone()  # (in place: the initial pool)
    plain = {**x, "out": torch.full_like(x["out"], float("nan")), "initial_state": before["initial_state"].clone()}
    plain["final_state"] = plain["initial_state"] if case.in_place else pool_before.clone()
    twin_args = {**matrix.twin_args(x), "initial_state": before["initial_state"], "final_state": pool_before}
    with testing.force_plan(**case.plan):
        flash_kda.fwd(**_fwd_args(x))
        flash_kda.fwd(**matrix.fwd_args(plain))  # the same call without checkpoints
        plan = flash_kda.plan(x["v"], x["cu_seqlens"], **matrix.plan_args(x))
        twin_out, twin_pool = numerics.twin_forward(**twin_args, checkpoint_indices=x["checkpoint_indices"],
                                                    checkpoint_every=case.C)
    for field, value in {**case.plan, **case.expect}.items():
        assert getattr(plan, field) == value, f"{field}={value} expected, got {plan}"
    for name, saved in before.items():
        if name == "initial_state" and case.in_place:
            continue  # it is final_state by design
        assert torch.equal(x[name], saved), f"input {name} modified: {compare.bitwise_mismatch(x[name], saved)}"

    pool = x["final_state"]
    checkpoints = _written_checkpoints(case, x).cuda()
    finals = x["state_indices"]
    assert checkpoints.numel(), "the case writes no checkpoint"
    assert matrix.same_bits(x["out"], twin_out), compare.bitwise_mismatch(x["out"], twin_out)
    twin_pool = twin_pool.to(pool.dtype)
    for name, slots in (("checkpoint slots", checkpoints), ("final slots", finals)):
        assert matrix.same_bits(pool[slots], twin_pool[slots]), f"{name} != twin: " + compare.bitwise_mismatch(
            pool[slots], twin_pool[slots])
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    untouched[checkpoints] = False
    untouched[finals] = False
    assert matrix.same_bits(pool[untouched], pool_before[untouched]), "slots nothing names changed"
    assert matrix.same_bits(x["out"], plain["out"]), "out differs from the call without checkpoints"
    assert matrix.same_bits(pool[finals], plain["final_state"][finals]), \
        "final slots differ from the call without checkpoints"

    ref_out, ref_pool = reference.reference_chunked(**twin_args, checkpoint_indices=x["checkpoint_indices"],
                                                    checkpoint_every=case.C)
    out_bound, state_bound = ((DECODE_OUT_REL_L2, DECODE_STATE_REL_L2[pool.dtype]) if plan.decode
                              else (OUT_REL_L2, STATE_REL_L2))
    report = compare.compare(x["out"], ref_out)
    report.check(rel_l2=out_bound, name="out vs float64")
    worst = 0.0
    for slot in checkpoints.tolist():  # every checkpoint, each on its own
        state = compare.compare(pool[slot], ref_pool[slot])
        state.check(rel_l2=state_bound, name=f"checkpoint slot {slot} vs float64")
        worst = max(worst, state.rel_l2)
    compare.compare(pool[finals], ref_pool[finals]).check(rel_l2=state_bound, name="final slots vs float64")
    print(f"[{case.name}] {plan} out rel_l2={report.rel_l2:.3e} worst checkpoint rel_l2={worst:.3e}", flush=True)


_PAST_THE_POOL_PLANS = {
    "auto": dict(),
    "vsplit2": dict(v_split=2),
    "tsplit2": dict(segment_chunks=2),
    "single_pass": dict(single_pass=True),
    "overlap2": dict(lead_chunks=2),
    "decode": dict(decode=True),
}


@pytest.mark.parametrize("plan", sorted(_PAST_THE_POOL_PLANS))
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_checkpoint_index_past_the_pool_is_reported_and_writes_nothing(plan, index_dtype) -> None:
    """A CUDA checkpoint entry >= P is not checked on the host: it writes nothing (no memory outside the pool is
    touched), the call equals the one where that entry is -1, bit for bit, and flash_kda.last_error names it."""
    case = CheckpointCase("past_the_pool", C=16, B=3, T=40, pool_dtype="fp32", index_dtype=index_dtype)
    x = _inputs(case)
    P = x["final_state"].shape[0]
    bad = x["checkpoint_indices"].clone()
    bad[1, 0] = P + 5
    skipped = x["checkpoint_indices"].clone()
    skipped[1, 0] = -1
    expected = {**x, "out": torch.full_like(x["out"], float("nan")), "final_state": x["final_state"].clone(),
                "checkpoint_indices": skipped}
    with testing.force_plan(**_PAST_THE_POOL_PLANS[plan]):
        matrix.assert_reports(lambda: flash_kda.fwd(**_fwd_args({**x, "checkpoint_indices": bad})),
                              "checkpoint_indices[1]", f"P = {P}")
        flash_kda.fwd(**_fwd_args(expected))
    assert flash_kda.last_error() is None  # negative entries are not errors
    assert matrix.same_bits(x["out"], expected["out"]), "out differs from the call with the entry skipped"
    assert matrix.same_bits(x["final_state"], expected["final_state"]), \
        "pool differs from the call with the entry skipped"


@pytest.mark.parametrize("in_place", [False, True], ids=["two_pools", "in_place"])
def test_graph_replay_reads_new_checkpoint_indices(in_place) -> None:
    """The kernels read CUDA checkpoint_indices at every launch: a replay after new entries (and -1s) are written into
    the captured tensor equals an eager call with them."""
    case = CheckpointCase("graph", C=32, B=3, T=100, in_place=in_place)
    x = _inputs(case)
    pool0 = x["initial_state"].clone()
    final0 = x["final_state"].clone()
    workspace = torch.empty(flash_kda.workspace_bytes(x["q"], None, x["state_indices"]), dtype=torch.uint8,
                            device="cuda")
    graph = matrix.capture(lambda: flash_kda.fwd(**_fwd_args(x), workspace=workspace))
    free = x["checkpoint_indices"].flip(0).flatten()
    for variant in ("reversed", "some_negative", "none"):
        indices = free.clone()
        if variant == "some_negative":
            indices[::2] = -1
        elif variant == "none":
            indices[:] = -3
        indices = indices.view_as(x["checkpoint_indices"])
        eager = {**x, "initial_state": pool0.clone(), "out": torch.full_like(x["out"], float("nan")),
                 "checkpoint_indices": indices}
        eager["final_state"] = eager["initial_state"] if in_place else final0.clone()
        flash_kda.fwd(**_fwd_args(eager))
        x["initial_state"].copy_(pool0)
        x["final_state"].copy_(pool0 if in_place else final0)
        x["out"].fill_(float("nan"))
        x["checkpoint_indices"].copy_(indices)
        graph.replay()
        torch.cuda.synchronize()
        assert matrix.same_bits(x["out"], eager["out"]), f"out of the replay with {variant} entries"
        assert matrix.same_bits(x["final_state"], eager["final_state"]), f"pool of the replay with {variant} entries"


def test_host_checkpoint_indices_beside_cuda_tensors_are_refused() -> None:
    """A CUDA call reads checkpoint_indices on the device (never copied from the host): a CPU tensor is refused by
    name, before anything is written."""
    x = _inputs(CheckpointCase("host", C=16, B=2, T=40))
    pool = x["final_state"].clone()
    with pytest.raises(ValueError, match="checkpoint_indices must be on q's device"):
        flash_kda.fwd(**{**_fwd_args(x), "checkpoint_indices": x["checkpoint_indices"].cpu()})
    assert matrix.same_bits(x["final_state"], pool)
