"""The ``pathkernels`` command line (also ``python -m pathkernels``).

    pathkernels demo [--out DIR] [--quick]      the main job: every experiment, tables, CSV and PNG
    pathkernels collapse [--model PATH] ...     residual ratio against depth
    pathkernels paths [--model PATH] ...        residual ratio of the paths, by length
    pathkernels bench [--device cuda] ...       fused ops and the engine against pure PyTorch

``--model`` takes a local Hugging Face model directory (weights are loaded, nothing is downloaded)
or a config (a ``config.json`` file, or a directory holding only one), which gives a randomly
initialised model. Without it the commands use :mod:`pathkernels.models`.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels import experiments
from pathkernels.benchmarks import (
    QUICK_NORM_CASES,
    QUICK_PATH_CASES,
    format_norm_table,
    format_path_table,
    machine_description,
    norm_benchmark,
    path_benchmark,
)
from pathkernels.testing import random_attention

DEFAULT_OUT = "demo_output"


# --- printed sections ----------------------------------------------------------------------------

def worked_example() -> str:
    """The 2×2 example of the README, then the collapse of a product of attention matrices."""
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    plain = pk.matrix_norms(x)
    res = pk.matrix_norms(x, residual=True)
    lines = [
        "Worked example: x = [[1, -2], [3, 4]], column mean μ = (2, 1), res(x) = x − 1μᵀ = [[-1, -3], [1, 3]]",
        (f"  ‖x‖_1 = {plain.l1.item():g} (max column abs sum)   ‖x‖_∞ = {plain.linf.item():g} "
         f"(max row abs sum)   ‖x‖_1,∞ = √42 = {plain.composite.item():.6f}"),
        (f"  ‖res‖_1 = {res.l1.item():g}   ‖res‖_∞ = {res.linf.item():g}   "
         f"‖res‖_1,∞ = √24 = {res.composite.item():.6f}   (check: {math.sqrt(24):.6f})"),
        "",
        "Pure attention collapses to rank 1: P = A_L ⋯ A_1 for random softmax attention (n = 32, float64)",
        f"  {'depth L':>7} {'‖res(P)‖_1,∞':>14} {'‖P‖_1,∞':>10} {'ratio':>10}",
    ]
    attn = random_attention(12, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    product = torch.eye(32, dtype=torch.float64)
    for depth in range(1, 13):
        product = attn[depth - 1] @ product
        if depth in (1, 2, 3, 4, 6, 8, 12):
            residual, norm = pk.residual_norm(product, return_norm=True)
            ratio = (residual / norm).item()
            lines.append(f"  {depth:>7} {residual.item():>14.3e} {norm.item():>10.4f} {ratio:>10.3e}")
    return "\n".join(lines)


def _heading(text: str) -> None:
    print()
    print(text)
    print("=" * len(text))


def _save(out: Path | None, name: str, table=None, figure=None) -> None:
    """Write ``name``.csv and/or ``name``.png into ``out`` and say so."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    if table is not None:
        table.to_csv(out / f"{name}.csv", index=False)
        print(f"  wrote {out / (name + '.csv')}")
    if figure is not None:
        figure.tight_layout()
        figure.savefig(out / f"{name}.png", dpi=120)
        print(f"  wrote {out / (name + '.png')}")
        import matplotlib.pyplot as plt

        plt.close(figure)


def _float_format(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


# --- models given on the command line -------------------------------------------------------------

def load_huggingface(spec: str):
    """A transformers model from a local directory (with weights) or a config (random weights)."""
    try:
        import transformers
    except ImportError as error:
        raise SystemExit("pathkernels: --model needs transformers: pip install 'pathkernels[adapters]'") from error
    path = Path(spec)
    if not path.exists():
        raise SystemExit(f"pathkernels: --model {spec}: no such file or directory (models are never downloaded)")
    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))
    if has_weights:
        model = transformers.AutoModel.from_pretrained(path, local_files_only=True)
    else:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(config)
    return model


def huggingface_inputs(model, tokens: int, batch: int = 1, seed: int = 0) -> dict:
    """Random token ids (or random pixels for vision models) that fit the model's config."""
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if getattr(config, "model_type", "") == "vit":
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=generator)}
    return {"input_ids": torch.randint(0, config.vocab_size, (batch, tokens), generator=generator)}


# --- subcommands ------------------------------------------------------------------------------------

