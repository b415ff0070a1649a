"""The automatic fixes: each takes a model (a copy the assistant made) and a finding, and returns the rewritten model.

A rewrite swaps a module for one built on kernel_lib, keeping the original's parameters (the same ``Parameter``
objects under the same names, so gradients compare by name and an optimizer keeps working), or wraps the model
(autocast, torch.compile, a fused loss). It only relies on what the finding's data flow showed: which Linear is the
gate, which the up projection, which mask was causal. The assistant then proves each rewrite: it compares the new
model with the original in float64, forward and backward, and keeps it only if it passes and is faster.

Rewrites and the finding kinds they fix:

===========================  ===========================  ===========================================================
technique                    kind                         what it does
===========================  ===========================  ===========================================================
``fused_norm``               ``manual_norm``              the module becomes ``kernel_lib.RMSNorm`` / ``LayerNorm``
``fused_gated_mlp``          ``unfused_activation``       ``kernel_lib.swiglu_linear`` (no product kept) / ``geglu``
``flash_attention``          ``manual_attention``         fused QKV GEMM, RoPE kernel, ``kernel_lib.flash_attention``
``grouped_moe``              ``expert_loop``              ``kernel_lib.moe``: grouped GEMMs, no host sync
``fused_linear_cross_entropy`` ``unfused_cross_entropy``  ``kernel_lib.linear_cross_entropy`` on the last hidden state
``bf16_autocast``            ``fp32_compute``             forward under ``torch.autocast(dtype=torch.bfloat16)``
``compile``                  ``not_compiled``             ``torch.compile(model)``
``cuda_graphs``              ``small_launches``           ``torch.compile(model, mode="reduce-overhead")`` (CUDA)
===========================  ===========================  ===========================================================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..ops.attention import MAX_HEAD_DIM
from ..ops.rope import rope_cos_sin
from .findings import Finding


class RewriteError(Exception):
    """The rewrite does not apply to this model (the reason is shown in the report)."""


def get_module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    return root.get_submodule(path) if path else root


def set_module(root: torch.nn.Module, path: str, new: torch.nn.Module) -> None:
    if not path:
        raise RewriteError("cannot replace the model itself in place")
    parent, _, name = path.rpartition(".")
    setattr(get_module(root, parent), name, new)


def _rel(path: str, parent: str) -> str:
    if parent and not path.startswith(parent + "."):
        raise RewriteError(f"{path} is not inside {parent}")
    return path[len(parent) + 1 :] if parent else path


def _linear(module: torch.nn.Module, rel: str) -> torch.nn.Linear:
    lin = module.get_submodule(rel)
    if not isinstance(lin, torch.nn.Linear):
        raise RewriteError(f"{rel} is a {type(lin).__name__}, not an nn.Linear")
    return lin


def _cat_linear(x: torch.Tensor, linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Several projections of x as one GEMM (weights concatenated per call: their gradients split back)."""
    weight = torch.cat([lin.weight for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [
                b if b is not None else lin.weight.new_zeros(lin.out_features)
                for b, lin in zip(biases, linears, strict=True)
            ]
        )
    )
    return F.linear(x, weight, bias)


def _compiling() -> bool:
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling()) if is_compiling is not None else torch._dynamo.is_compiling()


