"""What the subcommands share: the device, the memory of the attention maps, the models given with
``--model`` and their inputs, and the printed and written results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pathkernels.adapters.huggingface import LocalModel, load_local_model, local_model_inputs
from pathkernels.adapters.transcoders import load_transcoders
from pathkernels.app.cli.base import BUILT_IN_VOCAB, DEFAULT_TOKENS, CommandLineError
from pathkernels.app.cli.sizes import check_ids, example_task, gpt2_bytes, model_folder
from pathkernels.core._extension import build_info
from pathkernels.core._figures import saved
from pathkernels.core._memory import check_fits


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
        "pass fewer --tokens" + (" or a smaller --batch" if command == "collapse" else ""),
        error=CommandLineError,
    )


def resolve_device(device: str, command: str) -> str:
    """``auto``: CUDA when a GPU and the CUDA kernels are present, else CPU; ``cuda`` is checked."""
    has_cuda = torch.cuda.is_available() and build_info()["cuda"]
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    if device == "cuda" and not has_cuda:
        raise CommandLineError(
            f"--device cuda needs a GPU and pathkernels built with CUDA "
            f"(build_info: cuda={build_info()['cuda']}, GPU: {torch.cuda.is_available()})"
        )
    return device


def heading(text: str) -> None:
    print()
    print(text)
    print("=" * len(text))


def save(out: Path | None, name: str, table=None, figure=None) -> None:
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


def number(value: float, spec: str) -> str:
    """``value`` formatted by ``spec``, never as "-0": a zero, or a value that rounds to one, of
    either sign prints unsigned."""
    text = format(value + 0.0, spec)  # -0.0 + 0.0 is +0.0
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def float_format(value: float) -> str:
    """A table's numbers: 3 significant digits, or 3 digits and an exponent below 10^-3."""
    return number(value, ".3g") if abs(value) >= 1e-3 or value == 0 else number(value, ".2e")


def local_model(spec: str) -> LocalModel:
    """``--model``: the adapters' reader (a ``config.json`` standing for its directory), its errors
    as one command-line line."""
    try:
        return load_local_model(model_folder(spec))
    except (FileNotFoundError, ImportError, ValueError) as error:
        raise CommandLineError(f"--model {spec}: {error}") from None


def model_inputs(
    local: LocalModel,
    text: str | None,
    tokens: int | None,
    batch: int = 1,
    *,
    default_tokens: int,
    seed: int = 0,
    ids: list[int] | None = None,
    example: bool = False,
) -> tuple[dict, str]:
    """The inputs that ``--text`` / ``--tokens`` / ``--ids`` / ``--example`` ask for, refusing those
    that do not apply: without any, a model with a tokenizer reads a fixed sentence, one without
    ``default_tokens`` random token ids (the command's ``--tokens`` default). Random token ids and
    images are drawn from ``seed`` (the command's ``--seed``, where it has one). ``ids``: these token
    ids, in every one of the ``batch`` rows; ``example``: a fixture folder's own example input (its
    ``fixture.json``'s task, as :func:`pathkernels.fixtures.load_fixture` gives it)."""
    if ids is not None or example:
        return _given_inputs(local, ids, example, batch)
    if local.is_vision and (text is not None or tokens is not None):
        option = "--text" if text is not None else "--tokens"
        raise CommandLineError(
            f"{option} does not apply to the vision model {local.path}: its tokens are the image patches "
            "(random pixels here)"
        )
    if text is not None and tokens is not None:
        raise CommandLineError("pass --text or --tokens, not both (--tokens draws random token ids)")
    if text is not None and local.tokenizer is None:
        raise CommandLineError(
            f"--text needs a tokenizer, and {local.path} has none; pass --tokens N for random token ids"
        )
    if tokens is None and text is None and local.tokenizer is None and not local.is_vision:
        tokens = default_tokens
    try:
        return local_model_inputs(local, text=text, num_tokens=tokens, batch=batch, seed=seed)
    except ValueError as error:
        raise CommandLineError(f"--text: {str(error).split(': ', 1)[-1]}") from None


