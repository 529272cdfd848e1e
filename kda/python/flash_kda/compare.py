"""Error metrics for comparing a result with a reference, reporting *where* things go wrong.

- ``compare(actual, expected, window=..., cu_seqlens=...)`` -> ``Report``: relative L2 error, max abs error,
  cosine similarity, NaN/inf counts on both sides, the worst element's index, and the worst relative L2 error
  over windows of tokens along dim 1 (per sequence: windows never cross sequence boundaries).
- ``bitwise_mismatch(a, b)`` -> ``Mismatch``: how many elements differ in their bits and the first few indices,
  for explaining a failed ``torch.equal``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from flash_kda.validation import check_cu_seqlens

__all__ = ["Report", "compare", "Mismatch", "bitwise_mismatch", "assert_bitwise_equal"]

_F64 = torch.float64


@dataclass(frozen=True)
class Report:
    """Errors of ``actual`` against ``expected`` (all computed in float64)."""

    shape: tuple[int, ...]
    rel_l2: float  # ‖a − e‖₂ / ‖e‖₂ over finite-in-both elements (0/0 → 0, x/0 → inf)
    max_abs: float  # max |a − e| over finite-in-both elements
    cosine: float  # ⟨a, e⟩ / (‖a‖ ‖e‖) over finite-in-both elements (1 when both are all zero)
    nan_actual: int
    inf_actual: int
    nan_expected: int
    inf_expected: int
    nonfinite_mismatch: int  # elements where exactly one side is non-finite, or both but unequal (NaN vs ±inf)
    worst_index: tuple[int, ...] | None  # index of max |a − e| (or of the first non-finite mismatch)
    worst_actual: float | None
    worst_expected: float | None
    window: int | None = None
    window_rel_l2: float | None = None  # worst ‖a − e‖ / ‖e‖ over one window of tokens
    window_where: tuple[int, int, int] | None = None  # (sequence, first token, last token + 1) of that window

    @property
    def finite_ok(self) -> bool:
        """True when actual is non-finite exactly where expected is."""
        return self.nonfinite_mismatch == 0

    def __str__(self) -> str:
        lines = [
            f"shape={list(self.shape)} rel_l2={self.rel_l2:.3e} max_abs={self.max_abs:.3e} cosine={self.cosine:.9f}",
            f"nan/inf actual={self.nan_actual}/{self.inf_actual} expected={self.nan_expected}/{self.inf_expected} "
            f"non-finite mismatches={self.nonfinite_mismatch}",
            f"worst element at {self.worst_index}: actual={self.worst_actual} expected={self.worst_expected}",
        ]
        if self.window is not None:
            seq, a, b = self.window_where if self.window_where else (None, None, None)
            lines.append(
                f"worst window ({self.window} tokens): rel_l2={self.window_rel_l2:.3e} "
                f"in sequence {seq}, tokens [{a}, {b})"
            )
        return "\n".join(lines)

    def check(self, *, rel_l2: float, window_rel_l2: float | None = None, name: str = "result") -> None:
        """Raises AssertionError (with the whole report) unless errors are within the bounds and finite."""
        problems = []
        if not self.finite_ok:
            problems.append(f"{self.nonfinite_mismatch} non-finite mismatches")
        if not self.rel_l2 <= rel_l2:
            problems.append(f"rel_l2 {self.rel_l2:.3e} > {rel_l2:.1e}")
        if window_rel_l2 is not None and self.window_rel_l2 is not None and not self.window_rel_l2 <= window_rel_l2:
            problems.append(f"window rel_l2 {self.window_rel_l2:.3e} > {window_rel_l2:.1e}")
        if problems:
            raise AssertionError(f"{name}: {'; '.join(problems)}\n{self}")


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else float("inf")


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def compare(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    window: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> Report:
    """Compares ``actual`` with ``expected`` (same shape) and returns a ``Report``.

    | arg | type | meaning |
    |---|---|---|
    | actual, expected | tensors, same shape | e.g. out [B, T, H, V] or a state [N, H, V, K]; any float dtypes |
    | window | int / None | also report the worst relative L2 over windows of this many tokens along dim 1 |
    | cu_seqlens | int [N + 1] / None | sequence boundaries along dim 1 (B = 1): windows restart at each |

    Without ``cu_seqlens`` each index of dim 0 is a sequence. Windows are cut per sequence from its first
    token; the last one may be shorter. Synchronises (it returns Python numbers).
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"shapes differ: {actual.shape=} {expected.shape=}")
    shape = tuple(actual.shape)
    a = actual.detach().to(device=expected.device, dtype=_F64)
    e = expected.detach().to(_F64)
    fa, fe = torch.isfinite(a), torch.isfinite(e)
    both = fa & fe
    # Non-finite in exactly one, or non-finite in both with different values (NaN vs inf, +inf vs -inf).
    bad = (fa != fe) | (~fa & ~fe & ~((a == e) | (torch.isnan(a) & torch.isnan(e))))
    a0, e0 = torch.where(both, a, 0.0), torch.where(both, e, 0.0)
    diff = (a0 - e0).abs()
    err2, ref2 = float((diff * diff).sum()), float((e0 * e0).sum())
    dot, act2 = float((a0 * e0).sum()), float((a0 * a0).sum())
    nbad = int(bad.sum())
    if nbad:
        flat = int(torch.nonzero(bad.flatten())[0])
    elif diff.numel():
        flat = int(diff.flatten().argmax())
    else:
        flat = None
    worst = None if flat is None else _unravel(flat, shape)
    report = dict(
        shape=shape,
        rel_l2=_ratio(err2**0.5, ref2**0.5),
        max_abs=float(diff.max()) if diff.numel() else 0.0,
        cosine=1.0 if act2 == 0 and ref2 == 0 else _ratio(dot, (act2 * ref2) ** 0.5),
        nan_actual=int(torch.isnan(a).sum()),
        inf_actual=int(torch.isinf(a).sum()),
        nan_expected=int(torch.isnan(e).sum()),
        inf_expected=int(torch.isinf(e).sum()),
        nonfinite_mismatch=nbad,
        worst_index=worst,
        worst_actual=None if worst is None else float(a[worst]),
        worst_expected=None if worst is None else float(e[worst]),
    )
    if window is not None:
        report.update(_windows(diff, e0, window, cu_seqlens))
    return Report(**report)


