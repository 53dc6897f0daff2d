"""The ``pathkernels`` command line (also ``python -m pathkernels``).

    pathkernels demo [--out DIR] [--quick]      the main job: every experiment, tables, CSV and PNG
    pathkernels collapse [--model PATH] ...     residual ratio against depth
    pathkernels paths [--model PATH] ...        residual ratio of the paths, by length
    pathkernels attribute [--model PATH] ...    each path's share of a logit difference, top paths
    pathkernels scores [--model PATH] ...       where a head looks: its scores by pairs of paths
    pathkernels graph --model PATH --transcoders DIR ...   a prompt's attribution graph through features
    pathkernels bench [--device cuda] ...       fused ops and the engine against pure PyTorch

``--model`` takes a local Hugging Face model directory (its weights are loaded, nothing is
downloaded; a directory without weights, or its ``config.json``, gives a model at initialisation
from the config, with the directory's tokenizer either way), a config file of another name
(random weights, no tokenizer), or from any folder the name of one of pathkernels' fixtures
(``attn_only_2l``: :mod:`pathkernels.fixtures`). Without it the commands use
:mod:`pathkernels.app.models`.

Every error is one line on stderr, ``pathkernels COMMAND: message``: exit code 2 for a bad option
or input (refused before any work where it can be), 1 for an unexpected failure while running;
``--debug`` shows the traceback instead. Before any work, ``--out`` is checked for writability, and
the memory the command needs (its network or model, the attention maps, the paths) is estimated
from the options alone and checked against what the machine has (:mod:`.sizes`, before torch is
imported, so that oversized work is refused at once); so are the token positions, layers, heads and
token ids the options name, against a ``--model``'s config and the input's length where the options
give it. Progress shows as bars on a terminal, and as
a plain line about every 10 s elsewhere (a log).

This module is the parser and ``main``: it imports neither torch nor the library, so that
``--help`` answers at once. Each subcommand is a module of its own (``demo``, ``collapse``,
``paths``, ``attribute``, ``scores``, ``graph``, ``bench``; ``common`` and ``base`` what they share),
imported when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from pathkernels.app.cli.base import (
    ABANDONED,
    BUILT_IN_VOCAB,
    DEFAULT_TOKENS,
    DIRECTION_FORMS,
    MAX_ATTRIBUTION_PATHS,
    CommandLineError,
    check_writable,
    error_line,
)
from pathkernels.app.cli.sizes import fixture_names

DEFAULT_OUT = "demo_output"


# --- the parser --------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one to show (not None, not a flag's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: message`` on stderr, exit code 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (--help lists the options)\n")


class _Version(argparse.Action):
    """``--version``: pathkernels', torch's and the build's versions, without importing torch (the
    installed torch's version from its metadata, the build's from the file the build writes beside
    the extension)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        help = "show program's version number and exit" if help is None else help
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(version_line() + "\n", sys.stdout)
        parser.exit()


def version_line() -> str:
    """``pathkernels 0.1.0 (torch 2.13.0+cpu, CUDA kernels: no)``, read without importing torch; a
    build the installed torch does not match, or one not found, says so."""
    import importlib.metadata
    import importlib.util

    from pathkernels import __version__

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return f"pathkernels {__version__} (torch: not installed)"
    spec = importlib.util.find_spec("pathkernels._C")
    info_file = None if spec is None or spec.origin is None else Path(spec.origin).with_name("_build_info.json")
    try:
        info = json.loads(info_file.read_text()) if info_file is not None else None
    except (OSError, ValueError):
        info = None
    if info is None:
        return f"pathkernels {__version__} (torch {torch_version}, the compiled extension: not found; make build)"
    cuda = f"yes, CUDA {info['cuda_version']}" if info.get("cuda") else "no"
    built = info.get("torch_version")
    mismatch = "" if built == torch_version else f"; built against torch {built}: rebuild (make build)"
    return f"pathkernels {__version__} (torch {torch_version}, CUDA kernels: {cuda}{mismatch})"


