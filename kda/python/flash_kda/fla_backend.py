"""fla's KDA forward (its ``chunk_kda`` and its recurrent decode path) on ``flash_kda.fwd``, when asked for.

fla 0.6 dispatches two KDA entry points through ``fla.backends``: each call asks the registered backends in
priority order whether they take it (``<function>_verifier``) and otherwise runs fla's own Triton kernels.

- ``fla.ops.kda.chunk_kda``: what fla's ``KimiDeltaAttention`` layer runs in ``mode="chunk"`` (prefill, and any
  call of more than 64 tokens). fla 0.6 ships a backend of its own for this package there
  (``fla.ops.kda.backends.flash_kda``, type ``"flash_kda"``, on whenever ``flash_kda`` is importable) that takes
  the lower-bound gate with ``safe_gate=True`` only: no softplus gate (the layer's default), no grouped value heads,
  no negative eigenvalues.
- ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``: what ``fused_recurrent_kda`` and serving engines run (one
  or a few tokens per sequence, states in a pool; the layer's path for at most 64 tokens in inference).

``register()`` adds a backend of type ``"flash_kda"`` to both dispatches: for ``chunk_kda`` it replaces fla's own
backend of that type (fla keeps one backend per type per entry point) with one that takes every configuration
``flash_kda.fwd`` computes. Nothing changes in fla until it is called, and ``import flash_kda`` never imports fla::

    import flash_kda.fla_backend
    flash_kda.fla_backend.register()      # once per process; calling it again replaces the same entries

Both backends take a call only where ``flash_kda.fwd`` computes what fla's kernels would (``chunk_unsupported`` and
``unsupported`` say why not; every refusal runs fla's kernels, and fla logs the reason once):

- the KDA of ``flash_kda.fwd``: ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``
  and ``state_v_first=True``; either gate, as fla chooses it: ``lower_bound`` given (in [-5, 0]; ``chunk_kda`` with
  ``safe_gate`` in [-5, 0)) is the lower-bound gate ``lower_bound·sigmoid(exp(A_log)·(g + dt_bias))``, else the
  softplus gate ``-exp(A_log)·softplus(g + dt_bias)`` (A_log required: fla refuses it without, or, in its recurrent
  kernel, takes exp(A_log) as e); ``A_log`` None (lower-bound gate) and ``dt_bias`` None as fla reads them;
  ``allow_neg_eigval`` (β = 2·sigmoid(beta));
- grouped value heads: q, k [B, T, H, K], v, g [B, T, HV, ·], beta [B, T, HV], A_log [HV], dt_bias [HV·K] or
  [HV, K], states [N or P, HV, V, K], HV a multiple of H (value head hv reads key head hv // (HV / H), as in fla);
- q, k, v, g, beta (and ``out`` when given) bf16, K = V = 128, on one CUDA device of compute capability 9.0;
  states bf16 or fp32 (fla's own ``chunk_kda`` path takes fp32 only); A_log and dt_bias fp32, bf16 or fp16;
  ``cu_seqlens`` (int64 or int32) or fixed length; no input that requires grad while grad is enabled (the kernel
  has no backward: training runs fla's kernels);
- ``chunk_kda``: any strides and offsets (the call makes dense copies where needed: it writes only new tensors);
  ``chunk_size`` 32 or 64 (a tiling choice of fla's kernels; ours has its own), ``disable_recompute``, ``use_graph``
  (with ``max_num_seqs`` equal to the number of sequences) and ``cu_seqlens_cpu`` (a hint) are accepted; refused:
  ``cp_context`` (context parallel), ``return_intermediate_states``, arguments fla's signature does not name;
- ``fused_recurrent_kda_fwd``: contiguous, 16-byte aligned tensors (it writes states in place);
  ``ssm_state_indices`` None, 1-D with ``inplace_final_state=True`` and at most one token per sequence (fla reads a
  1-D index per token, which is a slot per sequence only then; with a CUDA ``cu_seqlens``, which is not read, T <= N
  and sequences of at most one token are assumed), or 2-D [N, L] with ``inplace_final_state=True`` and
  optionally ``num_accepted_tokens`` (speculative decoding: the state after token t into slot [n, t], the start from
  slot [n, num_accepted_tokens[n] − 1]); refused: per-channel beta, an inference tensor written outside inference
  mode (``fwd`` refuses it; fla's kernel writes it), arguments fla's signature does not name;
- padding tokens past ``cu_seqlens[-1]`` (a batch padded to a CUDA graph's size): zero ``out`` rows there in
  ``fused_recurrent_kda_fwd``, as fla's kernel leaves them (``chunk_kda``: unspecified, as in fla).

The calls map onto ``flash_kda.fwd`` as fla's functions define their results (``chunk_kda`` and
``fused_recurrent_kda_fwd`` below have the tables): out like v, bf16; final states fp32 [N, HV, V, K] when asked
for (or, in the recurrent path with ``inplace_final_state``, written into ``initial_state``, a pool indexed by
``ssm_state_indices`` or one state per sequence); fla's flat ``dt_bias`` [HV·K] viewed as [HV, K]. Slot indices
follow ``flash_kda.fwd``'s pool rule: a negative index starts from zeros and writes nothing; on the device, so does
one past the pool (``flash_kda.last_error()`` names it); a CPU ``ssm_state_indices`` is checked before the call,
and one past the pool, or a slot written twice, is refused with a ValueError naming the entry.

``FLA_FLASH_KDA=0`` turns both backends off (it is fla's switch for backends of type ``"flash_kda"``, read at every
call), and fla's ``FLA_DISABLE_BACKEND_DISPATCH=1`` bypasses every backend.
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
    first_requiring_grad,
    sequence_lengths,
)

__all__ = ["register", "unsupported", "chunk_unsupported", "fused_recurrent_kda_fwd", "chunk_kda", "BACKEND_TYPE",
           "PRIORITY", "ENV_VAR", "FLA_FUNCTION", "FLA_CHUNK_FUNCTION"]

BACKEND_TYPE = "flash_kda"  # fla's registries keep one backend per type per entry point: registering again replaces it
PRIORITY = 3  # fla tries lower values first; its own backends for "kda" use 0 (Ascend NPUs only), 3 (its chunk_kda
# backend for this package, which ours replaces) and 5 (TileLang)
ENV_VAR = "FLA_FLASH_KDA"  # "0" turns the backends off (the switch of fla's own chunk_kda dispatch to flash_kda)
FLA_OPERATION = "kda"  # the fla.backends operation whose dispatched functions include FLA_FUNCTION
FLA_FUNCTION = "fused_recurrent_kda_fwd"
FLA_CHUNK_FUNCTION = "chunk_kda"  # dispatched by function (fla.backends.dispatch(chunk_kda)), not by operation
_FLA_MODULE = "fla.ops.kda.fused_recurrent"
_FLA_CHUNK_MODULE = "fla.ops.kda.chunk"
_FLA_OWN_BACKEND_MODULE = "fla.ops.kda.backends.flash_kda"  # fla's own chunk_kda backend for this package
CHUNK_SIZES = (32, 64)  # the chunk sizes fla's chunk_kda takes (others raise in fla)
# chunk_kda's keyword arguments beyond its named parameters that the backend reads (fla passes the others on).
_CHUNK_KWARGS = ("A_log", "dt_bias", "chunk_size", "transpose_state_layout")


def register() -> None:
    """Registers the backend with fla 0.6's ``fla.backends.register`` for ``chunk_kda`` (replacing fla's own
    backend of type "flash_kda" there) and for ``fused_recurrent_kda_fwd``.

    Imports fla (which needs triton). Raises ImportError naming what is missing when fla is not importable, has no
    backend registry (fla < 0.6) or does not dispatch these functions, before registering anything. Idempotent:
    fla keeps one backend per type, so a second call replaces the first with an equal one. Warns when
    ``FLA_DISABLE_BACKEND_DISPATCH=1`` keeps fla from consulting any backend.
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
    functions = {}
    for module_name, function in ((_FLA_MODULE, FLA_FUNCTION), (_FLA_CHUNK_MODULE, FLA_CHUNK_FUNCTION)):
        try:
            # Importing the module also loads fla's own backends for its functions (fla.ops.kda's __init__ loads
            # its chunk_kda backend for this package), so that ours replaces that one below, not the reverse.
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(f"flash_kda.fla_backend.register() needs {module_name} (fla >= 0.6); fla {version}: "
                              f"{error}") from error
        if not hasattr(module, function):
            raise ImportError(f"fla {version} has no {module_name}.{function}; flash_kda.fla_backend needs fla >= 0.6")
        functions[function] = getattr(module, function)
    try:
        importlib.import_module(_FLA_OWN_BACKEND_MODULE)
    except ImportError:
        pass  # (a fla without a chunk_kda backend for this package: nothing to replace)
    if getattr(fla_backends, "_DISPATCH_DISABLED", False):
        warnings.warn("FLA_DISABLE_BACKEND_DISPATCH=1: fla consults no backend, so chunk_kda and "
                      "fused_recurrent_kda_fwd keep running fla's own kernels", RuntimeWarning, stacklevel=2)
    cls = _backend_class(fla_backends.BaseBackend)
    try:
        fla_backends.register(functions[FLA_CHUNK_FUNCTION])(cls)
    except KeyError as error:  # fla.backends keeps a registry only for the functions it dispatches
        raise ImportError(f"fla {version} does not dispatch {_FLA_CHUNK_MODULE}.{FLA_CHUNK_FUNCTION} through "
                          "fla.backends; flash_kda.fla_backend needs fla >= 0.6") from error
    fla_backends.register(FLA_OPERATION)(cls)


