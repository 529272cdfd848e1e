"""A consumer's forward on the CPU path, against FlashKDA's float64 recurrence."""
import torch

import flash_kda
from flash_kda import compare, reference

gen = torch.Generator().manual_seed(0)
B, T, H, K = 1, 40, 2, 128
q, k, v, g = (torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16) for _ in range(4))
beta = torch.randn(B, T, H, generator=gen).to(torch.bfloat16)
out = torch.empty(B, T, H, K, dtype=torch.bfloat16)
flash_kda.fwd(q, k, v, g, beta, K**-0.5, out, None, None, -5.0)
expected, _ = reference.reference_loop(q, k, v, g, beta, K**-0.5, None, None, -5.0)
floor = compare.compare(expected.to(torch.bfloat16), expected).rel_l2
error = compare.compare(out, expected).rel_l2
assert error <= 1.01 * floor, f"out against float64: {error:.3e}, bf16 floor {floor:.3e}"
print(f"consumer: flash_kda.fwd from a workspace that depends on FlashKDA, out rel L2 {error:.3e} (floor {floor:.3e})")