def _integer(minimum: int, maximum: int | None = None):
    """An argparse type: an int >= minimum (and <= maximum), with a message that says so."""
    expected = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    parse.__name__ = expected
    return parse


def _token_ids(text: str) -> list[int]:
    """An argparse type: at least two token ids (integers >= 0), separated by commas or spaces."""
    words = text.replace(",", " ").split()
    try:
        ids = [int(word) for word in words]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids (integers) separated by commas, got {text!r}") from None
    if len(ids) < 2 or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected at least 2 token ids, each >= 0, got {text!r}")
    return ids


_SEED = _integer(0, 2**64 - 1)  # torch's generators take 64-bit seeds


def _fraction(text: str) -> float:
    """A number in [0, 1] (a share of influence)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


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


def _check_paths(args) -> None:
    """--model and --direction, from the folder's listing and the small files alone (CommandLineError
    before anything is imported, in a fraction of a second): a path that is not there, a folder
    without ``config.json``, a config that is not JSON or names no ``model_type``, ``--example`` for
    a folder that is not one of the fixtures, ``--ids`` beyond the config's vocabulary, ``--text``
    for a folder without a tokenizer, and a text or ``.npy`` direction whose length is not the
    config's hidden size. A fixture's name stands for its folder (:func:`.sizes.model_folder`)."""
    from pathkernels.app.cli.sizes import (
        check_ids,
        direction_length,
        example_task,
        has_tokenizer,
        model_folder,
        model_shape,
    )

    model, direction = getattr(args, "model", None), getattr(args, "direction", None)
    folder = model_folder(model) if model else None  # a fixture's name too, from any folder
    if folder is not None and not folder.exists():
        raise CommandLineError(
            f"--model {model}: no such file or directory (models are never downloaded); expected a model folder, "
            f"a config file or the name of one of pathkernels' fixtures ({', '.join(fixture_names())})"
        )
    if direction and not Path(direction).exists():
        raise CommandLineError(f"--direction {direction}: no such file")
    transcoders = getattr(args, "transcoders", None)
    if transcoders is not None and not model:
        raise CommandLineError(f"--transcoders {transcoders} needs --model (the model whose MLPs the set replaces)")
    if transcoders is not None and not Path(transcoders).is_dir():
        raise CommandLineError(f"--transcoders {transcoders}: no such folder; expected a folder of transcoder files")
    if not model:
        return
    config_file = folder / "config.json" if folder.is_dir() else folder
    if not config_file.is_file():
        raise CommandLineError(
            f"--model {model}: a folder without config.json; expected a Hugging Face model folder (config.json, "
            "its weights and tokenizer) or a config file"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CommandLineError(
            f"--model {model}: not a JSON config file ({error}); expected a model folder or a config"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CommandLineError(
            f"--model {model}: {config_file.name} names no model_type; expected a transformers config "
            '(such as {"model_type": "gpt2", ...})'
        )
    if getattr(args, "example", False):
        example_task(folder)  # refuses a folder that is not a fixture
    check_ids(getattr(args, "ids", None), config.get("vocab_size"))
    if getattr(args, "text", None) is not None and not has_tokenizer(folder):
        raise CommandLineError(f"--text needs a tokenizer, and {folder} has none; pass --tokens N for random token ids")
    shape = model_shape(model) if direction is not None else None
    if shape is not None:
        length = direction_length(Path(direction))
        if length is not None and length != shape["width"]:
            raise CommandLineError(
                f"--direction {direction}: has shape [{length}]; expected {DIRECTION_FORMS} with d = "
                f"{shape['width']} (the model's hidden size)"
            )


def _check_options(args, parser: argparse.ArgumentParser) -> None:
    """What argparse cannot check alone: options that do not apply and the built-in network's shape
    (argparse's error: exit 2), and what the options alone show to be wrong in the inputs (the paths,
    attribute's token ids and position: CommandLineError)."""
    if getattr(args, "direction", None) is not None:
        given = [f"--{name}" for name in ("target", "versus") if getattr(args, name, None) is not None]
        if given:
            parser.error(
                f"{' and '.join(given)} {'choose' if len(given) > 1 else 'chooses'} the logit difference, and "
                f"--direction {args.direction} replaces it: pass one or the other"
            )
    if getattr(args, "model", None):
        given = [f"--{name}" for name in _NETWORK_DEFAULTS if getattr(args, name, None) is not None]
        if given:
            verbs = ("sets", "does") if len(given) == 1 else ("set", "do")
            parser.error(
                f"{', '.join(given)} {verbs[0]} the built-in network and {verbs[1]} not apply with --model "
                f"{args.model} (the model has its own)"
            )
    given = [f"--{name}" for name in ("text", "tokens", "ids", "example") if getattr(args, name, None)]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} each choose the input: pass one of them")
    for name in ("ids", "example"):
        if getattr(args, name, None) and not getattr(args, "model", None):
            parser.error(
                f"--{name} needs --model (a model folder{', one of the fixtures' if name == 'example' else ''})"
            )
    _check_paths(args)
    if getattr(args, "model", None):
        _check_model_inputs(args)  # from its config and folder, before its weights are read
        return
    if getattr(args, "text", None) is not None:
        parser.error("--text needs --model (a model directory with a tokenizer)")
    for name, default in _NETWORK_DEFAULTS.items():
        if hasattr(args, name) and getattr(args, name) is None:
            setattr(args, name, default if default is not None else args.default_layers)
    if hasattr(args, "tokens") and args.tokens is None:
        args.tokens = DEFAULT_TOKENS[args.command]
    if hasattr(args, "width") and args.width < args.heads:
        parser.error(
            f"argument --width: expected at least --heads = {args.heads} (each head gets width // heads "
            f"columns), got {args.width}"
        )
    if args.command in ("attribute", "scores") and args.width % args.heads:
        parser.error(
            f"argument --width: expected a multiple of --heads = {args.heads} (the built-in GPT-2 splits its "
            f"width evenly among its heads), got {args.width}"
        )
    if args.command == "scores":  # the built-in network: its layers, heads and tokens are known now
        _check_head_and_tokens(args, args.layers, args.heads, args.tokens)
    if args.command == "attribute":  # the built-in network: its tokens, layers and vocabulary are known now
        no_text = "token text needs a --model with a tokenizer"
        _check_attribute(args, args.layers, args.tokens, None, BUILT_IN_VOCAB, no_text)


