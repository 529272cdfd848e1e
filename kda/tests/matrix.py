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
- ``gate_softplus``: the softplus gate (``gate="softplus"``, λ = −exp(A_log)·softplus(g + dt_bias)) with A_log up to
  ln 16 and g + dt_bias spanning ±50 (SOFTPLUS_RECIPES): every state configuration, short and long fixed lengths
  (H 1 to 96), varlen, batched, decode lengths (T ≤ 16), a per-token log decay of -960 (the state is erased at
  every token: no NaN or inf, and the result of a zero initial state), A_log or dt_bias None, bf16 / fp16 gate
  parameters, mixed state dtypes, pools, scales of 2^100 and 2^-30.
- ``neg_eigval``: ``allow_neg_eigval=True`` (β = 2·sigmoid(beta), eigenvalues of the transition in (-1, 1)) under
  both gates: every state configuration, fixed, varlen, batched and decode lengths, beta logits at ±10 (β ≈ 2:
  reflections), near-collinear keys, pools.
- ``gva``: grouped value heads (G = H / key heads = 2 and 4; H 4 to 96 value heads, so 1 to 48 key heads) under
  both gates, with and without negative eigenvalues: every state configuration, fixed, varlen, batched, decode
  lengths, pools (padding rows, in place).
  Each of these three slices runs its cases under the automatic plan and again under every forced plan kind
  (``_with_forced_plans``: V split, time split, single pass (two stages for the softplus gate, which the single
  pass does not run), overlap on fixed lengths, and the decode kernel on sequences of more than 16 tokens or a
  chunked plan on shorter ones); cases of more than HEAVY_TOKEN_HEADS token-heads take one forced kind each, in
  turn.
- ``token_states``: per-token states (speculative verification): ``state_indices`` [N, L] with L in TOKEN_STATE_L
  and ``num_accepted_tokens`` (random in [1, L] on the device; a few None or on the host), fixed and varlen batches
  of 0 to 40 tokens per sequence (shorter than, equal to and longer than L), bf16 / fp32 / mixed pools in place and
  two pools (and a few without an initial pool: every sequence starts from zeros), padding rows and negative
  entries, int32 / int64 indices on the device or the host, a few softplus-gate, negative-eigenvalue and GVA cases;
  each under the automatic plan (the decode kernel for these lengths, a chunked plan past 16 tokens per sequence)
  and forced chunked plans (``decode=False``, a V split of 2, a time split of 2 chunks on sequences of more than 32
  tokens; and the decode kernel where the automatic plan is a chunked one). The written slots are held to the
  decode slice's bounds (their states come from the decode kernel's recurrence under every plan), out to the
  plan's.
- ``checkpoints``: prefix-cache checkpoints: ``state_indices`` [N] pools with ``checkpoint_indices`` [N, M] (int32
  and int64, on the device; negative entries) every C in CHECKPOINT_EVERY tokens, fixed and varlen batches with
  sequences shorter than C, of exactly C and of a few times C (up to about 3000 tokens; empty ones among them),
  bf16 / fp32 / mixed pools in place and two pools (a few without an initial pool), padding rows (their checkpoints
  are still written), a few softplus-gate, GVA and negative-eigenvalue cases; each under the
  automatic plan and forced ones (``_checkpoint_plans``: a V split of 2, time splits of 16 chunks (aligned with
  C = 256) and 24 (not aligned), the single pass on small shapes, the overlap with a lead of 8 on fixed lengths at
  H >= 32, the decode kernel on short sequences). Out, every written checkpoint and the final slots are held to the
  plan's bounds, and out and the final slots must equal those of the same call without checkpoints, bit for bit.

``Case.H`` is the number of value heads (the heads of v, g, beta, out and the states: what the plan and the
kernels run over); q and k have ``H // G`` key heads, value head h reading key head ``h // G``.

