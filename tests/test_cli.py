"""The command line as a new user meets it.

- Oversized work is refused at once, with the estimate, before torch is imported: never the
  allocator's error, never the out-of-memory killer (the sizes here are refused by arithmetic,
  terabytes beyond any machine, so nothing is tried).
- ``--tokens`` has one default rule, and ``--model DIR/config.json`` is the folder.
- Every error is one line, ``pathkernels COMMAND: message``.
- No "-0", and headings that read as English.
- ``attribute --direction FILE``: a probe direction from a .pt, .npy or text file, attributed
  exactly (its value equals the direction · the model's own last hidden state), for a BERT with
  its masked-LM head too, whose logit difference is refused by name.
"""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from pathkernels.app.cli import main, sizes
from pathkernels.app.cli.base import error_line
from pathkernels.app.cli.common import float_format, number

transformers = pytest.importorskip("transformers")
pytest.importorskip("pandas")


def run(argv, capsys):
    """``(exit code, stdout, stderr lines without transformers' own)`` of ``main(argv)`` in process."""
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    captured = capsys.readouterr()
    errors = [
        line
        for line in captured.err.splitlines()
        if line.strip()
        and not line.startswith("[transformers]")
        and "Loading weights" not in line
        and "Writing model" not in line
    ]
    return code, captured.out, errors


def huge_config(folder):
    """A GPT-2 config of 1000 layers, 64 heads and d = 8192 (about 8 * 10^11 parameters), written
    as JSON: no model is ever built from it here."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "gpt2", "n_layer": 1000, "n_head": 64, "n_embd": 8192, "vocab_size": 50257}
    config |= {"n_positions": 1024, "architectures": ["GPT2LMHeadModel"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def randomised(model, seed: int = 0):
    """``model`` with its norms' gains and every bias moved off their initial 1 and 0, so that the
    constants and the norms' frozen scales matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # biases and norm gains
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def tiny_bert(folder, *, tokenizer: bool = False):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox", "jumps", "over", "dog"]
    config = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=len(words),
        max_position_embeddings=32,
    )
    torch.manual_seed(1)
    randomised(transformers.BertForMaskedLM(config)).save_pretrained(folder)
    if tokenizer:
        (folder / "vocab.txt").write_text("\n".join(words) + "\n")
        transformers.BertTokenizer(str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


def tiny_gpt2(folder, model_class=None, **options):
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=30, n_positions=32, **options)
    torch.manual_seed(2)
    randomised((model_class or transformers.GPT2LMHeadModel)(config)).save_pretrained(folder)
    return folder


# --- oversized work, refused at once -------------------------------------------------------------

AVAILABLE = r"more than the [\d.]+ [KMGT]iB \([\d,]+ bytes\) available on cpu"
REFUSALS = [
    (
        ["attribute", "--tokens", "100000"],
        r"a GPT-2 of L = 4, H = 4, d = 64 and its capture of 100000 tokens need about 5\.83 TiB .*; "
        r"pass a smaller --layers, --width or --tokens",
    ),
    (
        ["attribute", "--layers", "1000", "--heads", "64", "--width", "8192"],
        r"a GPT-2 of L = 1000, H = 64, d = 8192 and its capture of 16 tokens need about 8\.81 TiB",
    ),
    (
        ["attribute", "--model", "{huge}"],
        r"the model \S+ \(a gpt2 of L = 1000, H = 64, d = 8192: about 805,\d{3},\d{3},\d{3} parameters\) with its "
        r"float64 copy and its capture of 16 tokens need about 8\.\d\d TiB",
    ),
    (
        ["attribute", "--model", "{huge}/config.json", "--tokens", "4"],
        r"the model \S+config\.json \(a gpt2 of L = 1000, .* capture of 4 tokens need about",
    ),
    (
        ["attribute", "--model", "{huge}", "--tokens", "100000"],
        r"--tokens 100000: the model \S+ embeds positions for at most 1024 tokens",
    ),
    (
        ["paths", "--layers", "60", "--heads", "64", "--tokens", "4096"],
        r"1 × 60 layers × 64 heads × 4096² tokens of attention need about 1\.88 TiB",
    ),
    (
        ["paths", "--layers", "60", "--heads", "64", "--tokens", "16", "--samples-per-length", "100000000"],
        r"a '\+skip' network of L = 60, H = 64, d = 64 \(986,880 parameters\), its attention over 16 tokens and the "
        r"paths it evaluates need about 21\.63 TiB",
    ),
    (
        ["paths", "--layers", "2", "--width", "100000"],
        r"a '\+skip' network of L = 2, H = 4, d = 100000 \(80,000,200,000 parameters\)",
    ),
    (
        ["paths", "--layers", "10", "--heads", "10", "--max-exact", "100000000000"],
        r"the decomposition would evaluate 25,937,424,601 paths, more than the 10,000,000,000 that one call evaluates",
    ),
    (
        ["paths", "--model", "{huge}", "--tokens", "8"],
        r"the model \S+ \(a gpt2 .* and its capture of 8 tokens need about",
    ),
    (
        ["collapse", "--layers", "10000", "--width", "100000", "--device", "cpu"],
        r"the networks of L = 10000, H = 4, d = 100000 \(the transformer variant: 1,200,010,000,000,000 parameters\) "
        r"and their activations for 8 × 32 tokens need about",
    ),
    (
        ["collapse", "--batch", "100000", "--tokens", "64", "--device", "cpu"],
        r"100000 × 12 layers × 4 heads × 64² tokens of attention need about 292\.97 GiB",
    ),
    (["collapse", "--model", "{huge}", "--device", "cpu"], r"the model \S+ \(a gpt2 .* capture of 8 × 32 tokens need"),
]


