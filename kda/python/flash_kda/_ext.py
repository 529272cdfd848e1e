"""Torch-facing wrappers around the compiled extension ``flash_kda._C``.

``_C`` takes raw device pointers and a stream handle (it links neither torch nor libtorch). It is imported
lazily, on first use, so ``import flash_kda`` works on machines where the extension was not built (the CPU path
and the references need only PyTorch); using a CUDA feature there raises an ImportError that says so.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from types import ModuleType

import torch

__all__ = [
    "available",
    "load",
    "build_info",
    "device_info",
    "ex2_approx",
    "tanh_approx",
    "sigmoid_approx",
    "softplus_log2",
    "rcp_sqrt_rn",
    "lane_leaves",
    "row_fma",
    "mma_bf16",
]


@functools.cache
def _import() -> ModuleType | ImportError:
    try:
        from flash_kda import _C  # noqa: PLC0415 -- lazy by design
    except ImportError as e:  # cached: a failed import is not retried on every call
        return e
    return _C


def available() -> bool:
    """True when the compiled extension ``flash_kda._C`` can be imported."""
    return not isinstance(_import(), ImportError)


def load() -> ModuleType:
    """Returns the extension module ``flash_kda._C``, or raises ImportError explaining how to get it."""
    mod = _import()
    if isinstance(mod, ImportError):
        raise ImportError(
            "flash_kda._C (the CUDA extension) is not importable, so the CUDA path of flash_kda is unavailable; "
            "build it with `tools/bazel build //kda:py` (the CPU path and flash_kda.reference work without it). "
            f"Import error: {mod}"
        ) from mod
    return mod


def cuda_device(device, caller: str) -> torch.device | None:
    """``device`` (None, an int CUDA index, a str or a torch.device) as a torch.device, None kept; a ValueError
    naming ``caller`` if it is not a CUDA device. Touches no CUDA (torch.device(int) would ask for an accelerator,
    which may not exist: an int here is a CUDA index)."""
    if device is None:
        return None
    if isinstance(device, bool):  # (an int to Python, but never meant as a device index)
        raise TypeError(f"{caller} needs a CUDA device (None, an int index, a str or a torch.device), got {device=}")
    if isinstance(device, numbers.Integral):  # a NumPy integer too
        if device < 0:
            raise ValueError(f"{caller} needs a CUDA device index >= 0, got {device=}")
        device = torch.device("cuda", int(device))
    elif isinstance(device, (str, torch.device)):
        try:
            device = torch.device(device)
        except RuntimeError:  # (torch's message names neither the call nor the argument)
            raise ValueError(f"{caller} needs a CUDA device, got device={device!r}") from None
    else:
        raise TypeError(f"{caller} needs a CUDA device (None, an int index, a str or a torch.device), got "
                        f"device={device!r} of {type(device)=}")
    if device.type != "cuda":
        raise ValueError(f"{caller} needs a CUDA device, got {device=}")
    return device


def cuda_index(device: torch.device | None, caller: str) -> int:
    """The index of ``cuda_device``'s result, the current CUDA device's for None or no index; a RuntimeError naming
    ``caller`` where torch sees no CUDA device (torch's own error says neither which call nor why)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{caller} needs a CUDA device and torch sees none (torch.cuda.is_available() is False); "
                           "flash_kda.fwd runs on CPU tensors without one")
    if device is not None and device.index is not None:
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{caller}: no CUDA device {device.index} (torch sees {torch.cuda.device_count()})")
        return device.index
    return torch.cuda.current_device()


_ON_CURRENT_DEVICE = contextlib.nullcontext()


def on_device(index: int):
    """A context in which CUDA device ``index`` is current: nothing where it already is (the usual case), else
    ``torch.cuda.device(index)``, whose exit restores the thread's device the way torch does, lazily (a device the
    thread never used gets no CUDA context; the extension's own switch back would create one there). Device calls
    of the extension and the capture checks run inside it."""
    return _ON_CURRENT_DEVICE if torch.cuda.current_device() == index else torch.cuda.device(index)


