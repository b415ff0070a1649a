"""Each public kernel file, copied with exactly the companions kernel_lib.ops lists, works in an empty folder.

Readers copy kernel files into their projects; this checks the promise the package docstring makes. Each case
runs in a fresh Python process (the copies register custom ops under the same names as kernel_lib's), imports
the copied file as part of a package of another name, and runs a forward and backward pass on the CPU.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from kernel_lib import ops

OPS_DIR = os.path.dirname(ops.__file__)

# What each file's smoke test runs, inside the copied package `copied` (small shapes: the interpreter is slow).
SMOKE = {
    "norms.py": "x = torch.randn(4, 40, requires_grad=True); w = torch.ones(40, requires_grad=True)\n"
    "(m.rms_norm(x, w).sum() + m.layer_norm(x, w, torch.zeros(40)).sum()).backward()",
    "softmax.py": "x = torch.randn(4, 40, requires_grad=True); m.softmax(x).pow(2).sum().backward()",
    "swiglu.py": "g, u = torch.randn(4, 40, requires_grad=True), torch.randn(4, 40)\nm.swiglu(g, u).sum().backward()",
    "rope.py": "x = torch.randn(1, 2, 8, 16, requires_grad=True); c, s = m.rope_cos_sin(8, 16)\n"
    "m.rope(x, c, s).sum().backward()",
    "cross_entropy.py": "x = torch.randn(4, 50, requires_grad=True)\n"
    "m.cross_entropy(x, torch.randint(0, 50, (4,))).backward()",
    "linear_cross_entropy.py": "h, w = torch.randn(4, 16, requires_grad=True), torch.randn(50, 16)\n"
    "m.linear_cross_entropy(h, w, torch.randint(0, 50, (4,))).backward()",
    "attention.py": "q = torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True)\n"
    "m.flash_attention(q, q, q, causal=True).float().sum().backward()\n"
    "layer = m.MultiHeadAttention(32, 2, rope=True, dtype=torch.float16)\n"
    "layer(torch.randn(1, 8, 32, dtype=torch.float16)).float().sum().backward()",
    "decode_attention.py": "q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 24, 16)\n"
    "with torch.no_grad():\n    m.decode_attention(q, k, k, 20)",
    "quantized_linear.py": "layer = m.QuantizedLinear(torch.nn.Linear(64, 8), bits=4, group=32)\n"
    "with torch.no_grad():\n    layer(torch.randn(2, 64))",
    "float8.py": "x, w = torch.randn(4, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)\n"
    "m.float8_linear(x, w).sum().backward()",
    "attention_variants.py": "import os\nq = torch.randn(1, 2, 40, 16, requires_grad=True)\n"
    "if os.environ['TRITON_INTERPRET'] == '0' and not q.is_cuda:  # CPU tensors, no Triton: said so\n"
    "    try:\n        m.create_block_mask(m.causal_mask, None, None, 40, 40, (0,))\n"
    "    except RuntimeError as e:\n        assert 'TRITON_INTERPRET' in str(e)\n"
    "    else:\n        raise AssertionError('no error without Triton')\n"
    "else:\n    attend = m.compile_attention_kernel('sliding_window', window_size=8, score_mod=m.softcap(5.0))\n"
    "    x = q.half() if q.is_cuda else q\n    attend(x, x, x).float().sum().backward()",
    "grouped_mm.py": "x, w = torch.randn(6, 8, requires_grad=True), torch.randn(2, 8, 4)\n"
    "m.grouped_mm(x, w, torch.tensor([2, 6], dtype=torch.int32)).sum().backward()",
    "moe.py": "layer = m.MoE(16, 32, n_experts=4, top_k=2); y, aux = layer(torch.randn(2, 5, 16))\n"
    "(y.sum() + aux).backward()",
}


def test_every_public_file_has_a_smoke_test_and_a_companion_entry():
    files = {f for f in os.listdir(OPS_DIR) if f.endswith(".py") and not f.startswith("_")}
    helpers = {c for companions in ops.COMPANIONS.values() for c in companions} - set(ops.COMPANIONS)
    assert files - helpers == set(ops.COMPANIONS) == set(SMOKE)


# On a GPU machine the copies run compiled on CUDA tensors; without one, under the interpreter. Both machines also
# check the CPU fallback to the reference.
WHERE = ["cuda", "reference-fallback"] if torch.cuda.is_available() else ["interpreter", "reference-fallback"]


@pytest.mark.parametrize("name", sorted(ops.COMPANIONS))
@pytest.mark.parametrize("where", WHERE)
def test_copied_file_runs_alone(tmp_path, name, where):
    package = tmp_path / "copied"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for file in ("_utils.py", name, *ops.COMPANIONS[name]):
        shutil.copy(os.path.join(OPS_DIR, file), package / file)
    module = name.removesuffix(".py")
    check = "import sys\nassert not any(n.startswith('kernel_lib') for n in sys.modules), 'kernel_lib was imported'"
    device = "torch.set_default_device('cuda')\n" if where == "cuda" else ""
    script = f"import torch\n{device}import copied.{module} as m\n{SMOKE[name]}\n{check}\nprint('ok')\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1" if where == "interpreter" else "0"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
