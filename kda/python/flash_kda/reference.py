"""Float64 ground truth for the KDA forward (docs/SPEC.md §1), on the device of the inputs (CPU or CUDA).

Two forms of the same function:
- ``reference_loop``: the token recurrence of docs/SPEC.md §1, literally, one token at a time.
- ``reference_chunked``: the chunked algebra of docs/SPEC.md §2 (exact, not an approximation), sequential only
  over chunks, so it is fast enough for 1M-token sequences on a GPU; it agrees with the loop to ~1e-12.

Both are vectorised over heads and sequences: sequences are laid side by side and padded to a common length
with "inert" tokens (k̂ = q̂ = v = 0, β = 0, decay 1), which leave the state unchanged and whose outputs are
dropped. Both return ``(out, final_state)`` in float64: out [B, T, HV, V], final_state [N, HV, V, K]. With
``state_indices`` both take pools (``flash_kda.pools``): the initial states of the sequences' slots, and the final
pool that ``flash_kda.fwd`` leaves (the slots no sequence names unchanged); with ``checkpoint_indices`` and
``checkpoint_every`` = C too, that pool holds the exact state after every sequence's first (m+1)·C tokens in slot
``checkpoint_indices[n, m]`` (written before the final states).

Both take ``flash_kda.fwd``'s options: the gate's activation (``gate_kind``, see ``gate``; A_log None means
exp(A_log) = 1, dt_bias None means 0), β's scale (``beta_scale``: 2 is fwd's ``allow_neg_eigval``) and grouped
value heads (q, k on H key heads, v, g, beta and the states on HV = G·H value heads; value head hv reads key head
hv // G, i.e. q and k expanded by ``repeat_interleave(G, dim=-2)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flash_kda import pools
from flash_kda.validation import check_cu_seqlens

__all__ = ["reference_loop", "reference_chunked", "l2_normalize", "gate", "NORM_EPS"]

NORM_EPS = 1e-6  # inside the square root: q̂ = q / sqrt(Σq² + eps)
_F64 = torch.float64
_BLOCK_TOKEN_HEADS = 1 << 16  # token-heads prepared at once (bounds memory for 1M-token inputs)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ x² + 1e-6) over the last dim, in float64."""
    x = x.to(_F64)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)


GATES = ("lower_bound", "softplus")


def gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
         kind: str = "lower_bound") -> torch.Tensor:
    """Natural-log decay per channel, float64, g [..., H, K]:
    lower_bound: λ = lower_bound · sigmoid(exp(A_log[h]) · (g + dt_bias[h]));
    softplus: λ = −exp(A_log[h]) · softplus(g + dt_bias[h]) (unbounded below; lower_bound unused, may be None).
    A_log None: exp(A_log[h]) = 1; dt_bias None: 0."""
    if kind not in GATES:
        raise ValueError(f"gate kind must be one of {GATES}, got {kind=}")
    H, K = g.shape[-2:]
    a = 1.0 if A_log is None else torch.exp(A_log.to(_F64)).reshape(H, 1)
    x = g.to(_F64) if dt_bias is None else g.to(_F64) + dt_bias.to(_F64).reshape(H, K)
    if kind == "softplus":
        return -a * torch.nn.functional.softplus(x)
    if lower_bound is None:
        raise ValueError("the lower_bound gate needs a lower_bound, got lower_bound=None")
    return lower_bound * torch.sigmoid(a * x)


