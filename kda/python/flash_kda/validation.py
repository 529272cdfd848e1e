"""Argument checks of ``flash_kda.fwd``: the ordered checks that name the first problem, the tight pass that
accepts a well-formed call in a third of their host time, and the host checks of the contents of ``cu_seqlens``,
``state_indices``, ``num_accepted_tokens`` and ``checkpoint_indices``.

Checks run in the order arch -> dtype -> device -> layout -> shape -> values; every message names the argument
and shows the offending value.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from flash_kda import pools

__all__ = ["validate", "well_formed", "refuse_grad", "first_requiring_grad", "check_cu_seqlens", "check_state_indices",
           "check_num_accepted_tokens", "check_token_state_reads", "check_checkpoint_indices", "sequence_lengths",
           "check_arch",
           "device_capability", "device_index", "cu_seqlens_on_host", "checked_cu_seqlens", "pool_slots", "HEAD_DIM",
           "LOWER_BOUND_RANGE", "PARAM_TYPES", "GATE_CODES", "CHECK_CU_SEQLENS_ENV"]

HEAD_DIM = 128  # K = V = 128: the only head size the kernel is built for.
LOWER_BOUND_RANGE = (-5.0, 0.0)  # the kernel's chunk size keeps 2^{±G} in range only for lower_bound >= -5.
REQUIRED_CAPABILITY = (9, 0)  # the kernel is compiled for sm_90a, which runs on compute capability 9.0 only.
STATE_DTYPES = (torch.bfloat16, torch.float32)  # initial and final state each, independently
PARAM_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # A_log, dt_bias -> kda::ParamType
# The gate's activation -> its code in the extension (kda::GateKind): "lower_bound" is
# λ = lower_bound·sigmoid(exp(A_log)·(g + dt_bias)), "softplus" λ = −exp(A_log)·softplus(g + dt_bias) (fla's default).
GATE_CODES = {"lower_bound": 0, "softplus": 1}
CU_SEQLENS_DTYPES = (torch.int64, torch.int32)
STATE_INDEX_DTYPES = (torch.int64, torch.int32)
# May be on the CPU beside CUDA tensors (validated there, then copied into the workspace).
HOST_INDEX_ARGS = ("cu_seqlens", "state_indices", "num_accepted_tokens")
CHECKPOINT_GRANULE = 16  # tokens per chunk: checkpoints fall on chunk boundaries (checkpoint_every a multiple)
ALIGNMENT = 16  # bytes: q, k, v, g, out, dt_bias and the states are read/written with 16-byte accesses
MAX_HEADS = 65535  # the kernels launch heads along a grid's y dimension, whose limit this is
FP32_OVERFLOW = 3.4028235677973366e38  # a float of this magnitude or more rounds to ±inf in float32
# What fwd writes, checked in this order against everything else it touches (kernel code may read one while
# another CTA writes the other, so no overlap is allowed, except final_state over initial_state's exact memory).
WRITTEN = ("final_state", "out", "workspace")
# FLASH_KDA_CHECK_CU_SEQLENS=1: fwd checks a CUDA cu_seqlens on the host before every call (a synchronisation).
CHECK_CU_SEQLENS_ENV = "FLASH_KDA_CHECK_CU_SEQLENS"


def validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
             workspace, state_indices=None, gate="lower_bound", allow_neg_eigval=False, num_accepted_tokens=None,
             checkpoint_indices=None, checkpoint_every=0, *, concrete: bool) -> tuple[int, int, int, int, int]:
    """Checks every argument of ``fwd`` (arch -> dtype -> device -> layout -> shape -> values -> grad); returns
    (B, T, HV, N, H): batch, tokens, value heads (the heads of v, out, the states and the kernels' grid),
    sequences, and the key heads of q and k (HV = G·H, value head hv reads key head hv // G).

    ``concrete=False`` (fake tensors while tracing for torch.compile) skips what needs real storage or a real
    device: the compute capability, the alignment of data pointers and the contents of ``cu_seqlens``. The
    contents of ``state_indices``, ``num_accepted_tokens`` and ``checkpoint_indices`` are checked by
    ``check_state_indices``, ``check_num_accepted_tokens`` and ``check_checkpoint_indices`` where they are on the
    host.
    """
    dims = _ordered_checks(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                           cu_seqlens, workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
                           checkpoint_indices, checkpoint_every, concrete)
    refuse_grad(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state)
    if concrete and not torch.is_inference_mode_enabled():
        for name, t in (("out", out), ("final_state", final_state), ("workspace", workspace)):
            if isinstance(t, torch.Tensor) and t.is_inference():
                # PyTorch refuses in-place updates of an inference tensor outside inference mode; the CPU path would
                # fail part way (out written, final_state not), the CUDA kernels would write it behind autograd.
                raise RuntimeError(
                    f"{name} is an inference tensor (created under torch.inference_mode()) and fwd runs outside "
                    f"inference mode, where PyTorch does not allow writing it in place; call fwd under "
                    f"torch.inference_mode() or pass a tensor created outside it as {name}"
                )
    return dims


def _ordered_checks(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                    cu_seqlens, workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
                    checkpoint_indices, checkpoint_every, concrete: bool) -> tuple[int, int, int, int, int]:
    """validate's checks of the arguments themselves, in its order (then validate checks grad mode)."""
    if concrete:
        dims = well_formed(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                           cu_seqlens, workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
                           checkpoint_indices, checkpoint_every)
        if dims is not None:
            return dims
    # Something is off (or unusual, e.g. an int scale): the checks below, in order, name the first problem.
    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "out": out, "A_log": A_log, "dt_bias": dt_bias,
        "initial_state": initial_state, "final_state": final_state, "cu_seqlens": cu_seqlens,
        "state_indices": state_indices, "num_accepted_tokens": num_accepted_tokens,
        "checkpoint_indices": checkpoint_indices,
    }  # fmt: skip
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t)=}")
    for name in ("q", "k", "v", "g", "beta", "out"):
        if name not in given:
            raise TypeError(f"{name} is required, got {name}=None")

    device = q.device  # read once: each .device read builds a new torch.device (host time per call)
    on_cuda = device.type == "cuda"
    # --- arch: the kernel is sm_90a machine code; anything else would fail at launch with a vaguer error.
    if concrete and on_cuda:
        check_arch(device)

    # --- dtype
    for name in ("q", "k", "v", "g", "beta", "out"):
        if tensors[name].dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {name}.dtype={tensors[name].dtype}")
    for name in ("A_log", "dt_bias"):
        if name in given and given[name].dtype not in PARAM_TYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {name}.dtype={given[name].dtype}")
    for name in ("initial_state", "final_state"):
        if name in given and given[name].dtype not in STATE_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float32, got {name}.dtype={given[name].dtype}")
    if cu_seqlens is not None and cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise TypeError(f"cu_seqlens must be int64 or int32, got {cu_seqlens.dtype=}")
    if state_indices is not None and state_indices.dtype not in STATE_INDEX_DTYPES:
        raise TypeError(f"state_indices must be int64 or int32, got {state_indices.dtype=}")
    if num_accepted_tokens is not None and num_accepted_tokens.dtype not in STATE_INDEX_DTYPES:
        raise TypeError(f"num_accepted_tokens must be int64 or int32, got {num_accepted_tokens.dtype=}")
    if checkpoint_indices is not None and checkpoint_indices.dtype not in STATE_INDEX_DTYPES:
        raise TypeError(f"checkpoint_indices must be int64 or int32, got {checkpoint_indices.dtype=}")

    # --- device: one device for everything, except that cu_seqlens, state_indices and num_accepted_tokens may also
    # be on the CPU with CUDA tensors (then they are validated on the host, where that costs no synchronisation, and
    # copied to the device). Not checkpoint_indices: the kernels read it where it is, at every launch.
    if not on_cuda and device.type != "cpu":
        raise ValueError(f"tensors must be on a CUDA or CPU device, got {q.device=}")
    for name, t in given.items():
        if name in HOST_INDEX_ARGS and cu_seqlens_on_host(q, t):
            continue
        if t.device != device:
            if name == "checkpoint_indices" and cu_seqlens_on_host(q, t):
                raise ValueError(f"checkpoint_indices must be on q's device (the kernels read it at every launch; "
                                 f"it is not copied from the host), got checkpoint_indices.device={t.device} with "
                                 f"q.device={device}")
            raise ValueError(f"all tensors must be on one device, got q.device={device} but {name}.device={t.device}")
    if workspace is not None:
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            got = f"dtype {workspace.dtype}" if isinstance(workspace, torch.Tensor) else f"{type(workspace)=}"
            raise TypeError(f"workspace must be a uint8 tensor, got {got}")
        if workspace.device != device:
            raise ValueError(f"workspace must be on q's device, got {workspace.device=} {q.device=}")

    # --- layout: the kernel indexes the layouts of docs/SPEC.md with implicit strides.
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
            if t.data_ptr() % ALIGNMENT and name not in ("beta", "A_log", "checkpoint_indices", *HOST_INDEX_ARGS):
                raise ValueError(
                    f"{name} must start at a {ALIGNMENT}-byte aligned address on CUDA, got "
                    f"{name}.data_ptr() % {ALIGNMENT} = {t.data_ptr() % ALIGNMENT} (a view with a storage offset?)"
                )

    # --- shape: q, k on the key heads H; v, g, out, beta, A_log, dt_bias and the states on the value heads HV.
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {q.shape=}")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise NotImplementedError(f"flash_kda supports head dim K = {HEAD_DIM} only, got K={K} from {q.shape=}")
    if k.shape != q.shape:
        raise ValueError(f"k must have shape {list(q.shape)} (q's shape), got k.shape={tuple(k.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, HV, V], got {v.shape=}")
    V = v.shape[-1]
    if V != HEAD_DIM:
        raise NotImplementedError(f"flash_kda supports head dim V = {HEAD_DIM} only, got V={V} from {v.shape=}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, {V}] (B, T from {q.shape=}), got "
                         f"v.shape={tuple(v.shape)}")
    HV = v.shape[2]
    if HV < H or (HV % H if H else HV):
        raise ValueError(f"v's heads HV must be a multiple G >= 1 of q's heads H (grouped value heads: value head "
                         f"hv reads key head hv // G), got HV={HV} from {v.shape=} and H={H} from {q.shape=}")
    expected_shapes = {
        "g": (B, T, HV, K), "out": (B, T, HV, V), "beta": (B, T, HV), "A_log": (HV,),
    }  # fmt: skip
    for name, shape in expected_shapes.items():
        if name in given and tensors[name].shape != shape:  # torch.Size is a tuple
            raise ValueError(f"{name} must have shape {list(shape)} (from {q.shape=} and {v.shape=}), got "
                             f"{name}.shape={tuple(tensors[name].shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) not in ((HV, K), (HV * K,)):
        raise ValueError(f"dt_bias must have shape [{HV}, {K}] (or flat [{HV * K}]; one row per value head), got "
                         f"{dt_bias.shape=}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got {cu_seqlens.shape=}")
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (sequences are packed along T), got B={B} from {q.shape=}")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if state_indices is None:
        for name in ("initial_state", "final_state"):
            if name in given and tuple(given[name].shape) != (N, HV, V, K):
                raise ValueError(
                    f"{name} must have shape [N, H, V, K] = {[N, HV, V, K]}, got {name}.shape={tuple(given[name].shape)}"
                )
    else:
        if state_indices.dim() not in (1, 2) or state_indices.shape[0] != N or (
                state_indices.dim() == 2 and state_indices.shape[1] < 1):
            raise ValueError(f"state_indices must be 1-D [N] = [{N}] (one slot per sequence) or 2-D [N, L] = "
                             f"[{N}, L] with L >= 1 (a slot per token), got {state_indices.shape=}")
        pools = [name for name in ("initial_state", "final_state") if name in given]
        if not pools:
            raise ValueError("state_indices needs initial_state or final_state (the pools [P, H, V, K] it indexes), "
                             "got neither")
        P = given[pools[0]].shape[0] if given[pools[0]].dim() == 4 else 0
        for name in pools:
            shape = tuple(given[name].shape)
            if len(shape) != 4 or shape[1:] != (HV, V, K) or shape[0] < 1:
                raise ValueError(f"{name} must be a pool [P, H, V, K] = [P, {HV}, {V}, {K}] with P >= 1 (with "
                                 f"state_indices), got {name}.shape={shape}")
            if shape[0] != P:
                raise ValueError(f"initial_state and final_state must be pools of one size P, got "
                                 f"{initial_state.shape=} and {final_state.shape=}")
        if state_indices.dim() == 2 and final_state is None:
            raise ValueError(f"state_indices [N, L] (per-token states) writes the state after each token into "
                             f"final_state, got final_state=None with {state_indices.shape=} (pass "
                             "final_state=initial_state to write the pool in place)")
    if num_accepted_tokens is not None:
        if state_indices is None or state_indices.dim() != 2:
            got = "state_indices=None" if state_indices is None else f"{state_indices.shape=}"
            raise ValueError(f"num_accepted_tokens needs per-token state_indices [N, L] (it picks each sequence's "
                             f"starting slot among its L), got {got}")
        if tuple(num_accepted_tokens.shape) != (N,):
            raise ValueError(f"num_accepted_tokens must be 1-D [N] = [{N}] (one count per sequence), got "
                             f"{num_accepted_tokens.shape=}")
    if checkpoint_indices is not None:
        if state_indices is None or state_indices.dim() != 1:
            got = "state_indices=None" if state_indices is None else f"{state_indices.shape=}"
            raise ValueError(f"checkpoint_indices needs state_indices [N] (one slot per sequence; checkpoints are "
                             f"written into the pool it indexes), got {got} with {checkpoint_indices.shape=}")
        if final_state is None:
            raise ValueError(f"checkpoint_indices writes each checkpoint into the pool final_state, got "
                             f"final_state=None with {checkpoint_indices.shape=} (pass final_state=initial_state "
                             "to write the pool in place)")
        if checkpoint_indices.dim() != 2 or checkpoint_indices.shape[0] != N:
            raise ValueError(f"checkpoint_indices must be 2-D [N, M] = [{N}, M] (a slot for each of a sequence's "
                             f"M checkpoints, M >= 0), got {checkpoint_indices.shape=}")
    if on_cuda and HV > MAX_HEADS:
        raise ValueError(f"v has H = {HV} heads but the CUDA kernel takes at most {MAX_HEADS} (value heads are a "
                         f"launch grid's y dimension), got {v.shape=}")

    # --- aliasing: outputs may not overlap anything else (fake tensors have no memory to compare)
    if concrete:
        same_device = {name: t for name, t in {**given, "workspace": workspace}.items()
                       if t is not None and t.device == device}  # (a CPU cu_seqlens beside CUDA tensors is not)
        overlap = first_overlap(same_device)
        if overlap is not None:
            written, other = overlap
            raise ValueError(
                f"{written} overlaps {other} in memory ({_span_text(written, same_device)}, "
                f"{_span_text(other, same_device)}); outputs may not share memory with any "
                "other argument, except final_state with initial_state when both start at the same address with "
                "the same dtype (in place)"
            )

    # --- scalar values
    if not isinstance(gate, str) or gate not in GATE_CODES:
        raise ValueError(f"gate must be one of {list(GATE_CODES)}, got {gate=}")
    if allow_neg_eigval is not True and allow_neg_eigval is not False:
        raise TypeError(f"allow_neg_eigval must be a bool, got {allow_neg_eigval=} of {type(allow_neg_eigval)=}")
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not _finite(scale):
        why = " (a Python or NumPy number: a tensor's value is not read, which would wait for its device)"
        raise ValueError(f"scale must be a finite real number, got scale={_shown(scale)}" +
                         (why if isinstance(scale, torch.Tensor) else ""))
    if abs(float(scale)) >= FP32_OVERFLOW:  # (as a Python float: a NumPy float32 would overflow the bound's cast)
        raise ValueError(f"scale must be finite in float32 (|scale| < {FP32_OVERFLOW:.9g}; the kernel computes "
                         f"in float32), got {scale=}")
    if gate == "lower_bound":
        if (
            not isinstance(lower_bound, numbers.Real)
            or isinstance(lower_bound, bool)
            or not _finite(lower_bound)
            or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]
        ):
            raise ValueError(f"lower_bound must be a finite number in {list(LOWER_BOUND_RANGE)}, got "
                             f"lower_bound={_shown(lower_bound)} "
                             "(gate='lower_bound'; only gate='softplus' takes None" +
                             ("; a Python or NumPy number: a tensor's value is not read)"
                              if isinstance(lower_bound, torch.Tensor) else ")"))
    elif lower_bound is not None and (
        not isinstance(lower_bound, numbers.Real) or isinstance(lower_bound, bool) or not _finite(lower_bound)
    ):
        raise ValueError(f"lower_bound must be None or a finite real number with gate='softplus' (which does not "
                         f"use it), got lower_bound={_shown(lower_bound)}")
    # (a SymInt: torch.compile traces an int that changed between calls as a symbol)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, torch.SymInt)):
        raise TypeError(f"checkpoint_every must be an int (tokens between checkpoints), got {checkpoint_every=} of "
                        f"{type(checkpoint_every)=}")
    if checkpoint_indices is None:
        if checkpoint_every != 0:
            raise ValueError(f"checkpoint_every needs checkpoint_indices (the slots the checkpoints go to), got "
                             f"{checkpoint_every=} with checkpoint_indices=None")
    elif checkpoint_every < CHECKPOINT_GRANULE or checkpoint_every % CHECKPOINT_GRANULE:
        raise ValueError(f"checkpoint_every must be a positive multiple of {CHECKPOINT_GRANULE} (checkpoints fall on "
                         f"chunk boundaries), got {checkpoint_every=} with checkpoint_indices given")

    return B, T, HV, N, H