@pytest.mark.parametrize("argv, message", REFUSALS, ids=[" ".join(argv[:3]) for argv, _ in REFUSALS])
def test_oversized_work_is_refused_at_once_with_the_estimate(argv, message, tmp_path, capsys):
    huge = str(huge_config(tmp_path / "huge"))
    argv = [word.replace("{huge}", huge) for word in argv]
    start = time.monotonic()
    code, out, errors = run(argv, capsys)
    assert time.monotonic() - start < 5
    assert code == 2 and out == "" and len(errors) == 1, errors
    command = argv[0]
    assert re.fullmatch(rf"pathkernels {command}: {message}.*", errors[0]), errors[0]
    if "positions" not in message and "paths, more than" not in message:
        assert re.search(AVAILABLE, errors[0]), errors[0]


def test_a_refusal_comes_before_torch_is_imported():
    """The whole program, Python's start included, in under 5 s: torch is never imported."""
    script = (
        "import sys; from pathkernels.app.cli import main; code = main(['attribute', '--tokens', '100000']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 5
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("pathkernels attribute: a GPT-2 of L = 4, H = 4, d = 64 and its capture of 100000")


def test_the_estimates_count_what_is_built(tmp_path):
    """The built-in networks' parameters exactly; a config's within a few percent, never far under."""
    from pathkernels.app.models import SelfAttentionNetwork

    layers, heads, width, tokens = 3, 2, 32, 40
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=1000, n_positions=tokens)
    )
    capture = 40 * layers * heads * tokens**2 + 8 * 24 * layers * tokens * width
    assert sizes.gpt2_bytes(layers, heads, width, tokens) == 12 * sum(p.numel() for p in gpt2.parameters()) + capture
    for variant, mlp in (("+skip", False), ("transformer", True)):
        network = SelfAttentionNetwork.variant(variant, d_model=width, num_heads=heads, num_layers=layers)
        assert sizes.network_parameters(layers, heads, width, mlp=mlp)[0] == sum(
            p.numel() for p in network.parameters()
        )
    configs = {
        "bert": transformers.BertConfig(
            num_hidden_layers=3, num_attention_heads=4, hidden_size=64, intermediate_size=256, vocab_size=500
        ),
        "llama": transformers.LlamaConfig(
            num_hidden_layers=3, num_attention_heads=4, hidden_size=64, intermediate_size=172, vocab_size=500
        ),
        "gpt2": transformers.GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=500, n_positions=128),
    }
    for name, config in configs.items():
        config.save_pretrained(tmp_path / name)
        model = transformers.AutoModel.from_config(config)
        actual = sum(p.numel() for p in model.parameters())
        estimate = sizes.model_shape(str(tmp_path / name))["parameters"]
        assert 0.97 * actual <= estimate <= 1.2 * actual, (name, actual, estimate)
    assert sizes.counts_by_length(4, 3) == [1, 12, 54, 108, 81]
    assert sizes.paths_evaluated(4, 3, None, 10**6) == (256, True)
    assert sizes.paths_evaluated(4, 3, 20, 10**6) == (1 + 12 + 20 + 20 + 20, True)


def test_the_refusal_follows_the_memory_the_machine_has(monkeypatch, capsys):
    """The same run is refused on a machine with less memory than it needs, with both numbers."""
    need = sizes.gpt2_bytes(2, 2, 16, 6)
    monkeypatch.setattr(sizes, "available_memory", lambda: need - 1)
    code, out, errors = run(["attribute", "--layers", "2", "--heads", "2", "--width", "16", "--tokens", "6"], capsys)
    assert code == 2 and out == ""
    assert errors == [
        f"pathkernels attribute: a GPT-2 of L = 2, H = 2, d = 16 and its capture of 6 tokens need about "
        f"{sizes.format_bytes(need)}, more than the {sizes.format_bytes(need - 1)} available on cpu; pass a smaller "
        "--layers, --width or --tokens"
    ]


# --- defaults, and what --model names -----------------------------------------------------------


def test_tokens_default_to_one_rule_stated_in_help(tmp_path, capsys):
    tiny_gpt2(tmp_path / "gpt2")
    for command, default in (("attribute", 16), ("paths", 32)):
        code, out, _ = run(
            [
                command,
                "--model",
                str(tmp_path / "gpt2"),
                "--max-length" if command == "attribute" else "--max-exact",
                "1",
            ],
            capsys,
        )
        assert code == 0
        assert f"1 sequence(s) of {default} random token ids (seed 0) (no tokenizer in the model directory)" in out
        help_text = subprocess.run(
            [sys.executable, "-m", "pathkernels", command, "--help"], capture_output=True, text=True, check=True
        ).stdout
        assert (
            f"random token ids (default {default}, with --model too when its directory has no tokenizer; a model "
            "with a tokenizer reads a fixed sentence unless --tokens or --text is given)"
        ) in " ".join(help_text.split())


