"""FlashKDA: the Kimi Delta Attention forward for Hopper (sm_90a), callable from PyTorch.

``flash_kda.fwd`` is a drop-in for the call that inference stacks (fla's ``chunk_kda`` backend) already make;
CPU tensors take a portable fp32 path. Submodules: ``reference`` (float64 ground truth), ``numerics`` (the
kernel's numerics twin and the CPU path), ``compare`` (error metrics), ``ops`` (``torch.ops.flash_kda.fwd``,
what torch.compile traces), ``testing`` (test-only plan forcing), ``fla_backend`` (opt-in: fla's ``chunk_kda``
and recurrent KDA forward on ``fwd``; imports fla only when registered), ``_ext`` (the compiled helpers); ``api``,
``validation``, ``planning``, ``pools`` and ``launch`` hold the forward call's parts. ``Plan`` is the extension's type,
loaded on first use, so ``import flash_kda`` works without the extension.
"""

from __future__ import annotations

import importlib

from flash_kda._ext import build_info, device_info
from flash_kda.api import (check_cu_seqlens, fwd, last_error, plan, release_workspace, reserve_workspace,
                           workspace_bytes)

__version__ = "0.1.0"
__all__ = [
    "fwd", "check_cu_seqlens", "last_error", "workspace_bytes", "reserve_workspace", "release_workspace", "plan", "Plan",
    "device_info", "build_info", "__version__",
]

_SUBMODULES = ("reference", "numerics", "compare", "api", "validation", "planning", "launch", "ops", "testing",
               "pools", "fla_backend", "_ext")


def __getattr__(name: str):
    # Submodules and Plan load on first access: `import flash_kda` stays cheap and works without the extension.
    if name in _SUBMODULES:
        return importlib.import_module(f"flash_kda.{name}")
    if name == "Plan":
        from flash_kda import planning  # noqa: PLC0415

        return planning.Plan
    raise AttributeError(f"module 'flash_kda' has no attribute {name!r}")
