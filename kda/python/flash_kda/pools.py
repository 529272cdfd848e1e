"""Pooled states on the host side: the gather and scatter that give ``state_indices`` its meaning.

With ``state_indices`` [N], ``initial_state`` and ``final_state`` are pools [P, H, V, K] and sequence n uses slot
``state_indices[n]``; a negative index (a padding row), or one past the pool, means no slot: start from zeros and
write nothing. The CUDA kernels follow these rules in place (``state_slot``, kda/csrc/state_slots.cuh); the CPU
path, the numerics twin and the float64 references run on dense [N, H, V, K] states and use these helpers around
that: ``gather`` the initial states of the sequences' slots, run, ``scatter`` the final states back.

Per-token states (speculative decoding, fla's and vLLM's contract): with ``state_indices`` [N, L] the state after
token t of sequence n goes to slot ``state_indices[n, t]`` for t < min(L, length), and sequence n starts from slot
``state_indices[n, a_n - 1]`` with a_n = ``num_accepted_tokens[n]`` (1 without it); an a_n outside [1, L] means no
starting slot (zeros). No final state is written apart from these.

Checkpoints (prefix caching): with ``checkpoint_indices`` [N, M] and ``checkpoint_every`` = C beside ``state_indices``
[N], the state of sequence n after its first (m+1)·C tokens goes to slot ``checkpoint_indices[n, m]`` for every m
with (m+1)·C <= its length; a negative entry, or one past the pool, writes nothing. Checkpoints are written before
the final states here, so a sequence's final state wins where it shares a slot with one of its checkpoints, as in
``fwd`` (a slot shared across sequences is unspecified there on CUDA, and its CPU path refuses it).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["named", "gather", "scatter", "copy_named_slots", "run_pooled", "start_slots", "run_pooled_tokens",
           "checkpoint_entries"]


def named(state_indices: torch.Tensor, pool_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, slots): the sequences n (int64, on the indices' device) that name a slot of a pool of
    ``pool_slots`` (0 <= state_indices[n] < pool_slots), and those slots. Reads the indices (a CUDA tensor
    synchronises)."""
    indices = state_indices.to(torch.int64)
    sequences = torch.nonzero((indices >= 0) & (indices < pool_slots)).flatten()
    return sequences, indices[sequences]