# Families the adapters read whose attention is not causal: a key may follow its query.
_BIDIRECTIONAL = {"vit", "bert", "roberta"}


def _check_model_inputs(args) -> None:
    """What a ``--model``'s config and folder show to be wrong in the options, before its weights are
    read (CommandLineError): ``--ids`` longer than the positions it embeds; for ``scores`` the layer,
    the head and the token positions (a key after the query of a causal model among them), for
    ``attribute`` the position, ``--max-length`` and the token ids of ``--target`` and ``--versus``.
    Positions are checked against the input's length where the options give it (``--tokens``,
    ``--ids``, ``--example``, a vision model's patches, the default random tokens), else (a prompt still
    to be tokenized) against the positions the model embeds, where it has learned ones."""
    from pathkernels.app.cli.sizes import example_task, model_folder, model_shape

    shape = model_shape(args.model)
    if shape is None:
        return  # the loader says what is wrong with the config
    model, folder, limit = args.model, model_folder(args.model), shape["positions"]
    if args.ids is not None and limit is not None and len(args.ids) > limit:
        raise CommandLineError(
            f"--ids: {len(args.ids)} token ids; expected at most {limit}, the positions the model {model} embeds"
        )
    if shape["tokens"] is not None:  # a vision model: its image patches and the class token
        tokens = shape["tokens"]
    elif args.example:
        tokens = 2 * int(example_task(folder)["length"]) + 1  # pathkernels.fixtures.induction_batch's length
    elif args.ids is not None:
        tokens = len(args.ids)
    elif args.tokens is not None or args.text is not None or shape["tokenizer"]:
        tokens = args.tokens  # None: a prompt, its length known once tokenized
    else:
        tokens = DEFAULT_TOKENS[args.command]
    if args.command == "scores":
        causal = shape["type"] not in _BIDIRECTIONAL
        _check_head_and_tokens(args, shape["layers"], shape["heads"], tokens, limit=limit, model=model, causal=causal)
    elif args.command == "attribute":
        config = json.loads((folder / "config.json" if folder.is_dir() else folder).read_text())
        classifier = any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or [])
        vocab = config.get("vocab_size")
        vocab = vocab if isinstance(vocab, int) and not classifier else None  # a classifier's ids are its classes
        no_text = None if shape["tokenizer"] else f"{model} has no tokenizer to read token text"
        _check_attribute(args, shape["layers"], tokens, limit, vocab, no_text, model=model)


