"""fla's recurrent KDA forward (the decode path of serving engines) on ``flash_kda.fwd``, when asked for.

fla 0.6 dispatches ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (what ``fused_recurrent_kda`` and its
serving callers run, one or a few tokens per sequence, states in a pool) through ``fla.backends``: each call asks
the registered backends in priority order whether they take it and otherwise runs fla's own Triton kernel.
``register()`` adds a backend of type ``"flash_kda"`` to that dispatch; nothing changes in fla until it is
called, and ``import flash_kda`` never imports fla::

    import flash_kda.fla_backend
    flash_kda.fla_backend.register()      # once per process; calling it again replaces the same entry

The backend takes a call only where ``flash_kda.fwd`` computes what fla's kernel would (``unsupported`` says
why not; every refusal runs fla's kernel, and fla logs the reason once):

- the KDA of ``flash_kda.fwd``: ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel`` with the lower-bound gate
  (``lower_bound`` in [-5, 0], ``A_log`` and ``dt_bias`` given), ``use_beta_sigmoid_in_kernel``, no
  ``allow_neg_eigval``, ``state_v_first=True``, per-head beta [B, T, H], as many value heads as key heads;
- q, k, v, g, beta (and ``out`` when given) bf16, K = V = 128, contiguous, 16-byte aligned, on one CUDA device of
  compute capability 9.0; the initial state bf16 or fp32; no input that requires grad while grad is enabled;
- ``cu_seqlens`` or fixed length; ``ssm_state_indices`` None or 1-D with ``inplace_final_state=True`` and one
  token per sequence (fla reads a 1-D index per token, which is a slot per sequence only then); no
  ``num_accepted_tokens`` (speculative decoding) and no arguments fla's signature does not name.

The call maps onto ``flash_kda.fwd`` as fla's function defines its results: ``out`` (allocated like ``v`` when not
given) receives the output; with ``inplace_final_state`` the final states go into ``initial_state`` (a pool
indexed by ``ssm_state_indices``, or one state per sequence), otherwise into a new fp32 [N, H, V, K] tensor when
``output_final_state``; fla's flat ``dt_bias`` [H·K] is viewed as [H, K]. It returns ``(out, final_state)`` like
fla (``final_state`` is ``initial_state`` itself in place, None without final states). A negative or too large
slot index starts from zeros and writes nothing (``flash_kda.fwd``'s pool rule).

``FLA_FLASH_KDA=0`` turns the backend off like fla's own ``chunk_kda`` dispatch to this package, and fla's
``FLA_DISABLE_BACKEND_DISPATCH=1`` bypasses every backend.
"""

from __future__ import annotations

import importlib
import numbers
import warnings

import torch

import flash_kda
from flash_kda.validation import (
    ALIGNMENT,
    CU_SEQLENS_DTYPES,
    FP32_OVERFLOW,
    HEAD_DIM,
    LOWER_BOUND_RANGE,
    MAX_HEADS,
    PARAM_TYPES,
    REQUIRED_CAPABILITY,
    STATE_DTYPES,
    STATE_INDEX_DTYPES,
    device_capability,
    first_overlap,
)

__all__ = ["register", "unsupported", "fused_recurrent_kda_fwd", "BACKEND_TYPE", "PRIORITY", "ENV_VAR",
           "FLA_FUNCTION"]

BACKEND_TYPE = "flash_kda"  # fla's registry keeps one backend per type per operation: registering again replaces it
PRIORITY = 3  # fla tries lower values first; its own backends for "kda" use 0 (Ascend NPUs only) and 5 (TileLang)
ENV_VAR = "FLA_FLASH_KDA"  # "0" turns the backend off (the switch of fla's chunk_kda dispatch to flash_kda)
FLA_OPERATION = "kda"  # the fla.backends operation whose dispatched functions include FLA_FUNCTION
FLA_FUNCTION = "fused_recurrent_kda_fwd"
_FLA_MODULE = "fla.ops.kda.fused_recurrent"