def test_a_config_json_names_its_folder_with_its_tokenizer_and_weights(tmp_path, capsys):
    tiny_bert(tmp_path / "bert", tokenizer=True)
    code, out, _ = run(["paths", "--model", str(tmp_path / "bert" / "config.json"), "--device", "cpu"], capsys)
    assert code == 0
    assert "pretrained weights" in out and "the default prompt" in out and "the model's tokenizer" in out
    assert "no tokenizer" not in out


# --- one error format ----------------------------------------------------------------------------


def test_every_error_is_one_line_naming_the_command(tmp_path, capsys, monkeypatch):
    cases = [
        (["paths", "--tokens", "x"], 2, "pathkernels paths: argument --tokens: expected an integer >= 2, got 'x'"),
        (
            ["attribute", "--target", "x", "--layers", "1", "--width", "8", "--tokens", "3"],
            2,
            "pathkernels attribute: --target: expected a token id",
        ),
        (["collapse", "--model", str(tmp_path / "missing")], 2, "pathkernels collapse: --model"),
        (["bogus"], 2, "pathkernels: argument command: invalid choice: 'bogus'"),
    ]
    for argv, expected_code, start in cases:
        code, _, errors = run(argv, capsys)
        assert code == expected_code and len(errors) == 1 and errors[0].startswith(start), (argv, errors)
        assert " error: " not in errors[0] and not errors[0].startswith("pathkernels: pathkernels")
    import pathkernels.app.cli.paths as paths_command

    def broken(**options):
        raise RuntimeError("a failure nobody foresaw\nsecond line")

    monkeypatch.setattr(paths_command, "paths_table", broken)
    code, _, errors = run(["paths", "--layers", "1", "--tokens", "3"], capsys)
    assert code == 1
    assert errors == [
        "pathkernels paths: a failure nobody foresaw (an unexpected RuntimeError; --debug shows the traceback)"
    ]
    assert (
        error_line("paths", "pathkernels: x") == error_line("paths", "pathkernels paths: x") == "pathkernels paths: x"
    )