def _check_position(name: str, value: int, tokens: int | None, limit: int | None, model: str | None) -> None:
    """``--name value``, a token position: within the ``tokens`` of the input where known, else
    within the ``limit`` positions the model embeds where it has one."""
    if tokens is not None:
        if not -tokens <= value < tokens:
            raise CommandLineError(
                f"--{name}: expected a token position in [-{tokens}, {tokens}), got {value} (the input has "
                f"{tokens} tokens)"
            )
    elif limit is not None and not -limit <= value < limit:
        raise CommandLineError(
            f"--{name}: expected a token position in [-{limit}, {limit}), got {value} (the model {model} embeds "
            f"positions for at most {limit} tokens)"
        )


def _check_attribute(
    args, layers: int, tokens: int | None, limit: int | None, vocab: int | None, no_text: str | None, model=None
) -> None:
    """``attribute``'s --position, --max-length, --target and --versus against the network: its
    ``layers``, the input's ``tokens`` (or the ``limit`` of positions it embeds) and its ``vocab``
    (None: unknown, a classifier's classes); ``no_text``: why token text cannot be read, if it cannot."""
    if args.position is not None:
        _check_position("position", args.position, tokens, limit, model)
    steps = layers * (2 if getattr(args, "transcoders", None) is not None else 1)  # with features: 2 steps a layer
    if args.max_length is not None and args.max_length > steps:
        what = f"{steps} steps (a head and an MLP step per layer)" if steps > layers else f"{layers} layers"
        raise CommandLineError(f"--max-length: expected at most the model's {what}, got {args.max_length}")
    given = {}
    for name in ("target", "versus"):
        value = getattr(args, name)
        if value is None:
            continue
        try:
            token = int(value)
        except ValueError:
            if no_text is not None:
                raise CommandLineError(
                    f"--{name}: expected a token id (an integer), got {value!r} ({no_text})"
                ) from None
            continue  # one token's text, read by the tokenizer once it is loaded
        if token < 0 or (vocab is not None and token >= vocab):
            expected = f"a token id in [0, {vocab})" if vocab is not None else "a token id >= 0"
            raise CommandLineError(f"--{name}: expected {expected}, got {token}")
        given[name] = token
    if len(given) == 2 and given["target"] == given["versus"]:
        raise CommandLineError(f"--versus: expected a token other than --target ({given['target']})")


def _check_head_and_tokens(
    args, layers: int, heads: int, tokens: int | None, *, limit=None, model=None, causal: bool = True
) -> None:
    """``scores``' --layer and --head against the network's shape, and its token positions against
    the input's ``tokens`` where known before the model is loaded (else against the ``limit`` of
    positions it embeds, where it has one): CommandLineError otherwise. Under ``causal`` attention a
    --key or --versus after the --query is refused too, and a --versus equal to --key."""
    if args.layer is not None and args.layer >= layers:
        raise CommandLineError(f"--layer: expected a layer in [0, {layers}), got {args.layer}")
    if args.head >= heads:
        raise CommandLineError(f"--head: expected a head in [0, {heads}), got {args.head}")
    positions = {}
    for name in ("query", "key", "versus"):
        value = getattr(args, name)
        if value is not None:
            _check_position(name, value, tokens, limit, model)
            positions[name] = value if tokens is None else value % tokens
    query = positions.get("query", None if tokens is None else tokens - 1)  # default: the last token
    for name in ("key", "versus"):
        key = positions.get(name)
        # Without the input's length, positions compare only where both count from the same end.
        if key is None or query is None or (tokens is None and (key < 0) != (query < 0)):
            continue
        if causal and key > query:
            allowed = f"that token {query} may attend (0…{query})" if tokens is not None else f"at or before {query}"
            raise CommandLineError(f"--{name}: expected a key {allowed}, got {key} (the attention is causal)")
    key, versus = positions.get("key"), positions.get("versus")
    if key is not None and versus == key and (tokens is not None or (key < 0) == (versus < 0)):
        raise CommandLineError(f"--versus: expected a key other than --key ({key})")


