"""Where the decode kernel stops beating the chunked plans (a development probe, not a test): per batch shape and
tokens per sequence, the time of one call on the decode kernel and on a chunked plan (testing.force_plan), from a
CUDA graph replay (GPU time) and eager (as bench_fwd times it), bf16 states in place. The automatic plan's rule
(kda_plan.h, "decode") should pick the faster one.

On the GPU machine, after `tools/offline/bazel-offline build //kda:py //kda/bench:all`:
  R=bazel-bin/kda/bench/bench_fwd.runfiles/flash_kda
  PYTHONPATH="$(pwd)/kda/bench:${R}/kda/python" /opt/torch/.venv/bin/python3 tools/dev/decode_crossover.py
"""
import torch
from absl import flags

import bench_fwd
import flash_kda
from flash_kda import testing

flags.FLAGS(["decode_crossover"])
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0
SHAPES = ((64, 32), (128, 32), (512, 8))  # (sequences, heads)
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main() -> None:
    print("| N | H | T | decode graph ms | chunked graph ms | decode eager ms | chunked eager ms | auto plan |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, heads in SHAPES:
        for T in LENGTHS:
            case = bench_fwd.Case(f"B{n} T{T} H{heads}", n, T, heads)
            x = bench_fwd.make_inputs(case, "cuda")
            state = x["init"].to(torch.bfloat16)
            out = torch.empty_like(x["v"])
            cells = {}
            for decode in (True, False):
                with testing.force_plan(decode=decode):
                    def call():
                        flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, out, x["A_log"],
                                      x["dt_bias"], LOWER_BOUND, initial_state=state, final_state=state)

                    cells[decode] = (bench_fwd.graph_time_ms(call, 30), bench_fwd.time_ms(call, 30))
            auto = "decode" if flash_kda.plan(x["q"]).decode else "chunked"
            print(f"| {n} | {heads} | {T} | {cells[True][0]:.3f} | {cells[False][0]:.3f} | {cells[True][1]:.3f} | "
                  f"{cells[False][1]:.3f} | {auto} |", flush=True)


if __name__ == "__main__":
    main()