def test_no_error_in_the_command_line_carries_another_prefix():
    """The messages the subcommands raise are bare or name their command; none says "error:"."""
    import ast
    from pathlib import Path

    def leading_text(node) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        return ""

    raised = 0
    for path in Path(sizes.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CommandLineError" and node.args:
                text = leading_text(node.args[0])
                raised += 1
                assert not text.startswith("pathkernels: ") and "error:" not in text, (path.name, text)
    assert raised > 20


# --- printing ------------------------------------------------------------------------------------


def test_numbers_never_print_as_negative_zero():
    assert number(-0.0, ".2g") == "0" and number(-1e-30, ".2f") == "0.00" and number(-0.5, ".2g") == "-0.5"
    assert float_format(-0.0) == "0" and float_format(-2e-5) == "-2.00e-05"


def test_attribute_headings_read_as_english(capsys):
    argv = ["attribute", "--layers", "2", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "3"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    lines = out.splitlines()
    headings = [lines[i - 1] for i, line in enumerate(lines) if line and set(line) == {"="}]
    assert headings == [
        "Attribution by number of heads",
        "Attribution by source (exactly 0, left out: L0 attention bias, L1 attention bias)",  # GPT-2 at init
        "The 3 largest attributions",
        "The 3 smallest attributions",
    ]
    assert re.search(r"Σ attributions \+ constant − readout = (0|-?\d(\.\d)?e-\d\d)\)", out), out
    assert not re.search(r"(?<![\w.])-0(?![.\de])", out), out
    code, out, _ = run([*argv, "--max-length", "1", "--top", "1"], capsys)
    assert "The largest attribution among the 13 enumerated paths\n" in out


# --- --direction ---------------------------------------------------------------------------------


def direction_files(folder, direction: torch.Tensor) -> dict:
    import numpy as np

    files = {"pt": folder / "u.pt", "npy": folder / "u.npy", "txt": folder / "u.txt"}
    torch.save(direction, files["pt"])
    np.save(files["npy"], direction.numpy())
    files["txt"].write_text("\n".join(repr(v) for v in direction.tolist()))
    return files


def model_last_hidden(folder, tokens: int, position: int) -> torch.Tensor:
    """The model's own last hidden state (its final norm's output) at ``position``, in float64, on the
    inputs the command line draws."""
    from pathkernels.adapters.huggingface import load_local_model, local_model_inputs

    local = load_local_model(folder)
    inputs, _ = local_model_inputs(local, num_tokens=tokens)
    with torch.no_grad():
        output = local.model.double().eval()(**inputs, output_hidden_states=True)
    return output.hidden_states[-1][0, position]


def test_a_bert_with_its_masked_lm_head_is_attributed_through_a_direction(tmp_path, capsys):
    from pathkernels.app.cli.attribute import attribute_table

    folder = tiny_bert(tmp_path / "bert")
    code, _, errors = run(["attribute", "--model", str(folder), "--tokens", "5"], capsys)
    assert code == 2 and len(errors) == 1
    assert re.fullmatch(
        r"pathkernels attribute: --model \S+: the logits of BertForMaskedLM \(bert\) are not a linear map of its "
        r"last hidden state .* pass --direction FILE \(16 numbers: a probe direction read from the last hidden "
        r"state\) to attribute that instead",
        errors[0],
    ), errors[0]
    direction = torch.randn(16, dtype=torch.float64)
    files = direction_files(tmp_path, direction)
    expected = float(model_last_hidden(folder, 5, 2) @ direction)
    for kind, path in files.items():
        result = attribute_table(model=str(folder), tokens=5, position=2, direction=path, top=3)
        value = float(result.value[0, 0])
        assert value == pytest.approx(expected, rel=1e-10, abs=1e-12), kind
        assert float(result.by_source.sum() + result.constant[0, 0]) == pytest.approx(value, rel=1e-10, abs=1e-12)
        assert result.labels == (f"the direction from {path}",)
    capsys.readouterr()
    out_dir = tmp_path / "out"
    for kind, path in files.items():  # the command line reads an .npy's length from its header first
        code, out, errors = run(
            ["attribute", "--model", str(folder), "--tokens", "5", "--direction", str(path), "--out", str(out_dir)],
            capsys,
        )
        assert code == 0, (kind, errors)
        readout = re.search(
            rf"readout: the direction from {re.escape(str(path))} · the last hidden state at token 4 = (\S+) "
            r"\(the model's own: (\S+)\)",
            out,
        )
        assert readout is not None and float(readout[1]) == pytest.approx(float(readout[2]), rel=1e-5), out
        assert float(readout[1]) == pytest.approx(float(model_last_hidden(folder, 5, 4) @ direction), rel=1e-5)
    assert (out_dir / "attribution.png").stat().st_size > 0


def test_a_direction_reads_the_final_norms_output_of_a_gpt2(tmp_path, capsys):
    """GPT-2's last hidden state is its final norm's output: the direction's value includes βᵀu."""
    from pathkernels.app.cli.attribute import attribute_table

    folder = tiny_gpt2(tmp_path / "gpt2")
    direction = torch.randn(16, dtype=torch.float64)
    path = direction_files(tmp_path, direction)["npy"]
    result = attribute_table(model=str(folder), tokens=6, direction=path, top=2)
    assert float(result.value[0, 0]) == pytest.approx(float(model_last_hidden(folder, 6, 5) @ direction), rel=1e-10)
    assert float(result.constant[0, 0]) != 0  # the final norm's β, randomised
    # The built-in GPT-2 (d = --width) takes one too.
    code, out, _ = run(
        ["attribute", "--layers", "1", "--heads", "2", "--width", "16", "--tokens", "4", "--direction", str(path)],
        capsys,
    )
    assert code == 0 and f"readout: the direction from {path} · the last hidden state at token 3 = " in out


@pytest.mark.parametrize("seed", [0, 70])
def test_a_classifiers_class_logits_are_read_through_its_score_head(tmp_path, capsys, seed):
    """At the token the model's head reads (the rightmost whose id is not the pad id, 0 here), with
    the model's own class logits; --seed draws the token ids: seed 70 draws [24, 8, 28, 2, 0], whose
    last token is the pad id, so the head reads token 3."""
    folder = tiny_gpt2(
        tmp_path / "classifier", transformers.GPT2ForSequenceClassification, num_labels=3, pad_token_id=0
    )
    from pathkernels.adapters.huggingface import load_local_model, local_model_inputs

    local = load_local_model(folder)
    inputs, _ = local_model_inputs(local, num_tokens=5, seed=seed)
    ids = inputs["input_ids"][0]
    pooled = int((torch.arange(5) * (ids != 0)).argmax())
    assert pooled == (3 if seed == 70 else 4), ids
    command = ["attribute", "--model", str(folder), "--tokens", "5", "--target", "2", "--versus", "0"]
    code, out, _ = run([*command, "--seed", str(seed)], capsys)
    assert code == 0, out
    readout = re.search(
        rf"readout: class logit\[2\] − class logit\[0\] at token {pooled} = (\S+) \(the model's own: (\S+)\)", out
    )
    assert readout is not None, (ids, out)
    assert f"token ids: {ids.tolist()}" in out  # what --seed drew, printed
    with torch.no_grad():
        logits = local.model.double().eval()(**inputs).logits[0]
    assert float(readout[1]) == pytest.approx(float(logits[2] - logits[0]), rel=1e-5)
    assert float(readout[2]) == pytest.approx(float(logits[2] - logits[0]), rel=1e-5)


@pytest.mark.parametrize(
    "write, message",
    [
        (
            lambda p: torch.save(torch.randn(2, 16), p.with_suffix(".pt")),
            r"has shape \[2, 16\]; expected .* with d = 16",
        ),
        (lambda p: torch.save(torch.randn(15), p.with_suffix(".pt")), r"has shape \[15\]; expected .* with d = 16"),
        (lambda p: torch.save({"u": torch.randn(16)}, p.with_suffix(".pt")), r"holds a dict, not a tensor"),
        (lambda p: torch.save(torch.ones(16, dtype=torch.bool), p.with_suffix(".pt")), r"holds bool values"),
        (
            lambda p: __import__("numpy").save(p.with_suffix(".npy"), __import__("numpy").ones(16, complex)),
            "complex128",
        ),
        (lambda p: p.with_suffix(".txt").write_text("1 " * 15 + "nan"), r"holds a NaN or infinite value"),
        (lambda p: p.with_suffix(".txt").write_text("1 2 three"), r"'three' is not a number"),
        (lambda p: p.with_suffix(".csv").write_bytes(b"\x80\x81\xff"), r"cannot read it"),
        (lambda p: None, r"no such file"),
    ],
    ids=["matrix", "length", "dict", "bool", "complex", "nan", "word", "binary", "missing"],
)
def test_a_bad_direction_is_refused_naming_the_option_and_d(write, message, tmp_path, capsys):
    write(tmp_path / "u")
    written = sorted(tmp_path.glob("u.*"))
    path = written[0] if written else tmp_path / "u.pt"
    argv = ["attribute", "--layers", "1", "--heads", "2", "--width", "16", "--tokens", "4", "--direction", str(path)]
    code, out, errors = run(argv, capsys)
    assert code == 2 and out == "" and len(errors) == 1, errors
    assert errors[0].startswith(f"pathkernels attribute: --direction {path}: ") and re.search(message, errors[0]), (
        errors
    )


def test_direction_and_target_do_not_mix(tmp_path, capsys):
    code, _, errors = run(
        ["attribute", "--direction", str(tmp_path / "u.pt"), "--target", "3", "--versus", "4"], capsys
    )
    assert code == 2
    assert errors[0].startswith("pathkernels attribute: --target and --versus choose the logit difference")


def test_a_seed_beyond_64_bits_is_refused_by_the_parser(capsys):
    """It reached torch.manual_seed: "Overflow when unpacking long long", as an unexpected failure."""
    for command in ("paths", "attribute"):
        code, _, errors = run([command, "--seed", str(2**64)], capsys)
        assert code == 2
        assert errors == [
            f"pathkernels {command}: argument --seed: expected an integer in [0, {2**64 - 1}], got {2**64} "
            "(--help lists the options)"
        ]


def test_checking_the_out_folder_leaves_none_behind(tmp_path):
    """--out is checked before any work (its folder created, a probe written), and the folders the
    check made are removed again: a run refused or interrupted after it leaves no empty folder; an
    existing folder and what it holds are kept; an unwritable place is refused by name."""
    from pathkernels.app.cli.base import CommandLineError, check_writable

    target = tmp_path / "a" / "b" / "out"
    check_writable(target, "--out", "paths")
    assert not (tmp_path / "a").exists()
    check_writable(tmp_path / "c" / "result.json", "--out", "bench", folder=False)
    assert not (tmp_path / "c").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    check_writable(kept, "--out", "paths")
    assert (kept / "mine.txt").read_text() == "x" and sorted(p.name for p in kept.iterdir()) == ["mine.txt"]
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CommandLineError, match=r"^pathkernels paths: --out .*file/out: cannot write there"):
        check_writable(blocker / "out", "--out", "paths")


# --- scores --------------------------------------------------------------------------------------


def test_scores_prints_the_head_the_groups_and_the_pairs_and_writes_its_files(tmp_path, capsys):
    """The built-in GPT-2: the head's scores equal to the library's own decomposition of the same
    model and tokens, the headings, and with --out the CSV files and the heatmap (labelled axes)."""
    import pandas as pd

    argv = ["scores", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", "--layer", "2", "--head", "1"]
    code, out, errors = run([*argv, "--top", "3", "--out", str(tmp_path)], capsys)
    assert code == 0 and not errors, (errors, out)
    lines = out.splitlines()
    headings = [lines[i - 1] for i, line in enumerate(lines) if line and set(line) == {"="}]
    assert headings[0] == "L2H1's scores and attention at query 5"
    assert headings[1].startswith("The score at key ") and headings[1].endswith("the 3 largest in size")
    assert headings[2:] == [h for h in headings[2:] if "pairs (query path · key path)" in h] and len(headings) == 4
    assert "every pair of the 17 paths per side below layer 2, listed" in out
    by_key = pd.read_csv(tmp_path / "scores_by_key.csv")
    by_group = pd.read_csv(tmp_path / "scores_by_group.csv")
    assert list(by_key.columns) == ["key", "token", "score", "attention"] and len(by_key) == 6
    key = int(by_key["key"][by_key["attention"].idxmax()])  # the default key: where the head attends most
    assert by_group["value"].sum() == pytest.approx(float(by_key["score"][key]), rel=1e-9, abs=1e-12)
    assert (tmp_path / "scores_by_group.png").stat().st_size > 0
    assert {f.name for f in tmp_path.iterdir()} >= {"score_pairs_largest.csv", "score_pairs_smallest.csv"}
    code, out, _ = run([*argv, "--key", "1", "--versus", "3"], capsys)
    assert code == 0 and "The score at key 1 − key 3, by (query group, key group)" in out


def test_scores_searches_when_the_pairs_are_too_many_to_list(capsys, monkeypatch):
    """Above the listing limit the top and bottom pairs come from the certified search, which says
    what it visited and whether it certified."""
    from pathkernels.app.cli import scores

    monkeypatch.setattr(scores, "MAX_LISTED_PATHS", 10)
    argv = ["scores", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "3"]
    code, out, errors = run(argv, capsys)
    assert code == 0 and all(line.startswith("pathkernels.top_score_pairs: ") for line in errors), errors  # progress
    assert re.search(r"the 3 largest pairs of 17 paths per side: a best-first search visited \d+ \+ \d+ paths", out)
    assert "certified" in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--layer", "4"], r"--layer: expected a layer in \[0, 3\), got 4"),
        (["--head", "2"], r"--head: expected a head in \[0, 2\), got 2"),
        (["--key", "9"], r"--key: expected a token position in \[-6, 6\), got 9"),
        (["--query", "2", "--key", "4"], r"--key: expected a key that token 2 may attend \(0…2\), got 4"),
        (["--key", "1", "--versus", "1"], r"--versus: expected a key other than --key \(1\)"),
    ],
)
def test_scores_refuses_what_does_not_exist_by_name(options, message, capsys):
    argv = ["scores", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", *options]
    code, _, errors = run(argv, capsys)
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors


def test_scores_refuses_a_family_whose_queries_are_not_read(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    config = transformers.BertConfig(
        num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=50
    )
    config.save_pretrained(folder)
    code, _, errors = run(["scores", "--model", str(folder), "--tokens", "5"], capsys)
    assert code == 2 and "query_key=True reads the queries and keys of gpt2" in errors[0], errors
    code, _, errors = run(["scores", "--model", str(folder), "--layer", "5"], capsys)
    assert code == 2 and "--layer: expected a layer in [0, 2), got 5" in errors[0], errors


# --- refusals from the model folder's listing, and the fixtures' own inputs --------------------------


def _refusals(tmp_path) -> list[tuple[list[str], str]]:
    """Model-folder mistakes, each with the start of its one error line."""
    empty = tmp_path / "empty"
    empty.mkdir()
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "config.json").write_text('{"n_layer": 2}')
    short = tmp_path / "short.txt"
    short.write_text("1 2 3")
    fixtures = "pathkernels/fixtures"
    return [
        (["attribute", "--model", str(empty)], f"--model {empty}: a folder without config.json"),
        (["scores", "--model", str(unnamed)], f"--model {unnamed}: config.json names no model_type"),
        (["collapse", "--model", f"{fixtures}/attn_only_2l", "--text", "hi"], "--text needs a tokenizer, and "),
        (
            ["attribute", "--model", f"{fixtures}/gpt2_4l", "--direction", str(short)],
            rf"--direction {short}: has shape \[3\]; expected .* with d = 64 \(the model's hidden size\)",
        ),
        (
            ["attribute", "--model", f"{fixtures}/attn_only_2l", "--ids", "1,64"],
            r"--ids: expected token ids in \[0, 64\)",
        ),
        (["scores", "--model", str(tiny_gpt2(tmp_path / "gpt2")), "--example"], "--example: .* is not one of"),
    ]


def test_model_folder_mistakes_are_refused_from_its_listing_in_under_a_second(tmp_path):
    """Each mistake a model folder can hold is refused by the whole program, Python's start
    included, in under a second, before torch is imported, and leaves no --out folder behind."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for argv, message in _refusals(tmp_path):
        out = tmp_path / "out"
        script = (
            "import sys; from pathkernels.app.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
        )
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", script, *argv, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=root,
        )
        elapsed = time.monotonic() - start
        assert done.returncode == 2, (argv, done.stderr)
        assert re.match(rf"pathkernels {argv[0]}: {message}", done.stderr), (argv, done.stderr)
        assert elapsed < 1.0, (argv, elapsed)
        assert not out.exists()


def test_the_input_options_choose_one_input_and_need_a_model(capsys):
    for argv, message in [
        (["attribute", "--ids", "1,2"], "--ids needs --model"),
        (["attribute", "--example"], "--example needs --model"),
        (["attribute", "--model", "x", "--ids", "1,2", "--tokens", "5"], "--tokens and --ids each choose the input"),
        (["scores", "--ids", "7"], "argument --ids: expected at least 2 token ids"),
        (["scores", "--ids", "1,a"], "argument --ids: expected token ids"),
    ]:
        code, out, errors = run(argv, capsys)
        assert code == 2 and len(errors) == 1 and message in errors[0], (argv, errors)


def test_attribute_and_scores_reproduce_the_readmes_induction_example(capsys):
    """``--example`` runs a fixture on its own example input, the README's: at token 20 the
    predicted token is the one after the first copy of token 20's, and L1H0 at token 20 attends
    most to that token (5). ``--ids`` reads the given tokens."""
    from pathkernels.fixtures import load_fixture

    model, inputs = load_fixture("attn_only_2l")
    ids = inputs["input_ids"][0]
    fixture = "pathkernels/fixtures/attn_only_2l"
    code, out, errors = run(["attribute", "--model", fixture, "--example", "--position", "20", "--top", "3"], capsys)
    assert code == 0, errors
    assert "the fixture's example (16 random tokens then again after a start token, seed 0" in out
    assert f"readout: logit[{int(ids[5])}] − logit[" in out
    code, out, errors = run(["scores", "--model", fixture, "--example", "--layer", "1", "--query", "20"], capsys)
    assert code == 0, errors
    assert re.search(r"score at key 5\b", out), out
    given = ",".join(str(int(t)) for t in ids[:10])
    code, out, errors = run(["attribute", "--model", fixture, "--ids", given, "--top", "2"], capsys)
    assert code == 0 and "inputs: the given 10 token ids" in out, errors


def test_paths_states_its_seed_and_gives_the_demos_numbers(capsys):
    """``pathkernels paths`` of the built-in network and the demo's section 3
    (``experiments.ratio_by_length``) are the same network on the same input: the same numbers
    under the same label, which states the seed."""
    from pathkernels.app import experiments

    for seed in (0, 3):
        code, out, errors = run(["paths", "--layers", "3", "--seed", str(seed)], capsys)
        assert code == 0, errors
        assert f"(L = 3, H = 4, n = 32, seed {seed}); all 125 paths, exactly" in out
        medians = [float(line.split()[6]) for line in out.splitlines()[2:6]]
        expected = experiments.ratio_by_length(num_layers=3, seed=seed).by_length()["median"].tolist()
        assert medians == pytest.approx(expected, rel=5e-3), (medians, expected)


def test_attributions_by_length_add_up_to_the_readout_when_not_every_path_is_enumerated(tmp_path, capsys):
    """``--max-length 1``: the by-length table and its CSV carry what the longer paths hold together
    as a row of its own, so that they add up, with the constant, to the readout."""
    import pandas as pd

    code, out, errors = run(["attribute", "--max-length", "1", "--out", str(tmp_path)], capsys)
    assert code == 0, errors
    value = float(re.search(r"at token \d+ = (\S+) \(the model's own", out).group(1))
    constant = float(re.search(r"; (\S+) of it is constant", out).group(1))
    table = pd.read_csv(tmp_path / "attribution_by_length.csv")
    assert table["length"].astype(str).tolist() == ["0", "1", "2–4 (together)"]
    assert table["attribution"].sum() + constant == pytest.approx(value, rel=1e-5, abs=1e-5)


def test_sources_that_are_exactly_zero_are_named_apart_from_the_by_source_table(capsys):
    """The Llama fixture has no attention biases, the attention-only one MLPs frozen at 0: those
    sources are named once, as exactly 0, not listed as rows of 0; GPT-2's are all listed."""
    for fixture, empty in (("llama_2l", "L0 attention bias, L1 attention bias"), ("attn_only_2l", "L0 MLP, L1 MLP")):
        code, out, errors = run(["attribute", "--model", f"pathkernels/fixtures/{fixture}", "--example"], capsys)
        assert code == 0, errors
        assert f"Attribution by source (exactly 0, left out: {empty})" in out
        table = out.split("Attribution by source")[1].split("The ")[0]
        assert all(name not in table.split(")", 1)[1] for name in empty.split(", "))
    argv = ["attribute", "--model", "pathkernels/fixtures/gpt2_4l", "--example", "--max-length", "1"]
    code, out, _ = run(argv, capsys)
    assert "Attribution by source\n" in out and "L3 attention bias" in out.split("Attribution by source")[1]


# --- fixtures by name, refusals before the model loads, tables that list every row once -------------


def test_a_fixtures_name_reads_the_fixture_from_any_folder(tmp_path, monkeypatch, capsys):
    """``--model attn_only_2l`` away from the checkout reads the fixture (its example and the
    README's result); a folder of that name where the command runs is read instead; a name that is
    neither is refused, listing the fixtures."""
    from pathkernels.fixtures import FIXTURES

    assert sizes.fixture_names() == sorted(FIXTURES)  # found from the listing, without importing torch
    monkeypatch.chdir(tmp_path)
    code, out, errors = run(["scores", "--model", "attn_only_2l", "--example", "--layer", "1", "--query", "20"], capsys)
    assert code == 0, errors
    assert out.startswith("Attention scores of attn_only_2l, pretrained weights") and re.search(r"key 5\b", out)
    assert sizes.model_folder("gpt2_4l") == sizes.FIXTURE_ROOT / "gpt2_4l"
    tiny_gpt2(tmp_path / "gpt2_4l")  # a folder of a fixture's name, here: read as the path it is
    assert sizes.model_folder("gpt2_4l").resolve() == (tmp_path / "gpt2_4l").resolve()
    assert sizes.model_shape("gpt2_4l")["width"] == 16
    code, _, errors = run(["attribute", "--model", "gpt2_5l"], capsys)
    assert code == 2 and errors == [
        "pathkernels attribute: --model gpt2_5l: no such file or directory (models are never downloaded); expected "
        "a model folder, a config file or the name of one of pathkernels' fixtures "
        "(attn_only_2l, gpt2_4l, llama_2l, permuted_2l)"
    ]


def _early_refusals(tmp_path) -> list[tuple[list[str], str]]:
    """What the options and a model's config show to be wrong, each with its error line."""
    prompted = tmp_path / "prompted"  # learned positions and a tokenizer: a prompt's length is not known yet
    prompted.mkdir()
    config = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 30, "n_positions": 20}
    (prompted / "config.json").write_text(json.dumps(config))
    (prompted / "tokenizer.json").write_text("{}")
    fifty = ",".join(str(i) for i in range(1, 51))
    return [
        (
            ["scores", "--model", "attn_only_2l", "--example", "--query", "5", "--key", "20"],
            "--key: expected a key that token 5 may attend (0…5), got 20 (the attention is causal)",
        ),
        (
            ["scores", "--model", "gpt2_4l", "--query", "-13", "--versus", "-2"],
            "--versus: expected a key that token 3 may attend (0…3), got 14 (the attention is causal)",
        ),
        (
            ["scores", "--model", "llama_2l", "--tokens", "10", "--key", "10"],
            "--key: expected a token position in [-10, 10), got 10 (the input has 10 tokens)",
        ),
        (
            ["scores", "--model", "gpt2_4l", "--key", "3", "--versus", "-13"],
            "--versus: expected a key other than --key (3)",
        ),
        (
            ["scores", "--model", str(prompted), "--text", "a prompt", "--query", "25"],
            f"--query: expected a token position in [-20, 20), got 25 (the model {prompted} embeds positions for at "
            "most 20 tokens)",
        ),
        (
            ["scores", "--model", str(prompted), "--query", "3", "--key", "5"],
            "--key: expected a key at or before 3, got 5 (the attention is causal)",
        ),
        (
            ["attribute", "--model", "attn_only_2l", "--example", "--position", "40"],
            "--position: expected a token position in [-33, 33), got 40 (the input has 33 tokens)",
        ),
        (
            ["attribute", "--model", "llama_2l", "--ids", "1,2,3", "--position", "-4"],
            "--position: expected a token position in [-3, 3), got -4 (the input has 3 tokens)",
        ),
        (["attribute", "--model", "llama_2l", "--target", "64"], "--target: expected a token id in [0, 64), got 64"),
        (
            ["attribute", "--model", "llama_2l", "--versus", "the"],
            "--versus: expected a token id (an integer), got 'the' (llama_2l has no tokenizer to read token text)",
        ),
        (
            ["attribute", "--model", "attn_only_2l", "--target", "3", "--versus", "3"],
            "--versus: expected a token other than --target (3)",
        ),
        (
            ["attribute", "--model", "gpt2_4l", "--max-length", "5"],
            "--max-length: expected at most the model's 4 layers, got 5",
        ),
        (
            ["collapse", "--model", "attn_only_2l", "--ids", fifty],
            "--ids: 50 token ids; expected at most 48, the positions the model attn_only_2l embeds",
        ),
        (["attribute", "--max-length", "5"], "--max-length: expected at most the model's 4 layers, got 5"),
    ]


