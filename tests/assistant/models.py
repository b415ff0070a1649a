"""Small models for the assistant's tests, each showing one habit a finding names (and one clean model)."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class ManualRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6, used_eps=None):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.eps = eps
        self.used_eps = eps if used_eps is None else used_eps  # a module whose attribute lies about its eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.used_eps) * self.weight


class ManualLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d)), eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias


class ManualAttention(nn.Module):
    def __init__(self, d, n_heads, causal=True):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.n_heads, self.causal = n_heads, causal

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.n_heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if self.causal:
            att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1), float("-inf"))
        att = torch.softmax(att, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, C))


class HeadLoopAttention(ManualAttention):
    """One head at a time: the loop the Level 1 notebook removes."""

    def forward(self, x):
        B, T, C = x.shape
        D = C // self.n_heads
        q, k, v = self.q(x), self.k(x), self.v(x)
        outs = []
        for h in range(self.n_heads):
            s = slice(h * D, (h + 1) * D)
            att = torch.softmax(q[..., s] @ k[..., s].transpose(-2, -1) / math.sqrt(D), dim=-1)
            outs.append(att @ v[..., s])
        return self.o(torch.cat(outs, dim=-1))


class GatedMLP(nn.Module):
    def __init__(self, d, hidden, act="silu"):
        super().__init__()
        self.gate, self.up, self.down = (
            nn.Linear(d, hidden, bias=False),
            nn.Linear(d, hidden, bias=False),
            nn.Linear(hidden, d, bias=False),
        )
        self.act = act

    def forward(self, x):
        g = self.gate(x)
        a = F.silu(g) if self.act == "silu" else F.gelu(g, approximate=self.act)
        return self.down(a * self.up(x))


class LMHeadLoss(nn.Module):
    """A tiny LM with the course's protocol: forward_hidden, and forward(idx, targets) -> loss."""

    def __init__(self, vocab=5000, d=32):
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(vocab, d), nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward_hidden(self, idx):
        return self.norm(self.embed(idx))

    def forward(self, idx, targets=None):
        logits = self.head(self.forward_hidden(idx))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class LossWithoutProtocol(LMHeadLoss):
    """The same loss, but no way to reach the hidden state: the fused loss cannot be applied automatically."""

    forward_hidden = None

    def forward(self, idx, targets):
        logits = self.head(self.norm(self.embed(idx)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class SyncsAndPrints(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        y = self.lin(x)
        if y.abs().max().item() > 1e6:  # a data-dependent branch: a host sync and a graph break
            y = y / 2
        return y


class StepCounter(nn.Module):
    """Python state that changes every call: Dynamo recompiles on each new value."""

    def __init__(self, d=16):
        super().__init__()
        self.lin, self.calls = nn.Linear(d, d), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


class Clean(nn.Module):
    """Written the way the course recommends: nothing to report beyond compilation."""

    def __init__(self, d=32, n_heads=4):
        super().__init__()
        self.norm, self.qkv, self.o, self.n_heads = (
            nn.LayerNorm(d),
            nn.Linear(d, 3 * d, bias=False),
            nn.Linear(d, d, bias=False),
            n_heads,
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, C))


class Wrap(nn.Module):
    """Puts a component at a module path (rewrites replace submodules, never the root)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)
