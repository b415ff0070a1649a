"""Rows of every width for RMSNorm, LayerNorm and softmax: one program a row against a team of programs a row
(``kernel_lib/ops/split_rows.py``), the team's lane width and warps, torch.compile and QuACK when installed.

bf16, rows x D = 2**27 elements, forward and forward + backward (gradients of x and of the weight for the norms),
checked against float64 by ``kernel_lib.bench.sweep`` before and after timing (the memory-bound benchmark's
rule), L2 wiped between calls. GB/s counts the fewest bytes a pass moves; % of the copy ceiling measured in the
same run. Variants are the library's own kernels with its module constants changed for the whole measurement
(forward and backward): ``whole rows`` holds every row in one program (up to 65,536 columns), ``lanes W x N``
splits rows wider than 4,096 columns into lanes of W columns and N warps. Writes <out>/wide_rows.csv and prints
% of copy by width.
"""

import contextlib
import os
import sys

from bench_memory_bound import arguments, make_ops, measure, prepare  # this folder's script

from kernel_lib import bench
from kernel_lib.ops import norms, softmax

VARIANTS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]  # (lane width, warps)


@contextlib.contextmanager
def patched(**values):
    """Set module constants of norms.py and softmax.py for the duration (the launchers read them per call)."""
    saved = []
    for module in (norms, softmax):
        for name, value in values.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def variant(fn, **values):
    def call(*args):
        with patched(**values):
            return fn(*args)

    return call


def quack_impls() -> dict:
    """QuACK's forwards with autograd, by op, when ``quack-kernels`` imports; else nothing. The function names and
    arguments are assumed, not yet tried against an installed QuACK (it was not installed in any run so far): a
    mismatch fails the sweep's check loudly rather than timing something else."""
    try:
        import quack
    except Exception as error:  # noqa: BLE001 - any failure to import means: not measured
        print(f"QuACK not measured ({type(error).__name__}: {error})")
        return {}
    impls = {}
    if hasattr(quack, "rmsnorm"):
        impls["rms_norm"] = lambda x, w: quack.rmsnorm(x, w, eps=1e-6)
    if hasattr(quack, "softmax"):
        impls["softmax"] = lambda x: quack.softmax(x)
    if hasattr(quack, "layernorm"):
        impls["layer_norm"] = lambda x, w, b: quack.layernorm(x, w, b, eps=1e-5)
    return impls


def main() -> int:
    parser = arguments(__doc__, "4096,16384,32768,65536,131072,262144", "rms_norm,layer_norm,softmax")
    parser.add_argument("--variants", action="store_true", help="also time every lane width x warps variant")
    args = parser.parse_args()
    env = bench.require_gpu("sweep_wide_rows")
    copy_gbps = prepare()
    widths = [int(w) for w in args.widths.split(",")]
    ops = {op: spec for op, spec in make_ops().items() if op in args.ops.split(",")}
    grads = {"rms_norm": 2, "layer_norm": 3, "softmax": 1}  # x and the parameters: the norms' dw, db too
    ops = {op: (make_inputs, impls, ref, grads[op], *moved) for op, (make_inputs, impls, ref, _, *moved) in ops.items()}
    quack = quack_impls()
    runs = [("kernel_lib", {}), ("whole rows", dict(SPLIT_ABOVE=65536, BWD_SPLIT_ABOVE=65536))]
    if args.variants:
        runs += [(f"lanes {width}x{warps}", dict(SPLIT_ABOVE=4096, BWD_SPLIT_ABOVE=4096, LANE_WIDTH=width,
                                                  RMS_FWD_LANES=(width, warps), LN_FWD_LANES=(width, warps),
                                                  BWD_LANES=(width, warps), LANE_WARPS=warps))
                 for width, warps in VARIANTS]  # fmt: skip
    frames = []
    for D in widths:
        for label, values in runs:  # the constants stay set for the whole measurement: forward and backward
            if label == "whole rows" and D > 65536:
                continue
            picked = {}
            for op, (make_inputs, impls, *rest) in ops.items():
                keep = {"kernel_lib": impls["kernel_lib"]}
                if label == "kernel_lib":  # the peers once, beside the library's default
                    keep["compiled reference"] = impls["compiled reference"]
                    if op in quack:
                        keep["QuACK"] = quack[op]
                picked[op] = (make_inputs, keep, *rest)
            with patched(**values):
                frame = measure(picked, [D], args.elements, copy_gbps, 2)
            frame.loc[frame["impl"] == "kernel_lib", "impl"] = label
            frames.append(frame)
    import pandas as pd

    frame = pd.concat(frames, ignore_index=True)
    path = bench.write_csv(frame.to_dict("records"), os.path.join(args.out, "wide_rows.csv"),
                           env={**env, "copy_gbps": copy_gbps})  # fmt: skip
    table = frame.pivot_table(index=["name", "pass", "impl"], columns="D", values="pct_of_copy")
    print("% of the copy ceiling:")
    print(table.to_string(float_format=lambda v: f"{v:.1f}"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
