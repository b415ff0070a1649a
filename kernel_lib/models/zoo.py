"""Small models written the way much PyTorch outside this course is written: plain, correct, and slow.

Each shows one habit that costs a GPU dearly and that a reader (or the optimization assistant) should spot:

* :class:`EdgeLoopGNN`, message passing over a graph as a Python loop over the edges, with ``.item()`` on every
  index. For a layer with E edges and N nodes::

      m_e     = message(h[src_e])                         one small matmul per edge
      agg[v]  = sum over edges e with dst_e = v of m_e    one indexed add per edge
      h'      = update([h, agg])                          (N, hidden), once per layer

  E tiny kernel launches and E host synchronizations per layer, where one gather, one matmul and one
  ``index_add_`` (or a segment sum) do the same work.
* :class:`EmbeddingLoopRecommender`, a DLRM / factorization-machine style click model: one ``nn.Embedding`` per
  categorical feature looked up in a Python loop over the F features, and the F (F - 1) / 2 pairwise dot products
  in a double Python loop::

      e_i     = embedding_i(features[:, i])               (B, dim) each, F lookups
      z_ij    = <e_i, e_j> for i < j                      (B,) each, F (F - 1) / 2 small kernels
      logit   = mlp([e_1 .. e_F, z_12 .. z_(F-1)F])       (B,)

  One batched matmul of the stacked embeddings (B, F, dim) with their transpose gives every z_ij at once, and
  one table with per-feature offsets gives every lookup at once.

Both are small (a CPU forward and backward at test size takes milliseconds) and run on any device.
"""

import torch
from torch import nn

__all__ = ["EdgeLoopGNN", "gnn_inputs", "EmbeddingLoopRecommender", "recommender_inputs"]


class EdgeLoopGNN(nn.Module):
    """Message-passing graph network with a Python loop over edges (the host-sync-per-edge habit).

    ``forward(x, edge_index)``: node features x (N, in_dim), edge_index (2, E) int64 of (source, destination)
    rows; returns (N, out_dim). Each layer: messages ``message[l](h[src])`` summed at ``dst``, then
    ``h = update[l](cat(h, agg))``; ``readout`` maps the last h to out_dim.
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int, n_layers: int = 2):
        super().__init__()
        dims = [in_dim] + [hidden] * n_layers
        self.message = nn.ModuleList([nn.Linear(dims[i], hidden) for i in range(n_layers)])
        self.update = nn.ModuleList(
            [nn.Sequential(nn.Linear(dims[i] + hidden, hidden), nn.ReLU()) for i in range(n_layers)]
        )
        self.readout = nn.Linear(hidden, out_dim)

    def forward(self, x, edge_index):
        h = x
        for message, update in zip(self.message, self.update, strict=True):
            agg = torch.zeros(h.shape[0], message.out_features, device=h.device, dtype=h.dtype)
            for e in range(edge_index.shape[1]):
                src, dst = edge_index[0, e].item(), edge_index[1, e].item()
                agg[dst] += message(h[src])
            h = update(torch.cat([h, agg], dim=-1))
        return self.readout(h)


def gnn_inputs(n_nodes: int, n_edges: int, in_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random node features x (n_nodes, in_dim) and edges edge_index (2, n_edges) int64 (repeats and self-loops
    allowed, as in a sampled graph)."""
    x = torch.randn(n_nodes, in_dim, device=device)
    edge_index = torch.randint(0, n_nodes, (2, n_edges), device=device)
    return x, edge_index


class EmbeddingLoopRecommender(nn.Module):
    """Click-through model with one embedding table per feature and pairwise interactions in Python loops.

    ``forward(features)``: features (B, F) int64, column i an id below ``cardinalities[i]``; returns (B,) logits.
    The MLP reads the F embeddings and their F (F - 1) / 2 pairwise dot products.
    """

    def __init__(self, cardinalities: list[int], dim: int = 16, hidden: int = 64):
        super().__init__()
        if not cardinalities or min(cardinalities) < 1:
            raise ValueError(f"cardinalities must be a non-empty list of positive sizes, got {cardinalities}")
        self.cardinalities = list(cardinalities)
        self.embeddings = nn.ModuleList([nn.Embedding(c, dim) for c in cardinalities])
        n = len(cardinalities)
        self.mlp = nn.Sequential(nn.Linear(n * dim + n * (n - 1) // 2, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, features):
        embs = []
        for i, emb in enumerate(self.embeddings):
            embs.append(emb(features[:, i]))
        interactions = []
        for i in range(len(embs)):
            for j in range(i + 1, len(embs)):
                interactions.append((embs[i] * embs[j]).sum(dim=1, keepdim=True))
        z = torch.cat(embs + interactions, dim=1)
        return self.mlp(z).squeeze(-1)


def recommender_inputs(batch: int, cardinalities: list[int], device=None) -> torch.Tensor:
    """Random features (batch, len(cardinalities)) int64, column i uniform below ``cardinalities[i]``."""
    columns = [torch.randint(0, c, (batch,), device=device) for c in cardinalities]
    return torch.stack(columns, dim=1)


def hf_llama(tiny: bool = False, device=None, dtype=None, seed: int = 0):
    """A Hugging Face ``LlamaForCausalLM`` built from a config with random weights (nothing downloaded).

    The full size is the assistant's goal model: 8 layers of d 2048, 32 query and 8 key/value heads, d_ff 8192, a
    Llama-3 vocabulary of 128256, RoPE theta 500000 (about 1.1B parameters). ``tiny`` is a 2-layer, d 64 model
    with a vocabulary of 4096 for CPU runs. Needs ``transformers``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                          rope_theta=500000.0)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