def run_collapse(args) -> object:
    if args.model:
        model = load_huggingface(args.model)
        stack = pk.adapters.from_huggingface(model, **huggingface_inputs(model, args.tokens, batch=args.batch))
        ratios = pk.metrics.residual_ratio(stack.hidden_states.double())  # [L+1, B]
        import pandas as pd

        table = pd.DataFrame(experiments.collapse_rows(args.model, ratios))
    else:
        table = experiments.collapse_vs_depth(num_layers=args.layers, d_model=args.width, num_heads=args.heads,
                                              n=args.tokens, batch=args.batch, seeds=args.seeds, progress=True)
    wide = table.pivot(index="depth", columns="variant", values="median")[list(dict.fromkeys(table["variant"]))]
    print("Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states by depth")
    print(wide.to_string(float_format=_float_format))
    _save(args.out, "collapse", table, experiments.plot_collapse(table))
    return table


def run_paths(args) -> object:
    """Under torchrun the ranks split the tree (gloo on CPU, NCCL with --device cuda); rank 0 reports."""
    device = getattr(args, "device", "cpu")
    if device == "cuda" and not (torch.cuda.is_available() and pk.build_info()["cuda"]):
        raise SystemExit("pathkernels paths: --device cuda needs a GPU and pathkernels built with CUDA")
    with pk.distributed.launched_group(device) as distributed:
        return _paths_table(args, device, distributed)


def _paths_table(args, device: str, distributed: bool) -> object:
    if distributed and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    if args.model:
        model = load_huggingface(args.model)
        stack = pk.adapters.from_huggingface(model, **huggingface_inputs(model, args.tokens)).to(torch.float64)
        attn = stack.attn
        source = f"{args.model} (L = {stack.num_layers}, H = {stack.num_heads}, n = {attn.shape[-1]})"
    else:
        torch.manual_seed(args.seed)
        network = pk.models.SelfAttentionNetwork.variant("+skip", d_model=args.width, num_heads=args.heads,
                                                          num_layers=args.layers)
        with torch.no_grad():
            attn = network(torch.randn(1, args.tokens, args.width)).attn
        source = f"a '+skip' network at initialisation (L = {args.layers}, H = {args.heads}, n = {args.tokens})"
    attn = attn.to(device)
    layers, heads = attn.shape[1], attn.shape[2]
    total = pk.count_paths(layers, heads, skip=True)
    generator = torch.Generator().manual_seed(args.seed)
    if args.samples_per_length or total > args.max_exact:
        per_length = args.samples_per_length or 200
        dec = pk.decompose(attn, skip=True, samples_per_length=per_length, generator=generator, progress=True)
        how = f"{per_length} paths drawn per length, of {total:,}"
    else:
        dec = pk.decompose(attn, skip=True, progress=True)
        how = f"all {total:,} paths, exactly"
    if dec is None:  # another rank reports
        return None
    if distributed:
        how += f", split over {torch.distributed.get_world_size()} processes"
    table = dec.by_length()
    print(f"Residual ratio of the attention products P_p by path length: {source}; {how}")
    columns = [c for c in ("length", "path_count", "evaluated", "mean", "stderr", "median", "q10", "q90")
               if c in table.columns]
    print(table[columns].to_string(index=False, float_format=_float_format))
    _save(args.out, "ratio_by_length", table, dec.plot())
    return table


def run_bench(args) -> tuple[object, object]:
    import pandas as pd

    device = args.device
    if device == "cuda" and not (torch.cuda.is_available() and pk.build_info()["cuda"]):
        raise SystemExit("pathkernels bench: --device cuda needs a GPU and pathkernels built with CUDA")
    min_run_time = 0.2 if args.quick else 1.0
    print(f"Fused norms against pure PyTorch on {machine_description(device)} (float32)")
    norm_rows = [
        row for shape in QUICK_NORM_CASES for row in norm_benchmark(shape, torch.float32, device, min_run_time)
    ]
    print(format_norm_table(norm_rows))
    print()
    print("Path engine (complete trees with skip) against the level-wise PyTorch baseline and the per-path loop")
    path_rows = [path_benchmark(*case, device=device, min_run_time=min_run_time) for case in QUICK_PATH_CASES]
    print(format_path_table(path_rows))
    norms, paths = pd.DataFrame(norm_rows), pd.DataFrame(path_rows)
    _save(args.out, "speed_norms", norms)
    _save(args.out, "speed_paths", paths)
    return norms, paths