def _kernels_apply(t: torch.Tensor, op: str) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under the interpreter; when it does not, the call is
    counted in ``ops._utils.REFERENCE_RUNS`` (the assistant credits no speedup to a kernel that never ran)."""
    if t.is_cuda or ops._utils.is_interpreting():
        return True
    _fell_back(op)
    return False


def _fell_back(op: str) -> None:
    if not torch.compiler.is_compiling():
        ops._utils.REFERENCE_RUNS[op] += 1


# --------------------------------------------------------------------------------------------------
# Module rewrites
# --------------------------------------------------------------------------------------------------
def fused_norm(model: torch.nn.Module, finding: Finding) -> list[str]:
    done = []
    for path in finding.modules:
        item = finding.data[path]
        old = get_module(model, path)
        weight = getattr(old, "weight", None)
        if not item["has_weight"] or not isinstance(weight, torch.nn.Parameter):
            raise RewriteError(f"{path} has no 1-D weight Parameter to carry over")
        eps = item["eps"] if item["eps"] is not None else 1e-6
        if item["norm"] == "rms":
            new = ops.norms.RMSNorm(weight.shape[0], eps=eps, device=weight.device, dtype=weight.dtype)
        else:
            bias = getattr(old, "bias", None)
            new = ops.norms.LayerNorm(
                weight.shape[0], eps=eps, bias=bias is not None, device=weight.device, dtype=weight.dtype
            )
            if bias is not None:
                new.bias = bias
        new.weight = weight  # the same Parameter: the optimizer's state and the gradient's name carry over
        set_module(model, path, new)
        done.append(path)
    return done


class FusedGatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) with one fused activation kernel; with SiLU, fused with the down projection
    (``swiglu_linear``: the backward recomputes the product instead of keeping it). The original Linear modules
    stay as children under their own names."""

    def __init__(self, names: dict[str, str], linears: dict[str, torch.nn.Linear], activation: str, approximate: str):
        super().__init__()
        self.names, self.activation, self.approximate = names, activation, approximate
        for rel, lin in linears.items():
            self.add_module(rel.replace(".", "_"), lin)

    def _get(self, role: str) -> torch.nn.Linear:
        return getattr(self, self.names[role].replace(".", "_"))

    def forward(self, x):
        # two GEMMs, not one on weights concatenated per call: that copy (2 d_ff x d per layer) would be kept for the
        # backward, a cost the original model does not have
        gate, up = self._get("gate")(x), self._get("up")(x)
        down = self._get("down")
        if not _kernels_apply(x, "swiglu"):
            h = (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate=self.approximate)) * up
        elif self.activation == "silu" and down.weight.dtype == gate.dtype:
            # the activation and the down projection as one op: its backward recomputes the product instead of
            # keeping it (d_ff elements per token less, the largest saved tensor of an MLP)
            y = ops.swiglu.swiglu_linear(gate, up, down.weight)
            return y if down.bias is None else y + down.bias
        elif self.activation == "silu":
            h = ops.swiglu.swiglu(gate, up)
        else:
            h = ops.swiglu.geglu(gate, up, approximate=self.approximate)
        return down(h)


def fused_gated_mlp(model: torch.nn.Module, finding: Finding) -> list[str]:
    done = []
    for path in finding.modules:
        item = finding.data[path]
        if item["down"] is None:
            raise RewriteError(f"{path}: the product does not feed one Linear (no down projection to keep)")
        old = get_module(model, path)
        names = {role: _rel(item[role], path) for role in ("gate", "up", "down")}
        linears = {rel: _linear(old, rel) for rel in names.values()}
        if linears[names["gate"]].weight.shape != linears[names["up"]].weight.shape:
            raise RewriteError(f"{path}: gate and up projections differ in shape")
        set_module(model, path, FusedGatedMLP(names, linears, item["activation"], item["approximate"]))
        done.append(path)
    return done