def _transcoders_option(parser: argparse.ArgumentParser) -> None:
    """``--transcoders FOLDER``, optional (``graph`` requires its own): a set replacing the MLPs."""
    parser.add_argument(
        "--transcoders",
        type=Path,
        help="with --model: a folder of transcoders (circuit-tracer, SAELens or sparsify files) that replace "
        "the model's MLPs, so that paths run through their active features too (docs/USAGE.md, 'Paths through "
        "MLP features')",
    )


def build_parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = _Parser(
        prog="pathkernels",
        description="Path decompositions of attention networks: rank collapse, "
        "per-path residuals and benchmarks (docs/DESIGN.md has the math; `pip install` puts the docs in "
        "pathkernels/docs).",
        formatter_class=formatter,
    )
    parser.add_argument("--version", action=_Version)
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
        description="Every experiment in seven sections, with tables printed and CSV/PNG files "
        "written: the norm, rank collapse, path residuals by length, path-length "
        "distributions, path effectiveness, a trained model's paths, and speed.",
    )
    demo.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="output folder")
    demo.add_argument(
        "--quick", action="store_true", help="smaller sizes and a shorter training (under a minute on 2 quiet cores)"
    )
    demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    demo.set_defaults(run=_run_demo)

    fixtures = ", ".join(fixture_names())

    def model_options(sub, layers: int, tokens: int, built_in: bool = True):
        """--model and its inputs; with ``built_in`` the built-in network's shape options too."""
        sub.set_defaults(default_layers=layers)
        sub.add_argument(
            "--model",
            help="a local Hugging Face model directory: its weights, or random weights from its config.json "
            "when it has none (its config.json names the same directory); a config file of another name "
            f"(random weights); or, from any folder, the name of one of pathkernels' fixtures ({fixtures}). "
            "Nothing is downloaded",
        )
        sub.add_argument(
            "--text",
            help="with --model: a prompt for the model directory's tokenizer (default: a "
            "fixed sentence when there is a tokenizer and no --tokens)",
        )
        sub.add_argument(
            "--ids",
            type=_token_ids,
            help="with --model: these token ids as the input (e.g. 0,5,3,9: commas or spaces between them)",
        )
        sub.add_argument(
            "--example",
            action="store_true",
            help="with --model of one of pathkernels' fixtures (pathkernels/fixtures/NAME): its own example "
            "input, as pathkernels.fixtures.load_fixture gives it (the README's)",
        )
        if built_in:
            sub.add_argument("--layers", type=_integer(1), help=f"depth of the built-in network (default {layers})")
            sub.add_argument("--heads", type=_integer(1), help="heads per layer of the built-in network (default 4)")
            sub.add_argument("--width", type=_integer(1), help="d_model of the built-in network (default 64)")
        sub.add_argument(
            "--tokens",
            type=_integer(2),
            help=f"sequence length n, random token ids (default {tokens}, with --model too when its directory has "
            "no tokenizer; a model with a tokenizer reads a fixed sentence unless --tokens or --text is given)",
        )
        sub.add_argument("--out", type=Path, help="folder to write CSV and PNG files into")

    collapse = command(
        "collapse",
        help="residual ratio of the hidden states against depth",
        description="Median residual ratio ‖X − 1μᵀ‖_1,∞ / ‖X‖_1,∞ of the hidden states "
        "at every depth: the built-in pure-attention, +MLP, +skip and transformer "
        "networks at initialisation, or a Hugging Face model.",
    )
    model_options(collapse, layers=12, tokens=DEFAULT_TOKENS["collapse"])
    collapse.add_argument("--batch", type=_integer(1), default=8, help="random inputs per model")
    collapse.add_argument("--seeds", type=_integer(1), help="initialisations per variant (default 3)")
    collapse.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    collapse.set_defaults(run=_run_collapse)

    paths = command(
        "paths",
        help="residual ratio of every path (or a stratified sample), by length",
        description="Residual ratio of the attention product of every path with skip, by "
        "path length: exactly when the tree is small enough, else a stratified sample "
        "without replacement. Under torchrun the processes split the tree.",
    )
    model_options(paths, layers=6, tokens=DEFAULT_TOKENS["paths"])
    paths.add_argument(
        "--seed", type=_SEED, default=0, help="seed of the network, of the sample and of random token ids"
    )
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
    paths.set_defaults(run=_run_paths)

    attribute = command(
        "attribute",
        help="each path's share of a logit difference (or of a probe direction), and the top paths",
        description="Each path (a source: the embedding, a layer's constant rows or an MLP's output, "
        "then the heads it passes) gets its exact share of a logit difference at one token, the norms "
        "frozen at the forward pass: sums by length and by source, and the top and bottom paths. A "
        "GPT-2 built from a config, or a local model whose logits are linear in its last hidden state "
        "(GPT-2, GPT-NeoX, GPT-J, Phi, Falcon, OPT, the Llama family, Gemma, OLMo, their sequence "
        "classifiers' class logits). With --direction, a probe direction read from a file is "
        "attributed instead, for any language model the adapters read: BERT and RoBERTa with their masked-LM "
        "heads too, whose logits are not linear.",
    )
    model_options(attribute, layers=4, tokens=DEFAULT_TOKENS["attribute"])
    attribute.add_argument(
        "--seed", type=_SEED, default=0, help="seed of the built-in model and of random token ids (--tokens)"
    )
    attribute.add_argument(
        "--target", help="token id (or, with a tokenizer, one token's text); default: the top prediction"
    )
    attribute.add_argument("--versus", help="the token it is compared with; default: the second prediction")
    attribute.add_argument(
        "--direction",
        type=Path,
        help="attribute this probe direction instead of a logit difference: a file holding d numbers (d = the "
        "model's hidden size), a torch .pt tensor [d], a .npy array [d] or text; its value is the direction · "
        "the model's last hidden state (its final norm's output) at --position",
    )
    attribute.add_argument("--position", type=int, help="the token read out (default: the last)")
    _transcoders_option(attribute)
    attribute.add_argument("--top", type=_integer(1), default=10, help="how many top and bottom paths to show")
    attribute.add_argument(
        "--max-length",
        type=_integer(0),
        help=f"enumerate the paths of at most this many heads (default: every path, or the most that "
        f"keeps within {MAX_ATTRIBUTION_PATHS:,})",
    )
    attribute.add_argument(
        "--time-limit",
        type=_seconds,
        default=300.0,
        help="seconds for the whole command (the model, its capture, the walk over the paths and, for a model "
        f"with more than {MAX_ATTRIBUTION_PATHS:,} paths, the searches of the top and bottom paths): at the "
        "limit it reports what it found and says what was left",
    )
    attribute.set_defaults(run=_run_attribute)

    graph = command(
        "graph",
        help="a prompt's attribution graph through a transcoder set, in circuit-tracer's and Neuronpedia's files",
        description="With the model's MLPs replaced by a transcoder set (its features' gates, the norms and the "
        "attention frozen at the forward pass), every active feature, error, token and logit is a node and the "
        "direct effect of each on each an edge, exactly: each edge is the sum of its chains of heads. The graph "
        "is pruned as circuit-tracer prunes it and written as circuit-tracer's graph file (graph.pt) and the JSON "
        "Neuronpedia's graph viewer loads, each link with its largest chains of heads.",
    )
    model_options(graph, layers=4, tokens=DEFAULT_TOKENS["graph"], built_in=False)  # (a --model only)
    graph.add_argument(
        "--transcoders", type=Path, required=True, help="a folder of transcoders (circuit-tracer, SAELens or sparsify)"
    )
    graph.add_argument("--seed", type=_SEED, default=0, help="seed of random token ids (--tokens)")
    graph.add_argument("--position", type=int, help="the token whose logits are explained (default: the last)")
    graph.add_argument("--slug", default="graph", help="the graph's name in Neuronpedia's files (default: graph)")
    graph.add_argument(
        "--node-threshold", type=_fraction, default=0.8, help="the share of influence the kept nodes hold (0.8)"
    )
    graph.add_argument(
        "--edge-threshold", type=_fraction, default=0.98, help="the share of influence the kept edges hold (0.98)"
    )
    graph.add_argument(
        "--paths-per-link", type=_integer(0), default=3, help="chains of heads written with each link (default 3)"
    )
    graph.add_argument(
        "--max-feature-nodes",
        type=_integer(1),
        help="at most this many features as nodes, those of most influence on the logits (default: every one)",
    )
    graph.add_argument("--top", type=_integer(1), default=10, help="how many nodes and edges to list")
    graph.add_argument("--time-limit", type=_seconds, default=600.0, help="seconds for the whole command")
    graph.set_defaults(run=_run_graph)

    scores = command(
        "scores",
        help="where a head looks: its attention scores at one token as exact sums over pairs of paths",
        description="A head's pre-softmax score is bilinear in the stream at its query and at its key; with "
        "the norms frozen each is a sum of paths, so the score is an exact sum over pairs (query path, key "
        "path). Prints the head's scores and attention at one query, the score at one key (or the difference "
        "of two keys') by pairs of path groups (source, number of heads), and the top and bottom pairs of "
        "paths: listed where they are few, else found by a certified best-first search. A GPT-2 built from a "
        "config, or a local model of a family whose queries and keys the adapters read (GPT-2, GPT-NeoX, GPT-J, "
        "Phi, Falcon, OPT, ViT, the Llama family, Gemma, OLMo).",
    )
    model_options(scores, layers=4, tokens=DEFAULT_TOKENS["scores"])
    scores.add_argument(
        "--seed", type=_SEED, default=0, help="seed of the built-in model and of random token ids (--tokens)"
    )
    scores.add_argument("--layer", type=_integer(0), help="the head's layer (default: the last)")
    scores.add_argument("--head", type=_integer(0), default=0, help="the head")
    scores.add_argument("--query", type=int, help="the query token (default: the last)")
    scores.add_argument("--key", type=int, help="the key token to explain (default: where the head attends most)")
    scores.add_argument("--versus", type=int, help="explain the score at --key minus the score at this key")
    _transcoders_option(scores)
    scores.add_argument("--top", type=_integer(1), default=10, help="how many groups and pairs to show")
    scores.add_argument(
        "--time-limit",
        type=_seconds,
        default=300.0,
        help="seconds for the whole command (the model, its capture and, where the paths are too many to list, "
        "the searches of the top and bottom pairs): at the limit it reports what it found and its gap",
    )
    scores.set_defaults(run=_run_scores)

    bench = command(
        "bench",
        help="fused ops and the path engine against pure PyTorch",
        description="Quick timings of the fused norms and the path engine against pure "
        "PyTorch; bench/ has the full suite.",
    )
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help=device_help)
    bench.add_argument("--quick", action="store_true", help="shorter timing")
    bench.add_argument("--out", type=Path, help="write both tables to this file: JSON, or CSV if it ends in .csv")
    bench.set_defaults(run=_run_bench)
    return parser