A state configuration is (state_io, state_dtype): state_io in STATE_IO, state dtype bf16 or fp32 ("none" for
no_state, where no state tensor exists so the dtype has no meaning and is not repeated).
"""

from __future__ import annotations

import dataclasses
import math
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
DECODE_MANY_SEQLENS = (0, 1, 2, 3, 4, 5, 6, 7) * 160  # 1,280 sequences: 20,480 items at H16
DECODE_FORCED_MAX_TOKENS = 4096  # longest sequence of a forced_decode case
TOKEN_STATE_L = (2, 4, 8)
# (shape, H) of the token_states slice: 0 to 40 tokens per sequence, below, at and above every L.
TOKEN_STATE_SHAPES = (
    (dict(B=8, T=1), 4), (dict(B=6, T=2), 32), (dict(B=4, T=4), 4), (dict(B=3, T=8), 1), (dict(B=2, T=5), 4),
    (dict(B=4, T=16), 4), (dict(B=3, T=37), 4), (dict(B=2, T=40), 32),
    (dict(seqlens=(1, 3, 0, 4, 2)), 4), (dict(seqlens=(1, 2, 3, 5, 8, 15)), 4), (dict(seqlens=(0, 3, 0, 16)), 32),
    (dict(seqlens=(8, 8, 8, 8)), 1), (dict(seqlens=(20, 3, 0, 40)), 4), (dict(seqlens=(17, 1, 33, 0, 9)), 4),
    (dict(seqlens=(40,)), 4), (dict(seqlens=(0, 2)), 4),
)  # fmt: skip
ACCEPTED = ("cuda", "host", "none")  # num_accepted_tokens on the indices' device, on the host, or None (a_n = 1)
CHECKPOINT_EVERY = (16, 64, 256, 512, 1024)
# (C, shape, H) of the checkpoints slice: per C, sequences shorter than C, of exactly C and of a few times C.
CHECKPOINT_SHAPES = (
    (16, dict(B=4, T=50), 4), (16, dict(B=2, T=16), 4), (16, dict(seqlens=(5, 16, 0, 47, 33)), 4),
    (16, dict(B=8, T=16), 8), (16, dict(seqlens=(1, 2, 3, 5, 8, 15, 16)), 4), (16, dict(B=2, T=160), 32),
    (64, dict(B=3, T=200), 4), (64, dict(B=2, T=64), 8), (64, dict(seqlens=(130, 64, 5, 0, 70)), 4),
    (64, dict(seqlens=(63, 64, 65, 128)), 4),
    (256, dict(T=2600), 8), (256, dict(B=2, T=512), 4), (256, dict(seqlens=(2300, 40, 256, 0, 600)), 4),
    (256, dict(seqlens=(255, 256, 257, 0, 1000)), 4), (256, dict(B=2, T=100), 4), (256, dict(T=2100), 32),
    (512, dict(seqlens=(2100, 300, 0, 700, 511)), 4), (512, dict(B=2, T=1100), 4), (512, dict(T=512), 32),
    (512, dict(B=2, T=1100), 32),
    (1024, dict(B=2, T=3000), 4), (1024, dict(seqlens=(1023, 1024, 0, 2048)), 4), (1024, dict(T=1024), 8),
    (1024, dict(T=2100), 32),
)  # fmt: skip
CHECKPOINT_SINGLE_PASS_TOKEN_HEADS = 8192  # the single pass is forced on checkpoint cases up to this size
SLICES = (
    "smoke", "fixed_h1_h4", "fixed_h32", "fixed_h96", "varlen", "batched", "long_context", "adversarial",
    "forced_vsplit", "forced_tsplit", "forced_single_pass", "forced_overlap", "pool", "decode", "forced_decode",
    "gate_softplus", "neg_eigval", "gva", "token_states", "checkpoints",
)  # fmt: skip
OPTION_SLICES = ("gate_softplus", "neg_eigval", "gva")  # the slices of the gates, negative eigenvalues and GVA
GATES = ("lower_bound", "softplus")
HEAVY_TOKEN_HEADS = 1 << 17  # an option slice's case of more tokens x heads than this takes one forced plan kind
SOFTPLUS_A_LOG_RANGE = (-2.0, math.log(16.0))  # A_log of the softplus gate's cases: exp(A_log) in [0.14, 16]
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
    # A_log +100 and -100 on alternate heads, dt_bias 0 and g 0 on every other channel: e^A_log past fp32's range
    # meets gate inputs of exactly 0 (∞·0 unless the kernels hold e^A_log in range, gate.cuh)
    "A_log=±100",
    # The softplus gate's (SOFTPLUS_RECIPES): A_log in SOFTPLUS_A_LOG_RANGE unless said otherwise.
    "g=U±50",  # g uniform in ±46, so g + dt_bias spans about ±50: decays from none to -800 per token
    "g=+50",  # g constant +50: a log decay of -exp(A_log)·50 per token (the state is almost erased each token)
    "g=-50",  # g constant -50: softplus ≈ 2e-22, no decay at all (the state accumulates)
    "decay=-960",  # A_log = ln 16, dt_bias = 0, g = 60: a log decay of -960 per token (exp underflows to 0)
)
SOFTPLUS_RECIPES = ("g=U±50", "g=+50", "g=-50", "decay=-960")


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
    gate: str = "lower_bound"  # fwd's gate: "lower_bound" or "softplus" (lower_bound is then passed as None)
    neg_eigval: bool = False  # fwd's allow_neg_eigval: beta = 2·sigmoid(logit)
    G: int = 1  # value heads per key head (GVA when > 1): q and k have H // G heads
    has_A_log: bool = True  # False: A_log=None (exp(A_log) taken as 1)
    has_dt_bias: bool = True  # False: dt_bias=None (taken as 0)
    state_tokens: int = 0  # L > 0: per-token states, state_indices [N, L] (padding rows: all L entries negative)
    accepted: str = "cuda"  # with per-token states: num_accepted_tokens (ACCEPTED)
    checkpoint_every: int = 0  # C > 0: checkpoint_indices [N, checkpoint_cols] beside state_indices [N]
    checkpoint_int32: bool = False  # with checkpoints: int32 checkpoint_indices (else int64)
    negative_entries: bool = False  # a fifth of the per-token or checkpoint entries that are written set to -1
    # varlen: this many padding tokens after the last sequence (cu_seqlens[-1] < T, as CUDA-graph batches pad them)
    tail_tokens: int = 0
    log2_scale: float | None = None  # scale = 2^log2_scale; None: K^-0.5
    seed: int = -1  # -1: derived from the id

    def __post_init__(self) -> None:
        if self.seqlens is not None:
            object.__setattr__(self, "T", sum(self.seqlens) + self.tail_tokens)
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
        assert self.gate in GATES, self.gate
        assert self.G >= 1 and self.H % self.G == 0, (self.H, self.G)
        assert self.inputs not in SOFTPLUS_RECIPES or self.gate == "softplus", (self.inputs, self.gate)
        assert self.accepted in ACCEPTED, self.accepted
        # Per-token states and checkpoints write into final_state, each entry into a slot of its own.
        assert not self.state_tokens or (self.has_final and not self.checkpoint_every
                                         and self.pool >= (self.num_seqs - self.padding) * self.state_tokens)
        assert not self.checkpoint_every or (
            self.has_final and self.checkpoint_every % 16 == 0
            and self.pool >= self.num_seqs - self.padding + self.num_seqs * self.checkpoint_cols)
        assert not self.negative_entries or self.state_tokens or self.checkpoint_every
        assert self.tail_tokens >= 0 and (not self.tail_tokens or self.varlen)

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
    def covered(self) -> int:
        """Tokens per row that belong to a sequence (T less the padding tokens past cu_seqlens[-1])."""
        return self.T - self.tail_tokens

    @property
    def checkpoint_cols(self) -> int:
        """M, checkpoints per sequence: one for every C tokens of the longest sequence, and one past it (never
        written)."""
        return self.longest // self.checkpoint_every + 1 if self.checkpoint_every else 0

    @property
    def key_heads(self) -> int:
        """Heads of q and k (H // G)."""
        return self.H // self.G

    @property
    def id(self) -> str:
        if self.varlen:
            seqs = ",".join(map(str, self.seqlens))
            if len(self.seqlens) > 4 and len(set(self.seqlens)) == 1:  # [1024]*8 -> [1024x8]
                seqs = f"{self.seqlens[0]}x{len(self.seqlens)}"
            elif len(self.seqlens) > 16:  # a repeated pattern: [0,1,2]*40 -> [(0,1,2)x40]
                n = len(self.seqlens)
                period = next(q for q in range(1, n + 1) if n % q == 0 and self.seqlens == self.seqlens[:q] * (n // q))
                if period < n:
                    seqs = f"({','.join(map(str, self.seqlens[:period]))})x{n // period}"
            shape = f"varlen_[{seqs}]" + (f"+{self.tail_tokens}" if self.tail_tokens else "") + f"_H{self.H}"
        elif self.B > 1:
            shape = f"B{self.B}_T{self.T}_H{self.H}"
        else:
            shape = f"H{self.H}_T{self.T}"
        extras = []
        if self.inputs != "random":
            extras.append(self.inputs)
        if self.lower_bound != -5.0:
            extras.append(f"lb={self.lower_bound:g}")
        if self.log2_scale is not None:
            extras.append(f"scale=2^{self.log2_scale:g}")
        if self.cu_seqlens_int32:
            extras.append("cu=int32")
        if self.inplace_state:
            extras.append("inplace")
        if self.final_dtype:
            extras.append(f"final={self.final_dtype}")
        if self.param_dtype != "fp32":
            extras.append(f"params={self.param_dtype}")
        if not self.has_A_log:
            extras.append("A_log=None")
        if not self.has_dt_bias:
            extras.append("dt_bias=None")
        if self.state_tokens:
            accepted = "" if self.accepted == "cuda" else f"_accepted={self.accepted}"
            extras.append(f"tokens{self.state_tokens}{accepted}" + ("_neg" if self.negative_entries else ""))
        if self.checkpoint_every:
            extras.append(f"ckpt{self.checkpoint_every}" + ("_idx=int32" if self.checkpoint_int32 else "")
                          + ("_neg" if self.negative_entries else ""))
        if self.pool:
            extras.append(f"pool{self.pool}" + (f"_pad{self.padding}" if self.padding else "")
                          + ("_idx=int32" if self.indices_int32 else "") + ("_idx=host" if self.indices_on_host else ""))
        if self.slice in ("smoke", "adversarial", "decode"):  # their shapes recur in other slices
            extras.insert(0, {"adversarial": "adv", "smoke": "smoke", "decode": "short"}[self.slice])
        # The options lead the id (the option slices' cases differ from the others' by them alone).
        if self.neg_eigval:
            extras.insert(0, "neg")
        if self.gate != "lower_bound":
            extras.insert(0, self.gate)
        if self.G > 1:
            extras.insert(0, f"G{self.G}")
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
    for recipe in (r for r in INPUT_RECIPES[1:] if r not in SOFTPLUS_RECIPES):
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
    # Padding tokens past cu_seqlens[-1] (a CUDA-graph batch padded to its captured size): in no sequence.
    for io, dt in _state_configs():
        cases.append(Case("adversarial", H=4, seqlens=(16, 0, 17), tail_tokens=7, state_io=io, state_dtype=dt))
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
              dict(seqlens=(100, 16, 1, 33, 0), H=2),
              dict(seqlens=(1, 1, 0, 1, 0), tail_tokens=2, H=4)]  # a decode batch padded to a graph's size
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
        # Many more (sequence, head) items than persistent CTAs: each CTA walks dozens of items of 0 to 7 tokens.
        cases.append(Case("decode", H=16, seqlens=DECODE_MANY_SEQLENS, inplace_state=True, state_dtype=dt))
        # A decode batch padded to a CUDA graph's size: empty sequences and padding tokens past cu_seqlens[-1].
        cases.append(Case("decode", H=4, seqlens=(1, 0, 1, 1, 0), tail_tokens=2, inplace_state=True, state_dtype=dt))
    for init, final in (("bf16", "fp32"), ("fp32", "bf16")):
        for params in ("fp32", "bf16", "fp16"):
            cases.append(Case("decode", H=4, T=5, state_dtype=init, final_dtype=final, param_dtype=params))
    return cases + _stream_pass_cases()


def _stream_pass_cases() -> list[Case]:
    """The stream pass's calls (kda_plan.h, stream_pass_runs: 16 tokens per sequence, no fp32 final state, at least
    one (sequence, head) item per SM), B8 T16 H32 (256 items): a bf16 pool in place with a padding row, dense states
    of every kind it takes (a bf16 final state or none, a bf16 or fp32 initial state or none), the slow-decay
    product, the softplus gate with grouped value heads and negative eigenvalues; and an fp32 final state, which
    stays on the chunk step."""
    shape = dict(H=32, B=8, T=16)
    return [
        Case("decode", **shape, state_dtype="bf16", inplace_state=True, pool=12, padding=1),
        Case("decode", **shape, state_dtype="bf16"),
        Case("decode", **shape, state_io="in_only", state_dtype="bf16"),
        Case("decode", **shape, state_io="out_only", state_dtype="bf16"),
        Case("decode", **shape, state_io="no_state"),
        Case("decode", **shape, state_dtype="fp32", final_dtype="bf16"),
        Case("decode", **shape, state_io="in_only", state_dtype="fp32"),
        Case("decode", **shape, state_dtype="bf16", lower_bound=-1.0),
        Case("decode", **shape, state_dtype="bf16", gate="softplus", G=2, neg_eigval=True),
        Case("decode", **shape, state_dtype="fp32"),
    ]


def _forced_decode(base: list[Case]) -> list[Case]:
    """The base cases again under the decode kernel, sequences of at most DECODE_FORCED_MAX_TOKENS tokens (a case
    that reads like another once it loses its prefix runs once)."""
    cases: dict[str, Case] = {}
    for c in base:
        if c.longest <= DECODE_FORCED_MAX_TOKENS:
            forced = dataclasses.replace(c, slice="forced_decode", decode=True)
            cases.setdefault(forced.id, forced)
    return list(cases.values())


def _with_forced_plans(base: list[Case]) -> list[Case]:
    """The base cases under the automatic plan, then again under every forced plan kind of the slices above: a V
    split (cycling through FORCED_V_SPLITS), a time split (segments cycling through FORCED_SEGMENT_CHUNKS, V
    splits the other way), the single pass (which runs the lower-bound gate only: the softplus gate's cases get two
    stages forced instead), the overlap (fixed lengths; leads cycling through FORCED_LEAD_CHUNKS) and the decode
    kernel (sequences of 17 to DECODE_FORCED_MAX_TOKENS tokens; shorter ones, which the decode kernel runs already,
    get a chunked plan instead). A case of more than HEAVY_TOKEN_HEADS token-heads takes one
    forced kind, in turn. A forced case that reads like another runs once."""
    cases: dict[str, Case] = {}
    heavy = 0
    for i, c in enumerate(base):
        kinds = [
            dict(v_split=FORCED_V_SPLITS[i % len(FORCED_V_SPLITS)]),
            dict(segment_chunks=FORCED_SEGMENT_CHUNKS[i % len(FORCED_SEGMENT_CHUNKS)],
                 v_split=FORCED_V_SPLITS[-1 - i % len(FORCED_V_SPLITS)]),
            dict(single_pass=True) if c.gate == "lower_bound" else dict(single_pass=False, lead_chunks=-1),
        ]
        if not c.varlen:
            kinds.append(dict(lead_chunks=FORCED_LEAD_CHUNKS[i % len(FORCED_LEAD_CHUNKS)]))
        if c.longest <= 16:
            kinds.append(dict(decode=False))
        elif c.longest <= DECODE_FORCED_MAX_TOKENS:
            kinds.append(dict(decode=True))
        if c.tokens * c.H > HEAVY_TOKEN_HEADS:
            kinds = [kinds[heavy % len(kinds)]]
            heavy += 1
        for forced in [c] + [dataclasses.replace(c, **kind) for kind in kinds]:
            cases.setdefault(forced.id, forced)
    return list(cases.values())


def _options_base(slice_: str, options: dict, *, configs: bool = True, few: bool = False) -> list[Case]:
    """Shapes every option slice runs (``options``: the Case fields of the option): every state configuration on a
    ragged fixed length, a varlen batch with empty sequences and a decode length (``configs``); fixed lengths
    short and long with H 1 to 96, varlen, batched, decode lengths and batches, in place, int32 cu_seqlens, both
    state dtypes (``few``: six of these shapes). With GVA, a single head becomes G value heads of one key head."""
    G = options.get("G", 1)

    def case(H: int, **fields) -> Case:
        return Case(slice_, H=H if H % G == 0 else H * G, **fields, **options)

    if few:
        return [case(4, T=97), case(4, seqlens=(17, 0, 33, 65), state_dtype="fp32"), case(32, T=1024),
                case(4, B=4, T=256, state_dtype="fp32"), case(4, T=5),
                case(4, seqlens=(1, 2, 3, 5, 8, 15), state_dtype="fp32")]
    cases = []
    if configs:
        for io, dt in _state_configs():
            cases.append(case(4, T=97, state_io=io, state_dtype=dt))
            cases.append(case(4, seqlens=(17, 0, 33, 65), state_io=io, state_dtype=dt))
            cases.append(case(4, T=5, state_io=io, state_dtype=dt))
    for i, (h, t) in enumerate(((1, 17), (1, 4096), (4, 64), (4, 256), (4, 1024), (32, 1024), (96, 256))):
        cases.append(case(h, T=t, state_dtype=STATE_DTYPES[i % 2]))
    for i, seqlens in enumerate(((1300, 547, 2048, 963, 271, 3063), (1024,) * 8, (0, 16, 0, 33, 0), (20, 50, 100))):
        cases.append(case(4 if i else 32, seqlens=seqlens, state_dtype=STATE_DTYPES[i % 2], cu_seqlens_int32=i == 3))
    cases.append(case(4, B=4, T=256, state_dtype="fp32"))
    cases.append(case(32, B=2, T=300))
    cases.append(case(4, seqlens=(16, 0, 37), inplace_state=True, state_dtype="fp32"))
    # Decode lengths (the decode kernel): one token to 16, short varlen batches, many sequences, in place.
    for i, t in enumerate((1, 2, 3, 8, 15, 16)):
        cases.append(case(32 if i % 2 else 4, T=t, state_dtype=STATE_DTYPES[i % 2]))
    for i, seqlens in enumerate(((1, 2, 3, 5, 8, 15), (0, 3, 0, 16), (1,) * 4)):
        cases.append(case(32 if i == 2 else 4, seqlens=seqlens, state_dtype=STATE_DTYPES[i % 2]))
    cases.append(case(32, B=8, T=1, inplace_state=True, state_dtype="fp32"))
    cases.append(case(4, B=3, T=16, state_dtype="bf16", final_dtype="fp32"))
    return cases


def _option_pools(slice_: str, options: dict, H: int = 4) -> list[Case]:
    """Pooled states under the option: padding rows, in place, mixed dtypes, fixed, varlen and decode lengths
    (their plans are forced by _with_forced_plans)."""
    return [
        Case(slice_, H=H, B=3, T=97, state_dtype="bf16", pool=5, padding=1, **options),
        Case(slice_, H=H, seqlens=(17, 0, 65, 5), state_dtype="fp32", inplace_state=True, pool=6, padding=1,
             indices_int32=True, **options),
        Case(slice_, H=H, B=8, T=1, state_dtype="fp32", inplace_state=True, pool=11, padding=2, **options),
        Case(slice_, H=H, seqlens=(3, 0, 16, 1), state_dtype="bf16", final_dtype="fp32", pool=4, **options),
    ]


def _gate_softplus() -> list[Case]:
    softplus = dict(gate="softplus")
    cases = _options_base("gate_softplus", softplus)
    cases += [Case("gate_softplus", H=1, T=16384, **softplus), Case("gate_softplus", H=96, T=2048, **softplus)]
    # g + dt_bias across ±50 (A_log up to ln 16): decays from none to several hundred per token, short and long.
    for recipe in SOFTPLUS_RECIPES[:3]:
        for dt in STATE_DTYPES:
            cases.append(Case("gate_softplus", H=4, T=97, inputs=recipe, state_dtype=dt, **softplus))
        cases.append(Case("gate_softplus", H=4, seqlens=(17, 33, 65), inputs=recipe, **softplus))
        cases.append(Case("gate_softplus", H=32, T=1024, inputs=recipe, state_dtype="fp32", **softplus))
        cases.append(Case("gate_softplus", H=4, T=8, inputs=recipe, **softplus))
        cases.append(Case("gate_softplus", H=4, seqlens=(1, 2, 3, 5, 8, 15), inputs=recipe, state_dtype="fp32",
                          **softplus))
    # e^A_log past fp32's range meeting gate inputs of 0 (softplus: heads that erase the state and heads that never
    # decay).
    cases.append(Case("gate_softplus", H=4, T=97, inputs="A_log=±100", **softplus))
    # Scales far from K^-0.5 (fwd takes any finite one): the products' operands must neither overflow for a large
    # scale nor lose their rows for a tiny one.
    cases.append(Case("gate_softplus", H=4, T=97, log2_scale=100, **softplus))
    cases.append(Case("gate_softplus", H=4, seqlens=(17, 33, 65), log2_scale=-30, state_dtype="fp32", **softplus))
    # A log decay of -960 per token: exp underflows to 0, the state is erased at every token (test_matrix.py checks
    # that the result is finite and equals the result from a zero initial state).
    erased = dict(inputs="decay=-960", **softplus)
    for dt in STATE_DTYPES:
        cases.append(Case("gate_softplus", H=4, T=97, state_dtype=dt, **erased))
        cases.append(Case("gate_softplus", H=4, T=5, state_dtype=dt, **erased))
    cases.append(Case("gate_softplus", H=4, seqlens=(17, 0, 33, 65), state_dtype="fp32", **erased))
    cases.append(Case("gate_softplus", H=32, T=1024, **erased))
    cases.append(Case("gate_softplus", H=4, seqlens=(1, 16, 3), inplace_state=True, **erased))
    # A_log or dt_bias None, gate parameters in bf16 / fp16, mixed state dtypes, a lower_bound given (ignored).
    for params in (dict(has_A_log=False), dict(has_dt_bias=False), dict(has_A_log=False, has_dt_bias=False)):
        cases.append(Case("gate_softplus", H=4, T=97, **params, **softplus))
        cases.append(Case("gate_softplus", H=4, seqlens=(3, 0, 16, 1), state_dtype="fp32", **params, **softplus))
    for params in ("bf16", "fp16"):
        cases.append(Case("gate_softplus", H=4, T=97, param_dtype=params, **softplus))
        cases.append(Case("gate_softplus", H=4, T=5, param_dtype=params, state_dtype="fp32", **softplus))
    for init, final in (("bf16", "fp32"), ("fp32", "bf16")):
        cases.append(Case("gate_softplus", H=4, T=97, state_dtype=init, final_dtype=final, **softplus))
    cases.append(Case("gate_softplus", H=4, T=97, lower_bound=-1.0, **softplus))
    cases += _option_pools("gate_softplus", softplus)
    return _with_forced_plans(cases)


def _neg_eigval() -> list[Case]:
    cases = []
    for gate in GATES:  # every shape under the lower-bound gate, fewer under the softplus gate
        options = dict(gate=gate, neg_eigval=True)
        cases += _options_base("neg_eigval", options, few=gate == "softplus")
        # β ≈ 2 (reflections: eigenvalue -1), β of either extreme, near-collinear keys.
        for recipe in ("beta=+10", "beta=±10", "collinear_k"):
            for dt in STATE_DTYPES:
                cases.append(Case("neg_eigval", H=4, T=97, inputs=recipe, state_dtype=dt, **options))
            cases.append(Case("neg_eigval", H=4, seqlens=(17, 33, 65), inputs=recipe, **options))
            cases.append(Case("neg_eigval", H=4, T=1024, inputs=recipe, state_dtype="fp32", **options))
            cases.append(Case("neg_eigval", H=4, T=8, inputs=recipe, **options))
        cases += _option_pools("neg_eigval", options)
    # The softplus gate's extremes with reflections: no decay (the state keeps every reflection) and ±50.
    for recipe in ("g=-50", "g=U±50"):
        cases.append(Case("neg_eigval", H=4, T=1024, inputs=recipe, gate="softplus", neg_eigval=True))
        cases.append(Case("neg_eigval", H=4, seqlens=(1, 2, 3, 5, 8, 15), inputs=recipe, gate="softplus",
                          neg_eigval=True, state_dtype="fp32"))
    for params in (dict(has_A_log=False), dict(has_dt_bias=False)):
        cases.append(Case("neg_eigval", H=4, T=97, neg_eigval=True, **params))
    return _with_forced_plans(cases)


def _gva() -> list[Case]:
    cases = []
    for G in (2, 4):
        for gate in GATES:  # every shape under G = 2 with the lower-bound gate and G = 4 with softplus, fewer else
            options = dict(G=G, gate=gate)
            full = (G, gate) in ((2, "lower_bound"), (4, "softplus"))
            cases += _options_base("gva", options, configs=G == 2, few=not full)
            cases += _option_pools("gva", options, H=2 * G)
        # Every state configuration under the softplus gate with negative eigenvalues once per G.
        cases += [Case("gva", H=8, T=97, state_io=io, state_dtype=dt, G=G, gate="softplus", neg_eigval=True)
                  for io, dt in _state_configs()]
        cases.append(Case("gva", H=8, seqlens=(17, 0, 33, 65), G=G, gate="softplus", neg_eigval=True))
        cases.append(Case("gva", H=32, T=1024, G=G, gate="softplus", neg_eigval=True, inputs="g=U±50"))
        cases.append(Case("gva", H=8, T=5, G=G, neg_eigval=True, state_dtype="fp32"))
        cases.append(Case("gva", H=8, T=97, G=G, inputs="collinear_k"))
        cases.append(Case("gva", H=8, T=97, G=G, gate="softplus", has_A_log=False, has_dt_bias=False))
    # 16 key heads under 32 value heads (Kimi Linear's shape, G = 2), 48 under 96.
    cases.append(Case("gva", H=32, seqlens=(1300, 547, 2048, 963, 271, 3063), G=2, gate="softplus",
                      state_dtype="fp32"))
    cases.append(Case("gva", H=96, T=97, G=2, gate="softplus"))
    return _with_forced_plans(cases)


def _token_states() -> list[Case]:
    """TOKEN_STATE_SHAPES x TOKEN_STATE_L with the pools cycled (dtype, in place or two pools, extra slots, index
    dtype and device, padding rows, negative entries, num_accepted_tokens), and a few options, mixed dtypes and
    pools only written; each under the plans of ``_token_state_plans``."""
    pools = (("bf16", True), ("fp32", False), ("bf16", False), ("fp32", True))  # (pool dtype, in place)
    accepted = ("cuda", "cuda", "none", "cuda", "host", "cuda", "cuda")

    def case(H: int, L: int, *, extra: int = 2, padding: int = 0, **fields) -> Case:
        N = len(fields["seqlens"]) if "seqlens" in fields else fields["B"]
        return Case("token_states", H=H, state_tokens=L, pool=(N - padding) * L + extra, padding=padding, **fields)

    cases = []
    i = 0
    for shape, H in TOKEN_STATE_SHAPES:
        N = len(shape["seqlens"]) if "seqlens" in shape else shape["B"]
        for L in TOKEN_STATE_L:
            dt, inplace = pools[i % len(pools)]
            cases.append(case(H, L, **shape, extra=i % 4, padding=1 if N >= 3 and i % 5 == 2 else 0,
                              state_dtype=dt, inplace_state=inplace, negative_entries=i % 3 == 1,
                              accepted=accepted[i % len(accepted)], indices_int32=i % 2 == 1,
                              indices_on_host=i % 11 == 4))
            i += 1
    # The model options (the per-token pass runs each gate, β scale and key-head mapping of the decode kernel).
    cases += [
        case(4, 4, B=4, T=4, gate="softplus", inplace_state=True),
        case(4, 4, B=2, T=5, gate="softplus", inputs="g=U±50", state_dtype="fp32"),
        case(8, 4, seqlens=(1, 3, 0, 4, 2), G=2, gate="softplus", state_dtype="fp32", negative_entries=True),
        case(8, 8, B=3, T=37, G=4, inplace_state=True),
        case(4, 8, seqlens=(20, 3, 0, 40), neg_eigval=True, accepted="host"),
        case(8, 2, seqlens=(17, 1, 33, 0, 9), G=2, gate="softplus", neg_eigval=True, inplace_state=True),
    ]
    # Mixed pool dtypes, a pool only written (every sequence starts from zeros), all rows but one padded, int32
    # cu_seqlens.
    cases += [
        case(4, 4, B=3, T=8, state_dtype="bf16", final_dtype="fp32"),
        case(4, 2, seqlens=(17, 1, 33, 0, 9), state_dtype="fp32", final_dtype="bf16", negative_entries=True),
        case(4, 4, B=4, T=4, state_io="out_only"),
        case(4, 8, seqlens=(1, 3, 0, 4, 2), state_io="out_only", state_dtype="fp32", accepted="none"),
        case(4, 4, B=6, T=3, padding=5, inplace_state=True),
        case(4, 4, seqlens=(1, 2, 3, 5, 8, 15), cu_seqlens_int32=True, state_dtype="fp32", indices_int32=True),
    ]
    return _token_state_plans(cases)


def _decodes_by_default(c: Case) -> bool:
    """Whether the automatic plan runs ``c`` on the decode kernel (kda_plan.h, decode_pays: at most 16 tokens per
    sequence, on average for varlen)."""
    return c.T <= 16 * c.num_seqs if c.varlen else c.T <= 16


def _token_state_plans(base: list[Case]) -> list[Case]:
    """Each case under the automatic plan, a chunked plan (``decode=False``) and, in turn, a V split of 2; a time
    split of 2 chunks on sequences of more than 32 tokens; the decode kernel where the automatic plan is a chunked
    one (more than 16 tokens per sequence)."""
    cases: dict[str, Case] = {}
    for i, c in enumerate(base):
        kinds = [dict(), dict(decode=False)]
        if i % 2 == 0:
            kinds.append(dict(v_split=2))
        if c.longest > 32:
            kinds.append(dict(segment_chunks=2))
        if not _decodes_by_default(c):
            kinds.append(dict(decode=True))
        for kind in kinds:
            forced = dataclasses.replace(c, **kind)
            cases.setdefault(forced.id, forced)
    return list(cases.values())


def _checkpoints() -> list[Case]:
    """CHECKPOINT_SHAPES, each with two pool configurations in turn (dtype, in place or two pools, index dtypes,
    negative entries, padding rows), and a few options, mixed dtypes and pools only written; each under the plans of
    ``_checkpoint_plans``."""
    pools = (("bf16", False), ("fp32", True), ("fp32", False), ("bf16", True))  # (pool dtype, in place)

    def case(C: int, H: int, *, extra: int = 3, padding: int = 0, **fields) -> Case:
        N = len(fields["seqlens"]) if "seqlens" in fields else fields.get("B", 1)
        M = (max(fields["seqlens"], default=0) if "seqlens" in fields else fields["T"]) // C + 1
        return Case("checkpoints", H=H, checkpoint_every=C, pool=N - padding + N * M + extra, padding=padding,
                    **fields)

    cases = []
    for i, (C, shape, H) in enumerate(CHECKPOINT_SHAPES):
        N = len(shape["seqlens"]) if "seqlens" in shape else shape.get("B", 1)
        writes = sum(n // C for n in shape.get("seqlens", (shape.get("T", 0),) * N))
        for j in range(2):
            k = 2 * i + j
            dt, inplace = pools[k % len(pools)]
            cases.append(case(C, H, **shape, extra=k % 4, padding=1 if N >= 2 and k % 7 == 3 else 0,
                              state_dtype=dt, inplace_state=inplace, negative_entries=k % 3 == 1 and writes >= 2,
                              checkpoint_int32=k % 2 == 0, indices_int32=k % 4 == 1))
    # The model options: the softplus gate, GVA, negative eigenvalues.
    cases += [
        case(256, 8, seqlens=(2300, 40, 256, 0, 600), G=2, gate="softplus"),
        case(64, 4, B=3, T=200, gate="softplus", state_dtype="fp32", inplace_state=True, negative_entries=True),
        case(16, 8, seqlens=(1, 2, 3, 5, 8, 15, 16), G=4, gate="softplus", state_dtype="fp32"),
        case(1024, 8, B=2, T=3000, G=2, checkpoint_int32=True),
        case(512, 32, B=2, T=1100, G=2, gate="softplus", inplace_state=True),
        case(64, 4, seqlens=(130, 64, 5, 0, 70), neg_eigval=True, gate="softplus", state_dtype="fp32"),
    ]
    # Mixed pool dtypes, pools only written (every sequence starts from zeros), int32 cu_seqlens.
    cases += [
        case(256, 4, seqlens=(255, 256, 257, 0, 1000), state_dtype="bf16", final_dtype="fp32"),
        case(64, 4, B=3, T=200, state_dtype="fp32", final_dtype="bf16", checkpoint_int32=True),
        case(512, 4, seqlens=(2100, 300, 0, 700, 511), state_io="out_only", state_dtype="fp32"),
        case(16, 4, B=4, T=50, state_io="out_only", negative_entries=True),
        case(64, 4, seqlens=(63, 64, 65, 128), cu_seqlens_int32=True, padding=2, inplace_state=True),
    ]
    return _checkpoint_plans(cases)


def _checkpoint_plans(base: list[Case]) -> list[Case]:
    """Each case under the automatic plan and forced ones: a V split of 2; time splits of 16 chunks (256 tokens:
    aligned with C up to 256, a divisor of larger C) and of 24 (384 tokens: aligned with none of 256, 512, 1024)
    on sequences that span several segments; the single pass on cases of at most CHECKPOINT_SINGLE_PASS_TOKEN_HEADS
    token-heads under the lower-bound gate (the single pass runs no other); the overlap with a lead of 8 chunks on
    fixed lengths at H >= 32; the decode kernel on sequences of at most 256 tokens (where the automatic plan does not
    run it already)."""
    cases: dict[str, Case] = {}
    for c in base:
        kinds = [dict(), dict(v_split=2)]
        if c.longest > 256:
            kinds.append(dict(segment_chunks=16))
        if c.longest > 384:
            kinds.append(dict(segment_chunks=24))
        if c.gate == "lower_bound" and c.tokens * c.H <= CHECKPOINT_SINGLE_PASS_TOKEN_HEADS:
            kinds.append(dict(single_pass=True))
        if not c.varlen and c.H >= 32:
            kinds.append(dict(lead_chunks=8))
        if c.longest <= 256 and not _decodes_by_default(c):
            kinds.append(dict(decode=True))
        for kind in kinds:
            forced = dataclasses.replace(c, **kind)
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
    cases += _gate_softplus() + _neg_eigval() + _gva()
    cases += _token_states() + _checkpoints()
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
    lower_bound, initial_state, final_state, cu_seqlens, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
    checkpoint_indices, checkpoint_every (``fwd_args`` and ``twin_args`` pick the keywords of fwd and of the twin and
    references, ``serving_args`` those of per-token states and checkpoints). Distributions follow fla's KDA tests:
    bf16 randn q/k [B, T, H // G, K], v/g [B, T, H, ·], beta [B, T, H] (as logits), fp32 randn A_log [H] (mapped
    onto SOFTPLUS_A_LOG_RANGE for the softplus gate) and dt_bias [H, K] (cast to the case's param dtype), an fp32
    randn initial state cast to the state dtype. ``out`` and ``final_state`` are NaN-filled so unwritten elements
    fail loudly.
    """
    import torch  # noqa: PLC0415 -- the data above is importable without torch

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(case.seed)
    B, T, H, D = case.B, case.T, case.H, 128
    bf16 = torch.bfloat16

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    Hk = case.key_heads  # q and k (H with G = 1); the draws of a case without GVA are those of one with it
    q, k = (randn(B, T, Hk, D, dtype=bf16) for _ in range(2))
    v, g = (randn(B, T, H, D, dtype=bf16) for _ in range(2))
    beta = randn(B, T, H, dtype=bf16)
    param_dtype = getattr(torch, DTYPES[case.param_dtype])
    A_log = randn(H)
    if case.gate == "softplus":  # N(0, 1) onto SOFTPLUS_A_LOG_RANGE (fla's layer draws exp(A_log) in [1, 16])
        lo, hi = SOFTPLUS_A_LOG_RANGE
        A_log = lo + (hi - lo) * torch.sigmoid(1.6 * A_log)
    A_log = A_log.to(param_dtype)
    dt_bias = randn(H, D, dtype=param_dtype)
    recipe = case.inputs
    if recipe == "g=U±50":  # N(0, 1) onto a uniform in ±46 (erf(x/√2) is uniform in (-1, 1))
        g = (46 * torch.erf(g.float() * 0.5**0.5)).to(bf16)
    elif recipe == "decay=-960":
        A_log.fill_(math.log(16.0))
        dt_bias.zero_()
        g.fill_(60.0)
    elif recipe.startswith("g="):
        g.fill_(float(recipe[2:]))
    elif recipe.startswith("dt_bias="):
        dt_bias.fill_(float(recipe[8:]))
    elif recipe == "A_log=±100":
        A_log = torch.tensor([100.0 if h % 2 == 0 else -100.0 for h in range(H)], device=device).to(param_dtype)
        dt_bias.zero_()
        g[..., ::2] = 0.0
    elif recipe == "collinear_k":
        # One direction per head plus noise below bf16's resolution: many keys round to the same vector.
        k = (randn(1, 1, Hk, D) + 1e-3 * randn(B, T, Hk, D)).to(bf16)
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
    state_indices = num_accepted_tokens = checkpoint_indices = None
    if case.pool:
        # A random permutation's first slots for the sequences (L each with per-token states), negative indices (of
        # several values) for `padding` of them at random positions, the next N·M slots for the checkpoints; drawn
        # on the CPU, so the same on every device. Every entry names a slot of its own: where two name one, the
        # state left there is unspecified.
        host = torch.Generator().manual_seed(case.seed)
        width = case.state_tokens or 1  # slots per sequence
        perm = torch.randperm(case.pool, generator=host)
        padded = torch.zeros(N, dtype=torch.bool)
        padded[torch.randperm(N, generator=host)[: case.padding]] = True
        indices = torch.zeros(N, width, dtype=torch.int64)
        indices[padded] = (-1 - torch.arange(case.padding * width) % 3).view(-1, width)
        indices[~padded] = perm[: (N - case.padding) * width].view(-1, width)
        index_dtype = torch.int32 if case.indices_int32 else torch.int64
        lengths = torch.tensor(case.seqlens if case.varlen else (case.T,) * B).view(N, 1)
        if case.state_tokens:
            if case.negative_entries:  # those tokens' states are not written
                _negate_some(indices, (torch.arange(width).view(1, width) < lengths) & ~padded.view(N, 1), host)
            accepted = torch.randint(1, width + 1, (N,), generator=host).to(index_dtype)
            num_accepted_tokens = {"cuda": accepted.to(device), "host": accepted, "none": None}[case.accepted]
        else:
            indices = indices.view(N)
        state_indices = indices.to(index_dtype)
        if not case.indices_on_host:
            state_indices = state_indices.to(device)
        if case.checkpoint_every:
            M, named = case.checkpoint_cols, N - case.padding
            checkpoints = perm[named : named + N * M].clone().view(N, M)
            if case.negative_entries:
                _negate_some(checkpoints, torch.arange(1, M + 1).view(1, M) * case.checkpoint_every <= lengths, host)
            checkpoint_indices = checkpoints.to(torch.int32 if case.checkpoint_int32 else torch.int64).to(device)
    cu_seqlens = None
    if case.varlen:
        cu = [0]
        for n in case.seqlens:
            cu.append(cu[-1] + n)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32 if case.cu_seqlens_int32 else torch.int64, device=device)
    # The softplus gate ignores lower_bound: None, unless a case gives one (a number is accepted and ignored).
    lower_bound = None if case.gate == "softplus" and case.lower_bound == -5.0 else case.lower_bound
    return dict(
        q=q, k=k, v=v, g=g, beta=beta, scale=D**-0.5 if case.log2_scale is None else 2.0**case.log2_scale,
        out=torch.full_like(v, float("nan")),
        A_log=A_log if case.has_A_log else None, dt_bias=dt_bias if case.has_dt_bias else None,
        lower_bound=lower_bound, initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
        state_indices=state_indices, gate=case.gate, allow_neg_eigval=case.neg_eigval,
        num_accepted_tokens=num_accepted_tokens, checkpoint_indices=checkpoint_indices,
        checkpoint_every=case.checkpoint_every,
    )  # fmt: skip


def _negate_some(entries, written, host) -> None:
    """Sets a fifth of the ``entries`` [N, ·] that a call would write (``written``), at random, to -1 (at least one
    where two or more would be written, so that some remain)."""
    import torch  # noqa: PLC0415

    positions = torch.nonzero(written.flatten()).flatten()
    count = max(1, positions.numel() // 5) if positions.numel() >= 2 else 0
    entries.view(-1)[positions[torch.randperm(positions.numel(), generator=host)[:count]]] = -1


INPUT_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "state_indices",
               "num_accepted_tokens", "checkpoint_indices")
FWD_NAMES = ("q", "k", "v", "g", "beta", "scale", "out", "A_log", "dt_bias", "lower_bound", "initial_state",
             "final_state", "cu_seqlens", "state_indices")  # flash_kda.fwd's arguments (state_indices by keyword;
# gate and allow_neg_eigval, keyword-only, are added by fwd_args where a case sets them)


def fwd_args(inputs: dict) -> dict:
    """The keyword arguments of ``flash_kda.fwd`` for ``inputs``: FWD_NAMES, and ``gate`` / ``allow_neg_eigval``
    where they are not the defaults."""
    args = {name: inputs.get(name) for name in FWD_NAMES}
    if inputs.get("gate", "lower_bound") != "lower_bound":
        args["gate"] = inputs["gate"]
    if inputs.get("allow_neg_eigval", False):
        args["allow_neg_eigval"] = True
    return args


def serving_args(inputs: dict) -> dict:
    """The keyword arguments of per-token states (``num_accepted_tokens``) and checkpoints (``checkpoint_indices``,
    ``checkpoint_every``) for ``inputs`` that have them, which ``flash_kda.fwd``, the twin and the references take
    alike (not in fwd_args and twin_args, whose callers may pass their own)."""
    args = {}
    if inputs.get("state_indices") is not None and inputs["state_indices"].dim() == 2:
        args["num_accepted_tokens"] = inputs.get("num_accepted_tokens")
    if inputs.get("checkpoint_indices") is not None:
        args["checkpoint_indices"] = inputs["checkpoint_indices"]
        args["checkpoint_every"] = inputs["checkpoint_every"]
    return args


def plan_args(inputs: dict) -> dict:
    """The keyword arguments of ``flash_kda.plan`` beside (v, cu_seqlens) for ``inputs``: ``gate`` where it is not
    the default (the plan depends on it: the single pass runs the lower-bound gate only)."""
    gate = inputs.get("gate", "lower_bound")
    return {} if gate == "lower_bound" else {"gate": gate}


def stream_pass_route(case: Case, sm_count: int) -> bool:
    """Whether a decode plan runs ``case`` on the stream pass at ``sm_count`` SMs (planning.stream_pass_runs, from
    the case's shape; (sequence, value head) items)."""
    from flash_kda import planning  # noqa: PLC0415

    fp32_final = case.has_final and (case.final_dtype or case.state_dtype) == "fp32"
    return planning.stream_pass_runs(case.varlen, case.T, fp32_final=fp32_final, items=case.num_seqs * case.H,
                                     sm_count=sm_count)


def twin_args(inputs: dict) -> dict:
    """The keyword arguments of numerics.twin_forward / cpu_forward / reference_* for ``inputs`` (with a pool:
    ``final_state`` is the pool as ``inputs`` hold it, the base of the pool the references return; ``gate_kind``
    and ``beta_scale`` where they are not the defaults)."""
    keys = ("q", "k", "v", "g", "beta", "scale", "A_log", "dt_bias", "lower_bound", "initial_state", "cu_seqlens")
    args = {name: inputs[name] for name in keys}
    if inputs.get("state_indices") is not None:
        args["state_indices"] = inputs["state_indices"]
        args["final_state"] = inputs["final_state"]
    if inputs.get("gate", "lower_bound") != "lower_bound":
        args["gate_kind"] = inputs["gate"]
    if inputs.get("allow_neg_eigval", False):
        args["beta_scale"] = 2.0
    return args


def same_bits(a, b) -> bool:
    """Whether two tensors hold the same values bit for bit, NaNs (the poison of untouched pool slots) included."""
    import torch  # noqa: PLC0415

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype])) if a.dtype in ints else torch.equal(a, b)


def capture(call, setup=None):
    """A CUDA graph of `call()`: on a side stream, `setup()` (what must run on that stream, such as reserving its
    workspace), a warm-up call, then the capture; the current stream then waits for the side stream."""
    import torch  # noqa: PLC0415

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if setup is not None:
            setup()
        call()  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            call()
    torch.cuda.current_stream().wait_stream(side)
    return graph


def assert_reports(call, *names: str) -> None:
    """Runs ``call()`` (a CUDA call with a malformed index or boundary) with nothing pending before it, and
    requires flash_kda.last_error() to name each of ``names``, then nothing (the query resets the word)."""
    import flash_kda  # noqa: PLC0415
    import torch  # noqa: PLC0415

    assert flash_kda.last_error() is None  # nothing pending from earlier tests
    call()
    torch.cuda.synchronize()  # a device fault would surface here
    message = flash_kda.last_error()
    assert message is not None and all(name in message for name in names), message
    assert flash_kda.last_error() is None  # the query resets the word
