"""The correctness matrix (docs/SPEC.md §4) on the GPU: kernel == numerics twin bit for bit, and close to float64.

Every case (matrix.py; ``--kda-slice`` picks slices):
1. builds its inputs on the GPU from its seed, NaN-poisons ``out`` and ``final_state``;
2. calls ``flash_kda.fwd`` (under ``flash_kda.testing.force_plan`` when the case forces a part of the plan);
3. asserts ``torch.equal`` with ``numerics.twin_forward`` (re-enacting the plan's time split, or the decode
   kernel's token-by-token arithmetic) on out and on final_state (cast to the state dtype);
4. asserts the inputs are unchanged (bitwise, against clones taken before the call);
5. compares with the float64 ground truth ``reference.reference_chunked`` (on the GPU): relative L2 of out and
   final_state, and the worst relative L2 over windows of WINDOW tokens of out (per sequence); the decode slice
   against the tighter short-sequence bounds DECODE_*_REL_L2.
All checks run before the test fails, so one failure report shows every problem of the case.
"""

from __future__ import annotations

import time

import matrix
import pytest
import torch

import flash_kda
from flash_kda import compare, reference, testing

pytestmark = pytest.mark.gpu

# Bounds against float64, about 2x the worst errors measured on the H200 (2026-11-29, torch 2.11 / CUDA 13.0,
# all 608 cases of matrix.py): out 5.6e-3 (adversarial; 4.9e-3 outside it), final_state 3.6e-3 (bf16) /
# 3.2e-3 (fp32), worst 256-token window 5.8e-3 (varlen [16,16]). The inputs are seeded by case id, so these are
# reproducible numbers, not samples. For scale: MoonshotAI FlashKDA measures out 5.7e-3 / state 4.8e-3 (docs/PERFORMANCE.md),
# and rounding the exact output to bf16 alone costs 1.66e-3.
OUT_REL_L2 = 1e-2  # MEASURED: worst 5.6e-3
STATE_REL_L2 = 7.5e-3  # MEASURED: worst 3.6e-3
WINDOW = 256  # tokens per window (windows never cross sequence boundaries)
WINDOW_REL_L2 = 1.2e-2  # MEASURED: worst 5.8e-3
# The decode slice (sequences of at most 16 tokens on the decode kernel): the short-sequence accuracy that long
# sequences get from the chunked kernels (out ≈ 4.0e-3, state 2.8-3.4e-3, docs/NUMERICS.md), asked for in the
# issue that added the kernel. Its fp32 state never passes through bf16 operands, so what remains is the rounding
# of out (and of a bf16 final state) to bf16: ≈ 1.7e-3 for out (docs/NUMERICS.md, "The decode kernel").
DECODE_OUT_REL_L2 = 4.5e-3
DECODE_STATE_REL_L2 = {torch.bfloat16: 3.5e-3, torch.float32: 3.0e-3}  # by final_state's dtype
_PROGRESS_TOKEN_HEADS = 1 << 20  # print stage timings for cases at least this big (long_context)


class _Stages:
    """Prints per-stage wall times for long cases (flushed, so they show in the Bazel log on failure)."""

    def __init__(self, case: matrix.Case) -> None:
        self.enabled = case.tokens * case.H >= _PROGRESS_TOKEN_HEADS
        self.case = case
        self.t = time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.enabled:
            torch.cuda.synchronize()
            now = time.perf_counter()
            print(f"[{self.case.id}] {stage}: {now - self.t:.2f} s", flush=True)
            self.t = now


def _fwd_args(x: dict) -> dict:
    names = ("q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias", "lower_bound")
    return {**{n: x[n] for n in names}, **{n: x[n] for n in ("initial_state", "final_state", "cu_seqlens")}}