_classes: dict[type, type] = {}  # fla's BaseBackend -> our subclass (one class per base, whatever the calls)


def _backend_class(base: type) -> type:
    """The backend as a subclass of fla's ``BaseBackend``: fla finds ``<function>`` and ``<function>_verifier``
    by name and, for the other functions of a registry, finds neither and passes them on."""
    cls = _classes.get(base)
    if cls is None:

        class FlashKDABackend(base):
            """flash_kda.fwd for fla's chunk_kda and fused_recurrent_kda_fwd (see flash_kda.fla_backend)."""

            backend_type = BACKEND_TYPE
            package_name = None  # (no import check: this package is the caller)
            env_var = ENV_VAR
            default_enable = True
            priority = PRIORITY

            def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
                reason = chunk_unsupported(*args, **kwargs)
                return reason is None, reason

            def chunk_kda(self, *args, **kwargs):
                return chunk_kda(*args, **kwargs)  # (the module's function)

            def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
                reason = unsupported(*args, **kwargs)
                return reason is None, reason

            def fused_recurrent_kda_fwd(self, *args, **kwargs):
                return fused_recurrent_kda_fwd(*args, **kwargs)  # (the module's function)

        cls = _classes[base] = FlashKDABackend
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


# --- checks both verifiers share ------------------------------------------------------------------------------


