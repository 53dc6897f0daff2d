"""One rank of the multi-process tests (tests/test_distributed.py starts one process per rank).

    python tests/distributed_worker.py RANK WORLD STORE_FILE OUT CASE [CASE ...]

Runs the cases in order in one gloo group, one thread per process, and saves per case either the
result (rank 0, or every rank with all_ranks) or the error's type and message to OUT (torch.save).
Every rank builds the same inputs from fixed seeds, except where a case makes them differ.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import pathkernels as pk
from pathkernels.testing import random_attention


def network(seed=0, layers=4, heads=3, n=6, d=5):
    generator = torch.Generator().manual_seed(seed)
    attn = random_attention(2, layers, heads, n, n, dtype=torch.float64, generator=generator)
    x = torch.randn(2, n, d, dtype=torch.float64, generator=generator)
    w_v = torch.randn(layers, heads, d, 3, dtype=torch.float64, generator=generator)
    w_o = torch.randn(layers, heads, 3, d, dtype=torch.float64, generator=generator)
    return attn, x, w_v, w_o


EXPLICIT = torch.tensor([[2, -1, 0, 1], [0, 0, 0, 0], [2, -1, 0, 1], [-1, -1, -1, -1], [1, 2, -1, 0], [0, 0, 0, 1]])


def run(case: str, rank: int):
    attn, x, w_v, w_o = network()
    if case == "skip":
        return pk.path_residuals(attn, pk.PathTree.complete(4, 3, skip=True), memory_budget=1 << 16)
    if case == "max_length":
        return pk.path_residuals(attn, pk.PathTree.complete(4, 3, skip=True, max_length=2), x=x, w_v=w_v, w_o=w_o)
    if case == "explicit":
        return pk.path_residuals(attn, pk.PathTree.from_paths(EXPLICIT, num_heads=3))
    if case == "no_skip_all_ranks":
        return pk.path_residuals(attn, pk.PathTree.complete(4, 3), all_ranks=True)
    if case == "stratified":
        return pk.decompose(attn, samples_per_length=5, generator=torch.Generator().manual_seed(7))
    if case == "uniform":
        return pk.decompose(attn, num_samples=40, generator=torch.Generator().manual_seed(8))
    if case == "statistics":
        tree = pk.PathTree.complete(4, 3, skip=True)
        return pk.path_statistics(attn, tree, x=x, w_v=w_v, w_o=w_o, top_k=3, memory_budget=1 << 16)
    if case == "float32_range":  # residuals below float32's range from leaf 3,281 on: rank 0 holds none
        e = torch.randint(-4, 5, (1, 8, 2, 8, 8), generator=torch.Generator().manual_seed(3)).double()
        e[..., -1] = -e[..., :-1].sum(-1)
        tree = pk.PathTree.complete(8, 2, skip=True)
        return pk.path_residuals((1 / 8 + 2.0**-19 * e).float(), tree, memory_budget=1 << 16)
    if case == "rank1_raises":
        budget = 100 if rank == 1 else 1 << 20
        return pk.path_residuals(attn, pk.PathTree.complete(4, 3, skip=True), memory_budget=budget)
    if case == "mismatched_attn":
        return pk.path_residuals(network(seed=rank)[0], pk.PathTree.complete(4, 3, skip=True))
    if case == "mismatched_seed":
        return pk.decompose(attn, num_samples=40, generator=torch.Generator().manual_seed(rank))
    raise ValueError(f"unknown case {case}")


def summary(result):
    if result is None:
        return None
    if isinstance(result, pk.PathStatistics):
        out = {"counts": result.counts, "top_values": result.top_values, "top_paths": result.top_paths}
        for name in ("ratio", "residual", "norm"):
            out.update(
                {
                    f"sum_{name}": result.sums[name],
                    f"min_{name}": result.minima[name],
                    f"max_{name}": result.maxima[name],
                    f"argmin_{name}": result.argmin[name],
                    f"argmax_{name}": result.argmax[name],
                }
            )
        out.update({f"histogram_{name}": result.histograms[name] for name in ("ratio", "residual")})
        return out
    if isinstance(result, pk.PathDecomposition):
        return {
            "residual": result.results.residual,
            "norm": result.results.norm,
            "paths": result.paths,
            "weights": result.weights,
            "table": result.by_length().to_dict("list"),
        }
    return {"residual": result.residual, "norm": result.norm, "paths": result.paths}


def main():
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    results = {}
    for case in sys.argv[5:]:
        try:
            results[case] = ("ok", summary(run(case, rank)))
        except Exception as error:  # recorded; the next case runs in the same group
            results[case] = ("error", type(error).__name__, str(error))
    torch.save(results, out)
    # Every rank done with its collectives before any tears its connections down, then no
    # interpreter teardown: twice in CI (2026-11-26) a rank aborted after this point with
    # "terminate called without an active exception" (a joinable C++ thread destroyed at exit, in
    # gloo's teardown; every collective here is synchronous and complete). The results are saved.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
