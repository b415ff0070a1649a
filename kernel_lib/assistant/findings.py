"""What the assistant can find: one table of finding kinds, and the record of one finding.

Each kind has a stable name (the ``kind`` of a :class:`Finding`, the key in JSON reports), the evidence it comes
from, and the course's fix. ``rewrite`` names the automatic rewrite in :mod:`kernel_lib.assistant.rewrites`
("" when the fix needs a person: the report then says what to change and where).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Kind:
    name: str
    what: str  # what the finding means, one line
    evidence: str  # where it comes from
    fix: str  # the course's fix
    rewrite: str  # the automatic rewrite's technique name, "" for none
    chapter: str  # where the course explains it


KINDS: dict[str, Kind] = {
    k.name: k
    for k in [
        Kind("graph_break", "torch.compile splits the forward into several graphs",
             "torch._dynamo.explain: break reasons with their source lines",
             "remove the Python the compiler cannot trace (data-dependent branches, prints, unsupported calls)",
             "", "Level 2"),
        Kind("recompile", "torch.compile compiles the same code again on later calls with the same inputs",
             "a counting backend over three identical calls; Dynamo's guard failures name the reason",
             "keep Python state that changes per call (counters, lists) out of forward, or mark it dynamic",
             "", "Level 2"),
        Kind("host_sync", "the forward waits for the GPU: .item(), .tolist(), nonzero, printing a tensor",
             "the recorded PyTorch calls, with their source lines",
             "keep values on the device (torch.where, masks, index tensors); move prints out of forward",
             "", "Level 1"),
        Kind("python_loop", "a Python loop issues the same small operations once per head, token, edge or feature",
             "loops in forward's source whose body ran many recorded calls",
             "one batched tensor operation: reshape heads into a dimension, index_add / scatter over edges, "
             "one embedding table with offsets", "", "Level 1"),
        Kind("separate_qkv", "three projections of the same input run as three matmuls",
             "three Linear calls on one tensor in the recorded data flow",
             "one fused projection (one GEMM): the flash_attention rewrite fuses it in the attention modules it "
             "replaces; elsewhere concatenate the weights into one Linear", "", "Level 1"),
        Kind("manual_attention", "attention written as matmul, mask, softmax, matmul: the scores go through memory",
             "a softmax between two matmuls in the recorded data flow",
             "F.scaled_dot_product_attention or kernel_lib.flash_attention", "flash_attention", "Levels 1 and 4"),
        Kind("manual_norm", "RMSNorm or LayerNorm written out: several passes over the activations",
             "rsqrt of a mean of squares (or of a variance) in the recorded data flow",
             "kernel_lib.RMSNorm / kernel_lib.LayerNorm (one pass forward, one backward)", "fused_norm", "Level 4"),
        Kind("unfused_activation", "silu(a) * b or gelu(a) * b as separate kernels, each output kept for the backward",
             "an activation whose output is multiplied by another projection of the same input",
             "kernel_lib.swiglu_linear (with the down projection; the product is recomputed, not kept) / "
             "kernel_lib.geglu", "fused_gated_mlp", "Level 4"),
        Kind("unfused_cross_entropy", "a large-vocabulary head writes full logits, then cross-entropy reads them",
             "a Linear with many outputs feeding cross_entropy; the logits' bytes",
             "kernel_lib.linear_cross_entropy (the logits never reach memory)", "fused_linear_cross_entropy",
             "Level 4"),
        Kind("expert_loop", "Mixture-of-Experts computed by a Python loop over experts",
             "a loop over experts in forward's source, nonzero calls in the recorded data flow",
             "kernel_lib.MoE (tokens sorted by expert, grouped GEMMs, no host sync)", "grouped_moe", "Level 4"),
        Kind("fp32_compute", "matmuls run in float32 where bfloat16 autocast keeps the result within tolerance",
             "dtypes of the recorded matmuls; the float64 comparison of an autocast run",
             "torch.autocast(dtype=torch.bfloat16)", "bf16_autocast", "Level 1"),
        Kind("small_launches", "many small kernels per step: the GPU waits for the CPU to launch them",
             "the profiler's kernel count and device-busy time (recorded PyTorch calls without a GPU)",
             "CUDA graphs: torch.compile(mode='reduce-overhead')", "cuda_graphs", "Level 3"),
        Kind("not_compiled", "the model runs eagerly: one kernel per PyTorch call, no fusion",
             "the model is not a torch.compile result", "torch.compile", "compile", "Level 2"),
    ]
}  # fmt: skip


@dataclass
class Finding:
    """One thing found, where, and why the assistant believes it."""

    kind: str  # a key of KINDS
    location: str  # module path and source line, e.g. "blocks.0.attn (model.py:41)"
    evidence: str  # what was measured or seen
    modules: list[str] = field(default_factory=list)  # every module path it applies to
    count: int = 1  # how many places
    data: dict = field(default_factory=dict, repr=False)  # what a rewrite needs (roles of submodules ...)
    advice: str = ""  # a fix more specific than the kind's, when the evidence says more

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def fix(self) -> str:
        return self.advice or KINDS[self.kind].fix

    @property
    def technique(self) -> str:
        """The automatic rewrite's name, or "" when the fix is left to a person."""
        return KINDS[self.kind].rewrite

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("data")
        out.pop("advice")
        out["fix"] = self.fix
        return out


def kinds_table():
    """The table of kinds as a DataFrame (the documentation's table comes from here)."""
    import pandas as pd

    return pd.DataFrame([asdict(k) for k in KINDS.values()]).set_index("name")
