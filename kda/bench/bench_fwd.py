"""Benchmark instrument: flash_kda.fwd against its peers, same process, same inputs, same GPU, plus accuracy.

    tools/bazel run //kda/bench:bench_fwd -- --json=/tmp/b.json --markdown=/tmp/b.md --png=/tmp/b.png

(on an air-gapped GPU machine: `tools/offline/bazel-offline run //kda/bench:bench_fwd -- ...`; the peers are built
into /tmp/peers-site as docs/PERFORMANCE.md "Reproducing it" describes). A program that prints tables, not a test.

Our decode rows take their states from a pool of 2N slots at random `state_indices`, updated in place (a serving
engine's call). Per case, right after our call and on the same tensors, it times the peers:
- fla ``chunk_kda`` (Triton), with ``FLA_FLASH_KDA=0`` so that fla never dispatches to a ``flash_kda`` package;
  on the decode rows (names starting "decode", sequences of at most 16 tokens, which our plan runs on the decode
  kernel) fla's column is its recurrent kernel instead, ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd``
  (fla 0.6.0), called as fla's KDA layer calls it for decode: ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``
  (A_log [H], dt_bias flat [H*K], ``lower_bound``), ``use_beta_sigmoid_in_kernel``, ``state_v_first=True``, our
  ``out`` buffer, and an fp32 state updated in place (``inplace_final_state=True``): on one-token rows a pool
  ``[N, H, V, K]`` with ``ssm_state_indices = arange(N)`` (int32, 1-D: the engine's continuous batching); on
  multi-token rows the dense state without indices (fla's 1-D indices address one slot per token there, so
  they mean something else), still read and written in place;
- MoonshotAI FlashKDA, whose package is also named ``flash_kda``: it is loaded from ``--moonshot_path`` under the
  module name ``moonshot_flash_kda``, with that path appended to ``sys.path`` (never ahead of ours).
Each peer is optional: when it cannot be imported or raises, its column stays empty and a one-line note says why.

Printed (and written to --markdown): a speed table (median ms of CUDA-event timings, tokens/s, achieved GB/s and
% of the memory floor against the device-copy ceiling measured in the same run, our speed-up over each peer),
a table of the decode rows replayed from CUDA graphs (--graphs: each implementation's call captured once; the GPU
time an engine that runs decode from graphs sees) and an accuracy table (relative L2 error of out and final state
against the float64 reference). --json holds every
number and the run's metadata; --png is a bar chart of the three implementations per case.

Cheap re-runs: --peers= (none) or --peers=fla, --cases / --case_names to pick rows (--state to run them in
one state mode), and --peer_json=EARLIER.json to fill the peer columns of rows not measured now from an earlier
run (marked "(earlier run)").
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Optional

import torch
from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("cases", "all", "'all' or comma-separated indices into CASES")
flags.DEFINE_list("case_names", [], "keep only cases whose name contains one of these substrings (comma list)")
flags.DEFINE_integer("iters", 30, "timed calls per case (max(5, iters // 6) above 16M token-heads)")
flags.DEFINE_bool("graphs", True, "also time the decode rows replayed from a CUDA graph (as serving engines run decode)")
flags.DEFINE_integer("warmup", 3, "untimed calls before timing (fla autotunes on its first call)")
flags.DEFINE_bool("accuracy", True, "also measure errors against the float64 reference")
flags.DEFINE_integer("accuracy_max_token_heads", 1_600_000, "skip the float64 reference above this size")
flags.DEFINE_list("peers", ["fla", "moonshot"], "peers to measure (comma list of fla, moonshot; empty: none)")
flags.DEFINE_string("moonshot_path", "/tmp/peers-site",
                    "site folder holding MoonshotAI's flash_kda/ and flash_kda_C (and fla); appended to sys.path")
flags.DEFINE_string("peer_json", None, "an earlier run's --json: fills peer columns of rows not measured now")
flags.DEFINE_integer("copy_mib", 2048, "size of the device-to-device copy that measures the copy ceiling")
flags.DEFINE_string("json", None, "write every number and the run's metadata here")
flags.DEFINE_string("markdown", None, "write the tables here, under a header line (date, GPU, command)")
flags.DEFINE_string("png", None, "write a bar chart of the three implementations here (needs matplotlib)")
flags.DEFINE_integer("force_v_split", 0, "run our calls with this V split (flash_kda.testing.force_plan); 0: auto")
flags.DEFINE_float("lower_bound", -5.0, "the gate lower bound of every case (docs/SPEC.md §1: [-5, 0]; -0.01 decays slowly)")
flags.DEFINE_enum("state", None, ["bf16", "fp32", "none"],
                  "run every selected case in this state mode (default: each case's own); the case name says so")
flags.DEFINE_integer("force_segment_chunks", -1,
                     "run our calls with this time split (chunks per segment; 0: none); -1: the automatic plan")
flags.DEFINE_enum("force_single_pass", "auto", ["auto", "on", "off"],
                  "run our calls under the single pass (on), the two stages (off) or the automatic plan")
flags.DEFINE_integer("force_lead_chunks", -2,
                     "run our calls under the overlap with this lead (chunks; fixed-length cases), -1: without it, "
                     "-2: the automatic plan")
flags.DEFINE_enum("force_decode", "auto", ["auto", "on", "off"],
                  "run our calls on the decode kernel (on), on a chunked plan (off) or under the automatic plan")

BYTES_PER_TOKEN_HEAD = 1282  # q, k, v, g, out in bf16 (5 x 256 B) + beta (2 B): docs/SPEC.md §5
HEAD_DIM = 128
LONG_TOKEN_HEADS = 16_000_000  # above this, fewer timed calls (each call takes long enough to be stable)
IMPLS = ("flash_kda", "fla", "moonshot")
PEERS = IMPLS[1:]
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "none": None}
STATE_SUFFIX = {"bf16": "", "fp32": " fp32 state", "none": " no state"}  # how case names label the mode
STATE_NOTE = ("state bf16: bf16 initial + final state for flash_kda and moonshot, fp32 for fla (its measured "
              "configuration); fp32: fp32 for all three; none: no initial and no final state.")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seqlen: int  # per row; for varlen the total
    heads: int
    seqlens: Optional[tuple] = None  # varlen: B must be 1
    state: str = "bf16"  # "bf16", "fp32" or "none": one state mode for all three implementations of the row
    inplace: bool = False  # decode rows: our states in a pool, updated in place (a serving engine's call)
    fla_recurrent: bool = False  # fla's column times fused_recurrent_kda_fwd (decode rows) instead of chunk_kda
    gate: str = "lower_bound"  # or "softplus" (Kimi Linear's gate; A_log drawn as log U(1, 16), fla's layer init)
    neg_eigval: bool = False  # β = 2·sigmoid (allow_neg_eigval)
    key_heads: Optional[int] = None  # grouped value heads: q and k on this many heads (None: `heads`)
    spec_tokens: int = 0  # L > 0: per-token states (speculative verification), state_indices [N, L] in place
    checkpoint_every: int = 0  # C > 0: a checkpoint of every sequence after every C tokens, into a pool

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def token_heads(self) -> int:
        return self.tokens * self.heads

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens) if self.seqlens is not None else self.batch

    @property
    def checkpoints(self) -> int:
        """Checkpoints the call writes per head (every C tokens of each sequence)."""
        if not self.checkpoint_every:
            return 0
        lengths = self.seqlens if self.seqlens is not None else (self.seqlen,) * self.batch
        return sum(n // self.checkpoint_every for n in lengths)

    @property
    def floor_bytes(self) -> int:
        """Bytes the forward must move at least: the token tensors plus each state buffer read or written (per-token
        states: one read and L writes per sequence-head; checkpoints: one more write each)."""
        per_state = self.num_seqs * self.heads * HEAD_DIM * HEAD_DIM
        states = 1 + self.spec_tokens if self.spec_tokens else 2
        states_bytes = (states * per_state + self.checkpoints * self.heads * HEAD_DIM * HEAD_DIM)
        state_bytes = 0 if self.state == "none" else states_bytes * STATE_DTYPES[self.state].itemsize
        key_bytes = 0 if self.key_heads is None else 2 * 2 * HEAD_DIM * self.tokens * (self.heads - self.key_heads)
        return self.token_heads * BYTES_PER_TOKEN_HEAD - key_bytes + state_bytes  # (GVA: q and k on fewer heads)


def _varlen(name: str, lens: list[int], heads: int, **kwargs) -> Case:
    return Case(name, 1, sum(lens), heads, tuple(lens), **kwargs)


def _decode(name: str, *args, **kwargs) -> Case:
    """A decode row: sequences of at most 16 tokens, our state in place, fla's recurrent kernel as its peer."""
    make = _varlen if "varlen" in name else Case
    return make(name, *args, inplace=True, fla_recurrent=True, **kwargs)