def run_demo(args) -> int:
    start = time.perf_counter()
    quick = args.quick
    print(f"pathkernels {pk.__version__}, torch {torch.__version__}, {machine_description('cpu')}; "
          f"build: {pk.build_info()}")
    _heading("1. The norm")
    print(worked_example())

    _heading("2. Rank collapse against depth at initialisation: pure attention, +MLP, +skip, transformer")
    collapse_args = argparse.Namespace(model=None, layers=6 if quick else 12, width=32 if quick else 64, heads=4,
                                       tokens=16 if quick else 32, batch=4 if quick else 8, seeds=1 if quick else 3,
                                       out=args.out)
    run_collapse(collapse_args)

    _heading("3. Residual ratio of every path, by length (exact)")
    paths_args = argparse.Namespace(model=None, layers=4 if quick else 6, heads=3 if quick else 4, width=32,
                                    tokens=16 if quick else 32, seed=0, samples_per_length=None, max_exact=10**6,
                                    out=args.out)
    run_paths(paths_args)

    _heading("4. How the paths of common architectures spread over lengths: C(L, k) H^k of (H+1)^L")
    lengths = experiments.path_length_distribution()
    summary = []
    for name, rows in lengths.groupby("architecture", sort=False):
        mode = rows.loc[rows["share"].idxmax()]
        short = rows[rows["length"] <= 3]["share"].sum()
        summary.append(f"  {name:<34} L = {int(mode['layers']):>2}, H = {int(mode['heads']):>2}: "
                       f"(H+1)^L = 10^{rows['layers'].iloc[0] * math.log10(rows['heads'].iloc[0] + 1):.1f} paths, "
                       f"most common length {int(mode['length'])}, share of length ≤ 3: {short:.1e}")
    print("\n".join(summary))
    _save(args.out, "path_lengths", lengths, experiments.plot_path_lengths(lengths))

    _heading("5. Path effectiveness: sorting with an attention-only model, keeping paths of length ≤ k")
    result = experiments.path_effectiveness(steps=200 if quick else 1000, test_size=512 if quick else 2048,
                                            progress=True)
    print(f"trained in {result.train_seconds:.0f} s (final loss {result.final_loss:.4f}); exact truncations by "
          "pk.length_sums; k = L is the model itself")
    print(result.table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    _save(args.out, "path_effectiveness", result.table, experiments.plot_effectiveness(result.table))

    _heading("6. Speed against pure PyTorch (quick sizes; bench/ has the full suite)")
    run_bench(argparse.Namespace(device="cpu", quick=True, out=args.out))
    print()
    print(f"demo finished in {time.perf_counter() - start:.0f} s" + (f"; outputs in {args.out}/" if args.out else ""))
    return 0


# --- the parser --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathkernels", description="Path decompositions of attention networks")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="the main job: every experiment, with tables, CSV files and PNG plots")
    demo.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT})")
    demo.add_argument("--quick", action="store_true", help="smaller sizes and a shorter training (about a minute)")
    demo.set_defaults(run=run_demo)

    def model_options(sub, layers: int, tokens: int):
        sub.add_argument("--model", help="a local Hugging Face model directory, or a config.json (random weights)")
        sub.add_argument("--layers", type=int, default=layers, help="depth of the built-in network")
        sub.add_argument("--heads", type=int, default=4, help="heads per layer of the built-in network")
        sub.add_argument("--width", type=int, default=64, help="d_model of the built-in network")
        sub.add_argument("--tokens", type=int, default=tokens, help="sequence length n")
        sub.add_argument("--out", type=Path, help="write CSV and PNG here")

    collapse = commands.add_parser("collapse", help="residual ratio of the hidden states against depth")
    model_options(collapse, layers=12, tokens=32)
    collapse.add_argument("--batch", type=int, default=8, help="random inputs per model")
    collapse.add_argument("--seeds", type=int, default=3, help="initialisations per variant")
    collapse.set_defaults(run=lambda args: _done(run_collapse(args)))

    paths = commands.add_parser("paths", help="residual ratio of every path (or a stratified sample), by length")
    model_options(paths, layers=6, tokens=32)
    paths.add_argument("--seed", type=int, default=0)
    paths.add_argument("--samples-per-length", type=int, help="sample this many paths per length instead of all")
    paths.add_argument("--max-exact", type=int, default=10**6, help="sample when the tree has more paths than this")
    paths.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="where to compute (under torchrun: gloo on CPU, NCCL and cuda:LOCAL_RANK with cuda)")
    paths.set_defaults(run=lambda args: _done(run_paths(args)))

    bench = commands.add_parser("bench", help="fused ops and the path engine against pure PyTorch")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    bench.add_argument("--quick", action="store_true", help="shorter timing")
    bench.add_argument("--out", type=Path, help="write CSV here")
    bench.set_defaults(run=lambda args: _done(run_bench(args)))
    return parser


def _done(_result) -> int:
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
