"""flash_kda.fwd under misuse: the calls a careless or hostile caller makes, and what they must get.

Each test pins one guarantee of docs/SPEC.md §3, "Guarantees":
- arguments the kernel cannot honour are refused before any kernel runs, by name: a scale that is not finite in
  fp32, more heads than a launch grid holds, outputs that overlap inputs or each other (only a final state that is
  the initial state, the same memory from the same first byte, may alias);
- a CPU ``cu_seqlens`` with CUDA tensors gives the bits of the CUDA ``cu_seqlens`` call for any N, and the call
  copies what it validated (the caller may change a pinned buffer as soon as the call returns);
- ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) works and equals eager;
- a buffer that a captured CUDA graph uses is never freed under it when the workspace cache grows;
- ``last_error()`` covers the work of every stream of the device;
- threads on their own streams that grow the workspace cache get the bits of serial calls;
- the CPU path refuses calls whose memory it cannot have, saying how much they need.
- a call on another device than the thread's current one runs under that device's context, which torch restores
  lazily (``_ext.on_device``: no CUDA context on a device the thread never used);
CPU tests run in CI; the ``gpu`` ones on an sm_90 machine.
"""

from __future__ import annotations

import threading

import pytest
import torch

import flash_kda

D = 128


def make(device, *, B=1, T=32, H=2, seqlens=None, state=torch.bfloat16, seed=0) -> dict:
    """A valid argument set for flash_kda.fwd on ``device`` (varlen when ``seqlens`` is given)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    N = B
    cu = None
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int64, device=device)
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        scale=D**-0.5, out=torch.full((B, T, H, D), float("nan"), dtype=torch.bfloat16, device=device),
        A_log=randn(H, dtype=torch.float32), dt_bias=randn(H, D, dtype=torch.float32), lower_bound=-5.0,
        initial_state=None if state is None else randn(N, H, D, D, dtype=state),
        final_state=None if state is None else torch.full((N, H, D, D), float("nan"), dtype=state, device=device),
        cu_seqlens=cu,
    )  # fmt: skip


def run(x: dict, **changes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Calls fwd on ``x`` changed as given; returns (out, final_state)."""
    x = {**x, **changes}
    flash_kda.fwd(**x)
    return x["out"], x["final_state"]


def fresh_outputs(x: dict) -> dict:
    out = torch.full_like(x["out"], float("nan"))
    final = None if x["final_state"] is None else torch.full_like(x["final_state"], float("nan"))
    return {**x, "out": out, "final_state": final}


# --- scale must be finite in fp32 (the kernel receives it as a float) -------------------------------------


@pytest.mark.parametrize("scale", [1e39, -1e39, 3.5e38, 1e300])
def test_scale_that_overflows_fp32_is_refused(scale):
    with pytest.raises(ValueError, match=r"scale must be finite in float32"):
        flash_kda.fwd(**{**make("cpu"), "scale": scale})


def test_large_finite_scale_is_accepted():
    x = make("cpu", T=5)
    unit, _ = run(fresh_outputs(x), scale=1.0)
    big, _ = run(fresh_outputs(x), scale=2.0**100)
    assert torch.isfinite(big).all()
    assert torch.equal(big, (unit.float() * 2.0**100).to(torch.bfloat16)), "scale multiplies the output exactly"


# --- outputs must not overlap anything but their own state -----------------------------------------------


def test_final_state_inside_out_is_refused():
    x = make("cpu", state=torch.bfloat16)
    N, H = x["initial_state"].shape[:2]
    buf = torch.empty(x["out"].numel() + N * H * D * D, dtype=torch.bfloat16)
    out = buf[: x["out"].numel()].view(x["out"].shape)
    final = buf[D : D + N * H * D * D].view(N, H, D, D)  # starts inside out's memory
    with pytest.raises(ValueError, match=r"final_state overlaps out"):
        flash_kda.fwd(**{**x, "out": out, "final_state": final})


def test_states_that_overlap_at_an_offset_are_refused():
    x = make("cpu", B=2, state=torch.float32)
    buf = torch.randn(3, 2, D, D)
    with pytest.raises(ValueError, match=r"final_state overlaps initial_state"):
        flash_kda.fwd(**{**x, "initial_state": buf[0:2], "final_state": buf[1:3]})


