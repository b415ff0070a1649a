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

from .data import batches, encode_corpus, fixed_batch, stdlib_files, train_tokenizer, train_val_split
from .generate import GraphedDecoder, greedy, to_hf_llama
from .gpt import GPT, GPTConfig, KVCache, kv_bucket, naive_layout, transfer_weights
from .zoo import EdgeLoopGNN, EmbeddingLoopRecommender, gnn_inputs, recommender_inputs

__all__ = [
    "GPT",
    "GPTConfig",
    "transfer_weights",
    "naive_layout",
    "KVCache",
    "kv_bucket",
    "greedy",
    "GraphedDecoder",
    "to_hf_llama",
    "stdlib_files",
    "train_tokenizer",
    "encode_corpus",
    "train_val_split",
    "batches",
    "fixed_batch",
    "EdgeLoopGNN",
    "gnn_inputs",
    "EmbeddingLoopRecommender",
    "recommender_inputs",
]