def register() -> None:
    """Registers the backend with fla 0.6's ``fla.backends.register`` for ``fused_recurrent_kda_fwd``.

    Imports fla (which needs triton). Raises ImportError naming what is missing when fla is not importable or
    has no backend registry (fla < 0.6). Idempotent: fla keeps one backend per type, so a second call replaces
    the first with an equal one. Warns when ``FLA_DISABLE_BACKEND_DISPATCH=1`` keeps fla from consulting any
    backend.
    """
    try:
        import fla  # noqa: PLC0415 -- lazily: importing flash_kda must not import fla
    except ImportError as error:
        raise ImportError(
            "flash_kda.fla_backend.register() needs fla (pip install flash-linear-attention>=0.6), which is not "
            f"importable: {error}"
        ) from error
    version = getattr(fla, "__version__", "unknown")
    try:
        import fla.backends as fla_backends  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(f"flash_kda.fla_backend.register() needs fla.backends (fla >= 0.6); fla {version} has "
                          f"none: {error}") from error
    if not callable(getattr(fla_backends, "register", None)) or not isinstance(
            getattr(fla_backends, "BaseBackend", None), type):
        raise ImportError(f"flash_kda.fla_backend.register() needs fla.backends.register and BaseBackend "
                          f"(fla >= 0.6); fla {version} lacks them")
    try:
        # The dispatched function lives here; importing it also loads fla's own backends for the operation.
        fla_module = importlib.import_module(_FLA_MODULE)
    except ImportError as error:
        raise ImportError(f"flash_kda.fla_backend.register() needs {_FLA_MODULE} (fla >= 0.6); fla {version}: "
                          f"{error}") from error
    if not hasattr(fla_module, FLA_FUNCTION):
        raise ImportError(f"fla {version} has no {_FLA_MODULE}.{FLA_FUNCTION}; flash_kda.fla_backend needs "
                          "fla >= 0.6")
    if getattr(fla_backends, "_DISPATCH_DISABLED", False):
        warnings.warn("FLA_DISABLE_BACKEND_DISPATCH=1: fla consults no backend, so fused_recurrent_kda_fwd keeps "
                      "running fla's own kernel", RuntimeWarning, stacklevel=2)
    fla_backends.register(FLA_OPERATION)(_backend_class(fla_backends.BaseBackend))


_classes: dict[type, type] = {}  # fla's BaseBackend -> our subclass (one class per base, whatever the calls)


def _backend_class(base: type) -> type:
    """The backend as a subclass of fla's ``BaseBackend``: fla finds ``<function>`` and ``<function>_verifier``
    by name and, for the operation's other dispatched functions, finds neither and passes them on."""
    cls = _classes.get(base)
    if cls is None:

        class FlashKDARecurrentBackend(base):
            """flash_kda.fwd for fla's fused_recurrent_kda_fwd (see flash_kda.fla_backend)."""

            backend_type = BACKEND_TYPE
            package_name = None  # (no import check: this package is the caller)
            env_var = ENV_VAR
            default_enable = True
            priority = PRIORITY

            def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
                reason = unsupported(*args, **kwargs)
                return reason is None, reason

            def fused_recurrent_kda_fwd(self, *args, **kwargs):
                return fused_recurrent_kda_fwd(*args, **kwargs)  # (the module's function)

        cls = _classes[base] = FlashKDARecurrentBackend
    return cls


