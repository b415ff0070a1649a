"""Whole models built from kernel_lib's parts, for the capstone and for the optimization assistant.

* :mod:`kernel_lib.models.gpt`: one small GPT written at several levels of the course (``GPTConfig.impl``:
  ``"naive"``, ``"native"``, ``"kernel_lib"``), with ``transfer_weights`` to compare them from identical weights,
  and a static KV cache (``init_cache``, ``forward_step``) for decoding;
* :mod:`kernel_lib.models.data`: the capstone's corpus (Python's standard library), its byte-level BPE tokenizer
  and random-window batches, shared with the distributed level;
* :mod:`kernel_lib.models.generate`: greedy decoding, the CUDA-graphed decoder, and the conversion to Hugging
  Face's Llama for comparing against its ``generate``;
* :mod:`kernel_lib.models.zoo`: small models written the way code outside this course often is (a graph network
  looping over edges, a recommender looping over features), for the assistant to work on code nobody here tuned.
"""

from . import data, generate, gpt, zoo
from .data import *  # noqa: F403
from .generate import *  # noqa: F403
from .gpt import *  # noqa: F403
from .zoo import *  # noqa: F403

# each submodule's public names, as its own __all__ lists them
__all__ = [*gpt.__all__, *generate.__all__, *data.__all__, *zoo.__all__]
