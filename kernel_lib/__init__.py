"""kernel_lib: the optimized components of the course "Making PyTorch fast on GPUs".

Each kernel family lives in one file (``rms_norm.py``, ``attention.py``, ``moe.py`` ...) that works on its
own with ``_utils.py``; copy the two into a project to use a kernel. This package also holds the course's
measuring tools:

* :mod:`kernel_lib.bench`: timing with CUDA events, measured ceilings, CSV rows and plots;
* :mod:`kernel_lib.validate`: the float64 comparison rule every kernel passes.

Kernels are exported here as they land.
"""

from . import bench, validate
from .attention import MultiHeadAttention, attention_ref, flash_attention
from .cross_entropy import cross_entropy, cross_entropy_ref
from .grouped_mm import grouped_mm, grouped_mm_ref
from .layer_norm import LayerNorm, layer_norm, layer_norm_ref
from .linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from .moe import MoE, moe, moe_ref
from .rms_norm import RMSNorm, rms_norm, rms_norm_ref
from .rope import rope, rope_cos_sin, rope_ref
from .softmax import softmax, softmax_ref
from .swiglu import geglu, geglu_ref, swiglu, swiglu_ref

__version__ = "0.1.0"

__all__ = [
    "bench",
    "validate",
    "flash_attention",
    "attention_ref",
    "MultiHeadAttention",
    "cross_entropy",
    "cross_entropy_ref",
    "grouped_mm",
    "grouped_mm_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "moe",
    "moe_ref",
    "MoE",
    "rms_norm",
    "rms_norm_ref",
    "RMSNorm",
    "layer_norm",
    "layer_norm_ref",
    "LayerNorm",
    "rope",
    "rope_ref",
    "rope_cos_sin",
    "softmax",
    "softmax_ref",
    "swiglu",
    "swiglu_ref",
    "geglu",
    "geglu_ref",
    "__version__",
]
