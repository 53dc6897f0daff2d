"""pk.experiments and the command line: tables, plots, and the demo end to end."""

import copy
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import pathkernels as pk  # noqa: E402
from pathkernels.app import experiments  # noqa: E402  (after the skips above)
from pathkernels.app.cli import main  # noqa: E402


def test_collapse_table_and_plot():
    table = experiments.collapse_vs_depth(num_layers=3, d_model=16, num_heads=2, n=6, batch=2, seeds=1)
    assert list(table.columns) == ["variant", "depth", "mean", "median", "q10", "q90"]
    assert list(table["variant"].unique()) == list(experiments.VARIANTS) and len(table) == 4 * 4
    depth0 = table[table["depth"] == 0]["median"]
    assert depth0.nunique() == 1  # every variant starts from the same inputs
    # The median is interpolated, as q10 and q90 are (the lower middle value lay below q10).
    assert bool(((table["q10"] <= table["median"]) & (table["median"] <= table["q90"])).all())
    assert experiments.collapse_rows("v", torch.tensor([[1.0, 3.0]]))[0]["median"] == 2.0
    fig = experiments.plot_collapse(table)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend()
    assert all(float(tick).is_integer() for tick in ax.get_xticks())
    # The float64 round-off line only where the data come near it (3 layers of pure attention do not).
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    near = float(table["q10"].min()) < 1e3 * 2 * torch.finfo(torch.float64).eps
    assert ("float64 round-off" in labels) == near


def test_collapse_plot_with_exact_zeros_spans_the_measured_values():
    """Tokens equal to the last bit give a ratio of exactly 0: such points are marked on the axis'
    bottom edge, a decade below the smallest positive value (here the round-off line), and the
    axis does not run down to 1e-300."""
    import pandas as pd

    rows = []
    for variant, medians in {"pure attention": [0.98, 0.02, 2e-7, 0.0], "+skip": [0.98, 0.9, 0.8, 0.7]}.items():
        for depth, median in enumerate(medians):
            rows.append(
                {"variant": variant, "depth": depth, "mean": median, "median": median, "q10": median, "q90": median}
            )
    fig = experiments.plot_collapse(pd.DataFrame(rows))
    ax = fig.axes[0]
    floor = 2 * torch.finfo(torch.float64).eps
    assert ax.get_ylim()[0] == pytest.approx(floor / 10)
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "exactly 0 (all tokens equal)" in labels and "float64 round-off" in labels
    markers = [line for line in ax.get_lines() if line.get_marker() == "v" and len(line.get_xdata())]
    assert len(markers) == 1 and list(markers[0].get_xdata()) == [3]
    assert list(markers[0].get_ydata()) == [pytest.approx(floor / 10)]


