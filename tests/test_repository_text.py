"""The repository's text speaks for itself: no code, comment or document points a reader at the
project tracker's issue numbers ("issue 24", "(#12)"), which say nothing to a reader outside it and
go stale when the work is done. Say what the code does instead."""

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".cu", ".cuh", ".txt", ".toml", ".cfg", ".yml", ".yaml"}
NAMES = {"Makefile", "run"}
SKIPPED = {".git", ".venv", ".venv-cuda", "build", "dist", "node_modules", "__pycache__"}
TRACKER = re.compile(r"\bissues? ?#?\d+|\(#\d+\)|\bissue #\d+", re.IGNORECASE)


def text_files():
    """The repository's text files, this one (whose examples must match) aside."""
    for folder, folders, files in os.walk(ROOT):
        folders[:] = [f for f in folders if f not in SKIPPED and (not f.startswith(".") or f == ".ci")]
        for name in files:
            path = Path(folder) / name
            if (path.suffix in SUFFIXES or name in NAMES) and path != Path(__file__).resolve():
                yield path


def test_no_tracker_issue_numbers():
    found = []
    for path in text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if TRACKER.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "issue numbers of the tracker in the repository's text:\n" + "\n".join(found)


def test_the_pattern_catches_what_it_should():
    for text in ("(issue 24, in progress)", "Issue 17's CPU target", "issues 4, 13 and 35", "see #12 (#12)"):
        assert TRACKER.search(text), text
    for text in ("an issue of memory", "tissue 3", "the 24 issues"):
        assert not TRACKER.search(text), text