def _finite(x: numbers.Real) -> bool:
    """Whether a real number is finite as a float (an int too large for one is not: math.isfinite would raise
    OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _shown(x) -> str:
    """x for an error message: repr, or an int's size where its digits would be too many to print."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool) and abs(int(x)).bit_length() > 256:
        return f"an int of {abs(int(x)).bit_length()} bits"
    return repr(x)


def refuse_grad(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state) -> None:
    """A RuntimeError naming the first of these tensors that requires grad, with grad mode on. ``fwd`` calls it
    before its operator too under torch.compile: an operator runs with grad mode off, so its own checks cannot."""
    if torch.is_grad_enabled():  # (inference_mode and no_grad: False, one call)
        name = first_requiring_grad({"q": q, "k": k, "v": v, "g": g, "beta": beta, "out": out, "A_log": A_log,
                                     "dt_bias": dt_bias, "initial_state": initial_state, "final_state": final_state})
        if name is not None:
            # fwd writes out and final_state in place and has no backward: the tensor would get no gradient, and a
            # leaf written in place would leave autograd unaware (PyTorch's own out= operators refuse the same).
            raise RuntimeError(
                f"flash_kda.fwd has no backward, got {name}.requires_grad=True with grad mode on "
                f"(torch.is_grad_enabled()): {name} would get no gradient; call fwd under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach()"
            )


