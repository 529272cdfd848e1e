"""Running a call: validation, then the CPU path or the CUDA kernel with its workspace and error word.

``run`` is ``flash_kda.fwd``'s body outside tracing (``torch.ops.flash_kda.fwd`` runs it too). On CUDA it takes
the plan (``planning``), a workspace (the caller's, or one cached per device and stream) and, for a CUDA
``cu_seqlens``, the device's error word (``last_error``), and enqueues the kernels through the extension.
"""

from __future__ import annotations

import numbers
import threading

import torch

from flash_kda import _ext, pools
from flash_kda.planning import host_copies, plan_for, sm_count_of
from flash_kda.validation import (
    GATE_CODES,
    HEAD_DIM,
    PARAM_TYPES,
    check_checkpoint_indices,
    check_cu_seqlens,
    check_num_accepted_tokens,
    check_state_indices,
    check_token_state_reads,
    checked_cu_seqlens,
    cu_seqlens_on_host,
    pool_slots,
    sequence_lengths,
    validate,
)

__all__ = ["run", "run_cpu", "last_error", "reserve_workspace", "release_workspace"]

# C / 16 reaches the kernels as an int; a larger C than any sequence could reach means no checkpoint either way.
_MAX_CHECKPOINT_CHUNKS = 1 << 30


