"""Whole models built from kernel_lib's parts, for the capstone and for the optimization assistant.

* :mod:`kernel_lib.models.gpt`: one small GPT written at several levels of the course (``GPTConfig.impl``:
  ``"naive"``, ``"native"``, ``"kernel_lib"``), with ``transfer_weights`` to compare them from identical weights;
* :mod:`kernel_lib.models.zoo`: small models written the way code outside this course often is (a graph network
  looping over edges, a recommender looping over features), for the assistant to work on code nobody here tuned.
"""

from .gpt import GPT, GPTConfig, naive_layout, transfer_weights
from .zoo import EdgeLoopGNN, EmbeddingLoopRecommender, gnn_inputs, recommender_inputs

__all__ = [
    "GPT",
    "GPTConfig",
    "transfer_weights",
    "naive_layout",
    "EdgeLoopGNN",
    "gnn_inputs",
    "EmbeddingLoopRecommender",
    "recommender_inputs",
]
