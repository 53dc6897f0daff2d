"""What a command's work needs, by arithmetic on its options, before torch is imported.

The parser calls :func:`refuse_oversized` after parsing and before it imports the subcommand's
module (and with it torch, about 3 s on a loaded machine), so that work beyond the machine's
memory, or beyond the library's bound on the paths one call evaluates, is refused in a fraction of
a second with the estimate: never by the allocator's error, never by the system's out-of-memory
killer. A ``--model``'s shape is read from its ``config.json`` and its weights' size on disk.

The estimates are upper bounds of the peak the command reaches, measured against ``/usr/bin/time``
on the built-in networks (each formula says what it counts). They are checked against the memory
the host has available now; work on a GPU is checked again once torch can see the device. Like the
parser, this module imports neither torch, the library nor transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from pathkernels.app.cli.base import CommandLineError

# pk.decompose's default bound on the paths one call evaluates (pathkernels.core.paths.DEFAULT_MAX_PATHS).
MAX_PATHS = 10**10
# The engine's working memory beyond inputs and results (pathkernels.core.planner.DEFAULT_MEMORY_BUDGET).
ENGINE_BUDGET = 1 << 30
# pk.decompose streams the statistics of an exact tree whose per-path results exceed this (its
# max_result_bytes), or that has more than 2^31 paths, in the engine's budget.
MAX_RESULT_BYTES = 1 << 30
MAX_ENUMERATED_PATHS = 1 << 31
# The paths sampled or enumerated with a result each, per path: the [M, L] int64 path list and its
# copies (the draws, their concatenation, the tree built from them; measured: 6.3 copies at L = 12)
# and the results. Counted as 8 copies and 256 bytes.
PATH_LIST_COPIES = 8
PATH_RESULT_BYTES = 256

# A folder holds a tokenizer when it has one of these (as pathkernels.adapters.load_local_model reads it).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model")
# Families whose MLP has a gate (three d × d_ff matrices instead of two).
_GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2"}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def available_memory() -> int | None:
    """The host's available physical memory now (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def format_bytes(count: int) -> str:
    """``count`` bytes as messages print them: "512 bytes", "24.00 KiB (24,576 bytes)"."""
    if count < 1024:
        return f"{count:,} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.2f} {unit} ({count:,} bytes)"
    raise AssertionError


def check_memory(command: str, need: int, needs: str, advice: str) -> None:
    """Refuse ``need`` bytes beyond what the host has available, as
    "pathkernels COMMAND: {needs} {need}, more than the {available} available on cpu; {advice}"."""
    available = available_memory()
    if available is not None and need > available:
        raise CommandLineError(
            f"pathkernels {command}: {needs} {format_bytes(need)}, more than the {format_bytes(available)} "
            f"available on cpu; {advice}"
        )


def gpu_visible() -> bool:
    """Whether this machine may have an NVIDIA GPU (a device file), so that ``--device auto`` may
    run on it: then the device's memory is checked once torch is imported."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


# --- the built-in networks ---------------------------------------------------------------------


def gpt2_bytes(layers: int, heads: int, width: int, tokens: int) -> int:
    """Bytes ``attribute`` needs for its built-in GPT-2 (vocabulary 1000) and ``tokens`` tokens:
    its parameters (initialised in float32, then a float64 copy: 12 bytes each) and its capture
    (the float64 attention maps and their copies, 40 bytes per entry, and about 24 activations
    of [n, d] per layer)."""
    parameters = (1000 + max(tokens, 16)) * width + layers * (12 * width * width + 13 * width) + 2 * width
    return 12 * parameters + 40 * layers * heads * tokens * tokens + 8 * 24 * layers * tokens * width


def network_parameters(layers: int, heads: int, width: int, *, mlp: bool) -> tuple[int, int]:
    """``(parameters, largest)``: the parameter count of a ``pk.models.SelfAttentionNetwork`` (with
    an MLP of 4d and two LayerNorms per layer when ``mlp``, the transformer variant) and its
    largest parameter's, which its initialisation briefly holds twice."""
    d_head = width // heads
    attention = 4 * heads * width * d_head + width
    block = attention + (8 * width * width + 5 * width + 4 * width if mlp else 0)
    return layers * block, max(heads * width * d_head, 4 * width * width if mlp else 0)


def counts_by_length(layers: int, heads: int) -> list[int]:
    """The paths with skip through exactly k heads, k = 0..L: ``C(L, k) H^k`` (pk.count_by_length)."""
    counts, count = [], 1
    for k in range(layers + 1):
        counts.append(count)
        count = count * (layers - k) * heads // (k + 1)
    return counts