@dataclass
class _Problem:
    """The inputs flattened to tokens [B*T, H, D] plus the sequence layout (H: the value heads; q and k
    expanded to them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    scale: float
    lower_bound: float | None
    shape: tuple[int, int, int, int, int]  # B, T, H, K, V
    starts: list[int]  # first token of each sequence in the flattened token axis
    lengths: list[int]
    state: torch.Tensor  # float64 [N, H, V, K]
    gate_kind: str = "lower_bound"
    beta_scale: float = 1.0

    @property
    def device(self) -> torch.device:
        return self.q.device

    def token_index(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flattened token index [N, t1 - t0] of local positions t0..t1-1 of every sequence, and its mask."""
        local = torch.arange(t0, t1, device=self.device)
        starts = torch.tensor(self.starts, device=self.device).unsqueeze(1)
        lengths = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
        valid = local.unsqueeze(0) < lengths
        return torch.where(valid, starts + local.unsqueeze(0), 0), valid

    def gather(self, t0: int, t1: int) -> dict[str, torch.Tensor]:
        """Float64 prepared tokens t0..t1-1 of every sequence, [N, H, L, D] (β: [N, H, L]); padding is inert."""
        idx, m = self.token_index(t0, t1)
        return {
            "q": _masked(l2_normalize(self.q[idx]), m),
            "k": _masked(l2_normalize(self.k[idx]), m),
            "v": _masked(self.v[idx].to(_F64), m),
            "lam": _masked(gate(self.g[idx], self.A_log, self.dt_bias, self.lower_bound, self.gate_kind), m),
            "beta": _masked(self.beta_scale * torch.sigmoid(self.beta[idx].to(_F64)), m),
        }

    def scatter(self, out: torch.Tensor, t0: int, t1: int, o: torch.Tensor) -> None:
        """Writes o [N, H, L, V] (tokens t0..t1-1 of every sequence) into out [B*T, H, V], dropping padding."""
        idx, valid = self.token_index(t0, t1)
        out[idx[valid]] = o.transpose(1, 2)[valid]


