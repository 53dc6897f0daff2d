"""The ``pathkernels`` command line (also ``python -m pathkernels``).

    pathkernels demo [--out DIR] [--quick]      the main job: every experiment, tables, CSV and PNG
    pathkernels collapse [--model PATH] ...     residual ratio against depth
    pathkernels paths [--model PATH] ...        residual ratio of the paths, by length
    pathkernels attribute [--model PATH] ...    each path's share of a logit difference, top paths
    pathkernels bench [--device cuda] ...       fused ops and the engine against pure PyTorch

``--model`` takes a local Hugging Face model directory (weights are loaded, nothing is downloaded)
or a config (a ``config.json`` file, or a directory holding only one), which gives a randomly
initialised model. Without it the commands use :mod:`pathkernels.models`.

Bad options and inputs end with one line on stderr that names what is wrong (exit code 2 for the
command line, 1 for a failure while running); ``--debug`` shows the traceback instead. Before any
work, ``--out`` is checked for writability and the attention maps' memory against what the device
has. Progress shows as bars on a terminal, and as a plain line about every 10 s elsewhere (a log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import pathkernels as pk
from pathkernels import experiments
from pathkernels.adapters.huggingface import LocalModel
from pathkernels.analysis.attribution import path_bars, unembedding
from pathkernels.benchmarks import (
    QUICK_NORM_CASES,
    QUICK_PATH_CASES,
    format_norm_table,
    format_path_table,
    machine_description,
    norm_benchmark,
    path_benchmark,
)
from pathkernels.core._figures import saved
from pathkernels.core._memory import check_fits
from pathkernels.core._progress import TimeLimitReached, time_limit
from pathkernels.core.paths import count_attribution_paths
from pathkernels.testing import random_attention

DEFAULT_OUT = "demo_output"


class CommandLineError(Exception):
    """A bad option or input found after parsing: reported in one line, exit code 2."""


def check_writable(path: Path, option: str, command: str, *, folder: bool = True) -> None:
    """Make sure ``path`` (a folder, or with ``folder=False`` a file) can be written, before any
    work: the folder is created and a probe file written and removed there."""
    directory = path if folder else path.parent
    if not folder and path.is_dir():
        raise CommandLineError(f"pathkernels {command}: {option} {path}: is a folder; expected a file name")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".pathkernels-probe-"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise CommandLineError(f"pathkernels {command}: {option} {path}: cannot write there ({reason})") from None


def check_attention_fits(
    command: str, *, batch: int, layers: int, heads: int, tokens: int, bytes_per_entry: int, device: str
) -> None:
    """Refuse, before anything is allocated, a run whose attention maps alone (``B·L·H·n²`` entries
    of ``bytes_per_entry``: the maps and the copies the command makes of them) exceed the memory
    the device has."""
    check_fits(
        batch * layers * heads * tokens * tokens * bytes_per_entry,
        torch.device(device),
        f"pathkernels {command}",
        f"{batch} × {layers} layers × {heads} heads × {tokens}² tokens of attention need about",
        "pass fewer --tokens (or a smaller --batch or network)",
        error=CommandLineError,
    )


def resolve_device(device: str, command: str) -> str:
    """``auto``: CUDA when a GPU and the CUDA kernels are present, else CPU; ``cuda`` is checked."""
    has_cuda = torch.cuda.is_available() and pk.build_info()["cuda"]
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        raise CommandLineError(
            f"pathkernels {command}: --device cuda needs a GPU and pathkernels built with CUDA "
            f"(build_info: cuda={pk.build_info()['cuda']}, GPU: {torch.cuda.is_available()})"
        )
    return device


# --- printed sections ----------------------------------------------------------------------------


def worked_example() -> str:
    """The 2×2 example of docs/USAGE.md, then the collapse of a product of attention matrices."""
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    plain = pk.matrix_norms(x)
    res = pk.matrix_norms(x, residual=True)
    lines = [
        "Worked example: x = [[1, -2], [3, 4]], column mean μ = (2, 1), res(x) = x − 1μᵀ = [[-1, -3], [1, 3]]",
        (
            f"  ‖x‖_1 = {plain.l1.item():g} (max column abs sum)   ‖x‖_∞ = {plain.linf.item():g} "
            f"(max row abs sum)   ‖x‖_1,∞ = √42 = {plain.composite.item():.6f}"
        ),
        (
            f"  ‖res‖_1 = {res.l1.item():g}   ‖res‖_∞ = {res.linf.item():g}   "
            f"‖res‖_1,∞ = √24 = {res.composite.item():.6f}   (check: {math.sqrt(24):.6f})"
        ),
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
        saved(figure, out / f"{name}.png")
        print(f"  wrote {out / (name + '.png')}")
        import matplotlib.pyplot as plt

        plt.close(figure)


def _float_format(value: float) -> str:
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


# --- models given on the command line -------------------------------------------------------------


def _local_model(spec: str) -> LocalModel:
    """``--model``: the adapters' reader, its errors as one command-line line."""
    try:
        return pk.adapters.load_local_model(spec)
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise CommandLineError(f"pathkernels: --model {spec}: {error}") from None