def build_info() -> dict:
    """The extension's build facts: toolkit version, archs compiled in, compiler flags."""
    return dict(load().build_info())


def device_info(device: int | torch.device | None = None) -> dict:
    """Facts about a CUDA device as the CUDA runtime reports them.

    | arg | type | meaning |
    |---|---|---|
    | device | int / torch.device / None | CUDA device; None: the current one |

    Returns a dict with at least name, major, minor, sm_count, driver_version, runtime_version (integral
    values as int).
    """
    index = cuda_index(cuda_device(device, "device_info"), "device_info")
    # The binding reports strings; integers come back as ints so callers can compare capabilities.
    with on_device(index):
        facts = load().device_info(index)
    return {key: int(value) if isinstance(value, str) and value.isdigit() else value for key, value in facts.items()}


# The raw cudaStream_t of a device's current stream: torch's private accessor returns the integer directly
# (building a torch.cuda.Stream object per call costs host time); the public path is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(index: int) -> int:
    """The handle of CUDA device ``index``'s current stream, as the extension takes it."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _check_fp32_cuda(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t)=}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype=}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got {t.device=}")


def _elementwise(fn_name: str, x: torch.Tensor) -> torch.Tensor:
    _check_fp32_cuda("x", x)
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    with torch.cuda.device(x.device):
        getattr(load(), fn_name)(x.data_ptr(), y.data_ptr(), x.numel(), current_stream(x.device.index))
    return y


def ex2_approx(x: torch.Tensor) -> torch.Tensor:
    """y = 2^x elementwise with the kernel's `ex2.approx.ftz.f32` (fp32 CUDA tensor in, new tensor out)."""
    return _elementwise("ex2_approx", x)


def tanh_approx(x: torch.Tensor) -> torch.Tensor:
    """y = tanh(x) elementwise with the kernel's `tanh.approx.f32` (fp32 CUDA tensor in, new tensor out)."""
    return _elementwise("tanh_approx", x)


def sigmoid_approx(x: torch.Tensor) -> torch.Tensor:
    """y = sigmoid(x) elementwise exactly as the kernel computes it (fp32 CUDA tensor in, new tensor out)."""
    return _elementwise("sigmoid_approx", x)


def softplus_log2(x: torch.Tensor) -> torch.Tensor:
    """y = log2(1 + e^x) elementwise exactly as the softplus gate computes it (fp32 CUDA tensor in, new tensor
    out)."""
    return _elementwise("softplus_log2", x)


def rcp_sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """y = 1 / sqrt(x) elementwise as the kernels' norms compute it: the sqrt and the reciprocal each correctly
    rounded, for x >= 2^-100, +inf and NaN (fp32 CUDA tensor in, new tensor out)."""
    return _elementwise("rcp_sqrt_rn", x)