def overlay(source: torch.Tensor, out_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``source`` and an ``out_like``-shaped bf16 tensor that share their first bytes."""
    nbytes = max(source.numel() * source.element_size(), out_like.numel() * 2)
    raw = torch.zeros(nbytes + 16, dtype=torch.uint8)
    copy = raw[: source.numel() * source.element_size()].view(source.dtype).view(source.shape)
    copy.copy_(source)
    return copy, raw[: out_like.numel() * 2].view(torch.bfloat16).view(out_like.shape)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"])
def test_out_overlapping_an_input_is_refused(name):
    x = make("cpu", state=torch.bfloat16)
    source, out = overlay(x[name], x["out"])
    with pytest.raises(ValueError, match=rf"out overlaps {name}"):
        flash_kda.fwd(**{**x, name: source, "out": out})


def test_final_state_overlapping_q_is_refused():
    x = make("cpu", T=1024, H=2, state=torch.bfloat16)  # q holds 2 x 128 x 128 bf16 elements and more
    final = x["q"].view(-1)[: x["final_state"].numel()].view(x["final_state"].shape)
    with pytest.raises(ValueError, match=r"final_state overlaps q"):
        flash_kda.fwd(**{**x, "final_state": final})


def test_in_place_state_is_accepted_as_the_same_tensor_or_the_same_memory():
    x = make("cpu", B=2, T=20, state=torch.float32)
    expected_out, expected_final = run(fresh_outputs(x))
    for alias in ("same tensor", "same memory"):
        state = x["initial_state"].clone()
        final = state if alias == "same tensor" else state.view(-1).view(state.shape)
        out, final = run(fresh_outputs(x), initial_state=state, final_state=final)
        assert torch.equal(out, expected_out), alias
        assert torch.equal(final, expected_final), alias


def test_inputs_may_share_memory():
    x = make("cpu", T=20)
    out_a, _ = run(fresh_outputs(x), k=x["q"])
    out_b, _ = run(fresh_outputs(x), k=x["q"].clone())
    assert torch.equal(out_a, out_b)


# --- the CPU path's memory ---------------------------------------------------------------------------------


def test_cpu_path_refuses_a_call_larger_than_host_memory(monkeypatch):
    from flash_kda import launch  # noqa: PLC0415

    monkeypatch.setattr(launch, "available_host_memory", lambda: 1 << 20)
    x = make("cpu", T=64, H=4)
    needed = launch.cpu_bytes_needed(64 * 4, 4)
    assert needed > 1 << 20
    with pytest.raises(MemoryError, match=r"the CPU path needs about .* for 256 token-heads and 4 sequence-heads .* "
                                          r"1\.0 MiB"):
        flash_kda.fwd(**x)
    assert torch.isnan(x["out"]).all(), "a refused call must write nothing"


def test_cpu_path_counts_each_sequences_states(monkeypatch):
    """A decode-shaped call (many sequences of one token) holds fp32 states per sequence-head: the estimate counts
    them, so such a call is refused with MemoryError where the token count alone would have let it through."""
    from flash_kda import launch  # noqa: PLC0415

    x = make("cpu", B=64, T=1, H=4)
    by_tokens = launch.cpu_bytes_needed(64 * 4)
    assert launch.cpu_bytes_needed(64 * 4, 64 * 4) >= by_tokens + 64 * 4 * 4 * D * D  # an fp32 state each, at least
    monkeypatch.setattr(launch, "available_host_memory", lambda: by_tokens + (1 << 20))
    with pytest.raises(MemoryError, match=r"for 256 token-heads and 256 sequence-heads"):
        flash_kda.fwd(**x)
    assert torch.isnan(x["out"]).all(), "a refused call must write nothing"


# --- outputs created under torch.inference_mode() ----------------------------------------------------------


@pytest.mark.parametrize("name", ["out", "final_state"])
def test_inference_tensor_output_outside_inference_mode_is_refused_by_name(name):
    """PyTorch does not allow an inference tensor to be written in place outside inference mode: the call is
    refused by name before it writes anything (the CPU path would otherwise fail after writing out)."""
    x = make("cpu")
    with torch.inference_mode():
        x[name] = x[name].clone()
    with pytest.raises(RuntimeError, match=rf"{name} is an inference tensor .* torch.inference_mode\(\)"):
        flash_kda.fwd(**x)
    assert torch.isnan(x["out"]).all() and torch.isnan(x["final_state"]).all(), "a refused call writes nothing"


def test_inference_tensor_outputs_inside_inference_mode_are_written():
    x = make("cpu")
    with torch.inference_mode():
        x["out"], x["final_state"] = x["out"].clone(), x["final_state"].clone()
        flash_kda.fwd(**x)
    assert not torch.isnan(x["out"]).any() and not torch.isnan(x["final_state"]).any()


# --- checkpoints past every sequence's end ----------------------------------------------------------------


@pytest.mark.parametrize("every", [2**62 + 16, 2**62, 2**63, 2**80], ids=str)
def test_checkpoints_past_int64_are_never_written(every):
    """(m+1)·checkpoint_every past 2^63 must not wrap around to a length the sequence reaches: slot 1, named for
    the 4th checkpoint of a 64-token sequence, is left as it was, and the call completes."""
    x = make("cpu", T=64, H=1, state=None)
    pool = torch.full((2, 1, D, D), float("nan"))
    flash_kda.fwd(**{**x, "initial_state": None, "final_state": pool}, state_indices=torch.tensor([0]),
                  checkpoint_indices=torch.tensor([[-1, -1, -1, 1]]), checkpoint_every=every)
    assert torch.isfinite(pool[0]).all()
    assert torch.isnan(pool[1]).all(), "a checkpoint the sequence never reaches was written"


# --- heads: a launch grid holds at most 65535 in y ---------------------------------------------------------


def test_too_many_heads_are_refused_on_cuda_by_the_fake_implementation():
    """Traced with fake CUDA tensors (no GPU needed): the same check the eager CUDA call makes."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    from flash_kda import ops  # noqa: F401, PLC0415

    H = 65536
    with FakeTensorMode():
        q = torch.empty(1, 1, H, D, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=r"H = 65536 heads.* at most 65535"):
            torch.ops.flash_kda.fwd(q, q, q, q, torch.empty(1, 1, H, dtype=torch.bfloat16, device="cuda"), 0.1,
                                    torch.empty_like(q), torch.empty(H, device="cuda"),
                                    torch.empty(H, D, device="cuda"), -5.0, None, None, None, None, None,
                                    "lower_bound", False, None, None, 0)


# --- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_too_many_heads_are_refused_before_any_kernel():
    x = make("cuda", T=1, H=65536, state=None)
    before = x["out"].clone()
    with pytest.raises(ValueError, match=r"H = 65536 heads.* at most 65535"):
        flash_kda.fwd(**x)
    torch.cuda.synchronize()
    assert torch.equal(x["out"].isnan(), before.isnan()), "nothing may run"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seqlens, H", [((1000,) * 3, 64), ((1000,) * 5, 96), ((300, 2000, 700), 48), ((1000,) * 3, 4), ((17,), 96)],
    ids=["3x1000_H64", "5x1000_H96", "ragged_H48", "3x1000_H4", "1x17_H96"],
)  # fmt: skip
def test_host_cu_seqlens_with_odd_n_equals_device_cu_seqlens(seqlens, H):
    x = make("cuda", seqlens=seqlens, H=H, state=torch.bfloat16)
    device_out, device_final = run(fresh_outputs(x))
    host_out, host_final = run(fresh_outputs(x), cu_seqlens=x["cu_seqlens"].cpu())
    torch.cuda.synchronize()
    assert torch.equal(host_out, device_out) and torch.equal(host_final, device_final)