def _done(_result) -> int:
    return 0


# The options that model_options adds, passed on by name to collapse_table and paths_table.
_MODEL_OPTIONS = ("model", "text", "ids", "example", "layers", "heads", "width", "tokens", "out")


def _options(args, *names: str) -> dict:
    """The parsed options of those names, as keyword arguments."""
    return {name: getattr(args, name) for name in names}


# Each subcommand's ``run``: its module is imported here, when it runs (not for --help).


def _run_demo(args) -> int:
    from pathkernels.app.cli.demo import run_demo

    return run_demo(args)


def _run_collapse(args) -> int:
    from pathkernels.app.cli.collapse import collapse_table

    return _done(collapse_table(**_options(args, *_MODEL_OPTIONS, "batch", "seeds", "device")))


def _run_paths(args) -> int:
    from pathkernels.app.cli.paths import paths_table

    return _done(paths_table(**_options(args, *_MODEL_OPTIONS, "seed", "samples_per_length", "max_exact", "device")))


def _run_attribute(args) -> int:
    from pathkernels.app.cli.attribute import attribute_table

    names = ("seed", "target", "versus", "direction", "position", "top", "max_length", "time_limit", "started")
    return _done(attribute_table(**_options(args, *_MODEL_OPTIONS, *names, "transcoders")))


