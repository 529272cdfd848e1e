"""The plan: how ``fwd`` spreads a call over the GPU (docs/DESIGN.md, "The plan"), and the workspace it needs.

The plan is chosen by the extension (``kda::choose_plan`` in kda/csrc/kda_plan.h) from shapes and the SM count
alone, never from tensor contents, so asking for it never synchronises. ``Plan`` is the extension's type
(``kda::Plan``); it loads with the extension, on first use. Plans and their workspace bytes are cached per shape
and per set of forced choices (``forced``, which ``flash_kda.testing.force_plan`` sets).
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

import torch

from flash_kda import _ext
from flash_kda.validation import GATE_CODES, cu_seqlens_on_host

if TYPE_CHECKING:
    from flash_kda._C import Plan

__all__ = ["plan", "plan_for", "decode_chunk_runs", "stream_pass_runs", "workspace_bytes", "host_cu_seqlens_bytes", "host_state_indices_bytes",
           "host_num_accepted_tokens_bytes", "host_copies", "sm_count_of", "forced", "forced_plan", "PlanOverrides", "Plan", "V_SPLITS"]

V_SPLITS = (1, 2, 4, 8)
DEFAULT_SM_COUNT = 132  # an H200/H100 SXM, for plans asked about CPU tensors


def __getattr__(name: str):
    if name == "Plan":  # the extension's type, imported on first use (the module imports without it)
        return _ext.load().Plan
    raise AttributeError(f"module 'flash_kda.planning' has no attribute {name!r}")


class PlanOverrides(NamedTuple):
    """Choices forced on the plan (``kda::PlanOverrides``); None leaves a choice to the plan. Unless given, a forced
    V split runs two stages, anything forced runs without the overlap, and anything forced but ``decode`` runs a
    chunked plan."""

    v_split: Optional[int] = None  # 1, 2, 4 or 8 (the scan's V split too, unless scan_v_split is given)
    scan_v_split: Optional[int] = None  # 1, 2, 4 or 8
    segment_chunks: Optional[int] = None  # 0: no time split; L > 0: segments of L chunks
    single_pass: Optional[bool] = None  # True: the single pass; False: two stages
    lead_chunks: Optional[int] = None  # L >= 0: the overlap with a lead of L chunks; -1: no overlap
    decode: Optional[bool] = None  # True: the decode plan (token by token or 16-token steps); False: a chunked plan


# The choices forced in this thread / context (None: none); part of every plan-cache key.
_forced: contextvars.ContextVar[Optional[PlanOverrides]] = contextvars.ContextVar("flash_kda_forced_plan",
                                                                                  default=None)


@contextlib.contextmanager
def forced(overrides: PlanOverrides) -> Iterator[None]:
    """Within the block (in this thread or context), plans are chosen with ``overrides`` instead of any outer ones.
    Each field is checked on its own (``flash_kda.testing.force_plan`` also checks them against each other; a plan
    that cannot run is refused by ``plan`` and ``fwd``)."""
    _check_overrides(overrides)
    token = _forced.set(overrides if overrides != PlanOverrides() else None)
    try:
        yield
    finally:
        _forced.reset(token)


def _check_overrides(overrides) -> None:
    if not isinstance(overrides, PlanOverrides):
        raise TypeError(f"overrides must be a planning.PlanOverrides, got {type(overrides).__name__}")
    for name in ("v_split", "scan_v_split"):
        value = getattr(overrides, name)
        if value is not None and (type(value) is not int or value not in V_SPLITS):
            raise ValueError(f"{name} must be None or one of {list(V_SPLITS)}, got {name}={value!r}")
    for name, low in (("segment_chunks", 0), ("lead_chunks", -1)):
        value = getattr(overrides, name)
        if value is not None and (type(value) is not int or not low <= value < 2**31):
            raise ValueError(f"{name} must be None or an int in [{low}, 2^31), got {name}={value!r}")
    for name in ("single_pass", "decode"):
        value = getattr(overrides, name)
        if value is not None and type(value) is not bool:
            raise ValueError(f"{name} must be None, True or False, got {name}={value!r}")


def forced_plan() -> PlanOverrides:
    """The choices forced here now (all None outside ``forced``)."""
    return _forced.get() or PlanOverrides()


def plan(q: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, heads: int | None = None,
         gate: str = "lower_bound") -> Plan:
    """The plan ``fwd`` uses for inputs shaped like ``q`` [B, T, H, K] (and ``cu_seqlens``) on q's device.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | q | any | [B, T, H, ·] | the call's q (or v: its heads are the value heads) |
    | cu_seqlens | int64 / int32 | [N + 1] | the call's sequence boundaries, or None |
    | heads | int | — | the call's value heads HV (v.shape[2]); None: q.shape[2] (no grouped value heads) |
    | gate | str | — | the call's ``gate`` ("lower_bound" or "softplus": the single pass runs the lower-bound gate only) |

    The kernels run one program per value head, so with grouped value heads (v with HV = G·H heads) pass
    ``heads=v.shape[2]`` (or pass v instead of q). Host-only: shapes and the device's SM count, never tensor
    contents (so never a synchronisation)."""
    return _plan_and_bytes(q, cu_seqlens, heads, gate)[0]


def decode_chunk_runs(total_tokens: int, num_seqs: int, state_tokens: int = 0) -> bool:
    """Whether a decode plan runs its chunk step (decode_chunk.cu) for a call of ``total_tokens`` tokens over
    ``num_seqs`` sequences with ``state_tokens`` per-token states (``kda::decode_chunk_runs``); otherwise the
    token-by-token kernel (decode.cu) runs."""
    return bool(_ext.load().decode_chunk_runs(_count("total_tokens", total_tokens), _count("num_seqs", num_seqs),
                                              _count("state_tokens", state_tokens, 2**31)))


def stream_pass_runs(varlen: bool, seqlen: int, state_tokens: int = 0, checkpoints: bool = False, *,
                     fp32_final: bool, items: int, sm_count: int) -> bool:
    """Whether a decode plan runs the stream pass (stream_pass.cuh), whose arithmetic is the chunked plans', for a
    call: fixed-length sequences of exactly 16 tokens without per-token states or checkpoints, no fp32 final state,
    and at least as many (sequence, head) ``items`` as the GPU's ``sm_count`` SMs (``kda::stream_pass_runs``);
    otherwise ``decode_chunk_runs`` decides."""
    return bool(_ext.load().stream_pass_runs(bool(varlen), _count("seqlen", seqlen),
                                             _count("state_tokens", state_tokens, 2**31), bool(checkpoints),
                                             bool(fp32_final), _count("items", items),
                                             _count("sm_count", sm_count, 2**31)))


def _count(name: str, value, limit: int = 2**63) -> int:
    """A size argument as an int in [0, limit), or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < limit:
        raise ValueError(f"{name} must be an int in [0, {limit}), got {name}={value!r}")
    return int(value)


