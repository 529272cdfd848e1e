"""The decode kernel's numerics twin (kda/csrc/decode.cu; docs/NUMERICS.md, "The decode kernel").

The decode kernel runs each sequence token by token with the state in fp32 registers. Its arithmetic, which
``decode_twin_forward`` re-enacts with PyTorch's IEEE-rounded elementwise ops (one rounding per op, no FMA) and
the extension's approximate instructions, is, per (sequence, head) and token t:

* k̂ = k ⊙ inv_norm(k) and q̃ = (q ⊙ inv_norm(q)) · scale (two roundings, in that order), with
  inv_norm(x) = 1 / sqrt(Σx² + 1e-6) (``rcp.rn``, ``sqrt.rn``) and Σ over the 128 channels in the tree order below;
* α = 2^γ through ``ex2.approx.ftz``, γ = sigmoid((g + dt_bias) · 2^(A_log·log2 e)) · (lower_bound · log2 e)
  exactly as the preparation computes it (sigmoid = 0.5·``tanh.approx``(0.5·x) + 0.5); β = sigmoid(beta logit);
* per state row v: S[v,:] = S[v,:] ⊙ α; r = v_t[v] − tree(S[v,k]·k̂_k); u = β·r; S[v,k] = S[v,k] + u·k̂_k;
  o[v] = tree(S[v,k]·q̃_k); out = bf16(o), rounded to nearest even.

tree(p) over the 128 channels: lane l of a warp holds p[4l..4l+3] and forms ((p0+p1)+(p2+p3)) (each product
rounded first), then the halving tree s[:16]+s[16:32], s[:8]+s[8:16], ..., which the kernel's xor butterfly
over lanes 16, 8, 4, 2, 1 reproduces exactly (fp addition is commutative). The initial state is read as fp32
(bf16 widened exactly), or zeros; the final state is S (the caller casts it to bf16 or keeps fp32).

The V split of the kernel (which rows a CTA owns) changes nothing: rows evolve independently.
"""

from __future__ import annotations

from typing import Optional

import torch

HEAD_DIM = 128
LOG2E = 1.4426950408889634
NORM_EPS = 1e-6


def tree_sum_128(p: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim (128) in the kernel's order: lane leaves ((p0+p1)+(p2+p3)), then the halving tree."""
    p = p.unflatten(-1, (32, 4))
    s = (p[..., 0] + p[..., 1]) + (p[..., 2] + p[..., 3])
    width = 16
    while width >= 1:
        s = s[..., :width] + s[..., width : 2 * width]
        width //= 2
    return s[..., 0]


def _fp32(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _inv_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.sqrt(tree_sum_128(x * x) + _fp32(NORM_EPS, x.device)))


def _prepare_tokens(q, k, g, beta, scale, A_log, dt_bias, lower_bound, exp2, sigmoid):
    """k̂, q̃, α [.., H, K] and β [.., H] of every token at once (no token depends on another)."""
    device = q.device
    kf, qf, gf = k.float(), q.float(), g.float()
    k_hat = kf * _inv_norm(kf)[..., None]
    q_t = (qf * _inv_norm(qf)[..., None]) * _fp32(scale, device)
    log2e = _fp32(LOG2E, device)
    exp_a = exp2(A_log.float() * log2e)  # [H]
    gate_scale = _fp32(lower_bound, device) * log2e
    x = (gf + dt_bias.float().reshape(-1, HEAD_DIM)) * exp_a[:, None]
    alpha = exp2(sigmoid(x) * gate_scale)
    return k_hat, q_t, alpha, sigmoid(beta.float())


def recurrent_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None, cu_seqlens=None,
                      exp2=torch.exp2, sigmoid=torch.sigmoid) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence in fp32 with the decode kernel's orders; (out bf16 [B,T,H,V], final fp32
    [N,H,V,K]). ``exp2`` / ``sigmoid``: the kernel's approximate instructions (``decode_twin_forward``) or exact
    ones. All sequences advance in lockstep, one token per step, for as many steps as the longest has tokens."""
    B, T, H, _ = q.shape
    device = q.device
    if cu_seqlens is None:
        bos = torch.arange(B, dtype=torch.int64) * T
        eos = bos + T
    else:
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        bos, eos = cu[:-1], cu[1:]
    lengths = (eos - bos).clamp(min=0)
    N = len(lengths)
    if initial_state is not None:
        state = initial_state.float().clone()
    else:
        state = torch.zeros(N, H, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    out = torch.zeros(B * T, H, HEAD_DIM, dtype=torch.bfloat16, device=device)
    if N == 0 or B * T == 0:
        return out.view(B, T, H, HEAD_DIM), state

    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    k_hat, q_t, alpha, beta_act = _prepare_tokens(flat(q), flat(k), flat(g), flat(beta), scale, A_log, dt_bias,
                                                  lower_bound, exp2, sigmoid)  # fmt: skip
    vf = flat(v).float()
    bos_d, lengths_d = bos.to(device), lengths.to(device)
    for step in range(int(lengths.max())):
        if int(lengths.min()) > step:  # every sequence has token `step` (no gather)
            active, tok = slice(None), bos_d + step
        else:
            active = (lengths_d > step).nonzero().flatten()  # the sequences that have token `step`
            tok = bos_d[active] + step
        s = state[active]  # [U, H, V, K]
        kh, qt = k_hat[tok][:, :, None, :], q_t[tok][:, :, None, :]  # [U, H, 1, K]
        s = s * alpha[tok][:, :, None, :]
        r = vf[tok] - tree_sum_128(s * kh)  # [U, H, V]
        u = beta_act[tok][:, :, None] * r
        s = s + u[..., None] * kh
        out[tok] = tree_sum_128(s * qt).to(torch.bfloat16)
        state[active] = s
    return out.view(B, T, H, HEAD_DIM), state


def decode_twin_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=None,
                        cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's exact arithmetic (CUDA tensors only): (out bf16 [B,T,H,V], final_state fp32 [N,H,V,K]).

    | arg | dtype | shape |
    |---|---|---|
    | q, k, g | bf16 | [B, T, H, K] |
    | v | bf16 | [B, T, H, V] |
    | beta | bf16 | [B, T, H] (logits) |
    | A_log, dt_bias | fp32 / bf16 / fp16 | [H], [H, K] |
    | initial_state | None / bf16 / fp32 | [N, H, V, K] |
    | cu_seqlens | int32 / int64 or None | [N + 1] |
    """
    from flash_kda import _ext  # noqa: PLC0415 -- the extension is needed only here

    if q.device.type != "cuda":
        raise RuntimeError(f"decode_twin_forward re-enacts the CUDA kernel and needs CUDA tensors; got {q.device=}")
    return recurrent_forward(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                             exp2=_ext.ex2_approx, sigmoid=_ext.sigmoid_approx)
