"""The chunked KDA forward with pluggable arithmetic: the CUDA kernel's numerics twin and the CPU path.

Both run the same chunk-16 algorithm as the kernel (docs/SPEC.md §2, kda/csrc/prepare_chunk.cuh and
recurrence_step.cuh), step for step and in the same order. What differs is the arithmetic:

* ``kernel_arithmetic()`` (the twin, CUDA only) re-enacts the kernel exactly: the same approximate instructions
  (``ex2.approx.ftz``, ``tanh.approx`` through the extension's helpers), the same bf16 rounding of every
  tensor-core operand, and every product through the extension's ``mma.sync`` helper with k-steps chained in
  the kernel's order. Elementwise fp32 steps use PyTorch's IEEE-rounded ops, which is why the kernel spells
  each of its steps with explicitly rounded intrinsics (no contraction into FMAs); the decode kernel's FMAs
  (``__fmaf_rn``) come from the extension's helpers (``lane_leaves``, ``row_fma``), which ``fma_rn`` defines. On
  the GPU the kernel and the twin must agree bit for bit.
* ``fp32_arithmetic()`` (the CPU path) keeps every operand in fp32 and uses exact ``exp2``/``sigmoid`` and
  fp32 matmuls: slower than the kernel, more accurate, and available on any device.

Rows past the end of a sequence are zero (q = k = v = 0, γ = 0, β = 0), which makes them inert, exactly as
in the kernel.

Checkpoints (``checkpoint_indices``, ``checkpoint_every`` = C): the state of sequence n after its first (m+1)·C
tokens is the state the plan's own recurrence holds there: after the step that ends chunk (m+1)·C/16 in the
chunked stepping (under the time split, the stepping of the unit that finishes that segment), after token
(m+1)·C − 1 in the decode kernel's recurrence, after the chunk that ends there in the decode plan's chunk step.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from typing import Callable, Optional

import torch

from flash_kda import planning, pools

CHUNK = 16
HEAD_DIM = 128
LOG2E = 1.4426950408889634
NORM_EPS = 1e-6
_UNSAID = object()  # twin_forward's final_dtype where the caller gave none


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """The operations that distinguish the twin from the fp32 CPU path."""

    exp2: Callable[[torch.Tensor], torch.Tensor]
    softplus2: Callable[[torch.Tensor], torch.Tensor]  # log2(1 + e^x), the softplus gate's core (gate.cuh)
    sigmoid: Callable[[torch.Tensor], torch.Tensor]
    operand: Callable[[torch.Tensor], torch.Tensor]  # rounding of a tensor-core operand
    matmul: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # c + a @ b
    # Whether the state update also adds the low half of Uᵀ's rounding (the kernel's slow-decay rule); with
    # fp32 operands there is no rounding to add.
    hi_lo_update: Callable[[float], bool] = lambda lower_bound: False
    # The decode recurrence's fused steps (``lane_leaves``, ``row_fma``): the kernel's single-rounded FMAs through
    # the extension or, on the CPU path, the same order with two roundings per FMA (as accurate).
    lane_leaves: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda a, b: _fp32_lane_leaves(a, b)
    row_fma: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
        lambda u, k, s: s + u[..., None] * k[..., None, :])


def _fp32_lane_leaves(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``lane_leaves`` with each FMA as a product and a sum: a [..., R, 128], b [..., 128] -> [..., R, 32]."""
    p = (a * b[..., None, :]).unflatten(-1, (32, 4))
    return p[..., 3] + (p[..., 2] + (p[..., 1] + p[..., 0]))


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
    product = torch.matmul(a, b)
    return product if c is None else c + product


def _softplus2(x: torch.Tensor) -> torch.Tensor:
    """log2(1 + e^x) = max(x, 0)·log2 e + log1p(e^−|x|)·log2 e in fp32 (gate.cuh's formula, PyTorch's functions)."""
    log2e = _fp32(LOG2E, x.device)
    return torch.clamp(x, min=0) * log2e + torch.log1p(torch.exp(-x.abs())) * log2e


def fp32_arithmetic() -> Arithmetic:
    return Arithmetic(exp2=torch.exp2, softplus2=_softplus2, sigmoid=torch.sigmoid, operand=lambda x: x,
                      matmul=_fp32_matmul)


