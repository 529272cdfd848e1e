"""How accurate a chunk step of 16 tokens would be with its tensor-core operands split into bf16 high and low
parts (a development probe for the decode lever of docs/PERFORMANCE.md at tag measurements-2026-12-07, "Decode
v22.2", not a test). Runs on the CPU: the chunked twin (flash_kda.numerics.chunked_forward) with PyTorch's exact
exp2 and sigmoid and each matmul evaluated in float64 from the operands below, rounded to fp32 once (a tensor core's
fp32 accumulation is close to that), against the float64 reference; B16 H8, bench_fwd's inputs, a bf16 state.

  bf16          every operand rounded to bf16, as the chunked kernels do
  split 3       both operands as hi + lo (hi = bf16(x), lo = bf16(x - hi)), three products: hi·hi + hi·lo + lo·hi
  split left    the left operand (the state, W, U, Kd) as hi + lo, the right one bf16: two products
  split right   the right operand (Kd, Qd, INV, Mqk, Kr) as hi + lo, the left one bf16: two products
  fp32          fp32 operands (the decode kernel's accuracy class)

  PYTHONPATH=kda/bench:kda/python .venv/bin/python tools/dev/split_operand_error.py
"""
import dataclasses

import torch
from absl import flags

import bench_fwd
from flash_kda import compare, numerics, reference

flags.FLAGS(["split_operand_error"])
SCALE, LOWER_BOUND = bench_fwd.HEAD_DIM**-0.5, -5.0
LENGTHS = (1, 2, 4, 8, 15, 16, 32)
SEEDS = range(4)


def _hi_lo(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = x.to(torch.bfloat16).double()
    return hi, (x.double() - hi).to(torch.bfloat16).double()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _product(terms):
    def matmul(a, b, c=None):
        d = sum(torch.matmul(x, y) for x, y in terms(a.float(), b.float()))
        return (d if c is None else d + c.double()).float()
    return matmul


def _split3(a, b):
    (ah, al), (bh, bl) = _hi_lo(a), _hi_lo(b)
    return [(ah, bh), (ah, bl), (al, bh)]


VARIANTS = {
    "bf16": _product(lambda a, b: [(_bf16(a), _bf16(b))]),
    "split 3": _product(_split3),
    "split left": _product(lambda a, b: [(h, _bf16(b)) for h in _hi_lo(a)]),
    "split right": _product(lambda a, b: [(_bf16(a), h) for h in _hi_lo(b)]),
    "fp32": _product(lambda a, b: [(a.double(), b.double())]),
}


def main() -> None:
    base = numerics.fp32_arithmetic()
    arithmetics = {name: dataclasses.replace(base, matmul=mm) for name, mm in VARIANTS.items()}
    print("| T | " + " | ".join(f"{v} out / state" for v in VARIANTS) + " |")
    print("|---:|" + "---:|" * len(VARIANTS))
    for T in LENGTHS:
        worst = {name: [0.0, 0.0] for name in VARIANTS}
        for seed in SEEDS:
            x = bench_fwd.make_inputs(bench_fwd.Case(f"B16 T{T} H8", 16, T, 8), "cpu", seed=seed)
            args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["A_log"], x["dt_bias"], LOWER_BOUND)
            ref_out, ref_state = reference.reference_chunked(*args, initial_state=x["init"])
            for name, ar in arithmetics.items():
                out, state = numerics.chunked_forward(*args, x["init"], None, ar)
                cells = worst[name]
                cells[0] = max(cells[0], compare.compare(out, ref_out).rel_l2)
                cells[1] = max(cells[1], compare.compare(state.to(torch.bfloat16), ref_state).rel_l2)
        print(f"| {T} | " + " | ".join(f"{o:.2e} / {s:.2e}" for o, s in worst.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
