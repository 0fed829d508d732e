"""Compile time of the sharded train step against depth, with the decoder layers scanned and as a
Python loop (a narrow Llama: hidden 64, so compile time is all there is).

    python -m benchmarks.compile_time [--layers 2 8 32] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tqdm.auto import tqdm

from jaxinfra.train.compile_cost import train_step_compile_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--preset", default="fsdp")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    rows = []
    for scan in (True, False):
        for layers in tqdm(args.layers, desc=f"scan_layers={scan}", unit="depth"):
            rows.append(dataclasses.asdict(train_step_compile_cost(layers, scan, args.preset)))
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compile_time.json").write_text(json.dumps(rows, indent=2))
    print("\n| layers | scanned: compile s | HLO ops | loop: compile s | HLO ops |")
    print("|---|---|---|---|---|")
    for layers in args.layers:
        s = next(r for r in rows if r["layers"] == layers and r["scan_layers"])
        loop = next(r for r in rows if r["layers"] == layers and not r["scan_layers"])
        print(f"| {layers} | {s['seconds']:.1f} | {s['hlo_ops']} | {loop['seconds']:.1f} | {loop['hlo_ops']} |")


if __name__ == "__main__":
    main()