def _flags_problem(state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel) -> str | None:
    if not state_v_first:
        return "needs state_v_first=True (states [N, H, V, K])"
    if not use_qk_l2norm_in_kernel:
        return "needs use_qk_l2norm_in_kernel=True"
    if not use_gate_in_kernel:
        return "needs use_gate_in_kernel=True"
    if not use_beta_sigmoid_in_kernel:
        return "needs use_beta_sigmoid_in_kernel=True"
    return None


def _gate_problem(lower_bound, A_log, scale) -> str | None:
    """The gate fla computes (lower_bound given: the lower-bound gate, else softplus) and scale."""
    if lower_bound is not None:
        if not _is_number(lower_bound) or not LOWER_BOUND_RANGE[0] <= lower_bound <= LOWER_BOUND_RANGE[1]:
            return f"lower_bound must be None (softplus gate) or a number in {list(LOWER_BOUND_RANGE)}, got " \
                   f"{lower_bound=}"
    elif A_log is None:
        return "the softplus gate (lower_bound=None) needs A_log (fla refuses it without A_log, or takes exp(A_log) " \
               "as e in its recurrent kernel)"
    if scale is not None and (not _is_number(scale) or not abs(scale) < FP32_OVERFLOW):  # (NaN fails too)
        return f"scale must be finite in float32, got {scale=}"
    return None


