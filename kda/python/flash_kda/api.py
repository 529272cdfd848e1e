"""The public forward call ``flash_kda.fwd`` and the package's other entry points.

CUDA tensors go to the sm_90a kernel in ``flash_kda._C``; CPU tensors go to the fp32 chunked PyTorch path
(``flash_kda.numerics.cpu_forward``), so the same call works on any machine. The work is done in
``validation`` (argument checks), ``planning`` (the plan and its workspace size) and ``launch`` (workspace and
error word, the extension call); ``ops`` is the operator torch.compile traces.
"""

from __future__ import annotations

import numbers

import torch

from flash_kda.launch import last_error, release_workspace, reserve_workspace
from flash_kda.launch import run as _run  # (a global, not launch.run: one attribute lookup less per call)
from flash_kda.planning import plan, workspace_bytes
from flash_kda.pools import CHECKPOINT_EVERY_CAP
from flash_kda.validation import HEAD_DIM, LOWER_BOUND_RANGE, check_cu_seqlens, refuse_grad

__all__ = ["fwd", "check_cu_seqlens", "last_error", "workspace_bytes", "reserve_workspace", "release_workspace", "plan",
           "HEAD_DIM", "LOWER_BOUND_RANGE"]


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
        out: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None,
        initial_state: torch.Tensor | None = None, final_state: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None,
        state_indices: torch.Tensor | None = None, gate: str = "lower_bound", allow_neg_eigval: bool = False,
        num_accepted_tokens: torch.Tensor | None = None, checkpoint_indices: torch.Tensor | None = None,
        checkpoint_every: int = 0) -> None:
    """Kimi Delta Attention forward: writes the output into ``out`` and the last state into ``final_state`` (with
    per-token ``state_indices``, the state after each of a sequence's first L tokens).

    Per sequence n and value head h (reading key head h // G, where HV = G·H: grouped value heads; G = 1 is plain
    KDA), with q̂ = q/sqrt(Σq² + 1e-6), k̂ likewise, a = exp(A_log[h]) (1 without A_log), x_t = g_t + dt_bias[h]
    (g_t without dt_bias), the per-channel decay α_t = exp(λ_t) with

        gate="lower_bound":  λ_t = lower_bound · sigmoid(a · x_t)        (in (lower_bound, 0))
        gate="softplus":     λ_t = −a · softplus(x_t)                     (fla's default; lower_bound unused)

    (the kernels take λ_t below −128 ln 2 as −128 ln 2: a factor 2^−128 or smaller is zero in their fp32
    arithmetic either way, and the state is erased as the math says),

    and β_t = sigmoid(beta_t) (2·sigmoid(beta_t) with ``allow_neg_eigval``: the update's eigenvalue 1 − β_t then
    ranges over (−1, 1)), the state S ∈ R^{V×K} (zeros or ``initial_state[n, h]``) evolves token by token as

        S ← S · Diag(α_t);   S ← S + β_t (v_t − S k̂_t) k̂_tᵀ;   out_t = S (scale · q̂_t)

    and ``final_state[n, h]`` receives S after the sequence's last token (with per-token ``state_indices``
    [N, L]: S after each token t < min(L, length) goes to pool slot ``state_indices[n, t]``, and S starts from
    slot ``state_indices[n, num_accepted_tokens[n] − 1]``; below). Without ``cu_seqlens`` each of the
    B rows is one sequence (N = B); with it, B must be 1 and sequence n is tokens cu[n] .. cu[n+1]-1 (it may be
    empty, and T = 0 is allowed); tokens from cu[N] on are padding (cu[N] < T: a batch padded to a CUDA graph's
    size), in no sequence, and their out rows are not written. States never cross sequence boundaries.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | q, k | bf16 | [B, T, H, K] | queries, keys on the H key heads (L2-normalised inside) |
    | v | bf16 | [B, T, HV, V] | values on HV = G·H value heads (G ≥ 1; G = 1: one value head per key head) |
    | g | bf16 | [B, T, HV, K] | gate before activation |
    | beta | bf16 | [B, T, HV] | beta logits (sigmoid inside) |
    | scale | float | — | output scale, finite (usually K**-0.5) |
    | out | bf16 | [B, T, HV, V] | output buffer, written in place |
    | A_log | None / fp32 / bf16 / fp16 | [HV] | log-gate parameter (read as if widened to fp32); None: exp(A_log) = 1 |
    | dt_bias | None / fp32 / bf16 / fp16 | [HV, K] (or flat [HV*K]) | gate bias (likewise); None: 0 |
    | lower_bound | float / None | — | gate="lower_bound": the gate's lower bound, in [-5, 0]; gate="softplus": unused (None or a finite number) |
    | initial_state | None / bf16 / fp32 | [N, HV, V, K] or pool [P, HV, V, K] | initial state (None: zeros); never modified |
    | final_state | None / bf16 / fp32 | [N, HV, V, K] or pool [P, HV, V, K] | output buffer for the final state (may be initial_state) |
    | cu_seqlens | int64 / int32 | [N + 1] | optional sequence boundaries; requires B = 1; may be on the CPU |
    | workspace | uint8 | [≥ workspace_bytes(v, cu_seqlens, state_indices, gate=gate, num_accepted_tokens=num_accepted_tokens)] | optional CUDA scratch (keyword only) |
    | state_indices | int64 / int32 | [N] or [N, L] | optional pool slot of each sequence, or of each of its first L tokens (per-token states, below; L ≥ 1) (keyword only); may be on the CPU |
    | gate | str | — | "lower_bound" (default) or "softplus": the decay's activation, above (keyword only) |
    | allow_neg_eigval | bool | — | β = 2·sigmoid(beta) instead of sigmoid(beta) (keyword only; default False) |
    | num_accepted_tokens | None / int64 / int32 | [N] | with state_indices [N, L] only: a_n, sequence n starts from slot state_indices[n, a_n − 1] (keyword only; None: a_n = 1); may be on the CPU |
    | checkpoint_indices | None / int64 / int32 | [N, M] | with pooled states (state_indices [N]): the pool slot of the state after the first (m + 1)·C tokens of sequence n (keyword only; below); on q's device |
    | checkpoint_every | int (or a NumPy integer) | — | C, a multiple of 16, with checkpoint_indices (keyword only; default 0: none) |

    Under ``torch.compile`` pass ``scale``, ``lower_bound`` and ``checkpoint_every`` as Python numbers where they are
    arguments of the compiled function: torch.compile traces a NumPy scalar argument as data (an np.float64 is
    taken as its value; an np.float32 or NumPy integer becomes a symbol the operator cannot take).

    K = V = 128. All tensors are contiguous and on one device. The two states may differ in dtype (fla passes a
    bf16 initial state with an fp32 final state); ``final_state`` may be the ``initial_state`` tensor itself.
    Only ``out`` and ``final_state`` are written. Returns None. There is no backward: with grad mode on
    (``torch.is_grad_enabled()``), a tensor argument that requires grad raises RuntimeError naming it (it would get
    no gradient); model parameters are fine under ``torch.no_grad()`` or ``torch.inference_mode()``.

    Pooled states (``state_indices``, as serving engines keep them): the state tensors are pools [P, HV, V, K]
    (P >= 1, independent of N; both of one P when both are given) and sequence n starts from slot
    ``state_indices[n]`` and writes its final state there; slots no sequence names are left untouched, so
    ``final_state`` may be the ``initial_state`` pool itself (in place). A negative index means no slot: the
    sequence starts from zeros and writes nothing (the padding rows of a CUDA-graph batch). Two sequences naming
    one slot with ``final_state`` given leave an unspecified state there. ``state_indices`` needs a pool to index
    (``initial_state`` or ``final_state``; refused otherwise). On the CPU its contents are checked (every index < P,
    no slot named twice when written) and copied into the workspace like a CPU ``cu_seqlens``; a CUDA
    ``state_indices`` is read by the kernels at every launch (graph replays see new contents), an index >= P
    is skipped like a negative one, never touching memory outside the pool, and ``flash_kda.last_error()``
    names it.

    Per-token states (speculative decoding, fla's and vLLM's contract): with ``state_indices`` [N, L] (L >= 1),
    sequence n starts from slot ``state_indices[n, a_n − 1]``, a_n = ``num_accepted_tokens[n]`` (1 when it is
    None), and the state after its token t is written to slot ``state_indices[n, t]`` for every
    t < min(L, its length); no other state is written (an empty sequence writes none). A negative slot means none:
    start from zeros, or write nothing for that token. The per-token states are those of the token-by-token
    recurrence, the decode kernel's arithmetic, whatever the plan that computes ``out``. The pools are required as
    for [N] indices, and ``final_state`` too (the pool written; pass ``initial_state`` itself to write in place);
    ``num_accepted_tokens`` is refused without [N, L] indices. Two written entries naming one slot leave an
    unspecified state there, and so, in place, does a starting slot that another sequence writes (for the sequence
    that reads it). On the CPU the contents are checked (every index < P; no slot written twice, and in place no
    starting slot written by another sequence, where the host knows which entries are written: fixed-length
    batches or a CPU ``cu_seqlens``; every a_n in [1, L])
    and copied into the workspace like ``state_indices`` [N]; a CUDA ``num_accepted_tokens`` is read by the
    kernels, where an a_n outside [1, L] means no starting slot (zeros) and ``flash_kda.last_error()`` reports it.

    Prefix-cache checkpoints (``checkpoint_indices`` [N, M] with ``checkpoint_every`` = C, pooled states only):
    the state after the first (m + 1)·C tokens of sequence n is written to pool slot ``checkpoint_indices[n, m]``
    of ``final_state`` for every m < M with (m + 1)·C <= its length, in the pool's dtype. Each slot is written at
    most once per call: a slot named by two written checkpoints, or by a written checkpoint and another sequence's
    final state, is left unspecified (the kernels write them from different CTAs in no fixed order). A checkpoint
    that names its own sequence's final slot is not written: the slot keeps the final state. Positions count from the
    sequence's first token in this call, so a call that continues a sequence from a checkpoint starts at a multiple
    of C. A negative entry writes nothing; an entry >= P writes nothing, and ``flash_kda.last_error()`` names it (a
    CPU ``checkpoint_indices``, on the CPU path, is checked before the call, slots written twice included). Every
    plan writes them, from the state its own recurrence holds at that token (docs/NUMERICS.md, "Checkpoints"); ``out``
    and the final states are those of the same call without checkpoints, bit for bit.

    CUDA: needs compute capability 9.0 (sm_90a). The call never synchronises with the host and allocates no
    device memory once its workspace is large enough, so it can be captured in a CUDA graph. The contents of a
    CUDA ``cu_seqlens`` are therefore not checked on the host: the kernel clamps malformed boundaries into
    [0, T] (it never reads or writes out of bounds, but the result of a malformed ``cu_seqlens`` is
    unspecified) and records the first bad boundary, which ``flash_kda.last_error()`` reports. To have them
    checked before the call: pass ``cu_seqlens`` on the CPU (validated there for free, then copied
    into the workspace asynchronously; not inside graph capture), set ``FLASH_KDA_CHECK_CU_SEQLENS=1`` (every
    call validates on the host, which synchronises), or call ``flash_kda.check_cu_seqlens``. The errors name
    ``cu_seqlens`` and the first bad index. Without ``workspace`` the call uses a cached
    per-(device, stream) buffer that grows when a larger problem is first seen; that growth is an allocation, so
    before graph capture pass ``workspace`` or size the cache with ``flash_kda.reserve_workspace``.

    CPU: the fp32 chunked PyTorch path computes the same function (slow, for testing and portability); the
    contents of ``cu_seqlens`` are validated there.
    """
    if type(checkpoint_every) is not int and isinstance(checkpoint_every, numbers.Integral) and not isinstance(
            checkpoint_every, bool):
        checkpoint_every = int(checkpoint_every)  # a NumPy integer (as scale takes NumPy numbers)
    if type(checkpoint_every) is int and checkpoint_every > CHECKPOINT_EVERY_CAP and checkpoint_every % 16 == 0:
        checkpoint_every = CHECKPOINT_EVERY_CAP  # no sequence reaches either: the same call, and an int64 for the op
    if torch.compiler.is_compiling():
        # Traced as one opaque operator (flash_kda/ops.py): the body below reads data pointers, which fake tensors
        # do not have, and would break the graph.
        from flash_kda import ops  # noqa: PLC0415 -- registers the operator on first use

        # NumPy scalars as Python numbers, as eager calls take them (the operator's schema wants float and int;
        # torch.compile traces a NumPy scalar argument as an array: float() of an np.float64 is its value, of an
        # np.float32 or int() of a NumPy integer a data-dependent symbol, refused by the operator's schema).
        if type(scale).__module__ == "numpy":
            scale = float(scale)
        if type(lower_bound).__module__ == "numpy":
            lower_bound = float(lower_bound)
        if type(checkpoint_every).__module__ == "numpy":
            checkpoint_every = int(checkpoint_every)

        # The operator runs with grad mode off (its fake implementation too): the caller's grad mode is seen here.
        refuse_grad(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state)
        return ops.fwd_op(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                          cu_seqlens, workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
                          checkpoint_indices, checkpoint_every)
    return _run(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
                workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens, checkpoint_indices,
                checkpoint_every)
