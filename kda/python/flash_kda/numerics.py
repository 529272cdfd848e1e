"""The chunked KDA forward with pluggable arithmetic: the CUDA kernel's numerics twin and the CPU path.

Both run the same chunk-16 algorithm as the kernel (SPEC §2, kda/csrc/kda_prepare.cu and
kda_recurrence.cu), step for step and in the same order. What differs is the arithmetic:

* ``KernelArithmetic`` (the twin, CUDA only) re-enacts the kernel exactly: the same approximate instructions
  (``ex2.approx.ftz``, ``tanh.approx`` through the extension's helpers), the same bf16 rounding of every
  tensor-core operand, and every product through the extension's ``mma.sync`` helper with k-steps chained in
  the kernel's order. Elementwise fp32 steps use PyTorch's IEEE-rounded ops, which is why the kernel spells
  each of its steps with explicitly rounded intrinsics (no contraction into FMAs). On the GPU the kernel and
  the twin must agree bit for bit.
* ``Fp32Arithmetic`` (the CPU path) keeps every operand in fp32 and uses exact ``exp2``/``sigmoid`` and
  fp32 matmuls: slower than the kernel, more accurate, and available on any device.

Rows past the end of a sequence are zero (q = k = v = 0, γ = 0, β = 0), which makes them inert, exactly as
in the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

CHUNK = 16
HEAD_DIM = 128
LOG2E = 1.4426950408889634
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """The operations that distinguish the twin from the fp32 CPU path."""

    exp2: Callable[[torch.Tensor], torch.Tensor]
    sigmoid: Callable[[torch.Tensor], torch.Tensor]
    operand: Callable[[torch.Tensor], torch.Tensor]  # rounding of a tensor-core operand
    matmul: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # c + a @ b


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
    product = torch.matmul(a, b)
    return product if c is None else c + product


def fp32_arithmetic() -> Arithmetic:
    return Arithmetic(exp2=torch.exp2, sigmoid=torch.sigmoid, operand=lambda x: x, matmul=_fp32_matmul)


def kernel_arithmetic() -> Arithmetic:
    from flash_kda import _ext

    def mma(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _ext.mma_bf16(a.contiguous(), b.contiguous(), None if c is None else c.contiguous())

    return Arithmetic(
        exp2=_ext.ex2_approx,
        sigmoid=_ext.sigmoid_approx,
        operand=lambda x: x.to(torch.bfloat16),
        matmul=mma,
    )


def _fp32(value: float, device: torch.device) -> torch.Tensor:
    """A Python float rounded to fp32 once, as the kernel receives it."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def _sum_squares_128(x: torch.Tensor) -> torch.Tensor:
    """Σ x² over the last dim (128) in the kernel's order: lane sums of 4, then a halving tree."""
    sq = (x * x).unflatten(-1, (32, 4))
    s = (sq[..., 0] + sq[..., 1]) + (sq[..., 2] + sq[..., 3])
    width = 16
    while width >= 1:
        s = s[..., :width] + s[..., width : 2 * width]
        width //= 2
    return s[..., 0]


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.sqrt(_sum_squares_128(x) + _fp32(NORM_EPS, x.device)))


@dataclasses.dataclass
class ChunkLayout:
    """Where every 16-token chunk of every sequence lives (chunks ordered by sequence, then position)."""

    token_index: torch.Tensor  # int64 [C, 16]: flat token of each chunk row, or total_tokens for padding
    valid: torch.Tensor  # bool [C, 16]
    chunk_offset: list  # first chunk of sequence n
    num_chunks: list  # chunks of sequence n
    num_seqs: int


def chunk_layout(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int, device) -> ChunkLayout:
    total = batch * seqlen
    if cu_seqlens is None:
        bos = torch.arange(batch, dtype=torch.int64) * seqlen
        eos = bos + seqlen
    else:
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        bos, eos = cu[:-1], cu[1:]
    lengths = (eos - bos).clamp(min=0)
    num_chunks = (lengths + CHUNK - 1) // CHUNK
    offsets = torch.cumsum(num_chunks, 0) - num_chunks
    seq_of_chunk = torch.repeat_interleave(torch.arange(len(lengths)), num_chunks)
    position = torch.arange(int(num_chunks.sum())) - offsets[seq_of_chunk]
    start = bos[seq_of_chunk] + CHUNK * position
    token_index = start[:, None] + torch.arange(CHUNK)[None, :]
    valid = token_index < eos[seq_of_chunk][:, None]
    token_index = torch.where(valid, token_index, torch.full_like(token_index, total))
    return ChunkLayout(
        token_index=token_index.to(device),
        valid=valid.to(device),
        chunk_offset=offsets.tolist(),
        num_chunks=num_chunks.tolist(),
        num_seqs=len(lengths),
    )