def _kda_problem(state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                 lower_bound, A_log, scale) -> str | None:
    """The first reason the flags or the gate ask for something other than flash_kda.fwd's KDA, or None (both
    verifiers)."""
    reason = _flags_problem(state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    return reason if reason is not None else _gate_problem(lower_bound, A_log, scale)


def _tensors_problem(tensors: dict, host_ok: tuple[str, ...]) -> str | None:
    """Types, grad, device, dtypes of the given tensors (None entries are absent); ``host_ok`` may be on the CPU."""
    for name in ("q", "k", "v", "g", "beta"):
        if tensors[name] is None:
            return f"{name} is required, got {name}=None"
    given = {name: t for name, t in tensors.items() if t is not None}
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
    if torch.is_grad_enabled():
        name = first_requiring_grad(given)
        if name is not None:
            return f"{name} requires grad (flash_kda.fwd has no backward)"

    # --- device: the kernel's (the index tensors may also be on the CPU: flash_kda.fwd copies them)
    device = given["q"].device
    reason = kernel_device(device)
    if reason is not None:
        return reason
    for name, t in given.items():
        if t.device != device and not (name in host_ok and t.device.type == "cpu"):
            return f"all tensors must be on one device, got q.device={device} but {name}.device={t.device}"

    # --- dtype
    for name in ("q", "k", "v", "g", "beta", "out"):
        if name in given and given[name].dtype != torch.bfloat16:
            return f"{name} must be bfloat16, got {name}.dtype={given[name].dtype}"
    for name in ("A_log", "dt_bias"):
        if name in given and given[name].dtype not in PARAM_TYPES:
            return f"{name} must be float32, bfloat16 or float16, got {name}.dtype={given[name].dtype}"
    if "initial_state" in given and given["initial_state"].dtype not in STATE_DTYPES:
        return f"initial_state must be bfloat16 or float32, got initial_state.dtype={given['initial_state'].dtype}"
    if "cu_seqlens" in given and given["cu_seqlens"].dtype not in CU_SEQLENS_DTYPES:
        return f"cu_seqlens must be int64 or int32, got cu_seqlens.dtype={given['cu_seqlens'].dtype}"
    return None


def _shape_problem(q, k, v, g, beta, A_log, dt_bias, cu_seqlens) -> tuple[str | None, int]:
    """(why the shapes are not KDA's with grouped value heads, or None; the number of sequences N)."""
    if q.dim() != 4 or q.shape[-1] != HEAD_DIM:
        return f"q must be [B, T, H, {HEAD_DIM}], got {q.shape=}", 0
    B, T, H, K = q.shape
    if k.shape != q.shape:
        return f"k must have q's shape {list(q.shape)}, got {k.shape=}", 0
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[-1] != HEAD_DIM:
        return f"v must be [B, T, HV, V] = [{B}, {T}, HV, {HEAD_DIM}] (V = {HEAD_DIM}), got {v.shape=}", 0
    HV = v.shape[2]
    if HV < H or (HV % H if H else HV):
        return f"v's heads HV must be a multiple of q's heads H (grouped value heads), got HV={HV} from {v.shape=} " \
               f"and H={H} from {q.shape=}", 0
    if g.shape != v.shape:
        return f"g must be [B, T, HV, K] = {list(v.shape)}, got {g.shape=}", 0
    if beta.shape != v.shape[:3]:
        return f"beta must be [B, T, HV] = {list(v.shape[:3])} (one beta per value head), got {beta.shape=}", 0
    if A_log is not None and A_log.shape != (HV,):
        return f"A_log must be [HV] = [{HV}], got {A_log.shape=}", 0
    if dt_bias is not None and tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):
        return f"dt_bias must be [HV * K] = [{HV * K}] or [HV, K], got {dt_bias.shape=}", 0
    if HV > MAX_HEADS:
        return f"at most {MAX_HEADS} value heads, got {v.shape=}", 0
    if cu_seqlens is None:
        return None, B
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or B != 1:
        return f"cu_seqlens must be [N + 1] (N >= 1) with B = 1, got {cu_seqlens.shape=}, {q.shape=}", 0
    return None, cu_seqlens.numel() - 1