def kernel_arithmetic() -> Arithmetic:
    from flash_kda import _ext

    def mma(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _ext.mma_bf16(a.contiguous(), b.contiguous(), None if c is None else c.contiguous())

    return Arithmetic(
        exp2=_ext.ex2_approx,
        softplus2=_ext.softplus_log2,
        sigmoid=_ext.sigmoid_approx,
        operand=lambda x: x.to(torch.bfloat16),
        matmul=mma,
        hi_lo_update=lambda lower_bound: bool(_ext.load().hi_lo_state_update(float(lower_bound))),
        lane_leaves=_ext.lane_leaves,
        row_fma=_ext.row_fma,
    )


def fma_rn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a·b + c rounded once to nearest even (IEEE fusedMultiplyAdd, CUDA's ``__fmaf_rn``), on any device: the
    definition the extension's ``lane_leaves`` and ``row_fma`` are checked against (tests/test_helpers.py).

    In float64 the product is exact (24 + 24 significant bits) and the sum is rounded once; TwoSum gives that
    rounding's error e exactly. Rounding the float64 sum s to fp32 then rounds the exact a·b + c = s + e correctly
    except where s lies exactly halfway between two fp32 numbers and e ≠ 0 (double rounding): there the exact
    sum is on e's side of the halfway point, so the result is the neighbour on that side."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    t = s - p
    e = (p - (s - t)) + (cd - t)
    r = s.float()
    beyond = torch.where(s > r.double(), torch.inf, -torch.inf).to(torch.float32)  # from r toward s
    other = torch.nextafter(r, beyond)
    halfway = ((r.double() + other.double()) * 0.5 == s) & (e != 0) & torch.isfinite(s)
    return torch.where(halfway, torch.where(e > 0, torch.maximum(r, other), torch.minimum(r, other)), r)


def lane_leaves_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The decode kernel's lane leaves a₃·b₃ + (a₂·b₂ + (a₁·b₁ + a₀·b₀)), each FMA by ``fma_rn``:
    a [..., R, 128], b [..., 128] -> [..., R, 32] (``lane_leaves``'s definition)."""
    a = a.unflatten(-1, (32, 4))
    b = b[..., None, :].unflatten(-1, (32, 4)).expand_as(a)
    leaf = a[..., 0] * b[..., 0]
    for c in range(1, 4):
        leaf = fma_rn(a[..., c], b[..., c], leaf)
    return leaf


def halving_tree_32(leaves: torch.Tensor) -> torch.Tensor:
    """Σ of 32 lane leaves (last dim) by the halving tree s[:16]+s[16:32], s[:8]+s[8:16], ... (the xor butterfly
    over lanes 16, 8, 4, 2, 1 with one leaf per lane; the decode kernel, whose lanes hold 8 leaves of a row, adds
    the same pairs, the first three levels inside a lane)."""
    width = 16
    while width >= 1:
        leaves = leaves[..., :width] + leaves[..., width : 2 * width]
        width //= 2
    return leaves[..., 0]


def _fp32(value: float, device: torch.device) -> torch.Tensor:
    """A Python float rounded to fp32 once, as the kernel receives it."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def tree_sum_128(p: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim (128) in the kernels' order: lane l's leaf ((p0+p1)+(p2+p3)) of p[4l..4l+3], then the
    halving tree s[:16]+s[16:32], s[:8]+s[8:16], ... (what an xor butterfly over lanes 16, 8, 4, 2, 1 computes:
    fp addition is commutative)."""
    p = p.unflatten(-1, (32, 4))
    return halving_tree_32((p[..., 0] + p[..., 1]) + (p[..., 2] + p[..., 3]))


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.sqrt(tree_sum_128(x * x) + _fp32(NORM_EPS, x.device)))


GATE_KINDS = ("lower_bound", "softplus")
MIN_LOG2_DECAY = -128.0  # the softplus gate's floor on a token's γ (gate.cuh, kMinLog2Decay)
MIN_EXP_A, MAX_EXP_A = 2.0**-126, 3.4028234663852886e38  # e^A_log held in fp32's normal range (gate.cuh, kMinExpA)


def _gate_log2(g: torch.Tensor, A_log, dt_bias, lower_bound, ar: Arithmetic, kind: str = "lower_bound"):
    """The base-2 log decay per channel as gate.cuh computes it; g is [..., H, K] (fp32). A_log None: e^A_log = 1;
    dt_bias None: 0. e^A_log is clamped to [2^-126, the largest finite float], as gate.cuh holds it.
    lower_bound: γ = sigmoid((g + dt_bias) · 2^(A_log·log2 e)) · (lower_bound · log2 e);
    softplus: γ = max(−(2^(A_log·log2 e) · softplus2(g + dt_bias)), −128), unbounded below but for that floor."""
    H = g.shape[-2]
    log2e = _fp32(LOG2E, g.device)
    if A_log is None:
        exp_a = torch.ones(H, dtype=torch.float32, device=g.device)
    else:
        # within fp32's normal range, as gate.cuh holds it (no ∞·0 or 0·∞ below; a NaN stays NaN)
        exp_a = ar.exp2(A_log.float() * log2e).clamp(MIN_EXP_A, MAX_EXP_A)  # [H]
    x = g if dt_bias is None else g + dt_bias.float().reshape(-1, HEAD_DIM)
    if kind == "softplus":
        gamma = -(exp_a[:, None] * ar.softplus2(x))
        return torch.where(gamma < MIN_LOG2_DECAY, torch.full_like(gamma, MIN_LOG2_DECAY), gamma)
    if kind != "lower_bound":
        raise ValueError(f"gate_kind must be one of {GATE_KINDS}, got {kind=}")
    gate_scale = _fp32(lower_bound, g.device) * log2e
    return ar.sigmoid(x * exp_a[:, None]) * gate_scale


def _beta(logit: torch.Tensor, ar: Arithmetic, beta_scale: float) -> torch.Tensor:
    """β = beta_scale · sigmoid(logit) (gate.cuh, beta_of; the product by 1 or 2 is exact)."""
    return ar.sigmoid(logit) * _fp32(beta_scale, logit.device)


def _hi_lo_bound(lower_bound, gate_kind: str) -> float:
    """The lower_bound the slow-decay rule (kda_plan.h, hi_lo_state_update) sees: 0 for the softplus gate, which
    may decay as slowly as it likes (fwd passes the kernel lower_bound 0 then)."""
    return 0.0 if gate_kind == "softplus" else lower_bound


def _key_heads_expanded(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped value heads: q and k [.., H, K] repeated to the `heads` = G·H value heads (value head hv reads key
    head hv // G, as the kernels do)."""
    group = heads // q.shape[-2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)


ANCHOR_BLOCK = 4  # rows per block of the softplus gate's intra-chunk products


def _diag_block_sums(k_hat: torch.Tensor, q_scaled: torch.Tensor, cum: torch.Tensor, ar: Arithmetic, b: int):
    """Block b's pair sums (rows 4b .. 4b + 3): A [.., 4, 4] (i > j) and Mqk (i ≥ j), each
    tree_sum_128((a_i · k̂_j) · 2^(cum_i − cum_j)), a = k̂ or q̃; zero elsewhere."""
    rb = slice(b * ANCHOR_BLOCK, (b + 1) * ANCHOR_BLOCK)
    cb, kb, qb = cum[..., rb, :], k_hat[..., rb, :], q_scaled[..., rb, :]
    lower = torch.tril(torch.ones(ANCHOR_BLOCK, ANCHOR_BLOCK, dtype=torch.bool, device=cum.device))
    diff = cb[..., :, None, :] - cb[..., None, :, :]  # [.., i, j, K]
    coeff = ar.exp2(torch.where(lower[:, :, None], diff, torch.zeros_like(diff)))
    kj = kb[..., None, :, :]
    a = tree_sum_128((kb[..., :, None, :] * kj) * coeff)
    m = tree_sum_128((qb[..., :, None, :] * kj) * coeff)
    strict = torch.tril(lower, diagonal=-1)
    return torch.where(strict, a, torch.zeros_like(a)), torch.where(lower, m, torch.zeros_like(m))


def _anchored_products(k_hat: torch.Tensor, q_scaled: torch.Tensor, cum: torch.Tensor, ar: Arithmetic):
    """A = Σ_c k̂_i k̂_j 2^(cum_i − cum_j) (i > j) and Mqk = Σ_c q̃_i k̂_j 2^(cum_i − cum_j) (i ≥ j) [.., 16, 16], as
    prepare_chunk.cuh forms them for the softplus gate, without the factor 2^(−cum) that overflows once a chunk's
    decay passes 2^−128.

    Pairs inside a block of 4 rows: direct coefficients, fp32 sums (_diag_block_sums). Pairs across blocks: the
    coefficient split at an anchor row e, 2^(cum_i − cum_e)·2^(cum_e − cum_j), both exponents ≤ 0, as one
    tensor-core product of the A-operand tiles Lk, Lq (row x: row x + 4 for x < 12, anchored at row 3 for x < 4 and
    at row 7 else; row x for x ≥ 12, anchored at row 11) with the B-operand tile R (row y: row y anchored at 7 for
    y < 8 and at 11 for y < 12; row y − 12 anchored at 3 for y ≥ 12)."""
    device = cum.device
    src_l = torch.tensor(list(range(4, 16)) + list(range(12, 16)), device=device)
    anchor_l = torch.tensor([3] * 4 + [7] * 8 + [11] * 4, device=device)
    src_r = torch.tensor(list(range(0, 12)) + list(range(0, 4)), device=device)
    anchor_r = torch.tensor([7] * 8 + [11] * 4 + [3] * 4, device=device)
    to_l = ar.exp2(cum[..., src_l, :] - cum[..., anchor_l, :])
    lk = ar.operand(k_hat[..., src_l, :] * to_l)
    lq = ar.operand(q_scaled[..., src_l, :] * to_l)
    r_t = ar.operand(k_hat[..., src_r, :] * ar.exp2(cum[..., anchor_r, :] - cum[..., src_r, :])).transpose(-1, -2)
    pa, pm = ar.matmul(lk, r_t, None), ar.matmul(lq, r_t, None)  # [.., x, y]

    a_full = torch.zeros((*cum.shape[:-2], CHUNK, CHUNK), dtype=torch.float32, device=device)
    m_full = torch.zeros_like(a_full)
    for full, prod in ((a_full, pa), (m_full, pm)):
        full[..., 8:16, 0:8] = prod[..., 4:12, 0:8]  # anchor 7
        full[..., 4:8, 0:4] = prod[..., 0:4, 12:16]  # anchor 3
        full[..., 12:16, 8:12] = prod[..., 12:16, 8:12]  # anchor 11
    for b in range(CHUNK // ANCHOR_BLOCK):
        rb = slice(b * ANCHOR_BLOCK, (b + 1) * ANCHOR_BLOCK)
        a_full[..., rb, rb], m_full[..., rb, rb] = _diag_block_sums(k_hat, q_scaled, cum, ar, b)
    return a_full, m_full


def sequence_bounds(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int) -> tuple:
    """(bos, eos, lengths) of the sequences, int64 CPU tensors: rows of ``seqlen`` tokens, or ``cu_seqlens``."""
    if cu_seqlens is None:
        bos = torch.arange(batch, dtype=torch.int64) * seqlen
        eos = bos + seqlen
    else:
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        bos, eos = cu[:-1], cu[1:]
    return bos, eos, (eos - bos).clamp(min=0)


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
    bos, eos, lengths = sequence_bounds(cu_seqlens, batch, seqlen)
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


def _running_decay(g_chunks: torch.Tensor, valid: torch.Tensor, A_log, dt_bias, lower_bound, ar: Arithmetic,
                   gate_kind: str) -> torch.Tensor:
    """G [C, H, 16, K]: the gates' log₂ decays of fp32 chunk rows g_chunks [C, H, 16, K] summed row by row in
    order (prepare_chunk.cuh's phase 1); rows where ``valid`` [C, 1, 16] is False add 0."""
    gate = _gate_log2(g_chunks.transpose(-2, -3), A_log, dt_bias, lower_bound, ar, gate_kind).transpose(-2, -3)
    gamma = torch.where(valid[..., None], gate, torch.zeros_like(gate))
    cum = torch.empty_like(gamma)
    acc = torch.zeros_like(gamma[..., 0, :])
    for r in range(CHUNK):
        acc = acc + gamma[..., r, :]
        cum[..., r, :] = acc
    return cum


def _prepare(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, layout: ChunkLayout, ar: Arithmetic,
             gate_kind: str = "lower_bound", beta_scale: float = 1.0):
    """Everything that does not touch the state, for all chunks and heads at once (prepare_chunk.cuh)."""
    device = q.device
    valid = layout.valid[:, None, :]  # [C, 1, 16]
    qf = _gather_chunks(q, layout).float()  # [C, H, 16, K]
    kf = _gather_chunks(k, layout).float()
    gf = _gather_chunks(g, layout).float()
    vc = _gather_chunks(v, layout)  # bf16 [C, H, 16, V]
    bf = _gather_chunks(beta, layout).float()  # [C, H, 16]

    cum = _running_decay(gf, valid, A_log, dt_bias, lower_bound, ar, gate_kind)
    beta_act = torch.where(valid, _beta(bf, ar, beta_scale), torch.zeros_like(bf))
    total = cum[..., CHUNK - 1, :]  # Γ [C, H, K]

    k_hat = kf * _inv_norm(kf)[..., None]
    q_scaled = (qf * _inv_norm(qf)[..., None]) * _fp32(scale, device)
    decay_rows = ar.exp2(cum)
    kd = ar.operand(k_hat * decay_rows)
    qd = ar.operand(q_scaled * decay_rows)
    kr = ar.operand(k_hat * ar.exp2(total[..., None, :] - cum))
    decay = ar.exp2(total)

    if gate_kind == "softplus":  # a chunk's decay is unbounded: no factor 2^(−cum)
        a_full, m_full = _anchored_products(k_hat, q_scaled, cum, ar)
    else:  # cum ≥ 16 · lower_bound · log2 e ≥ −116: 2^(−cum) stays finite
        ki_t = ar.operand(k_hat * ar.exp2(-cum)).transpose(-1, -2)
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
    return dict(kd=kd, qd=qd, kr=kr, inv=ar.operand(inv), mqk=ar.operand(mqk), decay=decay, beta=beta_act, v=vc,
                hi_lo=ar.hi_lo_update(_hi_lo_bound(lower_bound, gate_kind)))


def _run_units(prep: dict, states: torch.Tensor, first_chunk: list, counts: list, ar: Arithmetic,
               out_chunks: Optional[torch.Tensor] = None, capture: Optional[dict] = None) -> torch.Tensor:
    """Runs every unit u from ``states[u]`` over chunks first_chunk[u] .. first_chunk[u] + counts[u] - 1, all
    units in lockstep (recurrence_step.cuh's step); returns the end states [U, H, R, K].

    A unit is a whole sequence, or one segment of the time split. ``states`` rows are independent: R = 128 state
    rows, or 256 when the time split's transition rows (which see v = 0) sit above the state rows.
    ``out_chunks`` receives the outputs when given (R must be 128 then). ``capture`` (checkpoints): a dict whose
    keys are chunk ids; for each one a unit here steps through, it receives the unit's state after that chunk
    [H, R, K]."""
    states = states.clone()
    device = states.device
    offsets = torch.tensor(first_chunk, dtype=torch.int64, device=device)
    n = len(counts)
    captured_at = _capture_steps(capture, first_chunk, counts) if capture else None
    for step in range(max(counts, default=0)):
        active = [u for u in range(n) if counts[u] > step]
        if len(active) == n:
            units = slice(None)
            chunk_ids = offsets + step
        else:
            units = torch.tensor(active, dtype=torch.int64, device=device)
            chunk_ids = offsets[units] + step
        s_a = states[units]
        kd, kr, inv = prep["kd"][chunk_ids], prep["kr"][chunk_ids], prep["inv"][chunk_ids]
        decay, beta_c = prep["decay"][chunk_ids], prep["beta"][chunk_ids]
        v_t = prep["v"][chunk_ids].float().transpose(-1, -2)  # [U, H, V, 16]
        if s_a.shape[-2] != v_t.shape[-2]:  # transition rows (v = 0) above the state rows
            rows = s_a.shape[-2] - v_t.shape[-2]
            v_t = torch.cat([v_t.new_zeros(*v_t.shape[:-2], rows, v_t.shape[-1]), v_t], dim=-2)

        s_op = ar.operand(s_a)  # [U, H, R, K]
        p_t = ar.matmul(s_op, kd.transpose(-1, -2), None)  # Pᵀ [U, H, R, 16]
        w_t = beta_c[..., None, :] * (v_t - p_t)
        u_full = ar.matmul(ar.operand(w_t), inv.transpose(-1, -2), None)
        u_t = ar.operand(u_full)
        if out_chunks is not None:
            qd, mqk = prep["qd"][chunk_ids], prep["mqk"][chunk_ids]
            o_t = ar.matmul(s_op, qd.transpose(-1, -2), None)
            o_t = ar.matmul(u_t, mqk.transpose(-1, -2), o_t)
            out_chunks[chunk_ids] = o_t.transpose(-1, -2).to(torch.bfloat16)
        s_new = ar.matmul(u_t, kr, s_a * decay[..., None, :])
        if prep["hi_lo"]:  # slow decay: + bf16(Uᵀ − U_hi)·Kr, after (kda_plan.h, hi_lo_state_update)
            s_new = ar.matmul(ar.operand(u_full - u_t.float()), kr, s_new)
        states[units] = s_new
        if captured_at:
            for u, chunk in captured_at.get(step, ()):
                capture[chunk] = states[u].clone()
    return states


def _capture_steps(capture: dict, first_chunk: list, counts: list) -> dict:
    """step -> [(unit, chunk id)]: where the units (disjoint runs of chunks) pass the chunks ``capture`` names."""
    order = sorted(range(len(counts)), key=lambda u: (first_chunk[u], counts[u]))  # (an empty unit before a tie)
    starts = [first_chunk[u] for u in order]
    steps: dict = {}
    for chunk in capture:
        i = bisect.bisect_right(starts, chunk) - 1
        if i >= 0:
            u = order[i]
            step = chunk - first_chunk[u]
            if step < counts[u]:
                steps.setdefault(step, []).append((u, chunk))
    return steps


def _hi_lo(x: torch.Tensor, ar: Arithmetic) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo as two tensor-core operands: hi = operand(x), lo = operand(x - hi) (the difference is exact)."""
    hi = ar.operand(x)
    return hi, ar.operand(x - hi.float())


def _compose(state: torch.Tensor, m: torch.Tensor, q: torch.Tensor, ar: Arithmetic) -> torch.Tensor:
    """S · M + Q in segment_compose.cu's order: Q + S_hi·M_hi, then + S_hi·M_lo, then + S_lo·M_hi."""
    s_hi, s_lo = _hi_lo(state, ar)
    m_hi, m_lo = _hi_lo(m, ar)
    d = ar.matmul(s_hi, m_hi, q)
    d = ar.matmul(s_hi, m_lo, d)
    return ar.matmul(s_lo, m_hi, d)


def chunked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
                    initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], ar: Arithmetic,
                    segment_chunks: int = 0, gate_kind: str = "lower_bound",
                    beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the chunked forward with arithmetic ``ar``; returns (out bf16 [B,T,H,V], final fp32 [N,H,V,K]).

    ``gate_kind``: "lower_bound" or "softplus" (``lower_bound`` unused, may be None); ``beta_scale``: β's factor (2:
    negative eigenvalues); q, k may have fewer heads than v (grouped value heads); A_log / dt_bias may be None.

    ``segment_chunks`` = L > 0 re-enacts the CUDA path's time split (docs/DESIGN.md, "The time split"): every
    sequence is cut into segments of L chunks; each segment but the last gets its affine map S_end = S_start·M + Q
    (M from the identity with v = 0, Q from zero), the maps are composed in order into every segment's start
    state, and every segment then runs from that state. Without it each sequence runs in one piece."""
    return _chunked(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, ar,
                    segment_chunks, gate_kind, beta_scale)


def _chunked(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, ar: Arithmetic,
             segment_chunks: int = 0, gate_kind: str = "lower_bound", beta_scale: float = 1.0,
             checkpoints: Optional[list] = None) -> tuple:
    """``chunked_forward``; with ``checkpoints`` [(n, t), ...] (t a positive multiple of 16, at most sequence n's
    length) a third result: the state of sequence n after its first t tokens for each, fp32 [E, H, V, K], the state
    held after the step that ends its chunk t/16 (under the time split: in the unit that finishes the segment)."""
    batch, seqlen, heads, _ = v.shape
    q, k = _key_heads_expanded(q, k, heads)
    device = q.device
    layout = chunk_layout(cu_seqlens, batch, seqlen, device)
    n = layout.num_seqs
    if initial_state is not None:
        start = initial_state.float().clone()
    else:
        start = torch.zeros(n, heads, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    out_flat = torch.zeros(batch * seqlen, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    num_chunks_total = layout.token_index.shape[0]
    # checkpoint (n, t) is the state after chunk t/16 of sequence n: its chunk id
    chunk_ids = None if checkpoints is None else [layout.chunk_offset[n] + t // CHUNK - 1 for n, t in checkpoints]
    capture = None if checkpoints is None else dict.fromkeys(chunk_ids)
    if num_chunks_total == 0:  # (no tokens: no checkpoint either)
        result = out_flat.view(batch, seqlen, heads, HEAD_DIM), start
        return result if checkpoints is None else (*result, start.new_zeros(0, *start.shape[1:]))

    prep = _prepare(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, layout, ar, gate_kind, beta_scale)
    out_chunks = torch.empty(num_chunks_total, heads, CHUNK, HEAD_DIM, dtype=torch.bfloat16, device=device)
    offsets, counts = layout.chunk_offset, layout.num_chunks
    if segment_chunks <= 0:
        state = _run_units(prep, start, offsets, counts, ar, out_chunks, capture)
    else:
        state = _split_forward(prep, start, offsets, counts, segment_chunks, ar, out_chunks, capture)

    rows = out_chunks.transpose(1, 2)  # [C, 16, H, V]
    out_flat[layout.token_index[layout.valid]] = rows[layout.valid]
    out = out_flat.view(batch, seqlen, heads, HEAD_DIM)
    if checkpoints is None:
        return out, state
    recorded = (torch.stack([capture[c] for c in chunk_ids]) if chunk_ids
                else state.new_zeros(0, *state.shape[1:]))
    return out, state, recorded


_BATCH_STATE_BYTES = 256 << 20  # fp32 state rows the twin's time split keeps in one batch of units


def _run_batched(prep: dict, starts: list, first_chunk: list, counts: list, ar: Arithmetic,
                 out_chunks: Optional[torch.Tensor] = None, capture: Optional[dict] = None) -> list:
    """``_run_units`` over any number of units, in batches that bound the memory (units are independent)."""
    if not starts:
        return []
    per_unit = starts[0].numel() * 4
    size = max(1, _BATCH_STATE_BYTES // per_unit)
    ends = []
    for b in range(0, len(starts), size):
        batch = torch.stack(starts[b : b + size])
        ends += list(_run_units(prep, batch, first_chunk[b : b + size], counts[b : b + size], ar, out_chunks,
                                capture))
    return ends


def _split_forward(prep: dict, start: torch.Tensor, offsets: list, counts: list, L: int, ar: Arithmetic,
                   out_chunks: torch.Tensor, capture: Optional[dict] = None) -> torch.Tensor:
    """The time split of ``chunked_forward``: scan, compose, finish; returns the final states [N, H, V, K].

    Segment indices are taken in blocks (as many as fit the memory budget across all sequences): the block's
    scanned segments run from the identity (transition rows, v = 0) and from zero (state rows) in one batch, the
    chains are composed through the block in order, and the block's segments finish from their start states.
    Checkpoints (``capture``) come from the finishing units, as in the kernels' finish pass: a segment's last chunk
    gives that unit's end state, not the composed start of the next segment."""
    device = start.device
    num_seqs, heads = start.shape[0], start.shape[1]
    segments = [max(1, -(-c // L)) for c in counts]
    eye = torch.eye(HEAD_DIM, dtype=torch.float32, device=device)
    scan_start = torch.cat([eye.expand(heads, -1, -1), torch.zeros_like(eye).expand(heads, -1, -1)], dim=-2)
    per_index = max(1, _BATCH_STATE_BYTES // (scan_start.numel() * 4 * num_seqs))  # segment indices per block
    seg_start = {s: start[s] for s in range(num_seqs)}  # start state of each sequence's current segment
    final = [None] * num_seqs
    for j0 in range(0, max(segments), per_index):
        block = range(j0, min(max(segments), j0 + per_index))
        scanned = [(s, j) for j in block for s in range(num_seqs) if j < segments[s] - 1]
        ends = _run_batched(prep, [scan_start] * len(scanned), [offsets[s] + j * L for s, j in scanned],
                            [L] * len(scanned), ar)
        maps = {key: end for key, end in zip(scanned, ends)}
        starts_in_block = {}
        for j in block:
            seqs = [s for s in range(num_seqs) if j < segments[s]]
            for s in seqs:
                starts_in_block[(s, j)] = seg_start[s]
            chained = [s for s in seqs if j < segments[s] - 1]
            if chained:
                # S_{j+1} = S_j·M_j + Q_j, every sequence's chain in lockstep
                state = torch.stack([seg_start[s] for s in chained])
                m = torch.stack([maps[(s, j)][:, :HEAD_DIM] for s in chained])
                q = torch.stack([maps[(s, j)][:, HEAD_DIM:] for s in chained])
                for s, nxt in zip(chained, _compose(state, m, q, ar)):
                    seg_start[s] = nxt
        units = [(s, j) for j in block for s in range(num_seqs) if j < segments[s]]
        ends = _run_batched(prep, [starts_in_block[u] for u in units], [offsets[s] + j * L for s, j in units],
                            [max(0, min(L, counts[s] - j * L)) for s, j in units], ar, out_chunks, capture)
        for (s, j), end in zip(units, ends):
            if j == segments[s] - 1:
                final[s] = end
    return torch.stack(final)


def _forward_on(initial_state, final_state, state_indices, forward, tokens=None, num_accepted_tokens=None,
                lengths=None, checkpoint_slots=None):
    """``forward(initial [N, H, V, K] or None)`` on dense states, or on pools with ``state_indices``
    (``pools.run_pooled``: the final pool is ``final_state`` as it was, or ``initial_state``, with the named slots
    replaced, and with ``checkpoint_slots`` the checkpoints ``forward`` records written first); with per-token
    ``state_indices`` [N, L], ``tokens(initial)`` gives the states after each of the first L tokens
    (``pools.run_pooled_tokens``, sequence lengths ``lengths``)."""
    if state_indices is None:
        return forward(initial_state)
    if state_indices.dim() == 2:
        return pools.run_pooled_tokens(lambda initial: (forward(initial)[0], tokens(initial)), initial_state,
                                       final_state, state_indices, num_accepted_tokens, lengths)
    return pools.run_pooled(forward, initial_state, final_state, state_indices, checkpoint_slots)


def _checkpoint_entries(v, cu_seqlens, state_indices, initial_state, final_state, checkpoint_indices,
                        checkpoint_every) -> tuple:
    """(entries, slots) of the checkpoints a call writes (``pools.checkpoint_entries``), or (None, None) without
    ``checkpoint_indices``."""
    if checkpoint_indices is None:
        return None, None
    if state_indices is None or state_indices.dim() != 1:
        raise ValueError(f"checkpoint_indices needs state_indices [N] (the pool it writes into), got "
                         f"{None if state_indices is None else tuple(state_indices.shape)}")
    B, T = v.shape[:2]
    pool = final_state if final_state is not None else initial_state
    return pools.checkpoint_entries(checkpoint_indices, checkpoint_every, sequence_bounds(cu_seqlens, B, T)[2],
                                    pool.shape[0])


def _prepare_tokens(q, k, g, beta, scale, A_log, dt_bias, lower_bound, ar: Arithmetic, gate_kind: str = "lower_bound",
                    beta_scale: float = 1.0):
    """The decode kernel's per-token values, every token at once (no token depends on another): k̂, q̃ = (q̂·scale)
    and α = 2^γ [.., H, K], β [.., H]."""
    kf, qf = k.float(), q.float()
    k_hat = kf * _inv_norm(kf)[..., None]
    q_t = (qf * _inv_norm(qf)[..., None]) * _fp32(scale, q.device)
    alpha = ar.exp2(_gate_log2(g.float(), A_log, dt_bias, lower_bound, ar, gate_kind))
    return k_hat, q_t, alpha, _beta(beta.float(), ar, beta_scale)


def recurrent_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None,
                      ar: Optional[Arithmetic] = None, *, gate_kind: str = "lower_bound",
                      beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's token-by-token recurrence in fp32 (kda/csrc/decode.cu; docs/NUMERICS.md, "The decode
    kernel"): (out bf16 [B,T,H,V], final fp32 [N,H,V,K]). Per token and state row v: S[v,:] ⊙= α;
    r = v_t[v] − tree(S[v,:]·k̂); u = β·r; S[v,:] = fma(u, k̂, S[v,:]); o[v] = tree(S[v,:]·q̃); out = bf16(o), each
    tree the lane leaves (``lane_leaves_rn``) and ``halving_tree_32``. ``ar``: the kernel's approximate exp2 /
    sigmoid and single-rounded FMAs (``decode_twin_forward``) or, by default, exact exp2 / sigmoid and FMAs rounded
    twice. All sequences advance in lockstep, one token per step."""
    out, state, _, _ = _recurrent(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                                  ar, gate_kind, beta_scale)
    return out, state


def _token_walk_start(q, k, v, initial_state, cu_seqlens):
    """What both decode twins start from: q, k on the value heads, the sequences' (bos, lengths) on the CPU, the fp32
    state [N, H, V, K] (zeros without an initial state) and a zero out [B·T, H, V] in bf16."""
    B, T, H, _ = v.shape
    q, k = _key_heads_expanded(q, k, H)
    bos, _, lengths = sequence_bounds(cu_seqlens, B, T)
    if initial_state is not None:
        state = initial_state.float().clone()
    else:
        state = torch.zeros(len(lengths), H, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=q.device)
    return q, k, bos, lengths, state, torch.zeros(B * T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)


def _recurrent(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
               ar: Optional[Arithmetic], gate_kind: str, beta_scale: float, token_states: int = 0,
               checkpoints: Optional[list] = None):
    """``recurrent_forward``'s loop: (out, final state, with ``token_states`` = L > 0 the fp32 state after each of
    the first L tokens [N, L, H, V, K] (past a sequence's end, its state as it stays), else None, and with
    ``checkpoints`` [(n, t), ...] (0 < t <= sequence n's length) the fp32 state of sequence n after its token t − 1
    for each [E, H, V, K], else None)."""
    ar = ar or fp32_arithmetic()
    B, T, H, _ = v.shape
    q, k, bos, lengths, state, out = _token_walk_start(q, k, v, initial_state, cu_seqlens)
    N, device = len(lengths), q.device
    tokens = (torch.zeros(N, token_states, *state.shape[1:], dtype=torch.float32, device=device) if token_states
              else None)
    recorded = None if checkpoints is None else [None] * len(checkpoints)
    recorded_at = {}  # step -> [(checkpoint, sequence)]: the checkpoints taken after that token
    for e, (n, t) in enumerate(checkpoints or ()):
        recorded_at.setdefault(t - 1, []).append((e, n))
    if N == 0 or B * T == 0:  # (no tokens: no checkpoint either)
        if tokens is not None:
            tokens[:] = state.unsqueeze(1)
        return out.view(B, T, H, HEAD_DIM), state, tokens, _stacked(recorded, state)

    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    k_hat, q_t, alpha, beta_act = _prepare_tokens(flat(q), flat(k), flat(g), flat(beta), scale, A_log, dt_bias,
                                                  lower_bound, ar, gate_kind, beta_scale)  # fmt: skip
    vf = flat(v).float()
    bos_d, lengths_d = bos.to(device), lengths.to(device)
    for step in range(int(lengths.max())):
        if int(lengths.min()) > step:  # every sequence has token `step` (no gather)
            active, tok = slice(None), bos_d + step
        else:
            active = (lengths_d > step).nonzero().flatten()  # the sequences that have token `step`
            tok = bos_d[active] + step
        s = state[active]  # [U, H, V, K]
        kh, qt = k_hat[tok], q_t[tok]  # [U, H, K]
        s = s * alpha[tok][:, :, None, :]
        r = vf[tok] - halving_tree_32(ar.lane_leaves(s, kh))  # [U, H, V]
        u = beta_act[tok][:, :, None] * r
        s = ar.row_fma(u, kh, s)
        out[tok] = halving_tree_32(ar.lane_leaves(s, qt)).to(torch.bfloat16)
        state[active] = s
        if step < token_states:
            tokens[:, step] = state
        if recorded_at:
            for e, n in recorded_at.get(step, ()):
                recorded[e] = state[n].clone()
    if tokens is not None and int(lengths.max()) < token_states:
        tokens[:, int(lengths.max()):] = state.unsqueeze(1)
    return out.view(B, T, H, HEAD_DIM), state, tokens, _stacked(recorded, state)


def _stacked(recorded: Optional[list], state: torch.Tensor) -> Optional[torch.Tensor]:
    """The recorded checkpoint states [E, H, V, K] (E may be 0), or None without checkpoints."""
    if recorded is None:
        return None
    return torch.stack(recorded) if recorded else state.new_zeros(0, *state.shape[1:])


def token_states_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                         token_states: int, ar: Optional[Arithmetic] = None, *, gate_kind: str = "lower_bound",
                         beta_scale: float = 1.0) -> torch.Tensor:
    """The state after each of every sequence's first ``token_states`` = L tokens, fp32 [N, L, H, V, K], by the
    decode kernel's token-by-token recurrence (``recurrent_forward``; ``ar`` as there): how every plan produces
    per-token states (docs/NUMERICS.md, "Per-token states"). Past a sequence's end its state stays as it is."""
    return _recurrent(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, ar,
                      gate_kind, beta_scale, token_states)[2]


def _recurrent_checkpoints(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                           ar: Arithmetic, gate_kind: str, beta_scale: float, checkpoints: list) -> tuple:
    """(out, final state, checkpoint states [E, H, V, K]) of the decode kernel's recurrence (``_recurrent``)."""
    out, state, _, recorded = _recurrent(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state,
                                         cu_seqlens, ar, gate_kind, beta_scale, checkpoints=checkpoints)
    return out, state, recorded


def _split_k_steps(hi: torch.Tensor, lo: torch.Tensor, left: bool) -> torch.Tensor:
    """The three products of a hi/lo split product as one k-concatenated operand, k-step by k-step in the kernel's
    order (lo·hi, hi·lo, hi·hi): the left operand [.., m, k] as [lo | hi | hi] per 16 columns, the right one
    [.., k, n] as [hi; lo; hi] per 16 rows."""
    if left:
        parts = [x.unflatten(-1, (-1, CHUNK)) for x in (lo, hi, hi)]
        return torch.stack(parts, dim=-2).flatten(-3)
    parts = [x.unflatten(-2, (-1, CHUNK)) for x in (hi, lo, hi)]
    return torch.stack(parts, dim=-3).flatten(-4, -2)


def _split_product(left: torch.Tensor, right: torch.Tensor, c: Optional[torch.Tensor], ar: Arithmetic) -> torch.Tensor:
    """c + left·right as the decode chunk step forms it: both operands split hi + lo, three products per k-step."""
    l_hi, l_lo = _hi_lo(left, ar)
    r_hi, r_lo = _hi_lo(right, ar)
    return ar.matmul(_split_k_steps(l_hi, l_lo, True), _split_k_steps(r_hi, r_lo, False), c)


def _chunk_step(state, kh, qt, alpha, beta_act, v, valid, ar: Arithmetic):
    """One step of decode_chunk.cu for U (sequence, head) pairs: state fp32 [U, H, V, K]; kh, qt, alpha [U, H, 16, K]
    and beta_act [U, H, 16] prepared (rows past a sequence's end inert: 0, 0, 1, 0); v fp32 [U, H, 16, V]; valid
    bool [U, 16] (the rows that are tokens). Returns (out fp32 [U, H, 16, V], the new state); out past the tokens
    is not the kernel's (it writes none)."""
    # P(j→t) = α_{j+1}···α_t, step d = t − j at a time; A_tj = Σ_c (k̂_j P)_c k̂_t,c (j < t), B_tj likewise with q̃_t.
    U, H = kh.shape[:2]
    a_mat = torch.zeros(U, H, CHUNK, CHUNK, dtype=torch.float32, device=kh.device)
    b_mat = torch.zeros_like(a_mat)
    rows = torch.arange(CHUNK, device=kh.device)
    b_mat[..., rows, rows] = tree_sum_128(kh * qt)
    p = None
    for d in range(1, CHUNK):
        t = rows[d:]
        p = alpha[..., d:, :] if d == 1 else p[..., 1:, :] * alpha[..., 1 : CHUNK - d + 1, :]
        kd = kh[..., : CHUNK - d, :] * p  # rows j = t − d
        a_mat[..., t, t - d] = tree_sum_128(kd * kh[..., d:, :])
        b_mat[..., t, t - d] = tree_sum_128(kd * qt[..., d:, :])
    # T = (I + diag(β)·A)⁻¹·diag(β) by rows: T_tt = β_t, T_tj = (−β_t)·Σ_{i<t} A_ti T_ij (FMAs in i order); rows
    # past the tokens zero.
    valid = valid[:, None, :].expand(U, H, CHUNK)
    t_mat = torch.zeros_like(a_mat)
    for t in range(CHUNK):
        acc = torch.zeros_like(t_mat[..., 0, :])
        for i in range(t):
            acc = fma_rn(a_mat[..., t, i, None], t_mat[..., i, :], acc)
        row = (-beta_act[..., t, None]) * acc
        row[..., t] = beta_act[..., t]
        row[..., t + 1 :] = 0.0
        t_mat[..., t, :] = torch.where(valid[..., t, None], row, torch.zeros_like(row))
    # D_t = α_0···α_t; E_j = k̂_j P(j→15).
    decay = alpha.clone()
    for t in range(1, CHUNK):
        decay[..., t, :] = decay[..., t - 1, :] * alpha[..., t, :]
    e_mat = kh.clone()
    to_end = None
    for j in range(CHUNK - 2, -1, -1):
        to_end = alpha[..., CHUNK - 1, :] if j == CHUNK - 2 else to_end * alpha[..., j + 1, :]
        e_mat[..., j, :] = kh[..., j, :] * to_end
    x = torch.cat([kh * decay, qt * decay], dim=-2).transpose(-1, -2)  # [U, H, K, 32]
    w = _split_product(state, x, None, ar)  # [U, H, V, 32]
    w_k, w_q = w[..., :CHUNK], w[..., CHUNK:]
    r = v.transpose(-1, -2) - w_k  # [U, H, V, 16]
    r = torch.where(valid[..., None, :], r, torch.zeros_like(r))
    u = _split_product(r, t_mat.transpose(-1, -2), None, ar)
    o = _split_product(u, b_mat.transpose(-1, -2), w_q, ar)
    state = _split_product(u, e_mat, state * decay[..., CHUNK - 1, None, :], ar)
    return o.transpose(-1, -2), state


def decode_chunk_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None,
                         ar: Optional[Arithmetic] = None, *, gate_kind: str = "lower_bound",
                         beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode plan's chunk step (kda/csrc/decode_chunk.cu; docs/NUMERICS.md, "The decode chunk step"): each
    sequence 16 tokens at a time from its start, (out bf16 [B,T,H,V], final fp32 [N,H,V,K]). ``ar``: the kernel's
    arithmetic (``decode_chunk_twin_forward``) or, by default, fp32 operands and exact exp2 / sigmoid."""
    out, state, _ = _decode_chunks(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                                   ar or fp32_arithmetic(), gate_kind, beta_scale)
    return out, state


def _decode_chunks(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens, ar: Arithmetic,
                   gate_kind: str, beta_scale: float, checkpoints: Optional[list] = None):
    """``decode_chunk_forward``'s loop: (out, final state, with ``checkpoints`` [(n, t), ...] (t a multiple of 16,
    0 < t <= sequence n's length) the fp32 state of sequence n after its chunk ending at token t − 1 for each
    [E, H, V, K], else None)."""
    B, T, H, _ = v.shape
    q, k, bos, lengths, state, out = _token_walk_start(q, k, v, initial_state, cu_seqlens)
    N, device = len(lengths), q.device
    recorded = None if checkpoints is None else [None] * len(checkpoints)
    if N == 0 or B * T == 0:
        return out.view(B, T, H, HEAD_DIM), state, _stacked(recorded, state)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    k_hat, q_t, alpha, beta_act = _prepare_tokens(flat(q), flat(k), flat(g), flat(beta), scale, A_log, dt_bias,
                                                  lower_bound, ar, gate_kind, beta_scale)  # fmt: skip
    vf = flat(v).float()
    # One inert row past the tokens (k̂ = q̃ = v = 0, α = 1, β = 0) for the rows past a sequence's end.
    pad = lambda x, fill: torch.cat([x, torch.full_like(x[:1], fill)])  # noqa: E731
    k_hat, q_t, alpha, beta_act, vf = (pad(k_hat, 0.0), pad(q_t, 0.0), pad(alpha, 1.0), pad(beta_act, 0.0),
                                       pad(vf, 0.0))
    total = B * T
    for m in range(int((lengths.max() + CHUNK - 1) // CHUNK)):
        active = (lengths > CHUNK * m).nonzero().flatten()
        token = bos[active, None] + CHUNK * m + torch.arange(CHUNK)
        valid = token < (bos + lengths)[active, None]
        token = torch.where(valid, token, torch.full_like(token, total)).to(device)  # [U, 16]
        per_head = lambda x: x[token].transpose(1, 2)  # noqa: E731  [U, 16, H, ...] -> [U, H, 16, ...]
        idx = active.to(device)
        o, state[idx] = _chunk_step(state[idx], per_head(k_hat), per_head(q_t), per_head(alpha),
                                    beta_act[token].transpose(1, 2), per_head(vf), valid.to(device), ar)
        written = token[valid.to(device)]
        out[written] = o.transpose(1, 2)[valid.to(device)].to(torch.bfloat16)
        for e, (n, t) in enumerate(checkpoints or ()):
            if t == CHUNK * (m + 1):
                recorded[e] = state[n].clone()
    return out.view(B, T, H, HEAD_DIM), state, _stacked(recorded, state)


def decode_chunk_twin_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None,
                              cu_seqlens=None, *, gate_kind: str = "lower_bound",
                              beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk step's exact arithmetic (CUDA tensors only): ``decode_chunk_forward`` with the kernel's
    instructions, bf16 hi/lo operands and ``mma.sync`` products. Arguments as ``decode_twin_forward``."""
    if q.device.type != "cuda":
        raise RuntimeError(f"decode_chunk_twin_forward re-enacts the CUDA kernel and needs CUDA tensors; got "
                           f"{q.device=}")
    return decode_chunk_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                                kernel_arithmetic(), gate_kind=gate_kind, beta_scale=beta_scale)


def decode_twin_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None,
                        cu_seqlens=None, *, gate_kind: str = "lower_bound",
                        beta_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's exact arithmetic (CUDA tensors only): ``recurrent_forward`` with the kernel's
    ``ex2.approx`` and ``tanh.approx``-based sigmoid. (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K]).

    | arg | dtype | shape |
    |---|---|---|
    | q, k, g | bf16 | [B, T, H, K] |
    | v | bf16 | [B, T, H, V] |
    | beta | bf16 | [B, T, H] (logits) |
    | A_log, dt_bias | fp32 / bf16 / fp16 | [H], [H, K] |
    | initial_state | None / bf16 / fp32 | [N, H, V, K] |
    | cu_seqlens | int32 / int64 or None | [N + 1] |
    """
    if q.device.type != "cuda":
        raise RuntimeError(f"decode_twin_forward re-enacts the CUDA kernel and needs CUDA tensors; got {q.device=}")
    return recurrent_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                             kernel_arithmetic(), gate_kind=gate_kind, beta_scale=beta_scale)


def twin_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None,
                 segment_chunks=None, decode=None, *, state_indices=None, final_state=None,
                 gate_kind: str = "lower_bound", beta_scale: float = 1.0, num_accepted_tokens=None,
                 checkpoint_indices=None, checkpoint_every: int = 0, final_dtype=_UNSAID):
    """The kernel's exact arithmetic (CUDA tensors only): (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K]).

    ``segment_chunks``: the time split to re-enact; ``decode``: whether to re-enact the decode plan's kernels
    (``decode_twin_forward``, or ``decode_chunk_twin_forward`` where sequences average 16 tokens or more) instead
    of the chunked kernels. A decode plan's stream pass (``planning.stream_pass_runs``) runs the chunked
    arithmetic; it depends on the dtype of the call's final state, ``final_dtype`` (None: no final state), which
    must be given where it decides. None takes the choice
    ``flash_kda.fwd`` would make for these inputs now (its plan, including a plan forced by
    ``flash_kda.testing.force_plan``). With ``state_indices`` [N], ``initial_state`` is a pool [P, H, V, K] and
    the second result is the fp32 pool ``fwd`` leaves: ``final_state`` (the pool before the call; default
    ``initial_state``) with each named slot replaced; with per-token ``state_indices`` [N, L] (and
    ``num_accepted_tokens``), the pool with the state after each of the first L tokens in its slot, those states
    from the decode kernel's recurrence whatever the plan (``token_states_forward``). ``gate_kind``, ``beta_scale``,
    grouped value heads and A_log / dt_bias None as in ``chunked_forward``.

    ``checkpoint_indices`` [N, M] with ``checkpoint_every`` = C (beside ``state_indices`` [N]): the pool also holds
    the state of sequence n after its first (m+1)·C tokens in slot ``checkpoint_indices[n, m]`` for every m with
    (m+1)·C <= its length (negative or >= P: none), as the plan's recurrence holds it there (the chunked stepping,
    under the time split the finishing unit's; the decode kernel's recurrence), written before the final states."""
    if q.device.type != "cuda":
        raise RuntimeError(f"twin_forward re-enacts the CUDA kernel and needs CUDA tensors; got {q.device=}")
    if segment_chunks is None or decode is None:
        run = planning.plan(q, cu_seqlens, heads=v.shape[2], gate=gate_kind)
        segment_chunks = run.segment_chunks if segment_chunks is None else segment_chunks
        decode = run.decode if decode is None else decode
    per_token = _token_states(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, cu_seqlens, state_indices,
                              num_accepted_tokens, kernel_arithmetic(), gate_kind, beta_scale)
    entries, slots = _checkpoint_entries(v, cu_seqlens, state_indices, initial_state, final_state,
                                         checkpoint_indices, checkpoint_every)
    if entries is not None:
        if decode and planning.decode_chunk_runs(v.shape[0] * v.shape[1], len(
                sequence_bounds(cu_seqlens, v.shape[0], v.shape[1])[2])):
            forward = lambda initial: _decode_chunks(  # noqa: E731
                q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, kernel_arithmetic(),
                gate_kind, beta_scale, entries)
        elif decode:
            forward = lambda initial: _recurrent_checkpoints(  # noqa: E731
                q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, kernel_arithmetic(),
                gate_kind, beta_scale, entries)
        else:
            forward = lambda initial: _chunked(  # noqa: E731
                q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, kernel_arithmetic(),
                segment_chunks, gate_kind, beta_scale, entries)
        return _forward_on(initial_state, final_state, state_indices, forward, checkpoint_slots=slots)
    if decode and not per_token and _stream_pass_runs(v, cu_seqlens, final_dtype):
        decode = False  # the stream pass: the chunked arithmetic, no time split
        segment_chunks = 0
    if decode and not per_token and planning.decode_chunk_runs(v.shape[0] * v.shape[1], len(
            sequence_bounds(cu_seqlens, v.shape[0], v.shape[1])[2])):
        return _forward_on(initial_state, final_state, state_indices, lambda initial: decode_chunk_twin_forward(
            q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, gate_kind=gate_kind,
            beta_scale=beta_scale))
    if decode:
        return _forward_on(initial_state, final_state, state_indices, lambda initial: decode_twin_forward(
            q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, gate_kind=gate_kind,
            beta_scale=beta_scale), **per_token)
    return _forward_on(initial_state, final_state, state_indices, lambda initial: chunked_forward(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, kernel_arithmetic(),
        segment_chunks, gate_kind, beta_scale,
    ), **per_token)


def _stream_pass_runs(v, cu_seqlens, final_dtype) -> bool:
    """Whether ``fwd``'s decode plan runs the stream pass for a call with values ``v`` (planning.stream_pass_runs)
    and a final state of ``final_dtype`` (a ValueError where that decides and was not given)."""
    items = (v.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1) * v.shape[2]
    device = v.device.index if v.device.index is not None else torch.cuda.current_device()
    route = functools.partial(planning.stream_pass_runs, cu_seqlens is not None, v.shape[1], items=items,
                              sm_count=planning.sm_count_of(device))
    if not route(fp32_final=False):
        return False
    if final_dtype is _UNSAID:
        raise ValueError("twin_forward: pass final_dtype, the dtype of fwd's final_state (None for none): a decode "
                         "plan's stream pass runs only without an fp32 final state")
    return route(fp32_final=final_dtype == torch.float32)


def _token_states(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, cu_seqlens, state_indices,
                  num_accepted_tokens, ar: Arithmetic, gate_kind: str, beta_scale: float) -> dict:
    """``_forward_on``'s per-token arguments for ``state_indices`` [N, L] (empty otherwise)."""
    if state_indices is None or state_indices.dim() != 2:
        return {}
    B, T = v.shape[:2]
    return dict(tokens=lambda initial: token_states_forward(
                    q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, state_indices.shape[1],
                    ar, gate_kind=gate_kind, beta_scale=beta_scale),
                num_accepted_tokens=num_accepted_tokens, lengths=sequence_bounds(cu_seqlens, B, T)[2].tolist())


def cpu_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None, *,
                state_indices=None, final_state=None, gate_kind: str = "lower_bound", beta_scale: float = 1.0,
                num_accepted_tokens=None, checkpoint_indices=None, checkpoint_every: int = 0):
    """The same chunked algorithm in fp32 on any device: (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K]); with
    ``state_indices`` (1-D or per token), pools as in ``twin_forward`` (per-token states by the recurrence in fp32),
    and checkpoints as there (``checkpoint_indices``, ``checkpoint_every``: the chunked stepping's states, no time
    split)."""
    per_token = _token_states(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, cu_seqlens, state_indices,
                              num_accepted_tokens, fp32_arithmetic(), gate_kind, beta_scale)
    entries, slots = _checkpoint_entries(v, cu_seqlens, state_indices, initial_state, final_state,
                                         checkpoint_indices, checkpoint_every)
    return _forward_on(initial_state, final_state, state_indices, lambda initial: _chunked(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens, fp32_arithmetic(), 0, gate_kind,
        beta_scale, entries,
    ), checkpoint_slots=slots, **per_token)
