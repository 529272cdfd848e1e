"""FlashKDA demo: one realistic KDA forward on the best backend present, checked against float64.

Backend: the sm_90a CUDA kernel when a compute-capability-9.0 GPU is visible (default T = 8192, H = 96, the
spec's headline case), else the fp32 CPU path (default T = 2048, H = 4: it is slow). Prints the backend, the
shape, time per call, tokens/s (and, on the GPU, achieved bandwidth against the 1282 bytes per token-head the
call must move), and the relative L2 errors of the output and final state against the float64 reference.

    tools/bazel run //kda:demo -- --seqlen=4096 --heads=32 --iters=20
"""

from __future__ import annotations

import time

import torch
from absl import app, flags, logging

import flash_kda
from flash_kda import compare, reference

FLAGS = flags.FLAGS
flags.DEFINE_integer("seqlen", None, "tokens per sequence T (default: 8192 on CUDA, 2048 on CPU)")
flags.DEFINE_integer("heads", None, "heads H (default: 96 on CUDA, 4 on CPU)")
flags.DEFINE_integer("batch", 1, "sequences B")
flags.DEFINE_enum("device", "auto", ["auto", "cuda", "cpu"], "backend: auto picks CUDA when an sm_90 GPU is visible")
flags.DEFINE_integer("iters", None, "timed calls (default: 20 on CUDA, 3 on CPU)")
flags.DEFINE_integer("seed", 0, "input seed")

D = 128
BYTES_PER_TOKEN_HEAD = 1282  # q, k, v, g, out in bf16 + beta: the memory floor of one forward


def pick_device(choice: str) -> torch.device:
    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if choice == "cuda" and not sm90:
        raise app.UsageError("--device=cuda needs a visible compute-capability-9.0 GPU (H100/H200)")
    return torch.device("cuda" if choice == "cuda" or (choice == "auto" and sm90) else "cpu")


def make_inputs(B: int, T: int, H: int, device: torch.device, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        scale=D**-0.5, out=torch.empty(B, T, H, D, dtype=torch.bfloat16, device=device),
        A_log=randn(H, dtype=torch.float32), dt_bias=randn(H, D, dtype=torch.float32), lower_bound=-5.0,
        initial_state=randn(B, H, D, D, dtype=torch.float32),
        final_state=torch.empty(B, H, D, D, dtype=torch.float32, device=device),
    )  # fmt: skip


def time_calls(x: dict, device: torch.device, iters: int) -> float:
    """Seconds per call (after one warm-up call)."""
    flash_kda.fwd(**x)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            flash_kda.fwd(**x)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        flash_kda.fwd(**x)
    return (time.perf_counter() - t0) / iters


def main(argv: list[str]) -> None:
    del argv
    device = pick_device(FLAGS.device)
    cuda = device.type == "cuda"
    B = FLAGS.batch
    T = FLAGS.seqlen if FLAGS.seqlen is not None else (8192 if cuda else 2048)
    H = FLAGS.heads if FLAGS.heads is not None else (96 if cuda else 4)
    iters = FLAGS.iters if FLAGS.iters is not None else (20 if cuda else 3)
    if cuda:
        backend = f"CUDA kernel (sm_90a) on {torch.cuda.get_device_name(device)}"
    else:
        backend = "CPU path (fp32 chunked PyTorch; no sm_90 GPU visible)" if FLAGS.device == "auto" else "CPU path"
    logging.info("backend: %s", backend)
    logging.info("shape: B=%d T=%d H=%d K=V=%d, fp32 state in+out, lower_bound=-5", B, T, H, D)

    x = make_inputs(B, T, H, device, FLAGS.seed)
    initial = x["initial_state"].clone()
    seconds = time_calls(x, device, iters)
    tokens = B * T
    logging.info("time per call: %.3f ms over %d calls; %.3g tokens/s", seconds * 1e3, iters, tokens / seconds)
    if cuda:
        gbps = tokens * H * BYTES_PER_TOKEN_HEAD / seconds / 1e9
        logging.info("achieved %.0f GB/s of the %d bytes per token-head the call must move", gbps, BYTES_PER_TOKEN_HEAD)

    t0 = time.perf_counter()
    ref_out, ref_state = reference.reference_chunked(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["A_log"], x["dt_bias"], x["lower_bound"],
        initial_state=initial,
    )
    logging.info("float64 reference (chunked, on %s): %.1f s", device.type, time.perf_counter() - t0)
    out = compare.compare(x["out"], ref_out, window=256)
    state = compare.compare(x["final_state"], ref_state)
    floor = compare.compare(ref_out.to(torch.bfloat16), ref_out).rel_l2
    logging.info("out vs float64: rel L2 %.3e (bf16 rounding alone: %.3e), worst 256-token window %.3e, max abs %.3e",
                 out.rel_l2, floor, out.window_rel_l2, out.max_abs)  # fmt: skip
    logging.info("final_state vs float64: rel L2 %.3e, max abs %.3e", state.rel_l2, state.max_abs)
    if not (out.finite_ok and state.finite_ok):
        raise SystemExit(f"non-finite results:\nout: {out}\nfinal_state: {state}")

    print(f"backend      {backend}")
    print(f"shape        B={B} T={T} H={H} K=V={D}")
    print(f"time         {seconds * 1e3:.3f} ms/call ({iters} calls), {tokens / seconds:.3g} tokens/s")
    print(f"out          rel L2 {out.rel_l2:.3e} vs float64 (bf16 floor {floor:.3e}), worst window {out.window_rel_l2:.3e}")
    print(f"final_state  rel L2 {state.rel_l2:.3e} vs float64")


if __name__ == "__main__":
    app.run(main)