def _model_inputs(local: LocalModel, text: str | None, tokens: int | None, batch: int = 1) -> tuple[dict, str]:
    """The inputs that ``--text`` / ``--tokens`` ask for, refusing those that do not apply."""
    if local.is_vision and (text is not None or tokens is not None):
        option = "--text" if text is not None else "--tokens"
        raise CommandLineError(
            f"pathkernels: {option} does not apply to the vision model {local.path}: its tokens "
            "are the image patches (random pixels here)"
        )
    if text is not None and tokens is not None:
        raise CommandLineError("pathkernels: pass --text or --tokens, not both (--tokens draws random token ids)")
    if text is not None and local.tokenizer is None:
        raise CommandLineError(
            f"pathkernels: --text needs a tokenizer, and {local.path} has none; pass --tokens N for random token ids"
        )
    try:
        return pk.adapters.local_model_inputs(local, text=text, num_tokens=tokens, batch=batch)
    except ValueError as error:
        raise CommandLineError(f"pathkernels: --text: {str(error).split(': ', 1)[-1]}") from None


def _sequence_length(local: LocalModel, inputs: dict) -> int:
    """The number of tokens the model sees: its input ids', or a vision model's patches (+1)."""
    if local.is_vision:
        config = local.model.config
        return (config.image_size // config.patch_size) ** 2 + 1
    return inputs["input_ids"].shape[-1]


# --- subcommands, as typed functions (the demo calls them too) --------------------------------------


def collapse_table(
    *,
    model: str | None = None,
    text: str | None = None,
    layers: int = 12,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    batch: int = 8,
    seeds: int = 3,
    device: str = "cpu",
    out: Path | None = None,
):
    """``pathkernels collapse``: print (and with ``out``, write) the median residual ratio by depth."""
    device = resolve_device(device, "collapse")
    if model:
        local = _local_model(model)
        inputs, what = _model_inputs(local, text, tokens, batch)
        config = local.model.config
        check_attention_fits(
            "collapse",
            batch=batch,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            tokens=_sequence_length(local, inputs),
            bytes_per_entry=16,  # the model's float32 maps and their stacked copy
            device=device,
        )
        inputs = {name: value.to(device) for name, value in inputs.items()}
        stack = pk.adapters.from_huggingface(local.model.to(device), **inputs)
        ratios = pk.metrics.residual_ratio(stack.hidden_states.double())  # [L+1, B]
        import pandas as pd

        table = pd.DataFrame(experiments.collapse_rows(model, ratios))
        title = f"{model}, {local.weights}; inputs: {what}"
        plot_title = f"Rank collapse: {model}, {local.weights}"
    else:
        tokens = 32 if tokens is None else tokens
        check_attention_fits(
            "collapse", batch=batch, layers=layers, heads=heads, tokens=tokens, bytes_per_entry=16, device=device
        )
        table = experiments.collapse_vs_depth(
            num_layers=layers,
            d_model=width,
            num_heads=heads,
            n=tokens,
            batch=batch,
            seeds=seeds,
            device=device,
            progress=True,
        )
        title = (
            f"pathkernels.models at initialisation (L = {layers}, H = {heads}, d = {width}, n = {tokens}, "
            f"{seeds} seed(s) × {batch} inputs)"
        )
        plot_title = "Rank collapse at initialisation"
    wide = table.pivot(index="depth", columns="variant", values="median")[list(dict.fromkeys(table["variant"]))]
    print(f"Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states by depth: {title}")
    print(wide.to_string(float_format=_float_format))
    if out is not None:
        _save(out, "collapse", table, experiments.plot_collapse(table, title=plot_title))
    return table


def paths_table(
    *,
    model: str | None = None,
    text: str | None = None,
    layers: int = 6,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    seed: int = 0,
    samples_per_length: int | None = None,
    max_exact: int = 10**6,
    device: str = "cpu",
    out: Path | None = None,
):
    """``pathkernels paths``: the residual ratio of the paths by length. Under torchrun the ranks
    split the tree (gloo on CPU, NCCL with cuda); rank 0 reports, the others return None."""
    device = resolve_device(device, "paths")
    with pk.distributed.launched_group(device) as distributed:
        if distributed and device == "cuda":
            device = f"cuda:{torch.cuda.current_device()}"
        if model:
            local = _local_model(model)
            inputs, what = _model_inputs(local, text, tokens)
            config = local.model.config
            check_attention_fits(
                "paths",
                batch=1,
                layers=config.num_hidden_layers,
                heads=config.num_attention_heads,
                tokens=_sequence_length(local, inputs),
                bytes_per_entry=40,  # the model's maps, a float64 copy and the engine's centred operands
                device="cpu",  # the model runs on the CPU; the maps move to the device after
            )
            stack = pk.adapters.from_huggingface(local.model, **inputs).to(torch.float64)
            attn = stack.attn
            source = (
                f"{model}, {local.weights} (L = {stack.num_layers}, H = {stack.num_heads}, "
                f"n = {attn.shape[-1]}); inputs: {what}"
            )
        else:
            tokens = 32 if tokens is None else tokens
            check_attention_fits(
                "paths", batch=1, layers=layers, heads=heads, tokens=tokens, bytes_per_entry=32, device="cpu"
            )
            torch.manual_seed(seed)
            network = pk.models.SelfAttentionNetwork.variant("+skip", d_model=width, num_heads=heads, num_layers=layers)
            with torch.no_grad():
                attn = network(torch.randn(1, tokens, width)).attn
            source = f"a '+skip' network at initialisation (L = {layers}, H = {heads}, n = {tokens})"
        attn = attn.to(device)
        total = pk.count_paths(attn.shape[1], attn.shape[2], skip=True)
        generator = torch.Generator().manual_seed(seed)
        if samples_per_length or total > max_exact:
            per_length = samples_per_length or 200
            dec = pk.decompose(attn, skip=True, samples_per_length=per_length, generator=generator, progress=True)
            how = f"up to {per_length} distinct paths drawn per length, of {total:,} (lengths with fewer: all, exactly)"
        else:
            dec = pk.decompose(attn, skip=True, progress=True)
            how = f"all {total:,} paths, exactly"
        if dec is None:  # another rank reports
            return None
        if distributed:
            how += f", split over {torch.distributed.get_world_size()} processes"
    table = dec.by_length()
    print(f"Residual ratio of the attention products P_p by path length: {source}; {how}")
    columns = [
        c
        for c in ("length", "path_count", "evaluated", "exact", "mean", "stderr", "median", "q10", "q90")
        if c in table.columns
    ]
    print(table[columns].to_string(index=False, float_format=_float_format))
    if out is not None:
        _save(out, "ratio_by_length", table, dec.plot())
    return table


# Paths enumerated by default: beyond this, `attribute` enumerates the longest lengths that fit.
_MAX_ATTRIBUTION_PATHS = 10**7


def _token_id(value: str, tokenizer, vocab: int, option: str) -> int:
    """A token id from ``--target`` / ``--versus``: an integer, or with a tokenizer one token's text."""
    try:
        token = int(value)
    except ValueError:
        if tokenizer is None:
            raise CommandLineError(f"pathkernels: {option}: expected a token id (an integer), got {value!r}") from None
        ids = tokenizer.encode(value, add_special_tokens=False)
        if len(ids) != 1:
            raise CommandLineError(
                f"pathkernels: {option}: expected text that is one token, got {value!r} ({len(ids)} tokens)"
            ) from None
        token = ids[0]
    if not 0 <= token < vocab:
        raise CommandLineError(f"pathkernels: {option}: expected a token id in [0, {vocab}), got {token}")
    return token


class _Clock:
    """A command's ``--time-limit``: the seconds it has left, from the start of its work."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds
        self.end = math.inf if seconds is None else self.start + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.end - time.monotonic()


# Worker threads left running past the time limit (a search still in its set-up): the process
# does not wait for them when it ends (main, as the program's entry point).
_ABANDONED: list[threading.Thread] = []


def _within(seconds: float, function, *args, **kwargs):
    """``(True, function(*args, **kwargs))`` if it returns within ``seconds``, else ``(False,
    None)``, the call left to finish in a daemon thread (its result dropped): for work that a
    time limit cannot stop from outside, such as the set-up of :func:`pathkernels.top_paths`'
    bounds. Its exception, if it raises in time, is raised here."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 (handed to the caller)
            outcome["error"] = error

    worker = threading.Thread(target=run, name="pathkernels-bounded", daemon=True)
    worker.start()
    worker.join(None if math.isinf(seconds) else max(seconds, 0.0))
    if worker.is_alive():
        _ABANDONED.append(worker)
        return False, None
    if "error" in outcome:
        raise outcome["error"]
    return True, outcome["value"]


def _gpt2_bytes(config, tokens: int) -> int:
    """Bytes a GPT-2 built from ``config`` needs in float64 for ``tokens`` tokens: its parameters
    (initialised in float32, then a float64 copy: 12 bytes each) and its capture (the attention
    maps and their copies, 40 bytes per entry, and about 24 activations of [n, d] per layer)."""
    d, layers, heads = config.n_embd, config.n_layer, config.n_head
    parameters = (config.vocab_size + config.n_positions) * d + layers * (12 * d * d + 13 * d) + 2 * d
    return 12 * parameters + 40 * layers * heads * tokens * tokens + 8 * 24 * layers * tokens * d


def attribute_table(
    *,
    model: str | None = None,
    text: str | None = None,
    layers: int = 4,
    heads: int = 4,
    width: int = 64,
    tokens: int | None = None,
    seed: int = 0,
    target: str | None = None,
    versus: str | None = None,
    position: int | None = None,
    top: int = 10,
    max_length: int | None = None,
    time_limit: float | None = 300.0,
    out: Path | None = None,
):
    """``pathkernels attribute``: each path's attribution to a logit difference at one token of a
    model built from a config (or a local model), the sums by length and by source, and the top
    and bottom paths; with ``out`` also CSV files and a plot. A model with more than 10^7 paths
    gets its sums from the paths of the lengths that fit, and its top and bottom paths from the
    certified search (pk.top_paths).

    ``time_limit`` (seconds, None for none) bounds the whole command: building and capturing the
    model (which cannot be stopped part-way: they run in a thread, left behind at the limit), the
    walk over the paths (lengths 0, 1, … each walked whole within the limit: the longest that
    finished is reported, what the longer paths carry stays exact) and the two searches (each
    given half of what is left; at the limit a search returns its best list with its gap, or, if
    its set-up alone outlasts it, nothing). What stopped where is printed. Work that would not fit
    the machine's memory is refused before any is done. Returns the PathAttribution, or None when
    the limit came before any path was attributed."""
    import pandas as pd
    import transformers

    clock = _Clock(time_limit)
    if model:
        local = _local_model(model)
        if local.is_vision:
            raise CommandLineError(
                f"pathkernels attribute: --model {model} is a vision model, with no logits to attribute"
            )
        inputs, what = _model_inputs(local, text, tokens)
        config = local.model.config
        parameters = sum(p.numel() for p in local.model.parameters() if p.dtype != torch.float64)
        check_fits(
            8 * parameters,
            torch.device("cpu"),
            "pathkernels attribute",
            f"the model's float64 copy ({parameters:,} parameters) needs about",
            "attribute a smaller model, or one saved in float64",
            error=CommandLineError,
        )
        check_attention_fits(
            "attribute",
            batch=1,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            tokens=_sequence_length(local, inputs),
            bytes_per_entry=40,  # the float64 maps, the capture's copies and the walk's token maps
            device="cpu",
        )
        build, tokenizer = local.model.double, local.tokenizer
        source = f"{model}, {local.weights}; inputs: {what}"
    else:
        tokens = 16 if tokens is None else tokens
        config = transformers.GPT2Config(
            n_layer=layers,
            n_head=heads,
            n_embd=width,
            vocab_size=1000,
            n_positions=max(tokens, 16),
            bos_token_id=0,
            eos_token_id=0,
        )
        check_fits(
            _gpt2_bytes(config, tokens),
            torch.device("cpu"),
            "pathkernels attribute",
            f"a GPT-2 of L = {layers}, H = {heads}, d = {width} and its capture of {tokens} tokens need about",
            "pass a smaller --layers, --width or --tokens",
            error=CommandLineError,
        )
        inputs, tokenizer = None, None  # the token ids are drawn after the model, from the same seed
        source = f"a GPT-2 built from a config (L = {layers}, H = {heads}, d = {width}), {tokens} random token ids"

        def build():
            torch.manual_seed(seed)
            return transformers.GPT2LMHeadModel(config).double()

    # Building and capturing cannot be stopped part-way (minutes for a large model): they run aside
    # and are left behind at the limit.
    done, network = _within(clock.left(), build)
    if not done:
        return _stopped(clock, "building the model")
    if inputs is None:
        inputs = {"input_ids": torch.randint(0, 1000, (1, tokens))}
    try:
        done, captured = _within(clock.left(), pk.adapters.capture_huggingface_residual, network, **inputs)
    except ValueError as error:
        raise CommandLineError(f"pathkernels attribute: {str(error).split(': ', 1)[-1]}") from None
    if not done:
        return _stopped(clock, "capturing the model")
    stack = captured[0]
    n = stack.attn.shape[-1]
    position = n - 1 if position is None else position
    if not -n <= position < n:
        raise CommandLineError(f"pathkernels: --position: expected a token position in [-{n}, {n}), got {position}")
    position %= n
    try:
        weight, bias, vocab = unembedding(network, "pathkernels attribute")
    except ValueError as error:
        raise CommandLineError(str(error)) from None
    with torch.no_grad():
        output = network.eval()(**inputs)
    if getattr(output, "logits", None) is not None:
        logits = output.logits[0, position].double()
    else:  # a base model with tied embeddings (AutoModel): its last hidden state is the final norm's output
        logits = output.last_hidden_state[0, position].double() @ weight.double().T
        logits = logits if bias is None else logits + bias.double()
    ranked = torch.argsort(logits, descending=True).tolist()
    a = ranked[0] if target is None else _token_id(target, tokenizer, vocab, "--target")
    b = next(t for t in ranked if t != a) if versus is None else _token_id(versus, tokenizer, vocab, "--versus")
    if a == b:
        raise CommandLineError(f"pathkernels: --versus: expected a token other than --target ({a})")
    layers_, heads_ = stack.num_layers, stack.num_heads
    everything = count_attribution_paths(layers_, heads_, layers_)
    search = max_length is None and everything > _MAX_ATTRIBUTION_PATHS  # top paths by the certified search
    if max_length is None:
        max_length = max(
            (k for k in range(layers_ + 1) if count_attribution_paths(layers_, heads_, k) <= _MAX_ATTRIBUTION_PATHS),
            default=0,
        )
    elif max_length > layers_:
        raise CommandLineError(
            f"pathkernels: --max-length: expected at most the model's {layers_} layers, got {max_length}"
        )
    readout = pk.logit_diff(network, a, b)
    wanted = max_length
    # The searches get half of what is left after the walk; the walk the rest (all of it without them).
    walk_end = time.monotonic() + (clock.left() / 2 if search else clock.left())
    result, max_length = _attribution_walk(stack, readout, position, top, wanted, walk_end)
    paths = count_attribution_paths(layers_, heads_, max_length)

    def token_text(token: int) -> str:
        return f"{token} ({tokenizer.decode([token])!r})" if tokenizer is not None else str(token)

    value, constant = float(result.value[0, 0]), float(result.constant[0, 0])
    print(f"Path attribution of {source}")
    print(
        f"readout: logit[{token_text(a)}] − logit[{token_text(b)}] at token {position} = {value:.6g} "
        f"(the model's own: {float(logits[a] - logits[b]):.6g}); {constant:.4g} of it is constant "
        "(the final norm's β and the unembedding bias)"
    )
    if paths == everything:
        closure = float(result.unenumerated[0, 0])
        print(f"paths: all {paths:,}, exactly (Σ attributions + constant − readout = {-closure:.2g})")
    else:
        print(
            f"paths: the {paths:,} through at most {max_length} head{'' if max_length == 1 else 's'}, of "
            f"{everything:,}; the longer ones carry "
            f"{float(result.unenumerated[0, 0]):.6g} together (exact)"
        )
    if max_length < wanted:
        print(
            f"time limit: the walk stopped at the --time-limit of {clock.seconds:g} s before the "
            f"{count_attribution_paths(layers_, heads_, max_length + 1):,} paths through at most {max_length + 1} "
            f"heads ({clock.elapsed():.1f} s in); a larger --time-limit reaches them"
        )
    lengths = pd.DataFrame(
        {
            "length": range(max_length + 1),
            "paths": result.counts.sum(0)[: max_length + 1].tolist(),
            "attribution": result.by_length[: max_length + 1, 0, 0].tolist(),
        }
    )
    sources = pd.DataFrame(
        {
            "source": result.source_names,
            "paths": result.counts.sum(1).tolist(),
            "attribution": result.by_source[:, 0, 0].tolist(),
        }
    )
    rows = {"largest": result.table(), "smallest": result.table(which="bottom")}
    of_all = {"largest": "", "smallest": ""}  # the tables' reach: the enumerated paths, or all of them
    if search:  # the top and bottom of every path, not only of the enumerated ones
        for which in ("largest", "smallest"):
            share = clock.left() / (2 if which == "largest" else 1)
            if share <= 0:
                print(f"the {top} {which} of all paths: not searched, the --time-limit of {clock.seconds:g} s is spent")
                continue
            # The search stops itself at its time limit, but not within the set-up of its bounds
            # (minutes for a GPT-2-small shape): it runs aside, and is left behind at the limit.
            done, found = _within(
                share + 1.0,
                pk.top_paths,
                stack,
                readout,
                top,
                position=position,
                largest=which == "largest",
                time_limit=None if math.isinf(share) else share,
            )
            if not done:
                print(
                    f"the {top} {which} of all paths: not searched, the set-up of the search's bounds outlasted "
                    f"the --time-limit of {clock.seconds:g} s (those of the enumerated paths are shown)"
                )
                break  # the other search's set-up would take as long
            verdict = (
                "certified"
                if found.certified
                else f"not certified ({found.stopped}): no other path exceeds {found.bound:.4g} in size"
            )
            print(
                f"the {top} {which} of all paths: a best-first search visited {found.visited:,} paths in "
                f"{found.seconds:.1f} s, {verdict}"
            )
            rows[which], of_all[which] = found.table(), f" of all {everything:,} paths"
    best_rows, worst_rows = rows["largest"], rows["smallest"]
    ranked = of_all["largest"] if of_all["largest"] == of_all["smallest"] else ""
    best, worst = pd.DataFrame(best_rows), pd.DataFrame(worst_rows)
    for title, table in (
        ("by number of heads", lengths),
        ("by source", sources),
        (f"the {top} largest{of_all['largest']}", best),
        (f"the {top} smallest{of_all['smallest']}", worst),
    ):
        _heading(f"Attribution {title}")
        print(table.to_string(index=False, float_format=_float_format))
    if out is not None:
        for name, table in (
            ("attribution_by_length", lengths),
            ("attribution_by_source", sources),
            ("attribution_top", best),
            ("attribution_bottom", worst),
        ):
            _save(out, name, table)
        label = f"attribution to logit[{a}] − logit[{b}] at token {position}"
        title = f"top and bottom paths{ranked} (the readout: {value:.4g})"
        _save(out, "attribution", figure=path_bars(best_rows, worst_rows, label, title))
    return result


def _stopped(clock: _Clock, stage: str) -> None:
    """Say that ``attribute`` reached its time limit after ``stage``, before any path."""
    print(
        f"pathkernels attribute: stopped at the --time-limit of {clock.seconds:g} s while {stage} "
        f"({clock.elapsed():.1f} s in): no path attributed; a larger --time-limit goes on to the paths"
    )


def _attribution_walk(stack, readout, position: int, top: int, wanted: int, end: float):
    """``(result, k)``: :func:`pathkernels.path_attribution` of the paths through at most k heads
    for the largest ``k <= wanted`` whose walk finishes by ``end`` (``time.monotonic()``).

    Lengths 0 and up, each walk whole (what the longer paths carry together is exact in each): a
    walk still running at ``end`` is stopped between two chunks and the previous one is kept.
    After each walk the next goes straight to ``wanted`` when the rate just measured says it
    takes at most half of what is left. Length 0 (a few paths) runs whatever the limit."""
    layers, heads = stack.num_layers, stack.num_heads
    counts = [count_attribution_paths(layers, heads, k) for k in range(wanted + 1)]
    result, done, k, seconds_per_path = None, -1, 0, math.inf
    while True:
        started = time.monotonic()
        try:
            with time_limit(end) if k > 0 else contextlib.nullcontext():
                result = pk.path_attribution(
                    stack,
                    readout,
                    positions=position,
                    max_length=k,
                    top_k=top,
                    progress=k == wanted or (done >= 0 and seconds_per_path * counts[k] > 10),
                )
        except TimeLimitReached:
            return result, done
        done, seconds_per_path = k, (time.monotonic() - started) / counts[k]
        if k == wanted:
            return result, done
        k = wanted if seconds_per_path * counts[wanted] <= (end - time.monotonic()) / 2 else k + 1


def bench_tables(
    *, device: str = "cpu", quick: bool = False, out_file: Path | None = None, out_dir: Path | None = None
) -> tuple[object, object]:
    """``pathkernels bench``: both benchmark tables; ``out_file`` is written as JSON (or CSV by
    its suffix), ``out_dir`` gets two CSV files (the demo's)."""
    import pandas as pd

    device = resolve_device(device, "bench")
    min_run_time = 0.2 if quick else 1.0
    machine = machine_description(device)
    print(
        "Quick timings of a few runs each: on a shared or busy machine they move by 10-50 % from run to run,\n"
        "so read the speed-ups as orders of magnitude; bench/ times with repetitions and records its results.\n"
    )
    print(f"Fused norms against pure PyTorch on {machine} (float32)")
    norm_rows = [
        row for shape in QUICK_NORM_CASES for row in norm_benchmark(shape, torch.float32, device, min_run_time)
    ]
    print(format_norm_table(norm_rows))
    print()
    print("Path engine (complete trees with skip) against the level-wise PyTorch baseline and the per-path loop")
    path_rows = [path_benchmark(*case, device=device, min_run_time=min_run_time) for case in QUICK_PATH_CASES]
    print(format_path_table(path_rows))
    norms, paths = pd.DataFrame(norm_rows), pd.DataFrame(path_rows)
    if out_dir is not None:
        _save(out_dir, "speed_norms", norms)
        _save(out_dir, "speed_paths", paths)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        if out_file.suffix == ".csv":
            pd.concat([norms.assign(table="norms"), paths.assign(table="paths")]).to_csv(out_file, index=False)
        else:
            payload = {"machine": machine, "torch": torch.__version__, "norms": norm_rows, "paths": path_rows}
            out_file.write_text(json.dumps(payload, indent=1, default=str))
        print(f"  wrote {out_file}")
    return norms, paths


def run_demo(args) -> int:
    start = time.perf_counter()
    quick = args.quick
    device = resolve_device(args.device, "demo")
    print(
        f"pathkernels {pk.__version__}, torch {torch.__version__}, {machine_description(device)}; "
        f"build: {pk.build_info()}"
    )
    _heading("1. The norm")
    print(worked_example())

    _heading("2. Rank collapse against depth at initialisation: pure attention, +MLP, +skip, transformer")
    collapse_table(
        layers=6 if quick else 12,
        width=32 if quick else 64,
        heads=4,
        tokens=16 if quick else 32,
        batch=4 if quick else 8,
        seeds=1 if quick else 3,
        out=args.out,
    )

    _heading("3. Residual ratio of every path, by length (exact)")
    paths_table(
        layers=4 if quick else 6,
        heads=3 if quick else 4,
        width=32,
        tokens=16 if quick else 32,
        device=device,
        out=args.out,
    )

    _heading("4. How the paths of common architectures spread over lengths: C(L, k) H^k of (H+1)^L")
    lengths = experiments.path_length_distribution()
    summary = []
    for name, rows in lengths.groupby("architecture", sort=False):
        layers, heads = int(rows["layers"].iloc[0]), int(rows["heads"].iloc[0])
        counts = rows["path_count"].tolist()  # exact ints: ties are ties, not rounding
        modes = [int(k) for k, count in zip(rows["length"], counts) if count == max(counts)]
        mode = (
            f"most common length {modes[0]}"
            if len(modes) == 1
            else f"most common lengths {' and '.join(map(str, modes))} (tied)"
        )
        short = rows[rows["length"] <= 3]["share"].sum()
        summary.append(
            f"  {name:<34} L = {layers:>2}, H = {heads:>2}: "
            f"(H+1)^L = 10^{layers * math.log10(heads + 1):.1f} paths, {mode}, share of length ≤ 3: "
            f"{short:.1e}"
        )
    print("\n".join(summary))
    _save(args.out, "path_lengths", lengths, experiments.plot_path_lengths(lengths))

    _heading("5. Path effectiveness: sorting with an attention-only model, keeping paths of length ≤ k")
    result = experiments.path_effectiveness(
        steps=200 if quick else 1000, test_size=512 if quick else 2048, progress=True
    )
    print(
        f"trained in {result.train_seconds:.0f} s (final loss {result.final_loss:.4f}); exact truncations by "
        "pk.length_sums; k = L is the model itself"
    )
    print(result.table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    _save(args.out, "path_effectiveness", result.table, experiments.plot_effectiveness(result.table))

    _heading("6. Speed against pure PyTorch (quick sizes; bench/ has the full suite)")
    bench_tables(device=device, quick=True, out_dir=args.out)
    print()
    print(f"demo finished in {time.perf_counter() - start:.0f} s" + (f"; outputs in {args.out}/" if args.out else ""))
    return 0


# --- the parser --------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one to show (not None, not a flag's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` on stderr, exit code 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _integer(minimum: int):
    """An argparse type: an int >= minimum, with a message that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


# Options of the built-in network, which a --model sets for itself: their defaults.
_NETWORK_DEFAULTS = {"layers": None, "heads": 4, "width": 64, "seeds": 3}


def _check_options(args, parser: argparse.ArgumentParser) -> None:
    """What argparse cannot check alone: options that do not apply, and the built-in network's shape."""
    if getattr(args, "model", None):
        given = [f"--{name}" for name in _NETWORK_DEFAULTS if getattr(args, name, None) is not None]
        if given:
            verbs = ("sets", "does") if len(given) == 1 else ("set", "do")
            parser.error(
                f"{', '.join(given)} {verbs[0]} the built-in network and {verbs[1]} not apply with --model "
                f"{args.model} (the model has its own)"
            )
        return
    if getattr(args, "text", None) is not None:
        parser.error("--text needs --model (a model directory with a tokenizer)")
    for name, default in _NETWORK_DEFAULTS.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, default if default is not None else args.default_layers)
    if hasattr(args, "tokens") and args.tokens is None:
        args.tokens = args.default_tokens
    if hasattr(args, "width") and args.width < args.heads:
        parser.error(
            f"argument --width: expected at least --heads = {args.heads} (each head gets width // heads "
            f"columns), got {args.width}"
        )


def build_parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = _Parser(
        prog="pathkernels",
        description="Path decompositions of attention networks: rank collapse, "
        "per-path residuals and benchmarks (docs/DESIGN.md has the math).",
        formatter_class=formatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"pathkernels {pk.__version__} (torch {torch.__version__}, CUDA kernels: "
        f"{'yes' if pk.build_info()['cuda'] else 'no'})",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of a failure")

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], formatter_class=formatter, **kwargs)
        sub.set_defaults(command_parser=sub)
        return sub

    device_help = "where to compute: auto (CUDA when a GPU and the CUDA kernels are present), cpu or cuda"

    demo = command(
        "demo",
        help="the main job: every experiment, with tables, CSV files and PNG plots",
        description="Every experiment in six sections, with tables printed and CSV/PNG files "
        "written: the norm, rank collapse, path residuals by length, path-length "
        "distributions, path effectiveness, and speed.",
    )
    demo.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="output folder")
    demo.add_argument("--quick", action="store_true", help="smaller sizes and a shorter training (about a minute)")
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    demo.set_defaults(run=run_demo)

    def model_options(sub, layers: int, tokens: int):
        sub.set_defaults(default_layers=layers, default_tokens=tokens)
        sub.add_argument(
            "--model",
            help="a local Hugging Face model directory (pretrained weights) or a config.json "
            "(random weights); nothing is downloaded",
        )
        sub.add_argument(
            "--text",
            help="with --model: a prompt for the model directory's tokenizer (default: a "
            "fixed sentence when there is a tokenizer)",
        )
        sub.add_argument("--layers", type=_integer(1), help=f"depth of the built-in network (default {layers})")
        sub.add_argument("--heads", type=_integer(1), help="heads per layer of the built-in network (default 4)")
        sub.add_argument("--width", type=_integer(1), help="d_model of the built-in network (default 64)")
        sub.add_argument(
            "--tokens",
            type=_integer(2),
            help=f"sequence length n (default {tokens}; with --model, random token ids of this length)",
        )
        sub.add_argument("--out", type=Path, help="folder to write CSV and PNG files into")

    collapse = command(
        "collapse",
        help="residual ratio of the hidden states against depth",
        description="Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states "
        "at every depth: the built-in pure-attention, +MLP, +skip and transformer "
        "networks at initialisation, or a Hugging Face model.",
    )
    model_options(collapse, layers=12, tokens=32)
    collapse.add_argument("--batch", type=_integer(1), default=8, help="random inputs per model")
    collapse.add_argument("--seeds", type=_integer(1), help="initialisations per variant (default 3)")
    collapse.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    collapse.set_defaults(run=_runner(collapse_table, *_MODEL_OPTIONS, "batch", "seeds", "device"))

    paths = command(
        "paths",
        help="residual ratio of every path (or a stratified sample), by length",
        description="Residual ratio of the attention product of every path with skip, by "
        "path length: exactly when the tree is small enough, else a stratified sample "
        "without replacement. Under torchrun the processes split the tree.",
    )
    model_options(paths, layers=6, tokens=32)
    paths.add_argument("--seed", type=_integer(0), default=0, help="seed of the network and of the sample")
    paths.add_argument(
        "--samples-per-length", type=_integer(1), help="draw up to this many paths per length instead of all"
    )
    paths.add_argument(
        "--max-exact", type=_integer(1), default=10**6, help="sample when the tree has more paths than this"
    )
    paths.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help=device_help + " (under torchrun: gloo on CPU, NCCL and cuda:LOCAL_RANK with cuda)",
    )
    paths.set_defaults(run=_runner(paths_table, *_MODEL_OPTIONS, "seed", "samples_per_length", "max_exact", "device"))

    attribute = command(
        "attribute",
        help="each path's share of a logit difference, and the top paths",
        description="Each path (a source: the embedding, a layer's constant rows or an MLP's output, "
        "then the heads it passes) gets its exact share of a logit difference at one token, the norms "
        "frozen at the forward pass: sums by length and by source, and the top and bottom paths. A "
        "GPT-2 built from a config, or a local model (GPT-2, BERT-style with an LM head, Llama family).",
    )
    model_options(attribute, layers=4, tokens=16)
    attribute.add_argument("--seed", type=_integer(0), default=0, help="seed of the built-in model and its tokens")
    attribute.add_argument(
        "--target", help="token id (or, with a tokenizer, one token's text); default: the top prediction"
    )
    attribute.add_argument("--versus", help="the token it is compared with; default: the second prediction")
    attribute.add_argument("--position", type=int, help="the token read out (default: the last)")
    attribute.add_argument("--top", type=_integer(1), default=10, help="how many top and bottom paths to show")
    attribute.add_argument(
        "--max-length",
        type=_integer(0),
        help=f"enumerate the paths of at most this many heads (default: every path, or the most that "
        f"keeps within {_MAX_ATTRIBUTION_PATHS:,})",
    )
    attribute.add_argument(
        "--time-limit",
        type=_seconds,
        default=300.0,
        help="seconds for the whole command (the model, its capture, the walk over the paths and, for a model "
        f"with more than {_MAX_ATTRIBUTION_PATHS:,} paths, the searches of the top and bottom paths): at the "
        "limit it reports what it found and says what was left",
    )
    attribute.set_defaults(
        run=_runner(
            attribute_table, *_MODEL_OPTIONS, "seed", "target", "versus", "position", "top", "max_length", "time_limit"
        )
    )

    bench = command(
        "bench",
        help="fused ops and the path engine against pure PyTorch",
        description="Quick timings of the fused norms and the path engine against pure "
        "PyTorch; bench/ has the full suite.",
    )
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    bench.add_argument("--quick", action="store_true", help="shorter timing")
    bench.add_argument("--out", type=Path, help="write both tables to this file: JSON, or CSV if it ends in .csv")
    bench.set_defaults(run=lambda args: _done(bench_tables(device=args.device, quick=args.quick, out_file=args.out)))
    return parser