def gather(pool: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """The states [N, H, V, K] of the sequences' slots (pool's dtype and device; zeros where there is no slot)."""
    sequences, slots = named(state_indices.to(pool.device), pool.shape[0])
    dense = pool.new_zeros((state_indices.shape[0], *pool.shape[1:]))
    dense[sequences] = pool[slots]
    return dense


def scatter(states: torch.Tensor, state_indices: torch.Tensor, pool: torch.Tensor) -> None:
    """Writes states[n] [N, H, V, K] (cast to pool's dtype) into the pool slot of every sequence that names one;
    no other slot changes. Two sequences naming one slot leave either's state there (unspecified)."""
    sequences, slots = named(state_indices.to(pool.device), pool.shape[0])
    pool[slots] = states.to(pool.device)[sequences].to(pool.dtype)


def copy_named_slots(final_pool: torch.Tensor, initial_pool: Optional[torch.Tensor],
                     state_indices: torch.Tensor) -> None:
    """What a call without tokens (B·T = 0 or H = 0) does to the pools: every slot some sequence names receives
    its initial state (zeros without an initial pool); the others stay as they are.

    No host synchronisation (the mask is built on the indices' device), so CUDA indices stay on the device; and
    since the source is per slot, not per sequence, duplicate indices are harmless here."""
    P = final_pool.shape[0]
    indices = state_indices.to(device=final_pool.device, dtype=torch.int64)
    named_mask = torch.zeros(P + 1, dtype=torch.bool, device=final_pool.device)
    # Indices without a slot (negative, past the pool) land on the extra entry P, which is dropped.
    named_mask.index_fill_(0, torch.where((indices >= 0) & (indices < P), indices, P), True)
    source = (initial_pool.to(final_pool.dtype) if initial_pool is not None
              else torch.zeros((), dtype=final_pool.dtype, device=final_pool.device))
    final_pool.copy_(torch.where(named_mask[:P].view(P, 1, 1, 1), source, final_pool))


def run_pooled(forward: Callable[[Optional[torch.Tensor]], tuple],
               initial_state: Optional[torch.Tensor], final_state: Optional[torch.Tensor],
               state_indices: torch.Tensor,
               checkpoint_slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense forward ``forward(initial [N, H, V, K] or None) -> (out, final [N, H, V, K])`` run on pools:
    returns (out, final pool) where the final pool is ``final_state`` as it was before (``initial_state`` when
    None: in place), in the forward's state dtype, with the named slots replaced by their sequences' final states.

    With ``checkpoint_slots`` [E] (``checkpoint_entries``) the forward returns (out, final, checkpoint states
    [E, H, V, K]) and checkpoint e goes to slot ``checkpoint_slots[e]`` first, then the final states (a final state
    wins on a shared slot).

    The references and the twin take ``state_indices`` through this, so that they describe exactly what
    ``flash_kda.fwd`` leaves in the pool: untouched slots included."""
    base = final_state if final_state is not None else initial_state
    if base is None:
        raise ValueError("state_indices needs initial_state or final_state (the pools it indexes), got neither")
    dense_initial = gather(initial_state, state_indices) if initial_state is not None else None
    if checkpoint_slots is None:
        out, dense_final = forward(dense_initial)
    else:
        out, dense_final, checkpoints = forward(dense_initial)
    pool = base.to(device=dense_final.device, dtype=dense_final.dtype, copy=True)
    if checkpoint_slots is not None:
        pool[checkpoint_slots.to(pool.device)] = checkpoints.to(device=pool.device, dtype=pool.dtype)
    scatter(dense_final, state_indices, pool)
    return out, pool


def start_slots(state_indices: torch.Tensor, num_accepted_tokens: Optional[torch.Tensor]) -> torch.Tensor:
    """The starting slot of every sequence [N] (int64, on the indices' device) for per-token ``state_indices``
    [N, L]: ``state_indices[n, a_n - 1]``, a_n = ``num_accepted_tokens[n]`` (1 when None); -1 where a_n is outside
    [1, L] (no starting slot)."""
    indices = state_indices.to(torch.int64)
    N, L = indices.shape
    if num_accepted_tokens is None:
        accepted = torch.ones(N, dtype=torch.int64, device=indices.device)
    else:
        accepted = num_accepted_tokens.to(device=indices.device, dtype=torch.int64)
    valid = (accepted >= 1) & (accepted <= L)
    column = torch.where(valid, accepted - 1, 0)
    chosen = indices.gather(1, column.unsqueeze(1)).squeeze(1)
    return torch.where(valid, chosen, -1)


def run_pooled_tokens(forward: Callable[[Optional[torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
                      initial_state: Optional[torch.Tensor], final_state: Optional[torch.Tensor],
                      state_indices: torch.Tensor, num_accepted_tokens: Optional[torch.Tensor],
                      lengths: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense forward ``forward(initial [N, H, V, K] or None) -> (out, token_states [N, L, H, V, K])`` (the state
    after each of a sequence's first L tokens) run on pools with per-token ``state_indices`` [N, L]: returns (out,
    final pool), the pool being ``final_state`` as it was before (``initial_state`` when None: in place), in the
    forward's state dtype, with slot ``state_indices[n, t]`` replaced by the state after token t for every
    t < min(L, lengths[n]) whose slot is in the pool. Two writes of one slot leave either state (unspecified)."""
    base = final_state if final_state is not None else initial_state
    if base is None:
        raise ValueError("state_indices needs initial_state or final_state (the pools it indexes), got neither")
    starts = start_slots(state_indices, num_accepted_tokens)
    dense_initial = gather(initial_state, starts) if initial_state is not None else None
    out, token_states = forward(dense_initial)
    pool = base.to(device=token_states.device, dtype=token_states.dtype, copy=True)
    indices = state_indices.to(device=pool.device, dtype=torch.int64)
    N, L = indices.shape
    length = torch.tensor(lengths, dtype=torch.int64, device=pool.device).view(N, 1)
    step = torch.arange(L, device=pool.device).view(1, L)
    written = (step < length) & (indices >= 0) & (indices < pool.shape[0])
    pool[indices[written]] = token_states.to(pool.device)[written].to(pool.dtype)
    return out, pool


def checkpoint_entries(checkpoint_indices: torch.Tensor, checkpoint_every: int, lengths,
                       pool_slots: int) -> tuple[list, torch.Tensor]:
    """(entries, slots): the checkpoints a call writes, in the row-major order of ``checkpoint_indices`` [N, M].
    Entry (n, (m+1)·C), C = ``checkpoint_every``: the state of sequence n after its first (m+1)·C tokens, for every
    m with (m+1)·C <= lengths[n] whose slot ``checkpoint_indices[n, m]`` is in a pool of ``pool_slots`` (0 <= slot
    < P); ``slots`` (int64 [E], on the CPU) are those slots. Reads the indices (a CUDA tensor synchronises).

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | checkpoint_indices | int64 / int32 | [N, M] | slot of sequence n's checkpoint m; negative: none |
    | checkpoint_every | int | — | C, tokens between checkpoints |
    | lengths | int64 / list | [N] | the sequences' lengths |
    | pool_slots | int | — | P, the pool's first dimension |
    """
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 16 or (
            checkpoint_every % 16):
        raise ValueError(f"checkpoint_every must be a positive multiple of 16, got {checkpoint_every=}")
    lengths = torch.as_tensor(lengths, dtype=torch.int64).to("cpu").flatten()
    if checkpoint_indices.dim() != 2 or checkpoint_indices.shape[0] != lengths.numel():
        raise ValueError(f"checkpoint_indices must be [N, M] with N = {lengths.numel()} (the sequences), got "
                         f"checkpoint_indices.shape={tuple(checkpoint_indices.shape)}")
    indices = checkpoint_indices.detach().to("cpu", torch.int64)
    N, M = indices.shape
    written = checkpoints_reached(lengths, checkpoint_every, M) & (indices >= 0) & (indices < pool_slots)
    sequences, columns = torch.nonzero(written, as_tuple=True)
    # (Python ints: a written checkpoint's (m+1)·C is at most its sequence's length.)
    entries = [(n, (m + 1) * checkpoint_every) for n, m in zip(sequences.tolist(), columns.tolist())]
    return entries, indices[written]


# A checkpoint_every past any sequence's length (2^62 tokens, a multiple of 16): a larger C is counted as this one,
# which reaches no checkpoint either and keeps every count in int64.
CHECKPOINT_EVERY_CAP = 2**62


def checkpoints_reached(lengths, checkpoint_every: int, columns: int) -> torch.Tensor:
    """[N, M] bool on the CPU: whether checkpoint m of sequence n falls within it, (m+1)·C <= lengths[n], for
    C = ``checkpoint_every`` > 0 and M = ``columns``. Counted as m < lengths[n] // C, so that no product (m+1)·C is
    formed: with a C near 2^63 it would wrap in int64 and name a checkpoint the sequence never reaches."""
    length = torch.as_tensor(lengths, dtype=torch.int64).to("cpu").view(-1, 1)
    reached = length // min(int(checkpoint_every), CHECKPOINT_EVERY_CAP)
    return torch.arange(columns, dtype=torch.int64).view(1, columns) < reached
