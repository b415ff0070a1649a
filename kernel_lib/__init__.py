"""kernel_lib: the optimized components of the course "Making PyTorch fast on GPUs".

The kernels live in :mod:`kernel_lib.ops`, one file per family (``ops/norms.py``, ``ops/attention.py``,
``ops/moe.py`` ...), each working with ``ops/_utils.py`` and the few siblings that ``kernel_lib.ops`` lists;
their public functions and modules are re-exported here, so ``kernel_lib.rms_norm`` is the function and
``kernel_lib.ops.norms`` its file. The package also holds the course's measuring tools:

* :mod:`kernel_lib.bench`: timing with CUDA events, host and CUDA-graph time, measured ceilings, CSV rows, plots;
* :mod:`kernel_lib.validate`: the float64 comparison rule every kernel passes.

Imported on demand (each needs more than torch and triton, or builds something): :mod:`kernel_lib.equivalence`
(a component or model against its original, outputs and gradients), :mod:`kernel_lib.assistant` (find, fix and
prove optimizations on a model), :mod:`kernel_lib.search` (Monte Carlo graph search over kernel variants),
:mod:`kernel_lib.models` (the course's GPT at each level, small models written the common way, the capstone's
data and decoding), :mod:`kernel_lib.cuda` (RMSNorm and softmax in CUDA C++ as PyTorch operators),
:mod:`kernel_lib.distributed` (DDP and FSDP2 through torchrun: wrapping, memory model, MFU, checkpoints).
"""

from . import bench, validate
from .ops.attention import (
    MultiHeadAttention,
    attention_ref,
    attention_varlen_ref,
    flash_attention,
    flash_attention_varlen,
)
from .ops.attention_variants import compile_attention_kernel, create_block_mask, flex_attention, flex_attention_ref
from .ops.cross_entropy import cross_entropy, cross_entropy_ref
from .ops.decode_attention import decode_attention, decode_attention_ref
from .ops.float8 import Float8Linear, convert_to_float8, float8_linear, float8_linear_ref
from .ops.grouped_mm import grouped_mm, grouped_mm_ref
from .ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from .ops.moe import MoE, moe, moe_ref
from .ops.norms import LayerNorm, RMSNorm, add_rms_norm, layer_norm, layer_norm_ref, rms_norm, rms_norm_ref
from .ops.quantized_linear import QuantizedLinear, int4_linear, int8_linear, quantize_
from .ops.rope import rope, rope_cos_sin, rope_ref, rope_to_cache, rope_to_cache_ref
from .ops.softmax import softmax, softmax_ref
from .ops.swiglu import geglu, geglu_ref, swiglu, swiglu_linear, swiglu_ref

__version__ = "0.1.0"

__all__ = [
    "bench",
    "validate",
    "flash_attention",
    "flash_attention_varlen",
    "attention_ref",
    "attention_varlen_ref",
    "MultiHeadAttention",
    "flex_attention",
    "flex_attention_ref",
    "create_block_mask",
    "compile_attention_kernel",
    "decode_attention",
    "decode_attention_ref",
    "cross_entropy",
    "cross_entropy_ref",
    "grouped_mm",
    "grouped_mm_ref",
    "linear_cross_entropy",
    "linear_cross_entropy_ref",
    "moe",
    "moe_ref",
    "MoE",
    "float8_linear",
    "float8_linear_ref",
    "Float8Linear",
    "convert_to_float8",
    "int8_linear",
    "int4_linear",
    "QuantizedLinear",
    "quantize_",
    "rms_norm",
    "rms_norm_ref",
    "add_rms_norm",
    "RMSNorm",
    "layer_norm",
    "layer_norm_ref",
    "LayerNorm",
    "rope",
    "rope_ref",
    "rope_cos_sin",
    "rope_to_cache",
    "rope_to_cache_ref",
    "softmax",
    "softmax_ref",
    "swiglu",
    "swiglu_linear",
    "swiglu_ref",
    "geglu",
    "geglu_ref",
    "__version__",
]
