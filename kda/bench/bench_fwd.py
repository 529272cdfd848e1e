"""Side-by-side benchmark of flash_kda.fwd and fla's chunk_kda (Triton) in one process, plus accuracy.

Prints one table of times (median of CUDA-event timings) with tokens/s and the memory floor, and one table of
relative L2 errors against the float64 reference for flash_kda (bf16 and fp32 state) and fla. A program, not
a test: run it on a GPU machine, e.g.

    tools/bazel run //kda/bench:bench_fwd -- --cases=all --json=/tmp/bench.json

fla is optional (pure-Python wheels `fla-core` + `flash-linear-attention`); without it its columns are empty.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import torch
from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("cases", "all", "'all' or comma-separated indices into CASES")
flags.DEFINE_integer("iters", 20, "timed calls per case (a quarter of it, at least 3, above 4M token-heads)")
flags.DEFINE_bool("accuracy", True, "also measure errors against the float64 reference")
flags.DEFINE_integer("accuracy_max_token_heads", 1_600_000, "skip the float64 reference above this size")
flags.DEFINE_string("json", None, "write every number here")

BYTES_PER_TOKEN_HEAD = 1282  # q, k, v, g, out in bf16 (5 x 256 B) + beta (2 B): SPEC §5
COPY_BANDWIDTH = 4.25e12  # device copy, read + write, measured on the H200 (SPEC §5)
HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int  # per row; for varlen the total
    heads: int
    seqlens: Optional[tuple] = None  # varlen: B must be 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen


def _varlen(name: str, lens: list[int], heads: int) -> Case:
    return Case(name, 1, sum(lens), heads, tuple(lens))


CASES = [
    Case("T8192 H96", 1, 8192, 96),
    Case("T8192 H64", 1, 8192, 64),
    Case("T8192 H32", 1, 8192, 32),
    Case("B8 T1024 H32", 8, 1024, 32),
    _varlen("varlen [1300,547,2048,963,271,3063] H96", [1300, 547, 2048, 963, 271, 3063], 96),
    _varlen("varlen 1024x8 H96", [1024] * 8, 96),
    Case("T32768 H8", 1, 32768, 8),
    Case("T131072 H1", 1, 131072, 1),
    Case("T8192 H16", 1, 8192, 16),
    Case("B32 T512 H32", 32, 512, 32),
    _varlen("varlen 64x128 H32", [128] * 64, 32),
    Case("T1048576 H1", 1, 1048576, 1),
]


def make_inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H = case.batch, case.seqlen, case.heads

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    q, k, v, g = (randn(B, T, H, HEAD_DIM) for _ in range(4))
    beta = randn(B, T, H)
    A_log = torch.rand(H, generator=gen, device=device) * 0.5
    dt_bias = torch.randn(H, HEAD_DIM, generator=gen, device=device) * 0.1
    cu = None
    n = B
    if case.seqlens is not None:
        lens = torch.tensor((0,) + case.seqlens, dtype=torch.int64)
        cu = torch.cumsum(lens, 0).to(device)
        n = len(case.seqlens)
    init = torch.randn(n, H, HEAD_DIM, HEAD_DIM, generator=gen, device=device) * 0.1
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, init=init, n=n)


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_flash_kda(inp, state_dtype, scale, lower_bound):
    import flash_kda

    out = torch.empty_like(inp["v"])
    init = inp["init"].to(state_dtype)
    final = torch.empty_like(init)

    def call():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, out, inp["A_log"], inp["dt_bias"],
                      lower_bound, initial_state=init, final_state=final, cu_seqlens=inp["cu_seqlens"])

    return call, out, final


def run_fla(inp, scale, lower_bound):
    os.environ["FLA_FLASH_KDA"] = "0"  # measure fla's own Triton path, not a dispatch to a flash_kda package
    from fla.ops.kda import chunk_kda

    result = {}

    def call():
        o, s = chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=scale,
                         initial_state=inp["init"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                         lower_bound=lower_bound, state_v_first=True, cu_seqlens=inp["cu_seqlens"],
                         A_log=inp["A_log"], dt_bias=inp["dt_bias"])
        result["out"], result["final"] = o, s

    return call, result


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def main(argv: list[str]) -> None:
    del argv  # flags only
    if not torch.cuda.is_available():
        raise app.UsageError("bench_fwd times the CUDA kernel and needs a visible sm_90 GPU (H100/H200)")
    import flash_kda
    from flash_kda import reference

    device = "cuda"
    scale, lower_bound = HEAD_DIM ** -0.5, -5.0
    cases = CASES if FLAGS.cases == "all" else [CASES[int(i)] for i in FLAGS.cases.split(",")]
    try:
        run_fla_available = True
        import fla  # noqa: F401
    except Exception as exc:  # fla is optional
        logging.warning("fla not importable (%s); its columns stay empty", exc)
        run_fla_available = False

    info = flash_kda.device_info(0)
    logging.info("%s %s torch %s %s", time.strftime("%Y-%m-%d"), torch.cuda.get_device_name(0), torch.__version__, info)
    rows = []
    for case in cases:
        inp = make_inputs(case, device)
        row = {"case": case.name, "token_heads": case.tokens * case.heads}
        iters = FLAGS.iters if case.tokens * case.heads <= 4_000_000 else max(3, FLAGS.iters // 4)
        with torch.inference_mode():
            call, out_bf, fin_bf = run_flash_kda(inp, torch.bfloat16, scale, lower_bound)
            row["flash_kda_ms"] = time_ms(call, iters)
            call32, out32, fin32 = run_flash_kda(inp, torch.float32, scale, lower_bound)
            row["flash_kda_fp32_state_ms"] = time_ms(call32, iters)
            if run_fla_available:
                fla_call, fla_res = run_fla(inp, scale, lower_bound)
                try:
                    row["fla_ms"] = time_ms(fla_call, iters)
                except Exception as exc:
                    logging.warning("fla failed on %s: %s", case.name, exc)
                    fla_res.clear()
            if FLAGS.accuracy and case.tokens * case.heads <= FLAGS.accuracy_max_token_heads:
                ref_out, ref_fin = reference.reference_chunked(
                    inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp["A_log"], inp["dt_bias"],
                    lower_bound, initial_state=inp["init"], cu_seqlens=inp["cu_seqlens"])
                call()
                call32()
                row["err_out_bf16_state"] = rel_l2(out_bf, ref_out)
                row["err_state_bf16"] = rel_l2(fin_bf, ref_fin)
                row["err_out_fp32_state"] = rel_l2(out32, ref_out)
                row["err_state_fp32"] = rel_l2(fin32, ref_fin)
                row["err_out_bf16_rounding"] = rel_l2(ref_out.to(torch.bfloat16), ref_out)
                if run_fla_available and "out" in fla_res:
                    fla_call()
                    row["fla_err_out"] = rel_l2(fla_res["out"], ref_out)
                    row["fla_err_state"] = rel_l2(fla_res["final"], ref_fin)
                del ref_out, ref_fin
        floor = case.tokens * case.heads * BYTES_PER_TOKEN_HEAD / COPY_BANDWIDTH * 1e3
        row["floor_ms"] = floor
        row["tokens_per_s"] = case.tokens / (row["flash_kda_ms"] * 1e-3)
        rows.append(row)
        logging.info("%s", json.dumps(row))
        del inp
        torch.cuda.empty_cache()

    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(rows, f, indent=1)

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    print("\n## Speed (ms, median; bf16 state in/out)")
    print("| case | flash_kda ms | fp32-state ms | fla ms | fla/flash_kda | Mtok/s | floor ms | % of floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        speedup = r["fla_ms"] / r["flash_kda_ms"] if "fla_ms" in r else None
        print(f"| {r['case']} | {fmt(r['flash_kda_ms'], '.3f')} | {fmt(r['flash_kda_fp32_state_ms'], '.3f')} | "
              f"{fmt(r.get('fla_ms'), '.3f')} | {fmt(speedup, '.2f')} | {r['tokens_per_s'] / 1e6:.1f} | "
              f"{r['floor_ms']:.3f} | {100 * r['floor_ms'] / r['flash_kda_ms']:.1f} |")
    print("\n## Accuracy (relative L2 vs float64)")
    print("| case | out (bf16 st) | state bf16 | out (fp32 st) | state fp32 | fla out | fla state | bf16(exact) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "err_out_bf16_state" not in r:
            continue
        print(f"| {r['case']} | {fmt(r['err_out_bf16_state'], '.2e')} | {fmt(r['err_state_bf16'], '.2e')} | "
              f"{fmt(r['err_out_fp32_state'], '.2e')} | {fmt(r['err_state_fp32'], '.2e')} | "
              f"{fmt(r.get('fla_err_out'), '.2e')} | {fmt(r.get('fla_err_state'), '.2e')} | "
              f"{fmt(r['err_out_bf16_rounding'], '.2e')} |")


if __name__ == "__main__":
    app.run(main)
