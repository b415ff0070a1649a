"""Measure this machine's ceilings (copy bandwidth, matmul TFLOP/s per dtype) and write them as CSV rows.

Every later benchmark compares its throughput with these, measured on the same GPU; run them together
(`make bench`). Prints a table; writes <out>/ceilings.csv with device, versions and timestamp in each row.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from kernel_lib import bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="folder for the CSV")
    parser.add_argument("--matmul-n", type=int, default=None, help="square matmul size (default 8192 on a GPU)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = bench.environment(device)
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | {env['timestamp']}")
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a nicety

        def tqdm(items, **_):
            return items

    rows = []
    copy_sizes = [2**26, 2**28, 2**30] if device == "cuda" else [2**24]
    for nbytes in tqdm(copy_sizes, desc="copy"):
        value = bench.copy_bandwidth(nbytes=nbytes, device=device)
        rows.append(
            {
                "ceiling": "copy (read + write)",
                "size": f"{nbytes // 2**20} MiB per buffer",
                "value": value,
                "unit": "GB/s",
            }
        )
    for dtype in tqdm([torch.bfloat16, torch.float16, "tf32", torch.float32], desc="matmul"):
        if device == "cpu" and dtype in (torch.float16, "tf32"):
            continue
        name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        n = args.matmul_n or (8192 if device == "cuda" else 512)
        value = bench.matmul_tflops(dtype, n=n, device=device)
        rows.append({"ceiling": f"matmul {name}", "size": f"{n}^3", "value": value, "unit": "TFLOP/s"})

    path = bench.write_csv(rows, os.path.join(args.out, "ceilings.csv"), env=env)
    width = max(len(r["ceiling"]) for r in rows)
    for r in rows:
        print(f"{r['ceiling']:{width}s}  {r['size']:>20s}  {r['value']:>10,.1f} {r['unit']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
