"""``flash_kda.fwd`` as a PyTorch operator, ``torch.ops.flash_kda.fwd``, for torch.compile and other tracers.

``flash_kda.fwd`` reads data pointers and the device's compute capability, which fake tensors (what
torch.compile traces with) do not have. Under tracing it therefore calls this operator instead, which the
graph keeps as one opaque call that mutates ``out``, ``final_state`` and ``workspace``; its fake
implementation checks the arguments the way ``fwd`` does (dtypes, devices, layouts, shapes, scalars) and
produces nothing, so a bad call fails at trace time with the same message as in eager mode. At run time the
operator runs ``fwd``'s eager body: the same validation, kernel or CPU path, workspace and stream.

Direct calls of ``flash_kda.fwd`` do not go through the dispatcher (it costs host time per call); call
``torch.ops.flash_kda.fwd`` yourself only where a tracer needs an operator, with all 20 arguments: ``fwd``'s
positional ones, then ``workspace``, ``state_indices``, ``gate``, ``allow_neg_eigval``, ``num_accepted_tokens``,
``checkpoint_indices`` and ``checkpoint_every``.

What the operator cannot check: it runs with grad mode off, so a tensor that requires grad is refused by ``fwd``
before it (``validation.refuse_grad``), not by the operator; and a backend that functionalises it without putting
the mutations back in place (torch.compile's ``aot_eager`` debugging backend) hands it copies of ``out`` and
``final_state``, so the aliasing and inference-tensor refusals see the copies, not the caller's tensors (the
default inductor backend hands it the caller's).
"""

from __future__ import annotations

from typing import Optional

import torch

from flash_kda import launch, validation

__all__ = ["fwd_op"]


@torch.library.custom_op("flash_kda::fwd", mutates_args=("out", "final_state", "workspace"))
def fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
           out: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
           lower_bound: Optional[float], initial_state: Optional[torch.Tensor], final_state: Optional[torch.Tensor],
           cu_seqlens: Optional[torch.Tensor], workspace: Optional[torch.Tensor],
           state_indices: Optional[torch.Tensor], gate: str, allow_neg_eigval: bool,
           num_accepted_tokens: Optional[torch.Tensor], checkpoint_indices: Optional[torch.Tensor],
           checkpoint_every: int) -> None:
    """The KDA forward of ``flash_kda.fwd``: the same arguments, all 20 given (pass None for absent ones,
    ``"lower_bound"``, ``False`` and 0 for the default gate, β and checkpoints).

    No argument has a default: the dispatcher drops trailing arguments equal to their defaults, and the
    version bump of a dropped mutated argument (final_state, workspace) then fails inside PyTorch's custom-op
    machinery (seen with torch 2.11 on the H200).

    Without ``workspace`` a CUDA call takes a temporary of its own instead of the per-stream cache: under CUDA
    graph trees (torch.compile's mode="reduce-overhead") a first allocation of the cache would land in the
    trees' private pool, where only tracked tensors may live, and a recorded graph must not depend on a cached
    buffer that a later, larger call may replace. A temporary is freed in stream order like any intermediate."""
    launch.run(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
               workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens, checkpoint_indices,
               checkpoint_every, cached_workspace=False)


@fwd_op.register_fake
def _fwd_fake(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state, cu_seqlens,
              workspace, state_indices, gate="lower_bound", allow_neg_eigval=False, num_accepted_tokens=None,
              checkpoint_indices=None, checkpoint_every=0) -> None:
    validation.validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                        cu_seqlens, workspace, state_indices, gate, allow_neg_eigval, num_accepted_tokens,
                        checkpoint_indices, checkpoint_every, concrete=False)