def test_what_the_config_shows_to_be_wrong_is_refused_before_the_model_loads(tmp_path):
    """Positions beyond the input (or, for a prompt, beyond the positions the model embeds), a key
    after its query under causal attention, token ids beyond the vocabulary, a --max-length beyond
    the layers: each refused by the whole program, from any folder, with exit code 2 and one line
    naming the option, before torch is imported (so before any model is read; they took 8–9 s
    after loading it)."""
    for argv, message in _early_refusals(tmp_path):
        script = (
            "import sys; from pathkernels.app.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr == f"pathkernels {argv[0]}: {message}\n", argv


def test_the_early_checks_let_through_what_the_model_accepts(capsys):
    """The checks before the model loads refuse nothing the model takes: the last key a query may
    attend, negative positions, the versus key before the key (the built-in network and a fixture)."""
    argv = ["scores", "--layers", "2", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "2"]
    for options in (["--query", "3", "--key", "3", "--versus", "0"], ["--query", "-1", "--key", "-6"]):
        code, out, errors = run([*argv, *options], capsys)
        assert code == 0, (options, errors)
    code, out, errors = run(
        ["attribute", "--model", "gpt2_4l", "--position", "-16", "--target", "63", "--top", "1"], capsys
    )
    assert code == 0 and "readout: logit[63] − logit[" in out and "at token 0 =" in out, errors


def test_a_layer_0_head_lists_its_pairs_once_in_one_table(capsys):
    """Layer 0 has one path per side (the embedding) and each side's constant: 4 pairs, listed once
    (not as a largest and a smallest table of the same pairs), "1 path", and the 4 groups as all of
    them. Where the pairs outnumber twice --top, the two tables."""
    argv = ["scores", "--model", "attn_only_2l", "--example", "--layer", "0", "--head", "1"]
    code, out, errors = run([*argv, "--top", "5"], capsys)
    assert code == 0, errors
    lines = out.splitlines()
    headings = [lines[i - 1] for i, line in enumerate(lines) if line and set(line) == {"="}]
    key = re.search(r"The score at key (\d+),", out).group(1)
    assert headings[1:] == [
        f"The score at key {key}, by (query group, key group): all 4, largest in size first",
        f"All 4 pairs (query path · key path) of the score at key {key}, largest first",
    ]
    assert "every pair of the 1 path per side below layer 0, listed (with each side's constant: 4 pairs)" in out
    assert "1 paths" not in out
    table = out.split(headings[-1])[1].strip().splitlines()[2:]
    assert [int(row.split()[0]) for row in table] == [1, 2, 3, 4]
    values = [float(row.split()[-2]) for row in table]
    assert values == sorted(values, reverse=True)
    code, out, errors = run([*argv, "--top", "1"], capsys)
    assert code == 0 and "The 1 largest pairs" in out and "The 1 smallest pairs" in out, errors


def test_attribute_lists_few_paths_once_in_one_table(capsys):
    """Where the enumerated paths are at most twice --top, one table lists them all, largest first."""
    argv = ["attribute", "--model", "llama_2l", "--ids", "1,2", "--max-length", "0"]
    code, out, errors = run([*argv, "--top", "3"], capsys)
    assert code == 0, errors
    assert "smallest" not in out and "The 3 largest" not in out
    table = out.split("The attributions of the 5 enumerated paths, largest first\n")[1].strip().splitlines()[2:]
    assert [int(row.split()[0]) for row in table] == [1, 2, 3, 4, 5]
    code, out, errors = run([*argv, "--top", "2"], capsys)
    assert "The 2 largest attributions among the 5 enumerated paths" in out
    assert "The 2 smallest attributions among the 5 enumerated paths" in out
