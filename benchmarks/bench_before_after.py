"""kernel_lib against an older copy of itself, side by side in one process, on a GPU: GPU time and host time per op.

A refactoring must leave every kernel as fast as before and cost the host no more per call. This script imports
the current ``kernel_lib`` and an older one renamed ``kernel_lib_old`` (its custom ops registered under the
``kernel_lib_old::`` namespace, so both load at once), then for each op, alternating old and new twice:

* GPU time of the forward and of forward + backward at a size that fills the GPU (``bench.time_fn``, L2 flushed);
* host time of one forward + backward at a small size (``bench.host_ms``: what a Python caller pays per step),
  the median over ``--rounds`` alternating rounds, with the spread between rounds.

The outputs of old and new are compared first (same inputs, bf16 tolerance). Make the old copy with
``python benchmarks/bench_before_after.py --make-old <git ref>`` (it writes _build/old/kernel_lib_old), then run
with ``PYTHONPATH=_build/old``. Writes <out>/before_after.csv and prints a table of new / old ratios.
"""

import argparse
import os
import subprocess

import torch

import kernel_lib
from kernel_lib import bench


def make_old(ref: str, root: str = "_build/old") -> str:
    """Export kernel_lib at git ``ref`` as package kernel_lib_old, with its op namespace renamed."""
    target = os.path.join(root, "kernel_lib_old")
    subprocess.run(["rm", "-rf", target], check=True)
    os.makedirs(root, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, "kernel_lib"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    os.rename(os.path.join(root, "kernel_lib"), target)
    for folder, _, files in os.walk(target):
        for name in files:
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            text = text.replace("kernel_lib::", "kernel_lib_old::").replace(
                "torch.ops.kernel_lib.", "torch.ops.kernel_lib_old."
            )
            with open(path, "w") as f:
                f.write(text)
    return target


def cases(lib, big: bool):
    """(name, call) pairs; each call runs a forward and returns the output to differentiate."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16

    def rand(*shape, grad=True):
        return torch.randn(*shape, device=dev, dtype=bf16, generator=g).requires_grad_(grad)

    rows = 32768 if big else 256
    x, w, b = rand(rows, 4096), rand(4096), rand(4096)
    gate, up = rand(rows, 4096), rand(rows, 4096)
    logits, target = rand(rows // 4, 32000), torch.randint(0, 32000, (rows // 4,), device=dev, generator=g)
    q = rand(16, 32, 2048 if big else 64, 128)
    cos, sin = lib.rope_cos_sin(q.shape[2], 128, device=dev)
    n = 8192 if big else 256
    qa, ka, va = (rand(16384 // n, 16, n, 128) for _ in range(3))
    T, d, d_ff, E, k = (16384, 2048, 1408, 64, 6) if big else (512, 256, 128, 8, 2)
    xs = rand(T * k, d)
    wg = (torch.randn(E, d, d_ff, device=dev, generator=g) / d**0.5).to(bf16).requires_grad_()
    offs = torch.linspace(0, T * k, E + 1, device=dev)[1:].round().to(torch.int32)
    torch.manual_seed(0)
    layer = lib.MoE(d, d_ff, E, k, device=dev, dtype=bf16)
    xm = rand(T, d)
    return [
        ("rms_norm", lambda: lib.rms_norm(x, w)),
        ("layer_norm", lambda: lib.layer_norm(x, w, b)),
        ("softmax", lambda: lib.softmax(x)),
        ("swiglu", lambda: lib.swiglu(gate, up)),
        ("rope", lambda: lib.rope(q, cos, sin)),
        ("cross_entropy", lambda: lib.cross_entropy(logits, target)),
        ("flash_attention", lambda: lib.flash_attention(qa, ka, va)),
        ("flash_attention causal", lambda: lib.flash_attention(qa, ka, va, causal=True)),
        ("flash_attention window 256", lambda: lib.flash_attention(qa, ka, va, causal=True, window=256)),
        ("flash_attention window 4096", lambda: lib.flash_attention(qa, ka, va, causal=True, window=4096)),
        ("grouped_mm", lambda: lib.grouped_mm(xs, wg, offs, check_offs=False)),
        ("moe", lambda: layer(xm)[0]),
    ]


def step(call):
    """Forward + backward of ``call``, gradients accumulated into the leaves."""

    def run():
        out = call()
        out.float().sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--make-old", metavar="GIT_REF", help="export kernel_lib at GIT_REF as _build/old/kernel_lib_old"
    )
    parser.add_argument("--out", default="results", help="folder for the CSV file")
    parser.add_argument("--rounds", type=int, default=6, help="alternating old/new rounds of host timing")
    parser.add_argument("--ops", default="", help="comma-separated op names to run (default: all), e.g. 'flash'")
    args = parser.parse_args()
    if args.make_old:
        print(make_old(args.make_old))
        return
    bench.require_gpu("bench_before_after.py")
    import kernel_lib_old

    libs = {"old": kernel_lib_old, "new": kernel_lib}
    wanted = [w for w in args.ops.split(",") if w]

    def chosen(pairs):  # the ops whose name contains one of --ops
        return [(n, c) for n, c in pairs if not wanted or any(w in n for w in wanted)]

    big = {name: chosen(cases(lib, big=True)) for name, lib in libs.items()}
    small = {name: chosen(cases(lib, big=False)) for name, lib in libs.items()}
    for (name, new_call), (_, old_call) in zip(big["new"], big["old"], strict=True):
        torch.testing.assert_close(new_call(), old_call(), atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")
    rows = []
    for index, (name, _) in enumerate(big["new"]):
        gpu, host = {}, {}
        for rnd in range(args.rounds):
            for version in ("old", "new") if rnd % 2 == 0 else ("new", "old"):  # alternate which goes first
                call, small_call = big[version][index][1], small[version][index][1]
                if rnd < 2:  # GPU times are steady: two rounds
                    gpu.setdefault(version, []).append(
                        (bench.time_fn(call).median_ms, bench.time_fn(step(call)).median_ms)
                    )
                host.setdefault(version, []).append(bench.host_ms(step(small_call), reps=200))
        for version in ("old", "new"):
            fwd, both = (min(v[i] for v in gpu[version]) for i in range(2))  # the better of the two rounds
            per_round = sorted(host[version])
            rows.append(
                dict(
                    op=name,
                    version=version,
                    fwd_ms=fwd,
                    fwd_bwd_ms=both,
                    host_fwd_bwd_us=1000 * per_round[len(per_round) // 2],  # median over rounds
                    host_spread_us=1000 * (per_round[-1] - per_round[0]),
                )
            )
        print(name, "done", flush=True)
    frame = bench.to_frame(rows).pivot(index="op", columns="version")
    for column in ("fwd_ms", "fwd_bwd_ms", "host_fwd_bwd_us"):  # host_spread_us: max - min over the rounds
        frame[(column, "new/old")] = frame[(column, "new")] / frame[(column, "old")]
    print(frame.sort_index(axis=1).round(3).to_string())
    bench.write_csv(rows, os.path.join(args.out, "before_after.csv"))


if __name__ == "__main__":
    main()
