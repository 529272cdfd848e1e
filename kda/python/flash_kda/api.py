"""The public forward call ``flash_kda.fwd``: validation, workspace management and dispatch.

CUDA tensors go to the sm_90a kernel in ``flash_kda._C``; CPU tensors go to the fp32 chunked PyTorch path
(``flash_kda.numerics.cpu_forward``), so the same call works on any machine.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from typing import NamedTuple

import torch

from flash_kda import _ext

__all__ = ["fwd", "check_cu_seqlens", "last_error", "workspace_bytes", "reserve_workspace", "plan", "Plan",
           "HEAD_DIM", "LOWER_BOUND_RANGE"]

HEAD_DIM = 128  # K = V = 128: the only head size the kernel is built for.
LOWER_BOUND_RANGE = (-5.0, 0.0)  # the kernel's chunk size keeps 2^{±G} in range only for lower_bound >= -5.
REQUIRED_CAPABILITY = (9, 0)  # the kernel is compiled for sm_90a, which runs on compute capability 9.0 only.
_STATE_DTYPES = (torch.bfloat16, torch.float32)  # initial and final state each, independently
_PARAM_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # A_log, dt_bias -> kda::ParamType
_CU_SEQLENS_DTYPES = (torch.int64, torch.int32)
_ALIGNMENT = 16  # bytes: q, k, v, g, out, dt_bias and the states are read/written with 16-byte accesses
_V_SPLITS = (1, 2, 4, 8)
# Set only through flash_kda.testing.force_plan:
_forced_v_split = 0  # 0: the plan chooses (forcing it forces the scan's V split too, unless that is forced)
_forced_scan_v_split = 0  # 0: the plan chooses
_forced_segment_chunks: int | None = None  # None: the plan chooses; 0: no time split; L: segments of L chunks
_forced_single_pass: bool | None = None  # None: the plan chooses (two stages whenever a V split is forced)
_forced_lead_chunks: int | None = None  # None: the plan chooses; -1: no overlap; L >= 0: the overlap with lead L
_DEFAULT_SM_COUNT = 132  # an H200/H100 SXM, for plans asked about CPU tensors


class Plan(NamedTuple):
    """How ``fwd`` runs a call on the GPU (docs/KERNEL.md, "The plan"); no choice changes a result bit except
    the time split, which the numerics twin re-enacts."""

    v_split: int  # recurrence CTAs per (segment, head), each owning 128 / v_split state rows
    scan_v_split: int  # scan-pass CTAs per (scanned segment, head, map)
    segment_chunks: int  # time split: chunks (16 tokens) per segment; 0 = none
    single_pass: bool = False  # one kernel prepares and runs each (sequence, head); no workspace
    lead_chunks: int = -1  # the overlap: chunks prepared before the recurrence starts, the rest beside it; -1 = none
    tail_ctas: int = 0  # the overlap: CTAs of its tail kernel (one per SM the recurrence leaves free)
    longest_first: bool = False  # varlen: the finishing pass starts the longest sequences first


def plan(q: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> Plan:
    """The plan ``fwd`` uses for inputs shaped like ``q`` [B, T, H, K] (and ``cu_seqlens``) on q's device.

    Host-only: shapes and the device's SM count, never tensor contents (so never a synchronisation)."""
    return _plan_and_bytes(q, cu_seqlens)[0]


