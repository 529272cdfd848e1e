"""compute-sanitizer memcheck and racecheck over a representative slice of forward calls (GPU).

A child Python process runs small cases that reach the kernel's edge paths (a partial chunk, varlen with empty
sequences, both state dtypes, no state, int32 cu_seqlens) and, with forced plans, the 8-warp CTAs whose
products are wgmma (the finishing pass at v_split 1, the scan at scan_v_split 1), the single pass (a
sequence of more than one block of 8 chunks, empty ones, a partial chunk) and the overlap (lead and tail
records, a partial chunk) and the decode kernel (one and 16 tokens, empty sequences, both state dtypes, in place,
and forced over longer sequences), the warp-specialised decode kernel over more than 32 heads per group (its head
table refilled) and the stream pass (a bf16 state prefetch with padding rows in a pool in place),
then malformed CUDA cu_seqlens (decreasing, past the end, a first boundary other than
0, negative) under every plan kind that takes cu_seqlens (two stages, longest first, the single pass, the time
split with and without a V split, the decode kernel), each naming its first bad index through
``flash_kda.last_error``, and a last boundary short of T (padding tokens: no error), then pooled states (padding rows, in place, every plan kind), the softplus gate
with grouped value heads (negative eigenvalues, A_log or dt_bias None, pools; every plan kind) and a log decay of
-960 per token, and a state index past the pool under two stages, the single pass, the time split, the overlap,
the decode kernel and the stream pass (named by ``last_error``; no access outside the pool), under each tool; the test asserts exit
code 0 and the tool's clean summary ("ERROR SUMMARY: 0 errors" for memcheck, "RACECHECK SUMMARY: 0 hazards displayed (0 errors,
0 warnings)" for racecheck). compute-sanitizer is looked up on PATH, then $KDA_CUDA_HOME/bin, then
/usr/local/cuda/bin; where it is absent the test is skipped (with KDA_REQUIRE_GPU=1 it fails instead).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

# What each tool prints when it found nothing (racecheck has its own summary line).
CLEAN = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
}
TIMEOUT_S = 900

CHILD = textwrap.dedent(
    """
    import contextlib, time, torch, matrix, flash_kda
    from flash_kda import testing
    automatic = contextlib.nullcontext
    chunked = lambda: testing.force_plan(decode=False)  # short batches that would otherwise run the decode kernel
    cases = [
        (matrix.Case("fixed_h1_h4", H=2, T=37, state_dtype="bf16"), automatic),
        (matrix.Case("fixed_h1_h4", H=2, T=37, state_dtype="fp32"), automatic),
        (matrix.Case("adversarial", H=2, seqlens=(0, 16, 0, 33, 0), state_dtype="bf16"), chunked),
        (matrix.Case("adversarial", H=2, seqlens=(0, 16, 0, 33, 0), state_dtype="fp32", cu_seqlens_int32=True),
         chunked),
        (matrix.Case("adversarial", H=2, seqlens=(5, 17), state_io="no_state"), chunked),
        (matrix.Case("batched", H=1, B=2, T=20, state_io="out_only", state_dtype="fp32"), automatic),
        # 8-warp CTAs (wgmma): the finishing pass unsplit, short and with more chunks than ring stages (the
        # producer warp refills stages the consumers released), then a time split whose scan runs them too.
        (matrix.Case("fixed_h1_h4", H=2, T=37, state_dtype="bf16"), lambda: testing.force_plan(v_split=1)),
        (matrix.Case("batched", H=2, B=2, T=90, state_dtype="bf16"), lambda: testing.force_plan(v_split=1)),
        (matrix.Case("adversarial", H=2, seqlens=(0, 16, 0, 90, 0), state_dtype="fp32"),
         lambda: testing.force_plan(v_split=1, segment_chunks=2, scan_v_split=1)),
        # The single pass: its shared-memory ring written by the CTA's own warps, then read by wgmma.
        (matrix.Case("adversarial", H=2, seqlens=(0, 16, 0, 150, 5), state_dtype="bf16"),
         lambda: testing.force_plan(single_pass=True)),
        # The overlap: records of the lead kernel and of the tail kernel (behind ready flags), a partial chunk.
        (matrix.Case("batched", H=2, B=2, T=90, state_dtype="fp32"), lambda: testing.force_plan(lead_chunks=2)),
        # Pooled states: slots of a larger pool, padding rows (no read, no write), in place, on every plan kind.
        (matrix.Case("pool", H=2, B=3, T=37, state_dtype="bf16", pool=5, padding=1), automatic),
        (matrix.Case("pool", H=2, seqlens=(0, 16, 0, 33, 5), state_dtype="fp32", pool=7, padding=2,
                     inplace_state=True), lambda: testing.force_plan(v_split=1, segment_chunks=2, scan_v_split=1)),
        (matrix.Case("pool", H=2, seqlens=(0, 16, 0, 150, 5), state_dtype="bf16", pool=6, padding=1,
                     final_dtype="fp32"), lambda: testing.force_plan(single_pass=True)),
        (matrix.Case("pool", H=2, B=2, T=90, state_dtype="fp32", pool=3, padding=1),
         lambda: testing.force_plan(lead_chunks=2)),
        (matrix.Case("pool", H=2, B=3, T=5, state_dtype="fp32", pool=5, padding=1), automatic),  # decode
        (matrix.Case("pool", H=2, B=3, T=40, state_dtype="bf16", pool=4, state_io="out_only"),
         lambda: testing.force_plan(v_split=4, segment_chunks=1)),
        # The decode kernels (chosen for sequences of at most 16 tokens): one token, 16, empty sequences, both state
        # dtypes, int32 cu_seqlens, in place, mixed dtypes, no state, and a forced run over longer sequences; the
        # chunk step (16 tokens per sequence on average) with 16 tokens, and in place over several chunks.
        (matrix.Case("decode", H=2, B=3, T=1, state_dtype="bf16"), automatic),
        (matrix.Case("decode", H=2, B=3, T=16, state_dtype="fp32"), automatic),
        (matrix.Case("decode", H=2, seqlens=(0, 40, 0, 33, 7), state_dtype="bf16", inplace_state=True), automatic),
        (matrix.Case("decode", H=2, seqlens=(0, 3, 0, 16, 1), state_dtype="bf16"), automatic),
        (matrix.Case("decode", H=2, seqlens=(0, 3, 0, 16, 1), state_dtype="fp32", cu_seqlens_int32=True), automatic),
        (matrix.Case("decode", H=2, seqlens=(2, 0, 5), state_dtype="fp32", inplace_state=True), automatic),
        (matrix.Case("decode", H=2, T=3, state_dtype="bf16", final_dtype="fp32"), automatic),
        (matrix.Case("decode", H=2, seqlens=(4, 0, 1), state_io="no_state"), automatic),
        # The warp-specialised kernel over more than 32 heads per group (8,800 heads: 33 or 34 per group on 132 SMs),
        # its head table refilled between heads; two tokens each, the fewest it takes.
        (matrix.Case("decode", H=2, seqlens=(2,) * 4400, state_dtype="bf16", inplace_state=True), automatic),
        (matrix.Case("adversarial", H=2, seqlens=(0, 40, 0, 17), state_dtype="bf16"),
         lambda: testing.force_plan(decode=True)),
        # The stream pass (16 tokens per sequence, an item per SM, no fp32 final state): its bf16 state prefetch
        # two items ahead with a padding row in a pool in place, an fp32 initial state, no state and softplus.
        (matrix.Case("decode", H=2, B=80, T=16, state_dtype="bf16", pool=90, padding=3, inplace_state=True),
         automatic),
        (matrix.Case("decode", H=2, B=80, T=16, state_dtype="fp32", final_dtype="bf16"), automatic),
        (matrix.Case("decode", H=4, G=2, B=40, T=16, gate="softplus", state_io="no_state"), automatic),
        # The softplus gate with grouped value heads (two value heads per key head; four in the pool), negative
        # eigenvalues and A_log / dt_bias None among them, on every plan kind (the single pass with the lower-bound
        # gate); a log decay of -960 per token.
        (matrix.Case("gva", H=4, G=2, T=37, gate="softplus", state_dtype="bf16"), automatic),
        (matrix.Case("gva", H=4, G=2, B=2, T=90, gate="softplus", neg_eigval=True, state_dtype="fp32"),
         lambda: testing.force_plan(v_split=1)),
        (matrix.Case("gva", H=4, G=2, seqlens=(0, 16, 0, 90, 0), gate="softplus", state_dtype="fp32",
                     has_A_log=False), lambda: testing.force_plan(v_split=1, segment_chunks=2, scan_v_split=1)),
        (matrix.Case("gva", H=4, G=2, seqlens=(0, 16, 0, 150, 5), gate="softplus", neg_eigval=True,
                     state_dtype="bf16"), lambda: testing.force_plan(single_pass=False, lead_chunks=-1)),
        (matrix.Case("gva", H=4, G=2, seqlens=(0, 16, 0, 150, 5), neg_eigval=True, state_dtype="bf16"),
         lambda: testing.force_plan(single_pass=True)),  # (the single pass runs the lower-bound gate only)
        (matrix.Case("gva", H=4, G=2, B=2, T=90, gate="softplus", state_dtype="fp32", has_dt_bias=False),
         lambda: testing.force_plan(lead_chunks=2)),
        (matrix.Case("gva", H=4, G=2, seqlens=(0, 3, 0, 16, 1), gate="softplus", state_dtype="fp32"), automatic),
        (matrix.Case("gva", H=8, G=4, B=3, T=37, gate="softplus", state_dtype="bf16", pool=5, padding=1),
         lambda: testing.force_plan(v_split=4, segment_chunks=1)),
        (matrix.Case("gva", H=8, G=4, B=3, T=1, gate="softplus", state_dtype="fp32", pool=4, padding=1,
                     inplace_state=True), automatic),  # decode
        (matrix.Case("gate_softplus", H=2, seqlens=(5, 0, 40), gate="softplus", inputs="decay=-960",
                     state_dtype="fp32"), chunked),
        (matrix.Case("gate_softplus", H=2, T=9, gate="softplus", inputs="decay=-960", state_dtype="bf16"),
         automatic),  # decode
        # Per-token states (state_indices [N, L], accepted starts): the decode kernel, and the chunked kernels
        # followed by the per-token pass (padding row, a sequence longer than L).
        (matrix.Case("token_states", H=2, B=3, T=4, state_tokens=4, pool=14, state_dtype="bf16", inplace_state=True),
         automatic),
        (matrix.Case("token_states", H=2, seqlens=(0, 7, 3, 40), state_tokens=4, pool=14, padding=1,
                     state_dtype="fp32"), chunked),
        # Checkpoints on every plan kind: the finishing pass (unsplit and time split), the single pass, the overlap
        # and the decode kernel, with sequences shorter than C and empty ones.
        (matrix.Case("checkpoints", H=2, B=2, T=90, checkpoint_every=32, pool=10, state_dtype="fp32"), automatic),
        (matrix.Case("checkpoints", H=2, seqlens=(0, 40, 100, 5), checkpoint_every=16, pool=33, state_dtype="bf16",
                     inplace_state=True), lambda: testing.force_plan(v_split=1, segment_chunks=2, scan_v_split=1)),
        (matrix.Case("checkpoints", H=2, seqlens=(0, 16, 0, 150, 5), checkpoint_every=64, pool=21,
                     state_dtype="bf16"), lambda: testing.force_plan(single_pass=True)),
        (matrix.Case("checkpoints", H=2, B=2, T=90, checkpoint_every=32, pool=9, state_dtype="bf16"),
         lambda: testing.force_plan(lead_chunks=2)),
        (matrix.Case("checkpoints", H=2, seqlens=(3, 40, 0), checkpoint_every=16, pool=13, state_dtype="fp32"),
         lambda: testing.force_plan(decode=True)),
    ]
    for case, plan in cases:
        start = time.perf_counter()
        # Inputs made on the CPU: fewer foreign kernels under the sanitizer.
        x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in matrix.make_inputs(case, "cpu").items()}
        with plan():
            flash_kda.fwd(**matrix.fwd_args(x), **matrix.serving_args(x))
        torch.cuda.synchronize()
        print("ran", case.id, f"in {time.perf_counter() - start:.1f} s", flush=True)

    # Malformed CUDA cu_seqlens (never read on the host) under every plan kind that takes cu_seqlens: the kernels
    # clamp them and stay inside their buffers; the device word names the first bad index (none for padding
    # tokens past the last boundary, which are allowed). (The overlap runs
    # fixed-length batches only: a varlen call never takes it, forced or not.)
    malformed = [
        # (boundaries over T = 400 tokens, first bad index); mean 9 chunks a sequence (no single pass unforced)
        ([0, 200, 100, 400], 2),          # decreasing
        ([0, 150, 5000, 400], 2),         # past the end
        ([5, 100, 250, 400], 0),          # first not 0
        ([0, -7, 200, 400], 1),           # negative
        ([0, 100, 200, 300], None),       # last short of T: padding tokens, not an error
    ]
    plans = [
        ("two_stage", lambda: testing.force_plan(single_pass=False, lead_chunks=-1), 4),
        ("longest_first", automatic, 96),  # N * H > 132 SMs, at most 256 sequences: ranked longest first
        ("single_pass", lambda: testing.force_plan(single_pass=True), 4),
        ("time_split", lambda: testing.force_plan(v_split=1, segment_chunks=2, scan_v_split=1), 4),
        ("time_split_vsplit", lambda: testing.force_plan(v_split=4, segment_chunks=3), 4),
        ("decode", lambda: testing.force_plan(decode=True), 4),
    ]
    for cu, first_bad in malformed:
        for plan_name, plan, H in plans:
            case = matrix.Case("adversarial", H=H, T=400, state_dtype="fp32")
            x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in matrix.make_inputs(case, "cpu").items()}
            N = len(cu) - 1
            x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64).cuda()
            x["initial_state"] = x["initial_state"][:1].expand(N, -1, -1, -1).contiguous()
            x["final_state"] = torch.full_like(x["initial_state"], float("nan"))
            with plan():
                if plan_name == "longest_first":
                    assert flash_kda.plan(x["q"], x["cu_seqlens"]).longest_first
                flash_kda.fwd(**matrix.fwd_args(x))
            torch.cuda.synchronize()
            message = flash_kda.last_error()
            if first_bad is None:
                assert message is None, (cu, plan_name, message)
            else:
                assert message is not None and f"cu_seqlens[{first_bad}]" in message, (cu, plan_name, message)
            print("ran malformed", cu, plan_name, flush=True)

    # A CUDA state index past the pool (P = 3) beside a padding row, under every plan kind for fixed lengths: the
    # kernels skip it (no read, no write outside the pool) and the device word names the sequence.
    bad_index_plans = [
        ("two_stage", lambda: testing.force_plan(single_pass=False, lead_chunks=-1)),
        ("single_pass", lambda: testing.force_plan(single_pass=True)),
        ("time_split", lambda: testing.force_plan(v_split=2, segment_chunks=2)),
        ("overlap", lambda: testing.force_plan(lead_chunks=1)),
        ("decode", lambda: testing.force_plan(decode=True)),
    ]
    for index_dtype in (torch.int64, torch.int32):
        for plan_name, plan in bad_index_plans:
            case = matrix.Case("pool", H=2, B=4, T=90, state_dtype="bf16", pool=3, padding=1, inplace_state=True)
            x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in matrix.make_inputs(case, "cpu").items()}
            x["state_indices"] = torch.tensor([0, 1 << 30, -1, 2], dtype=index_dtype).cuda()
            with plan():
                flash_kda.fwd(**matrix.fwd_args(x))
            torch.cuda.synchronize()
            message = flash_kda.last_error()
            assert message is not None and "state_indices[1]" in message, (plan_name, message)
            print("ran bad state index", plan_name, index_dtype, flush=True)

    # The same under the stream pass (automatic for these shapes): its state prefetch two items ahead skips the
    # index past the pool and the padding row.
    from flash_kda import planning
    assert planning.stream_pass_runs(False, 16, fp32_final=False, items=160,
                                     sm_count=planning.sm_count_of(torch.cuda.current_device()))
    for index_dtype in (torch.int64, torch.int32):
        case = matrix.Case("pool", H=2, B=80, T=16, state_dtype="bf16", pool=80, inplace_state=True)
        x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in matrix.make_inputs(case, "cpu").items()}
        indices = torch.arange(80, dtype=index_dtype)
        indices[1], indices[2] = 1 << 30, -1
        x["state_indices"] = indices.cuda()
        flash_kda.fwd(**matrix.fwd_args(x))
        torch.cuda.synchronize()
        message = flash_kda.last_error()
        assert message is not None and "state_indices[1]" in message, ("stream_pass", message)
        print("ran bad state index stream_pass", index_dtype, flush=True)

    # A CUDA checkpoint entry past the pool under the same plan kinds: skipped (nothing written outside the pool),
    # named by the device word.
    for plan_name, plan in bad_index_plans:
        case = matrix.Case("checkpoints", H=2, B=4, T=90, checkpoint_every=32, pool=20, state_dtype="fp32")
        x = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in matrix.make_inputs(case, "cpu").items()}
        x["checkpoint_indices"][1, 0] = 1 << 30
        with plan():
            flash_kda.fwd(**matrix.fwd_args(x), **matrix.serving_args(x))
        torch.cuda.synchronize()
        message = flash_kda.last_error()
        assert message is not None and "checkpoint_indices[1]" in message, (plan_name, message)
        print("ran bad checkpoint index", plan_name, flush=True)
    """
)
MALFORMED_RUNS = 5 * 6  # malformed boundaries x plan kinds in CHILD
BAD_INDEX_RUNS = 2 * 6  # index dtypes x plan kinds (the stream pass's own loop too) of the state index past the pool
BAD_CHECKPOINT_RUNS = 5  # plan kinds of the checkpoint entry past the pool in CHILD


def find_sanitizer() -> str | None:
    candidates = [shutil.which("compute-sanitizer")]
    if os.environ.get("KDA_CUDA_HOME"):
        candidates.append(str(Path(os.environ["KDA_CUDA_HOME"]) / "bin" / "compute-sanitizer"))
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@pytest.mark.parametrize("tool", sorted(CLEAN))
def test_compute_sanitizer(tool: str, record_property) -> None:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        reason = "compute-sanitizer not found on PATH, in $KDA_CUDA_HOME/bin or /usr/local/cuda/bin"
        if os.environ.get("KDA_REQUIRE_GPU", "") == "1":
            pytest.fail(f"KDA_REQUIRE_GPU=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), *sys.path])
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # exact allocations, so out-of-bounds accesses are visible
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", CHILD]
    print("running:", " ".join(cmd[:5]), "python -c <cases>", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    tail = output[-6000:]
    assert proc.returncode == 0, f"compute-sanitizer --tool {tool} exited {proc.returncode}:\n{tail}"
    assert CLEAN[tool] in output, f"compute-sanitizer --tool {tool} did not print {CLEAN[tool]!r}:\n{tail}"
    ran = [line for line in proc.stdout.splitlines() if line.startswith("ran ")]
    # One Case( builds the malformed runs, two the bad state index runs, one the bad checkpoint entry runs.
    expected = CHILD.count("matrix.Case(") - 4 + MALFORMED_RUNS + BAD_INDEX_RUNS + BAD_CHECKPOINT_RUNS
    assert len(ran) == expected, f"{len(ran)} of {expected} cases ran under {tool}:\n{tail}"
    # The slowest calls under the tool (the target's time is mostly theirs), kept in the junit XML's properties.
    timed = [line for line in ran if line.endswith(" s")]
    timed.sort(key=lambda line: float(line.rsplit(" ", 2)[-2]), reverse=True)
    record_property("slowest_calls", "; ".join(line.removeprefix("ran ") for line in timed[:5]))