def _run_graph(args) -> int:
    from pathkernels.app.cli.graph import graph_files

    names = ("model", "transcoders", "text", "ids", "example", "tokens", "seed", "position", "slug")
    names += ("node_threshold", "edge_threshold", "paths_per_link", "max_feature_nodes", "top", "time_limit", "out")
    names += ("started",)
    return _done(graph_files(**_options(args, *names)))


def _run_scores(args) -> int:
    from pathkernels.app.cli.scores import scores_table

    names = ("seed", "layer", "head", "query", "key", "versus", "top", "time_limit", "started", "transcoders")
    return _done(scores_table(**_options(args, *_MODEL_OPTIONS, *names)))


def _run_bench(args) -> int:
    from pathkernels.app.cli.bench import bench_tables

    return _done(bench_tables(device=args.device, quick=args.quick, out_file=args.out))


def main(argv=None) -> int:
    code = _main(argv)
    if argv is None and any(worker.is_alive() for worker in ABANDONED):
        # The program's entry point, with a search left running past the time limit: end now, as
        # an interpreter that waited for it (or tore torch down under it) would not.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# The optional dependencies the subcommands import: the name pip installs each by, and the extra of
# pyproject.toml that lists it.
OPTIONAL_PACKAGES = {
    "pandas": ("pandas", "analysis"),
    "matplotlib": ("matplotlib", "analysis"),
    "tqdm": ("tqdm", "analysis"),
    "transformers": ("transformers", "adapters"),
    "transformer_lens": ("transformer-lens", "adapters"),
}


