"""Where the host's time goes in one eager RMSNorm forward + backward (x and weight gradients), on a GPU.

An experiment log: cProfile over 200 steps of kernel_lib.rms_norm at 32768 x 4096 bf16, top functions by own time.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from explore_host_norms import profile_steps  # noqa: E402  (this folder is on sys.path when run as a script)

import kernel_lib  # noqa: E402

x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)


def step():
    return torch.autograd.grad(kernel_lib.rms_norm(x, w), (x, w), dy)


for _ in range(10):
    step()
torch.cuda.synchronize()
profile_steps(step, top=25)
