"""The correctness matrix of docs/SPEC.md §4 as data: one frozen ``Case`` per test case, grouped in named slices.

Slices (each is one sharded, tagged Bazel py_test; ``--kda-slice`` selects them in pytest):
- ``smoke``: one small fixed-seed case, the quick sanity run.
- ``fixed_h1_h4``, ``fixed_h32``, ``fixed_h96``: B = 1, T in FIXED_T, every state configuration.
- ``varlen``: cu_seqlens with VARLEN_SEQLENS × H {1, 4, 96} × state configuration.
- ``batched``: B > 1 with (B, T) in BATCHED_BT × H {1, 4, 96} × state configuration.
- ``long_context``: T 131072 and 1048576 (H = 1), varlen [131072] and [524288, 524288]; in+out bf16 state.
- ``adversarial``: extreme gates, biases and beta logits, near-collinear keys, lower_bound at both ends and on
  both sides of the slow-decay threshold, zero-length sequences, T = 0, int32 cu_seqlens, in-place state.
- ``forced_vsplit``: every case of the slices above except smoke and long_context again, with the
  recurrence's V split forced (``flash_kda.testing.force_plan``) to 1, 2, 4 or 8 in turn, so every split runs
  on every kind of shape (the automatic choice gives H96 split 1, H32 split 4, H1/H4 split 8).
- ``forced_tsplit``: the same cases again with the time split forced to segments of 1, 2, 3, 5 or 8 chunks
  (and the V split cycling too), so the scan, the composition and the segmented finish run on every kind of
  shape — short, ragged, empty and one-token sequences, every state mode — against the twin's re-enactment.
- ``forced_single_pass``: the same cases again under the single pass (one kernel prepares each block of 8 chunks
  into shared memory and runs it), which the plan picks for batches of many (sequence, head) pairs.
- ``pool``: pooled states (``state_indices``): random slot permutations of pools larger than the batch, padding
  rows (negative indices), one-slot pools, in place and two pools, both state dtypes and mixed, int32 and int64
  indices (on the device, and on the host), fixed and varlen, under every plan kind (forced: two stages, single
  pass, time splits of 1-3 chunks with V splits, the overlap with a lead on fixed lengths, V splits 2/4/8).
- ``forced_overlap``: the fixed-length cases among them again under the overlap (the preparation's tail on the
  SMs the recurrence leaves free, behind ready flags), with leads of 0, 1, 2 and 5 chunks in turn, so that
  records from both preparation kernels meet in every kind of sequence; the plan picks it for T8192 H96-like
  shapes (``fixed_h96`` runs it at T >= 1024).
- ``decode``: sequences of at most 16 tokens, which the plan runs on the decode kernel (token by token, the state
  in fp32 registers): fixed T in DECODE_T x H {1, 4, 32}, short varlen batches (DECODE_SEQLENS, empty sequences
  among them), a few batched ones, in place, int32 cu_seqlens and mixed state dtypes, every state configuration;
  held to the tighter short-sequence bounds of test_matrix.py (DECODE_*_REL_L2).
- ``forced_decode``: the cases of the slices above except smoke and long_context again under
  ``force_plan(decode=True)`` (sequences of more than DECODE_FORCED_MAX_TOKENS tokens left out: the twin steps
  token by token), so the decode kernel runs long, ragged and adversarial sequences too.

A state configuration is (state_io, state_dtype): state_io in STATE_IO, state dtype bf16 or fp32 ("none" for
no_state, where no state tensor exists so the dtype has no meaning and is not repeated).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

STATE_IO = ("in+out", "in_only", "out_only", "no_state")
STATE_DTYPES = ("bf16", "fp32")
FIXED_T = (16, 64, 256, 1024, 4096, 8192, 17, 37, 97)
VARLEN_SEQLENS = (
    (16,),
    (16, 16),
    (4, 8, 12),
    (64, 128, 256),
    (1300, 547, 2048, 963, 271, 3063),
    (1024,) * 8,
    (20, 50, 100),
    (17, 33, 65),
)
BATCHED_BT = ((2, 64), (2, 1024), (4, 256), (8, 128))
VARLEN_H = (1, 4, 96)
DECODE_T = (1, 2, 3, 5, 8, 15, 16)
DECODE_H = (1, 4, 32)
DECODE_SEQLENS = ((1,), (1, 1, 1, 1), (4,) * 8, (1, 2, 3, 5, 8, 15), (0, 3, 0, 16), (16,) * 3)
DECODE_BATCHED_BT = ((8, 1), (4, 3), (3, 16))
DECODE_FORCED_MAX_TOKENS = 4096  # longest sequence of a forced_decode case
SLICES = (
    "smoke", "fixed_h1_h4", "fixed_h32", "fixed_h96", "varlen", "batched", "long_context", "adversarial",
    "forced_vsplit", "forced_tsplit", "forced_single_pass", "forced_overlap", "pool", "decode", "forced_decode",
)  # fmt: skip
FORCED_V_SPLITS = (1, 2, 4, 8)
FORCED_SEGMENT_CHUNKS = (1, 2, 3, 5, 8)
FORCED_LEAD_CHUNKS = (0, 1, 2, 5)

# Input recipes of the adversarial slice (``Case.inputs``); "random" is the default everywhere.
INPUT_RECIPES = (
    "random",
    "g=+8",  # g constant +8: gate saturates at lower_bound (fastest decay)
    "g=-8",  # g constant -8: gate ~0 (almost no decay, the state accumulates)
    "dt_bias=+8",
    "dt_bias=-8",
    "collinear_k",  # keys nearly parallel: I + A is close to singular-looking; an fp16 Neumann series NaNs here
    "beta=+10",  # beta ≈ 1
    "beta=-10",  # beta ≈ 0
    "beta=±10",  # random signs: each token either writes fully or not at all
)


@dataclass(frozen=True)
class Case:
    """One test case: the shapes, the state configuration, the input recipe and the seed."""

    slice: str
    H: int
    T: int = 0  # tokens per row (fixed/batched); the packed total for varlen
    B: int = 1
    seqlens: tuple[int, ...] | None = None  # varlen (cu_seqlens given) when not None
    state_io: str = "in+out"
    state_dtype: str = "bf16"  # "bf16" / "fp32" / "none" (no_state)
    lower_bound: float = -5.0
    inputs: str = "random"
    cu_seqlens_int32: bool = False
    inplace_state: bool = False  # final_state is the same tensor as initial_state
    v_split: int = 0  # recurrence V split forced through flash_kda.testing.force_plan; 0: automatic
    segment_chunks: int = -1  # time split forced through flash_kda.testing.force_plan; -1: automatic
    single_pass: bool | None = None  # the single pass forced on (True) or off (False); None: automatic
    lead_chunks: int = -2  # the overlap forced with this lead (-1: off) through force_plan; -2: automatic
    decode: bool | None = None  # the decode kernel forced on (True) or off (False); None: automatic
    final_dtype: str = ""  # final_state's dtype when it differs from state_dtype (fla: bf16 in, fp32 out)
    param_dtype: str = "fp32"  # A_log and dt_bias ("bf16" / "fp16": a model cast with layer.to(bf16))
    pool: int = 0  # P > 0: the states are pools of P slots, sequence n in slot state_indices[n]; 0: dense states
    padding: int = 0  # with a pool: this many sequences get a negative index (no slot)
    indices_int32: bool = False  # with a pool: int32 state_indices (else int64)
    indices_on_host: bool = False  # with a pool: state_indices on the CPU (copied through the workspace)
    seed: int = -1  # -1: derived from the id

    def __post_init__(self) -> None:
        if self.seqlens is not None:
            object.__setattr__(self, "T", sum(self.seqlens))
        if self.state_io == "no_state":
            object.__setattr__(self, "state_dtype", "none")
        if self.seed < 0:
            object.__setattr__(self, "seed", zlib.crc32(self.id.encode()))
        assert self.slice in SLICES, self.slice
        assert self.state_io in STATE_IO, self.state_io
        assert self.inputs in INPUT_RECIPES, self.inputs
        assert not self.inplace_state or self.state_io == "in+out"
        assert not self.final_dtype or (self.has_final and not self.inplace_state)
        assert self.pool >= 0 and 0 <= self.padding <= self.num_seqs
        assert not self.pool or (self.state_io != "no_state" and self.pool >= self.num_seqs - self.padding)

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.varlen else self.B

    @property
    def has_initial(self) -> bool:
        return self.state_io in ("in+out", "in_only")

    @property
    def has_final(self) -> bool:
        return self.state_io in ("in+out", "out_only")

    @property
    def longest(self) -> int:
        """Tokens of the longest sequence."""
        return max(self.seqlens, default=0) if self.varlen else self.T

    @property
    def tokens(self) -> int:
        return self.B * self.T

    @property
    def id(self) -> str:
        if self.varlen:
            seqs = ",".join(map(str, self.seqlens))
            if len(self.seqlens) > 4 and len(set(self.seqlens)) == 1:  # [1024]*8 -> [1024x8]
                seqs = f"{self.seqlens[0]}x{len(self.seqlens)}"
            shape = f"varlen_[{seqs}]_H{self.H}"
        elif self.B > 1:
            shape = f"B{self.B}_T{self.T}_H{self.H}"
        else:
            shape = f"H{self.H}_T{self.T}"
        extras = []
        if self.inputs != "random":
            extras.append(self.inputs)
        if self.lower_bound != -5.0:
            extras.append(f"lb={self.lower_bound:g}")
        if self.cu_seqlens_int32:
            extras.append("cu=int32")
        if self.inplace_state:
            extras.append("inplace")
        if self.final_dtype:
            extras.append(f"final={self.final_dtype}")
        if self.param_dtype != "fp32":
            extras.append(f"params={self.param_dtype}")
        if self.pool:
            extras.append(f"pool{self.pool}" + (f"_pad{self.padding}" if self.padding else "")
                          + ("_idx=int32" if self.indices_int32 else "") + ("_idx=host" if self.indices_on_host else ""))
        if self.slice in ("smoke", "adversarial", "decode"):  # their shapes recur in other slices
            extras.insert(0, {"adversarial": "adv", "smoke": "smoke", "decode": "short"}[self.slice])
        if self.v_split:
            extras.insert(0, f"vsplit{self.v_split}")
        if self.segment_chunks >= 0:
            extras.insert(0, f"tsplit{self.segment_chunks}")
        if self.single_pass is not None:
            extras.insert(0, "single" if self.single_pass else "two_stage")
        if self.lead_chunks >= -1:
            extras.insert(0, f"lead{self.lead_chunks}")
        if self.decode is not None:
            extras.insert(0, "decode" if self.decode else "chunked")
        prefix = "".join(f"{x}_" for x in extras)
        return f"{prefix}{shape}_state_dtype={self.state_dtype}[{self.state_io}]"


def _state_configs() -> list[tuple[str, str]]:
    configs = [(io, dt) for io in STATE_IO if io != "no_state" for dt in STATE_DTYPES]
    return configs + [("no_state", "none")]


def _fixed(slice_: str, heads: tuple[int, ...]) -> list[Case]:
    return [
        Case(slice_, H=h, T=t, state_io=io, state_dtype=dt)
        for h in heads
        for t in FIXED_T
        for io, dt in _state_configs()
    ]


def _varlen() -> list[Case]:
    return [
        Case("varlen", H=h, seqlens=s, state_io=io, state_dtype=dt)
        for s in VARLEN_SEQLENS
        for h in VARLEN_H
        for io, dt in _state_configs()
    ]


def _batched() -> list[Case]:
    return [
        Case("batched", H=h, B=b, T=t, state_io=io, state_dtype=dt)
        for b, t in BATCHED_BT
        for h in VARLEN_H
        for io, dt in _state_configs()
    ]


def _long_context() -> list[Case]:
    return [
        Case("long_context", H=1, T=131072),
        Case("long_context", H=1, T=1048576),
        Case("long_context", H=1, seqlens=(131072,)),
        Case("long_context", H=1, seqlens=(524288, 524288)),
    ]


def _adversarial() -> list[Case]:
    cases = []
    for recipe in INPUT_RECIPES[1:]:
        for dt in STATE_DTYPES:
            cases.append(Case("adversarial", H=4, T=97, inputs=recipe, state_dtype=dt))
        cases.append(Case("adversarial", H=4, seqlens=(17, 33, 65), inputs=recipe))
    for lb in (-5.0, -1e-3, 0.0):
        cases.append(Case("adversarial", H=4, T=256, lower_bound=lb))
        cases.append(Case("adversarial", H=4, T=256, lower_bound=lb, inputs="g=+8", state_dtype="fp32"))
    # Both sides of the slow-decay state update's threshold (kda_plan.h, hi_lo_state_update), on the 8-warp
    # (wgmma) CTAs of H = 96 and the smaller ones of H = 32.
    for lb in (-4.0, -3.99, -0.01):
        cases.append(Case("adversarial", H=96, T=97, lower_bound=lb))
    cases.append(Case("adversarial", H=32, seqlens=(17, 33, 65), lower_bound=-0.5, state_dtype="fp32"))
    for seqlens in ((0, 16, 0, 33, 0), (0,), (0, 0), (5, 0), (0, 1), (1,), (16, 0, 17)):
        for io, dt in _state_configs():
            cases.append(Case("adversarial", H=4, seqlens=seqlens, state_io=io, state_dtype=dt))
    # Longest first (more (sequence, head) pairs than SMs) with empty sequences and ties among the ranks.
    # (82 tokens over 6 sequences would pick the decode kernel: kept on the chunked plans.)
    for dt in STATE_DTYPES:
        cases.append(Case("adversarial", H=96, seqlens=(0, 16, 0, 33, 0, 33), state_dtype=dt, decode=False))
    for b in (1, 2):
        for io, dt in _state_configs():
            cases.append(Case("adversarial", H=4, B=b, T=0, state_io=io, state_dtype=dt))
    for dt in STATE_DTYPES:
        cases.append(Case("adversarial", H=4, seqlens=(20, 50, 100), cu_seqlens_int32=True, state_dtype=dt))
        cases.append(Case("adversarial", H=4, T=97, inplace_state=True, state_dtype=dt))
        cases.append(Case("adversarial", H=4, seqlens=(16, 0, 37), inplace_state=True, state_dtype=dt))
    # The dtypes real callers pass: mixed initial / final state dtypes, bf16 / fp16 gate parameters.
    for init, final in (("bf16", "fp32"), ("fp32", "bf16")):
        for params in ("fp32", "bf16", "fp16"):
            cases.append(Case("adversarial", H=4, T=97, state_dtype=init, final_dtype=final, param_dtype=params))
            cases.append(Case("adversarial", H=1, T=1024, state_dtype=init, final_dtype=final, param_dtype=params))
        cases.append(Case("adversarial", H=4, seqlens=(17, 0, 65), state_dtype=init, final_dtype=final,
                          param_dtype="bf16"))
    for params in ("bf16", "fp16"):
        cases.append(Case("adversarial", H=4, T=97, param_dtype=params))
    return cases


def _forced_vsplit(base: list[Case]) -> list[Case]:
    """The base cases again with the V split forced, cycling through FORCED_V_SPLITS (same inputs: same seed)."""
    return [
        dataclasses.replace(c, slice="forced_vsplit", v_split=FORCED_V_SPLITS[i % len(FORCED_V_SPLITS)])
        for i, c in enumerate(base)
    ]


def _forced_tsplit(base: list[Case]) -> list[Case]:
    """The base cases again with the time split forced (segment lengths cycling through FORCED_SEGMENT_CHUNKS,
    V splits through FORCED_V_SPLITS in the other direction)."""
    return [
        dataclasses.replace(
            c,
            slice="forced_tsplit",
            segment_chunks=FORCED_SEGMENT_CHUNKS[i % len(FORCED_SEGMENT_CHUNKS)],
            v_split=FORCED_V_SPLITS[-1 - i % len(FORCED_V_SPLITS)],
        )
        for i, c in enumerate(base)
    ]


def _forced_single_pass(base: list[Case]) -> list[Case]:
    """The base cases again under the single pass (no time split, v_split 1: the plan of its own). An adversarial
    case that loses its prefix here and then reads like a fixed-length one (H4 T256 at lower_bound -5) runs once."""
    cases: dict[str, Case] = {}
    for c in base:
        forced = dataclasses.replace(c, slice="forced_single_pass", single_pass=True)
        cases.setdefault(forced.id, forced)
    return list(cases.values())


def _forced_overlap(base: list[Case]) -> list[Case]:
    """The fixed-length base cases again under the overlap, leads cycling through FORCED_LEAD_CHUNKS (varlen
    batches run without it). An adversarial case that reads like a fixed-length one once it loses its prefix runs
    once."""
    cases: dict[str, Case] = {}
    for c in (c for c in base if not c.varlen):
        forced = dataclasses.replace(c, slice="forced_overlap",
                                     lead_chunks=FORCED_LEAD_CHUNKS[len(cases) % len(FORCED_LEAD_CHUNKS)])
        cases.setdefault(forced.id, forced)
    return list(cases.values())


def _pool() -> list[Case]:
    """Pooled states on every plan kind: shapes x (P, padding) x state configurations x forced plans, cycled so
    that each plan meets every kind of shape and pool without the product's size."""
    shapes = [dict(B=3, T=97, H=4), dict(B=2, T=37, H=2), dict(B=8, T=20, H=2), dict(seqlens=(17, 0, 65, 5), H=4),
              dict(seqlens=(100, 16, 1, 33, 0), H=2)]
    pools = [(3, 1), (0, 0), (0, -1)]  # (extra slots, padding): P = N - padding + extra; -1: all padded but one
    states = [("in+out", "bf16", False, ""), ("in+out", "fp32", True, ""), ("in_only", "fp32", False, ""),
              ("out_only", "bf16", False, ""), ("in+out", "bf16", False, "fp32"), ("in+out", "fp32", False, "")]
    plans = [dict(), dict(single_pass=False, lead_chunks=-1), dict(single_pass=True),
             dict(segment_chunks=1, v_split=8), dict(segment_chunks=2, v_split=1), dict(segment_chunks=3, v_split=4),
             dict(lead_chunks=2), dict(lead_chunks=0), dict(v_split=2), dict(v_split=4), dict(v_split=8),
             dict(decode=True)]
    cases: dict[str, Case] = {}
    i = 0
    for shape in shapes:
        N = len(shape["seqlens"]) if "seqlens" in shape else shape["B"]
        for extra, padding in pools:
            padding = N - 1 if padding < 0 else padding
            P = N - padding + extra
            for io, dt, inplace, final in states:
                plan = plans[i % len(plans)]
                i += 1
                if "seqlens" in shape and "lead_chunks" in plan and plan["lead_chunks"] >= 0:
                    plan = dict(segment_chunks=1, v_split=2)  # the overlap takes fixed lengths only
                case = Case("pool", **shape, state_io=io, state_dtype=dt, inplace_state=inplace, final_dtype=final,
                            pool=P, padding=padding, indices_int32=i % 3 == 0, indices_on_host=i % 7 == 0, **plan)
                cases.setdefault(case.id, case)
    return list(cases.values())