def _windows(diff: torch.Tensor, ref: torch.Tensor, window: int, cu_seqlens: torch.Tensor | None) -> dict:
    if not isinstance(window, numbers.Integral) or isinstance(window, bool):
        raise TypeError(f"window must be an int (tokens per window), got {window=} of {type(window)=}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window=}")
    if diff.dim() < 2:
        raise ValueError(f"windows run along dim 1, got a tensor of shape {tuple(diff.shape)}")
    B, T = diff.shape[:2]
    # Per-token sums of squares [B, T]; the window sums below are exact segment sums (no cumsum cancellation).
    inner = math.prod(diff.shape[2:])
    err2 = (diff * diff).reshape(B, T, inner).sum(-1)
    ref2 = (ref * ref).reshape(B, T, inner).sum(-1)
    if cu_seqlens is None:
        starts = [b * T for b in range(B)]
        lengths = [T] * B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 along dim 0, got shape {tuple(diff.shape)}")
        check_cu_seqlens(cu_seqlens, T)
        cu = [int(x) for x in cu_seqlens.tolist()]
        if cu[-1] != T:  # (padding tokens past the last sequence would be hidden from the worst window)
            raise ValueError(f"cu_seqlens[-1] must equal the number of tokens {T} (compare the covered tokens "
                             f"out[:, :cu_seqlens[-1]]), got cu_seqlens[-1]={cu[-1]}")
        starts, lengths = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    err2, ref2 = err2.flatten().cpu(), ref2.flatten().cpu()
    worst, where = 0.0, None
    for n, (s, length) in enumerate(zip(starts, lengths)):
        if length == 0:
            continue
        nw = -(-length // window)
        wid = torch.arange(length) // window
        e_w = torch.zeros(nw, dtype=_F64).index_add_(0, wid, err2[s : s + length])
        r_w = torch.zeros(nw, dtype=_F64).index_add_(0, wid, ref2[s : s + length])
        rel = torch.where(r_w > 0, (e_w / r_w.clamp_min(1e-300)).sqrt(), torch.where(e_w > 0, float("inf"), 0.0))
        i = int(rel.argmax())
        if where is None or float(rel[i]) > worst:
            worst = float(rel[i])
            # For packed varlen (B = 1) report the position inside the sequence; without cu_seqlens, in the row.
            where = (n, i * window, min(length, (i + 1) * window))
    return {"window": window, "window_rel_l2": worst, "window_where": where}


@dataclass(frozen=True)
class Mismatch:
    """Elements whose bits differ between two tensors of one shape and dtype."""

    count: int
    total: int
    first: list[tuple[tuple[int, ...], float, float]] = field(default_factory=list)  # (index, a, b)
    nan_both: int = 0  # elements NaN in both (equal bits, but torch.equal treats NaN as unequal)
    note: str = ""

    def __str__(self) -> str:
        if self.note:
            return self.note
        head = f"{self.count} of {self.total} elements differ bitwise"
        if self.nan_both:
            head += f"; {self.nan_both} elements are NaN in both (torch.equal fails on NaN)"
        rows = [f"  at {idx}: actual={x!r} expected={y!r}" for idx, x, y in self.first]
        return "\n".join([head, *rows])


_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_mismatch(a: torch.Tensor, b: torch.Tensor, *, limit: int = 10) -> Mismatch:
    """Counts elements of ``a`` and ``b`` whose bit patterns differ and lists the first ``limit`` of them."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return Mismatch(0, a.numel(), note=f"not comparable: {a.dtype=} {a.shape=} vs {b.dtype=} {b.shape=}")
    if a.device != b.device:
        b = b.to(a.device)
    if a.dtype.is_floating_point:
        ia, ib = a.contiguous().view(_INT_OF[a.element_size()]), b.contiguous().view(_INT_OF[b.element_size()])
        nan_both = int((torch.isnan(a) & torch.isnan(b)).sum())
    else:
        ia, ib, nan_both = a, b, 0
    differ = (ia != ib).flatten()
    count = int(differ.sum())
    flat_a, flat_b = a.flatten(), b.flatten()
    first = [
        (_unravel(int(i), tuple(a.shape)), float(flat_a[i]), float(flat_b[i]))
        for i in torch.nonzero(differ)[:limit].flatten().tolist()
    ]
    return Mismatch(count, a.numel(), first, nan_both)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "result") -> None:
    """``assert torch.equal(actual, expected)``, with a failure message that says where they differ."""
    if not torch.equal(actual, expected):
        raise AssertionError(f"{name} is not bitwise equal to the twin: {bitwise_mismatch(actual, expected)}")