def _plan_and_bytes(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[Plan, int]:
    """``plan(q, cu_seqlens)`` and the kernels' workspace bytes under it, cached per shape (host time per call)."""
    B, T, H, _ = q.shape
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    sm_count = _sm_count(q.device) if q.device.type == "cuda" else _DEFAULT_SM_COUNT
    return _plan_for(B, T, H, N, cu_seqlens is not None, sm_count)


def _plan_for(B: int, T: int, H: int, N: int, varlen: bool, sm_count: int) -> tuple[Plan, int]:
    """``_plan_and_bytes`` from the shapes (fwd has them from its validation: no tensor reads again)."""
    key = (B, T, H, N, varlen, sm_count, _forced_v_split, _forced_scan_v_split, _forced_segment_chunks,
           _forced_single_pass, _forced_lead_chunks)
    cached = _plans.get(key)  # a dict hit instead of extension calls on every fwd
    if cached is not None:
        return cached
    forced_segments = -1 if _forced_segment_chunks is None else _forced_segment_chunks
    if _forced_single_pass is None:
        forced_single = 0 if (_forced_v_split or _forced_scan_v_split) else -1  # a forced V split is two-stage
    else:
        forced_single = int(_forced_single_pass)
    forced_lead = -2 if _forced_lead_chunks is None else _forced_lead_chunks
    if forced_lead == -2 and (_forced_v_split or _forced_scan_v_split or _forced_segment_chunks is not None
                              or _forced_single_pass is not None):
        forced_lead = -1  # any other forced plan runs without the overlap
    C = _ext.load()
    v_split, scan_v_split, segment_chunks, single_pass, lead_chunks, tail_ctas, longest_first = C.choose_plan(
        B * T, T, N, H, varlen, sm_count, forced_segments, forced_single, forced_lead)
    if _forced_v_split:
        v_split = scan_v_split = _forced_v_split
        longest_first = longest_first and v_split == 1  # (the order is kept for 8-warp CTAs only)
    if _forced_scan_v_split:
        scan_v_split = _forced_scan_v_split
    run = Plan(int(v_split), int(scan_v_split), int(segment_chunks), bool(single_pass), int(lead_chunks),
               int(tail_ctas), bool(longest_first))
    tail_items = int(C.overlap_tail_items(T, N, H, run.lead_chunks))
    result = run, int(C.workspace_bytes(B * T, N, H, run.segment_chunks, run.single_pass, tail_items,
                                        run.longest_first))
    if len(_plans) >= _PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = result
    return result


_plans: dict[tuple, tuple[Plan, int]] = {}
_PLAN_CACHE_SIZE = 4096  # distinct shapes remembered (cleared when full)


_sm_counts: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _sm_count_of(index: int) -> int:
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float,
    initial_state: torch.Tensor | None = None,
    final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    workspace: torch.Tensor | None = None,
) -> None:
    """Kimi Delta Attention forward: writes the output into ``out`` and the last state into ``final_state``.

    Per sequence n and head h, with q̂ = q/sqrt(Σq² + 1e-6), k̂ likewise, the per-channel decay
    α_t = exp(lower_bound · sigmoid(exp(A_log[h]) · (g_t + dt_bias[h]))) and β_t = sigmoid(beta_t), the state
    S ∈ R^{V×K} (zeros or ``initial_state[n, h]``) evolves token by token as

        S ← S · Diag(α_t);   S ← S + β_t (v_t − S k̂_t) k̂_tᵀ;   out_t = S (scale · q̂_t)

    and ``final_state[n, h]`` receives S after the sequence's last token. Without ``cu_seqlens`` each of the
    B rows is one sequence (N = B); with it, B must be 1 and sequence n is tokens cu[n] .. cu[n+1]-1 (it may be
    empty, and T = 0 is allowed). States never cross sequence boundaries.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | q, k | bf16 | [B, T, H, K] | queries, keys (L2-normalised inside) |
    | v | bf16 | [B, T, H, V] | values |
    | g | bf16 | [B, T, H, K] | gate before activation |
    | beta | bf16 | [B, T, H] | beta logits (sigmoid inside) |
    | scale | float | — | output scale, finite (usually K**-0.5) |
    | out | bf16 | [B, T, H, V] | output buffer, written in place |
    | A_log | fp32 / bf16 / fp16 | [H] | log-gate parameter (read as if widened to fp32) |
    | dt_bias | fp32 / bf16 / fp16 | [H, K] (or flat [H*K]) | gate bias (likewise) |
    | lower_bound | float | — | gate lower bound, in [-5, 0] |
    | initial_state | None / bf16 / fp32 | [N, H, V, K] | initial state (None: zeros); never modified |
    | final_state | None / bf16 / fp32 | [N, H, V, K] | output buffer for the final state (may be initial_state) |
    | cu_seqlens | int64 / int32 | [N + 1] | optional sequence boundaries; requires B = 1; may be on the CPU |
    | workspace | uint8 | [≥ workspace_bytes(q, cu_seqlens)] | optional CUDA scratch (keyword only) |

    K = V = 128. All tensors are contiguous and on one device. The two states may differ in dtype (fla passes a
    bf16 initial state with an fp32 final state); ``final_state`` may be the ``initial_state`` tensor itself.
    Only ``out`` and ``final_state`` are written. Returns None.

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
    if torch.compiler.is_compiling():
        # Traced as one opaque operator (flash_kda/ops.py): the body below reads data pointers, which fake tensors
        # do not have, and would break the graph.
        from flash_kda import ops  # noqa: PLC0415 -- registers the operator on first use

        return ops.fwd_op(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                          cu_seqlens, workspace)
    return _fwd_eager(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                      cu_seqlens, workspace)


def _validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
              workspace, *, concrete: bool) -> tuple[int, int, int, int]:
    """Checks every argument of ``fwd`` (arch -> dtype -> device -> layout -> shape -> values); returns (B, T, H, N).

    ``concrete=False`` (fake tensors while tracing for torch.compile) skips what needs real storage or a real
    device: the compute capability, the alignment of data pointers and the contents of ``cu_seqlens``.
    """
    if concrete:
        dims = _well_formed(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                            cu_seqlens, workspace)
        if dims is not None:
            return dims
    # Something is off (or unusual, e.g. an int scale): the checks below, in order, name the first problem.
    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "out": out, "A_log": A_log, "dt_bias": dt_bias,
        "initial_state": initial_state, "final_state": final_state, "cu_seqlens": cu_seqlens,
    }  # fmt: skip
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t)=}")
    for name in ("q", "k", "v", "g", "beta", "out", "A_log", "dt_bias"):
        if name not in given:
            raise TypeError(f"{name} is required, got {name}=None")

    device = q.device  # read once: each .device read builds a new torch.device (host time per call)
    on_cuda = device.type == "cuda"
    # --- arch: the kernel is sm_90a machine code; anything else would fail at launch with a vaguer error.
    if concrete and on_cuda:
        _check_arch(device)

    # --- dtype
    for name in ("q", "k", "v", "g", "beta", "out"):
        if tensors[name].dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {name}.dtype={tensors[name].dtype}")
    for name in ("A_log", "dt_bias"):
        if tensors[name].dtype not in _PARAM_TYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {name}.dtype={tensors[name].dtype}")
    for name in ("initial_state", "final_state"):
        if name in given and given[name].dtype not in _STATE_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={given[name].dtype}")
    if cu_seqlens is not None and cu_seqlens.dtype not in _CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must be int64 or int32, got {cu_seqlens.dtype=}")

    # --- device: one device for everything, except that cu_seqlens may also be on the CPU with CUDA tensors
    # (then it is validated on the host, where that costs no synchronisation, and copied to the device).
    if not on_cuda and device.type != "cpu":
        raise ValueError(f"tensors must be on a CUDA or CPU device, got {q.device=}")
    for name, t in given.items():
        if name == "cu_seqlens" and _cu_seqlens_on_host(q, t):
            continue
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got q.device={device} but {name}.device={t.device}")
    if workspace is not None:
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            raise TypeError(f"workspace must be a uint8 tensor, got {getattr(workspace, 'dtype', type(workspace))=}")
        if workspace.device != device:
            raise ValueError(f"workspace must be on q's device, got {workspace.device=} {q.device=}")

    # --- layout: the kernel indexes the SPEC layouts with implicit strides.
    for name, t in given.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got {name}.stride()={t.stride()} for shape {tuple(t.shape)}")
    if workspace is not None and not workspace.is_contiguous():
        raise ValueError(f"workspace must be contiguous, got {workspace.stride()=}")
    if concrete and on_cuda:
        # The kernels move rows with 16-byte vector loads and bulk copies; fresh allocations always qualify,
        # a view that starts mid-row may not.
        aligned = {**given, "workspace": workspace} if workspace is not None else given
        for name, t in aligned.items():
            if t.data_ptr() % _ALIGNMENT and name not in ("beta", "A_log", "cu_seqlens"):
                raise ValueError(
                    f"{name} must start at a {_ALIGNMENT}-byte aligned address on CUDA, got "
                    f"{name}.data_ptr() % {_ALIGNMENT} = {t.data_ptr() % _ALIGNMENT} (a view with a storage offset?)"
                )

    # --- shape
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {q.shape=}")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise NotImplementedError(f"flash_kda supports head dim K = {HEAD_DIM} only, got K={K} from {q.shape=}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, H, V], got {v.shape=}")
    V = v.shape[-1]
    if V != HEAD_DIM:
        raise NotImplementedError(f"flash_kda supports head dim V = {HEAD_DIM} only, got V={V} from {v.shape=}")
    expected_shapes = {
        "k": (B, T, H, K), "g": (B, T, H, K), "v": (B, T, H, V), "out": (B, T, H, V), "beta": (B, T, H),
        "A_log": (H,),
    }  # fmt: skip
    for name, shape in expected_shapes.items():
        if tensors[name].shape != shape:  # torch.Size is a tuple
            raise ValueError(f"{name} must have shape {list(shape)} (from {q.shape=}), got {name}.shape={tuple(tensors[name].shape)}")
    if tuple(dt_bias.shape) not in ((H, K), (H * K,)):
        raise ValueError(f"dt_bias must have shape [{H}, {K}] (or flat [{H * K}]), got {dt_bias.shape=}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got {cu_seqlens.shape=}")
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (sequences are packed along T), got B={B} from {q.shape=}")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    for name in ("initial_state", "final_state"):
        if name in given and tuple(given[name].shape) != (N, H, V, K):
            raise ValueError(
                f"{name} must have shape [N, H, V, K] = {[N, H, V, K]}, got {name}.shape={tuple(given[name].shape)}"
            )

    # --- scalar values
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale=}")
    if (
        not isinstance(lower_bound, numbers.Real)
        or isinstance(lower_bound, bool)
        or not math.isfinite(lower_bound)
        or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]
    ):
        raise ValueError(f"lower_bound must be a finite number in {list(LOWER_BOUND_RANGE)}, got {lower_bound=}")

    return B, T, H, N


def _well_formed(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
                 workspace) -> tuple[int, int, int, int] | None:
    """(B, T, H, N) when every check of ``_validate`` passes for a call of the usual kind, else None.

    Host time per call: the same conditions as ``_validate`` in one tight pass (about a third of its cost), with
    no messages; whatever it does not accept (a bad argument, or an int ``scale``) goes through ``_validate``'s
    ordered checks, which raise or accept. It must never accept what those checks refuse (test_validation's
    error cases all go through ``fwd`` and so through here first).
    """
    Tensor = torch.Tensor
    bf16 = torch.bfloat16
    for t in (q, k, v, g, beta, out, A_log, dt_bias):
        if not isinstance(t, Tensor):
            return None
    device = q.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        if _device_capability(device) != REQUIRED_CAPABILITY:
            return None
    elif device.type != "cpu":
        return None
    shape = q.shape
    if len(shape) != 4 or shape[3] != HEAD_DIM:
        return None
    B, T, H, K = shape
    for t in (q, k, v, g, out):
        if t.dtype != bf16 or t.shape != shape or t.device != device or not t.is_contiguous():
            return None
    if beta.dtype != bf16 or beta.shape != shape[:3] or beta.device != device or not beta.is_contiguous():
        return None
    for t in (A_log, dt_bias):
        if t.dtype not in _PARAM_TYPES or t.device != device or not t.is_contiguous():
            return None
    if A_log.shape != (H,) or tuple(dt_bias.shape) not in ((H, K), (H * K,)):
        return None
    if cu_seqlens is None:
        N = B
    else:
        if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in _CU_SEQLENS_DTYPES or cu_seqlens.dim() != 1
                or cu_seqlens.numel() < 2 or B != 1 or not cu_seqlens.is_contiguous()):
            return None
        if cu_seqlens.device != device and not (on_cuda and cu_seqlens.device.type == "cpu"):
            return None
        N = cu_seqlens.numel() - 1
    for t in (initial_state, final_state):
        if t is not None:
            if (not isinstance(t, Tensor) or t.dtype not in _STATE_DTYPES or t.device != device
                    or not t.is_contiguous() or t.shape != (N, H, HEAD_DIM, HEAD_DIM)):
                return None
    if workspace is not None:
        if (not isinstance(workspace, Tensor) or workspace.dtype != torch.uint8 or workspace.device != device
                or not workspace.is_contiguous()):
            return None
    if on_cuda:
        for t in (q, k, v, g, out, dt_bias, initial_state, final_state, workspace):
            if t is not None and t.data_ptr() % _ALIGNMENT:
                return None
    if type(scale) is not float or not math.isfinite(scale):
        return None
    if type(lower_bound) is not float or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]:
        return None  # (NaN fails the range test; ±inf are outside it)
    return B, T, H, N


def _fwd_eager(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
               workspace) -> None:
    """``fwd`` outside tracing: validate, then run the CUDA kernel or the CPU path."""
    B, T, H, N = _validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                           cu_seqlens, workspace, concrete=True)
    K = HEAD_DIM
    cu_on_host = cu_seqlens is not None and _cu_seqlens_on_host(q, cu_seqlens)
    if cu_seqlens is not None and (cu_seqlens.device.type == "cpu" or _checked_cu_seqlens()):
        check_cu_seqlens(cu_seqlens, T)  # on the host: free there; for a CUDA tensor (checked mode) a sync

    # --- nothing to compute: no launch with an empty grid, but final_state is still defined.
    if B * T == 0 or H == 0:
        if final_state is not None and final_state is not initial_state:
            if initial_state is None:
                final_state.zero_()
            else:
                final_state.copy_(initial_state)
        return None

    if q.device.type == "cpu":
        _cpu_forward(q, k, v, g, beta, float(scale), out, A_log, dt_bias.view(H, K), float(lower_bound),
                     initial_state, final_state, cu_seqlens)  # fmt: skip
        return None

    C = _ext.load()
    index = q.device.index  # a CUDA tensor's device always has an index
    stream = _ext.current_stream(index)
    run, kernel_bytes = _plan_for(B, T, H, N, cu_seqlens is not None, _sm_count_of(index))
    nbytes = kernel_bytes + (_host_cu_seqlens_bytes(N) if cu_on_host else 0)
    if workspace is None:
        workspace = _cached_workspace(index, stream, nbytes)
    elif workspace.numel() < nbytes:
        raise ValueError(f"workspace must hold at least {nbytes} bytes for this call, got {workspace.numel()=}")
    if cu_on_host:
        # Behind the kernel's records: an asynchronous copy (a pageable host buffer is staged at once, so the
        # caller may reuse it on return), no allocation, no synchronisation.
        device_cu = workspace[kernel_bytes : kernel_bytes + 8 * (N + 1)].view(torch.int64)
        device_cu.copy_(cu_seqlens.to(torch.int64), non_blocking=True)
        cu_seqlens = device_cu

    # The device's error word: the kernels lower it to the first malformed boundary of a CUDA cu_seqlens (a host
    # cu_seqlens was validated above, so its copy needs no device check).
    status = _status_word(index) if cu_seqlens is not None and not cu_on_host else None
    # The extension makes q's device current for the launches itself (a torch.cuda.device context costs more
    # host time than the launches).
    # (Pointers read inline, 0 for None: a helper function's call per tensor is host time too.)
    C.fwd(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), A_log.data_ptr(),
        _PARAM_TYPES[A_log.dtype], dt_bias.data_ptr(), _PARAM_TYPES[dt_bias.dtype], out.data_ptr(),
        0 if initial_state is None else initial_state.data_ptr(),
        initial_state is not None and initial_state.dtype == torch.float32,
        0 if final_state is None else final_state.data_ptr(),
        final_state is not None and final_state.dtype == torch.float32,
        0 if cu_seqlens is None else cu_seqlens.data_ptr(), cu_seqlens is not None and cu_seqlens.dtype == torch.int64,
        B, T, N, H, float(scale), float(lower_bound),
        workspace.data_ptr(), workspace.numel(), 0 if status is None else status.data_ptr(), run.v_split,
        run.scan_v_split, run.segment_chunks, run.single_pass, run.lead_chunks, run.tail_ctas, run.longest_first,
        stream, index,
    )  # fmt: skip
    return None


_capabilities: dict[int, tuple[int, int]] = {}


def _device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, read once per device (a seam for tests, which monkeypatch it)."""
    index = _device_index(device)
    capability = _capabilities.get(index)
    if capability is None:
        capability = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return capability