def _decode() -> list[Case]:
    cases = [
        Case("decode", H=h, T=t, state_io=io, state_dtype=dt)
        for h in DECODE_H
        for t in DECODE_T
        for io, dt in _state_configs()
    ]
    cases += [
        Case("decode", H=h, seqlens=s, state_io=io, state_dtype=dt)
        for s in DECODE_SEQLENS
        for h in DECODE_H
        for io, dt in _state_configs()
    ]
    cases += [
        Case("decode", H=4, B=b, T=t, state_io=io, state_dtype=dt)
        for b, t in DECODE_BATCHED_BT
        for io, dt in _state_configs()
    ]
    for dt in STATE_DTYPES:
        cases.append(Case("decode", H=32, B=8, T=1, inplace_state=True, state_dtype=dt))
        cases.append(Case("decode", H=4, seqlens=(3, 0, 16, 1), inplace_state=True, state_dtype=dt))
        cases.append(Case("decode", H=4, seqlens=(1, 2, 3, 5, 8, 15), cu_seqlens_int32=True, state_dtype=dt))
    for init, final in (("bf16", "fp32"), ("fp32", "bf16")):
        for params in ("fp32", "bf16", "fp16"):
            cases.append(Case("decode", H=4, T=5, state_dtype=init, final_dtype=final, param_dtype=params))
    return cases


