"""Training checkpoints: the learner state, the PRNG key and the loop's progress, with orbax.

    ckpt = Checkpointer(workdir + "/checkpoints", keep=3, every=10, config=config.to_dict())
    restored = ckpt.restore_latest(abstract_of(state), abstract_of(rng))
    if restored is not None:
      iteration, state, rng, progress = restored
    ...
    ckpt.save(iteration, state, rng, {"next_task": ...})   # saves when iteration % every == 0
    ckpt.close()

One orbax `CheckpointManager` (as MaxText's `common/checkpointing.py`) holds, per saved
iteration, four items: `train_state` (any pytree of arrays, e.g. a learner `TrainState`, sharded
or not), `rng` (the key data of the PRNG key), `progress` (a JSON dict of the loop's position)
and `manifest` (JSON: every leaf's path, shape and dtype, the key's kind and the run's config).
A synchronous save (`asynchronous=False`) returns when the checkpoint is complete on disk, so a
kill -9 after it cannot lose it. An asynchronous one (`asynchronous=True`, the training
program's default: `checkpoint.asynchronous`) returns once the arrays are copied to host memory
(orbax's blocking part; the next update may then donate the device buffers) and writes the files
in a background thread while training goes on; the next `save` and `close` wait for it first, so
at most one save is in flight and a program that ends has every checkpoint it saved. A kill -9
while an asynchronous save is in flight loses that checkpoint only: the run resumes from the one
before. Orbax writes each checkpoint into `<iteration>.orbax-checkpoint-tmp-*`
and renames it to `<iteration>` only when complete, so a kill -9 during a save leaves the previous
checkpoints as they were; the leftover temporary directory is ignored by `restore_latest` and
deleted when the next `Checkpointer` that owns the directory opens it (not `read_only`: the
trainer, which holds the workdir's lock, so no other save is under way).

When a save is complete, the primary process records the size of every file of the checkpoint
in `<iteration>/file_sizes.json`; before orbax reads a checkpoint, its files are compared with
that record, so a truncated, emptied or deleted file (a crash, a full disk, a partial copy) is
found at once, without starting orbax's concurrent reads (which, abandoned, print tracebacks from
their threads). A checkpoint without the record (written before it, or killed between orbax's
rename and the record) is only checked by reading it.

A checkpoint that cannot be read (a truncated or deleted file, a missing item) is skipped with a
one-line warning naming it, and `restore_latest` restores the newest one that reads; unless
`read_only`, the unreadable newer ones are then moved aside to `<iteration>.unreadable` (kept
for inspection, out of orbax's sight, so the next save of that iteration has its name back).
When checkpoints exist but none reads, `restore_latest` raises `CheckpointsUnreadable`: a run
never starts again from iteration 0 silently.

Before restoring, the manifest is compared with the target: a different tree structure, shape or
dtype (e.g. the model preset changed but the workdir is reused) is a ValueError naming the first
differing leaf, and a config that differs in keys other than `allowed_to_differ` is a ValueError
listing them (`check_config`). The HF safetensors export of the model is separate
(`seeupo_jax.models.checkpoint.save`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging as std_logging
import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from seeupo_jax import learner
from seeupo_jax.training.checkpoint_manifest import (  # the checkpointer's API, too
  DEFAULT_ALLOWED_TO_DIFFER,
  MANIFEST_FORMAT,
  abstract_of,
  check_config,
  check_manifest,
  describe,
  is_typed_key,
  jsonable,
  rng_manifest,
  tree_manifest,
)

PyTree = Any

_STATE, _RNG, _PROGRESS, _MANIFEST = "train_state", "rng", "progress", "manifest"
_KEY_DATA = "key_data"  # orbax's StandardSave takes trees, not single arrays
UNREADABLE_SUFFIX = ".unreadable"
FILE_SIZES = "file_sizes.json"
"""The record, in each checkpoint directory, of its files' sizes in bytes when saved."""


class CheckpointsUnreadable(RuntimeError):
  """Checkpoints exist, but none of them can be read; the message names each with its error."""


# ----------------------------------------------------------------------------------------------
# The checkpointer.


def _key_data(rng) -> Any:
  """The uint32 key data of a typed key; a raw key as it is."""
  return jax.random.key_data(rng) if is_typed_key(rng) else rng


def _abstract_key_data(abstract_rng) -> jax.ShapeDtypeStruct:
  """The ShapeDtypeStruct of the key data behind `abstract_rng`, on its sharding (a typed key's
  trailing key-data axis is not named by the sharding's spec, so it stays whole)."""
  sharding = getattr(abstract_rng, "sharding", None)
  shape = jax.eval_shape(_key_data, jax.ShapeDtypeStruct(abstract_rng.shape, abstract_rng.dtype))
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)