def kernel_device(device: torch.device) -> str | None:
    """Why tensors on ``device`` cannot run the kernel, or None (a CUDA device of compute capability 9.0)."""
    if device.type != "cuda":
        return f"flash_kda's kernel needs CUDA tensors, got q.device={device}"
    capability = tuple(device_capability(device))
    if capability != REQUIRED_CAPABILITY:
        return f"flash_kda's kernel needs compute capability 9.0 (sm_90a), got {capability} on {device}"
    return None


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# The signature of fla 0.6's fused_recurrent_kda_fwd (callers pass any of these by position or by name).
def unsupported(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                lower_bound=None, out=None, **kwargs) -> str | None:
    """Why ``flash_kda.fwd`` cannot compute this call of fla's ``fused_recurrent_kda_fwd``, or None to take it.

    The backend's verifier: the module docstring lists what it takes. Host work only (no synchronisation).
    """
    # --- what the arguments mean: the KDA of flash_kda.fwd and nothing else
    if kwargs:
        return f"arguments fla 0.6's signature does not name: {sorted(kwargs)}"
    if num_accepted_tokens is not None:
        return "num_accepted_tokens (speculative decoding) is not supported"
    if not state_v_first:
        return "needs state_v_first=True (states [N, H, V, K])"
    if not use_qk_l2norm_in_kernel:
        return "needs use_qk_l2norm_in_kernel=True"
    if not use_gate_in_kernel:
        return "needs use_gate_in_kernel=True"
    if not use_beta_sigmoid_in_kernel:
        return "needs use_beta_sigmoid_in_kernel=True"
    if allow_neg_eigval:
        return "allow_neg_eigval=True is not supported"
    if lower_bound is None:
        return "needs the lower-bound gate (lower_bound given)"
    if not _is_number(lower_bound) or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]:
        return f"lower_bound must be a number in {list(LOWER_BOUND_RANGE)}, got {lower_bound=}"
    if A_log is None or dt_bias is None:
        return f"needs A_log and dt_bias, got A_log={type(A_log).__name__}, dt_bias={type(dt_bias).__name__}"
    if scale is not None and (not _is_number(scale) or not abs(scale) < FP32_OVERFLOW):  # (NaN fails too)
        return f"scale must be finite in float32, got {scale=}"
    if inplace_final_state and initial_state is None:
        return "inplace_final_state=True without initial_state (fla's own kernel refuses it)"
    if ssm_state_indices is not None and not inplace_final_state:
        return "ssm_state_indices with inplace_final_state=False (fla then writes a state per token, not a pool)"

    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t is None:
            return f"{name} is required, got {name}=None"
    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
        "initial_state": initial_state, "cu_seqlens": cu_seqlens, "ssm_state_indices": ssm_state_indices,
        "out": out,
    }  # fmt: skip
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
    if torch.is_grad_enabled():
        for name, t in given.items():
            if t.requires_grad:
                return f"{name} requires grad (flash_kda.fwd has no backward)"

    # --- device: the kernel's (cu_seqlens and the indices may also be on the CPU: flash_kda.fwd copies them)
    device = q.device
    reason = kernel_device(device)
    if reason is not None:
        return reason
    for name, t in given.items():
        if t.device != device and not (name in ("cu_seqlens", "ssm_state_indices") and t.device.type == "cpu"):
            return f"all tensors must be on one device, got q.device={device} but {name}.device={t.device}"

    # --- dtype
    for name in ("q", "k", "v", "g", "beta", "out"):
        if name in given and given[name].dtype != torch.bfloat16:
            return f"{name} must be bfloat16, got {name}.dtype={given[name].dtype}"
    for name in ("A_log", "dt_bias"):
        if given[name].dtype not in PARAM_TYPES:
            return f"{name} must be float32, bfloat16 or float16, got {name}.dtype={given[name].dtype}"
    if initial_state is not None and initial_state.dtype not in STATE_DTYPES:
        return f"initial_state must be bfloat16 or float32, got {initial_state.dtype=}"
    if cu_seqlens is not None and cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        return f"cu_seqlens must be int64 or int32, got {cu_seqlens.dtype=}"
    if ssm_state_indices is not None and ssm_state_indices.dtype not in STATE_INDEX_DTYPES:
        return f"ssm_state_indices must be int64 or int32, got {ssm_state_indices.dtype=}"

    # --- layout: flash_kda.fwd takes contiguous tensors whose rows start 16-byte aligned
    for name, t in given.items():
        if not t.is_contiguous():
            return f"{name} must be contiguous, got {name}.stride()={t.stride()} for shape {tuple(t.shape)}"
        if name not in ("beta", "A_log", "cu_seqlens", "ssm_state_indices") and t.data_ptr() % ALIGNMENT:
            return f"{name} must start {ALIGNMENT}-byte aligned, got {name}.data_ptr() % {ALIGNMENT} = " \
                   f"{t.data_ptr() % ALIGNMENT}"

    # --- shape
    if q.dim() != 4 or q.shape[-1] != HEAD_DIM:
        return f"q must be [B, T, H, {HEAD_DIM}], got {q.shape=}"
    B, T, H, K = q.shape
    for name in ("k", "v", "g", "out"):
        if name in given and given[name].shape != q.shape:
            return f"{name} must have q's shape {list(q.shape)} (V = {HEAD_DIM}, one value head per key head), " \
                   f"got {name}.shape={tuple(given[name].shape)}"
    if beta.shape != q.shape[:3]:
        return f"beta must be [B, T, H] = {[B, T, H]} (one beta per head), got {beta.shape=}"
    if A_log.shape != (H,):
        return f"A_log must be [H] = [{H}], got {A_log.shape=}"
    if tuple(dt_bias.shape) not in ((H * K,), (H, K)):
        return f"dt_bias must be [H * K] = [{H * K}] or [H, K], got {dt_bias.shape=}"
    if H > MAX_HEADS:
        return f"at most {MAX_HEADS} heads, got {q.shape=}"
    if cu_seqlens is None:
        N = B
    else:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or B != 1:
            return f"cu_seqlens must be [N + 1] (N >= 1) with B = 1, got {cu_seqlens.shape=}, {q.shape=}"
        N = cu_seqlens.numel() - 1
    if ssm_state_indices is not None:
        if ssm_state_indices.dim() != 1 or ssm_state_indices.shape[0] != N:
            return f"ssm_state_indices must be 1-D [N] = [{N}], got {ssm_state_indices.shape=}"
        if B * T != N:
            return f"ssm_state_indices needs one token per sequence, got {B * T} tokens for N = {N} sequences"
        if initial_state.dim() != 4 or initial_state.shape[0] < 1 or initial_state.shape[1:] != (H, HEAD_DIM,
                                                                                                HEAD_DIM):
            return f"initial_state must be a pool [P, H, V, K] = [P, {H}, {HEAD_DIM}, {HEAD_DIM}], got " \
                   f"{initial_state.shape=}"
    elif initial_state is not None and initial_state.shape != (N, H, HEAD_DIM, HEAD_DIM):
        return f"initial_state must be [N, H, V, K] = {[N, H, HEAD_DIM, HEAD_DIM]}, got {initial_state.shape=}"

    # --- memory: what is written overlaps nothing else (the in-place state only its own initial state)
    if out is not None or inplace_final_state:
        same_device = {name: t for name, t in given.items() if t.device == device}
        if inplace_final_state:
            same_device["final_state"] = initial_state
        overlap = first_overlap(same_device)
        if overlap is not None:
            return f"{overlap[0]} overlaps {overlap[1]} in memory"
    return None


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False,
                            cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda_fwd`` by ``flash_kda.fwd``, for a call ``unsupported`` takes.

    | fla argument | passed to flash_kda.fwd as |
    |---|---|
    | q, k, v, g, beta [B, T, H, ·] | the same tensors |
    | scale (None: K**-0.5), lower_bound | scale, lower_bound (floats) |
    | A_log [H], dt_bias [H·K] | A_log, dt_bias viewed as [H, K] |
    | out (None: a new tensor like v) | out, returned |
    | initial_state [N, H, V, K], or a pool [P, H, V, K] with ssm_state_indices | initial_state |
    | inplace_final_state | final_state = initial_state |
    | output_final_state without inplace_final_state | final_state = new fp32 [N, H, V, K] |
    | cu_seqlens, ssm_state_indices [N] | cu_seqlens, state_indices |

    Returns ``(out, final_state)``: ``final_state`` is ``initial_state`` in place, the new tensor, or None.
    """
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if out is None:
        out = torch.empty_like(v)  # (fla zero-fills it; every element is written here)
    if inplace_final_state:
        final_state = initial_state
    elif output_final_state:
        final_state = q.new_empty(N, H, v.shape[-1], K, dtype=torch.float32)
    else:
        final_state = None
    if dt_bias.dim() == 1:
        dt_bias = dt_bias.view(H, K)
    flash_kda.fwd(q, k, v, g, beta, K**-0.5 if scale is None else float(scale), out, A_log, dt_bias,
                  float(lower_bound), initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
                  state_indices=ssm_state_indices)
    return out, final_state