def _forced_decode(base: list[Case]) -> list[Case]:
    """The base cases again under the decode kernel, sequences of at most DECODE_FORCED_MAX_TOKENS tokens (a case
    that reads like another once it loses its prefix runs once)."""
    cases: dict[str, Case] = {}
    for c in base:
        if c.longest <= DECODE_FORCED_MAX_TOKENS:
            forced = dataclasses.replace(c, slice="forced_decode", decode=True)
            cases.setdefault(forced.id, forced)
    return list(cases.values())


def all_cases() -> list[Case]:
    cases = [Case("smoke", H=4, T=97, seed=0)]
    base = _fixed("fixed_h1_h4", (1, 4)) + _fixed("fixed_h32", (32,)) + _fixed("fixed_h96", (96,))
    base += _varlen() + _batched()
    adversarial = _adversarial()
    cases += base + _long_context() + adversarial + _forced_vsplit(base + adversarial)
    cases += _forced_tsplit(base + adversarial) + _forced_single_pass(base + adversarial)
    cases += _forced_overlap(base + adversarial) + _pool()
    cases += _decode() + _forced_decode(base + adversarial)
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases


def cases(slices: str | None = None) -> list[Case]:
    """The cases of the given comma-separated slices (all of them for None, "" or "all")."""
    if not slices or slices == "all":
        return all_cases()
    wanted = set(slices.split(","))
    unknown = wanted - set(SLICES)
    if unknown:
        raise ValueError(f"unknown slice(s) {sorted(unknown)}; slices are {list(SLICES)}")
    return [c for c in all_cases() if c.slice in wanted]