def workspace_bytes(q: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                    state_indices: torch.Tensor | None = None, *, heads: int | None = None,
                    gate: str = "lower_bound", num_accepted_tokens: torch.Tensor | None = None) -> int:
    """Bytes of CUDA workspace ``fwd`` needs for inputs shaped like ``q`` [B, T, H, K] (and ``cu_seqlens``,
    ``state_indices``, ``num_accepted_tokens``); with grouped value heads, ``heads=v.shape[2]`` (the value heads HV;
    None: q.shape[2]), or v in place of q, and with the softplus gate ``gate="softplus"``, as for ``plan``.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | q | any | [B, T, H, ·] | the call's q (or v) |
    | cu_seqlens | int64 / int32 | [N + 1] | the call's sequence boundaries, or None |
    | state_indices | int64 / int32 | [N] or [N, L] | the call's pool slots, or None |
    | heads | int | — | the call's value heads HV; None: q.shape[2] |
    | gate | str | — | the call's ``gate`` |
    | num_accepted_tokens | int64 / int32 | [N] | the call's accepted-token counts (with [N, L] indices), or None |

    Host-only: reads shapes and devices, never tensor contents. It depends on the plan (``plan(q, cu_seqlens)``:
    a time split stores each segment's map, the overlap a ready flag per tail record, the single pass needs no
    records at all, nor does the decode kernel), which depends on the device's SM count. A CPU ``cu_seqlens``,
    ``state_indices`` (N or N·L int64 slots) or ``num_accepted_tokens`` (N int64 counts) with CUDA ``q`` adds room
    for its device copy.
    """
    for name, t in (("state_indices", state_indices), ("num_accepted_tokens", num_accepted_tokens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be None or the call's {name} tensor, got {type(t).__name__}")
    kernel_bytes = _plan_and_bytes(q, cu_seqlens, heads, gate)[1]  # (checks q and cu_seqlens)
    N = int(cu_seqlens.numel()) - 1 if cu_seqlens is not None else int(q.shape[0])
    for name, t, dims in (("state_indices", state_indices, (1, 2)), ("num_accepted_tokens", num_accepted_tokens, (1,))):
        if t is not None and (t.dtype not in (torch.int32, torch.int64) or t.dim() not in dims or t.shape[0] != N):
            shapes = " or ".join(("[N]", "[N, L]")[d - 1] for d in dims)
            raise ValueError(f"{name} must be int64 or int32 {shapes} with N = {N} (the call's sequences), got "
                             f"{name}.dtype={t.dtype}, {name}.shape={tuple(t.shape)}")
    cu_on_host = cu_seqlens is not None and cu_seqlens_on_host(q, cu_seqlens)
    indices_on_host = state_indices is not None and cu_seqlens_on_host(q, state_indices)
    accepted_on_host = num_accepted_tokens is not None and cu_seqlens_on_host(q, num_accepted_tokens)
    state_tokens = int(state_indices.shape[1]) if state_indices is not None and state_indices.dim() == 2 else 0
    return host_copies(kernel_bytes, N, cu_on_host, indices_on_host, accepted_on_host, state_tokens)[3]


def host_copies(kernel_bytes: int, num_seqs: int, cu_on_host: bool, indices_on_host: bool,
                accepted_on_host: bool = False, state_tokens: int = 0) -> tuple[int, int, int, int]:
    """(cu_seqlens offset, state_indices offset, num_accepted_tokens offset, total bytes) of the workspace: after
    the kernels' bytes, on 16-byte boundaries, the device copy of a CPU ``cu_seqlens`` (if any), then that of a CPU
    ``state_indices`` (if any: N int64 slots, or N·L with ``state_tokens`` = L > 0, per-token indices [N, L]),
    then that of a CPU ``num_accepted_tokens`` (if any: N int64 counts). An offset whose copy is absent is where
    it would start; the total is the kernels' bytes when there is no copy."""
    cu_offset = host_cu_seqlens_offset(kernel_bytes)
    indices_offset = cu_offset + (host_cu_seqlens_bytes(num_seqs) if cu_on_host else 0)
    slots = num_seqs * state_tokens if state_tokens else num_seqs
    accepted_offset = indices_offset + (host_state_indices_bytes(slots) if indices_on_host else 0)
    end = accepted_offset + (host_num_accepted_tokens_bytes(num_seqs) if accepted_on_host else 0)
    copies = cu_on_host or indices_on_host or accepted_on_host
    return cu_offset, indices_offset, accepted_offset, end if copies else kernel_bytes


def host_cu_seqlens_offset(kernel_bytes: int) -> int:
    """Where the device copy of a CPU ``cu_seqlens`` starts in the workspace: after the kernels' bytes, on a
    16-byte boundary (those bytes end on any 4-byte boundary: the overlap's flags and the longest-first order
    hold 4 bytes per entry)."""
    return -(-kernel_bytes // 16) * 16


def host_cu_seqlens_bytes(num_seqs: int) -> int:
    """Workspace bytes for the device copy of a CPU ``cu_seqlens`` (int64 boundaries, 16-byte granules)."""
    return -(-8 * (num_seqs + 1) // 16) * 16


def host_state_indices_bytes(num_slots: int) -> int:
    """Workspace bytes for the device copy of a CPU ``state_indices`` of ``num_slots`` entries (N, or N·L for
    per-token indices [N, L]; int64 slots, 16-byte granules)."""
    return -(-8 * num_slots // 16) * 16


def host_num_accepted_tokens_bytes(num_seqs: int) -> int:
    """Workspace bytes for the device copy of a CPU ``num_accepted_tokens`` (int64 counts, 16-byte granules)."""
    return -(-8 * num_seqs // 16) * 16


def _plan_and_bytes(q: torch.Tensor, cu_seqlens: torch.Tensor | None, heads: int | None = None,
                    gate: str = "lower_bound") -> tuple[Plan, int]:
    """``plan(q, cu_seqlens, heads=heads, gate=gate)`` and the kernels' workspace bytes under it."""
    if not isinstance(gate, str) or gate not in GATE_CODES:
        raise ValueError(f"gate must be one of {list(GATE_CODES)}, got {gate=}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise TypeError(f"q must be the call's q (or v), a 4-D tensor [B, T, H, K], got {type(q).__name__} "
                        f"{tuple(q.shape) if isinstance(q, torch.Tensor) else ''}".rstrip())
    if cu_seqlens is not None and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1):
        raise TypeError(f"cu_seqlens must be None or the call's 1-D boundaries [N + 1], got {type(cu_seqlens).__name__} "
                        f"{tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else ''}".rstrip())
    if cu_seqlens is not None and (cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2):
        raise ValueError(f"cu_seqlens must be int64 or int32 boundaries [N + 1] with N >= 1, got "
                         f"cu_seqlens.dtype={cu_seqlens.dtype}, cu_seqlens.shape={tuple(cu_seqlens.shape)}")
    B, T, H = (int(d) for d in q.shape[:3])  # (int: symbolic sizes under torch.compile specialise here)
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs B = 1 (the sequences packed along dim 1), got q.shape={tuple(q.shape)}")
    if heads is not None:  # (the call's value heads, whether the tensor given is q or v)
        if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads < 0:
            raise ValueError(f"heads must be None or the call's value heads (a non-negative int), got {heads=}")
        H = int(heads)
    if H >= 2**31:
        raise ValueError(f"a call has at most 2^31 - 1 heads (a CUDA launch takes at most 65535), got {H}")
    N = int(cu_seqlens.numel()) - 1 if cu_seqlens is not None else B
    sm_count = _sm_count(q.device) if q.device.type == "cuda" else DEFAULT_SM_COUNT
    run, nbytes = plan_for(B, T, H, N, cu_seqlens is not None, sm_count, GATE_CODES[gate])
    problem = _ext.load().plan_error(run, cu_seqlens is not None, N, GATE_CODES[gate])
    if problem:
        raise ValueError(problem)  # (as fwd would refuse it: a forced plan this call cannot run)
    return run, nbytes


def plan_for(B: int, T: int, H: int, N: int, varlen: bool, sm_count: int, gate: int = 0) -> tuple[Plan, int]:
    """The plan and the kernels' workspace bytes for these shapes (H: the value heads) and gate code
    (``validation.GATE_CODES``), cached (fwd has the shapes from its validation: no tensor reads again, and a dict
    hit instead of extension calls on every call)."""
    overrides = _forced.get()
    key = (B, T, H, N, varlen, sm_count, gate, overrides)
    cached = _plans.get(key)
    if cached is not None:
        return cached
    C = _ext.load()
    run = C.choose_plan(B * T, T, N, H, varlen, sm_count, gate=gate, **(overrides._asdict() if overrides else {}))
    tail_items = C.overlap_tail_items(T, N, H, run.lead_chunks)
    result = run, int(C.workspace_bytes(B * T, N, H, run.segment_chunks, run.single_pass, tail_items,
                                        run.longest_first, run.decode))
    if len(_plans) >= _PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = result
    return result


_plans: dict[tuple, tuple[Plan, int]] = {}
_PLAN_CACHE_SIZE = 4096  # distinct shapes remembered (cleared when full)
_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    return sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def sm_count_of(index: int) -> int:
    """The SM count of CUDA device ``index``, read once per device."""
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count
