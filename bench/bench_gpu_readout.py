"""The readout engine on a GPU (run by bench/gpu_check.sh): pk.path_attribution and
pk.top_paths of GPT-2-shaped models captured on CUDA against the same models on the CPU, with the
results compared (the readout ops run their ATen form on CUDA).

    python bench/bench_gpu_readout.py --out FILE      # about a minute; needs a GPU and transformers
"""

from __future__ import annotations

import sys
import time

import torch

from pathkernels.app.benchmarks import bench_main

# (what, layers, heads, d_model, max_length or None)
CASES = [("attribution", 7, 8, 64, None), ("attribution", 12, 12, 768, 3), ("top_paths", 12, 12, 768, None)]
COLUMNS = [
    ("what", "what", "<"),
    ("L", "layers", ""),
    ("H", "heads", ""),
    ("d", "d_model", ""),
    ("max len", "max_length", ""),
    ("cpu s", "cpu_s", ".3f"),
    ("cuda s", "cuda_s", ".3f"),
    ("speed-up", "speedup", ".2f", "x"),
    ("max rel. diff", "difference", ".1e"),
]


def _timed(function):
    function()  # warm-up (CUDA context, cuBLAS handles)
    start = time.perf_counter()
    result = function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def bench_case(what: str, layers: int, heads: int, width: int, max_length: int | None) -> dict:
    from bench_attribution import gpt2_model

    import pathkernels as pk

    torch.manual_seed(0)
    model = gpt2_model(layers, heads, width, 16)
    ids = torch.randint(0, 100, (1, 16))
    on_cpu, _ = pk.adapters.capture_huggingface_residual(model, input_ids=ids)
    on_gpu, _ = pk.adapters.capture_huggingface_residual(model.cuda(), input_ids=ids.cuda())
    readout = pk.logit_diff(model, 1, 2)
    if what == "attribution":

        def run(stack):
            return pk.path_attribution(stack, readout, max_length=max_length)

        cpu_s, cpu = _timed(lambda: run(on_cpu))
        cuda_s, gpu = _timed(lambda: run(on_gpu))
        scale = cpu.by_source_length.abs().max()
        difference = float((gpu.by_source_length - cpu.by_source_length).abs().max() / scale)
    else:

        def run(stack):
            return pk.top_paths(stack, readout, 20, time_limit=120, batch_nodes=8192)

        cpu_s, cpu = _timed(lambda: run(on_cpu))
        cuda_s, gpu = _timed(lambda: run(on_gpu))
        same = torch.equal(cpu.paths, gpu.paths) and cpu.certified == gpu.certified
        difference = float((gpu.values - cpu.values).abs().max() / cpu.values.abs().max()) if same else float("inf")
    return {
        "what": what,
        "layers": layers,
        "heads": heads,
        "d_model": width,
        "max_length": "all" if max_length is None else max_length,
        "cpu_s": cpu_s,
        "cuda_s": cuda_s,
        "speedup": cpu_s / cuda_s,
        "difference": difference,
    }


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        print("bench_gpu_readout: no GPU here; nothing to measure")
        return 0
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_gpu_readout: transformers is not installed; the models are built from its configs")
        return 0
    title = "readout engine, CUDA against CPU"
    return bench_main(argv, "The readout engine on a GPU", title, bench_case, COLUMNS, CASES)


if __name__ == "__main__":
    sys.exit(main())