def _gather_chunks(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[B, T, H, ...] -> [C, H, 16, ...] with zero rows past the end of each sequence."""
    flat = x.reshape(-1, *x.shape[2:])
    padded = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    chunks = padded[layout.token_index]  # [C, 16, H, ...]
    return chunks.transpose(1, 2)


def _prepare(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, layout: ChunkLayout, ar: Arithmetic):
    """Everything that does not touch the state, for all chunks and heads at once (kda_prepare.cu)."""
    device = q.device
    valid = layout.valid[:, None, :]  # [C, 1, 16]
    qf = _gather_chunks(q, layout).float()  # [C, H, 16, K]
    kf = _gather_chunks(k, layout).float()
    gf = _gather_chunks(g, layout).float()
    vc = _gather_chunks(v, layout)  # bf16 [C, H, 16, V]
    bf = _gather_chunks(beta, layout).float()  # [C, H, 16]

    log2e = _fp32(LOG2E, device)
    exp_a = ar.exp2(A_log.float() * log2e)  # [H]
    gate_scale = _fp32(lower_bound, device) * log2e
    x = (gf + dt_bias.float()[None, :, None, :]) * exp_a[None, :, None, None]
    gamma = torch.where(valid[..., None], ar.sigmoid(x) * gate_scale, torch.zeros_like(x))
    beta_act = torch.where(valid, ar.sigmoid(bf), torch.zeros_like(bf))

    cum = torch.empty_like(gamma)
    acc = torch.zeros_like(gamma[..., 0, :])
    for r in range(CHUNK):
        acc = acc + gamma[..., r, :]
        cum[..., r, :] = acc
    total = cum[..., CHUNK - 1, :]  # Γ [C, H, K]

    k_hat = kf * _inv_norm(kf)[..., None]
    q_hat = qf * _inv_norm(qf)[..., None]
    decay_rows = ar.exp2(cum)
    kd = ar.operand(k_hat * decay_rows)
    qd = ar.operand((q_hat * _fp32(scale, device)) * decay_rows)
    ki = ar.operand(k_hat * ar.exp2(-cum))
    kr = ar.operand(k_hat * ar.exp2(total[..., None, :] - cum))
    decay = ar.exp2(total)

    ki_t = ki.transpose(-1, -2)
    a_full = ar.matmul(kd, ki_t, None)  # [C, H, 16, 16]
    m_full = ar.matmul(qd, ki_t, None)

    # INV = (I + β·strict_lower(A))⁻¹ by forward substitution, row by row, columns in parallel.
    lower = a_full * beta_act[..., :, None]
    inv = torch.zeros_like(lower)
    eye = torch.eye(CHUNK, dtype=torch.float32, device=device)
    for i in range(CHUNK):
        acc = torch.zeros_like(lower[..., i, :])
        for m in range(i):
            acc = acc + lower[..., i, m, None] * inv[..., m, :]
        inv[..., i, :] = eye[i] - acc
    causal = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device))
    mqk = torch.where(causal, m_full, torch.zeros_like(m_full))
    return dict(kd=kd, qd=qd, kr=kr, inv=ar.operand(inv), mqk=ar.operand(mqk), decay=decay, beta=beta_act, v=vc)


def chunked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    ar: Arithmetic,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the chunked forward with arithmetic ``ar``; returns (out bf16 [B,T,H,V], final fp32 [N,H,V,K])."""
    batch, seqlen, heads, _ = q.shape
    device = q.device
    layout = chunk_layout(cu_seqlens, batch, seqlen, device)
    n = layout.num_seqs
    if initial_state is not None:
        state = initial_state.float().clone()
    else:
        state = torch.zeros(n, heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    out_flat = torch.zeros(batch * seqlen, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    num_chunks_total = layout.token_index.shape[0]
    if num_chunks_total == 0:
        return out_flat.view(batch, seqlen, heads, HEAD_DIM), state

    prep = _prepare(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, layout, ar)
    out_chunks = torch.empty(num_chunks_total, heads, CHUNK, HEAD_DIM, dtype=torch.bfloat16, device=device)
    offsets = torch.tensor(layout.chunk_offset, dtype=torch.int64, device=device)
    counts = layout.num_chunks
    for step in range(max(counts)):
        active = [s for s in range(n) if counts[s] > step]
        if len(active) == n:
            seqs = slice(None)
            chunk_ids = offsets + step
        else:
            seqs = torch.tensor(active, dtype=torch.int64, device=device)
            chunk_ids = offsets[seqs] + step
        s_a = state[seqs]
        kd, qd, kr = prep["kd"][chunk_ids], prep["qd"][chunk_ids], prep["kr"][chunk_ids]
        inv, mqk = prep["inv"][chunk_ids], prep["mqk"][chunk_ids]
        decay, beta_c, v_c = prep["decay"][chunk_ids], prep["beta"][chunk_ids], prep["v"][chunk_ids]

        s_op = ar.operand(s_a)  # [n, H, V, K]
        p_t = ar.matmul(s_op, kd.transpose(-1, -2), None)  # Pᵀ [n, H, V, 16]
        o_t = ar.matmul(s_op, qd.transpose(-1, -2), None)
        w_t = beta_c[..., None, :] * (v_c.float().transpose(-1, -2) - p_t)
        u_t = ar.operand(ar.matmul(ar.operand(w_t), inv.transpose(-1, -2), None))
        o_t = ar.matmul(u_t, mqk.transpose(-1, -2), o_t)
        out_chunks[chunk_ids] = o_t.transpose(-1, -2).to(torch.bfloat16)
        s_a = ar.matmul(u_t, kr, s_a * decay[..., None, :])
        state[seqs] = s_a

    rows = out_chunks.transpose(1, 2)  # [C, 16, H, V]
    out_flat[layout.token_index[layout.valid]] = rows[layout.valid]
    return out_flat.view(batch, seqlen, heads, HEAD_DIM), state


def twin_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None):
    """The kernel's exact arithmetic (CUDA tensors only): (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K])."""
    if q.device.type != "cuda":
        raise RuntimeError(f"twin_forward re-enacts the CUDA kernel and needs CUDA tensors; got {q.device=}")
    return chunked_forward(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, kernel_arithmetic()
    )


def cpu_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None):
    """The same chunked algorithm in fp32 on any device: (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K])."""
    return chunked_forward(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, fp32_arithmetic()
    )