# --- fused_recurrent_kda_fwd ------------------------------------------------------------------------------------


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
    for name, t in (("ssm_state_indices", ssm_state_indices), ("num_accepted_tokens", num_accepted_tokens)):
        if t is not None and not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
    if num_accepted_tokens is not None and (ssm_state_indices is None or ssm_state_indices.dim() != 2):
        return "num_accepted_tokens without 2-D ssm_state_indices [N, L] (fla reads it only with per-token slots)"
    reason = _kda_problem(state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                          lower_bound, A_log, scale)
    if reason is not None:
        return reason
    if inplace_final_state and initial_state is None:
        return "inplace_final_state=True without initial_state (fla's own kernel refuses it)"
    if ssm_state_indices is not None and not inplace_final_state:
        return "ssm_state_indices with inplace_final_state=False (fla then writes a state per token, not a pool)"

    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
        "initial_state": initial_state, "cu_seqlens": cu_seqlens, "ssm_state_indices": ssm_state_indices,
        "num_accepted_tokens": num_accepted_tokens, "out": out,
    }  # fmt: skip
    reason = _tensors_problem(tensors, host_ok=("cu_seqlens", "ssm_state_indices", "num_accepted_tokens"))
    if reason is not None:
        return reason
    given = {name: t for name, t in tensors.items() if t is not None}
    for name in ("ssm_state_indices", "num_accepted_tokens"):
        if name in given and given[name].dtype not in STATE_INDEX_DTYPES:
            return f"{name} must be int64 or int32, got {name}.dtype={given[name].dtype}"

    # --- layout: flash_kda.fwd takes contiguous tensors whose rows start 16-byte aligned (and this path writes
    # initial_state in place, so it cannot work on copies)
    for name, t in given.items():
        if not t.is_contiguous():
            return f"{name} must be contiguous, got {name}.stride()={t.stride()} for shape {tuple(t.shape)}"
        if name not in ("beta", "A_log", "cu_seqlens", "ssm_state_indices", "num_accepted_tokens") and \
                t.data_ptr() % ALIGNMENT:
            return f"{name} must start {ALIGNMENT}-byte aligned, got {name}.data_ptr() % {ALIGNMENT} = " \
                   f"{t.data_ptr() % ALIGNMENT}"

    # --- shape
    reason, N = _shape_problem(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    if reason is not None:
        return reason
    B, T, HV = v.shape[:3]
    if out is not None and out.shape != v.shape:
        return f"out must have v's shape {list(v.shape)}, got out.shape={tuple(out.shape)}"
    if ssm_state_indices is not None:
        # 1-D: one slot per sequence, which fla indexes per token, so one token per sequence; 2-D [N, L]: the state
        # after token t of sequence n into slot [n, t] (speculative decoding).
        if ssm_state_indices.dim() == 2:
            if ssm_state_indices.shape[0] != N or ssm_state_indices.shape[1] < 1:
                return f"ssm_state_indices [N, L] must have N = {N} rows and L >= 1, got {ssm_state_indices.shape=}"
        elif ssm_state_indices.dim() != 1 or ssm_state_indices.shape[0] != N:
            return f"ssm_state_indices must be [N] = [{N}] or [N, L], got {ssm_state_indices.shape=}"
        else:
            reason = _one_token_problem(T, N, cu_seqlens)
            if reason is not None:
                return reason
        if num_accepted_tokens is not None and tuple(num_accepted_tokens.shape) != (N,):
            return f"num_accepted_tokens must be [N] = [{N}], got {num_accepted_tokens.shape=}"
        if initial_state.dim() != 4 or initial_state.shape[0] < 1 or initial_state.shape[1:] != (HV, HEAD_DIM,
                                                                                                HEAD_DIM):
            return f"initial_state must be a pool [P, HV, V, K] = [P, {HV}, {HEAD_DIM}, {HEAD_DIM}], got " \
                   f"{initial_state.shape=}"
    elif initial_state is not None and initial_state.shape != (N, HV, HEAD_DIM, HEAD_DIM):
        return f"initial_state must be [N, HV, V, K] = {[N, HV, HEAD_DIM, HEAD_DIM]}, got {initial_state.shape=}"

    # --- PyTorch refuses in-place writes of an inference tensor outside inference mode (fla's kernel writes
    # through raw pointers and serves the call: leave it to fla)
    if not torch.is_inference_mode_enabled():
        for name, t in (("initial_state", initial_state if inplace_final_state else None), ("out", out)):
            if t is not None and t.is_inference():
                return f"{name} is an inference tensor written outside inference mode (fwd refuses it)"

    # --- memory: what is written overlaps nothing else (the in-place state only its own initial state)
    if out is not None or inplace_final_state:
        device = q.device
        same_device = {name: t for name, t in given.items() if t.device == device}
        if inplace_final_state:
            same_device["final_state"] = initial_state
        overlap = first_overlap(same_device)
        if overlap is not None:
            return f"{overlap[0]} overlaps {overlap[1]} in memory"
    return None


def _one_token_problem(T: int, N: int, cu_seqlens: torch.Tensor | None) -> str | None:
    """Why a call with 1-D ssm_state_indices may have a sequence of more than one token, or None. fla reads a 1-D
    index per token (slot ssm_state_indices[n + t] for token t of sequence n), which is a slot per sequence only
    when no sequence has more than one token. A CUDA cu_seqlens is not read (that would synchronise): T <= N is
    then required and every sequence is taken to have at most one token, as decode batches have."""
    if cu_seqlens is None:
        if T > 1:
            return f"1-D ssm_state_indices needs at most one token per sequence, got T = {T} tokens per sequence"
        return None
    if cu_seqlens.device.type == "cpu":
        longest = int(sequence_lengths(cu_seqlens, 1, T).max())  # (N >= 1: _shape_problem checked it)
        if longest > 1:
            return f"1-D ssm_state_indices needs at most one token per sequence, got a sequence of {longest} tokens"
        return None
    if T > N:
        return f"1-D ssm_state_indices needs at most one token per sequence, got {T} tokens for N = {N} sequences"
    return None


def _gate_args(lower_bound) -> tuple[float | None, str]:
    """flash_kda.fwd's (lower_bound, gate) for fla's lower_bound (None: the softplus gate)."""
    return (None, "softplus") if lower_bound is None else (float(lower_bound), "lower_bound")


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False,
                            cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                            **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda_fwd`` by ``flash_kda.fwd``, for a call ``unsupported`` takes.

    | fla argument | passed to flash_kda.fwd as |
    |---|---|
    | q, k [B, T, H, K]; v, g [B, T, HV, ·]; beta [B, T, HV] | the same tensors |
    | scale (None: K**-0.5) | scale |
    | lower_bound (None: the softplus gate) | lower_bound, gate="lower_bound" / None, gate="softplus" |
    | allow_neg_eigval | allow_neg_eigval |
    | A_log [HV], dt_bias [HV·K] (or None) | A_log, dt_bias viewed as [HV, K] |
    | out (None: a new tensor like v) | out, returned |
    | initial_state [N, HV, V, K], or a pool [P, HV, V, K] with ssm_state_indices | initial_state |
    | inplace_final_state | final_state = initial_state |
    | output_final_state without inplace_final_state | final_state = new fp32 [N, HV, V, K] |
    | cu_seqlens, ssm_state_indices [N] or [N, L] | cu_seqlens, state_indices |
    | num_accepted_tokens [N] (with [N, L] slots) | num_accepted_tokens |

    Returns ``(out, final_state)``: ``final_state`` is ``initial_state`` in place, the new tensor, or None.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if out is None:
        # fla zero-fills it; fwd writes every row that belongs to a sequence, so only padding tokens past
        # cu_seqlens[-1] (a batch padded to a CUDA graph's size) would be left: zeros there too, as fla.
        out = torch.empty_like(v) if cu_seqlens is None else torch.zeros_like(v)
    if inplace_final_state:
        final_state = initial_state
    elif output_final_state:
        final_state = q.new_empty(N, HV, V, K, dtype=torch.float32)
    else:
        final_state = None
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias.view(HV, K)
    bound, gate = _gate_args(lower_bound)
    flash_kda.fwd(q, k, v, g, beta, K**-0.5 if scale is None else float(scale), out, A_log, dt_bias, bound,
                  initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
                  state_indices=ssm_state_indices, gate=gate, allow_neg_eigval=bool(allow_neg_eigval),
                  num_accepted_tokens=num_accepted_tokens)
    return out, final_state


# --- chunk_kda ----------------------------------------------------------------------------------------------------


# The signature of fla 0.6's chunk_kda (A_log, dt_bias and chunk_size come through **kwargs, as fla reads them).
def chunk_unsupported(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                      return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                      cp_context=None, use_graph=False, max_num_seqs=None, **kwargs) -> str | None:
    """Why ``flash_kda.fwd`` cannot compute this call of fla's ``chunk_kda``, or None to take it.

    The chunk backend's verifier: the module docstring lists what it takes. Where fla's ``chunk_kda`` would raise
    (safe_gate without a lower bound in [-5, 0), a chunk size other than 32 or 64, ...) it refuses, so that fla
    raises its own error. Host work only (no synchronisation).
    """
    unknown = sorted(set(kwargs) - set(_CHUNK_KWARGS))
    if unknown:
        return f"arguments fla 0.6's signature does not name: {unknown}"
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if "transpose_state_layout" in kwargs:  # (fla's deprecated name of state_v_first)
        if state_v_first:
            return "both state_v_first and the deprecated transpose_state_layout (fla raises)"
        state_v_first = kwargs["transpose_state_layout"]
    chunk_size = kwargs.get("chunk_size", 64)
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        return f"chunk_size must be one of {list(CHUNK_SIZES)} (fla raises), got {chunk_size=}"
    if cp_context is not None:
        return "cp_context (context parallel) is not supported"
    if return_intermediate_states:
        return "return_intermediate_states is not supported (flash_kda.fwd keeps no per-chunk states)"
    reason = _kda_problem(state_v_first, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                          lower_bound, A_log, scale)
    if reason is not None:
        return reason
    if safe_gate and (lower_bound is None or not lower_bound < 0):
        return f"safe_gate=True needs lower_bound in [-5, 0) (fla raises), got {lower_bound=}"

    tensors = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
        "initial_state": initial_state, "cu_seqlens": cu_seqlens,
    }  # fmt: skip
    reason = _tensors_problem(tensors, host_ok=("cu_seqlens",))
    if reason is not None:
        return reason

    # --- shape (any layout: chunk_kda makes dense copies where flash_kda.fwd needs them)
    reason, N = _shape_problem(q, k, v, g, beta, A_log, dt_bias, cu_seqlens)
    if reason is not None:
        return reason
    HV = v.shape[2]
    if initial_state is not None and initial_state.shape != (N, HV, HEAD_DIM, HEAD_DIM):
        return f"initial_state must be [N, HV, V, K] = {[N, HV, HEAD_DIM, HEAD_DIM]}, got {initial_state.shape=}"
    if use_graph and cu_seqlens is not None and max_num_seqs is not None and max_num_seqs != N:
        return f"use_graph needs cu_seqlens of max_num_seqs + 1 entries (fla raises), got {max_num_seqs=}, N = {N}"
    return None


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a contiguous copy of it where ``flash_kda.fwd`` would refuse its strides or start address."""
    if t is None:
        return None
    if not t.is_contiguous():
        return t.contiguous()
    if t.data_ptr() % ALIGNMENT:
        return t.clone()
    return t


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None,
              **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_kda`` by ``flash_kda.fwd``, for a call ``chunk_unsupported`` takes.

    | fla argument | passed to flash_kda.fwd as |
    |---|---|
    | q, k [B, T, H, K]; v, g [B, T, HV, ·]; beta [B, T, HV] | the same tensors (dense copies where needed) |
    | scale (None: K**-0.5) | scale |
    | lower_bound (None: the softplus gate; safe_gate only tells fla's kernels the gate is bounded) | lower_bound, gate="lower_bound" / None, gate="softplus" |
    | allow_neg_eigval | allow_neg_eigval |
    | A_log [HV], dt_bias [HV·K] (or None; keywords) | A_log, dt_bias viewed as [HV, K] |
    | initial_state [N, HV, V, K] (bf16 or fp32) | initial_state |
    | output_final_state | final_state = new fp32 [N, HV, V, K] |
    | cu_seqlens | cu_seqlens |
    | chunk_size, disable_recompute, use_graph, max_num_seqs, cu_seqlens_cpu | (nothing: they tune fla's kernels) |

    Returns ``(out, final_state)`` like fla: out a new bf16 tensor like v, final_state the new fp32 tensor or None.
    """
    A_log, dt_bias = _dense(kwargs.get("A_log")), _dense(kwargs.get("dt_bias"))
    q, k, v, g, beta, initial_state = (_dense(t) for t in (q, k, v, g, beta, initial_state))
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = torch.empty_like(v)
    final_state = q.new_empty(N, HV, V, K, dtype=torch.float32) if output_final_state else None
    if dt_bias is not None and dt_bias.dim() == 1:
        dt_bias = dt_bias.view(HV, K)
    bound, gate = _gate_args(lower_bound)
    flash_kda.fwd(q, k, v, g, beta, K**-0.5 if scale is None else float(scale), out, A_log, dt_bias, bound,
                  initial_state=initial_state, final_state=final_state, cu_seqlens=_dense(cu_seqlens), gate=gate,
                  allow_neg_eigval=bool(allow_neg_eigval))
    return out, final_state