class FusedSelfAttention(torch.nn.Module):
    """Self-attention of x (B, T, d): one QKV GEMM, RoPE (rotate-half) if the original applied it, causal flash
    attention (kernel_lib on CUDA in float16/bfloat16, else SDPA), the output projection; the original Linear
    modules stay as children under their own names."""

    def __init__(self, names, linears, n_heads, n_kv_heads, head_dim, causal, rope_base):
        super().__init__()
        self.names, self.n_heads, self.n_kv_heads, self.head_dim = names, n_heads, n_kv_heads, head_dim
        self.causal, self.rope_base = causal, rope_base
        for rel, lin in linears.items():
            self.add_module(rel.replace(".", "_"), lin)
        self._tables: dict = {}

    def _get(self, role: str) -> torch.nn.Linear:
        return getattr(self, self.names[role].replace(".", "_"))

    def _cos_sin(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if _compiling():  # a table cached from inside a CUDA graph would be overwritten by the next replay
            return rope_cos_sin(n, self.head_dim, self.rope_base, device=device)
        key = (n, str(device))
        if key not in self._tables:  # eager: built once per length (the naive code rebuilt it every call)
            self._tables[key] = rope_cos_sin(n, self.head_dim, self.rope_base, device=device)
        return self._tables[key]

    def forward(self, x):
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if "qkv" in self.names:
            qkv = self._get("qkv")(x)
        else:
            qkv = _cat_linear(x, [self._get("q"), self._get("k"), self._get("v")])
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
        # float32 or wide heads take SDPA by design (a fused kernel too); only a CPU without the interpreter counts
        # as the kernel not running
        fast = _kernels_apply(x, "flash_attention") and x.dtype in (torch.float16, torch.bfloat16) and D <= MAX_HEAD_DIM
        if self.rope_base is not None:
            cos, sin = self._cos_sin(T, x.device)
            rot = ops.rope.rope if _kernels_apply(x, "rope") else ops.rope.rope_ref
            q, k = rot(q, cos, sin), rot(k, cos, sin)
        if fast:
            out = ops.attention.flash_attention(q, k, v, causal=self.causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=Hkv != H)
        return self._get("o")(out.transpose(1, 2).reshape(B, T, H * D))


def _rope_base(module: torch.nn.Module) -> float:
    for owner in (module, getattr(module, "config", None)):
        for attr in ("rope_base", "rope_theta", "base", "theta"):
            value = getattr(owner, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
    return 10000.0


def flash_attention(model: torch.nn.Module, finding: Finding) -> list[str]:
    done = []
    for path in finding.modules:
        item = finding.data[path]
        old = get_module(model, path)
        q, k, v, o = item["q"], item["k"], item["v"], item["o"]
        if len(o) != 1:
            raise RewriteError(f"{path}: the attention output does not feed exactly one Linear")
        if len(q) == 1 and q == k == v:
            names = {"qkv": _rel(q[0], path), "o": _rel(o[0], path)}
        elif len(q) == len(k) == len(v) == 1 and len({q[0], k[0], v[0]}) == 3:
            names = {"q": _rel(q[0], path), "k": _rel(k[0], path), "v": _rel(v[0], path), "o": _rel(o[0], path)}
        else:
            raise RewriteError(f"{path}: could not tell the q, k and v projections apart ({q}, {k}, {v})")
        linears = {rel: _linear(old, rel) for rel in names.values()}
        H = item["heads"]
        out_q = linears[names["q"]].out_features if "q" in names else None
        width = linears[names["o"]].in_features
        if width % H:
            raise RewriteError(f"{path}: {width} features do not split into {H} heads")
        D = width // H
        if "qkv" in names:
            n_kv = (linears[names["qkv"]].out_features - width) // (2 * D)
        else:
            if out_q != width:
                raise RewriteError(f"{path}: q projects to {out_q} features, the output projection reads {width}")
            n_kv = linears[names["k"]].out_features // D
        if item["causal"] is None:
            raise RewriteError(f"{path}: the mask is neither causal nor absent in a way the trace could tell")
        base = _rope_base(old) if item["rope"] else None
        set_module(model, path, FusedSelfAttention(names, linears, H, n_kv, D, item["causal"], base))
        done.append(path)
    return done


class GroupedMoE(torch.nn.Module):
    """A loop-over-experts MoE as kernel_lib.moe: tokens sorted by expert and three grouped GEMMs. The router and
    the experts' Linear modules stay as children under their own names; their weights are stacked per call."""

    def __init__(self, router_name, router, experts_name, experts, roles, top_k):
        super().__init__()
        self.router_name, self.experts_name, self.roles, self.top_k = router_name, experts_name, roles, top_k
        self.add_module(router_name, router)
        self.add_module(experts_name, experts)

    def forward(self, x):
        experts = getattr(self, self.experts_name)
        stack = {
            role: torch.stack([e.get_submodule(name).weight.t() for e in experts]).contiguous()
            for role, name in self.roles.items()
        }  # (E, in, out): grouped_mm's layout
        router = getattr(self, self.router_name).weight
        fn = ops.moe.moe if _kernels_apply(x, "moe") else ops.moe.moe_ref
        y, _aux = fn(x, router, stack["gate"], stack["up"], stack["down"], self.top_k, aux_loss_coef=0.0)
        return y


def _expert_roles(expert: torch.nn.Module) -> dict[str, str]:
    linears = {n: m for n, m in expert.named_modules() if isinstance(m, torch.nn.Linear)}
    roles = {}
    for role, words in (("gate", ("gate", "w1")), ("up", ("up", "w3")), ("down", ("down", "w2"))):
        match = [n for n in linears if any(w in n.rpartition(".")[2] for w in words)]
        if len(match) != 1:
            raise RewriteError(f"cannot tell the experts' {role} projection ({list(linears)})")
        roles[role] = match[0]
    return roles


def grouped_moe(model: torch.nn.Module, finding: Finding) -> list[str]:
    done = []
    for path in finding.modules:
        item = finding.data[path]
        old = get_module(model, path)
        if item.get("router") is None or not item.get("top_k"):
            raise RewriteError(f"{path}: no router Linear with one output per expert, or no top_k attribute")
        experts_name, experts = next((n, m) for n, m in old.named_children() if isinstance(m, torch.nn.ModuleList))
        roles = _expert_roles(experts[0])
        if any(getattr(_linear(e, r), "bias", None) is not None for e in experts for r in roles.values()):
            raise RewriteError(f"{path}: experts with biases are outside kernel_lib.moe")
        router = _linear(old, item["router"])
        set_module(model, path, GroupedMoE(item["router"], router, experts_name, experts, roles, item["top_k"]))
        done.append(path)
    return done


# --------------------------------------------------------------------------------------------------
# Model wrappers
# --------------------------------------------------------------------------------------------------
class FusedLossLM(torch.nn.Module):
    """A causal LM whose loss is ``kernel_lib.linear_cross_entropy`` on the last hidden state: the logits are
    never written. Without targets it calls the model unchanged (logits for generation).

    Two model protocols: ``forward_hidden(idx)`` plus ``forward(idx, targets)`` (the course's GPT), and a Hugging
    Face ``*ForCausalLM`` (``get_decoder()``, ``lm_head``; labels shifted by one inside, as its own loss does).
    """

    def __init__(self, model: torch.nn.Module, head: str, protocol: str):
        super().__init__()
        self.model, self.head, self.protocol = model, head, protocol

    def forward(self, *args, **kwargs):
        if self.protocol == "forward_hidden":
            targets = kwargs.pop("targets", args[1] if len(args) > 1 else None)
            if targets is None:
                return self.model(*args, **kwargs)
            h = self.model.forward_hidden(args[0] if args else kwargs.pop("idx"))
            return self._loss(h, targets)
        labels = kwargs.get("labels")
        if labels is None:
            return self.model(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs = {k: v for k, v in kwargs.items() if k not in ("labels", "num_items_in_batch")}
        h = self.model.get_decoder()(*args, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=self._loss(h[:, :-1], labels[:, 1:]))

    def _loss(self, h, targets):
        weight = self.model.get_submodule(self.head).weight
        h2 = h.reshape(-1, h.shape[-1])
        t = targets.reshape(-1)
        if h2.dtype != weight.dtype:  # under autocast the hidden state may be float32 while the head is not
            h2 = h2.to(weight.dtype)
        return ops.linear_cross_entropy.linear_cross_entropy(h2.contiguous(), weight, t.contiguous())


def fused_linear_cross_entropy(model: torch.nn.Module, finding: Finding) -> torch.nn.Module:
    item = next(iter(finding.data.values()))
    if not item["protocol"]:
        raise RewriteError(
            "the loss is computed inside forward from full logits, and the model offers no way to get the last "
            "hidden state (forward_hidden, or a Hugging Face CausalLM): call kernel_lib.linear_cross_entropy(h, "
            f"{item['head']}.weight, targets) there"
        )
    return FusedLossLM(model, item["head"], item["protocol"])


class Autocast(torch.nn.Module):
    """The model's forward under ``torch.autocast``: matmuls in bfloat16, reductions kept in float32."""

    def __init__(self, model: torch.nn.Module, dtype=torch.bfloat16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args, **kwargs):
        param = next(self.model.parameters())
        if param.dtype == torch.float64:  # a float64 copy is the validation's reference: keep it exact
            return self.model(*args, **kwargs)
        with torch.autocast(device_type=param.device.type, dtype=self.dtype):
            return self.model(*args, **kwargs)


def bf16_autocast(model: torch.nn.Module, finding: Finding) -> torch.nn.Module:
    return Autocast(model)


def compile_model(model: torch.nn.Module, finding: Finding) -> torch.nn.Module:
    return torch.compile(model)


def cuda_graphs(model: torch.nn.Module, finding: Finding) -> torch.nn.Module:
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise RewriteError("CUDA graphs need a CUDA device")
    return torch.compile(model, mode="reduce-overhead")


# technique -> (function, whether it replaces modules in place (list of paths) or returns a new model, order)
REWRITES = {
    "fused_norm": (fused_norm, "in_place", 0),
    "fused_gated_mlp": (fused_gated_mlp, "in_place", 0),
    "flash_attention": (flash_attention, "in_place", 0),
    "grouped_moe": (grouped_moe, "in_place", 0),
    "fused_linear_cross_entropy": (fused_linear_cross_entropy, "wrap", 1),
    "bf16_autocast": (bf16_autocast, "wrap", 2),
    "compile": (compile_model, "wrap", 3),
    "cuda_graphs": (cuda_graphs, "wrap", 3),
}


def apply(model: torch.nn.Module, finding: Finding) -> tuple[torch.nn.Module, str]:
    """Apply the finding's rewrite to ``model`` (modified in place where it swaps modules); returns the model to
    use and a note. Raises RewriteError when it does not apply."""
    technique = finding.technique
    if technique not in REWRITES:
        raise RewriteError(f"no automatic rewrite for {finding.kind}: {finding.fix}")
    fn, how, _ = REWRITES[technique]
    if how == "in_place":
        done = fn(model, finding)
        return model, f"{len(done)} module(s) replaced"
    return fn(model, finding), "wrapped"
