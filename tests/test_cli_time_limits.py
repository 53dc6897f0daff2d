"""`pathkernels attribute --time-limit` bounds the whole command.

`attribute --time-limit 5` of a GPT-2-small shape took 99 s: the limit applied to each of the two
searches alone, and the searches' set-up of their bounds (66 s there) ran before either looked at
the clock. Now the limit covers the model, its capture, the walk (each length walked whole, the
longest that finished reported, what the longer paths carry still exact) and the searches (one
left behind when its set-up outlasts the limit); work beyond the machine's memory is refused
before any is done. Slowness is simulated here, so that the tests are quick and do not depend on
the machine's speed.
"""

import re
import subprocess
import sys
import threading
import time

import pytest

import pathkernels as pk
import pathkernels.app.cli.attribute as attribute_command
from pathkernels.app.cli import main

ARGV = ["attribute", "--layers", "4", "--heads", "2", "--width", "16", "--tokens", "6", "--top", "3"]
TOKENS = ["--target", "5", "--versus", "9"]


def test_the_walk_stops_at_the_limit_and_keeps_the_lengths_it_finished(monkeypatch, capsys, tmp_path):
    pytest.importorskip("transformers")
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    assert main([*ARGV, *TOKENS, "--out", str(tmp_path / "all")]) == 0
    assert "paths: all 161, exactly" in capsys.readouterr().out
    real = pk.path_attribution

    def slow(stack, readout, **options):  # walks of two heads or more outlast the limit
        if options["max_length"] >= 2:
            time.sleep(2.5)
        return real(stack, readout, **options)

    monkeypatch.setattr(attribute_command, "path_attribution", slow)
    assert main([*ARGV, *TOKENS, "--time-limit", "2", "--out", str(tmp_path / "limited")]) == 0
    out = capsys.readouterr().out
    found = re.search(r"paths: the (\d+) through at most (\d) heads?, of 161; the longer ones carry", out)
    assert found is not None, out
    reached = int(found[2])
    assert reached < 2 and int(found[1]) == pk.core.paths.count_attribution_paths(4, 2, reached)
    assert "time limit: the walk stopped at the --time-limit of 2 s before the" in out
    # What it reports is exact: the sums of the lengths it walked are those of every path's walk.
    every = pd.read_csv(tmp_path / "all" / "attribution_by_length.csv")
    limited = pd.read_csv(tmp_path / "limited" / "attribution_by_length.csv")
    walked = [str(k) for k in range(reached + 1)]
    assert limited["length"].astype(str).tolist() == [*walked, f"{reached + 1}–4 (together)"]
    assert limited["attribution"].tolist()[:-1] == pytest.approx(
        every["attribution"][: reached + 1].tolist(), rel=1e-12
    )
    # and the row of the longer paths holds the rest: the rows add up to every path's total.
    assert limited["attribution"].sum() == pytest.approx(every["attribution"].sum(), rel=1e-10)


def test_a_search_whose_set_up_outlasts_the_limit_is_left_behind(monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    monkeypatch.setattr(attribute_command, "MAX_ATTRIBUTION_PATHS", 10)  # search the top paths of this small model
    release = threading.Event()
    calls = []

    def set_up_for_ever(*args, **options):  # a set-up of bounds that takes minutes
        calls.append(options["time_limit"])
        release.wait(60)
        raise AssertionError("not reached: the command no longer waits")

    monkeypatch.setattr(attribute_command, "top_paths", set_up_for_ever)
    start = time.monotonic()
    try:
        assert main([*ARGV, *TOKENS, "--time-limit", "3"]) == 0
        elapsed = time.monotonic() - start
    finally:
        release.set()
    out = capsys.readouterr().out
    assert (
        "the 3 largest of all paths: not searched, the set-up of the search's bounds outlasted the --time-limit" in out
    )
    assert len(calls) == 1 and 0 < calls[0] <= 3  # the second search, which would wait as long, is not started
    assert re.search(r"^The 3 largest attributions among the \d+ enumerated paths$", out, re.M), out  # labelled as such
    assert elapsed < 3 + 1 + 15  # the limit, the search's grace second, and a loaded machine's slack


def test_the_command_line_stops_at_a_tiny_limit_and_says_where():
    pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    run = subprocess.run(
        [sys.executable, "-m", "pathkernels", *ARGV, "--time-limit", "0.001"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(
        r"^pathkernels attribute: stopped at the --time-limit of 0\.001 s while building the model \([\d.]+ s in\): no "
        r"path attributed; a larger --time-limit goes on to the paths$",
        run.stdout,
        re.M,
    ), run.stdout


@pytest.mark.parametrize(
    "options, what",
    [
        (["--layers", "4000", "--width", "8192"], r"a GPT-2 of L = 4000, H = 4, d = 8192 and its capture of 16 tokens"),
        (["--tokens", "3000000"], r"a GPT-2 of L = 4, H = 4, d = 64 and its capture of 3000000 tokens"),
    ],
    ids=["parameters", "tokens"],
)
def test_work_beyond_memory_is_refused_before_any_is_done(options, what, capsys):
    """It was built until the kernel killed the process."""
    pytest.importorskip("transformers")
    start = time.monotonic()
    assert main(["attribute", *options]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        rf"pathkernels attribute: {what} need about [\d.]+ [TGP]iB \([\d,]+ bytes\), more than the .* available on "
        r"cpu; pass a smaller --layers, --width or --tokens\n",
        captured.err,
    ), captured.err
    assert time.monotonic() - start < 10