def run_case(case: matrix.Case, record=lambda name, value: None) -> None:
    """Runs one matrix case and raises AssertionError listing every failed check.

    ``record(name, value)`` receives the measured errors (pytest's record_property puts them in the junit XML,
    where tools/offline/gpu_acceptance.sh collects them)."""
    from flash_kda import numerics  # noqa: PLC0415 -- the lead's module; import errors fail the case clearly

    stage = _Stages(case)
    x = matrix.make_inputs(case, "cuda")
    before = {n: x[n].clone() for n in matrix.INPUT_NAMES if x[n] is not None}
    # The twin and the reference start from the initial state as it was before the call (in-place case).
    args = {**matrix.twin_args(x), "initial_state": before.get("initial_state")}
    stage("inputs")

    forced_segments = case.segment_chunks if case.segment_chunks >= 0 else None
    forced_lead = case.lead_chunks if case.lead_chunks >= -1 else None
    with testing.force_plan(v_split=case.v_split, segment_chunks=forced_segments, single_pass=case.single_pass,
                            lead_chunks=forced_lead, decode=case.decode):
        flash_kda.fwd(**_fwd_args(x))
        plan = flash_kda.plan(x["q"], x["cu_seqlens"])
    stage(f"flash_kda.fwd {plan}")

    failures: list[str] = []
    if case.slice in ("decode", "forced_decode") and not plan.decode:
        failures.append(f"the {case.slice} slice must run the decode kernel, got {plan}")
    twin_out, twin_state = numerics.twin_forward(**args, segment_chunks=plan.segment_chunks, decode=plan.decode)
    stage("numerics.twin_forward")
    if not torch.equal(x["out"], twin_out):
        failures.append(f"out != twin: {compare.bitwise_mismatch(x['out'], twin_out)}")
    if case.has_final:
        twin_state = twin_state.to(x["final_state"].dtype)
        if not torch.equal(x["final_state"], twin_state):
            failures.append(f"final_state != twin: {compare.bitwise_mismatch(x['final_state'], twin_state)}")

    for name, saved in before.items():
        if name == "initial_state" and case.inplace_state:
            continue  # it is final_state by design
        if not torch.equal(x[name], saved):
            failures.append(f"input {name} was modified: {compare.bitwise_mismatch(x[name], saved)}")

    ref_out, ref_state = reference.reference_chunked(**args)
    stage("reference.reference_chunked (float64)")
    report = compare.compare(x["out"], ref_out, window=WINDOW, cu_seqlens=x["cu_seqlens"])
    short = case.slice == "decode"  # the short-sequence bounds
    try:
        report.check(rel_l2=DECODE_OUT_REL_L2 if short else OUT_REL_L2, window_rel_l2=WINDOW_REL_L2,
                     name="out vs float64")
    except AssertionError as e:
        failures.append(str(e))
    record("out_rel_l2", report.rel_l2)
    record("out_window_rel_l2", report.window_rel_l2)
    line = f"[{case.id}] {plan} out vs float64: rel_l2={report.rel_l2:.3e} window={report.window_rel_l2:.3e}"
    if case.has_final:
        state_report = compare.compare(x["final_state"], ref_state)
        record(f"state_{case.state_dtype}_rel_l2", state_report.rel_l2)
        line += f" state rel_l2={state_report.rel_l2:.3e}"
        try:
            bound = DECODE_STATE_REL_L2[x["final_state"].dtype] if short else STATE_REL_L2
            state_report.check(rel_l2=bound, name="final_state vs float64")
        except AssertionError as e:
            failures.append(str(e))
    print(line, flush=True)  # the measured errors, for setting the MEASURED bounds from the logs
    stage("compare")
    if failures:
        raise AssertionError(f"case {case.id}:\n" + "\n".join(failures))


def test_case(kda_case: matrix.Case, record_property) -> None:
    run_case(kda_case, record_property)


# --- adversarial checks that are not one input set ----------------------------------------------------------


def _fresh_outputs(x: dict) -> dict:
    y = dict(x)
    y["out"] = torch.full_like(x["out"], float("nan"))
    if x["final_state"] is not None:
        y["final_state"] = torch.full_like(x["final_state"], float("nan"))
    return y


@pytest.mark.kda_slice("adversarial")
@pytest.mark.parametrize(
    "case",
    [
        matrix.Case("adversarial", H=32, seqlens=(1300, 547, 2048, 963, 271, 3063), state_dtype="fp32"),
        matrix.Case("adversarial", H=4, T=8192, state_dtype="bf16"),
    ],
    ids=lambda c: c.id,
)
def test_deterministic(case: matrix.Case) -> None:
    """Two calls (cached workspace, then an explicit one) give bitwise equal results."""
    x = matrix.make_inputs(case, "cuda")
    first, second = _fresh_outputs(x), _fresh_outputs(x)
    flash_kda.fwd(**_fwd_args(first))
    workspace = torch.empty(flash_kda.workspace_bytes(x["q"], x["cu_seqlens"]), dtype=torch.uint8, device="cuda")
    flash_kda.fwd(**_fwd_args(second), workspace=workspace)
    for name in ("out", "final_state"):
        compare.assert_bitwise_equal(second[name], first[name], f"{name} of the second call")


