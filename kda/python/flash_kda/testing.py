"""Test-only controls of the CUDA path: force the execution plan that ``fwd`` would otherwise choose.

The V split never changes a result bit (each recurrence CTA owns whole state rows, and rows evolve
independently); the time split does change the rounding path, and the numerics twin re-enacts whichever one
``fwd`` runs (``numerics.twin_forward`` asks ``planning.plan``, which sees the forced values). So the correctness
matrix can run every plan on every shape:

    with flash_kda.testing.force_plan(v_split=8, segment_chunks=4):
        flash_kda.fwd(...)
        numerics.twin_forward(...)

The single pass (one kernel that prepares and runs each (sequence, head)) computes the same bits as the two
stages; ``force_plan(single_pass=True)`` runs it on any shape, ``single_pass=False`` keeps it out. So does the
overlap (the preparation's tail on the SMs the recurrence leaves free, while it runs):
``force_plan(lead_chunks=L)`` runs it on any fixed-length batch with a lead of L chunks, ``lead_chunks=-1`` keeps
it out. The decode plan (short sequences with the state in registers: token by token, or in 16-token chunk steps
where sequences average 16 tokens or more; its twins ``numerics.decode_twin_forward`` and
``numerics.decode_chunk_twin_forward``, and the chunked twin where its stream pass runs,
``planning.stream_pass_runs``) runs on any shape under ``force_plan(decode=True)``, and ``decode=False`` keeps it
out; forcing anything else keeps it out too.

Not meant for production code. The forced plan holds in the thread (or asyncio context) that entered the block,
through a context variable of ``flash_kda.planning``; it is part of every plan-cache key.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Iterator, Optional

from flash_kda import _ext, planning

__all__ = ["force_plan", "V_SPLITS", "default_v_split", "default_plan"]

V_SPLITS = planning.V_SPLITS


@contextlib.contextmanager
def force_plan(v_split: int = 0, segment_chunks: Optional[int] = None, scan_v_split: int = 0,
               single_pass: Optional[bool] = None, lead_chunks: Optional[int] = None,
               decode: Optional[bool] = None) -> Iterator[None]:
    """Within the block, ``fwd`` on CUDA runs the forced plan.

    | arg | type | meaning |
    |---|---|---|
    | v_split | int | 1, 2, 4 or 8: each recurrence CTA owns 128 / v_split state rows (0: automatic) |
    | segment_chunks | int / None | time split into segments of this many 16-token chunks; 0: no split; None: automatic |
    | scan_v_split | int | 1, 2, 4 or 8 CTAs per map in the time split's scan; 0: v_split if forced, else automatic |
    | single_pass | bool / None | True: the single pass (no time split, v_split 1); False: two stages; None: automatic (two stages whenever a V split is forced) |
    | lead_chunks | int / None | L >= 0: the overlap, lead of L chunks (v_split 1, no time split), on fixed-length batches only: a varlen call gets the plan it would get with -1; -1: none; None: automatic (none when anything else is forced) |
    | decode | bool / None | True: the decode kernel (nothing else may be forced); False: a chunked plan; None: automatic (sequences of at most 16 tokens, mean for varlen; a chunked plan when anything else is forced) |
    """
    # NumPy integers as the ints they hold (as fwd takes them); sizes past an int32 cannot be a plan's
    v_split, scan_v_split, segment_chunks, lead_chunks = (
        int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x
        for x in (v_split, scan_v_split, segment_chunks, lead_chunks))
    for name, value in (("v_split", v_split), ("scan_v_split", scan_v_split)):
        if isinstance(value, bool) or not isinstance(value, int) or value not in (0, *V_SPLITS):
            raise ValueError(f"{name} must be 0 (automatic) or one of {list(V_SPLITS)}, got {name}={value!r}")
    if segment_chunks is not None and (
        isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int) or not 0 <= segment_chunks < 2**31
    ):
        raise ValueError(f"segment_chunks must be None (automatic) or an int in [0, 2^31), got {segment_chunks=}")
    if single_pass is not None and not isinstance(single_pass, bool):
        raise ValueError(f"single_pass must be None (automatic), True or False, got {single_pass=!r}")
    if single_pass and (v_split not in (0, 1) or scan_v_split or segment_chunks):
        raise ValueError("single_pass=True runs v_split 1 without a time split, got "
                         f"{v_split=}, {scan_v_split=}, {segment_chunks=}")
    if lead_chunks is not None and (isinstance(lead_chunks, bool) or not isinstance(lead_chunks, int)
                                    or not -1 <= lead_chunks < 2**31):
        raise ValueError(f"lead_chunks must be None (automatic), -1 (no overlap) or an int in [0, 2^31), got "
                         f"{lead_chunks=}")
    if lead_chunks is not None and lead_chunks >= 0 and (v_split not in (0, 1) or scan_v_split or segment_chunks
                                                          or single_pass):
        raise ValueError("lead_chunks >= 0 runs v_split 1 without a time split or the single pass, got "
                         f"{v_split=}, {scan_v_split=}, {segment_chunks=}, {single_pass=}")
    if decode is not None and not isinstance(decode, bool):
        raise ValueError(f"decode must be None (automatic), True or False, got {decode=!r}")
    if decode and (v_split or scan_v_split or segment_chunks is not None or single_pass is not None
                   or lead_chunks is not None):
        raise ValueError("decode=True runs the decode kernel alone (no V split, time split, single pass or overlap), "
                         f"got {v_split=}, {scan_v_split=}, {segment_chunks=}, {single_pass=}, {lead_chunks=}")
    overrides = planning.PlanOverrides(v_split=v_split or None, scan_v_split=scan_v_split or None,
                                       segment_chunks=segment_chunks, single_pass=single_pass, lead_chunks=lead_chunks,
                                       decode=decode)
    with planning.forced(overrides):
        yield


def default_v_split(num_seqs: int, heads: int, sm_count: int) -> int:
    """The V split that N sequences of H heads get on a GPU with ``sm_count`` SMs from their count alone (no time
    split). ``default_plan`` has the whole choice: batches of many short sequences (mean at most 8 chunks) that
    get 1 here get 2 there (kda_plan.h)."""
    return int(_ext.load().choose_v_split(num_seqs, heads, sm_count))


def default_plan(total_tokens: int, seqlen: int, num_seqs: int, heads: int, varlen: bool,
                 sm_count: int, gate: str = "lower_bound") -> planning.Plan:
    """The plan ``fwd`` chooses for these shapes and gate on a GPU with ``sm_count`` SMs (nothing forced)."""
    return _ext.load().choose_plan(total_tokens, seqlen, num_seqs, heads, varlen, sm_count,
                                   gate=planning.GATE_CODES[gate])