def paths_evaluated(layers: int, heads: int, samples_per_length: int | None, max_exact: int) -> tuple[int, bool]:
    """``(paths, kept)``: how many paths ``pathkernels paths`` evaluates, and whether each keeps a
    result (a sample, or an exact tree small enough; else the exact tree's statistics stream in
    the engine's budget)."""
    counts = counts_by_length(layers, heads)
    total = (heads + 1) ** layers
    if samples_per_length or total > max_exact:
        per_length = samples_per_length or 200
        return sum(min(per_length, count) for count in counts), True
    return total, total <= MAX_ENUMERATED_PATHS and 16 * total <= MAX_RESULT_BYTES


def _paths_bytes(command: str, layers: int, heads: int, samples_per_length: int | None, max_exact: int) -> int:
    """Refuse a decomposition beyond the library's bound on paths; else the bytes its paths take."""
    paths, kept = paths_evaluated(layers, heads, samples_per_length, max_exact)
    if paths > MAX_PATHS:
        hours = paths / 1e5 / 3600
        raise CommandLineError(
            f"pathkernels {command}: the decomposition would evaluate {paths:,} paths, more than the "
            f"{MAX_PATHS:,} that one call evaluates (about {hours:,.0f} hours at the 10^5 paths/s of 2 CPU cores); "
            "pass a smaller --samples-per-length or --max-exact (or fewer --layers or --heads)"
        )
    return paths * (PATH_LIST_COPIES * 8 * layers + PATH_RESULT_BYTES) if kept else ENGINE_BUDGET


# --- models given with --model -----------------------------------------------------------------


# pathkernels' fixtures (pathkernels.fixtures.FIXTURES): the folders beside that module that hold a
# fixture.json, found by their listing so that neither pathkernels.fixtures nor torch is imported.
FIXTURE_ROOT = Path(__file__).resolve().parents[2] / "fixtures"


def fixture_names() -> list[str]:
    """The names of pathkernels' fixtures, which ``--model`` takes from any folder."""
    try:
        return sorted(path.name for path in FIXTURE_ROOT.iterdir() if (path / "fixture.json").is_file())
    except OSError:
        return []


def model_folder(spec: str) -> Path:
    """What ``--model`` reads: a folder, or a ``config.json`` standing for the folder that holds it
    (its weights and tokenizer with it); a fixture's name (``attn_only_2l``, …) where no such path
    exists here, its folder; any other path as given (a config file of another name: random
    weights, no tokenizer)."""
    path = Path(spec)
    if not path.exists() and path.as_posix() in fixture_names():
        return FIXTURE_ROOT / path.as_posix()
    return path.parent if path.name == "config.json" and path.is_file() else path


def model_name(spec: str) -> str:
    """A ``--model``'s short name for tables, legends and titles: its folder's name (a config file's
    own name where it is not a folder's ``config.json``)."""
    folder = model_folder(spec)
    return folder.resolve().name if folder.is_dir() else folder.name


def has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in TOKENIZER_FILES)


def example_task(folder) -> dict:
    """The ``task`` of a fixture folder's ``fixture.json`` (what ``--example`` draws its input by),
    or CommandLineError for a folder that is not a fixture."""
    file = Path(folder) / "fixture.json"
    try:
        task = json.loads(file.read_text())["task"]
        if task.get("generator") != "pathkernels.fixtures.induction_batch":
            raise KeyError("generator")
        return task
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CommandLineError(
            f"--example: {folder} is not one of pathkernels' fixtures (no fixture.json with its example task); "
            "pass --ids, --text or --tokens instead"
        ) from None


def check_ids(ids: list[int] | None, vocab) -> None:
    """Refuse ``--ids`` beyond a vocabulary of ``vocab`` tokens (nothing to check without one)."""
    if ids is not None and isinstance(vocab, int) and max(ids) >= vocab:
        raise CommandLineError(f"--ids: expected token ids in [0, {vocab}) (the model's vocabulary), got {max(ids)}")


