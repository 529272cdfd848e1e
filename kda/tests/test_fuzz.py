"""Seeded random calls of ``flash_kda.fwd``: shapes, varlen with empty and one-token sequences, state I/O and
dtypes (mixed too), pools with padding rows and in place, the model options (either gate, g + dt_bias across ±50
under the softplus gate, negative eigenvalues, grouped value heads with G of 2 or 4, A_log or dt_bias None), and on
the GPU a forced plan of every kind.

- GPU (marker ``gpu``): GPU_CASES calls, each bit for bit against ``numerics.twin_forward`` (out, and the whole
  final pool or state: untouched slots keep their poison) with the inputs unchanged; and STREAM_CASES decode-shaped
  calls of many 16-token sequences (an item per SM of an H100 or H200) that take the stream pass, likewise.
- CPU (runs in CI): CPU_CASES calls of the CPU path against the float64 reference (pools through the references'
  own gather and scatter), within the CPU path's bounds (test_cpu_path.py: out within 1.01 × the bf16 rounding
  floor, an fp32 state within 1e-6; under the softplus gate within 5e-5, test_softplus_numerics.py's bound).

Reproducible: case i of a run is drawn from random.Random(f"{SEED}:{i}") alone (its options from a second generator
of its own: lengths, key heads, states and plans are those the case drew before the options existed), so one failing
id reruns by itself (``--test_filter=fuzz17``). Sizes are kept small (at most a few hundred tokens) so each variant
runs in well under a minute.
"""

from __future__ import annotations

import random

import matrix
import pytest
import torch

import flash_kda
from flash_kda import compare, reference, testing

SEED = 26
GPU_CASES = 64
CPU_CASES = 32
FLOOR_FACTOR = 1.01  # test_cpu_path.py: measured worst 1.0000001
FP32_STATE_REL_L2 = 1e-6  # test_cpu_path.py: measured worst 3.4e-7
# The softplus gate's fp32 state (test_softplus_numerics.py: fp32 operands, fp32 state, MEASURED worst 1.1e-5): its
# decays reach several hundred per token (g + dt_bias up to ±50, exp(A_log) up to 16), and fp32 carries their sums to
# a few ulp of that magnitude, not of the decay's effect.
SOFTPLUS_FP32_STATE_REL_L2 = 5e-5
SEQLEN_CHOICES = (0, 1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 64, 100, 130)
# The stream pass's calls (kda_plan.h, stream_pass_runs): fixed-length sequences of 16 tokens, at least one
# (sequence, value head) item per SM: 144 items covers 144 SMs (an H100 or H200 has 132).
STREAM_CASES = 12
STREAM_MIN_ITEMS = 144