@pytest.mark.kda_slice("adversarial")
@pytest.mark.parametrize("lead_chunks", [0, 1, 5, None], ids=lambda L: "auto" if L is None else f"lead{L}")
def test_overlap_ready_flags_start_at_zero(lead_chunks) -> None:
    """The overlap's ready flags are zeroed by every call (by the lead kernel; a memset where the lead is empty),
    whatever the workspace holds: a workspace of 0xFF bytes, where every stale flag reads "ready" and every record
    is NaN, gives the bits of a zeroed one."""
    case = matrix.Case("adversarial", H=40, T=2000, state_dtype="bf16")  # automatically an overlap (lead 10)
    x = matrix.make_inputs(case, "cuda")
    results = []
    for fill in (0x00, 0xFF):
        y = _fresh_outputs(x)
        with testing.force_plan(lead_chunks=lead_chunks):
            assert flash_kda.plan(x["q"]).lead_chunks >= 0, "the case must run the overlap"
            nbytes = flash_kda.workspace_bytes(x["q"], x["cu_seqlens"])
            workspace = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda")
            flash_kda.fwd(**_fwd_args(y), workspace=workspace)
        results.append(y)
    for name in ("out", "final_state"):
        compare.assert_bitwise_equal(results[1][name], results[0][name], f"{name} with a 0xFF workspace")


@pytest.mark.kda_slice("adversarial")
def test_cuda_graph_capture() -> None:
    """fwd neither synchronises nor allocates once its workspace is reserved, so it can be graph-captured."""
    case = matrix.Case("adversarial", H=4, seqlens=(17, 0, 100, 64))
    x = matrix.make_inputs(case, "cuda")
    eager = _fresh_outputs(x)
    flash_kda.fwd(**_fwd_args(eager))
    captured = _fresh_outputs(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flash_kda.reserve_workspace(flash_kda.workspace_bytes(x["q"], x["cu_seqlens"]), x["q"].device)
        flash_kda.fwd(**_fwd_args(captured))  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            flash_kda.fwd(**_fwd_args(captured))
    torch.cuda.current_stream().wait_stream(side)
    captured["out"].fill_(float("nan"))
    captured["final_state"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name in ("out", "final_state"):
        compare.assert_bitwise_equal(captured[name], eager[name], f"{name} of the graph replay")


@pytest.mark.kda_slice("adversarial")
@pytest.mark.parametrize(
    "cu, first_bad", [([0, 50, 30, 97], 2), ([0, 10, 500], 2), ([5, 20, 97], 0), ([0, -4, 97], 1), ([0, 40, 90], 2)],
    ids=str,
)
@pytest.mark.parametrize("segment_chunks", [None, 1], ids=["auto", "tsplit1"])
def test_malformed_cu_seqlens_is_memory_safe(cu: list[int], first_bad: int, segment_chunks) -> None:
    """Malformed boundaries are not checked on the host (that would synchronise); the kernels must clamp them:
    the call completes without a device fault (its result is unspecified, with and without the time split),
    the device records the first bad boundary for flash_kda.last_error, and check_cu_seqlens rejects them."""
    case = matrix.Case("adversarial", H=4, T=97)
    x = matrix.make_inputs(case, "cuda")
    x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64, device="cuda")
    x["initial_state"] = x["initial_state"][:1].expand(len(cu) - 1, -1, -1, -1).contiguous()
    x["final_state"] = torch.full_like(x["initial_state"], float("nan"))
    assert flash_kda.last_error() is None  # nothing pending from earlier tests
    with testing.force_plan(segment_chunks=segment_chunks):
        flash_kda.fwd(**_fwd_args(x))
    torch.cuda.synchronize()  # a device fault would surface here
    message = flash_kda.last_error()
    assert message is not None and f"cu_seqlens[{first_bad}]" in message, message
    assert flash_kda.last_error() is None  # the query resets the word
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_kda.check_cu_seqlens(x["cu_seqlens"], case.T)


@pytest.mark.kda_slice("adversarial")
def test_well_formed_cu_seqlens_leave_no_error() -> None:
    case = matrix.Case("adversarial", H=4, seqlens=(17, 0, 65, 1))
    x = matrix.make_inputs(case, "cuda")
    for cu in (x["cu_seqlens"], x["cu_seqlens"].to(torch.int32)):
        flash_kda.fwd(**{**_fwd_args(x), "cu_seqlens": cu})
    assert flash_kda.last_error() is None
