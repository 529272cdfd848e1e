"""Test-only controls of the CUDA path: force the execution plan that ``fwd`` would otherwise choose.

The V split never changes a result bit (each recurrence CTA owns whole state rows, and rows evolve
independently); the time split does change the rounding path, and the numerics twin re-enacts whichever one
``fwd`` runs (``numerics.twin_forward`` asks ``api.plan``, which sees the forced values). So the correctness
matrix can run every plan on every shape:

    with flash_kda.testing.force_plan(v_split=8, segment_chunks=4):
        flash_kda.fwd(...)
        numerics.twin_forward(...)

Not thread-safe and not meant for production code: it sets module-level overrides of ``flash_kda.api``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from flash_kda import api

__all__ = ["force_plan", "V_SPLITS", "default_v_split", "default_plan"]

V_SPLITS = api._V_SPLITS


@contextlib.contextmanager
def force_plan(v_split: int = 0, segment_chunks: Optional[int] = None, scan_v_split: int = 0) -> Iterator[None]:
    """Within the block, ``fwd`` on CUDA runs the forced plan.

    | arg | type | meaning |
    |---|---|---|
    | v_split | int | 1, 2, 4 or 8: each recurrence CTA owns 128 / v_split state rows (0: automatic) |
    | segment_chunks | int / None | time split into segments of this many 16-token chunks; 0: no split; None: automatic |
    | scan_v_split | int | 1, 2, 4 or 8 CTAs per map in the time split's scan; 0: v_split if forced, else automatic |
    """
    for name, value in (("v_split", v_split), ("scan_v_split", scan_v_split)):
        if isinstance(value, bool) or not isinstance(value, int) or value not in (0, *V_SPLITS):
            raise ValueError(f"{name} must be 0 (automatic) or one of {list(V_SPLITS)}, got {name}={value!r}")
    if segment_chunks is not None and (
        isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int) or segment_chunks < 0
    ):
        raise ValueError(f"segment_chunks must be None (automatic) or an int >= 0, got {segment_chunks=}")
    saved = api._forced_v_split, api._forced_segment_chunks, api._forced_scan_v_split
    api._forced_v_split, api._forced_segment_chunks, api._forced_scan_v_split = v_split, segment_chunks, scan_v_split
    try:
        yield
    finally:
        api._forced_v_split, api._forced_segment_chunks, api._forced_scan_v_split = saved


def default_v_split(num_seqs: int, heads: int, sm_count: int) -> int:
    """The V split that N sequences of H heads get on a GPU with ``sm_count`` SMs from their count alone (no time
    split). ``default_plan`` has the whole choice: batches of many short sequences (mean at most 8 chunks) that
    get 1 here get 2 there (kda_plan.h)."""
    from flash_kda import _ext  # noqa: PLC0415 -- needs the extension, not torch's CUDA

    return int(_ext.load().choose_v_split(num_seqs, heads, sm_count))


def default_plan(total_tokens: int, seqlen: int, num_seqs: int, heads: int, varlen: bool,
                 sm_count: int) -> api.Plan:
    """The plan ``fwd`` chooses for these shapes on a GPU with ``sm_count`` SMs (nothing forced)."""
    from flash_kda import _ext  # noqa: PLC0415

    return api.Plan(*(int(x) for x in _ext.load().choose_plan(total_tokens, seqlen, num_seqs, heads, varlen,
                                                               sm_count)))