def _masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, L, H, ...] float64, zeroed where the mask [N, L] is False (where, not *, so NaNs cannot leak from
    the token that padding indices point at), moved to [N, H, L, ...]."""
    x = torch.where(m.reshape(*m.shape, *([1] * (x.dim() - 2))), x, 0.0)
    return x.transpose(1, 2)


def _problem(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
             gate_kind: str = "lower_bound", beta_scale: float = 1.0) -> _Problem:
    B, T, H_key, K = q.shape
    H, V = v.shape[-2:]  # the value heads
    grouped = H >= H_key and H % H_key == 0 if H_key else H == 0  # HV = G·H with G >= 1
    if k.shape != q.shape or not grouped:
        raise ValueError(f"k must have q's shape and v's heads must be a multiple of q's, got {q.shape=}, "
                         f"{k.shape=}, {v.shape=}")
    expected = {"v": (B, T, H, V), "g": (B, T, H, K), "beta": (B, T, H), "A_log": (H,)}
    for name, t in (("v", v), ("g", g), ("beta", beta), ("A_log", A_log)):
        if t is not None and tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} must be {list(expected[name])} (B, T from q, the value heads H from v), got "
                             f"{name}.shape={tuple(t.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must be [H, K] or flat [H·K] = {H * K} elements, got dt_bias.shape="
                         f"{tuple(dt_bias.shape)}")
    if H != H_key:  # grouped value heads: value head h reads key head h // G
        q, k = q.repeat_interleave(H // H_key, dim=-2), k.repeat_interleave(H // H_key, dim=-2)
    if cu_seqlens is None:
        starts, lengths = [b * T for b in range(B)], [T] * B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1, got {q.shape=}")
        check_cu_seqlens(cu_seqlens, T)  # the reference may synchronise; malformed input is a test bug
        cu = cu_seqlens.tolist()
        starts, lengths = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    N = len(lengths)
    if initial_state is None:
        state = torch.zeros(N, H, V, K, dtype=_F64, device=q.device)
    else:
        if tuple(initial_state.shape) != (N, H, V, K):
            raise ValueError(f"initial_state must be [N, H, V, K] = {[N, H, V, K]}, got {initial_state.shape=}")
        state = initial_state.to(_F64).clone()
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    return _Problem(
        q=flat(q), k=flat(k), v=flat(v), g=flat(g), beta=flat(beta), A_log=A_log, dt_bias=dt_bias,
        scale=float(scale), lower_bound=None if lower_bound is None else float(lower_bound), shape=(B, T, H, K, V),
        starts=starts, lengths=lengths, state=state, gate_kind=gate_kind, beta_scale=float(beta_scale),
    )  # fmt: skip


def reference_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
                   initial_state: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, *, state_indices: torch.Tensor | None = None,
                   final_state: torch.Tensor | None = None, gate_kind: str = "lower_bound",
                   beta_scale: float = 1.0, num_accepted_tokens: torch.Tensor | None = None,
                   checkpoint_indices: torch.Tensor | None = None,
                   checkpoint_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA recurrence of docs/SPEC.md §1 in float64, one token at a time (all sequences and heads at once).

    For each token: S ← S·Diag(α_t); r = v_t − S k̂_t; S ← S + β_t r k̂_tᵀ; o_t = S (scale·q̂_t), with
    α_t = exp(λ_t) (``gate``) and β_t = beta_scale · sigmoid(beta_t).

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | q, k | any float | [B, T, H, K] | queries, keys on the H key heads |
    | g | any float | [B, T, HV, K] | raw gate, on the HV = G·H value heads (value head hv reads key head hv // G) |
    | v | any float | [B, T, HV, V] | values |
    | beta | any float | [B, T, HV] | beta logits |
    | scale | float | — | output scale |
    | lower_bound | float / None | — | the lower_bound gate's bound; unused by the softplus gate (may be None) |
    | A_log | None / any float | [HV] | log-gate parameter (None: exp(A_log) = 1) |
    | dt_bias | None / any float | [HV, K] or [HV*K] | gate bias (None: 0) |
    | initial_state | None / any float | [N, HV, V, K] | initial state (None: zeros) |
    | cu_seqlens | int | [N + 1] | optional sequence boundaries (B = 1); validated (synchronises) |
    | state_indices | int | [N] or [N, L] | optional pool slot of each sequence (negative: none), or per-token slots (pools.run_pooled_tokens); the states are pools |
    | num_accepted_tokens | int | [N] | with [N, L] indices: sequence n starts from slot [n, num_accepted_tokens[n] − 1] |
    | final_state | None / any float | [P, HV, V, K] | with state_indices: the pool before the call (None: initial_state) |
    | gate_kind | str | — | "lower_bound" or "softplus" (``gate``) |
    | beta_scale | float | — | β's factor: 1, or 2 for ``flash_kda.fwd``'s ``allow_neg_eigval`` |
    | checkpoint_indices | int | [N, M] | with state_indices [N]: the slot of the state after sequence n's first (m+1)·C tokens (negative or >= P: none) |
    | checkpoint_every | int | — | C, tokens between checkpoints, with checkpoint_indices |

    Returns (out float64 [B, T, HV, V], final_state float64 [N, HV, V, K]) on the inputs' device; with
    ``state_indices``, the final pool float64 [P, HV, V, K] ``flash_kda.fwd`` leaves.
    """
    problem = lambda initial: _problem(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial,  # noqa: E731
                                       cu_seqlens, gate_kind, beta_scale)
    if checkpoint_indices is not None:
        entries, slots = _checkpoint_entries(problem(None).lengths, state_indices, initial_state, final_state,
                                             checkpoint_indices, checkpoint_every)
        return pools.run_pooled(lambda initial: _recorded(_loop(problem(initial), checkpoints=entries)),
                                initial_state, final_state, state_indices, slots)
    if state_indices is not None and state_indices.dim() == 2:  # per-token states
        return pools.run_pooled_tokens(
            lambda initial: _loop(problem(initial), token_states=state_indices.shape[1])[::2],
            initial_state, final_state, state_indices, num_accepted_tokens, problem(None).lengths)
    if state_indices is not None:
        return pools.run_pooled(
            lambda initial: reference_loop(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial, cu_seqlens,
                                           gate_kind=gate_kind, beta_scale=beta_scale),
            initial_state, final_state, state_indices)
    out, S, _, _ = _loop(problem(initial_state))
    return out, S


def _checkpoint_entries(lengths: list, state_indices, initial_state, final_state, checkpoint_indices,
                        checkpoint_every: int) -> tuple[list, torch.Tensor]:
    """(entries, slots) of the checkpoints a call writes (``pools.checkpoint_entries``); they need pools."""
    if state_indices is None or state_indices.dim() != 1:
        raise ValueError(f"checkpoint_indices needs state_indices [N] (the pool it writes into), got "
                         f"{None if state_indices is None else tuple(state_indices.shape)}")
    pool = final_state if final_state is not None else initial_state
    if pool is None:
        raise ValueError("state_indices needs initial_state or final_state (the pools it indexes), got neither")
    return pools.checkpoint_entries(checkpoint_indices, checkpoint_every, lengths, pool.shape[0])


