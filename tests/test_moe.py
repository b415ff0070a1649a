"""kernel_lib.moe against the per-expert loop in float64: output, auxiliary loss and the gradient of every
parameter, router included."""

import pytest
import torch

from kernel_lib.ops.moe import MoE, moe_ref
from kernel_lib.validate import check, report


def _loss_and_grads(forward, x, params, upstream):
    """y, aux and the gradients of x and every parameter of loss = <y, upstream> + aux."""
    y, aux = forward(x, params)
    loss = (y.to(upstream.dtype) * upstream).sum() + aux.to(upstream.dtype)
    return y, aux, torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize(
    "n_experts, top_k, z_loss_coef",
    [(1, 1, 0.0), (4, 1, 0.0), (8, 2, 1e-3), (16, 4, 0.0)],  # one expert; top-1; top-2 with z-loss; fine-grained
)
def test_module_matches_the_loop(device, n_experts, top_k, z_loss_coef):
    torch.manual_seed(n_experts * 10 + top_k)
    layer = MoE(32, 48, n_experts, top_k, aux_loss_coef=0.01, z_loss_coef=z_loss_coef, device=device)
    x = torch.randn(2, 9, 32, device=device, requires_grad=True)  # batched (B, T, d)
    params = [layer.router.weight, layer.w_gate, layer.w_up, layer.w_down]
    upstream = torch.randn(2, 9, 32, device=device, dtype=torch.float64)

    def reference(x, p):
        return moe_ref(x, *p, top_k, 0.01, z_loss_coef)

    y, aux, grads = _loss_and_grads(lambda x, p: layer(x), x, params, upstream)  # the module's own parameters
    base_y, base_aux, base_grads = _loss_and_grads(reference, x, params, upstream)  # PyTorch, float32
    leaves = [t.detach().double().requires_grad_() for t in (x, *params)]
    want_y, want_aux, want_grads = _loss_and_grads(reference, leaves[0], leaves[1:], upstream)  # float64
    names = ["dx", "d router", "d w_gate", "d w_up", "d w_down"]
    checks = [check(y, want_y, base_y, name="y", atol=1e-5), check(aux, want_aux, base_aux, name="aux", atol=1e-7)]
    for got, want, base, name in zip(grads, want_grads, base_grads, names, strict=True):
        checks.append(check(got, want, base, name=name, atol=1e-5))
    assert all(c.ok for c in checks), report(checks)


def test_every_token_to_one_expert(device):
    layer = MoE(16, 24, 4, 1, device=device)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 5.0  # expert 2 wins for every positive-sum token
    x = torch.rand(7, 16, device=device) + 0.1
    y, _ = layer(x)
    want, _ = moe_ref(x, layer.router.weight, layer.w_gate, layer.w_up, layer.w_down, 1)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_load_balancing_loss_value():
    # Uniform router: every probability 1/E and every expert gets 1/E of the assignments: aux = coef * E * E / E^2.
    layer = MoE(8, 8, 4, 2, aux_loss_coef=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
    _, aux = layer(torch.randn(16, 8))
    assert aux.item() == pytest.approx(0.5)


def test_compiles_without_graph_break(device):
    layer = MoE(16, 24, 4, 2, device=device)
    x = torch.randn(6, 16, device=device, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)
    y, aux = compiled(x)
    (y.sum() + aux).backward()
    want, _ = moe_ref(x.detach(), layer.router.weight, layer.w_gate, layer.w_up, layer.w_down, 2)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert layer.w_down.grad is not None


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="top_k must be between 1"):
        MoE(8, 8, 4, 5)
    with pytest.raises(ValueError, match="shapes do not fit"):
        MoE(8, 8, 4, 2)(torch.randn(3, 9))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "tokens, k, width",
    [
        (9, 2, 40),  # top-2, a width below one column block
        (5, 3, 1500),  # k not a power of two, a width past one column block (1024)
        (1, 1, 7),  # one token, one slot
    ],
)
def test_permutation_kernels(device, dtype, atol, tokens, k, width):
    """The dispatch (gather by expert) and the weighted combine against plain indexing in float64, with gradients."""
    from kernel_lib.ops.moe import _Combine, _Dispatch

    torch.manual_seed(tokens * k)
    order = torch.randperm(tokens * k, device=device)  # any permutation stands in for the sort by expert
    token = order // k
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=device)
    pos = pos.view(tokens, k)
    x = torch.randn(tokens, width, device=device).to(dtype)
    out = torch.randn(tokens * k, width, device=device).to(dtype)
    weight = torch.rand(tokens, k, device=device)
    dxs, dy = torch.randn(tokens * k, width, device=device), torch.randn(tokens, width, device=device)

    def run(x, out, weight, kernel):
        x, out, weight = (t.detach().requires_grad_() for t in (x, out, weight))
        if kernel:
            xs, y = _Dispatch.apply(x, token, pos), _Combine.apply(out, weight, pos, token, order)
        else:  # plain indexing, summed in float32 (float64 for float64): the definition
            xs = x[token]
            acc = torch.promote_types(out.dtype, torch.float32)
            terms = out.to(acc) * weight.reshape(-1)[order, None].to(acc)
            y = torch.zeros(x.shape, device=device, dtype=acc).index_add(0, token, terms).to(x.dtype)
        (xs * dxs.to(xs.dtype)).sum().backward()
        (y * dy.to(y.dtype)).sum().backward()
        return xs, y, x.grad, out.grad, weight.grad

    names = ["xs", "y", "dx", "dout", "dweight"]
    got = run(x, out, weight, kernel=True)
    want = run(x.double(), out.double(), weight.double(), kernel=False)
    base = run(x, out, weight, kernel=False)  # PyTorch in the test's dtype
    checks = [check(g, w, b, name=n, atol=atol) for g, w, b, n in zip(got, want, base, names, strict=True)]
    assert all(c.ok for c in checks), report(checks)
