"""Old import paths of modules that moved keep resolving: `import seeupo_jax.<old>` gives the
module at its new path (the module object itself, so both names see one set of globals).

The import-path counterpart of the config's `MOVED_KEYS`: code and notebooks written against an
older layout keep working, while the tree holds each module once, where its role puts it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Mapping, Optional, Sequence

# old dotted path -> new dotted path
MOVED_MODULES: dict[str, str] = {
  "seeupo_jax.chat_tokens": "seeupo_jax.text.chat_tokens",
  "seeupo_jax.decode_layout": "seeupo_jax.sampling.layout",
  "seeupo_jax.hlo_collectives": "seeupo_jax.devtools.hlo_collectives",
  "seeupo_jax.sampling_probs": "seeupo_jax.sampling.selection",
  "seeupo_jax.tokenizer": "seeupo_jax.text.tokenizer",
}


class _Alias(importlib.abc.Loader):
  def __init__(self, target: str):
    self._target = target
    self._spec = None

  def create_module(self, spec):
    module = importlib.import_module(self._target)
    self._spec = module.__spec__  # the import machinery overwrites it with the alias's spec
    return module

  def exec_module(self, module) -> None:
    # The target module is already executed: give it back its own spec, nothing more.
    module.__spec__ = self._spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
  """A `sys.meta_path` finder answering only for the keys of `moved` (old -> new path)."""

  def __init__(self, moved: Mapping[str, str]):
    self._moved = moved

  def find_spec(
    self, fullname: str, path: Optional[Sequence[str]], target=None
  ) -> Optional[importlib.machinery.ModuleSpec]:
    del path, target
    new = self._moved.get(fullname)
    if new is None:
      return None
    return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install(moved: Mapping[str, str] = MOVED_MODULES) -> None:
  """Puts one finder for `moved` first on `sys.meta_path` (idempotent).

  First, so that an old path gives the module at its new path even where a later finder still
  sees a file at the old path: an editable install's finder maps `seeupo_jax.<name>` to the
  checkout it was installed from, which may be another checkout holding the old layout.
  """
  if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, MovedModuleFinder(moved))