def _directory(path: str) -> str:
  return path if "://" in path else os.path.abspath(path)


def _one_line(error: BaseException, limit: int = 300) -> str:
  """'Type: message' of the innermost cause of `error` (orbax wraps tensorstore's precise error
  in a generic one), its first line, at most `limit` characters."""
  seen = {id(error)}
  while True:
    inner = error.__cause__
    if inner is None and not error.__suppress_context__:  # `raise ... from None` ends the chain
      inner = error.__context__
    if inner is None or id(inner) in seen:
      break
    seen.add(id(inner))
    error = inner
  lines = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
  return text if len(text) <= limit else text[: limit - 3] + "..."


class _AbandonedReadsToDebug(std_logging.Filter):
  """Demotes asyncio's "Task exception was never retrieved" records (with their tracebacks) to
  one debug line."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.getMessage().startswith("Task exception was never retrieved"):
      logging.debug("while reading a checkpoint: %s", record.exc_info and record.exc_info[1])
      return False
    return True


class CheckpointFilesChanged(ValueError):
  """A checkpoint's files differ from the sizes recorded when it was saved."""


def _file_sizes(directory: str) -> dict[str, int]:
  """{path relative to `directory`: size in bytes} of every file under it (not the record)."""
  sizes = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      relative = os.path.relpath(path, directory)
      if relative != FILE_SIZES:
        sizes[relative] = os.path.getsize(path)
  return sizes


def _write_file_sizes(directory: str) -> None:
  """Writes `directory/file_sizes.json` (atomically: a temporary file renamed)."""
  record = {"format": 1, "sizes": _file_sizes(directory)}
  temporary = os.path.join(directory, FILE_SIZES + ".tmp")
  with open(temporary, "w") as f:
    json.dump(record, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, os.path.join(directory, FILE_SIZES))


