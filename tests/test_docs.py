"""The tracked text files speak of the product, not of how the work on it was organised.

A figure keeps its command, machine and date; the history of how it came about lives in git.
The pattern is built from pieces so that this file does not match it.
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".md", ".py", ".sh", ".ipynb", ".toml", ".ini")

_S = "sess" + "ion"
HISTORY = re.compile(
  "|".join(
    [
      r"\b" + _S + r" [0-9]+",
      "this " + _S,
      _S + r"s? [0-9]+",
      "help" + "er " + _S,
      r"the (development |2-core )?V" + r"M\b",
      "le" + "nt machine",
      "iss" + r"ue [0-9]+",
      "a slow " + "day",
      "on a " + "lent",
      "next " + "item",
      "earl" + "ier " + _S,
    ]
  ),
  re.IGNORECASE,
)


def _tracked_text_files() -> list[str]:
  listed = subprocess.run(
    ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout
  return sorted(p for p in listed.split("\0") if p.endswith(SUFFIXES))


def history_lines(text: str) -> list[tuple[int, str]]:
  """(line number, line) of each line of `text` that matches `HISTORY`."""
  return [(n, line) for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


@pytest.mark.parametrize(
  "line",
  [
    "Measured in " + _S.capitalize() + " 12 on the 2-core CPU.",
    "figures of " + _S + "s 1-3",
    "rerun in this " + _S,
    "measured by a help" + "er " + _S,
    "on the V" + "M, under load",
    "on the development V" + "M",
    "the 2-core V" + "M was busy",
    "when a le" + "nt machine is free",
    "see iss" + "ue 22",
    "on a slow " + "day",
    "it is the next " + "item",
    "as an earl" + "ier " + _S + " found",
  ],
)
def test_the_pattern_finds_history(line):
  assert history_lines("ok\n" + line + "\n") == [(2, line)]


@pytest.mark.parametrize(
  "line",
  [
    "a `SamplerSession` of 8 rows over a paged cache",
    "2-core CPU (AMD EPYC), 2026-12-02, `python benchmarks/bench_rollout.py --repeats 3`",
    "the session's first turn makes 1 prefill and 4 decode calls",
    "a TPU VM pod slice whose environment names no workers",
    "CPython gh-106905: two threads parsing at once can fail",
  ],
)
def test_the_pattern_leaves_product_text_alone(line):
  assert history_lines(line) == []


def test_tracked_text_files_have_no_development_history():
  files = _tracked_text_files()
  assert "tests/test_docs.py" in files  # the listing works and this file is scanned too
  found = []
  for path in files:
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):  # tracked but deleted in the working tree
      continue
    with open(full, encoding="utf-8", errors="replace") as f:
      found += [f"{path}:{n}: {line.strip()}" for n, line in history_lines(f.read())]
  assert not found, (
    "development history in tracked files (say what is true now; a figure keeps its command, "
    "machine and date):\n" + "\n".join(found)
  )