def _recorded(result: tuple) -> tuple:
    """(out, final state, checkpoint states) of ``_loop`` / ``_chunked``'s four results."""
    out, S, _, recorded = result
    return out, S, recorded


def _stacked(recorded: list, S: torch.Tensor) -> torch.Tensor:
    """The checkpoint states recorded [E, H, V, K] (E may be 0)."""
    return torch.stack(recorded) if recorded else S.new_zeros(0, *S.shape[1:])


def _loop(p: _Problem, token_states: int = 0, checkpoints: list | None = None) -> tuple:
    """reference_loop's token loop: (out [B, T, H, V], S after each sequence's last token [N, H, V, K], with
    ``token_states`` = L > 0 the state after each of the first L tokens [N, L, H, V, K] (a sequence's state stays
    as it is past its last token), else None, and with ``checkpoints`` [(n, t), ...] (0 < t <= length of n) the
    state of sequence n after its first t tokens for each [E, H, V, K], else None), float64."""
    B, T, H, K, V = p.shape
    out = torch.zeros(B * T, H, V, dtype=_F64, device=p.device)
    S = p.state
    tokens = (torch.zeros(S.shape[0], token_states, *S.shape[1:], dtype=_F64, device=p.device) if token_states
              else None)
    recorded = None if checkpoints is None else [None] * len(checkpoints)
    recorded_at = {}  # token position -> [(checkpoint, sequence)]: the checkpoints taken after that token
    for e, (n, t) in enumerate(checkpoints or ()):
        recorded_at.setdefault(t - 1, []).append((e, n))
    L = max(p.lengths, default=0)
    block = max(1, _BLOCK_TOKEN_HEADS // max(1, len(p.lengths) * H))
    for t0 in range(0, L, block):
        t1 = min(L, t0 + block)
        x = p.gather(t0, t1)
        o = torch.empty(S.shape[0], H, t1 - t0, V, dtype=_F64, device=p.device)
        for t in range(t1 - t0):
            kt = x["k"][:, :, t]  # [N, H, K]
            S = S * torch.exp(x["lam"][:, :, t]).unsqueeze(-2)  # decay each column k of S
            r = x["v"][:, :, t] - (S @ kt.unsqueeze(-1)).squeeze(-1)  # [N, H, V]
            S = S + x["beta"][:, :, t, None, None] * r.unsqueeze(-1) * kt.unsqueeze(-2)
            o[:, :, t] = (S @ (p.scale * x["q"][:, :, t]).unsqueeze(-1)).squeeze(-1)
            if t0 + t < token_states:
                tokens[:, t0 + t] = S
            for e, n in recorded_at.get(t0 + t, ()):
                recorded[e] = S[n].clone()
        p.scatter(out, t0, t1, o)
    if tokens is not None and L < token_states:  # (tokens past every sequence's end: the state as it stays)
        tokens[:, L:] = S.unsqueeze(1)
    return out.reshape(B, T, H, V), S, tokens, None if recorded is None else _stacked(recorded, S)


_SAFE_DECAY = 600.0  # a chunk's decay e^Γ down to e^-600 keeps e^{±G} normal in float64 (limit e^±708)
_ANCHOR_BLOCK = 4  # rows of the blocks of _anchored_products


def _anchored_products(k: torch.Tensor, q: torch.Tensor, G: torch.Tensor, exp) -> tuple[torch.Tensor, torch.Tensor]:
    """A[i, j] = Σ_c k_i k_j e^(G_i − G_j) and M[i, j] = Σ_c q_i k_j e^(G_i − G_j) for j <= i (0 above), k, q, G
    [..., C, K] float64, without a factor e^−G (which overflows once a chunk decays past e^−708): every exponent
    is G_i − G_j <= 0 (G falls along the chunk). Pairs inside a block of rows: the coefficients themselves; pairs
    across blocks: split at an anchor row e (the last row of j's block), e^(G_i − G_e)·e^(G_e − G_j)."""
    C = G.shape[-2]
    A = G.new_zeros(*G.shape[:-1], C)
    M = torch.zeros_like(A)
    for j0 in range(0, C, _ANCHOR_BLOCK):
        j1 = min(C, j0 + _ANCHOR_BLOCK)
        tri = torch.ones(j1 - j0, j1 - j0, dtype=torch.bool, device=G.device).tril().unsqueeze(-1)
        Gb = G[..., j0:j1, :]
        E = exp(torch.where(tri, Gb.unsqueeze(-2) - Gb.unsqueeze(-3), -math.inf))  # [..., i, j, K]
        kb = k[..., j0:j1, :]
        A[..., j0:j1, j0:j1] = torch.einsum("...ik,...jk,...ijk->...ij", kb, kb, E)
        M[..., j0:j1, j0:j1] = torch.einsum("...ik,...jk,...ijk->...ij", q[..., j0:j1, :], kb, E)
        if j1 < C:
            anchor = G[..., j1 - 1 : j1, :]
            left = exp(G[..., j1:, :] - anchor)
            right = (kb * exp(anchor - Gb)).transpose(-1, -2)
            A[..., j1:, j0:j1] = (k[..., j1:, :] * left) @ right
            M[..., j1:, j0:j1] = (q[..., j1:, :] * left) @ right
    return A, M


def reference_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                      lower_bound: float | None, initial_state: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, *, chunk: int = 64, base2: bool = False,
                      state_indices: torch.Tensor | None = None, final_state: torch.Tensor | None = None,
                      gate_kind: str = "lower_bound", beta_scale: float = 1.0,
                      checkpoint_indices: torch.Tensor | None = None,
                      checkpoint_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function as ``reference_loop``, by the chunked algebra of docs/SPEC.md §2 in float64.

    Per chunk of C tokens with G = cumsum of the gates inside the chunk and Γ its last row:
    Kd = k̂⊙e^G, Qd = scale·q̂⊙e^G, Ki = k̂⊙e^-G, Kr = Ki⊙e^Γ, A = β·strict_lower(Kd Kiᵀ),
    M = lower_incl_diag(Qd Kiᵀ), U = (I + A)⁻¹ (β⊙(V − Kd Sᵀ)), O = Qd Sᵀ + M U, S ← S⊙e^Γ + Uᵀ Kr.
    Everything but the S recurrence is computed for a block of chunks at once; only the chunk loop is sequential.
    Where a chunk decays past e^-600 (the softplus gate is unbounded below), e^-G would overflow: that block forms
    Kr = k̂⊙e^(Γ−G) and A, M from pairwise coefficients e^(G_i − G_j) <= 1 instead (``_anchored_products``).
    A checkpoint inside a chunk, after its row i, is S⊙e^(G_i) + U[:i+1]ᵀ (k̂[:i+1]⊙e^(G_i − G[:i+1])): the chunk's
    update cut at row i (U's rows depend only on the rows before them).

    Arguments as ``reference_loop`` (``state_indices``, ``final_state``, ``gate_kind``, ``beta_scale``,
    ``checkpoint_indices``, ``checkpoint_every`` too), plus:

    | arg | type | meaning |
    |---|---|---|
    | chunk | int | C, tokens per chunk, 1..128 |
    | base2 | bool | compute the gates in base 2 (γ = λ·log2 e, 2^G) as the kernel does; same result |

    Returns (out float64 [B, T, HV, V], final_state float64 [N, HV, V, K]) on the inputs' device.
    """
    if not 1 <= chunk <= 128:
        raise ValueError(f"chunk must be in [1, 128] (e^{{±G}} must not overflow float64), got {chunk=}")
    problem = lambda initial: _problem(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial,  # noqa: E731
                                       cu_seqlens, gate_kind, beta_scale)
    if checkpoint_indices is not None:
        entries, slots = _checkpoint_entries(problem(None).lengths, state_indices, initial_state, final_state,
                                             checkpoint_indices, checkpoint_every)
        return pools.run_pooled(lambda initial: _recorded(_chunked(problem(initial), chunk, base2, entries)),
                                initial_state, final_state, state_indices, slots)
    if state_indices is not None:
        return pools.run_pooled(lambda initial: _chunked(problem(initial), chunk, base2)[:2], initial_state,
                                final_state, state_indices)
    return _chunked(problem(initial_state), chunk, base2)[:2]


def _chunked(p: _Problem, chunk: int, base2: bool, checkpoints: list | None = None) -> tuple:
    """reference_chunked's chunk loop: (out [B, T, H, V], S after each sequence's last token [N, H, V, K], None,
    and with ``checkpoints`` [(n, t), ...] (0 < t <= length of n) the state of sequence n after its first t tokens
    for each [E, H, V, K], else None), float64 (the results of ``_loop``, without per-token states)."""
    B, T, H, K, V = p.shape
    N = len(p.lengths)
    C = chunk
    exp = torch.exp2 if base2 else torch.exp
    out = torch.zeros(B * T, H, V, dtype=_F64, device=p.device)
    S = p.state
    L = -(-max(p.lengths, default=0) // C) * C
    block = max(1, _BLOCK_TOKEN_HEADS // max(1, N * H * C)) * C
    recorded = None if checkpoints is None else [None] * len(checkpoints)
    recorded_in = {}  # chunk -> [(checkpoint, sequence, row)]: the checkpoints taken after that row of that chunk
    for e, (n, t) in enumerate(checkpoints or ()):
        recorded_in.setdefault((t - 1) // C, []).append((e, n, (t - 1) % C))
    eye = torch.eye(C, dtype=_F64, device=p.device)
    lower = torch.ones(C, C, dtype=torch.bool, device=p.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    for t0 in range(0, L, block):
        t1 = min(L, t0 + block)
        nc = (t1 - t0) // C
        x = {name: t.unflatten(2, (nc, C)) for name, t in p.gather(t0, t1).items()}  # [N, H, nc, C, ...]
        lam = x["lam"] * math.log2(math.e) if base2 else x["lam"]
        G = lam.cumsum(-2)
        Gam = G[..., -1, :]  # [N, H, nc, K]
        Kd = x["k"] * exp(G)
        Qd = p.scale * x["q"] * exp(G)
        beta_ = x["beta"].unsqueeze(-1)  # [N, H, nc, C, 1]
        # (one host read per block of chunks: on a GPU a synchronisation, as the reference may)
        if Gam.numel() == 0 or float(Gam.min()) * (math.log(2.0) if base2 else 1.0) >= -_SAFE_DECAY:
            Ki = x["k"] * exp(-G)
            Kr = Ki * exp(Gam).unsqueeze(-2)
            A = beta_ * torch.where(strict, Kd @ Ki.transpose(-1, -2), 0.0)
            M = torch.where(lower, Qd @ Ki.transpose(-1, -2), 0.0)
        else:  # a chunk decays past e^-600 (the softplus gate is unbounded): e^-G would overflow
            Kr = x["k"] * exp(Gam.unsqueeze(-2) - G)
            A, M = _anchored_products(x["k"], p.scale * x["q"], G, exp)
            A = beta_ * torch.where(strict, A, 0.0)
        INV = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        decay = exp(Gam).unsqueeze(-2)  # [N, H, nc, 1, K]
        O = torch.empty(N, H, nc, C, V, dtype=_F64, device=p.device)
        for j in range(nc):
            St = S.transpose(-1, -2)  # [N, H, K, V]
            U = INV[:, :, j] @ (beta_[:, :, j] * (x["v"][:, :, j] - Kd[:, :, j] @ St))
            O[:, :, j] = Qd[:, :, j] @ St + M[:, :, j] @ U
            S_before = S
            S = S * decay[:, :, j] + U.transpose(-1, -2) @ Kr[:, :, j]
            for e, n, i in recorded_in.get(t0 // C + j, ()):
                if i == C - 1:  # the chunk's end: the state itself
                    recorded[e] = S[n].clone()
                else:
                    G_i = G[n, :, j, i]  # [H, K]
                    cut = x["k"][n, :, j, : i + 1] * exp(G_i.unsqueeze(-2) - G[n, :, j, : i + 1])  # [H, i+1, K]
                    recorded[e] = S_before[n] * exp(G_i).unsqueeze(-2) + U[n, :, : i + 1].transpose(-1, -2) @ cut
        p.scatter(out, t0, t1, O.flatten(2, 3))
    return out.reshape(B, T, H, V), S, None, None if recorded is None else _stacked(recorded, S)
