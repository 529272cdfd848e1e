"""Test-only controls of the CUDA path: force the execution plan that ``fwd`` would otherwise choose.

The plan never changes a result bit (each recurrence CTA owns whole state rows, and rows evolve
independently), so the correctness matrix can run every plan on every shape:

    with flash_kda.testing.force_plan(v_split=8):
        flash_kda.fwd(...)

Not thread-safe and not meant for production code: it sets a module-level override of ``flash_kda.api``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from flash_kda import api

__all__ = ["force_plan", "V_SPLITS", "default_v_split"]

V_SPLITS = api._V_SPLITS


@contextlib.contextmanager
def force_plan(v_split: int = 0) -> Iterator[None]:
    """Within the block, ``fwd`` on CUDA runs the recurrence with ``v_split`` CTAs per (sequence, head).

    | arg | type | meaning |
    |---|---|---|
    | v_split | int | 1, 2, 4 or 8 (each CTA owns 128 / v_split state rows); 0 restores the automatic choice |
    """
    if isinstance(v_split, bool) or not isinstance(v_split, int) or v_split not in (0, *V_SPLITS):
        raise ValueError(f"v_split must be 0 (automatic) or one of {list(V_SPLITS)}, got {v_split=}")
    saved = api._forced_v_split
    api._forced_v_split = v_split
    try:
        yield
    finally:
        api._forced_v_split = saved


def default_v_split(num_seqs: int, heads: int, sm_count: int) -> int:
    """The V split ``fwd`` chooses for N sequences of H heads on a GPU with ``sm_count`` SMs."""
    from flash_kda import _ext  # noqa: PLC0415 -- needs the extension, not torch's CUDA

    return int(_ext.load().choose_v_split(num_seqs, heads, sm_count))