@pytest.mark.gpu
def test_pinned_host_cu_seqlens_changed_right_after_the_call():
    seqlens = (300, 40, 700, 90)
    x = make("cuda", seqlens=seqlens, H=4, state=torch.float32)
    expected_out, expected_final = run(fresh_outputs(x))
    pinned = x["cu_seqlens"].cpu().pin_memory()
    y = fresh_outputs(x)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the call: its copies wait behind it
    flash_kda.fwd(**{**y, "cu_seqlens": pinned})
    rotated = torch.tensor([0, *torch.tensor(seqlens[1:] + seqlens[:1]).cumsum(0).tolist()], dtype=torch.int64)
    pinned.copy_(rotated)  # the caller reuses its buffer as soon as fwd returns
    torch.cuda.synchronize()
    assert torch.equal(y["out"], expected_out), "the call must use the boundaries it validated"
    assert torch.equal(y["final_state"], expected_final)


class KdaLayer(torch.nn.Module):
    def forward(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens):
        out = torch.empty_like(v)
        final = torch.empty_like(initial_state)
        flash_kda.fwd(q, k, v, g, beta, D**-0.5, out, A_log, dt_bias, -5.0, initial_state=initial_state,
                      final_state=final, cu_seqlens=cu_seqlens)
        return out * 2, final + 1