def random_case(i: int, *, gpu: bool) -> matrix.Case:
    """Case i of the fuzz (drawn from its own seeded generator); on the GPU with a forced plan of some kind."""
    rng = random.Random(f"{SEED}:{i}:{'gpu' if gpu else 'cpu'}")
    H = rng.choice((1, 2, 4, 8, 32) if gpu else (1, 2, 4))
    if rng.random() < 0.5:
        shape = dict(seqlens=tuple(rng.choice(SEQLEN_CHOICES) for _ in range(rng.randint(1, 6))))
        if sum(shape["seqlens"]) == 0 and not gpu:
            shape = dict(seqlens=shape["seqlens"] + (rng.choice(SEQLEN_CHOICES[1:]),))
        N = len(shape["seqlens"])
    else:
        shape = dict(B=rng.randint(1, 4), T=rng.choice(SEQLEN_CHOICES[1:]))
        N = shape["B"]
    state_io = rng.choice(matrix.STATE_IO)
    fields: dict = dict(state_io=state_io, state_dtype=rng.choice(matrix.STATE_DTYPES),
                        lower_bound=rng.choice((-5.0, -4.0, -3.99, -1.0, -0.01)))
    if state_io == "in+out":
        if rng.random() < 0.3:
            fields["inplace_state"] = True
        elif rng.random() < 0.25:
            fields["final_dtype"] = "fp32" if fields["state_dtype"] == "bf16" else "bf16"
    if state_io != "no_state" and rng.random() < 0.6:
        padding = rng.randint(0, N - 1) if rng.random() < 0.5 else 0
        fields.update(pool=N - padding + rng.randint(0, 3), padding=padding, indices_int32=rng.random() < 0.5,
                      indices_on_host=gpu and rng.random() < 0.2)
    if gpu:
        kind = rng.choice(("auto", "two_stage", "single_pass", "time_split", "overlap", "v_split", "decode"))
        if kind == "overlap" and "seqlens" in shape:
            kind = "time_split"  # the overlap runs fixed-length batches only
        fields.update({
            "auto": dict(),
            "two_stage": dict(single_pass=False, lead_chunks=-1),
            "single_pass": dict(single_pass=True),
            "time_split": dict(segment_chunks=rng.randint(1, 3), v_split=rng.choice((1, 2, 4, 8))),
            "overlap": dict(lead_chunks=rng.randint(0, 3)),
            "v_split": dict(v_split=rng.choice((2, 4, 8))),
            "decode": dict(decode=True),
        }[kind])
    slice_ = "pool" if fields.get("pool") else "adversarial"
    seed = rng.randrange(1 << 31)
    # The model options, from a generator of their own: H key heads, G·H value heads.
    options = random.Random(f"{SEED}:{i}:{'gpu' if gpu else 'cpu'}:options")
    G = options.choice((1, 1, 2, 4))
    gate = options.choice(matrix.GATES)
    if fields.get("single_pass"):  # the single pass runs the lower-bound gate only
        gate = "lower_bound"
    fields.update(gate=gate, neg_eigval=options.random() < 0.35, G=G, has_A_log=options.random() >= 0.15,
                  has_dt_bias=options.random() >= 0.15)
    if gate == "softplus" and options.random() < 0.35:
        fields["inputs"] = options.choice(("g=U±50", "g=+50", "g=-50"))
    return matrix.Case(slice_, H=G * H, **shape, **fields, seed=seed)


def random_stream_case(j: int) -> matrix.Case:
    """Stream-pass case j (its own seeded generator): a few hundred to a few thousand 16-token (sequence, head)
    items, pools with padding rows and in place, dense states of each dtype the stream pass takes, both gates,
    negative eigenvalues and grouped value heads."""
    rng = random.Random(f"{SEED}:stream:{j}")
    G = rng.choice((1, 1, 2))
    H = G * rng.choice((8, 16, 32))
    N = -(-STREAM_MIN_ITEMS // H) + rng.randint(0, 80)
    fields: dict = dict(lower_bound=rng.choice((-5.0, -4.0, -3.99, -1.0, -0.01)), neg_eigval=rng.random() < 0.3, G=G,
                        gate="softplus" if j % 3 == 1 else "lower_bound")
    # The state by j % 4: a bf16 pool (padding rows, in place or two pools), dense states in and out (a bf16
    # final state: an fp32 one keeps the chunk step), one of them, none.
    state_io = ("in+out", "in+out", rng.choice(("in_only", "out_only")), "no_state")[j % 4]
    fields.update(state_io=state_io, state_dtype="bf16" if j % 4 == 0 or state_io == "out_only"
                  else rng.choice(("bf16", "fp32")))
    if j % 4 == 0:
        padding = rng.randint(0, 4)
        fields.update(pool=N - padding + rng.randint(0, 3), padding=padding, inplace_state=rng.random() < 0.6,
                      indices_int32=rng.random() < 0.5, indices_on_host=rng.random() < 0.4)
    elif state_io == "in+out" and fields["state_dtype"] == "fp32":
        fields["final_dtype"] = "bf16"
    return matrix.Case("pool" if fields.get("pool") else "decode", H=H, B=N, T=16, **fields,
                       seed=rng.randrange(1 << 31))


def _args_before(case: matrix.Case, x: dict) -> dict:
    """The twin's / reference's arguments from the inputs as they are before the call (clones: in place)."""
    args = matrix.twin_args(x)
    if x["initial_state"] is not None:
        args["initial_state"] = x["initial_state"].clone()
    if case.pool:
        args["final_state"] = (args.get("initial_state") if case.inplace_state or not case.has_final
                               else x["final_state"].clone())
    return args


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(GPU_CASES), ids=lambda i: f"fuzz{i}")
def test_fuzz_gpu_equals_twin(i: int) -> None:
    _check_against_twin(random_case(i, gpu=True))


