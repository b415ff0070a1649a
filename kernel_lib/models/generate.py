"""Generating text with the course's GPT: greedy decoding with the static KV cache, the same decode step captured
in CUDA graphs, and the conversion to Hugging Face's ``LlamaForCausalLM`` to compare against its ``generate``.

Greedy decoding of a prompt (B, T0)::

    logits = forward_step(prompt, cache, 0)                 prefill: one pass over the prompt fills the cache
    repeat: token = argmax(logits[:, -1])                   (B,)
            logits = forward_step(token, cache, pos)        decode: one token against the cache, pos += 1

Without a cache every new token re-runs ``forward`` over the whole sequence (T0 + i tokens at step i): quadratic
work, but no new code path, hence the reference (``greedy(..., use_cache=False)``). With the cache a decode step
at batch 1 reads every weight once to compute a single row per matmul: it is memory-bound, and for a small
model its few hundred kernels are short enough that launching them from Python costs more than running them.
``GraphedDecoder`` removes that cost (Level 3): it captures one decode step in a ``torch.cuda.CUDAGraph`` and
replays it per token, so the host issues one launch per token instead of one per kernel. What a graph needs:

* static inputs: the token (B, 1) and the position (1,) live in tensors allocated once and rewritten in place
  before each replay (``copy_``, ``fill_``: device work, no host value read);
* static shapes: a step's shapes depend on kv_len, the cache positions attention reads, not on pos; kv_len is
  ``kv_bucket(pos + 1)``, a multiple of 64, so one graph serves 64 positions, captured when generation first
  reaches them (all graphs share one memory pool);
* no host synchronization inside: forward_step reads pos on the host only when no capture is under way.

The prefill runs eagerly: its length changes with each prompt, and it runs once per generation.

``to_hf_llama`` builds a ``LlamaForCausalLM`` from a config with the same sizes and copies the weights: both
models are pre-norm RMSNorm/SwiGLU decoders with rotate-half RoPE on q and k in the (B, H, T, hd) layout, no
biases and an untied head, so the weights map one to one with no permutation (tests/models/test_generate.py
checks the logits and the greedy tokens). It is the baseline of the capstone's decode benchmark: Hugging Face's
``generate`` with its static cache and automatic compile, on the same weights.
"""

from typing import Optional

import torch

from .gpt import GPT, KVCache, _unwrap, kv_bucket, naive_layout

__all__ = ["greedy", "GraphedDecoder", "to_hf_llama"]


def _check_prompt(prompt, max_new_tokens, max_len: int) -> tuple[int, int]:
    if not isinstance(prompt, torch.Tensor) or prompt.dtype != torch.int64 or prompt.dim() != 2:
        raise ValueError(
            f"prompt must be an int64 tensor of token ids (B, T0), got "
            f"{getattr(prompt, 'dtype', type(prompt).__name__)} {tuple(getattr(prompt, 'shape', ()))}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    B, T0 = prompt.shape
    if T0 < 1:
        raise ValueError("the prompt is empty: give at least one token per sequence")
    if T0 + max_new_tokens > max_len:
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) = {T0 + max_new_tokens} exceeds the "
            f"{max_len} positions available (the cache's max_len, at most the model's max_seq_len)"
        )
    return B, T0