def _check_arch(device: torch.device) -> None:
    capability = tuple(_device_capability(device))
    if capability != REQUIRED_CAPABILITY:
        raise RuntimeError(
            f"flash_kda's CUDA kernel is built for sm_90a and needs compute capability 9.0 (H100/H200), "
            f"got device {device} with capability {capability}; use CPU tensors for the portable path"
        )


def _cpu_forward(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens):
    from flash_kda import numerics  # noqa: PLC0415 -- lazy: the CUDA path does not need it

    if cu_seqlens is not None and cu_seqlens.dtype != torch.int64:
        cu_seqlens = cu_seqlens.to(torch.int64)
    o, state = numerics.cpu_forward(
        q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    # The results are fresh tensors, so final_state may alias initial_state.
    out.copy_(o)
    if final_state is not None:
        final_state.copy_(state)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Validates the contents of ``cu_seqlens`` on the host (this synchronises with the device).

    ``fwd`` does not read ``cu_seqlens`` on the host for CUDA tensors; call this where malformed boundaries may
    come from outside.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | cu_seqlens | int64 / int32 | [N + 1] | sequence boundaries |
    | total_tokens | int | — | T, the packed length (q.shape[1] with B = 1) |

    Raises ValueError naming the problem unless N >= 1, cu[0] == 0, cu is non-decreasing and cu[N] == T.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in _CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must be an int64 or int32 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))=}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got {cu_seqlens.shape=}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0].item()} in cu_seqlens={cu.tolist()}")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        n = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{n}]={cu[n].item()} > "
            f"cu_seqlens[{n + 1}]={cu[n + 1].item()}"
        )
    if cu[-1] != total_tokens:
        raise ValueError(
            f"cu_seqlens[-1] must equal the number of tokens {total_tokens}, got cu_seqlens[-1]={cu[-1].item()}"
        )