CASES = [
    Case("T8192 H96", 1, 8192, 96),
    Case("T8192 H64", 1, 8192, 64),
    Case("T8192 H32", 1, 8192, 32),
    Case("B8 T1024 H32", 8, 1024, 32),
    _varlen("varlen [1300,547,2048,963,271,3063] H96", [1300, 547, 2048, 963, 271, 3063], 96),
    _varlen("varlen 1024x8 H96", [1024] * 8, 96),
    Case("T32768 H8", 1, 32768, 8),
    Case("T131072 H1", 1, 131072, 1),
    Case("T8192 H16", 1, 8192, 16),
    Case("B32 T512 H32", 32, 512, 32),
    _varlen("varlen 64x128 H32", [128] * 64, 32),
    Case("T1048576 H1", 1, 1048576, 1),
    Case("T8192 H96 fp32 state", 1, 8192, 96, state="fp32"),
    Case("T8192 H96 no state", 1, 8192, 96, state="none"),
    _varlen("varlen [131072, 64x128] H4", [131072] + [128] * 64, 4),  # one long + many short (issue 7)
    # Decode (issue 26): the floor is the state read and written plus the token bytes.
    _decode("decode B128 T1 H32", 128, 1, 32),
    _decode("decode B512 T1 H8", 512, 1, 8),
    _decode("decode varlen 128x4 H32", [4] * 128, 32),
    _decode("decode B64 T16 H32", 64, 16, 32),
    _decode("decode B128 T1 H32 fp32 state", 128, 1, 32, state="fp32"),
    # The model options (issue 27): Kimi Linear's softplus gate, negative eigenvalues, grouped value heads.
    Case("T8192 H32 softplus", 1, 8192, 32, gate="softplus"),
    Case("T8192 H96 softplus", 1, 8192, 96, gate="softplus"),
    Case("T131072 H1 softplus", 1, 131072, 1, gate="softplus"),
    Case("T8192 H32 neg eigval", 1, 8192, 32, neg_eigval=True),
    Case("T8192 GVA 16->32", 1, 8192, 32, key_heads=16),
    Case("T8192 GVA 16->32 softplus", 1, 8192, 32, key_heads=16, gate="softplus"),
    # Serving II (issue 28): speculative verification (the state after each of 4 tokens, accepted starts) and
    # prefix-cache checkpoints every 1024 tokens (against rows 2 and 7 without them).
    _decode("spec varlen 128x4 H32 per-token states", [4] * 128, 32, spec_tokens=4),
    _decode("spec varlen 128x4 H32 per-token states fp32", [4] * 128, 32, spec_tokens=4, state="fp32"),
    Case("T8192 H32 checkpoints every 1024", 1, 8192, 32, checkpoint_every=1024),
    Case("T131072 H1 checkpoints every 1024", 1, 131072, 1, checkpoint_every=1024),
]