@pytest.mark.gpu
@pytest.mark.parametrize("j", range(STREAM_CASES), ids=lambda j: f"stream{j}")
def test_fuzz_stream_pass_equals_twin(j: int) -> None:
    from flash_kda import planning  # noqa: PLC0415

    case = random_stream_case(j)
    assert matrix.stream_pass_route(case, planning.sm_count_of(torch.cuda.current_device())), case.id
    # The stream pass runs the chunked arithmetic without a time split: the twin re-enacts that directly (not
    # through the route it shares with the kernel), so a call left on the token kernels fails on its bits.
    plan = _check_against_twin(case, stream_pass=True)
    assert plan.decode, plan


def _check_against_twin(case: matrix.Case, stream_pass: bool = False):
    """One call of ``case`` on the GPU (under its forced plan, if any) bit for bit against the twin (``stream_pass``:
    its chunked arithmetic, as the stream pass runs it), its inputs unchanged and no error recorded; the plan."""
    from flash_kda import numerics  # noqa: PLC0415

    x = matrix.make_inputs(case, "cuda")
    before = {n: x[n].clone() for n in matrix.INPUT_NAMES if x[n] is not None}
    args = _args_before(case, x)
    forced_segments = case.segment_chunks if case.segment_chunks >= 0 else None
    forced_lead = case.lead_chunks if case.lead_chunks >= -1 else None
    with testing.force_plan(v_split=case.v_split, segment_chunks=forced_segments, single_pass=case.single_pass,
                            lead_chunks=forced_lead, decode=case.decode):
        flash_kda.fwd(**matrix.fwd_args(x))
        plan = flash_kda.plan(x["v"], x["cu_seqlens"], **matrix.plan_args(x))  # (v: the value heads)
    # The plan the call ran (decode included): short shapes run the decode kernel unless something else is forced.
    twin_out, twin_state = numerics.twin_forward(**args, segment_chunks=0 if stream_pass else plan.segment_chunks,
                                                 decode=False if stream_pass else plan.decode,
                                                 final_dtype=x["final_state"].dtype if case.has_final else None)
    failures = []
    if not torch.equal(x["out"], twin_out):
        failures.append(f"out != twin: {compare.bitwise_mismatch(x['out'], twin_out)}")
    if case.has_final:
        twin_state = twin_state.to(x["final_state"].dtype)
        actual, base = x["final_state"], args.get("final_state")
        if case.pool:  # named slots against the twin, the others against the pool before the call
            from flash_kda import pools  # noqa: PLC0415

            _, slots = pools.named(x["state_indices"], case.pool)
            untouched = torch.ones(case.pool, dtype=torch.bool)
            untouched[slots.cpu()] = False
            if base is not None and not matrix.same_bits(actual[untouched.cuda()],
                                                         base.to(actual.dtype)[untouched.cuda()]):
                failures.append("pool slots no sequence names changed")
            actual, twin_state = actual[slots], twin_state[slots]
        if not torch.equal(actual, twin_state):
            failures.append(f"final_state != twin: {compare.bitwise_mismatch(actual, twin_state)}")
    for name, saved in before.items():
        if not (name == "initial_state" and case.inplace_state) and not torch.equal(x[name], saved):
            failures.append(f"input {name} was modified")
    assert flash_kda.last_error() is None
    assert not failures, f"case {case.id} under {plan}:\n" + "\n".join(failures)
    return plan