def _check_rows(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """a [..., R, 128] and b [..., 128] with the same leading dims, fp32 on one CUDA device."""
    _check_fp32_cuda("a", a)
    _check_fp32_cuda("b", b)
    if a.dim() < 2 or a.shape[-1] != 128 or tuple(b.shape) != (*a.shape[:-2], 128):
        raise ValueError(f"{what} needs a [..., R, 128] and b [..., 128] with the same leading dims, got "
                         f"{tuple(a.shape)=} {tuple(b.shape)=}")
    if a.device != b.device:
        raise ValueError(f"{what} needs one device, got {a.device=} {b.device=}")


def lane_leaves(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The decode kernel's lane leaves of each row's sum a[..., r, :]·b[..., :]: leaf l is
    a₃·b₃ + (a₂·b₂ + (a₁·b₁ + a₀·b₀)) over channels 4l..4l+3, three of its steps single-rounded FMAs
    (device_math.cuh, lane_leaf4). a fp32 [..., R, 128], b fp32 [..., 128] -> fp32 [..., R, 32], CUDA."""
    _check_rows(a, b, "lane_leaves")
    a, b = a.contiguous(), b.contiguous()
    leaves = torch.empty((*a.shape[:-1], 32), dtype=torch.float32, device=a.device)
    if leaves.numel():
        with torch.cuda.device(a.device):
            load().lane_leaves(a.data_ptr(), b.data_ptr(), leaves.data_ptr(), math.prod(a.shape[:-2]), a.shape[-2],
                               current_stream(a.device.index))
    return leaves


def row_fma(u: torch.Tensor, k: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The decode kernel's state update s[..., r, c] + u[..., r]·k[..., c], rounded once (``__fmaf_rn``).
    u fp32 [..., R], k fp32 [..., 128], s fp32 [..., R, 128] -> a new fp32 [..., R, 128], CUDA."""
    _check_rows(s, k, "row_fma")
    _check_fp32_cuda("u", u)
    if tuple(u.shape) != tuple(s.shape[:-1]) or u.device != s.device:
        raise ValueError(f"row_fma needs u [..., R] beside s [..., R, 128] on its device, got {tuple(u.shape)=} "
                         f"{tuple(s.shape)=} {u.device=} {s.device=}")
    u, k, s = u.contiguous(), k.contiguous(), s.contiguous()
    out = torch.empty_like(s)
    if out.numel():
        with torch.cuda.device(s.device):
            load().row_fma(u.data_ptr(), k.data_ptr(), s.data_ptr(), out.data_ptr(), math.prod(s.shape[:-2]),
                           s.shape[-2], current_stream(s.device.index))
    return out


def mma_bf16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    """D = C + A·B per batch entry, with the kernel's `mma.sync.m16n8k16` bf16×bf16→fp32, k-steps in order.

    Batch dimensions are not broadcast: they must be equal in a, b and c.

    | arg | dtype | shape | meaning |
    |---|---|---|---|
    | a | bf16 | [..., m, k] | left factor (m % 16 == 0, k % 16 == 0) |
    | b | bf16 | [..., k, n] | right factor (n % 8 == 0) |
    | c | fp32 / None | [..., m, n] | addend; None: zeros |

    Returns D, fp32 [..., m, n], a new contiguous tensor on a's device.
    """
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {name}.dtype={t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got {name}.device={t.device}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims, got {name}.shape={tuple(t.shape)}")
    if b.device != a.device:
        raise ValueError(f"a and b must be on one device, got {a.device=} {b.device=}")
    *batch, m, k = a.shape
    *batch_b, k_b, n = b.shape
    if batch_b != batch or k_b != k:
        raise ValueError(f"mma_bf16 needs a [..., m, k] and b [..., k, n], got {a.shape=} {b.shape=}")
    if m % 16 or n % 8 or k % 16:
        raise ValueError(f"mma_bf16 needs m % 16 == 0, n % 8 == 0, k % 16 == 0, got {m=} {n=} {k=}")
    if c is None:
        c = torch.zeros((*batch, m, n), dtype=torch.float32, device=a.device)
    else:
        _check_fp32_cuda("c", c)
        if c.device != a.device:
            raise ValueError(f"c must be on a's device, got {c.device=} {a.device=}")
        if tuple(c.shape) != (*batch, m, n):
            raise ValueError(f"c must have shape {(*batch, m, n)}, got {c.shape=}")
        c = c.contiguous()
    a, b = a.contiguous(), b.contiguous()
    d = torch.empty_like(c)
    nbatch = math.prod(batch)
    if d.numel() == 0:
        return d
    if k == 0:  # nothing to accumulate: D = C, no launch
        return d.copy_(c)
    with torch.cuda.device(a.device):
        load().mma_bf16(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), nbatch, m, n, k,
                        current_stream(a.device.index))
    return d
