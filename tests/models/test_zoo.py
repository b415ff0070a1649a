"""kernel_lib.models.zoo: the loop-written models run forward and backward, and compute what their vectorized
forms compute (a gather, one matmul and ``index_add_`` for the GNN; stacked embeddings and one batched matmul
for the recommender), output and every parameter's gradient."""

import pytest
import torch

from kernel_lib.models import EdgeLoopGNN, EmbeddingLoopRecommender, gnn_inputs, recommender_inputs


def _grads(model, out, upstream) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out.backward(upstream)
    # zeros where None: with no edges the loop never calls the message layer, the vectorized form calls it on none
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def gnn_vectorized(model: EdgeLoopGNN, x, edge_index):
    """The same layers with the edge loop replaced by one gather, one matmul and one index_add_."""
    src, dst = edge_index
    h = x
    for message, update in zip(model.message, model.update, strict=True):
        agg = torch.zeros(h.shape[0], message.out_features, device=h.device).index_add_(0, dst, message(h[src]))
        h = update(torch.cat([h, agg], dim=-1))
    return model.readout(h)


def recommender_vectorized(model: EmbeddingLoopRecommender, features):
    """All pairwise dot products from one batched matmul of the stacked embeddings, upper triangle row by row
    (the loop's order: (0, 1), (0, 2), ... (1, 2), ...)."""
    embs = torch.stack([emb(features[:, i]) for i, emb in enumerate(model.embeddings)], dim=1)  # (B, F, dim)
    n = embs.shape[1]
    i, j = torch.triu_indices(n, n, offset=1, device=features.device)
    dots = (embs @ embs.transpose(1, 2))[:, i, j]  # (B, F (F - 1) / 2)
    return model.mlp(torch.cat([embs.flatten(1), dots], dim=1)).squeeze(-1)


@pytest.mark.parametrize(
    "n_nodes, n_edges, n_layers",
    [
        (12, 40, 2),  # several edges into most nodes
        (7, 20, 3),  # deeper: hidden -> hidden layers
        (5, 0, 1),  # no edges: every aggregate stays zero
        (1, 3, 2),  # one node: self-loops only, the same edge repeated
    ],
    ids=str,
)
def test_gnn_matches_the_vectorized_form(device, n_nodes, n_edges, n_layers):
    model = EdgeLoopGNN(in_dim=6, hidden=16, out_dim=3, n_layers=n_layers).to(device)
    x, edge_index = gnn_inputs(n_nodes, n_edges, 6, device=device)
    assert x.shape == (n_nodes, 6) and edge_index.shape == (2, n_edges) and edge_index.dtype == torch.int64
    out = model(x, edge_index)
    assert out.shape == (n_nodes, 3)
    want = gnn_vectorized(model, x, edge_index)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out)
    got_grads, want_grads = _grads(model, out, upstream), _grads(model, want, upstream)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "cardinalities, batch",
    [
        ([10, 7, 3, 25], 32),  # a few features of different sizes
        ([5], 4),  # one feature: no pairs at all
        ([2, 2], 1),  # one pair, one row
    ],
    ids=str,
)
def test_recommender_matches_the_vectorized_form(device, cardinalities, batch):
    model = EmbeddingLoopRecommender(cardinalities, dim=8, hidden=16).to(device)
    features = recommender_inputs(batch, cardinalities, device=device)
    assert features.shape == (batch, len(cardinalities)) and features.dtype == torch.int64
    assert all(int(features[:, i].max()) < c for i, c in enumerate(cardinalities))
    out = model(features)
    assert out.shape == (batch,)
    want = recommender_vectorized(model, features)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(out)
    got_grads, want_grads = _grads(model, out, upstream), _grads(model, want, upstream)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("cardinalities", [[], [4, 0]], ids=["no features", "an empty table"])
def test_recommender_bad_cardinalities_are_named(cardinalities):
    with pytest.raises(ValueError, match="cardinalities must be a non-empty list of positive sizes"):
        EmbeddingLoopRecommender(cardinalities)
