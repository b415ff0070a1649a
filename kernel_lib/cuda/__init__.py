"""Level 5: RMSNorm and row softmax written in CUDA C++, as PyTorch operators.

    from kernel_lib import cuda
    y = cuda.rms_norm(x, weight)            # builds the extension on first use (cached afterwards)
    cuda.build_info()                       # where it was built, for which architecture, how long it took

``csrc/rms_norm.cu`` and ``csrc/softmax.cu`` hold the ladder of CUDA kernels notebook 05a builds step by step
(one thread per row, a block per row with a shared-memory tree, warp shuffles, 128-bit loads, rows in registers
(on Hopper split over a thread-block cluster when wider than a block), an online softmax, and on Hopper wide rows
in the shared memory of a cluster, brought by the Tensor Memory Accelerator), sharing ``device.cuh`` (device
helpers), ``hopper.cuh`` (clusters, bulk copies, barriers) and ``launch.cuh`` (host launch configurations and
checks); ``csrc/ops.cpp`` registers the operators (``TORCH_LIBRARY``) with a plain C++ CPU implementation, so
the ops, their registration and their gradients are tested on machines without a GPU;
``_build.py`` compiles with ninja for the device's architecture and caches the library; ``ops.py`` adds the fake
implementations (torch.compile), autograd, the functions and a module. Needs a C++ compiler (g++); the CUDA
kernels also need nvcc and a GPU.
"""

from ._build import BuildInfo
from .ops import VARIANTS, RMSNorm, ensure_loaded, rms_norm, softmax


def build_info() -> BuildInfo:
    """Build or load the extension and say how: folder, CUDA or not, architecture, seconds, cached or not."""
    return ensure_loaded()


__all__ = ["VARIANTS", "RMSNorm", "build_info", "ensure_loaded", "rms_norm", "softmax"]