def select_cases() -> list[Case]:
    """CASES picked by --cases (indices or 'all'), then filtered by --case_names substrings."""
    if FLAGS.cases == "all":
        cases = list(CASES)
    else:
        try:
            cases = [CASES[int(i)] for i in FLAGS.cases.split(",")]
        except (ValueError, IndexError) as exc:
            raise app.UsageError(f"--cases must be 'all' or indices in 0..{len(CASES) - 1}, got {FLAGS.cases!r}") from exc
    if FLAGS.case_names:
        cases = [c for c in cases if any(s in c.name for s in FLAGS.case_names)]
    if not cases:
        raise app.UsageError(f"no case left after --cases={FLAGS.cases} --case_names={','.join(FLAGS.case_names)}")
    if FLAGS.state is not None:
        cases = [dataclasses.replace(c, name=_base_name(c) + STATE_SUFFIX[FLAGS.state], state=FLAGS.state)
                 for c in cases]
    return cases


def _base_name(case: Case) -> str:
    """The case's name without its state label."""
    return case.name.removesuffix(STATE_SUFFIX[case.state])


def iters_for(case: Case) -> int:
    return FLAGS.iters if case.token_heads <= LONG_TOKEN_HEADS else max(5, FLAGS.iters // 6)


def make_inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    B, T, H = case.batch, case.seqlen, case.heads

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    q, k, v, g = (randn(B, T, H, HEAD_DIM) for _ in range(4))
    if case.key_heads is not None:  # (drawn after the others: every row's q, k, v, g and β stay as they were)
        q, k = (randn(B, T, case.key_heads, HEAD_DIM) for _ in range(2))
    beta = randn(B, T, H)
    A_log = torch.rand(H, generator=gen, device=device) * 0.5
    if case.gate == "softplus":
        A_log = torch.log(1 + 15 * torch.rand(H, generator=gen, device=device))
    dt_bias = torch.randn(H, HEAD_DIM, generator=gen, device=device) * 0.1
    cu = None
    if case.seqlens is not None:
        lens = torch.tensor((0,) + case.seqlens, dtype=torch.int64)
        cu = torch.cumsum(lens, 0).to(device)  # int64: MoonshotAI FlashKDA accepts no other dtype
    init = None
    if case.state != "none":
        # fp32 holding bf16-representable values: every implementation and the reference then start from the
        # same state whatever dtype they take it in, so the errors measure the forward, not the state's rounding.
        init = (torch.randn(case.num_seqs, H, HEAD_DIM, HEAD_DIM, generator=gen, device=device) * 0.1)
        init = init.to(torch.bfloat16).float()
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, init=init,
                n=case.num_seqs, gate=case.gate, neg_eigval=case.neg_eigval, spec_tokens=case.spec_tokens,
                checkpoint_every=case.checkpoint_every)