def missing_package_message(package: str) -> str:
    """What the command line says when ``package`` (a key of OPTIONAL_PACKAGES) cannot be imported."""
    name, extra = OPTIONAL_PACKAGES[package]
    return (
        f"needs the package {package}, which is not installed in this environment "
        f'(pip install {name}; pyproject.toml lists it in the extra "{extra}")'
    )


def _main(argv=None) -> int:
    started = time.monotonic()  # --time-limit counts from here: the imports of torch and the rest too
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.started = started
    try:
        _check_options(args, args.command_parser)
        out = getattr(args, "out", None)
        if out is not None:
            check_writable(out, "--out", args.command, folder=args.command != "bench")
        from pathkernels.app.cli.sizes import refuse_oversized

        refuse_oversized(args)  # by arithmetic, before the subcommand imports torch
        return args.run(args)
    except CommandLineError as error:
        if args.debug:
            raise
        print(error_line(args.command, str(error)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(error_line(args.command, "interrupted"), file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 (one line unless --debug)
        if args.debug:
            raise
        package = (getattr(error, "name", None) or "").split(".")[0]
        if isinstance(error, ModuleNotFoundError) and package in OPTIONAL_PACKAGES:
            message = missing_package_message(package)
        else:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
            message = f"{reason} (an unexpected {type(error).__name__}; --debug shows the traceback)"
        print(error_line(args.command, message), file=sys.stderr)
        return 1
