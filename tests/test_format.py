"""The tree is formatted with the formatter `pyproject.toml` names (ruff, 2-space indentation)."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
  exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
  assert exe, "ruff is not installed: pip install -e '.[test]'"
  return [exe]


def test_tree_is_formatted():
  result = subprocess.run(
    _ruff() + ["format", "--check", "."], cwd=ROOT, capture_output=True, text=True
  )
  assert result.returncode == 0, (
    "files are not formatted; run `ruff format .`:\n" + result.stdout + result.stderr
  )


def test_no_syntax_or_undefined_name_errors():
  result = subprocess.run(_ruff() + ["check", "."], cwd=ROOT, capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