@pytest.mark.parametrize("i", range(CPU_CASES), ids=lambda i: f"fuzz{i}")
def test_fuzz_cpu_matches_float64(i: int) -> None:
    case = random_case(i, gpu=False)
    x = matrix.make_inputs(case, "cpu")
    args = _args_before(case, x)
    flash_kda.fwd(**matrix.fwd_args(x))
    ref_out, ref_state = reference.reference_chunked(**args)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out).rel_l2
    compare.compare(x["out"], ref_out).check(rel_l2=FLOOR_FACTOR * floor, name=f"{case.id} out")
    if case.has_final:
        # The whole pool: untouched slots hold NaN (or the initial values in place) in both.
        report = compare.compare(x["final_state"], ref_state)
        if x["final_state"].dtype == torch.float32:
            bound = FP32_STATE_REL_L2 if case.gate == "lower_bound" else SOFTPLUS_FP32_STATE_REL_L2
            report.check(rel_l2=bound, name=f"{case.id} fp32 final_state")
        else:
            state_floor = compare.compare(ref_state.to(torch.bfloat16), ref_state).rel_l2
            report.check(rel_l2=FLOOR_FACTOR * state_floor, name=f"{case.id} bf16 final_state")


def test_fuzz_draws_every_kind() -> None:
    """The GPU draw covers pools with padding, in place, varlen, both dtypes and every plan kind."""
    cases = [random_case(i, gpu=True) for i in range(GPU_CASES)]
    assert any(c.pool and c.padding for c in cases) and any(c.pool and c.inplace_state for c in cases)
    assert any(c.varlen for c in cases) and {c.state_dtype for c in cases} >= {"bf16", "fp32"}
    assert any(c.single_pass for c in cases) and any(c.segment_chunks > 0 for c in cases)
    assert any(c.lead_chunks >= 0 for c in cases) and any(c.v_split > 1 for c in cases)
    assert any(c.indices_on_host for c in cases)
    assert random_case(3, gpu=True) == random_case(3, gpu=True)  # reproducible


def test_fuzz_stream_draws_take_the_stream_pass() -> None:
    """Every stream-pass draw takes the stream pass at 132 and at 144 SMs, and the draws cover pools with padding
    in place, host indices, both initial-state dtypes, no state, both gates, negative eigenvalues and grouped value
    heads."""
    cases = [random_stream_case(j) for j in range(STREAM_CASES)]
    assert all(matrix.stream_pass_route(c, sms) for c in cases for sms in (132, 144)), [c.id for c in cases]
    assert any(c.pool and c.padding and c.inplace_state for c in cases)
    assert any(c.pool and c.indices_on_host for c in cases)
    assert {c.state_dtype for c in cases} >= {"bf16", "fp32", "none"}
    assert any(c.gate == "softplus" for c in cases) and any(c.neg_eigval for c in cases)
    assert any(c.G > 1 for c in cases)
    assert random_stream_case(5) == random_stream_case(5)


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_fuzz_draws_every_option(gpu: bool) -> None:
    """Each draw covers both gates, negative eigenvalues under each, G of 2 and 4 (with pools too), A_log and
    dt_bias None, and the softplus gate's extreme inputs."""
    cases = [random_case(i, gpu=gpu) for i in range(GPU_CASES if gpu else CPU_CASES)]
    assert {(c.gate, c.neg_eigval) for c in cases} == {(g, n) for g in matrix.GATES for n in (False, True)}
    assert {c.G for c in cases} == {1, 2, 4} and any(c.G > 1 and c.pool for c in cases)
    assert any(not c.has_A_log for c in cases) and any(not c.has_dt_bias for c in cases)
    assert any(c.inputs in matrix.SOFTPLUS_RECIPES for c in cases)