@pytest.mark.gpu
def test_compile_reduce_overhead_equals_eager_for_several_shapes():
    torch._dynamo.reset()
    layer = KdaLayer()
    compiled = torch.compile(layer, mode="reduce-overhead")
    shapes = [dict(T=64), dict(T=300), dict(B=2, T=128), dict(seqlens=(100, 0, 37)), dict(T=64)]
    for shape in shapes:
        x = make("cuda", H=4, **shape)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], x["initial_state"],
                x["cu_seqlens"])
        eager = layer(*args)
        for attempt in range(3):  # warm-up, recording, replays
            got = compiled(*args)
            torch.cuda.synchronize()
            for a, b in zip(got, eager):
                assert torch.equal(a, b), f"{shape} attempt {attempt}: compiled differs from eager"


@pytest.mark.gpu
def test_graph_on_the_cached_workspace_survives_its_growth():
    """Capture on the cached workspace, grow the cache with a larger eager call on the same stream, allocate
    foreign memory of the old buffer's size, replay: the foreign memory stays untouched, the replay is right."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    small = make("cuda", T=256, H=8)
    large = make("cuda", T=8192, H=16)
    with torch.cuda.stream(side):
        flash_kda.reserve_workspace(flash_kda.workspace_bytes(small["q"]), small["q"].device)
        cached = flash_kda.reserve_workspace(0, small["q"].device)
        old_bytes = cached.numel()
        flash_kda.fwd(**small)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            flash_kda.fwd(**small)
        flash_kda.fwd(**large)  # grows the cache of this stream
        assert flash_kda.reserve_workspace(0, small["q"].device).numel() > old_bytes
        del cached
        foreign = [torch.full((old_bytes,), 0x5A, dtype=torch.uint8, device="cuda") for _ in range(4)]
        small["out"].fill_(float("nan"))
        graph.replay()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for buf in foreign:
        assert bool((buf == 0x5A).all()), "a replay wrote into memory the cache had freed"
    expected_out, expected_final = run(fresh_outputs(small))
    assert torch.equal(small["out"], expected_out) and torch.equal(small["final_state"], expected_final)


@pytest.mark.gpu
def test_last_error_covers_other_streams():
    x = make("cuda", seqlens=(16, 20), H=2)
    bad = torch.tensor([0, 30, 20], dtype=torch.int64, device="cuda")  # decreasing: index 2 is bad
    flash_kda.last_error()  # clear
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the bad call's check runs ~0.1 s after the query starts
        flash_kda.fwd(**{**x, "cu_seqlens": bad})
    message = flash_kda.last_error()  # on the default stream, which never waited for `side`
    assert message is not None and "cu_seqlens[2]" in message, message
    assert flash_kda.last_error() is None, "the query resets the word"


@pytest.mark.gpu
def test_threads_on_their_own_streams_growing_the_cache_equal_serial_calls():
    shapes = [dict(T=64, H=4), dict(T=1024, H=8), dict(seqlens=(300, 17, 900), H=16), dict(T=4096, H=32),
              dict(B=4, T=512, H=8), dict(seqlens=(1000,) * 3, H=64)]
    inputs = [make("cuda", seed=i, **s) for i, s in enumerate(shapes)]
    serial = [run(fresh_outputs(x)) for x in inputs]
    torch.cuda.synchronize()
    results: dict[tuple[int, int], tuple] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(len(inputs)):  # growing shapes: each thread's stream grows its own cache
                    results[w, i] = run(fresh_outputs(inputs[i]))
                stream.synchronize()
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (w, i), (out, final) in results.items():
        assert torch.equal(out, serial[i][0]), f"thread {w}, shape {shapes[i]}: out differs from a serial call"
        assert torch.equal(final, serial[i][1]), f"thread {w}, shape {shapes[i]}: final_state differs"
    assert len(results) == 4 * len(inputs)


@pytest.mark.parametrize("current", [0, 1])
def test_device_calls_switch_through_torch_only_for_another_device(monkeypatch, current):
    # (CPU: the choice alone; the device switch itself needs two GPUs)
    from flash_kda import _ext

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    context = _ext.on_device(1)
    if current == 1:
        assert not isinstance(context, torch.cuda.device)
        with context:
            pass
    else:
        assert isinstance(context, torch.cuda.device) and context.idx == 1