def first_requiring_grad(tensors: dict) -> str | None:
    """The name of the first tensor among ``tensors`` (name -> tensor, None or anything else) that requires grad,
    or None. With grad mode on, such a call cannot go through fwd, which has no backward: validate refuses it, and
    fla_backend's verifiers leave it to fla's kernels."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return name
    return None


def well_formed(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
                workspace, state_indices=None, gate="lower_bound", allow_neg_eigval=False,
                num_accepted_tokens=None, checkpoint_indices=None,
                checkpoint_every=0) -> tuple[int, int, int, int, int] | None:
    """(B, T, HV, N, H) when every check of ``validate`` passes for a call of the usual kind, else None.

    Host time per call: the same conditions as ``validate`` in one tight pass (about a third of its cost), with
    no messages; whatever it does not accept (a bad argument, or an int ``scale``) goes through ``validate``'s
    ordered checks, which raise or accept. It must never accept what those checks refuse (test_validation's
    error cases all go through ``fwd`` and so through here first).
    """
    Tensor = torch.Tensor
    bf16 = torch.bfloat16
    for t in (q, k, v, g, beta, out):
        if not isinstance(t, Tensor):
            return None
    device = q.device
    on_cuda = device.type == "cuda"
    if on_cuda:
        if device_capability(device) != REQUIRED_CAPABILITY:
            return None
    elif device.type != "cpu":
        return None
    shape = q.shape
    if len(shape) != 4 or shape[3] != HEAD_DIM:
        return None
    B, T, H, K = shape
    vshape = v.shape  # [B, T, HV, V]: HV = H, or a multiple G·H (grouped value heads)
    if vshape == shape:  # (the usual call: one loop)
        HV = H
        for t in (q, k, v, g, out):
            if t.dtype != bf16 or t.shape != shape or t.device != device or not t.is_contiguous():
                return None
    else:
        if len(vshape) != 4 or vshape[3] != HEAD_DIM or vshape[0] != B or vshape[1] != T:
            return None
        HV = vshape[2]
        if HV < H or (HV % H if H else HV):
            return None
        for t in (q, k):
            if t.dtype != bf16 or t.shape != shape or t.device != device or not t.is_contiguous():
                return None
        for t in (v, g, out):
            if t.dtype != bf16 or t.shape != vshape or t.device != device or not t.is_contiguous():
                return None
    if beta.dtype != bf16 or beta.shape != vshape[:3] or beta.device != device or not beta.is_contiguous():
        return None
    if A_log is not None:
        if (not isinstance(A_log, Tensor) or A_log.dtype not in PARAM_TYPES or A_log.device != device
                or not A_log.is_contiguous() or A_log.shape != (HV,)):
            return None
    if dt_bias is not None:
        if (not isinstance(dt_bias, Tensor) or dt_bias.dtype not in PARAM_TYPES or dt_bias.device != device
                or not dt_bias.is_contiguous() or tuple(dt_bias.shape) not in ((HV, K), (HV * K,))):
            return None
    if cu_seqlens is None:
        N = B
    else:
        if (not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in CU_SEQLENS_DTYPES or cu_seqlens.dim() != 1
                or cu_seqlens.numel() < 2 or B != 1 or not cu_seqlens.is_contiguous()):
            return None
        if cu_seqlens.device != device and not (on_cuda and cu_seqlens.device.type == "cpu"):
            return None
        N = cu_seqlens.numel() - 1
    P = N  # rows of the state tensors: one per sequence, or the pools' slots
    if state_indices is not None:
        if (not isinstance(state_indices, Tensor) or state_indices.dtype not in STATE_INDEX_DTYPES
                or not state_indices.is_contiguous()):
            return None
        index_shape = state_indices.shape
        if index_shape != (N,):
            # per-token slots [N, L]: they write only into final_state
            if len(index_shape) != 2 or index_shape[0] != N or index_shape[1] < 1 or final_state is None:
                return None
        if state_indices.device != device and not (on_cuda and state_indices.device.type == "cpu"):
            return None
        if num_accepted_tokens is not None:
            if (len(index_shape) != 2 or not isinstance(num_accepted_tokens, Tensor)
                    or num_accepted_tokens.dtype not in STATE_INDEX_DTYPES or num_accepted_tokens.shape != (N,)
                    or not num_accepted_tokens.is_contiguous()):
                return None
            if num_accepted_tokens.device != device and not (on_cuda and num_accepted_tokens.device.type == "cpu"):
                return None
        pool = initial_state if initial_state is not None else final_state
        if not isinstance(pool, Tensor) or pool.dim() != 4 or pool.shape[0] < 1:
            return None
        P = pool.shape[0]
        if checkpoint_indices is not None:
            if (not isinstance(checkpoint_indices, Tensor) or len(index_shape) != 1 or final_state is None
                    or checkpoint_indices.dtype not in STATE_INDEX_DTYPES or checkpoint_indices.dim() != 2
                    or checkpoint_indices.shape[0] != N or checkpoint_indices.device != device
                    or not checkpoint_indices.is_contiguous()):
                return None
            if (type(checkpoint_every) is not int or checkpoint_every < CHECKPOINT_GRANULE
                    or checkpoint_every % CHECKPOINT_GRANULE):
                return None
    elif num_accepted_tokens is not None or checkpoint_indices is not None:
        return None
    if checkpoint_indices is None and (type(checkpoint_every) is not int or checkpoint_every):
        return None
    for t in (initial_state, final_state):
        if t is not None:
            if (not isinstance(t, Tensor) or t.dtype not in STATE_DTYPES or t.device != device
                    or not t.is_contiguous() or t.shape != (P, HV, HEAD_DIM, HEAD_DIM)):
                return None
    if workspace is not None:
        if (not isinstance(workspace, Tensor) or workspace.dtype != torch.uint8 or workspace.device != device
                or not workspace.is_contiguous()):
            return None
    if on_cuda and HV > MAX_HEADS:
        return None
    # Where each tensor lives (shapes are known by now, so byte sizes come from ints, not tensor calls): for the
    # alignment check on CUDA and the overlap filter everywhere. An absent tensor is the empty span (0, 0).
    big = B * T * HV * HEAD_DIM * 2
    key_bytes = big if HV == H else B * T * H * HEAD_DIM * 2
    state_bytes = P * HV * HEAD_DIM * HEAD_DIM
    aligned = [(q.data_ptr(), key_bytes), (k.data_ptr(), key_bytes), (v.data_ptr(), big), (g.data_ptr(), big),
               (out.data_ptr(), big), (0, 0) if dt_bias is None else (dt_bias.data_ptr(), dt_bias.nbytes)]
    for t in (initial_state, None if final_state is initial_state else final_state):  # (in place: once)
        if t is not None:
            aligned.append((t.data_ptr(), state_bytes * (4 if t.dtype == torch.float32 else 2)))
    if workspace is not None:
        aligned.append((workspace.data_ptr(), workspace.numel()))
    if on_cuda:
        for start, _ in aligned:
            if start % ALIGNMENT:
                return None
    spans = [*aligned, (beta.data_ptr(), B * T * HV * 2),
             (0, 0) if A_log is None else (A_log.data_ptr(), A_log.nbytes)]
    if cu_seqlens is not None and cu_seqlens.device == device:
        spans.append((cu_seqlens.data_ptr(), cu_seqlens.nbytes))
    if state_indices is not None and state_indices.device == device:
        spans.append((state_indices.data_ptr(), state_indices.nbytes))
    if num_accepted_tokens is not None and num_accepted_tokens.device == device:
        spans.append((num_accepted_tokens.data_ptr(), num_accepted_tokens.nbytes))
    if checkpoint_indices is not None:
        spans.append((checkpoint_indices.data_ptr(), checkpoint_indices.nbytes))
    if _spans_overlap(spans):
        return None  # (validate's first_overlap tells the allowed from the refused)
    if allow_neg_eigval is not False and allow_neg_eigval is not True:
        return None
    if type(scale) is not float or not abs(scale) < FP32_OVERFLOW:  # (NaN fails the comparison)
        return None
    if gate == "lower_bound":
        if type(lower_bound) is not float or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]:
            return None  # (NaN fails the range test; ±inf are outside it)
    elif gate == "softplus":
        if lower_bound is not None and (type(lower_bound) is not float or not abs(lower_bound) < math.inf):
            return None  # (unused; None or finite)
    else:
        return None
    return B, T, HV, N, H


def _spans_overlap(spans: list) -> bool:
    """Whether any two (start, nbytes) spans share a byte."""
    end = 0
    for start, nbytes in sorted(spans):
        if nbytes:
            if start < end:
                return True
            end = max(end, start + nbytes)
    return False


def first_overlap(tensors: dict) -> tuple[str, str] | None:
    """The first (written, other) pair of ``tensors`` (name -> contiguous tensor or None, all on one device)
    whose bytes overlap.

    Written tensors (``WRITTEN``) are checked in that order against every other tensor; ``final_state`` may be
    ``initial_state``'s memory exactly (the same first byte and dtype: in place)."""
    spans = {}
    for name, t in tensors.items():
        if t is not None:
            nbytes = t.nbytes
            if nbytes:
                start = t.data_ptr()
                spans[name] = (start, start + nbytes)
    for written in WRITTEN:
        span = spans.get(written)
        if span is None:
            continue
        start, end = span
        for other, (other_start, other_end) in spans.items():
            if other == written or not (start < other_end and other_start < end):
                continue
            if (written, other) == ("final_state", "initial_state") and start == other_start and (
                    tensors[written].dtype == tensors[other].dtype):
                continue  # in place
            return written, other
    return None


