"""fla's chunk_kda reaches flash_kda.fwd (GPU; fla 0.6.0 from the pinned wheels, @fla_wheels//:fla).

fla 0.6 dispatches `chunk_kda` to an importable package named `flash_kda` under `torch.inference_mode()` when it
is called with the docs/SPEC.md §3 flags, unless `FLA_FLASH_KDA=0`. Each test counts the calls that reach
`flash_kda.fwd` and compares fla's results with a direct `flash_kda.fwd` call bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import flash_kda
from fla_support import kda_layer_class

pytestmark = pytest.mark.gpu

D = 128
LOWER_BOUND = -5.0


def _inputs(*, B=1, T=300, H=4, seqlens=None, initial_state=True, seed=0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    cu = None
    N = B
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int64, device="cuda")
    return dict(
        q=randn(B, T, H, D), k=randn(B, T, H, D), v=randn(B, T, H, D), g=randn(B, T, H, D), beta=randn(B, T, H),
        A_log=randn(H, dtype=torch.float32), dt_bias=randn(H * D, dtype=torch.float32),  # fla's flat layout
        initial_state=randn(N, H, D, D, dtype=torch.float32) if initial_state else None, cu_seqlens=cu, N=N,
    )  # fmt: skip


def _fla_chunk_kda(x: dict):
    from fla.ops.kda import chunk_kda  # noqa: PLC0415 -- fla needs triton and a GPU

    with torch.inference_mode():
        return chunk_kda(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=D**-0.5, initial_state=x["initial_state"],
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, state_v_first=True,
            cu_seqlens=x["cu_seqlens"], A_log=x["A_log"], dt_bias=x["dt_bias"],
        )  # fmt: skip


def _direct(x: dict):
    H = x["q"].shape[2]
    out = torch.empty_like(x["v"])
    final = torch.empty(x["N"], H, D, D, dtype=torch.float32, device="cuda")
    flash_kda.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], D**-0.5, out, x["A_log"], x["dt_bias"].view(H, D),
                  LOWER_BOUND, initial_state=x["initial_state"], final_state=final, cu_seqlens=x["cu_seqlens"])
    return out, final


@pytest.fixture
def fwd_calls(monkeypatch) -> list:
    """Counts the calls of flash_kda.fwd (fla looks the function up on the module at call time)."""
    calls = []
    real = flash_kda.fwd

    def counting_fwd(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_kda, "fwd", counting_fwd)
    return calls


@pytest.fixture
def set_dispatch(monkeypatch):
    """Sets FLA_FLASH_KDA. fla's backend reads it once per process (a cached check), so the cache is cleared on
    every change and after the test (when monkeypatch has restored the variable, the next read sees it)."""
    from fla.ops.kda.backends.flash_kda import FlashKDABackend  # noqa: PLC0415 -- fla needs triton

    def set_(enabled: bool) -> None:
        monkeypatch.setenv("FLA_FLASH_KDA", "1" if enabled else "0")
        FlashKDABackend.can_use.cache_clear()

    yield set_
    FlashKDABackend.can_use.cache_clear()


@pytest.mark.parametrize(
    "shape",
    [dict(), dict(B=2, T=257, initial_state=False), dict(seqlens=(100, 37, 64)),
     dict(seqlens=(17, 200), initial_state=False)],
    ids=["fixed_fp32_state", "batched_no_state", "varlen_fp32_state", "varlen_no_state"],
)  # fmt: skip
def test_chunk_kda_dispatches_to_flash_kda(shape, fwd_calls, set_dispatch):
    set_dispatch(True)
    x = _inputs(**shape)
    out, final = _fla_chunk_kda(x)
    assert len(fwd_calls) == 1, f"chunk_kda called flash_kda.fwd {len(fwd_calls)} times, expected once"
    assert fwd_calls[0] == (x["cu_seqlens"] is not None)
    direct_out, direct_final = _direct(x)
    assert torch.equal(out, direct_out), "fla's dispatched output differs from a direct flash_kda.fwd call"
    assert torch.equal(final, direct_final), "fla's dispatched final state differs from a direct call"


def test_fla_flash_kda_0_keeps_fla_on_its_own_kernels(fwd_calls, set_dispatch):
    set_dispatch(False)
    out, final = _fla_chunk_kda(_inputs())
    assert fwd_calls == [], "chunk_kda dispatched to flash_kda.fwd although FLA_FLASH_KDA=0"
    assert torch.isfinite(out.float()).all() and torch.isfinite(final).all()


# --- fla's KimiDeltaAttention layer, as inference code runs it ---------------------------------------------


def _layer_outputs(layer, x, *, dispatch: bool, set_dispatch, autocast: bool):
    set_dispatch(dispatch)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)[0]
    return out.float()


@pytest.mark.parametrize("precision", ["bf16_layer", "autocast"])
def test_kimi_delta_attention_layer_dispatches(precision, fwd_calls, set_dispatch):
    """The layer cast with layer.to(torch.bfloat16) hands A_log and dt_bias over as bf16, and under autocast an
    fp32 layer hands bf16 activations with fp32 parameters: both reach flash_kda.fwd, and the layer's output
    stays close to fla's own Triton path (different kernels: not bit for bit)."""
    torch.manual_seed(0)
    layer = kda_layer_class()(hidden_size=512, head_dim=D, num_heads=4, mode="chunk", safe_gate=True,
                               lower_bound=LOWER_BOUND).cuda().eval()
    autocast = precision == "autocast"
    if not autocast:
        layer = layer.to(torch.bfloat16)
        assert layer.A_log.dtype == torch.bfloat16 and layer.dt_bias.dtype == torch.bfloat16
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.float32 if autocast else torch.bfloat16)
    ours = _layer_outputs(layer, x, dispatch=True, set_dispatch=set_dispatch, autocast=autocast)
    assert len(fwd_calls) == 1, f"the layer called flash_kda.fwd {len(fwd_calls)} times, expected once"
    fla_own = _layer_outputs(layer, x, dispatch=False, set_dispatch=set_dispatch, autocast=autocast)
    assert len(fwd_calls) == 1, "FLA_FLASH_KDA=0 still dispatched"
    assert torch.isfinite(ours).all()
    rel = ((ours - fla_own).norm() / fla_own.norm()).item()
    assert rel < 3e-2, f"layer output differs from fla's own path by rel L2 {rel:.3e}"