def _given_inputs(local: LocalModel, ids: list[int] | None, example: bool, batch: int) -> tuple[dict, str]:
    """``--ids`` or ``--example`` as the model's inputs ``[batch, n]`` and a phrase saying what they are."""
    if example:
        from pathkernels.fixtures import induction_batch

        task = example_task(local.path)
        input_ids = induction_batch(task["vocab"], task["length"], batch, task["example_seed"])
        what = (
            f"the fixture's example ({task['length']} random tokens then again after a start token, "
            f"seed {task['example_seed']}: pathkernels.fixtures.load_fixture)"
        )
        return {"input_ids": input_ids}, what
    check_ids(ids, local.model.config.vocab_size)
    return {"input_ids": torch.tensor([ids] * batch)}, f"the given {len(ids)} token ids"


def sequence_length(local: LocalModel, inputs: dict) -> int:
    """The number of tokens the model sees: its input ids', or a vision model's patches (+1)."""
    if local.is_vision:
        config = local.model.config
        return (config.image_size // config.patch_size) ** 2 + 1
    return inputs["input_ids"].shape[-1]


@dataclass
class ModelToRun:
    """What a command that captures a language model runs: ``build()`` makes the float64 model,
    ``inputs`` are its inputs (None: random token ids, drawn by :meth:`drawn_inputs` after the
    model is built, from the same seed), ``tokens`` their length and ``source`` says what it is."""

    build: Callable
    inputs: dict | None
    tokenizer: object | None
    source: str
    tokens: int

    def drawn_inputs(self) -> dict:
        return {"input_ids": torch.randint(0, BUILT_IN_VOCAB, (1, self.tokens))}


def model_to_run(
    command: str,
    local: LocalModel | None,
    spec: str | None,
    text: str | None,
    tokens: int | None,
    layers: int,
    heads: int,
    width: int,
    seed: int,
    *,
    bytes_per_entry: int,
    ids: list[int] | None = None,
    example: bool = False,
) -> ModelToRun:
    """A local model (``local``, read from ``--model spec``) with the inputs ``--text`` / ``--tokens``
    ask for, or a GPT-2 built from a config of ``layers``, ``heads``, ``width`` on ``tokens`` random
    ids, each refused before anything is built where the machine's memory would not hold it (the
    float64 copy of the model, and ``bytes_per_entry`` per entry of its attention maps)."""
    import transformers

    where = f"pathkernels {command}"
    if local is not None:
        inputs, what = model_inputs(
            local, text, tokens, default_tokens=DEFAULT_TOKENS[command], seed=seed, ids=ids, example=example
        )
        config = local.model.config
        parameters = sum(p.numel() for p in local.model.parameters() if p.dtype != torch.float64)
        check_fits(
            8 * parameters,
            torch.device("cpu"),
            where,
            f"the model's float64 copy ({parameters:,} parameters) needs about",
            f"{command} a smaller model, or one saved in float64",
            error=CommandLineError,
        )
        length = sequence_length(local, inputs)
        check_attention_fits(
            command,
            batch=1,
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            tokens=length,
            bytes_per_entry=bytes_per_entry,  # the float64 maps and the command's copies of them
            device="cpu",
        )
        return ModelToRun(
            local.model.double, inputs, local.tokenizer, f"{spec}, {local.weights}; inputs: {what}", length
        )
    tokens = DEFAULT_TOKENS[command] if tokens is None else tokens
    config = transformers.GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        vocab_size=BUILT_IN_VOCAB,
        n_positions=max(tokens, 16),
        bos_token_id=0,
        eos_token_id=0,
    )
    check_fits(
        gpt2_bytes(layers, heads, width, tokens),
        torch.device("cpu"),
        where,
        f"a GPT-2 of L = {layers}, H = {heads}, d = {width} and its capture of {tokens} tokens need about",
        "pass a smaller --layers, --width or --tokens",
        error=CommandLineError,
    )

    def build():
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(config).double().eval()  # as a user reads it: no dropout

    source = (
        f"a GPT-2 built from a config (L = {layers}, H = {heads}, d = {width}), {tokens} random token ids "
        f"(seed {seed} for both)"
    )
    return ModelToRun(build, None, None, source, tokens)


def read_transcoders(folder: Path, network):
    """``--transcoders``: the set in ``folder`` checked against the model, its refusals as one line."""
    try:
        return load_transcoders(folder, model=network, require_all_layers=False)
    except (FileNotFoundError, ValueError, ImportError) as error:
        raise CommandLineError(f"--transcoders {folder}: {str(error).split(': ', 1)[-1]}") from None