@torch.no_grad()
def greedy(model: GPT, prompt: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
    """The prompt (B, T0) followed by ``max_new_tokens`` greedy tokens: (B, T0 + max_new_tokens) int64.

    ``use_cache``: prefill and one ``forward_step`` per token on a cache of exactly T0 + max_new_tokens positions
    (positions as Python ints: eager). False: ``model(tokens so far)`` at every step, the reference. ``model`` may
    be compiled (the uncached path then runs the compiled forward)."""
    gpt = _unwrap(model)
    B, T0 = _check_prompt(prompt, max_new_tokens, gpt.config.max_seq_len)
    out = prompt.new_empty(B, T0 + max_new_tokens)
    out[:, :T0] = prompt
    if use_cache:
        cache = gpt.init_cache(B, T0 + max_new_tokens)
        logits = gpt.forward_step(prompt, cache, 0)
    for i in range(max_new_tokens):
        pos = T0 + i
        if not use_cache:
            logits = model(out[:, :pos])
        out[:, pos] = logits[:, -1].argmax(dim=-1)
        if use_cache and i + 1 < max_new_tokens:  # the last token needs no logits after it
            logits = gpt.forward_step(out[:, pos : pos + 1], cache, pos)
    return out


class GraphedDecoder:
    """Greedy decoding for ``batch`` sequences of up to ``max_len`` tokens with the decode step in CUDA graphs.

    The module docstring describes the graphs. ``generate(prompt, max_new_tokens)`` returns the same tokens as
    ``greedy(model, prompt, max_new_tokens)`` (the same kernels in the same order, up to the attention reading a
    bucket of the cache instead of exactly pos + 1 positions). The cache, the static token and position and the
    graphs are kept between calls, so a second generation replays graphs captured by the first.

    On a CPU there are no graphs: the same step (tensor position, bucketed kv_len) runs eagerly, which is what
    the CPU tests check; ``uses_graphs`` says which. Capture needs a step without host synchronization: a
    mixture of experts in the naive or native version (expert group sizes read on the host) is refused on a GPU.
    """

    def __init__(self, model: GPT, batch: int, max_len: Optional[int] = None):
        self.model = _unwrap(model)
        self.cache: KVCache = self.model.init_cache(batch, max_len)
        device = self.cache.device
        self.uses_graphs = device.type == "cuda"
        config = self.model.config
        if self.uses_graphs and config.n_experts and config.impl != "kernel_lib":
            raise ValueError(
                f"the {config.impl} mixture of experts reads its group sizes on the host, which a CUDA graph "
                "cannot capture: use impl='kernel_lib' (grouped GEMMs, no sync) or a dense model"
            )
        self.token = torch.zeros(batch, 1, dtype=torch.int64, device=device)  # the step's static input
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # its position, data rather than a constant
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # kv_len -> (graph, logits)
        self._pool = None

    @torch.no_grad()
    def _capture(self, kv_len: int) -> None:
        # Warm up on a side stream first: Triton compiles and cuBLAS allocates its workspace on a first call,
        # neither allowed during capture. The warm-up writes the current token's k, v at the current position,
        # exactly what the step itself writes, so it changes nothing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model.forward_step(self.token, self.cache, self.pos, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one pool: the graphs never run concurrently
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward_step(self.token, self.cache, self.pos, kv_len)  # (B, 1, V), static
        self._graphs[kv_len] = (graph, logits)

    def _step(self, kv_len: int) -> torch.Tensor:
        """Logits (B, 1, V) of self.token at self.pos: a graph replay on a GPU, the eager step on a CPU."""
        if not self.uses_graphs:
            return self.model.forward_step(self.token, self.cache, self.pos, kv_len)
        if kv_len not in self._graphs:
            self._capture(kv_len)
        graph, logits = self._graphs[kv_len]
        graph.replay()
        return logits

    @torch.no_grad()
    def step(self, pos: int) -> torch.Tensor:
        """One decode step alone, as ``generate`` runs it: the logits (batch, 1, V) of the static token (the last
        one a step was fed) at position ``pos``, its key and value written into the cache there; for profiling."""
        if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos < self.cache.max_len:
            raise ValueError(f"pos must be an int in [0, {self.cache.max_len}), got {pos!r}")
        self.pos.fill_(pos)
        return self._step(kv_bucket(pos + 1, self.cache.max_len))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The prompt (batch, T0) followed by ``max_new_tokens`` greedy tokens, (batch, T0 + max_new_tokens)."""
        B, T0 = _check_prompt(prompt, max_new_tokens, self.cache.max_len)
        if B != self.cache.batch or prompt.device != self.cache.device:
            raise ValueError(
                f"prompt is (batch {B}, {prompt.device}), this decoder was built for (batch {self.cache.batch}, "
                f"{self.cache.device})"
            )
        out = prompt.new_empty(B, T0 + max_new_tokens)
        out[:, :T0] = prompt
        logits = self.model.forward_step(prompt, self.cache, 0)  # prefill, eager: its length varies
        for i in range(max_new_tokens):
            pos = T0 + i
            out[:, pos] = logits[:, -1].argmax(dim=-1)
            if i + 1 == max_new_tokens:
                break
            self.token.copy_(out[:, pos : pos + 1])  # device-side writes: the host never waits for the GPU
            self.pos.fill_(pos)
            logits = self._step(kv_bucket(pos + 1, self.cache.max_len))
        return out


_HF_NAMES = {  # naive-layout name within a block -> Hugging Face Llama's, within model.layers.i
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_HF_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm_f.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def to_hf_llama(model: GPT):
    """A ``transformers.LlamaForCausalLM`` with ``model``'s sizes and weights (any version; dense only), in its
    dtype, on its device, in eval mode. Config: n_heads and n_kv_heads, intermediate_size d_ff, SiLU,
    rms_norm_eps norm_eps, rope theta rope_base (default RoPE, no scaling), untied head, no biases, and no
    bos/eos/pad token (``generate`` then never stops early). Built from the config in the model's dtype, so its
    RoPE frequencies stay in float32 (casting a built model with ``.to(bfloat16)`` would round them too)."""
    import transformers

    gpt = _unwrap(model)
    c = gpt.config
    if c.n_experts:
        raise ValueError("Llama has a dense MLP: a model with n_experts > 0 does not convert")
    new_api = int(transformers.__version__.split(".")[0]) >= 5  # rope settings and dtype were renamed in v5
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base}} if new_api else {}
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **rope,
    )
    if not new_api:
        config.rope_theta = c.rope_base
    w = gpt.head.weight
    dtype_kw = {"dtype": w.dtype} if new_api else {"torch_dtype": w.dtype}
    hf = transformers.AutoModelForCausalLM.from_config(config, **dtype_kw).to(w.device)
    state = {}
    for name, tensor in naive_layout(gpt).items():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            state[f"model.layers.{i}.{_HF_NAMES[rest]}"] = tensor
        else:
            state[_HF_TOP[name]] = tensor
    hf.load_state_dict(state, strict=True)
    return hf.eval()