def check_file_sizes(directory: str) -> bool:
  """Compares a checkpoint's files with the sizes recorded when it was saved.

  Args:
    directory: one checkpoint's directory (`<checkpoints>/<iteration>`).

  Returns:
    True if the record exists and every recorded file has its size; False if there is no
    record (nothing checked). Files added since are allowed (a later orbax version's metadata).

  Raises:
    CheckpointFilesChanged: a recorded file is missing or has another size (the message names
      the first few), or the record itself is unreadable.
  """
  path = os.path.join(directory, FILE_SIZES)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      recorded = json.load(f)["sizes"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointFilesChanged(f"its record {path} is unreadable: {_one_line(e)}") from None
  changed = []
  for relative, size in sorted(recorded.items()):
    file = os.path.join(directory, relative)
    if not os.path.isfile(file):
      changed.append(f"{relative} is missing")
    elif os.path.getsize(file) != size:
      changed.append(f"{relative} has {os.path.getsize(file)} bytes, {size} when saved")
  if changed:
    more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
    raise CheckpointFilesChanged(
      f"{len(changed)} of its {len(recorded)} files changed since the save: "
      + "; ".join(changed[:3])
      + more
    )
  return True


@contextlib.contextmanager
def _unraisable_to_log():
  """Logs (at debug level) instead of printing the tracebacks of orbax's other reads, abandoned
  when one read of an unreadable checkpoint fails: "Exception ignored in <coroutine>" (Python's
  unraisable hook) and "Task exception was never retrieved" (asyncio's logger)."""
  previous = sys.unraisablehook
  asyncio_logger = std_logging.getLogger("asyncio")
  asyncio_filter = _AbandonedReadsToDebug()

  def hook(unraisable):
    logging.debug("while reading a checkpoint: %s", unraisable.exc_value)

  sys.unraisablehook = hook
  asyncio_logger.addFilter(asyncio_filter)
  try:
    yield
  finally:
    gc.collect()  # the abandoned coroutines and tasks go now, while the hook is in place
    sys.unraisablehook = previous
    asyncio_logger.removeFilter(asyncio_filter)


def _saved_part(tree: PyTree) -> PyTree:
  """What a checkpoint holds of `tree`: a learner `TrainState` without its frozen base (the
  base is loaded again as it was first, `learner.without_base`); any other tree as it is."""
  return learner.without_base(tree) if isinstance(tree, learner.TrainState) else tree


class Checkpointer:
  """Keep-last-N checkpoints of (train state, PRNG key, progress) in one directory.

  Args:
    directory: the checkpoint directory (created), for checkpoints only (e.g.
      `workdir/checkpoints`); one subdirectory per saved iteration.
    keep: how many checkpoints to keep (the newest ones), >= 1.
    every: the save interval: `save` saves iterations divisible by it (or when forced), >= 1.
    config: the run's config (a JSON-able nested dict or a ConfigDict), stored in every
      checkpoint's manifest; when given, `restore_latest` checks it against the saved one
      (`check_config`) and refuses a changed config.
    allowed_to_differ: the config keys (dotted prefixes) that may change on resume.
    defaults: the config's defaults, for keys the checkpoint lacks (see `check_config`).
    moved: keys the config no longer has, and where their values live now (`check_config`).
    read_only: never change the directory: no `save`, leftover temporary directories are left
      alone (they may be a running trainer's save in progress) and unreadable checkpoints are
      not moved aside. For readers beside a trainer (an evaluation).
    on_saved: called by the primary process with the iteration of each save once it is
      complete on disk, its `file_sizes.json` written (`finish`): e.g. a remote mirror's push
      (`remote.Mirror`). What it raises propagates from `finish` (and so from `save` and
      `close`); the checkpoint stays as it is.
  """

  def __init__(
    self,
    directory: str,
    *,
    keep: int = 3,
    every: int = 10,
    config: Optional[Mapping[str, Any]] = None,
    allowed_to_differ: Sequence[str] = DEFAULT_ALLOWED_TO_DIFFER,
    defaults: Optional[Mapping[str, Any]] = None,
    moved: Optional[Mapping[str, str]] = None,
    read_only: bool = False,
    asynchronous: bool = False,
    on_saved: Optional[Callable[[int], None]] = None,
  ):
    if keep < 1 or every < 1:
      raise ValueError(f"Checkpointer needs keep >= 1 and every >= 1, got {keep=}, {every=}")
    self.directory = _directory(directory)
    self.every = every
    self.read_only = read_only
    self._config = None if config is None else jsonable(config, "config")
    self._defaults = None if defaults is None else jsonable(defaults, "defaults")
    self._allowed_to_differ = tuple(allowed_to_differ)
    self._moved = dict(moved or {})
    self.asynchronous = asynchronous
    self._on_saved = on_saved
    self._in_flight: Optional[int] = None  # the iteration an asynchronous save is writing
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        save_interval_steps=every,
        create=True,
        # Deletes the `<step>.orbax-checkpoint-tmp-*` directories of interrupted saves; only
        # the directory's owner may (a reader could delete a running save's directory).
        cleanup_tmp_directories=not read_only,
        # Asynchronous: the files are written in orbax's background thread (`save`, `finish`).
        enable_async_checkpointing=asynchronous,
      ),
    )
    if not read_only:
      # Orbax deletes them in a background thread and waits for it only at the first save, so
      # a restore-only run (or a test) could see them afterwards: wait here, so that they are
      # gone when the constructor returns. (Private in orbax 0.12; setup.py pins < 0.13.)
      self._manager._maybe_await_cleanup_tmp_directory()

  def latest_iteration(self) -> Optional[int]:
    """The newest complete checkpoint's iteration (readable or not), or None if there is none."""
    return self._manager.latest_step()

  def all_iterations(self) -> list[int]:
    """The iterations of the complete checkpoints, ascending."""
    return sorted(self._manager.all_steps())

  def should_save(self, iteration: int) -> bool:
    """True when `iteration` is on the save interval (iteration % every == 0)."""
    return iteration % self.every == 0

  def save(
    self,
    iteration: int,
    train_state: PyTree,
    rng: jax.Array,
    progress: Mapping[str, Any],
    *,
    force: bool = False,
  ) -> bool:
    """Saves a checkpoint if `iteration` is on the interval (or `force`): synchronously, it
    returns when the checkpoint is complete on disk; asynchronously, once its arrays are on the
    host, the files written in the background (`finish` waits for them). Drops the oldest
    checkpoints beyond `keep`. A save first waits for the one in flight.

    Call it before the next update donates `train_state`'s buffers.

    Args:
      iteration: the checkpoint's iteration (int >= 0); newer than every saved one.
      train_state: any pytree of jax arrays, e.g. a learner `TrainState` (sharded or not); a
        `TrainState` is saved without its frozen base (`learner.without_base`).
      rng: the loop's PRNG key: a typed key (`jax.random.key`, any shape) or a raw uint32 key.
      progress: a JSON-able dict of the loop's position (next task index, sampler epoch, ...).
      force: save even if `iteration` is off the interval (e.g. the last iteration).

    Returns:
      True if a checkpoint was written; False if the iteration is off the interval (and not
      forced) or already saved (e.g. a forced final save right after an interval save).

    Raises:
      ValueError: `iteration` is older than the newest checkpoint, `progress` is not JSON, or
        the Checkpointer is read-only.
    """
    if self.read_only:
      raise ValueError(f"cannot save iteration {iteration}: {self.directory} is open read-only")
    train_state = _saved_part(train_state)
    if not (force or self.should_save(iteration)):
      return False
    self.finish()
    latest = self.latest_iteration()
    if latest is not None and iteration <= latest:
      if iteration == latest:
        return False
      raise ValueError(
        f"cannot save iteration {iteration}: {self.directory} already holds the newer "
        f"iteration {latest}"
      )
    manifest = {
      "format": MANIFEST_FORMAT,
      _STATE: tree_manifest(train_state),
      _RNG: rng_manifest(rng),
      "config": self._config,
    }
    args = ocp.args.Composite(
      **{
        _STATE: ocp.args.StandardSave(train_state),
        _RNG: ocp.args.StandardSave({_KEY_DATA: _key_data(rng)}),
        _PROGRESS: ocp.args.JsonSave(jsonable(dict(progress), "progress")),
        _MANIFEST: ocp.args.JsonSave(manifest),
      }
    )
    saved = self._manager.save(iteration, args=args, force=True)
    if saved:
      self._in_flight = iteration
    if not self.asynchronous:
      self.finish()
    return bool(saved)

  def finish(self) -> Optional[int]:
    """Waits for the save in flight (if any) to be complete on disk and records its files'
    sizes, then calls `on_saved`; returns its iteration (None if none was in flight)."""
    self._manager.wait_until_finished()
    iteration, self._in_flight = self._in_flight, None
    if iteration is not None and jax.process_index() == 0:
      _write_file_sizes(self._where(iteration))
      if self._on_saved is not None:
        self._on_saved(iteration)
    return iteration

  def _manifest(self, iteration: int) -> dict[str, Any]:
    """The checkpoint's manifest; raises (any exception: orbax's vary) if it cannot be read."""
    restored = self._manager.restore(
      iteration, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
    )
    manifest = restored[_MANIFEST]
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
      raise ValueError(
        f"checkpoint {self._where(iteration)} has no manifest of format {MANIFEST_FORMAT}: "
        "it was not written by seeupo_jax.training.checkpoints.Checkpointer"
      )
    return manifest

  def _where(self, iteration: int) -> str:
    return os.path.join(self.directory, str(iteration))

  def saved_config(self, iteration: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The config stored with checkpoint `iteration` (default: the newest), or None if there
    is no checkpoint or it was saved without a config."""
    iteration = self.latest_iteration() if iteration is None else iteration
    return None if iteration is None else self._manifest(iteration)["config"]

  def _check(self, manifest: dict[str, Any], abstract_train_state, abstract_rng, where) -> None:
    """Raises ValueError unless the checkpoint fits the targets and the config."""
    if self._config is not None:
      if manifest.get("config") is None:
        logging.warning("checkpoint %s holds no config; the config is not checked", where)
      else:
        check_config(
          manifest["config"], self._config, self._allowed_to_differ, self._defaults, self._moved
        )
    check_manifest(manifest[_STATE], abstract_train_state, where)
    if manifest[_RNG] != rng_manifest(abstract_rng):
      saved, wanted = manifest[_RNG], rng_manifest(abstract_rng)
      raise ValueError(
        f"checkpoint {where} holds a PRNG key {describe(saved['dtype'], saved['shape'])}, but "
        f"the target is {describe(wanted['dtype'], wanted['shape'])} (a typed key restores into "
        "a typed key of the same implementation, a raw key into a raw key)"
      )

  def _restore(self, iteration: int, abstract_train_state, abstract_rng):
    iteration, state, rng, progress = self._restore_saved(
      iteration, _saved_part(abstract_train_state), abstract_rng
    )
    if isinstance(abstract_train_state, learner.TrainState):  # the target's own frozen base
      state = learner.with_base(state, abstract_train_state.base)
    return iteration, state, rng, progress

  def _restore_saved(self, iteration: int, abstract_train_state, abstract_rng):
    args = ocp.args.Composite(
      **{
        _STATE: ocp.args.StandardRestore(abstract_of(abstract_train_state)),
        _RNG: ocp.args.StandardRestore({_KEY_DATA: _abstract_key_data(abstract_rng)}),
        _PROGRESS: ocp.args.JsonRestore(),
      }
    )
    restored = self._manager.restore(iteration, args=args)
    rng = restored[_RNG][_KEY_DATA]
    if is_typed_key(abstract_rng):
      rng = jax.random.wrap_key_data(rng, dtype=abstract_rng.dtype)
    progress = restored[_PROGRESS]
    if not isinstance(progress, dict):
      raise ValueError(f"the progress item is {type(progress).__name__}, not a JSON object")
    return iteration, restored[_STATE], rng, dict(progress)

  def _set_aside(self, iteration: int) -> str:
    """Renames checkpoint `iteration` to `<iteration>.unreadable` (or `...unreadable-<n>`)."""
    source = epath.Path(self._where(iteration))
    target, n = epath.Path(str(source) + UNREADABLE_SUFFIX), 1
    while target.exists():
      n += 1
      target = epath.Path(f"{source}{UNREADABLE_SUFFIX}-{n}")
    source.rename(target)
    return str(target)

  def restore_latest(
    self, abstract_train_state: PyTree, abstract_rng: Any
  ) -> Optional[tuple[int, PyTree, jax.Array, dict[str, Any]]]:
    """Restores the newest readable checkpoint onto the shardings of the targets.

    Checkpoints are tried newest first. One that cannot be read (a missing or truncated file:
    orbax raises anything from KeyError to a bare Exception) is skipped with a warning naming
    it and the error; unless `read_only`, the skipped ones are moved aside to
    `<iteration>.unreadable` once an older checkpoint has restored, so that the run, resuming
    from that one, can save their iterations again. A checkpoint that reads but does not fit
    (another model or config) is an error, never skipped.

    Args:
      abstract_train_state: the tree to restore into: `jax.ShapeDtypeStruct`s with shardings
        (e.g. `abstract_of(fresh_state)` or `jax.eval_shape` plus shardings), or arrays. Each
        array comes back on its target's sharding, which may differ from the saved one (another
        mesh); a leaf without a sharding comes back on the default device. A learner
        `TrainState` restores its saved part (`learner.without_base`) and comes back with the
        target's `base` as it is (None, or the frozen base's arrays).
      abstract_rng: the PRNG key's target: a typed key's (dtype `key<impl>`) or a raw uint32
        key's ShapeDtypeStruct (or the key itself), with its sharding.

    Returns:
      None if there is no checkpoint; else (iteration, train_state, rng, progress), with
      `train_state` of `abstract_train_state`'s tree type and `rng` of `abstract_rng`'s kind.

    Raises:
      ValueError: the checkpoint's tree structure, a shape or dtype, or the PRNG key's kind
        differs from the target (naming the first differing leaf), or the saved config differs
        from this Checkpointer's `config` in keys not allowed to differ.
      CheckpointsUnreadable: there are checkpoints but none can be read (nothing is moved).
    """
    iterations = self.all_iterations()
    unreadable: list[tuple[int, str]] = []
    for iteration in reversed(iterations):
      where = self._where(iteration)
      message = None
      with _unraisable_to_log():
        # Only the error's one line leaves this block: the exception's traceback holds the
        # frames of orbax's abandoned reads, which must be collected while the hook is in place.
        try:
          check_file_sizes(where)
          manifest = self._manifest(iteration)
        except Exception as e:  # pylint: disable=broad-exception-caught
          message = _one_line(e)
        else:
          self._check(
            manifest, _saved_part(abstract_train_state), abstract_rng, where
          )  # refuses, not skips
          try:
            restored = self._restore(iteration, abstract_train_state, abstract_rng)
          except Exception as e:  # pylint: disable=broad-exception-caught
            message = _one_line(e)
      if message is None:
        self._set_aside_all(unreadable, iteration)
        return restored
      unreadable.append((iteration, message))
      logging.warning("checkpoint %s is unreadable, skipped: %s", where, unreadable[-1][1])
    if unreadable:
      raise CheckpointsUnreadable(
        f"none of the {len(unreadable)} checkpoint(s) in {self.directory} can be read: "
        + "; ".join(f"{i}: {message}" for i, message in unreadable)
      )
    return None

  def _set_aside_all(self, unreadable: list[tuple[int, str]], restored: int) -> None:
    if not unreadable or self.read_only:
      return
    for iteration, _ in unreadable:
      target = self._set_aside(iteration)
      logging.warning(
        "moved the unreadable checkpoint %s to %s (restored iteration %d instead)",
        self._where(iteration),
        target,
        restored,
      )
    self._manager.reload()

  def close(self) -> None:
    """Waits for pending work and releases the manager."""
    try:
      self.finish()
    finally:
      self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