def spec_slots(n: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rows' state_indices [N, L] (distinct random slots of a pool of N·L) and num_accepted_tokens [N]
    (random in [1, L]), int32, the same for every implementation."""
    gen = torch.Generator(device="cpu").manual_seed(n * tokens)
    indices = torch.randperm(n * tokens, generator=gen).view(n, tokens).to(device=device, dtype=torch.int32)
    accepted = torch.randint(1, tokens + 1, (n,), generator=gen).to(device=device, dtype=torch.int32)
    return indices, accepted


def forced_plan():
    """flash_kda.testing.force_plan from the --force_* flags (a context manager)."""
    from flash_kda import testing

    single = {"auto": None, "on": True, "off": False}[FLAGS.force_single_pass]
    decode = {"auto": None, "on": True, "off": False}[FLAGS.force_decode]
    return testing.force_plan(v_split=FLAGS.force_v_split, single_pass=single,
                              segment_chunks=None if FLAGS.force_segment_chunks < 0 else FLAGS.force_segment_chunks,
                              lead_chunks=None if FLAGS.force_lead_chunks < -1 else FLAGS.force_lead_chunks,
                              decode=decode)


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 3, batch: int = 1) -> float:
    """Median of `iters` CUDA-event timings of fn, after `warmup` untimed calls. With `batch` > 1 each timing
    covers that many calls issued back to back and is divided by it: the GPU time per call, the host's hidden
    wherever the GPU's is longer (the span of calls whose kernels overlap, e.g. plan_sweep's)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def graph_time_ms(fn: Callable[[], object], iters: int) -> float:
    """time_ms of one replay of a CUDA graph holding one call of fn (captured after fn's warm-up calls): the GPU
    time of the call without the host's, as an engine that runs decode from graphs sees it."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return time_ms(graph.replay, iters)


def measure_copy_ceiling(nbytes: int, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write): the roof for a memory-bound forward."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


# --- the three implementations: each returns (call, outputs); outputs() gives (out, final state or None) of the
# last call. Buffers and argument conversions are made once, outside the timed call.
Run = tuple[Callable[[], None], Callable[[], tuple]]


def run_flash_kda(inp, state: str, scale: float, lower_bound: float, inplace: bool = False) -> Run:
    """Our fwd; ``inplace``: a serving engine's call, the states in a pool of 2N slots updated in place, sequence n
    in a random slot ``state_indices[n]`` (then every timed call starts from the previous call's state, and the
    outputs are those of one more call from the original state)."""
    import flash_kda

    out = torch.empty_like(inp["v"])
    dtype = STATE_DTYPES[state]
    original = None if dtype is None or inp["init"] is None else inp["init"].to(dtype)
    init, final, indices = original, None if original is None else torch.empty_like(original), None
    extra = {}
    if inp["spec_tokens"] and original is not None:
        # per-token states in place: sequence n starts from slot indices[n, a_n - 1], where outputs() puts its state
        n, tokens = original.shape[0], inp["spec_tokens"]
        token_slots, accepted = spec_slots(n, tokens, original.device)
        starts = token_slots.long().gather(1, accepted.long().view(n, 1) - 1).view(n)
        init = final = torch.zeros((n * tokens, *original.shape[1:]), dtype=dtype, device=original.device)
        init[starts] = original
        extra = dict(state_indices=token_slots, num_accepted_tokens=accepted)

        def spec_call():
            flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, out, inp["A_log"],
                          inp["dt_bias"], None if inp["gate"] == "softplus" else lower_bound, initial_state=init,
                          final_state=final, cu_seqlens=inp["cu_seqlens"], gate=inp["gate"],
                          allow_neg_eigval=inp["neg_eigval"], **extra)

        def spec_outputs():  # out only: the per-token states are not a final state
            init[starts] = original
            spec_call()
            return out, None

        return spec_call, spec_outputs
    if inp["checkpoint_every"] and original is not None:
        # checkpoints: a pool of N final slots then N·M checkpoint slots, sequence n's final state in slot n
        n = original.shape[0]
        lengths = (inp["cu_seqlens"].diff().tolist() if inp["cu_seqlens"] is not None
                   else [inp["q"].shape[1]] * n)
        m = max(max(lengths) // inp["checkpoint_every"], 1)
        pool = torch.zeros((n + n * m, *original.shape[1:]), dtype=dtype, device=original.device)
        pool[:n] = original
        indices = torch.arange(n, dtype=torch.int32, device=original.device)
        extra = dict(checkpoint_indices=torch.arange(n, n + n * m, dtype=torch.int32, device=original.device)
                     .view(n, m), checkpoint_every=inp["checkpoint_every"])
        init, final = pool, torch.empty_like(pool)
    elif inplace and original is not None:
        n = original.shape[0]
        gen = torch.Generator(device="cpu").manual_seed(n)
        indices = torch.randperm(2 * n, generator=gen)[:n].to(device=original.device, dtype=torch.int32)
        init = final = torch.zeros((2 * n, *original.shape[1:]), dtype=dtype, device=original.device)

    def call():
        flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, out, inp["A_log"], inp["dt_bias"],
                      None if inp["gate"] == "softplus" else lower_bound, initial_state=init, final_state=final,
                      cu_seqlens=inp["cu_seqlens"], state_indices=indices, gate=inp["gate"],
                      allow_neg_eigval=inp["neg_eigval"], **extra)

    def outputs():
        if indices is None:
            return out, final
        init[indices.long()] = original
        call()
        return out, final[indices.long()]

    return call, outputs


def run_fla(chunk_kda, inp, scale: float, lower_bound: float) -> Run:
    """fla's measured configuration: fp32 initial state (None without state), dt_bias flat [H*K]; the softplus gate
    as fla's layer passes it (safe_gate False, no lower bound)."""
    init = inp["init"]
    dt_bias = inp["dt_bias"].reshape(-1)
    lower_bound_gate = inp["gate"] == "lower_bound"
    result = {}

    def call():
        o, s = chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=scale,
                         initial_state=init, output_final_state=init is not None, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=lower_bound_gate,
                         lower_bound=lower_bound if lower_bound_gate else None, state_v_first=True,
                         cu_seqlens=inp["cu_seqlens"], A_log=inp["A_log"], dt_bias=dt_bias,
                         allow_neg_eigval=inp["neg_eigval"])
        result["out"], result["final"] = o, s

    return call, lambda: (result["out"], result["final"])


