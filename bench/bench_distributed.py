"""Strong scaling of pk.path_residuals across processes (gloo, one thread per process).

Times one complete tree with skip (default L = 6, H = 9: 10^6 leaves, n = 32, float32) on 1 and
on 2 processes (or --worlds), each process pinned to one thread, and reports the speed-up. The
configurations alternate for --rounds rounds (so that both see the same machine state), each run
timing the tree --repeats times after a warm-up; the best time of each configuration counts (this
VM's timings vary by ±30 %).

    python bench/bench_distributed.py
    python bench/bench_distributed.py --worlds 1 2 --out bench/results/distributed-cpu-dev.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path


def worker(rank: int, world: int, port: int, layers: int, heads: int, n: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    import pathkernels as pk
    from pathkernels.testing import random_attention

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
        )
    attn = random_attention(1, layers, heads, n, n, generator=torch.Generator().manual_seed(0))
    tree = pk.PathTree.complete(layers, heads, skip=True)
    pk.path_residuals(attn[:, :3], pk.PathTree.complete(3, heads, skip=True))  # warm-up
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        result = pk.path_residuals(attn, tree)
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(
            json.dumps(
                {
                    "world": world,
                    "seconds": min(times),
                    "times": times,
                    "paths": len(tree),
                    "checksum": float(result.ratio.double().sum()),
                }
            )
        )
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, args) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        __file__,
        "--worker",
        str(world),
        str(port),
        str(args.layers),
        str(args.heads),
        str(args.n),
        str(args.repeats),
    ]
    procs = [
        subprocess.Popen([*command, str(rank)], stdout=subprocess.PIPE, text=True, env=env) for rank in range(world)
    ]
    outputs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {outputs}")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Strong scaling of the path engine over processes")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=7, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        world, port, layers, heads, n, repeats, rank = args.worker
        worker(rank, world, port, layers, heads, n, repeats)
        return 0

    best: dict[int, dict] = {}
    seen: dict[int, list[float]] = {world: [] for world in args.worlds}
    for _ in range(args.rounds):
        for world in args.worlds:
            row = run(world, args)
            seen[world].append(row["seconds"])
            if world not in best or row["seconds"] < best[world]["seconds"]:
                best[world] = row
    rows = [dict(best[world], best_of_each_run=seen[world]) for world in args.worlds]
    base = rows[0]["seconds"] * rows[0]["world"]
    print(
        f"complete tree with skip: L = {args.layers}, H = {args.heads}, n = {args.n}, float32, "
        f"{rows[0]['paths']:,} paths; one thread per process, gloo"
    )
    print(f"{'processes':>9} {'best s':>8} {'speed-up':>8} {'efficiency':>10}")
    for row in rows:
        row["speedup"] = base / row["seconds"]
        row["efficiency"] = row["speedup"] / row["world"]
        print(f"{row['world']:>9} {row['seconds']:>8.2f} {row['speedup']:>7.2f}x {row['efficiency']:>10.0%}")
    if len({round(r["checksum"], 6) for r in rows}) != 1:
        raise SystemExit(f"results differ across world sizes: {[r['checksum'] for r in rows]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"layers": args.layers, "heads": args.heads, "n": args.n, "rows": rows}
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
