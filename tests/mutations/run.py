"""Plant one known bug in a scratch copy of the repository and run the tests that must catch it.

Usage: ``tests/mutations/run.sh N [N ...]`` (or ``all``; ``--check`` only checks that every plant still applies).
For each plant (``plants.py``) the working tree (tracked and untracked, not ignored, files) is copied to a temporary
directory, each edit replaces one snippet that must occur exactly once in the package, the tests, the examples or the
benchmarks (found by content, so renames do not break the plants), and pytest runs the plant's tests there.
``caught``: the tests failed (pytest exit 1), with the plant's ``expect`` text in their output where it gives one
(``OTHER FAILURE`` without it); ``MISSED``: they passed; ``ERROR``: the edit did not apply or pytest
could not run them (exit 2-5). Read the failure lines it prints: a plant counts only if the failure is the one the
test is for. Exit status: 0 when every plant given was caught.

Not part of the normal run: pytest collects nothing here (no ``test_*.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plants import PLANTS  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEARCHED = ("fabric_hsdp", "tests", "examples", "benchmarks")
SEARCHED_FILES = ("Makefile", "pyproject.toml")  # the set-up a user runs is code too


def copy_tree(destination: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            target = destination / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def searched(root: Path) -> list[Path]:
    """The files a plant's snippet may be in."""
    sources = [path for top in SEARCHED for path in (root / top).rglob("*.py") if "mutations" not in path.parts]
    return sources + [root / name for name in SEARCHED_FILES if (root / name).is_file()]


def apply(root: Path, old: str, new: str) -> Path:
    found = [path for path in searched(root) if old in path.read_text()]
    counts = sum(path.read_text().count(old) for path in found)
    if counts != 1:
        where = [str(p.relative_to(root)) for p in found]
        raise LookupError(f"the snippet occurs {counts} times (in {where}), not once:\n{old}")
    path = found[0]
    path.write_text(path.read_text().replace(old, new))
    return path


def run(number: str) -> str:
    plant = PLANTS[number]
    with tempfile.TemporaryDirectory(prefix=f"hsdp-plant{number}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        try:
            edited = sorted({str(apply(root, old, new).relative_to(root)) for old, new in plant.edits})
        except LookupError as error:
            print(f"plant {number}: ERROR {error}")
            return "ERROR"
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *plant.tests]
        print(f"plant {number} ({plant.finding}): {plant.change}\n  edited {edited}\n  running {' '.join(plant.tests)}")
        started = time.monotonic()
        env = dict(os.environ, **dict(plant.env))
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
        lines = result.stdout.splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "E "))]
        # a launched rank's own error (the last line of its traceback), when the launch itself failed
        failed += [
            line for line in lines if line.startswith("E ") and "Error:" in line and "launch failed" not in line
        ][-2:]
        verdict = {0: "MISSED", 1: "caught"}.get(result.returncode, "ERROR")
        if verdict == "caught" and plant.expect and plant.expect not in result.stdout:
            verdict = "OTHER FAILURE"  # the tests failed, but not as this plant must make them fail
            print(f"  expected in the output: {plant.expect}")
        print(f"  -> {verdict} (pytest exit {result.returncode}, {seconds:.0f} s)")
        for line in failed[:6] + failed[-2:]:
            print(f"     {line[:300]}")
        if verdict == "ERROR":
            print(result.stdout[-3000:], result.stderr[-3000:])
        return verdict


def check() -> int:
    """``--check``: every plant's snippets occur exactly once here (no tests run)."""
    bad = 0
    for number, plant in PLANTS.items():
        for old, _ in plant.edits:
            counts = sum(path.read_text().count(old) for path in searched(REPO))
            if counts != 1:
                bad += 1
                print(f"plant {number}: its snippet occurs {counts} times:\n{old}")
    print(f"{len(PLANTS)} plants, {bad} snippet(s) not found exactly once")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        return check()
    numbers = list(PLANTS) if argv in ([], ["all"]) else argv
    verdicts = {number: run(number) for number in numbers}
    print("summary:", ", ".join(f"{n}: {v}" for n, v in verdicts.items()))
    return 0 if all(v == "caught" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