def replace(case: Case, **changes) -> Case:
    """A copy of ``case`` with fields changed (the seed is re-derived unless given)."""
    changes.setdefault("seed", -1)
    return dataclasses.replace(case, **changes)


DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def make_inputs(case: Case, device) -> dict:
    """Inputs of ``case`` on ``device`` (generated there, from the case's seed), with NaN-poisoned outputs.

    Returns a dict with the ``flash_kda.fwd`` arguments: q, k, v, g, beta, scale, out, A_log, dt_bias,
    lower_bound, initial_state, final_state, cu_seqlens. Distributions follow fla's KDA tests: bf16 randn
    q/k/v/g/beta (beta as logits), fp32 randn A_log [H] and dt_bias [H, K] (cast to the case's param dtype), an
    fp32 randn initial state cast to the state dtype. ``out`` and ``final_state`` are NaN-filled so unwritten elements fail loudly.
    """
    import torch  # noqa: PLC0415 -- the data above is importable without torch

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    B, T, H, D = case.B, case.T, case.H, 128
    bf16 = torch.bfloat16

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k, v, g = (randn(B, T, H, D, dtype=bf16) for _ in range(4))
    beta = randn(B, T, H, dtype=bf16)
    param_dtype = getattr(torch, DTYPES[case.param_dtype])
    A_log = randn(H, dtype=param_dtype)
    dt_bias = randn(H, D, dtype=param_dtype)
    recipe = case.inputs
    if recipe.startswith("g="):
        g.fill_(float(recipe[2:]))
    elif recipe.startswith("dt_bias="):
        dt_bias.fill_(float(recipe[8:]))
    elif recipe == "collinear_k":
        # One direction per head plus noise below bf16's resolution: many keys round to the same vector.
        k = (randn(1, 1, H, D) + 1e-3 * randn(B, T, H, D)).to(bf16)
    elif recipe == "beta=±10":
        beta = (10 * torch.sign(randn(B, T, H))).to(bf16)
    elif recipe.startswith("beta="):
        beta.fill_(float(recipe[5:]))
    state_dtype = getattr(torch, DTYPES[case.state_dtype]) if case.state_dtype != "none" else None
    N = case.num_seqs
    rows = case.pool or N  # state rows: one per sequence, or the pool's slots
    initial_state = randn(rows, H, D, D, dtype=state_dtype) if case.has_initial else None
    if case.inplace_state:
        final_state = initial_state
    elif case.has_final:
        final_dtype = getattr(torch, DTYPES[case.final_dtype]) if case.final_dtype else state_dtype
        final_state = torch.full((rows, H, D, D), float("nan"), dtype=final_dtype, device=device)
    else:
        final_state = None
    state_indices = None
    if case.pool:
        # A random permutation's first slots for the sequences, negative indices (of several values) for
        # `padding` of them at random positions; drawn on the CPU, so the same on every device.
        host = torch.Generator().manual_seed(case.seed)
        slots = torch.randperm(case.pool, generator=host)[: N - case.padding]
        padded = torch.zeros(N, dtype=torch.bool)
        padded[torch.randperm(N, generator=host)[: case.padding]] = True
        indices = torch.zeros(N, dtype=torch.int64)
        indices[padded] = -1 - torch.arange(case.padding) % 3
        indices[~padded] = slots
        state_indices = indices.to(torch.int32 if case.indices_int32 else torch.int64)
        if not case.indices_on_host:
            state_indices = state_indices.to(device)
    cu_seqlens = None
    if case.varlen:
        cu = [0]
        for n in case.seqlens:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32 if case.cu_seqlens_int32 else torch.int64, device=device)
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, scale=D**-0.5, out=torch.full_like(v, float("nan")), A_log=A_log,
        dt_bias=dt_bias, lower_bound=case.lower_bound, initial_state=initial_state, final_state=final_state,
        cu_seqlens=cu_seqlens, state_indices=state_indices,
    )  # fmt: skip


INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "state_indices")
FWD_NAMES = ("q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias", "lower_bound", "initial_state",
             "final_state", "cu_seqlens", "state_indices")  # flash_kda.fwd's arguments (state_indices by keyword)


def twin_args(inputs: dict) -> dict:
    """The keyword arguments of numerics.twin_forward / cpu_forward / reference_* for ``inputs`` (with a pool:
    ``final_state`` is the pool as ``inputs`` hold it, the base of the pool the references return)."""
    keys = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "initial_state", "cu_seqlens")
    args = {name: inputs[name] for name in keys}
    if inputs.get("state_indices") is not None:
        args["state_indices"] = inputs["state_indices"]
        args["final_state"] = inputs["final_state"]
    return args


def same_bits(a, b) -> bool:
    """Whether two tensors hold the same values bit for bit, NaNs (the poison of untouched pool slots) included."""
    import torch  # noqa: PLC0415

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype])) if a.dtype in ints else torch.equal(a, b)