def _done(_result) -> int:
    return 0


# The options that model_options adds, passed on by name to collapse_table and paths_table.
_MODEL_OPTIONS = ("model", "text", "layers", "heads", "width", "tokens", "out")


def _runner(function, *names: str):
    """A subcommand's ``run``: ``function`` called with the parsed options of those names."""
    return lambda args: _done(function(**{name: getattr(args, name) for name in names}))


def main(argv=None) -> int:
    code = _main(argv)
    if argv is None and any(worker.is_alive() for worker in _ABANDONED):
        # The program's entry point, with a search left running past the time limit: end now, as
        # an interpreter that waited for it (or tore torch down under it) would not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _check_options(args, args.command_parser)
    where = args.command_parser.prog
    try:
        out = getattr(args, "out", None)
        if out is not None:
            check_writable(out, "--out", args.command, folder=args.command != "bench")
        return args.run(args)
    except CommandLineError as error:
        if args.debug:
            raise
        # The helpers that several commands share say "pathkernels:"; the line names the command.
        message = str(error)
        print(
            f"{where}: {message.removeprefix('pathkernels: ')}" if message.startswith("pathkernels: ") else message,
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 (one line unless --debug)
        if args.debug:
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "(no message)"
        print(
            f"{where}: error: {type(error).__name__}: {reason} (rerun with --debug for the traceback)", file=sys.stderr
        )
        return 1
