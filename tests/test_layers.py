"""The package's layers: each imports only the layers below it (docs/architecture.md).

Read from the source (the import statements of every module, `ast`), so a new upward import,
anywhere in a module, fails here before it makes a cycle.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "seeupo_jax"

# Bottom up: a unit may import units of lower rank only (docs/architecture.md, "The layers").
RANK = {
  "text": 0,
  "fields": 0,
  "distributed": 0,
  "sharding": 0,
  "assets": 0,
  "losses": 1,
  "models": 1,
  "sampling": 2,
  "envs": 2,
  "learner": 3,
  "rollout": 4,
  "training": 5,
  "theory": 5,
  "devtools": 6,  # reads compiled programs of every layer; nothing in the package imports it
}
TOP = {"__init__", "_moved"}  # the package's own entry: installs the moved-path finder


def _unit(path: pathlib.Path) -> str:
  rel = path.relative_to(PACKAGE)
  return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: pathlib.Path) -> set[str]:
  units = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split(".")
      if parts[0] == "seeupo_jax" and len(parts) > 1 and parts[1] in RANK:
        units.add(parts[1])
  return units


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_of_the_package_has_a_rank():
  units = {_unit(p) for p in MODULES} - TOP
  assert units - set(RANK) == set(), "a new package or module: give it a rank (and a row in docs)"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_module_imports_only_layers_below_its_own(path):
  unit = _unit(path)
  if unit in TOP:
    return
  upward = {u for u in _imported_units(path) if u != unit and RANK[u] >= RANK[unit]}
  assert upward == set(), f"{unit} (rank {RANK[unit]}) imports {sorted(upward)}"


def test_the_rule_catches_an_upward_import(tmp_path):
  """The check itself can fail: the sampler importing the rollout engine is refused."""
  bad = PACKAGE / "sampling" / "x.py"
  source = tmp_path / "x.py"
  source.write_text("from seeupo_jax.rollout import roller\nimport seeupo_jax.text.messages\n")
  units = _imported_units(source)
  assert units == {"rollout", "text"}
  assert {u for u in units if RANK[u] >= RANK[_unit(bad)]} == {"rollout"}