def run_fla_recurrent(fused_recurrent_kda_fwd, inp, scale: float, lower_bound: float) -> Run:
    """fla's recurrent kernel as its KDA layer runs decode, fp32 state in place (module docstring): a pool with
    ssm_state_indices on one-token rows, the dense state on multi-token rows."""
    original = inp["init"]  # fp32 [N, H, V, K]
    state = original.clone()
    one_token = inp["cu_seqlens"] is None and inp["q"].shape[1] == 1
    indices = torch.arange(inp["n"], dtype=torch.int32, device=state.device) if one_token else None
    accepted, starts = None, None
    if inp["spec_tokens"]:  # per-token states: the same slots as ours, a pool of N·L fp32 states
        n, tokens = original.shape[0], inp["spec_tokens"]
        indices, accepted = spec_slots(n, tokens, original.device)
        starts = indices.long().gather(1, accepted.long().view(n, 1) - 1).view(n)
        state = torch.zeros((n * tokens, *original.shape[1:]), dtype=original.dtype, device=original.device)
        state[starts] = original
    dt_bias = inp["dt_bias"].reshape(-1)
    out = torch.empty_like(inp["v"])

    def call():
        fused_recurrent_kda_fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                                dt_bias=dt_bias, initial_state=state, scale=scale, output_final_state=True,
                                inplace_final_state=True, state_v_first=True, cu_seqlens=inp["cu_seqlens"],
                                ssm_state_indices=indices, num_accepted_tokens=accepted,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, out=out)

    def outputs():
        if starts is not None:
            state[starts] = original
            call()
            return out, None
        state.copy_(original)
        call()
        return out, state

    return call, outputs


def run_moonshot(module, inp, state: str, scale: float, lower_bound: float) -> Run:
    """MoonshotAI's fwd: dt_bias must be 2-D [H, K], A_log fp32, cu_seqlens int64, both states of one dtype.

    Its Python wrapper allocates its workspace and transposes beta on every call: that is part of its cost."""
    out = torch.empty_like(inp["v"])
    dtype = STATE_DTYPES[state]
    init = None if dtype is None or inp["init"] is None else inp["init"].to(dtype)
    final = None if init is None else torch.empty_like(init)
    cu = None if inp["cu_seqlens"] is None else inp["cu_seqlens"].to(torch.int64)

    def call():
        module.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, out, inp["A_log"], inp["dt_bias"],
                   lower_bound, initial_state=init, final_state=final, cu_seqlens=cu)

    return call, lambda: (out, final)


# --- peers: loading and versions
@dataclasses.dataclass(frozen=True)
class FlaHandle:
    chunk: Callable  # fla.ops.kda.chunk_kda
    recurrent: Optional[Callable]  # fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd, where it exists


def load_fla():
    os.environ["FLA_FLASH_KDA"] = "0"  # fla's FlashKDA backend would otherwise take over chunk_kda
    import fla
    from fla.ops.kda import chunk_kda

    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        fused_recurrent_kda_fwd = None
    return FlaHandle(chunk_kda, fused_recurrent_kda_fwd), getattr(fla, "__version__", None)


def load_moonshot(path: str):
    """MoonshotAI's `flash_kda` package under the name `moonshot_flash_kda` (ours keeps the name flash_kda)."""
    package = os.path.join(path, "flash_kda")
    init_py = os.path.join(package, "__init__.py")
    if not os.path.isfile(init_py):
        raise ImportError(f"{init_py} not found (install MoonshotAI FlashKDA there as docs/PERFORMANCE.md says, or pass --moonshot_path)")
    spec = importlib.util.spec_from_file_location("moonshot_flash_kda", init_py,
                                                  submodule_search_locations=[package])
    module = importlib.util.module_from_spec(spec)
    sys.modules["moonshot_flash_kda"] = module
    try:
        spec.loader.exec_module(module)  # imports flash_kda_C from the appended path
    except BaseException:
        del sys.modules["moonshot_flash_kda"]
        raise
    return module


def moonshot_version(path: str) -> Optional[str]:
    """Best effort: a PEER_VERSION line ("MoonshotAI/FlashKDA <commit>, cutlass <commit>") next to the peer's source."""
    for candidate in (os.path.join(path, "..", "peers-src", "PEER_VERSION"), os.path.join(path, "PEER_VERSION"),
                      os.path.join(path, "flash_kda", "PEER_VERSION")):
        try:
            with open(candidate) as f:
                return f.read().strip() or None
        except OSError:
            continue
    return None


def load_peers(names: list[str], path: str) -> tuple[dict, dict, list[str]]:
    """(peer name -> loaded handle, peer name -> version, notes) for the peers that import."""
    if path not in sys.path:
        sys.path.append(path)  # at the end: our flash_kda must keep the name
    handles, versions, notes = {}, {}, []
    for name in names:
        try:
            if name == "fla":
                handles[name], versions[name] = load_fla()
            else:
                handles[name] = load_moonshot(path)
                versions[name] = moonshot_version(path)
        except Exception as exc:  # an optional peer: an empty column, not an error
            notes.append(f"{name} not importable, its column stays empty: {type(exc).__name__}: {exc}")
            logging.warning("%s", notes[-1])
    return handles, versions, notes


# --- measurement
def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def empty_row(case: Case) -> dict:
    row = {"case": case.name, "state": case.state, "tokens": case.tokens, "heads": case.heads,
           "token_heads": case.token_heads, "floor_bytes": case.floor_bytes, "iters": iters_for(case), "notes": []}
    for impl in IMPLS:
        row.update({f"{impl}_ms": None, f"{impl}_err_out": None, f"{impl}_err_state": None})
    row.update({"bf16_rounding_out": None, "bf16_rounding_state": None})
    return row


