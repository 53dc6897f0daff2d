"""What the command line's parser and every subcommand share, without torch: the one-line error,
the defaults, the check of ``--out``, and calls bounded in time."""

from __future__ import annotations

import contextlib
import math
import tempfile
import threading
from pathlib import Path

# --tokens by default: the built-in networks', and a --model's random token ids when its directory
# has no tokenizer (one with a tokenizer reads a fixed sentence unless --tokens or --text is given).
DEFAULT_TOKENS = {"collapse": 32, "paths": 32, "attribute": 16, "scores": 16, "graph": 16}

# The vocabulary of attribute's built-in GPT-2 (without --model).
BUILT_IN_VOCAB = 1000

# Paths enumerated by default: beyond this, `attribute` enumerates the longest lengths that fit.
MAX_ATTRIBUTION_PATHS = 10**7

# What --direction reads.
DIRECTION_FORMS = "a torch .pt tensor [d], a .npy array [d] or a text file of d numbers"

# Worker threads left running past the time limit (a search still in its set-up): the process
# does not wait for them when it ends (main, as the program's entry point).
ABANDONED: list[threading.Thread] = []


class CommandLineError(Exception):
    """A bad option or input found after parsing: reported in one line, exit code 2. Its message
    may begin with "pathkernels COMMAND: " (or "pathkernels: "); :func:`error_line` puts the
    command's name there either way."""


def error_line(command: str | None, message: str) -> str:
    """The one error line of every command: ``pathkernels COMMAND: message`` (``pathkernels:
    message`` before a command is known), whatever prefix ``message`` came with."""
    prefix = f"pathkernels {command}" if command else "pathkernels"
    for given in (f"{prefix}: ", "pathkernels: "):
        if message.startswith(given):
            message = message[len(given) :]
            break
    return f"{prefix}: {message}"


def check_writable(path: Path, option: str, command: str, *, folder: bool = True) -> None:
    """Make sure ``path`` (a folder, or with ``folder=False`` a file) can be written, before any
    work: the folder is created, a probe file written and removed there, and the folders this made
    removed again, so that a run refused or interrupted later leaves no empty folder behind (the
    outputs create it when they are written)."""
    directory = path if folder else path.parent
    if not folder and path.is_dir():
        raise CommandLineError(f"pathkernels {command}: {option} {path}: is a folder; expected a file name")
    made = [parent for parent in [directory, *directory.parents] if not parent.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".pathkernels-probe-"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise CommandLineError(f"pathkernels {command}: {option} {path}: cannot write there ({reason})") from None
    finally:
        for parent in made:
            with contextlib.suppress(OSError):  # not empty after all (another writer): leave it
                parent.rmdir()


def within(seconds: float, function, *args, **kwargs):
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
        ABANDONED.append(worker)
        return False, None
    if "error" in outcome:
        raise outcome["error"]
    return True, outcome["value"]