_STATUS_CLEAR = 1 << 62  # the error word when no malformed boundary was seen (the kernel lowers it atomically)
_status_words: dict[int, torch.Tensor] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _status_word(index: int) -> torch.Tensor:
    """Device ``index``'s error word (one int64, allocated once per device, never during graph capture)."""
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
            word = torch.full((1,), _STATUS_CLEAR, dtype=torch.int64, device=torch.device("cuda", index))
            _status_words[index] = word
        return word


def last_error(device: torch.device | str | int | None = None) -> str | None:
    """The first malformed ``cu_seqlens`` a CUDA call on ``device`` met since the last query, or None.

    ``fwd`` never reads a CUDA ``cu_seqlens`` on the host (that would synchronise); a small kernel checks its
    boundaries on the device (cu[0] == 0, non-decreasing, cu[N] == number of tokens) and records the first bad
    index in a per-device word. This query reads that word (a synchronisation), resets it and returns a message
    naming ``cu_seqlens`` and the index; the outputs of the offending call are unspecified.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"last_error needs a CUDA device, got {device=}")
    word = _status_words.get(_device_index(device))
    if word is None:
        return None
    first_bad = int(word.item())
    if first_bad >= _STATUS_CLEAR:
        return None
    word.fill_(_STATUS_CLEAR)
    return (
        f"flash_kda: a call on cuda:{_device_index(device)} got a malformed cu_seqlens: cu_seqlens[{first_bad}] is "
        "its first bad boundary (cu_seqlens must start at 0, never decrease and end at the number of tokens); "
        "the outputs of that call are unspecified"
    )


def workspace_bytes(q: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> int:
    """Bytes of CUDA workspace ``fwd`` needs for inputs shaped like ``q`` [B, T, H, K] (and ``cu_seqlens``).

    Host-only: reads shapes and devices, never tensor contents. It depends on the plan (``plan(q, cu_seqlens)``:
    a time split stores each segment's map, the overlap a ready flag per tail record, the single pass needs no
    records at all), which depends on the device's SM count. A CPU ``cu_seqlens`` with CUDA ``q`` adds room for
    its device copy.
    """
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    extra = _host_cu_seqlens_bytes(N) if cu_seqlens is not None and _cu_seqlens_on_host(q, cu_seqlens) else 0
    return _plan_and_bytes(q, cu_seqlens)[1] + extra


def _cu_seqlens_on_host(q: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    return q.device.type == "cuda" and cu_seqlens.device.type == "cpu"


def _host_cu_seqlens_bytes(num_seqs: int) -> int:
    return -(-8 * (num_seqs + 1) // 16) * 16  # int64 boundaries, 16-byte granules


CHECK_CU_SEQLENS_ENV = "FLASH_KDA_CHECK_CU_SEQLENS"


def _checked_cu_seqlens() -> bool:
    """FLASH_KDA_CHECK_CU_SEQLENS=1: validate a CUDA cu_seqlens on the host before every call (synchronises)."""
    return os.environ.get(CHECK_CU_SEQLENS_ENV, "0") not in ("", "0")


# One cached workspace per (device index, stream): a buffer shared across streams could be overwritten by a
# kernel on another stream while still in use. The caching allocator ties each buffer to the stream it was
# allocated on, so replacing it by a larger one is stream-ordered and safe.
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_workspaces_lock = threading.Lock()
_WORKSPACE_GRANULE = 2 << 20  # round growth up to 2 MiB so slowly growing inputs do not reallocate every call


def _cached_workspace(index: int, stream: int, nbytes: int) -> torch.Tensor:
    """The cached workspace of device ``index``'s stream ``stream`` (its current one), grown to ``nbytes``."""
    key = (index, stream)
    buf = _workspaces.get(key)  # the common case, without the lock: a dict read is atomic
    if buf is not None and buf.numel() >= nbytes:
        return buf
    with _workspaces_lock:
        buf = _workspaces.get(key)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"flash_kda.fwd needs {nbytes} workspace bytes during CUDA graph capture but the cached workspace "
                f"holds {0 if buf is None else buf.numel()}; pass workspace= or call "
                "flash_kda.reserve_workspace(flash_kda.workspace_bytes(q, cu_seqlens), q.device) before capture"
            )
        size = -(-nbytes // _WORKSPACE_GRANULE) * _WORKSPACE_GRANULE
        _workspaces.pop(key, None)  # free the old buffer before allocating its replacement
        buf = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
        _workspaces[key] = buf
        return buf


def reserve_workspace(nbytes: int, device: torch.device | str | int | None = None) -> torch.Tensor:
    """Grows the cached workspace of ``device``'s current stream to at least ``nbytes`` and returns it.

    Call before CUDA graph capture with the largest ``workspace_bytes(q, cu_seqlens)`` the graph will see, so
    that ``fwd`` allocates nothing while capturing (or pass ``workspace=`` to ``fwd`` instead).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
        raise ValueError(f"nbytes must be a non-negative int, got {nbytes=}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"reserve_workspace needs a CUDA device, got {device=}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _status_word(device.index)  # the error word too, so that capture allocates nothing
    return _cached_workspace(device.index, _ext.current_stream(device.index), int(nbytes))