def direction_length(path: Path) -> int | None:
    """How many numbers a ``--direction`` file holds, read without torch: a text file's words, a
    ``.npy`` array's length from its header (None for a torch file, or one that is not a vector:
    the reader refuses it when the model is loaded)."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            return None
        if suffix == ".npy":
            import numpy as np

            shape = np.load(path, mmap_mode="r", allow_pickle=False).shape  # the header alone is read
            return shape[0] if len(shape) == 1 else None
        return len(path.read_text().replace(",", " ").split())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _first(config: dict, *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_shape(spec: str) -> dict | None:
    """A ``--model``'s shape from its config and weight files, without reading the weights: its
    type, layers, heads, width, tokens (a vision model's patches + 1, else None), the most
    positions it embeds (learned positions only), its parameters and the bytes they take loaded.
    None where the config cannot be read or lacks a field (the loader then says what is wrong)."""
    folder = model_folder(spec)
    config_file = folder / "config.json" if folder.is_dir() else folder
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    model_type = config.get("model_type")
    width = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    if width is None or layers is None or heads is None:
        return None
    tokens = None
    if model_type == "vit":
        image, patch = _first(config, "image_size"), _first(config, "patch_size")
        if image is None or patch is None:
            return None
        tokens = (image // patch) ** 2 + 1
    positions = None
    if model_type == "gpt2":
        positions = _first(config, "n_positions")
    elif model_type in ("bert", "opt"):
        positions = _first(config, "max_position_embeddings")
    elif model_type == "roberta" and _first(config, "max_position_embeddings"):
        pad = config.get("pad_token_id", 1)
        positions = config["max_position_embeddings"] - (pad if isinstance(pad, int) else 0) - 1
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    element = _DTYPE_BYTES.get(dtype if isinstance(dtype, str) else "float32", 4)
    weights = 0
    if folder.is_dir():
        weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern))
    if weights:
        parameters, loaded = weights // element, weights
    else:  # random weights from the config, in float32
        d_ff = _first(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * width
        vocab = _first(config, "vocab_size") or 0
        embeddings = vocab * width * (1 if config.get("tie_word_embeddings", True) else 2)
        matrices = 3 if model_type in _GATED else 2
        block = 4 * width * width + matrices * width * d_ff + 16 * width + 2 * d_ff  # and biases, norms
        parameters = embeddings + (positions or 0) * width + layers * block
        element, loaded = 4, 4 * parameters
    return {
        "type": model_type,
        "layers": layers,
        "heads": heads,
        "width": width,
        "tokens": tokens,
        "positions": positions,
        "parameters": parameters,
        "loaded": loaded,
        "float64": element == 8,
        "weights": bool(weights),
        "tokenizer": has_tokenizer(folder),
    }


def _model_tokens(command: str, spec: str, shape: dict, tokens: int | None, text, default: int) -> int | None:
    """The sequence length a ``--model`` will see, where it is known before tokenizing (None: a
    prompt through its tokenizer, checked once tokenized); refuses more tokens than the model
    embeds positions for."""
    if shape["tokens"] is not None:
        return shape["tokens"]
    if tokens is None and text is None and not shape["tokenizer"]:
        tokens = default
    limit = shape["positions"]
    if tokens is not None and limit is not None and tokens > limit:
        raise CommandLineError(
            f"pathkernels {command}: --tokens {tokens}: the model {spec} embeds positions for at most "
            f"{limit} tokens; pass --tokens {limit} or fewer"
        )
    return tokens


def _describe_model(spec: str, shape: dict) -> str:
    return (
        f"the model {spec} (a {shape['type']} of L = {shape['layers']}, H = {shape['heads']}, d = {shape['width']}: "
        f"about {shape['parameters']:,} parameters)"
    )


# --- the commands --------------------------------------------------------------------------------


def refuse_oversized(args) -> None:
    """Refuse, before torch is imported, a command whose work would not fit: the attention maps,
    the model and its capture, the paths. Commands without a size (demo, bench) pass."""
    command = args.command
    if command not in ("attribute", "paths", "collapse", "scores"):
        return
    model = getattr(args, "model", None)
    if model:
        shape = model_shape(model)
        if shape is None:
            return  # the loader says what is wrong with it
        _refuse_model(command, args, shape)
    else:
        _refuse_builtin(command, args)


def _refuse_builtin(command: str, args) -> None:
    layers, heads, width, tokens = args.layers, args.heads, args.width, args.tokens
    if command in ("attribute", "scores"):
        check_memory(
            command,
            gpt2_bytes(layers, heads, width, tokens),
            f"a GPT-2 of L = {layers}, H = {heads}, d = {width} and its capture of {tokens} tokens need about",
            "pass a smaller --layers, --width or --tokens",
        )
        return
    if command == "paths":
        check_memory(
            "paths",
            32 * layers * heads * tokens * tokens,
            f"1 × {layers} layers × {heads} heads × {tokens}² tokens of attention need about",
            "pass fewer --tokens (or a smaller network)",
        )
        parameters, largest = network_parameters(layers, heads, width, mlp=False)
        paths = _paths_bytes("paths", layers, heads, args.samples_per_length, args.max_exact)
        activations = 8 * (layers + 2) * tokens * width + 32 * layers * heads * tokens * tokens
        check_memory(
            "paths",
            4 * (parameters + largest) + activations + paths,
            f"a '+skip' network of L = {layers}, H = {heads}, d = {width} ({parameters:,} parameters), its "
            f"attention over {tokens} tokens and the paths it evaluates need about",
            "pass a smaller --width, --layers, --heads, --tokens or --samples-per-length",
        )
        return
    batch = args.batch
    if args.device == "cuda" or (args.device == "auto" and gpu_visible()):
        parameters, largest = network_parameters(layers, heads, width, mlp=True)
        check_memory(  # each network is initialised on the CPU in float32, then moved to the device
            "collapse",
            4 * (parameters + largest) + 8 * batch * tokens * width,
            f"a transformer of L = {layers}, H = {heads}, d = {width} ({parameters:,} parameters) needs about",
            "pass a smaller --width or --layers",
        )
        return  # the device's memory is checked once torch can see it
    check_memory(
        "collapse",
        16 * batch * layers * heads * tokens * tokens,
        f"{batch} × {layers} layers × {heads} heads × {tokens}² tokens of attention need about",
        "pass fewer --tokens (or a smaller --batch or network)",
    )
    check_memory(
        "collapse",
        collapse_bytes(layers, heads, width, tokens, batch),
        f"the networks of L = {layers}, H = {heads}, d = {width} (the transformer variant: "
        f"{network_parameters(layers, heads, width, mlp=True)[0]:,} parameters) and their activations "
        f"for {batch} × {tokens} tokens need about",
        "pass a smaller --width, --layers, --tokens or --batch",
    )


def collapse_bytes(layers: int, heads: int, width: int, tokens: int, batch: int) -> int:
    """Bytes ``collapse`` needs on one device for its built-in networks: the largest (the
    transformer variant) in float64 with the previous one not yet freed and a float32 copy
    converting (20 bytes per parameter), and the float64 activations: the attention maps and
    their stacked copy (16 bytes per entry), the hidden states and their stacked copy, and one
    layer's queries, keys, values and MLP."""
    parameters, largest = network_parameters(layers, heads, width, mlp=True)
    attention = 16 * batch * layers * heads * tokens * tokens
    activations = 8 * batch * tokens * width * (2 * (layers + 1) + 12)
    return 20 * parameters + 8 * largest + attention + activations


def _refuse_model(command: str, args, shape: dict) -> None:
    default = 16 if command in ("attribute", "scores") else 32
    model = args.model
    n = _model_tokens(command, model, shape, args.tokens, args.text, default)
    layers, heads, width = shape["layers"], shape["heads"], shape["width"]
    batch = getattr(args, "batch", 1) if command == "collapse" else 1
    attention = {"attribute": 40, "scores": 48, "paths": 40, "collapse": 16}[command]
    if n is not None:
        check_memory(
            command,
            attention * batch * layers * heads * n * n,
            f"{batch} × {layers} layers × {heads} heads × {n}² tokens of attention need about",
            "pass fewer --tokens" + (" or a smaller --batch" if command == "collapse" else ""),
        )
    need = shape["loaded"]  # the model as loaded
    copy = ""
    if command in ("attribute", "scores") and not shape["float64"]:
        need += 8 * shape["parameters"]
        copy = " with its float64 copy"
    if n is not None:
        need += attention * batch * layers * heads * n * n + 8 * 24 * batch * layers * n * width
    if command == "paths":
        need += _paths_bytes("paths", layers, heads, args.samples_per_length, args.max_exact)
    if command == "collapse" and args.device != "cpu" and (args.device == "cuda" or gpu_visible()):
        need = shape["loaded"]  # the CPU holds the model as loaded; the device is checked with torch
    what = _describe_model(model, shape) + copy
    if n is not None:
        what += f" and its capture of {batch} × {n} tokens" if batch > 1 else f" and its capture of {n} tokens"
    check_memory(command, need, f"{what} need about", "pass a smaller model or fewer --tokens")