def measure_case(case: Case, peers: dict, scale: float, lower_bound: float) -> dict:
    from flash_kda import compare, reference

    import flash_kda

    row = empty_row(case)
    inp = make_inputs(case, "cuda")
    row["plan"] = flash_kda.plan(inp["v"], inp["cu_seqlens"], gate=case.gate)._asdict()  # how our call ran
    runs = {"flash_kda": run_flash_kda(inp, case.state, scale, lower_bound, case.inplace)}
    if "fla" in peers and case.fla_recurrent:
        if peers["fla"].recurrent is None or inp["init"] is None:
            row["notes"].append(f"fla's fused_recurrent_kda_fwd not measured on {case.name}: "
                                f"{'not in this fla' if inp['init'] is not None else 'its in-place state needs one'}")
        else:
            runs["fla"] = run_fla_recurrent(peers["fla"].recurrent, inp, scale, lower_bound)
            row["notes"].append(f"{case.name}: fla column = fused_recurrent_kda_fwd, fp32 state in place")
    elif "fla" in peers:
        runs["fla"] = run_fla(peers["fla"].chunk, inp, scale, lower_bound)
    if "moonshot" in peers and (case.gate, case.neg_eigval, case.key_heads) != ("lower_bound", False, None):
        row["notes"].append(f"MoonshotAI's fwd not measured on {case.name}: it takes the lower-bound gate with "
                            "β = sigmoid and as many value heads as key heads only")
    elif "moonshot" in peers:
        runs["moonshot"] = run_moonshot(peers["moonshot"], inp, case.state, scale, lower_bound)
    with torch.inference_mode():
        for impl, (call, _) in runs.items():
            try:
                row[f"{impl}_ms"] = time_ms(call, row["iters"], FLAGS.warmup)
            except Exception as exc:
                if impl == "flash_kda":
                    raise  # the subject of the benchmark: its failure is an error
                row["notes"].append(f"{impl} raised on {case.name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                logging.warning("%s", row["notes"][-1])
        if FLAGS.graphs and case.fla_recurrent:
            for impl, (call, _) in runs.items():
                if row[f"{impl}_ms"] is None:
                    continue
                try:
                    row[f"{impl}_graph_ms"] = graph_time_ms(call, row["iters"])
                except Exception as exc:  # a peer that cannot be captured keeps an empty cell
                    if impl == "flash_kda":
                        raise
                    row["notes"].append(f"{impl} not captured in a CUDA graph on {case.name}: "
                                        f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        if FLAGS.accuracy and case.token_heads <= FLAGS.accuracy_max_token_heads:
            ref_out, ref_fin = reference.reference_chunked(
                inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale, inp["A_log"], inp["dt_bias"],
                lower_bound, initial_state=inp["init"], cu_seqlens=inp["cu_seqlens"], gate_kind=case.gate,
                beta_scale=2.0 if case.neg_eigval else 1.0)
            row["bf16_rounding_out"] = rel_l2(ref_out.to(torch.bfloat16), ref_out)
            if case.state != "none":
                row["bf16_rounding_state"] = rel_l2(ref_fin.to(torch.bfloat16), ref_fin)
            for impl, (_, outputs) in runs.items():
                if row[f"{impl}_ms"] is None:
                    continue
                out, final = outputs()  # the last timed call's results: every call computes the same thing
                row[f"{impl}_err_out"] = rel_l2(out, ref_out)
                if impl == "flash_kda":  # the worst 256-token window of any sequence (issue 7's accuracy bound)
                    row["flash_kda_err_window"] = compare.compare(out, ref_out, window=256,
                                                                  cu_seqlens=inp["cu_seqlens"]).window_rel_l2
                if final is not None and case.state != "none":
                    row[f"{impl}_err_state"] = rel_l2(final, ref_fin)
            del ref_out, ref_fin
    del inp, runs
    torch.cuda.empty_cache()
    return row


def derive(row: dict, copy_bytes_per_s: float) -> dict:
    """Rates and ratios of a row from its times (recomputed on every row, measured now or loaded)."""
    ms = row["flash_kda_ms"]
    row["floor_ms"] = row["floor_bytes"] / copy_bytes_per_s * 1e3
    row["tokens_per_s"] = row["tokens"] / (ms * 1e-3) if ms else None
    row["achieved_gb_per_s"] = row["floor_bytes"] / (ms * 1e-3) / 1e9 if ms else None
    row["pct_of_floor"] = 100 * row["floor_ms"] / ms if ms else None
    for peer in PEERS:
        peer_ms = row.get(f"{peer}_ms")
        row[f"speedup_vs_{peer}"] = peer_ms / ms if peer_ms and ms else None
    return row


def load_earlier(path: str) -> tuple[dict, dict]:
    """(case name -> row, metadata) of an earlier --json; also reads the older list-of-rows format."""
    with open(path) as f:
        data = json.load(f)
    rows, meta = (data, {}) if isinstance(data, list) else (data.get("rows", []), data.get("meta", {}))
    return {r["case"]: r for r in rows if "case" in r}, meta


def fill_from_earlier(row: dict, earlier: dict) -> None:
    """Peer columns this run did not measure come from the earlier run, marked as such."""
    old = earlier.get(row["case"])
    if old is None or old.get("state", row["state"]) != row["state"]:
        return
    for peer in PEERS:
        if row.get(f"{peer}_ms") is None and old.get(f"{peer}_ms") is not None:
            for key in (f"{peer}_ms", f"{peer}_err_out", f"{peer}_err_state"):
                row[key] = old.get(key)
            row[f"{peer}_source"] = "earlier run"


# --- outputs
def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _peer_cell(row: dict, peer: str, key: str, spec: str) -> str:
    cell = _fmt(row.get(key), spec)
    return f"{cell} (earlier run)" if cell != "-" and row.get(f"{peer}_source") == "earlier run" else cell


def speed_table(rows: list[dict], copy_bytes_per_s: float) -> list[str]:
    lines = [f"## Speed (ms, median of CUDA-event timings; memory floor at the copy ceiling "
             f"{copy_bytes_per_s / 1e9:.0f} GB/s measured in this run)",
             "| case | state | flash_kda ms | fla ms | moonshot ms | fla / flash_kda | moonshot / flash_kda | Mtok/s "
             "| GB/s | floor ms | % of floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mtok = r["tokens_per_s"] / 1e6 if r.get("tokens_per_s") else None
        lines.append(
            f"| {r['case']} | {r['state']} | {_fmt(r['flash_kda_ms'], '.3f')} | {_peer_cell(r, 'fla', 'fla_ms', '.3f')} | "
            f"{_peer_cell(r, 'moonshot', 'moonshot_ms', '.3f')} | {_peer_cell(r, 'fla', 'speedup_vs_fla', '.2f')} | "
            f"{_peer_cell(r, 'moonshot', 'speedup_vs_moonshot', '.2f')} | {_fmt(mtok, '.1f')} | "
            f"{_fmt(r.get('achieved_gb_per_s'), '.0f')} | {_fmt(r.get('floor_ms'), '.3f')} | "
            f"{_fmt(r.get('pct_of_floor'), '.1f')} |")
    lines.append("")
    lines.append(f"Speed-up = peer ms / flash_kda ms. GB/s and % of floor are flash_kda's, with {BYTES_PER_TOKEN_HEAD} B "
                 "per token-head plus each state buffer read or written. " + STATE_NOTE)
    return lines


def graph_table(rows: list[dict], copy_bytes_per_s: float) -> list[str]:
    """The decode rows replayed from CUDA graphs (rows without a graph time are left out)."""
    rows = [r for r in rows if r.get("flash_kda_graph_ms")]
    if not rows:
        return []
    lines = ["## Decode rows replayed from CUDA graphs (ms, median of CUDA-event timings of one replay)",
             "| case | state | flash_kda ms | fla ms | moonshot ms | fla / flash_kda | moonshot / flash_kda | floor ms "
             "| % of floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["flash_kda_graph_ms"]
        floor = r["floor_bytes"] / copy_bytes_per_s * 1e3
        ratios = [_fmt(r[f"{p}_graph_ms"] / ms if r.get(f"{p}_graph_ms") else None, ".2f") for p in PEERS]
        lines.append(f"| {r['case']} | {r['state']} | {ms:.3f} | {_fmt(r.get('fla_graph_ms'), '.3f')} | "
                     f"{_fmt(r.get('moonshot_graph_ms'), '.3f')} | {ratios[0]} | {ratios[1]} | {floor:.3f} | "
                     f"{100 * floor / ms:.1f} |")
    lines.append("")
    lines.append("Each implementation's call captured once in a torch.cuda.CUDAGraph after its warm-up; no host work "
                 "is timed. The eager table above times each call as issued from Python.")
    return lines + [""]


def accuracy_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        if r.get("bf16_rounding_out") is None and all(r.get(f"{i}_err_out") is None for i in IMPLS):
            continue  # the reference did not run on this case
        cells = [_fmt(r.get("flash_kda_err_out"), ".2e"), _fmt(r.get("flash_kda_err_state"), ".2e"),
                 _fmt(r.get("flash_kda_err_window"), ".2e")]
        for peer in PEERS:
            cells += [_peer_cell(r, peer, f"{peer}_err_out", ".2e"), _peer_cell(r, peer, f"{peer}_err_state", ".2e")]
        cells += [_fmt(r.get("bf16_rounding_out"), ".2e"), _fmt(r.get("bf16_rounding_state"), ".2e")]
        body.append(f"| {r['case']} | {r['state']} | " + " | ".join(cells) + " |")
    if not body:
        return []  # no case was checked (--noaccuracy, or every case above --accuracy_max_token_heads)
    return (["## Accuracy (relative L2 error against the float64 reference)",
             "| case | state | flash_kda out | flash_kda state | flash_kda worst 256-token window | fla out "
             "| fla state | moonshot out | moonshot state | bf16 rounding out | bf16 rounding state |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + body +
            ["", "bf16 rounding: the error of the reference itself rounded to bf16 (the floor for a bf16 output)."])


def notes_lines(notes: list[str]) -> list[str]:
    return ["## Notes"] + [f"- {n}" for n in notes] if notes else []


def report_lines(rows: list[dict], meta: dict) -> list[str]:
    lines = speed_table(rows, meta["copy_bytes_per_s"]) + [""]
    lines += graph_table(rows, meta["copy_bytes_per_s"])
    lines += accuracy_table(rows)
    notes = list(meta.get("notes", [])) + [n for r in rows for n in r.get("notes", [])]
    return lines + ([""] + notes_lines(notes) if notes else [])


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
        f.write("\n")


def write_markdown(path: str, rows: list[dict], meta: dict) -> None:
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("peer_versions", {}).items() if v)
    header = [f"# flash_kda.fwd vs peers: {meta['date']}, {meta['gpu']}, `{meta['command']}`", "",
              f"torch {meta['torch']}" + (f"; peers: {versions}" if versions else ""), ""]
    with open(path, "w") as f:
        f.write("\n".join(header + report_lines(rows, meta)) + "\n")


def write_png(path: str, rows: list[dict], meta: dict) -> bool:
    """Grouped horizontal bars, ms on a log axis; a peer without a number has no bar. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        logging.warning("--png: matplotlib is not importable (%s); no chart written (pip install matplotlib)", exc)
        return False
    colors = {"flash_kda": "tab:green", "fla": "tab:blue", "moonshot": "tab:orange"}
    height = 0.8 / len(IMPLS)
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.55 * len(rows)))
    for j, impl in enumerate(IMPLS):
        ys, xs, hatches = [], [], []
        for i, r in enumerate(rows):
            if r.get(f"{impl}_ms"):
                ys.append(len(rows) - 1 - i + (1 - j) * height)  # first case on top, ours on top of its group
                xs.append(r[f"{impl}_ms"])
                hatches.append("//" if r.get(f"{impl}_source") == "earlier run" else "")
        if not xs:
            continue
        bars = ax.barh(ys, xs, height=height, color=colors[impl], label=impl)
        for bar, hatch, x in zip(bars, hatches, xs):
            bar.set_hatch(hatch)
            ax.text(x * 1.03, bar.get_y() + bar.get_height() / 2, f"{x:.3g}", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["case"] for r in reversed(rows)], fontsize=7)
    ax.set_xscale("log")
    values = [r[f"{impl}_ms"] for r in rows for impl in IMPLS if r.get(f"{impl}_ms")]
    if values:
        ax.set_xlim(right=max(values) * 1.6)  # room for the value labels
    ax.set_xlabel("ms per call (median; log scale; hatched: earlier run)")
    fig.suptitle(f"KDA forward, {meta['gpu']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(IMPLS), frameon=False)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return True


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; bench_fwd takes flags only")
    unknown = [p for p in FLAGS.peers if p not in PEERS]
    if unknown:
        raise app.UsageError(f"--peers: unknown {unknown}; choose among {list(PEERS)} (empty for none)")
    cases = select_cases()
    if not torch.cuda.is_available():
        raise app.UsageError("bench_fwd times the CUDA kernel and needs a visible sm_90 GPU (H100/H200)")
    import flash_kda

    scale, lower_bound = HEAD_DIM ** -0.5, FLAGS.lower_bound
    earlier, earlier_meta = load_earlier(FLAGS.peer_json) if FLAGS.peer_json else ({}, {})
    peers, versions, notes = load_peers(FLAGS.peers, FLAGS.moonshot_path) if FLAGS.peers else ({}, {}, [])
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "flash_kda": getattr(flash_kda, "__version__", None),
        "device_info": flash_kda.device_info(0),
        "command": "bench_fwd " + shlex.join(sys.argv[1:]),
        "peers_requested": list(FLAGS.peers),
        "peers_loaded": sorted(peers),
        "peer_versions": {"fla": versions.get("fla"), "moonshot": versions.get("moonshot")},
        "moonshot_path": FLAGS.moonshot_path,
        "peer_json": FLAGS.peer_json,
        "peer_json_meta": {k: earlier_meta.get(k) for k in ("date", "gpu", "peer_versions")} if earlier_meta else None,
        "bytes_per_token_head": BYTES_PER_TOKEN_HEAD,
        "notes": notes,
    }
    logging.info("%s %s torch %s %s", meta["date"], meta["gpu"], meta["torch"], meta["device_info"])
    meta["copy_bytes_per_s"] = measure_copy_ceiling(FLAGS.copy_mib << 20)
    print(f"copy ceiling (device-to-device copy of {FLAGS.copy_mib} MiB, read + write, median of 10): "
          f"{meta['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)

    from flash_kda import testing

    forced = forced_plan()
    forced.__enter__()  # for the whole run (a benchmark of a forced plan: the per-case plan is in the JSON)
    rows = []
    t_run = time.time()
    for i, case in enumerate(cases):
        t0 = time.time()
        logging.info("case %d/%d %s (state %s, %d timed calls) ...", i + 1, len(cases), case.name, case.state,
                     iters_for(case))
        row = derive(measure_case(case, peers, scale, lower_bound), meta["copy_bytes_per_s"])
        rows.append(row)
        logging.info("case %d/%d %s done in %.1f s (%.0f s so far): %s; plan %s", i + 1, len(cases), case.name,
                     time.time() - t0, time.time() - t_run,
                     ", ".join(f"{impl} {_fmt(row[f'{impl}_ms'], '.3f')} ms" for impl in IMPLS), row.get("plan"))
        if FLAGS.json:  # after every case: a run cut short by a time limit keeps what it measured
            write_json(FLAGS.json, rows, meta)
    if earlier:
        for row in rows:
            fill_from_earlier(row, earlier)
            derive(row, meta["copy_bytes_per_s"])

    print("\n" + "\n".join(report_lines(rows, meta)), flush=True)
    if FLAGS.json:
        write_json(FLAGS.json, rows, meta)
        logging.info("wrote %s", FLAGS.json)
    if FLAGS.markdown:
        write_markdown(FLAGS.markdown, rows, meta)
        logging.info("wrote %s", FLAGS.markdown)
    if FLAGS.png and write_png(FLAGS.png, rows, meta):
        logging.info("wrote %s", FLAGS.png)


if __name__ == "__main__":
    app.run(main)
