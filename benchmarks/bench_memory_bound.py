"""Memory-bound kernels of kernel_lib against PyTorch eager, the PyTorch built-in and torch.compile.

For each op (RMSNorm, LayerNorm, softmax, SwiGLU), bf16, rows x D with rows * D = 2**27 (the 32768 x 4096 of the course
at D = 4096), forward and forward + backward: checks every implementation against float64 first, then times
it with L2 wiped between calls (kernel_lib.bench.time_fn). GB/s counts the fewest bytes each pass must move
(inputs read once, outputs written once); the copy ceiling is measured in the same run. Writes
<out>/memory_bound.csv and prints a table.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_lib import bench, validate  # noqa: E402
from kernel_lib.layer_norm import layer_norm, layer_norm_ref  # noqa: E402
from kernel_lib.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from kernel_lib.softmax import softmax, softmax_ref  # noqa: E402
from kernel_lib.swiglu import swiglu, swiglu_ref  # noqa: E402


def make_cases(rows: int, D: int, dtype):
    """op -> (inputs maker, {impl: fn}, tensors moved forward, tensors moved forward + backward)."""
    weight = 1 + 0.1 * torch.randn(D, device="cuda", dtype=dtype)
    bias = 0.1 * torch.randn(D, device="cuda", dtype=dtype)
    return {
        "rms_norm": (
            lambda: [torch.randn(rows, D, device="cuda", dtype=dtype)],
            {
                "kernel_lib": lambda x: rms_norm(x, weight),
                "F.rms_norm": lambda x: F.rms_norm(x, (D,), weight, 1e-6),
                "eager reference": lambda x: rms_norm_ref(x, weight),
                "compiled reference": torch.compile(lambda x: rms_norm_ref(x, weight), dynamic=False),
            },
            lambda x: rms_norm_ref(x.double(), weight.double()),
            2,
            5,
        ),
        "layer_norm": (
            lambda: [1 + torch.randn(rows, D, device="cuda", dtype=dtype)],
            {
                "kernel_lib": lambda x: layer_norm(x, weight, bias),
                "F.layer_norm": lambda x: F.layer_norm(x, (D,), weight, bias, 1e-5),
                "eager reference": lambda x: layer_norm_ref(x, weight, bias),
                "compiled reference": torch.compile(lambda x: layer_norm_ref(x, weight, bias), dynamic=False),
            },
            lambda x: layer_norm_ref(x.double(), weight.double(), bias.double()),
            2,
            5,
        ),
        "softmax": (
            lambda: [3 * torch.randn(rows, D, device="cuda", dtype=dtype)],
            {
                "kernel_lib": softmax,
                "F.softmax": lambda x: F.softmax(x, dim=-1),
                "eager reference": softmax_ref,
                "compiled reference": torch.compile(softmax_ref, dynamic=False),
            },
            lambda x: softmax_ref(x.double()),
            2,
            5,
        ),
        "swiglu": (
            lambda: [
                torch.randn(rows, D, device="cuda", dtype=dtype),
                torch.randn(rows, D, device="cuda", dtype=dtype),
            ],
            {
                "kernel_lib": swiglu,
                "F.silu(g) * u": lambda g, u: F.silu(g) * u,
                "eager reference": swiglu_ref,
                "compiled reference": torch.compile(swiglu_ref, dynamic=False),
            },
            lambda g, u: swiglu_ref(g.double(), u.double()),
            3,
            8,
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--widths", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--elements", type=int, default=2**27, help="rows * D for every width")
    parser.add_argument("--ops", default="rms_norm,layer_norm,softmax,swiglu", help="comma-separated subset")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_memory_bound needs a CUDA GPU")
    try:
        from tqdm import tqdm
    except ImportError:

        def tqdm(items, **_):
            return items

    env = bench.environment()
    copy_gbps = bench.copy_bandwidth()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | copy ceiling {copy_gbps:,.0f} GB/s")
    dtype = torch.bfloat16
    rows_out = []
    widths = [int(w) for w in args.widths.split(",")]
    for D in tqdm(widths, desc="widths"):
        rows = args.elements // D
        cases = {k: v for k, v in make_cases(rows, D, dtype).items() if k in args.ops.split(",")}
        for op, (make, impls, ref64, moved_fwd, moved_fwdbwd) in cases.items():
            inputs = make()
            nbytes = rows * D * inputs[0].element_size()
            want = ref64(*inputs)
            torch_lowp = impls["eager reference"](*inputs)  # PyTorch in bf16: its error sets the allowance
            for impl, fn in impls.items():
                out = fn(*inputs)
                result = validate.check(out, want, torch_lowp, name=f"{op} {impl}", atol=1e-2)
                ok = result.ok
                forward = bench.time_fn(lambda fn=fn, inputs=inputs: fn(*inputs))
                grads_in = [t.detach().requires_grad_() for t in inputs]
                dy = torch.randn_like(out)

                def fwd_bwd(fn=fn, grads_in=grads_in, dy=dy):
                    return torch.autograd.grad(fn(*grads_in), grads_in, dy)

                both = bench.time_fn(fwd_bwd)
                for pass_name, timing, moved in (
                    ("forward", forward, moved_fwd),
                    ("forward+backward", both, moved_fwdbwd),
                ):
                    row = bench.result_row(
                        op, timing, nbytes=moved * nbytes, impl=impl, D=D, rows=rows, dtype="bfloat16"
                    )
                    row.update(
                        {
                            "pass": pass_name,
                            "pct_of_copy": 100 * row["gbps"] / copy_gbps,
                            "correct": ok,
                            "max_abs_err": result.kernel.max_abs,
                        }
                    )
                    rows_out.append(row)
            mine = [r for r in rows_out if r["name"] == op and r["D"] == D and r["impl"] == "kernel_lib"]
            summary = ", ".join(f"{r['pass']} {r['gbps']:,.0f} GB/s" for r in mine)
            print(f"D={D} {op}: kernel_lib {summary}", flush=True)
            del inputs
            torch.cuda.empty_cache()

    frame = bench.to_frame(rows_out)
    ours = frame[frame["impl"] == "kernel_lib"].set_index(["name", "pass", "D"])["median_ms"]
    frame["kernel_lib speed-up"] = [
        ours[(r["name"], r["pass"], r["D"])] and r["median_ms"] / ours[(r["name"], r["pass"], r["D"])]
        for _, r in frame.iterrows()
    ]
    path = bench.write_csv(
        frame.to_dict("records"),
        os.path.join(args.out, "memory_bound.csv"),
        env={**env, "copy_gbps": copy_gbps},
    )
    show = frame[frame["D"] == 4096][
        ["name", "pass", "impl", "median_ms", "gbps", "pct_of_copy", "kernel_lib speed-up", "correct"]
    ]
    print(show.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print("\nkernel_lib GB/s by width (forward | forward+backward):")
    for op in frame["name"].unique():
        sub = frame[(frame["name"] == op) & (frame["impl"] == "kernel_lib")]
        cells = [
            f"D={d}: {sub[(sub.D == d) & (sub['pass'] == 'forward')].gbps.iloc[0]:,.0f} | "
            f"{sub[(sub.D == d) & (sub['pass'] == 'forward+backward')].gbps.iloc[0]:,.0f}"
            for d in widths
        ]
        print(f"  {op:9s} " + "; ".join(cells))
    print(f"wrote {path}")
    return 0 if frame["correct"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