def run(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
        workspace, state_indices=None, gate="lower_bound", allow_neg_eigval=False, num_accepted_tokens=None,
        checkpoint_indices=None, checkpoint_every=0, cached_workspace: bool = True) -> None:
    """``fwd`` outside tracing (the same arguments, all given): validate, then run the CUDA kernel or the CPU path.

    Without ``workspace``, a CUDA call uses the per-stream cache, or with ``cached_workspace=False`` a temporary
    of its own (the operator's choice, ops.py). H below is the value heads (v's); q and k have H // G key heads."""
    B, T, H, N, key_heads = validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                                     final_state, cu_seqlens, workspace, state_indices, gate, allow_neg_eigval,
                                     num_accepted_tokens, checkpoint_indices, checkpoint_every, concrete=True)
    K = HEAD_DIM
    cu_on_host = cu_seqlens is not None and cu_seqlens_on_host(q, cu_seqlens)
    if cu_seqlens is not None and (cu_seqlens.device.type == "cpu" or checked_cu_seqlens()):
        check_cu_seqlens(cu_seqlens, T)  # on the host: free there; for a CUDA tensor (checked mode) a sync
        if q.device.type == "cpu" and T:
            end = int(cu_seqlens[-1])
            if end < T:
                # Padding tokens past the last sequence (a CUDA-graph batch): the CPU path runs the call without
                # them (B = 1, so the prefixes are contiguous views); their out rows are not written. A CUDA call
                # keeps all T tokens whether cu_seqlens is on the host or the device: its plan and kernel counts
                # them (the same bits either way), and the kernels skip the padding rows.
                q, k, v, g, beta, out = (t[:, :end] for t in (q, k, v, g, beta, out))
                T = end
    # (the usual call: no pools, no host time beyond these names)
    P, indices_on_host, state_tokens, accepted_on_host = N, False, 0, False
    if state_indices is not None:
        P = pool_slots(initial_state, final_state, N, state_indices)
        indices_on_host = state_indices.device.type == "cpu"
        if state_indices.dim() == 2:
            state_tokens = state_indices.shape[1]  # L: per-token states
        # Which per-token entries and checkpoints are written is known on the host from fixed lengths or a CPU
        # cu_seqlens (a CUDA one is not read: no check that needs them then).
        lengths = (sequence_lengths(cu_seqlens, B, T)
                   if indices_on_host and (state_tokens or checkpoint_indices is not None)
                   and (cu_seqlens is None or cu_seqlens.device.type == "cpu") else None)
        if indices_on_host:
            check_state_indices(state_indices, P, final_state is not None, lengths if state_tokens else None)
        if num_accepted_tokens is not None:
            accepted_on_host = num_accepted_tokens.device.type == "cpu"
            if accepted_on_host:
                check_num_accepted_tokens(num_accepted_tokens, state_tokens)  # on the host: free there
        in_place = (initial_state is not None and final_state is not None
                    and initial_state.data_ptr() == final_state.data_ptr())
        if state_tokens and in_place and lengths is not None and (num_accepted_tokens is None or accepted_on_host):
            check_token_state_reads(state_indices, P, lengths, num_accepted_tokens)
        if checkpoint_indices is not None and checkpoint_indices.device.type == "cpu":
            # (the CPU path's: CUDA calls take CUDA ones)
            check_checkpoint_indices(checkpoint_indices, P, state_indices, lengths, checkpoint_every)

    # --- nothing to compute: no launch with an empty grid, but final_state is still defined (per-token states: no
    # token, so no state is written).
    if B * T == 0 or H == 0:
        if final_state is not None and final_state is not initial_state and not state_tokens:
            if state_indices is not None:
                pools.copy_named_slots(final_state, initial_state, state_indices)  # (no synchronisation)
            elif initial_state is None:
                final_state.zero_()
            else:
                final_state.copy_(initial_state)
        return None

    if q.device.type == "cpu":
        run_cpu(q, k, v, g, beta, float(scale), out, A_log, None if dt_bias is None else dt_bias.view(H, K),
                None if lower_bound is None else float(lower_bound), initial_state, final_state, cu_seqlens,
                state_indices, gate, allow_neg_eigval, num_accepted_tokens, checkpoint_indices,
                checkpoint_every)  # fmt: skip
        return None

    index = q.device.index  # a CUDA tensor's device always has an index
    # On q's device (usually current already): the capture check and the cached workspace then see that device's
    # current stream, and the thread's device is restored as torch restores it (_ext.on_device).
    with _ext.on_device(index):
        C = _ext.load()
        stream = _ext.current_stream(index)
        gate_code = GATE_CODES[gate]
        plan, kernel_bytes = plan_for(B, T, H, N, cu_seqlens is not None, sm_count_of(index), gate_code)
        if cu_on_host or indices_on_host or accepted_on_host:
            cu_offset, indices_offset, accepted_offset, nbytes = host_copies(kernel_bytes, N, cu_on_host,
                                                                             indices_on_host, accepted_on_host,
                                                                             state_tokens)
        else:
            nbytes = kernel_bytes
        if workspace is None:
            # A call that needs no bytes (the decode kernel) takes none: no cache lookup, and a CUDA graph may capture
            # it on any stream without reserve_workspace.
            workspace = (_NO_WORKSPACE if nbytes == 0 else _cached_workspace(index, stream, nbytes) if cached_workspace
                         else torch.empty(nbytes, dtype=torch.uint8, device=q.device))
        elif workspace.numel() < nbytes:
            raise ValueError(f"workspace must hold at least {nbytes} bytes for this call, got {workspace.numel()=}")
        if cu_on_host:
            # Behind the kernel's bytes, from a private pageable copy of what was validated above: CUDA stages a
            # pageable source before the asynchronous copy returns, so the caller may change its buffer (pinned or
            # not) as soon as fwd returns. No device allocation, no synchronisation.
            staged = torch.empty(N + 1, dtype=torch.int64)
            staged.copy_(cu_seqlens)
            device_cu = workspace[cu_offset : cu_offset + 8 * (N + 1)].view(torch.int64)
            device_cu.copy_(staged, non_blocking=True)
            cu_seqlens = device_cu
        if indices_on_host:
            # Likewise, after the cu_seqlens copy (if any): a private pageable int64 copy of the validated indices
            # (N of them, or N·L per-token slots, row-major).
            count = N * state_tokens if state_tokens else N
            staged = torch.empty(count, dtype=torch.int64)
            staged.copy_(state_indices.view(count))
            device_indices = workspace[indices_offset : indices_offset + 8 * count].view(torch.int64)
            device_indices.copy_(staged, non_blocking=True)
            state_indices = device_indices
        if accepted_on_host:
            # Likewise, after the state_indices copy (if any): the validated counts as int64.
            staged = torch.empty(N, dtype=torch.int64)
            staged.copy_(num_accepted_tokens)
            device_accepted = workspace[accepted_offset : accepted_offset + 8 * N].view(torch.int64)
            device_accepted.copy_(staged, non_blocking=True)
            num_accepted_tokens = device_accepted

        # The device's error word: the kernels lower it to the first malformed boundary of a CUDA cu_seqlens, to the
        # first sequence whose CUDA state index is past the pool, or whose CUDA num_accepted_tokens is outside [1, L]
        # (host copies were validated above: no device check).
        indices_on_device = state_indices is not None and not indices_on_host
        accepted_on_device = num_accepted_tokens is not None and not accepted_on_host
        # (checkpoint_indices of a CUDA call are on the device: validate)
        status = (_status_word(index)
                  if (cu_seqlens is not None and not cu_on_host) or indices_on_device or accepted_on_device
                  or checkpoint_indices is not None else None)
        if indices_on_device or checkpoint_indices is not None:
            _note_pool_slots(index, P)
        if state_tokens and (indices_on_device or accepted_on_device):
            _per_token_devices.add(index)
        # The extension makes q's device current for the launches (a no-op here: it is current). Its argument is
        # four groups (kda/csrc/binding.cpp): tensors with their dtype codes, shape with the scalars, the plan, and
        # where to launch. (Pointers read inline, 0 for None: a helper
        # function's call per tensor is host time too.) Shape: (B, T, N, value heads, scale, lower_bound (0.0 for the
        # softplus gate, which does not use it), P, key heads, gate code, β's scale (2 allows negative eigenvalues),
        # state_tokens: L of per-token state_indices [N, L], 0 otherwise; the checkpoints' M and C / 16, or 0, 0).
        C.fwd(
            (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
             0 if A_log is None else A_log.data_ptr(), 0 if A_log is None else PARAM_TYPES[A_log.dtype],
             0 if dt_bias is None else dt_bias.data_ptr(), 0 if dt_bias is None else PARAM_TYPES[dt_bias.dtype],
             out.data_ptr(),
             0 if initial_state is None else initial_state.data_ptr(),
             initial_state is not None and initial_state.dtype == torch.float32,
             0 if final_state is None else final_state.data_ptr(),
             final_state is not None and final_state.dtype == torch.float32,
             0 if cu_seqlens is None else cu_seqlens.data_ptr(),
             cu_seqlens is not None and cu_seqlens.dtype == torch.int64,
             0 if state_indices is None else state_indices.data_ptr(),
             state_indices is not None and state_indices.dtype == torch.int64,
             0 if num_accepted_tokens is None else num_accepted_tokens.data_ptr(),
             num_accepted_tokens is not None and num_accepted_tokens.dtype == torch.int64,
             0 if checkpoint_indices is None else checkpoint_indices.data_ptr(),
             checkpoint_indices is not None and checkpoint_indices.dtype == torch.int64),
            (B, T, N, H, float(scale), 0.0 if gate_code else float(lower_bound), P, key_heads, gate_code,
             2.0 if allow_neg_eigval else 1.0, state_tokens,
             0 if checkpoint_indices is None else checkpoint_indices.shape[1],
             0 if checkpoint_indices is None else min(int(checkpoint_every) // C.CHUNK, _MAX_CHECKPOINT_CHUNKS)),
            plan,
            (workspace.data_ptr(), workspace.numel(), 0 if status is None else status, stream, index),
        )  # fmt: skip
        return None



# The CPU path's host memory: its fp32 chunk tensors hold about 8.0-8.6 KiB per token-head at their peak (peak RSS
# over the call, T4096 H4 / T16384 H4 / T8192 H16: 202 / 538 / 1002 MiB), its fp32 states and their temporaries
# [N, H, V, K] about 400-490 KiB per sequence-head (B512 T1 H4, with and without states: 796-981 MiB; B2048 T1 H4:
# 2.9-3.4 GiB), plus a fixed part of tens of MiB.
CPU_BYTES_PER_TOKEN_HEAD = 9 * 1024
CPU_BYTES_PER_SEQUENCE_HEAD = 512 * 1024
CPU_FIXED_BYTES = 128 << 20


def cpu_bytes_needed(token_heads: int, sequence_heads: int = 0) -> int:
    """An upper bound of the host memory the CPU path holds for a call of ``token_heads`` = B·T·H over
    ``sequence_heads`` = N·H (sequences times value heads)."""
    return CPU_FIXED_BYTES + CPU_BYTES_PER_TOKEN_HEAD * token_heads + CPU_BYTES_PER_SEQUENCE_HEAD * sequence_heads


def available_host_memory() -> int | None:
    """Bytes the kernel says a new allocation can have without swapping (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def run_cpu(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
            state_indices=None, gate="lower_bound", allow_neg_eigval=False, num_accepted_tokens=None,
            checkpoint_indices=None, checkpoint_every=0):
    """The CPU path (``numerics.cpu_forward``), its results copied into ``out`` and ``final_state`` (with
    ``state_indices`` [N]: into the named slots of the pool ``final_state``, ``pools.scatter``; with per-token
    ``state_indices`` [N, L]: the pool ``cpu_forward`` returns, its written slots holding the states after each
    token by the recurrence, ``pools.run_pooled_tokens``; with ``checkpoint_indices`` [N, M]: likewise the pool
    ``cpu_forward`` returns, its checkpoint slots and named slots copied back, ``pools.checkpoint_entries``).

    Refuses (MemoryError, before any work) a call whose working memory exceeds what the host has available."""
    with torch.autocast("cpu", enabled=False):  # (a model under CPU autocast: the path computes in fp32 as given)
        _run_cpu(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
                 state_indices, gate, allow_neg_eigval, num_accepted_tokens, checkpoint_indices, checkpoint_every)


def _run_cpu(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
             state_indices, gate, allow_neg_eigval, num_accepted_tokens, checkpoint_indices, checkpoint_every):
    """run_cpu's body, outside autocast."""
    from flash_kda import numerics  # noqa: PLC0415 -- lazy: the CUDA path does not need it

    B, T, H, _ = v.shape  # H: the value heads (the path expands grouped key heads to them)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    needed = cpu_bytes_needed(B * T * H, N * H)
    per_token = state_indices is not None and state_indices.dim() == 2
    also = ""
    if per_token:
        # the fp32 states after each of the first L tokens [N, L, H, V, K] and the final pool in fp32
        needed += 4 * HEAD_DIM * HEAD_DIM * H * (state_indices.numel() + final_state.shape[0])
        also = f" and fp32 states [N·L + P = {state_indices.numel() + final_state.shape[0]}, H, V, K]"
    elif checkpoint_indices is not None:
        # at most N·M checkpoint states [E, H, V, K] and the final pool in fp32
        needed += 4 * HEAD_DIM * HEAD_DIM * H * (checkpoint_indices.numel() + final_state.shape[0])
        also = f" and fp32 states [N·M + P = {checkpoint_indices.numel() + final_state.shape[0]}, H, V, K]"
    available = available_host_memory()
    if available is not None and needed > available:
        raise MemoryError(
            f"flash_kda: the CPU path needs about {_gib(needed)} for {B * T * H} token-heads and {N * H} "
            f"sequence-heads (B*T*H from {tuple(v.shape)=}, N*H; ~{CPU_BYTES_PER_TOKEN_HEAD // 1024} and "
            f"~{CPU_BYTES_PER_SEQUENCE_HEAD // 1024} KiB each){also} but the host has "
            f"{_gib(available)} available; use CUDA tensors or split the call"
        )

    if cu_seqlens is not None and cu_seqlens.dtype != torch.int64:
        cu_seqlens = cu_seqlens.to(torch.int64)
    beta_scale = 2.0 if allow_neg_eigval else 1.0
    if per_token:
        # The pools go in as they are (final_state is required with per-token indices): the result is the whole
        # final pool in fp32, a fresh tensor (so final_state may be initial_state). Only the written slots are
        # copied back: the others keep their bits (a bf16 NaN would not survive the round trip through fp32).
        o, pool = numerics.cpu_forward(
            q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=initial_state, cu_seqlens=cu_seqlens,
            state_indices=state_indices, final_state=final_state, gate_kind=gate, beta_scale=beta_scale,
            num_accepted_tokens=num_accepted_tokens,
        )
        out.copy_(o)
        indices = state_indices.to(torch.int64)
        N, L = indices.shape
        lengths = sequence_lengths(cu_seqlens, B, T).view(N, 1)
        written = (torch.arange(L).view(1, L) < lengths) & (indices >= 0) & (indices < final_state.shape[0])
        slots = indices[written]
        final_state[slots] = pool[slots].to(final_state.dtype)
        return
    if checkpoint_indices is not None:
        # As for per-token slots: the whole final pool in fp32 comes back (final_state is required with
        # checkpoints), and only the slots written (checkpoints, then the named slots) are copied back, bit for
        # bit what the pool holds there (a final state over a checkpoint it shares a slot with).
        o, pool = numerics.cpu_forward(
            q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=initial_state, cu_seqlens=cu_seqlens,
            state_indices=state_indices, final_state=final_state, gate_kind=gate, beta_scale=beta_scale,
            checkpoint_indices=checkpoint_indices, checkpoint_every=checkpoint_every,
        )
        out.copy_(o)
        P = final_state.shape[0]
        _, checkpoint_slots = pools.checkpoint_entries(checkpoint_indices, checkpoint_every,
                                                       sequence_lengths(cu_seqlens, B, T), P)
        slots = torch.cat([checkpoint_slots, pools.named(state_indices, P)[1].to(torch.int64)])
        final_state[slots] = pool[slots].to(final_state.dtype)
        return
    # With pools: the dense initial states of the sequences' slots (a fresh tensor), pools.gather.
    dense_initial = initial_state
    if state_indices is not None and initial_state is not None:
        dense_initial = pools.gather(initial_state, state_indices)
    o, state = numerics.cpu_forward(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=dense_initial, cu_seqlens=cu_seqlens,
        gate_kind=gate, beta_scale=beta_scale,
    )
    # The results are fresh tensors, so final_state may alias initial_state.
    out.copy_(o)
    if final_state is not None:
        if state_indices is not None:
            pools.scatter(state, state_indices, final_state)
        else:
            final_state.copy_(state)



_status_words: dict[int, int] = {}  # device index -> address of its error word
_status_take_lock = threading.Lock()  # one last_error query at a time (kda/csrc/status_word.cu reads back one slot)
# device index -> the pool sizes P of its calls with CUDA state_indices since the last query (for last_error's
# message: the word holds the sequence, not the call's P).
_pool_sizes: dict[int, set[int]] = {}
# device indices with a call since the last query whose per-token state_indices or num_accepted_tokens were on the
# device (the word then names a sequence with a bad slot or a count outside [1, L]).
_per_token_devices: set[int] = set()


def _note_pool_slots(index: int, P: int) -> None:
    sizes = _pool_sizes.get(index)
    if sizes is None:
        sizes = _pool_sizes[index] = set()
    if len(sizes) < 8:
        sizes.add(P)


def _status_word(index: int) -> int:
    """The address of device ``index``'s error word, created once per device and never during graph capture.

    The extension allocates it outside PyTorch's caching allocator (kda/csrc/status_word.cu): created on a first
    call inside torch.compile's CUDA graph trees, a tensor would land in the pool they own, where only tracked
    outputs may live."""
    word = _status_words.get(index)
    if word is not None:
        return word
    with _workspaces_lock:
        word = _status_words.get(index)
        if word is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "flash_kda.fwd needs its per-device error word during CUDA graph capture but it does not exist "
                    "yet; call flash_kda.fwd once or flash_kda.reserve_workspace(...) before capture"
                )
            word = _status_words[index] = int(_ext.load().status_word_create(index))
        return word


def last_error(device: torch.device | str | int | None = None) -> str | None:
    """The first malformed ``cu_seqlens``, ``state_indices``, ``num_accepted_tokens`` or ``checkpoint_indices`` a
    CUDA call on ``device`` met since the last query, or None.

    ``fwd`` never reads a CUDA ``cu_seqlens`` or ``state_indices`` on the host (that would synchronise); a small
    kernel checks the boundaries on the device (cu[0] == 0, non-decreasing, cu[N] <= number of tokens) and the
    state indices (each below the pools' slot count P) and the accepted-token counts (each in [1, L]) and records
    the first bad one in a per-device word (a ``cu_seqlens`` index before any sequence). This query covers every
    call enqueued on ``device`` before it, on any stream and from any thread (it waits for all of the device's
    work: ``torch.cuda.synchronize(device)``), then reads and resets the word in one atomic exchange and returns a
    message naming ``cu_seqlens[i]``, or ``state_indices[n]`` (and ``num_accepted_tokens[n]`` after calls with
    per-token states: the word names the sequence, not which of the two was bad), or ``checkpoint_indices[n]``;
    the outputs of a call with a malformed ``cu_seqlens`` are unspecified, a sequence whose starting index is past
    the pool, or whose count is outside [1, L], ran from zeros, and no state or checkpoint was written past the pool
    (no memory outside the pool was touched). Calls enqueued while the query runs are reported by the next query.
    Before any CUDA call with device checks (on a machine without CUDA, say) it returns None and leaves CUDA
    uninitialised.
    """
    device = _ext.cuda_device(device, "last_error")
    if not _status_words:  # no CUDA call has had a word to lower: nothing to report, and no CUDA to ask
        return None
    index = _ext.cuda_index(device, "last_error")
    word = _status_words.get(index)
    if word is None:
        return None
    C = _ext.load()
    with _status_take_lock, _ext.on_device(index):  # (two threads' queries would share the word's read-back slot)
        first_bad = int(C.status_word_take(word, index))
        sizes = sorted(_pool_sizes.pop(index, ()))
        per_token = index in _per_token_devices
        _per_token_devices.discard(index)
    if first_bad >= C.STATUS_CLEAR:  # (the value of a word that no malformed boundary lowered)
        return None
    if first_bad >= C.STATUS_CHECKPOINT_INDEX_BASE:
        n = first_bad - C.STATUS_CHECKPOINT_INDEX_BASE
        pool = f"P = {sizes[0]}" if len(sizes) == 1 else "P of that call; the calls since the last query had P in " + str(sizes)
        return (
            f"flash_kda: a call on cuda:{index} got a malformed checkpoint_indices: an entry of "
            f"checkpoint_indices[{n}] is past the pool's last slot ({pool}); no checkpoint was written there"
        )
    if first_bad >= C.STATUS_STATE_INDEX_BASE:
        n = first_bad - C.STATUS_STATE_INDEX_BASE
        pool = f"P = {sizes[0]}" if len(sizes) == 1 else "P of that call; the calls since the last query had P in " + str(sizes)
        if per_token:
            slot = f"an entry of state_indices[{n}] is past the pool's last slot ({pool}), or " if sizes else ""
            return (
                f"flash_kda: a call on cuda:{index} got a malformed state_indices or "
                f"num_accepted_tokens for sequence {n}: {slot}num_accepted_tokens[{n}] is outside [1, L] (L: "
                "state_indices.shape[1]); a sequence without a starting slot in the pool ran from a zero state, and "
                "no state was written to a slot past the pool"
            )
        return (
            f"flash_kda: a call on cuda:{index} got a malformed state_indices: state_indices[{n}] is "
            f"past the pool's last slot ({pool}); that sequence ran from a zero state and wrote no final state"
        )
    return (
        f"flash_kda: a call on cuda:{index} got a malformed cu_seqlens: cu_seqlens[{first_bad}] is "
        "its first bad boundary (cu_seqlens must start at 0, never decrease and end at most at the number of "
        "tokens); "
        "the outputs of that call are unspecified"
    )



# One cached workspace per (device index, stream): a buffer shared across streams could be overwritten by a
# kernel on another stream while still in use. The caching allocator ties each buffer to the stream it was
# allocated on, so replacing it by a larger one is stream-ordered and safe for eager work. A CUDA graph captured
# on a cached buffer keeps its address for every replay, so a buffer handed to a capture is never freed: when the
# cache outgrows it, it moves to _held_by_graphs for the life of the process.
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_NO_WORKSPACE = torch.empty(0, dtype=torch.uint8)  # (only its address 0 and size 0 reach the kernel)
_captured: set[int] = set()  # data_ptr of cached buffers a capture has used
_held_by_graphs: list[torch.Tensor] = []
_workspaces_lock = threading.Lock()
_WORKSPACE_GRANULE = 2 << 20  # round growth up to 2 MiB so slowly growing inputs do not reallocate every call
_capturing = torch._C._cuda_isCurrentStreamCapturing  # (what torch.cuda.is_current_stream_capturing calls)


def _retire_workspace(key: tuple[int, int]) -> None:
    """Drops the cached workspace of ``key`` (if any); one a capture has used is held instead: a captured graph
    writes it at every replay. Called with _workspaces_lock held."""
    buf = _workspaces.pop(key, None)
    if buf is not None and buf.data_ptr() in _captured:
        _held_by_graphs.append(buf)


def _cached_workspace(index: int, stream: int, nbytes: int) -> torch.Tensor:
    """The cached workspace of device ``index``'s stream ``stream`` (its current one), grown to ``nbytes``."""
    key = (index, stream)
    buf = _workspaces.get(key)  # the common case, without the lock: a dict read is atomic
    if buf is not None and buf.numel() >= nbytes:
        if _capturing():
            _captured.add(buf.data_ptr())
        return buf
    with _workspaces_lock:
        buf = _workspaces.get(key)
        if buf is not None and buf.numel() >= nbytes:
            if _capturing():
                _captured.add(buf.data_ptr())
            return buf
        if _capturing():
            raise RuntimeError(
                f"flash_kda.fwd needs {nbytes} workspace bytes during CUDA graph capture but the cached workspace "
                f"of the capturing stream holds {0 if buf is None else buf.numel()}; pass workspace= or call "
                "flash_kda.reserve_workspace(flash_kda.workspace_bytes(v, cu_seqlens, gate=gate), v.device) before "
                "capture, on the stream that captures (the cache is per stream; torch.cuda.graph captures on a side "
                "stream unless given stream=)"
            )
        size = -(-nbytes // _WORKSPACE_GRANULE) * _WORKSPACE_GRANULE
        buf = None  # (no reference left: the old buffer is freed before its replacement is allocated)
        _retire_workspace(key)
        buf = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
        _workspaces[key] = buf
        return buf


def reserve_workspace(nbytes: int, device: torch.device | str | int | None = None) -> torch.Tensor:
    """Grows the cached workspace of ``device``'s current stream to at least ``nbytes`` and returns it.

    Call before CUDA graph capture with the largest ``workspace_bytes(v, cu_seqlens, gate=gate)`` the graph will
    see, so that ``fwd`` allocates nothing while capturing (or pass ``workspace=`` to ``fwd`` instead). The cache
    is per stream: call it with the capturing stream current (``torch.cuda.graph`` captures on a side stream of
    its own unless given ``stream=``).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral):
        # (the type only: a tensor passed by mistake would print its contents)
        raise TypeError(f"nbytes must be a non-negative int (e.g. workspace_bytes(v, cu_seqlens)), got "
                        f"{type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes=}")
    index = _ext.cuda_index(_ext.cuda_device(device, "reserve_workspace"), "reserve_workspace")
    with _ext.on_device(index):  # (as fwd runs: the capture checks see that device's current stream)
        _status_word(index)  # the error word too, so that capture allocates nothing
        return _cached_workspace(index, _ext.current_stream(index), int(nbytes))


def release_workspace(device: torch.device | str | int | None = None) -> None:
    """Drops the cached workspaces of every stream of ``device`` (None: of every device), so that
    ``torch.cuda.empty_cache()`` can return their memory; the next call without ``workspace=`` allocates again.
    A buffer that a captured CUDA graph uses stays held for the life of the process, as when the cache outgrows it.
    Without ``device`` it touches no CUDA (a machine without one has nothing cached); with one, a machine without
    CUDA gets the RuntimeError of ``reserve_workspace``."""
    index = None if device is None else _ext.cuda_index(_ext.cuda_device(device, "release_workspace"),
                                                        "release_workspace")
    with _workspaces_lock:
        for key in [key for key in _workspaces if index is None or key[0] == index]:
            _retire_workspace(key)