def test_collapse_plot_of_a_model_that_keeps_its_rank_spans_its_data(tmp_path, capsys):
    """A trained model's ratios (0.6–0.97): the axis spans them, not 1e-16 … 1, without the
    round-off line; the command line's legend, table and CSV name the model by its folder's name,
    and the title fits the figure."""
    from pathkernels.app.cli import main

    assert main(["collapse", "--model", "pathkernels/fixtures/gpt2_4l", "--batch", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = __import__("pandas").read_csv(tmp_path / "collapse.csv")
    assert set(table["variant"]) == {"gpt2_4l"} and "variant  gpt2_4l" in out
    fig = experiments.plot_collapse(table, title="Rank collapse: gpt2_4l, pretrained weights")
    ax = fig.axes[0]
    assert ax.get_ylim()[0] >= 0.1 * float(table["q10"].min())
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["gpt2_4l"]
    assert all(len(line) <= 72 for line in ax.get_title().splitlines())


def test_path_length_distribution_is_binomial():
    table = experiments.path_length_distribution({"tiny": (2, 2), "BERT": (12, 12)})
    tiny = table[table["architecture"] == "tiny"]
    assert list(tiny["path_count"]) == [1, 4, 4]
    assert tiny["share"].tolist() == pytest.approx([1 / 9, 4 / 9, 4 / 9])
    bert = table[table["architecture"] == "BERT"]
    assert bert["share"].sum() == pytest.approx(1)
    assert bert["path_count"].iloc[3] == math.comb(12, 3) * 12**3
    assert experiments.plot_path_lengths(table).axes[0].get_yscale() == "log"


def test_thread_choice_runs_the_faster_count_and_restores_the_setting():
    """Trial steps on one thread and on all, the faster count for the rest, measured again every
    `every` steps; the setting before is restored. Here one thread is made the faster."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to choose")
    most = torch.get_num_threads()
    choice = experiments.ThreadChoice(every=6, trials=1)
    used = []
    for step in range(12):
        with choice.step(step):
            used.append(torch.get_num_threads())
            if torch.get_num_threads() > 1 and step % 6 < 2:
                time.sleep(0.02)  # all threads, slower in their trial step
    choice.close()
    assert used == [1, most, 1, 1, 1, 1] * 2 and choice.chosen == 1
    assert torch.get_num_threads() == most


def test_sorting_training_on_one_thread_agrees_with_the_chosen_counts():
    """The thread count ThreadChoice picks leaves the training's outcome alone: one thread
    throughout against the choice (bit for bit on the development machine; 1e-5 here)."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: nothing to choose")
    settings = dict(vocab=6, n=4, d_model=16, num_heads=2, num_layers=2, steps=30, batch=32, test_size=64)
    chosen = experiments.path_effectiveness(**settings)
    most = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = experiments.path_effectiveness(**settings)
    finally:
        torch.set_num_threads(most)
    for a, b in zip(chosen.model.parameters(), single.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    pd.testing.assert_frame_equal(chosen.table, single.table)


def test_path_effectiveness_small():
    result = experiments.path_effectiveness(
        vocab=6, n=4, d_model=16, num_heads=2, num_layers=2, steps=30, batch=32, test_size=64
    )
    table = result.table
    assert list(table["max_length"]) == [0, 1, 2] and list(table["path_count"]) == [1, 5, 9]
    assert ((table["token_accuracy"] >= 0) & (table["token_accuracy"] <= 1)).all()
    # k = L keeps every path: the last row is the model's own accuracy, on any batch.
    tokens, target = experiments.sorting_batch(64, 4, 6, torch.Generator().manual_seed(1))
    fresh = experiments.truncation_accuracy(result.model, tokens, target)
    with torch.no_grad():
        predicted = copy.deepcopy(result.model).double()(tokens)[0].argmax(-1)
    assert fresh["token_accuracy"].iloc[-1] == pytest.approx((predicted == target).double().mean().item())
    assert experiments.plot_effectiveness(table).axes[0].get_xlabel().startswith("longest path kept")


def test_cli_subcommands_write_tables_and_plots(tmp_path, capsys):
    assert (
        main(
            [
                "collapse",
                "--layers",
                "3",
                "--width",
                "16",
                "--heads",
                "2",
                "--tokens",
                "6",
                "--batch",
                "2",
                "--seeds",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (
        main(["paths", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", "--out", str(tmp_path)]) == 0
    )
    assert (
        main(["paths", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", "--samples-per-length", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "Median residual ratio" in out and "all 27 paths, exactly" in out and "up to 3 distinct paths" in out
    for name in ("collapse.csv", "collapse.png", "ratio_by_length.csv", "ratio_by_length.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = pd.read_csv(tmp_path / "ratio_by_length.csv")
    assert table["path_count"].tolist() == [1, 6, 12, 8]


def test_cli_reads_huggingface_directories_and_configs(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=30, n_positions=16)
    transformers.GPT2Model(config).save_pretrained(tmp_path / "weights")
    config.save_pretrained(tmp_path / "config_only")
    assert main(["collapse", "--model", str(tmp_path / "weights"), "--tokens", "6", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "pretrained weights" in out and "2 sequence(s) of 6 random token ids (seed 0) (no tokenizer" in out
    assert (
        main(["paths", "--model", str(tmp_path / "config_only" / "config.json"), "--tokens", "6", "--device", "cpu"])
        == 0
    )
    out = capsys.readouterr().out
    assert "at initialisation (random weights from its config)" in out and "all 9 paths, exactly" in out
    assert main(["paths", "--model", str(tmp_path / "missing")]) == 2
    assert "no such file or directory (models are never downloaded)" in capsys.readouterr().err


def test_cli_feeds_text_through_the_model_directorys_tokenizer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox", "jumps", "over", "dog"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=len(words),
        max_position_embeddings=32,
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    assert main(["paths", "--model", str(tmp_path), "--text", "the quick brown fox", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "the prompt 'the quick brown fox' (6 tokens, the model's tokenizer)" in out  # [CLS] … [SEP]
    assert main(["paths", "--model", str(tmp_path), "--device", "cpu"]) == 0
    assert "the default prompt" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["paths", "--layers", "-2"], "argument --layers: expected an integer >= 1, got -2"),
        (["paths", "--heads", "0"], "argument --heads: expected an integer >= 1, got 0"),
        (["collapse", "--width", "-8"], "argument --width: expected an integer >= 1, got -8"),
        (["paths", "--tokens", "-5"], "argument --tokens: expected an integer >= 2, got -5"),
        (["paths", "--tokens", "1"], "argument --tokens: expected an integer >= 2, got 1"),
        (["paths", "--samples-per-length", "0"], "argument --samples-per-length: expected an integer >= 1, got 0"),
        (["collapse", "--seeds", "x"], "argument --seeds: expected an integer >= 1, got 'x'"),
        (["paths", "--width", "2", "--heads", "4"], "argument --width: expected at least --heads = 4"),
        (["attribute", "--width", "16", "--heads", "3"], "argument --width: expected a multiple of --heads = 3"),
        (["scores", "--width", "10", "--heads", "4"], "argument --width: expected a multiple of --heads = 4"),
        (["paths", "--text", "hello"], "--text needs --model"),
        (
            ["paths", "--model", "some-dir", "--layers", "3", "--heads", "2"],
            "--layers, --heads set the built-in network and do not apply with --model some-dir",
        ),
        (
            ["collapse", "--model", "some-dir", "--layers", "3"],
            "--layers sets the built-in network and does not apply with --model some-dir",
        ),
        (["collapse", "--out", "/proc/x"], "pathkernels collapse: --out /proc/x: cannot write there"),
        (["paths", "--out", "/proc/x/y"], "pathkernels paths: --out /proc/x/y: cannot write there"),
        (["bench", "--out", "/proc/x/speed.json"], "pathkernels bench: --out /proc/x/speed.json: cannot write there"),
        (["bench", "--out", "/"], "pathkernels bench: --out /: is a folder; expected a file name"),
        (
            ["paths", "--tokens", "100000", "--layers", "2", "--heads", "1"],
            "pathkernels paths: 1 × 2 layers × 1 heads × 100000² tokens of attention need about 596.05 GiB",
        ),
        (
            ["collapse", "--tokens", "100000", "--layers", "2", "--heads", "1", "--batch", "1"],
            "pathkernels collapse: 1 × 2 layers × 1 heads × 100000² tokens of attention need about 298.02 GiB",
        ),
    ],
)
def test_cli_refuses_bad_options_in_one_line(argv, message):
    run = subprocess.run([sys.executable, "-m", "pathkernels", *argv], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


EARLY_REFUSALS = [
    (["paths", "--layrs", "3"], "pathkernels paths: unrecognized arguments: --layrs 3"),
    (["attribute", "--top", "3", "--topk", "5"], "pathkernels attribute: unrecognized arguments: --topk 5"),
    (["attribute", "--position", "16"], "pathkernels attribute: --position: expected a token position in [-16, 16)"),
    (["attribute", "--tokens", "4", "--position", "-5"], "--position: expected a token position in [-4, 4), got -5"),
    (["attribute", "--target", "1000"], "pathkernels attribute: --target: expected a token id in [0, 1000), got 1000"),
    (["attribute", "--versus", "hello"], "--versus: expected a token id (an integer), got 'hello' (token text needs"),
    (["attribute", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such file or directory"),
    (
        ["attribute", "--direction", "/nonexistent.pt"],
        "pathkernels attribute: --direction /nonexistent.pt: no such file",
    ),
    (["paths", "--model", "README.md"], "pathkernels paths: --model README.md: not a JSON config file"),
]


@pytest.mark.parametrize("argv, message", EARLY_REFUSALS, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_cli_refuses_cheap_mistakes_before_importing_torch(argv, message):
    """Unknown options name the subcommand; a position beyond the tokens, a token id beyond the
    built-in vocabulary, token text without a tokenizer, a missing --model or --direction and a
    config that is not JSON are refused from the options alone (exit code 2, one line), without
    importing torch."""
    script = (
        "import sys\n"
        "from pathkernels.app.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1]
    )
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr


def test_cli_reports_bad_models_in_one_line_and_tracebacks_only_with_debug(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "unknown.json").write_text('{"model_type": "no-such-architecture"}')
    (tmp_path / "broken.json").write_text("{not json")
    transformers.T5Config(num_layers=1, d_model=16, num_heads=2, d_kv=8, vocab_size=30).save_pretrained(tmp_path / "t5")
    cases = {
        "unknown.json": "cannot read it as a transformers model",
        "broken.json": "--model " + str(tmp_path / "broken.json") + ": not a JSON config file",
        "t5": "expected a transformers model of type",
    }
    for name, message in cases.items():
        run = subprocess.run(
            [sys.executable, "-m", "pathkernels", "paths", "--model", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        errors = [line for line in run.stderr.splitlines() if not line.startswith("[transformers]")]
        assert run.returncode == 2 and len(errors) == 1 and message in errors[0], run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pathkernels", "paths", "--model", str(tmp_path / "t5"), "--debug"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "Traceback" in run.stderr


def test_cli_help_shows_defaults_and_descriptions():
    for command in ("demo", "collapse", "paths", "bench"):
        run = subprocess.run(
            [sys.executable, "-m", "pathkernels", command, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert "(default: auto)" in run.stdout or command == "collapse", command
        description = run.stdout.split("\n\n")[1]
        assert len(description) > 40 and not description.startswith("options"), run.stdout


def test_cli_bench_out_writes_that_file(tmp_path, monkeypatch):
    from pathkernels.app.cli import bench as bench_command

    monkeypatch.setattr(bench_command, "QUICK_NORM_CASES", [(2, 8, 8)])
    monkeypatch.setattr(bench_command, "QUICK_PATH_CASES", [(2, 2, 8)])
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path / "speed.json")]) == 0
    payload = __import__("json").loads((tmp_path / "speed.json").read_text())
    assert payload["norms"] and payload["paths"] and sorted(p.name for p in tmp_path.iterdir()) == ["speed.json"]
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path / "speed.csv")]) == 0
    assert set(pd.read_csv(tmp_path / "speed.csv")["table"]) == {"norms", "paths"}


def test_progress_off_a_terminal_is_plain_lines(tmp_path):
    args = ["paths", "--layers", "3", "--heads", "2", "--width", "16", "--tokens", "6", "--device", "cpu"]
    run = subprocess.run(
        [sys.executable, "-m", "pathkernels", *args], capture_output=True, text=True, timeout=120, check=True
    )
    # stderr is a pipe here: no bar drawn with carriage returns, one plain line when the work ends
    assert run.stderr.splitlines() == ["pathkernels: 27/27 paths (100 %), 0 s"], run.stderr


def test_plain_progress_lines_come_about_every_interval(monkeypatch, capsys):
    from pathkernels.core import _progress

    clock = iter([0.0, 3.0, 11.0, 12.0, 25.0, 26.0]).__next__
    monkeypatch.setattr(_progress.time, "monotonic", clock)
    monkeypatch.setattr(_progress.sys.stderr, "isatty", lambda: False, raising=False)
    bar = _progress.progress_bar(100, unit="step", desc="training")
    assert isinstance(bar, _progress._LogLines)
    for _ in range(4):
        bar.update(20)  # at 3, 11, 12 and 25 s: lines at 11 and 25
    bar.close()  # at 26 s
    assert capsys.readouterr().err.splitlines() == [
        "training: 40/100 steps (40 %), 11 s, about 16 s left",
        "training: 80/100 steps (80 %), 25 s, about 6 s left",
        "training: 80/100 steps (80 %), 26 s, about 6 s left",
    ]


def test_cli_version_and_the_bench_caveat(monkeypatch, capsys):
    from pathkernels.app.cli import bench as bench_command

    cuda = "yes" if pk.build_info()["cuda"] else "no"
    expected = f"pathkernels {pk.__version__} (torch {torch.__version__}, CUDA kernels: {cuda}"
    # --version answers from the package metadata and the build's file, without importing torch.
    code = (
        "import sys, time\nstart = time.monotonic()\nfrom pathkernels.app.cli import main\ntry:\n"
        "    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, time.monotonic() - start)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line, imported = run.stdout.splitlines()
    assert line.startswith(expected) and "rebuild" not in line, line
    assert imported.split()[0] == "False" and float(imported.split()[1]) < 1.0, imported
    run = subprocess.run([sys.executable, "-m", "pathkernels", "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith(expected)
    from pathkernels.app import cli

    monkeypatch.setattr("importlib.metadata.version", lambda name: "9.9.9")
    assert cli.version_line().endswith(f"; built against torch {torch.__version__}: rebuild (make build))")
    monkeypatch.setattr(bench_command, "QUICK_NORM_CASES", [(2, 8, 8)])
    monkeypatch.setattr(bench_command, "QUICK_PATH_CASES", [(2, 2, 8)])
    assert main(["bench", "--quick", "--device", "cpu"]) == 0
    assert "each reported at its fastest round; the copy's rounds say whether the machine was busy" in (
        capsys.readouterr().out
    )


def test_interleaved_rounds_take_turns_and_the_busy_note():
    from pathkernels.app import benchmarks

    calls = []
    times = benchmarks.interleaved_rounds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, "cpu", min_run_time=0.0, rounds=3
    )
    assert calls == ["a", "b"] * 3 and {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3}
    # A copy of 1 GB repeated to 1 % in 8 rounds at 10 GB/s: quiet; one round slow: still quiet (the
    # median); half the rounds 3x slower, or every round at 0.5 GB/s: busy.
    quiet = [0.2, 0.201, 0.2, 0.202, 0.2, 0.2, 0.201, 0.2]
    assert not benchmarks.steadiness(quiet, 10**9)["busy"]
    assert benchmarks.steadiness(quiet, 10**9)["copy_gbs"] == pytest.approx(10.0)
    assert not benchmarks.steadiness([*quiet[:7], 5.0], 10**9)["busy"]
    assert benchmarks.steadiness([0.2] * 4 + [0.6] * 4, 10**9)["busy"]
    assert benchmarks.steadiness([4.0] * 8, 10**9)["busy"]
    rows = [{"busy": False, "copy_spread": 1.0, "copy_gbs": 10.0}]
    assert benchmarks.busy_note(rows) is None
    rows.append({"busy": True, "copy_spread": 3.0, "copy_gbs": 0.5})
    assert "1 of these 2 rows" in benchmarks.busy_note(rows) and "3.0x" in benchmarks.busy_note(rows)
    table = benchmarks.format_norm_table(
        [
            {
                "op": "composite_norm",
                "shape": [2, 8, 8],
                "dtype": "float32",
                "fused_ms": 1.0,
                "reference_ms": 2.0,
                "speedup": 2.0,
                "bandwidth_gbs": 1.0,
                "fraction_of_copy": 0.5,
                "busy": busy,
            }
            for busy in (False, True)
        ]
    )
    assert "composite_norm " in table.splitlines()[2] and "composite_norm*" in table.splitlines()[3]


def test_cli_collapse_takes_a_device(capsys):
    argv = [
        "collapse",
        "--layers",
        "2",
        "--width",
        "8",
        "--heads",
        "2",
        "--tokens",
        "4",
        "--batch",
        "2",
        "--seeds",
        "1",
    ]
    assert main([*argv, "--device", "cpu"]) == 0
    on_cpu = capsys.readouterr().out
    assert main([*argv, "--device", "auto"]) == 0  # auto is the CPU here, or the GPU where there is one
    assert "Median residual ratio" in on_cpu and "Median residual ratio" in capsys.readouterr().out


def test_demo_runs_end_to_end(tmp_path):
    """The README's main job, in its quick form, in a fresh process."""
    run = subprocess.run(
        [sys.executable, "-m", "pathkernels", "demo", "--quick", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for section in (
        "1. The norm",
        "2. Rank collapse",
        "3. Residual ratio",
        "4. How the paths",
        "5. Path effectiveness",
        "6. A trained model",
        "7. Speed",
    ):
        assert section in run.stdout
    figures = (
        "collapse",
        "ratio_by_length",
        "path_lengths",
        "path_effectiveness",
        "induction_paths",
        "trained_collapse",
    )
    expected = [f"{name}.{ext}" for name in figures for ext in ("csv", "png")] + ["speed_norms.csv", "speed_paths.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)


def test_cli_refuses_tokens_for_a_vision_model(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.ViTConfig(
        image_size=16, patch_size=4, num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32
    ).save_pretrained(tmp_path)
    assert main(["paths", "--model", str(tmp_path), "--tokens", "8", "--device", "cpu"]) == 2
    assert "--tokens does not apply to the vision model" in capsys.readouterr().err
    assert main(["paths", "--model", str(tmp_path), "--device", "cpu"]) == 0
    assert "1 random image(s) of 16×16 pixels" in capsys.readouterr().out


def test_cli_attribute_closes_the_logit_difference(tmp_path, capsys):
    """`attribute` on the built-in GPT-2: the readout equals the model's own logit difference, every
    path is enumerated, and the tables and plot are written."""
    pytest.importorskip("transformers")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    argv = ["attribute", "--layers", "2", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "4"]
    assert main([*argv, "--target", "5", "--versus", "9", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    readout = re.search(r"logit\[5\] − logit\[9\] at token 5 = (\S+) \(the model's own: (\S+)\)", out)
    assert readout is not None and math.isclose(float(readout[1]), float(readout[2]), rel_tol=1e-5, abs_tol=1e-9)
    assert "paths: all 17, exactly" in out
    by_length = pd.read_csv(tmp_path / "attribution_by_length.csv")
    assert by_length["paths"].tolist() == [5, 8, 4]  # the 5 sources direct; 4 + 2·2 through one head; 4 through two
    top = pd.read_csv(tmp_path / "attribution_top.csv")
    assert len(top) == 4 and top["attribution"].is_monotonic_decreasing
    assert (tmp_path / "attribution.png").stat().st_size > 0
    # Defaults: the top prediction against the second; --max-length leaves the rest to one exact sum.
    assert main([*argv, "--max-length", "1"]) == 0
    assert "paths: the 13 through at most 1 head, of 17; the longer ones carry" in capsys.readouterr().out


def test_cli_attribute_reads_a_base_model_directory_and_refuses_what_it_cannot_read(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=30, n_positions=16)
    transformers.GPT2Model(config).save_pretrained(tmp_path / "gpt2")  # no LM head: tied embeddings
    assert main(["attribute", "--model", str(tmp_path / "gpt2"), "--tokens", "5", "--target", "3"]) == 0
    out = capsys.readouterr().out
    readout = re.search(r"at token 4 = (\S+) \(the model's own: (\S+)\)", out)
    assert readout is not None and math.isclose(float(readout[1]), float(readout[2]), rel_tol=1e-9, abs_tol=1e-12)
    bert = transformers.BertConfig(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=30
    )
    transformers.BertForMaskedLM(bert).save_pretrained(tmp_path / "bert")
    assert main(["attribute", "--model", str(tmp_path / "bert"), "--tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert "the logits of BertForMaskedLM (bert) are not a linear map of its last hidden state" in err
    assert "pass --direction FILE (16 numbers" in err
    for argv, message in (
        (["--target", "x"], "--target: expected a token id (an integer), got 'x'"),
        (["--target", "1000"], "--target: expected a token id in [0, 1000), got 1000"),
        (["--target", "3", "--versus", "3"], "--versus: expected a token other than --target (3)"),
        (["--position", "16"], "--position: expected a token position in [-16, 16), got 16"),
        (["--max-length", "5"], "--max-length: expected at most the model's 4 layers, got 5"),
    ):
        assert main(["attribute", *argv]) == 2
        assert message in capsys.readouterr().err


def test_cli_attribute_searches_the_top_paths_of_a_tree_too_large_to_enumerate(tmp_path, capsys, monkeypatch):
    """Above the enumeration limit (lowered here to 10 paths), the sums come from the short paths
    and the top and bottom paths from the certified search over all of them: the same as full
    enumeration finds."""
    pytest.importorskip("transformers")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    import pathkernels.app.cli.attribute as attribute_command

    argv = ["attribute", "--layers", "2", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "4"]
    assert main([*argv, "--target", "5", "--versus", "9", "--out", str(tmp_path / "all")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(attribute_command, "MAX_ATTRIBUTION_PATHS", 10)
    assert main([*argv, "--target", "5", "--versus", "9", "--out", str(tmp_path / "search")]) == 0
    out = capsys.readouterr().out
    assert "the 4 largest of all paths: a best-first search visited" in out and "certified" in out
    assert "The 4 largest attributions among all 17 paths\n" in out
    for name in ("attribution_top.csv", "attribution_bottom.csv"):
        every, searched = pd.read_csv(tmp_path / "all" / name), pd.read_csv(tmp_path / "search" / name)
        assert every["path"].tolist() == searched["path"].tolist()
        assert every["attribution"].tolist() == pytest.approx(searched["attribution"].tolist(), rel=1e-12)
    assert (tmp_path / "search" / "attribution.png").stat().st_size > 0
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--time-limit", "0"])
    assert stopped.value.code == 2
    assert "argument --time-limit: expected a positive number of seconds, got 0" in capsys.readouterr().err


def test_induction_example_is_exact_and_finds_the_induction_path():
    pytest.importorskip("pandas")
    pytest.importorskip("transformers")
    example = pk.experiments.induction_example(top_k=3)
    result, table = example.attribution, example.by_length
    # The example is [BOS, A, A] with A of 16 tokens: the target follows position 20's first copy, at 5.
    from pathkernels.fixtures import load_fixture

    _, inputs = load_fixture("attn_only_2l")
    assert example.position == 20 and example.target == int(inputs["input_ids"][0, 5])
    carried = float(result.value[0, 0] - result.constant[0, 0])
    assert table["attribution"].sum() == pytest.approx(carried, rel=1e-10)
    assert table["share"].sum() == pytest.approx(1.0, rel=1e-10)
    assert table["paths"].tolist() == [5, 16, 16]  # 37 paths: sources by heads on the path
    top = result.table()[0]
    assert top["path"].startswith("L1H") and top["path"].endswith("from embedding")
    with pytest.raises(ValueError, match="expected position in"):
        pk.experiments.induction_example(position=3)


def test_trained_collapse_trained_terms_keep_their_rank():
    pytest.importorskip("pandas")
    pytest.importorskip("transformers")
    table = pk.experiments.trained_collapse("gpt2_4l")
    trained = table[table["weights"] == "trained"].set_index("length")["median"]
    initial = table[table["weights"] == "initialisation"].set_index("length")["median"]
    assert list(trained.index) == [0, 1, 2, 3, 4] == list(initial.index)
    assert table[table["weights"] == "trained"]["paths"].tolist() == [9, 64, 224, 384, 256]
    # At initialisation each head takes the terms further toward rank 1; trained, they keep it.
    assert all(initial[k + 1] < initial[k] for k in range(1, 4))
    assert trained[4] > 2 * initial[4] and trained[3] > 2 * initial[3]
    # The bias paths (ratio round-off) are left out of the band: its lower edge stays with the
    # paths that carry the stream, far above round-off.
    assert float(table["q10"].min()) > 0.1


def test_the_engines_own_gemm_rate_counts_every_thread(monkeypatch):
    """bench_paths' second floor: the engine's own GEMM on one thread, times torch's threads."""
    from pathkernels.app import benchmarks

    monkeypatch.setattr(benchmarks, "seconds_per_call", lambda call, **_: (call(), 0.5)[1])
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda count=threads: count)
        assert benchmarks.own_gemm_rate(torch.float64, size=10) == 2 * 10**3 / 0.5 * threads


def test_the_machine_is_named_by_its_cpu_model_and_instruction_sets():
    """Benchmarks name the CPU by ``/proc/cpuinfo``'s model and its vector instruction sets (where
    the file exists), with torch's threads: what a reader needs to compare figures across CPUs."""
    from pathlib import Path

    from pathkernels.app.benchmarks import cpu_description, machine_description

    text = cpu_description()
    assert text and machine_description("cpu") == f"{text}, {torch.get_num_threads()} threads"
    info = Path("/proc/cpuinfo")
    content = info.read_text() if info.exists() else ""
    if "model name" in content and "flags" in content:  # x86 Linux
        model = next(line.split(":", 1)[1].strip() for line in content.splitlines() if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in content.splitlines() if line.startswith("flags"))
        assert text.startswith(model)
        assert ("AVX-512" in text) == ("avx512f" in flags) and ("AVX2" in text) == ("avx2" in flags)
        family = re.search(r"^cpu family\s*:\s*(\S+)", content, re.MULTILINE)
        number = re.search(r"^model\s*:\s*(\S+)", content, re.MULTILINE)
        if family and number:
            assert f"(family {family[1]} model {number[1]}; " in text
