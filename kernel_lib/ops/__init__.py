"""The kernel files of kernel_lib, one per kernel family; ``kernel_lib`` re-exports their public functions.

Importing a module here gives the module (``from kernel_lib.ops import softmax`` is the file, with its launchers,
kernels and reference), while ``kernel_lib.softmax`` is the function. Every file needs ``_utils.py`` beside it; a
few need siblings too. To use a kernel in your project, copy these files into one package folder:

* ``swiglu.py``, ``rope.py``, ``cross_entropy.py``, ``grouped_mm.py``, ``decode_attention.py``,
  ``quantized_linear.py``, ``float8.py``: with ``_utils.py`` alone;
* ``norms.py``, ``softmax.py``: with ``_utils.py`` and ``split_rows.py`` (rows too wide for one program shared by
  a team of programs);
* ``linear_cross_entropy.py``: with ``_utils.py`` and ``cross_entropy.py``;
* ``attention.py``: with ``_utils.py``, ``attention_kernels.py``, ``attention_hopper.py`` (the Gluon forward for
  SM90 GPUs; on a Triton without Gluon it imports and stays unused) and ``rope.py`` (for ``MultiHeadAttention``'s
  rotary embedding; ``flash_attention`` alone does not import it);
* ``attention_variants.py``: with ``_utils.py`` and ``attention_kernels.py``;
* ``moe.py``: with ``_utils.py``, ``grouped_mm.py`` and ``swiglu.py``.

``COMPANIONS`` says the same for code; ``tests/test_copy_alone.py`` copies each file with exactly these
companions into an empty folder, imports it there and runs it forward and backward.
"""

COMPANIONS = {
    "norms.py": ("split_rows.py",),
    "softmax.py": ("split_rows.py",),
    "swiglu.py": (),
    "rope.py": (),
    "cross_entropy.py": (),
    "linear_cross_entropy.py": ("cross_entropy.py",),
    "attention.py": ("attention_kernels.py", "attention_hopper.py", "rope.py"),
    "grouped_mm.py": (),
    "decode_attention.py": (),
    "quantized_linear.py": (),
    "float8.py": (),
    "attention_variants.py": ("attention_kernels.py",),
    "moe.py": ("grouped_mm.py", "swiglu.py"),
}