def _span_text(name: str, tensors: dict) -> str:
    t = tensors[name]
    return f"{name} bytes [{t.data_ptr():#x}, {t.data_ptr() + t.nbytes:#x})"


def check_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int) -> None:
    """Validates the contents of ``cu_seqlens`` on the host (this synchronises with the device).

    ``fwd`` does not read ``cu_seqlens`` on the host for CUDA tensors; call this where malformed boundaries may
    come from outside.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | cu_seqlens | int64 / int32 | [N + 1] | sequence boundaries |
    | total_tokens | int | — | T, the packed length (q.shape[1] with B = 1) |

    Raises ValueError naming the problem unless N >= 1, cu[0] == 0, cu is non-decreasing and cu[N] <= T (tokens
    from cu[N] on are padding, as CUDA-graph batches pad them: they belong to no sequence).
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        got = f"dtype {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor) else f"{type(cu_seqlens)=}"
        raise TypeError(f"cu_seqlens must be an int64 or int32 tensor, got {got}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got {cu_seqlens.shape=}")
    if cu_seqlens.device.type not in ("cpu", "cuda"):  # (a meta tensor has no contents to check)
        raise ValueError(f"cu_seqlens must be on the CPU or a CUDA device, got {cu_seqlens.device=}")
    if not isinstance(total_tokens, numbers.Integral) or isinstance(total_tokens, bool):
        raise TypeError(f"total_tokens must be an int (the packed length), got total_tokens={_shown(total_tokens)} "
                        f"of {type(total_tokens)=}")
    if not 0 <= total_tokens < 2**63:
        raise ValueError(f"total_tokens must be in [0, 2^63), got total_tokens={_shown(total_tokens)}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu[0] != 0:
        shown = cu.tolist() if cu.numel() <= 8 else f"[{', '.join(map(str, cu[:8].tolist()))}, ...]"
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu[0].item()} in cu_seqlens={shown}")
    steps = cu[1:] - cu[:-1]
    if (steps < 0).any():
        n = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{n}]={cu[n].item()} > "
            f"cu_seqlens[{n + 1}]={cu[n + 1].item()}"
        )
    if cu[-1] > total_tokens:
        raise ValueError(
            f"cu_seqlens[-1] must be at most the number of tokens {total_tokens} (tokens past it are padding), got "
            f"cu_seqlens[-1]={cu[-1].item()}"
        )


def check_state_indices(state_indices: torch.Tensor, pool_slots: int, writes: bool,
                        lengths: torch.Tensor | None = None) -> None:
    """Validates the contents of ``state_indices`` on the host (a CUDA tensor synchronises).

    ``fwd`` does this for free where the indices are on the CPU; on the device the kernels skip an index past the
    pool (memory stays safe) and ``flash_kda.last_error`` reports it.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | state_indices | int64 / int32 | [N] or [N, L] | pool slot of each sequence, or of each of its first L tokens; negative: none (a padding row) |
    | pool_slots | int | — | P, the pools' first dimension |
    | writes | bool | — | whether the call writes the pool (final_state given) |
    | lengths | int64 / None | [N] | with [N, L] indices: the sequences' lengths (``sequence_lengths``); None: unknown on the host |

    Raises ValueError naming the first index past the pool (>= P), or, when ``writes``, the first two writes of
    one slot (the result would be unspecified): two sequences that name one slot ([N]), or two of the written
    entries (n, t), t < min(L, lengths[n]), that name one slot ([N, L]; not checked when ``lengths`` is None, as
    for a CUDA ``cu_seqlens``: which entries are written is then not known on the host).
    """
    indices = state_indices.detach().to("cpu", torch.int64)
    flat = indices.flatten()
    past = torch.nonzero(flat >= pool_slots)
    if past.numel():
        i = int(past[0])
        raise ValueError(f"{_entry(indices, i)} = {int(flat[i])} is past the pool's last slot (P = {pool_slots}: "
                         "the initial_state / final_state pools' first dimension); negative indices mean no slot")
    if not writes or flat.numel() < 2:
        return
    written = flat >= 0
    if indices.dim() == 2:
        if lengths is None:
            return
        N, L = indices.shape
        steps = torch.arange(L).view(1, L)
        written &= (steps < lengths.to("cpu", torch.int64).view(N, 1)).flatten()
    valid = torch.nonzero(written).flatten()
    repeat = _first_repeat(flat[valid])
    if repeat is not None:
        first, second = sorted(int(valid[i]) for i in repeat)
        if indices.dim() == 1:
            raise ValueError(
                f"state_indices[{first}] and state_indices[{second}] both name slot {int(flat[first])}; with "
                "final_state given each slot may be named once (two sequences would write it)"
            )
        raise ValueError(
            f"{_entry(indices, first)} and {_entry(indices, second)} both name slot {int(flat[first])}; each "
            "slot may be written once (the state after token t of sequence n goes to state_indices[n, t] for "
            "t < min(L, the sequence's length))"
        )


def check_token_state_reads(state_indices: torch.Tensor, pool_slots: int, lengths: torch.Tensor,
                            num_accepted_tokens: torch.Tensor | None) -> None:
    """With per-token ``state_indices`` [N, L] and one pool in place: refuses a starting slot that another sequence
    writes (the host check of the CPU path; on CUDA such a slot is read and written by different CTAs in no fixed
    order, so the reading sequence's result is unspecified). Sequence n starts from slot ``state_indices[n, a_n -
    1]`` (a_n = ``num_accepted_tokens[n]``, 1 without it) if it has a token; entries (n', t) with t < min(L,
    lengths[n']) are written, each in a slot of its own (``check_state_indices`` first). Two pools are read and
    written apart: no check is needed then.

    Raises ValueError naming the starting entry and the other sequence's written entry."""
    indices = state_indices.detach().to("cpu", torch.int64)
    N, L = indices.shape
    lengths = lengths.to("cpu", torch.int64).view(N)
    accepted = (torch.ones(N, dtype=torch.int64) if num_accepted_tokens is None
                else num_accepted_tokens.detach().to("cpu", torch.int64).view(N))
    written = (indices >= 0) & (torch.arange(L).view(1, L) < lengths.view(N, 1))
    # The writing entry n·L + t of each slot (-1: none); slot P is a sink for the unwritten entries.
    writer = torch.full((pool_slots + 1,), -1, dtype=torch.int64)
    writer[torch.where(written, indices, pool_slots)] = torch.where(written, torch.arange(N * L).view(N, L), -1)
    # Each reading sequence's starting slot: it has a token and a count in [1, L] (else nothing is read).
    reads = (lengths > 0) & (accepted >= 1) & (accepted <= L)
    starts = indices.gather(1, (accepted.clamp(1, L) - 1).view(N, 1)).view(N)
    by = writer[torch.where(reads & (starts >= 0), starts, pool_slots)]
    clash = torch.nonzero((by >= 0) & (by // L != torch.arange(N))).flatten()
    if clash.numel():
        n = int(clash[0])
        other_n, other_t = divmod(int(by[n]), L)
        raise ValueError(
            f"state_indices[{n}, {int(accepted[n]) - 1}] = {int(starts[n])}, sequence {n}'s starting slot, is written "
            f"by state_indices[{other_n}, {other_t}] (another sequence's token state); with initial_state and "
            "final_state one pool, a slot one sequence starts from may not be written by another (their CTAs "
            "read and write it in no fixed order)"
        )


def _first_repeat(slots: torch.Tensor) -> tuple[int, int] | None:
    """The positions in ``slots`` (1-D) of the smallest value that occurs twice, its first two in order; None if
    every value occurs once."""
    ordered, order = torch.sort(slots, stable=True)
    same = torch.nonzero(ordered[1:] == ordered[:-1]).flatten()
    if not same.numel():
        return None
    return int(order[int(same[0])]), int(order[int(same[0]) + 1])


def _entry(indices: torch.Tensor, flat_index: int) -> str:
    """``state_indices[n]`` or ``state_indices[n, t]``: the entry at ``flat_index`` of the flattened indices."""
    if indices.dim() == 1:
        return f"state_indices[{flat_index}]"
    n, t = divmod(flat_index, indices.shape[1])
    return f"state_indices[{n}, {t}]"


def check_num_accepted_tokens(num_accepted_tokens: torch.Tensor, state_tokens: int) -> None:
    """Validates the contents of ``num_accepted_tokens`` on the host (a CUDA tensor synchronises).

    ``fwd`` does this for free where they are on the CPU; on the device a count outside [1, L] gives its sequence
    no starting slot (it starts from zeros) and ``flash_kda.last_error`` reports it.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | num_accepted_tokens | int64 / int32 | [N] | a_n: sequence n starts from slot state_indices[n, a_n − 1] |
    | state_tokens | int | — | L, the per-token ``state_indices``' second dimension |

    Raises ValueError naming the first count outside [1, L].
    """
    accepted = num_accepted_tokens.detach().to("cpu", torch.int64)
    outside = torch.nonzero((accepted < 1) | (accepted > state_tokens)).flatten()
    if outside.numel():
        n = int(outside[0])
        raise ValueError(
            f"num_accepted_tokens[{n}] = {int(accepted[n])} is outside [1, L] = [1, {state_tokens}] (L: "
            f"state_indices.shape[1]; sequence n starts from slot state_indices[n, num_accepted_tokens[n] - 1])"
        )


def check_checkpoint_indices(checkpoint_indices: torch.Tensor, pool_slots: int,
                             state_indices: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                             checkpoint_every: int = 0) -> None:
    """Validates the contents of ``checkpoint_indices`` on the host (a CUDA tensor synchronises).

    ``fwd`` does this for free where they are on the CPU (the CPU path); on the device the kernels skip an entry
    past the pool (memory stays safe) and ``flash_kda.last_error`` reports it.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | checkpoint_indices | int64 / int32 | [N, M] | slot of sequence n's state after its first (m+1)·C tokens; negative: none |
    | pool_slots | int | — | P, the pools' first dimension |
    | state_indices | int64 / int32 / None | [N] | the sequences' slots (their final states are written there) |
    | lengths | int64 / None | [N] | the sequences' lengths (``sequence_lengths``); None: unknown on the host |
    | checkpoint_every | int | — | C |

    Raises ValueError naming the first entry past the pool (>= P) as ``checkpoint_indices[n, m]``; then, with
    ``state_indices`` and ``lengths`` given, the first two writes of one slot: two written checkpoints
    ((m + 1)·C <= lengths[n]), or a written checkpoint and another sequence's final state (``state_indices[n']``),
    name one slot. The kernels write them from different CTAs in no fixed order (two sequences, or two segments of
    one sequence under the time split), so such a slot would be unspecified. A checkpoint may name its own
    sequence's final slot: the kernels leave that slot to the final state.
    """
    indices = checkpoint_indices.detach().to("cpu", torch.int64)
    past = torch.nonzero(indices.flatten() >= pool_slots)
    if past.numel():
        n, m = divmod(int(past[0]), indices.shape[1])
        raise ValueError(f"checkpoint_indices[{n}, {m}] = {int(indices[n, m])} is past the pool's last slot "
                         f"(P = {pool_slots}: the final_state pool's first dimension); negative entries mean no "
                         "checkpoint")
    if state_indices is None or lengths is None or checkpoint_every <= 0 or indices.numel() == 0:
        return
    N, M = indices.shape
    finals = state_indices.detach().to("cpu", torch.int64).view(N, 1)
    reached = pools.checkpoints_reached(lengths, checkpoint_every, M)
    written = (indices >= 0) & reached & (indices != finals)  # (own final slot: the final state's)
    # Every write as (slot, entry): final states first (entry n), then the written checkpoints (entry N + n·M + m).
    entries = torch.cat([torch.nonzero(finals.flatten() >= 0).flatten(), N + torch.nonzero(written.flatten()).flatten()])
    slots = torch.cat([finals.flatten(), indices.flatten()])[entries]
    repeat = _first_repeat(slots)
    if repeat is None:
        return
    first, second = sorted(int(entries[i]) for i in repeat)

    def name(entry: int) -> str:
        if entry < N:
            return f"state_indices[{entry}] (sequence {entry}'s final state)"
        n, m = divmod(entry - N, M)
        return f"checkpoint_indices[{n}, {m}]"

    raise ValueError(f"{name(first)} and {name(second)} both write slot {int(slots[repeat[0]])}; each slot may "
                     "be written once per call (checkpoints and final states are written by different CTAs in no "
                     "fixed order; a checkpoint may name its own sequence's final slot, which keeps the final state)")


def sequence_lengths(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int) -> torch.Tensor:
    """The sequences' lengths, int64 [N] on the CPU: ``seqlen`` for each of the ``batch`` rows without
    ``cu_seqlens``, else its differences (reads a CUDA ``cu_seqlens``: a synchronisation)."""
    if cu_seqlens is None:
        return torch.full((batch,), seqlen, dtype=torch.int64)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    return cu[1:] - cu[:-1]


def pool_slots(initial_state: torch.Tensor | None, final_state: torch.Tensor | None, num_seqs: int,
               state_indices: torch.Tensor | None) -> int:
    """P, the state tensors' first dimension: the pools' slots with ``state_indices``, else N (one per sequence)."""
    if state_indices is None:
        return num_seqs
    return (initial_state if initial_state is not None else final_state).shape[0]


def cu_seqlens_on_host(q: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    return q.device.type == "cuda" and cu_seqlens.device.type == "cpu"


def checked_cu_seqlens() -> bool:
    """FLASH_KDA_CHECK_CU_SEQLENS=1: validate a CUDA cu_seqlens on the host before every call (synchronises)."""
    return os.environ.get(CHECK_CU_SEQLENS_ENV, "0") not in ("", "0")


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_capabilities: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, read once per device (a seam for tests, which monkeypatch it)."""
    index = device_index(device)
    capability = _capabilities.get(index)
    if capability is None:
        capability = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return capability


def check_arch(device: torch.device) -> None:
    capability = tuple(device_capability(device))
    if capability != REQUIRED_CAPABILITY:
        raise RuntimeError(
            f"flash_kda's CUDA kernel is built for sm_90a and needs compute capability 9.0 (H100/H200), "
            f"got device {device} with capability {capability}; use CPU tensors for the portable path"
        )

