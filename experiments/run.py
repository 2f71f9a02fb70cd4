r"""Runs one experiment: a config from the registry, overrides, a workdir.

  python experiments/run.py                      # trains SeeUPO on the synthetic task
  python experiments/run.py --config=synthetic --workdir=runs/gspo \
      --config.learner.algorithm=gspo
  python experiments/run.py --config=bandit --workdir=/tmp/bandit \
      --config.num_seeds=100 --config.algorithms=seeupo,grpo

`--config=NAME` picks a config from `experiments/configs` (default
`synthetic`; an unknown name is an error that lists the allowed ones);
`--config.a.b=value` overrides a key (an unknown key is an error naming it);
`--workdir` defaults to `runs/NAME`. Rerunning a command with the same
workdir resumes from its last checkpoint. The config's `program` selects
what runs, from the fixed table `PROGRAMS`. This file only dispatches.

A remote workdir (`--workdir=gs://BUCKET/run`, `s3://...`; the training
program only): the run writes `--local_dir` (default: a directory under the
system's temp dir named after the remote path) and copies it to the remote
after each checkpoint and at the end; a fresh machine pulls the remote's
checkpoints first (docs/training.md, "Remote storage").

Many processes (a TPU pod slice, SLURM nodes, or several processes on one machine): the same
command in every process. `--distributed=auto` (the default) starts JAX's multi-process
runtime when `--num_processes` > 1 is given (with `--coordinator_address` and
`--process_id`) or when SLURM's srun, a TPU pod slice or Open MPI announces several processes;
`--distributed=yes` always starts it (JAX then finds the cluster, e.g. on Cloud TPU VMs),
`no` never. Recipes: docs/training.md, "Many processes".

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
      python experiments/run.py --workdir=/tmp/two --num_processes=2 --process_id=I \
        --coordinator_address=127.0.0.1:12355          # for I in 0 1, at once

Expected failures end the run with one line on stderr, `error: ...`, and a
non-zero status, never a traceback: a bad config, an environment that cannot
run here, a workdir that cannot be used (a file, locked by a live run, only
unreadable checkpoints; a remote one unreachable or locked) (status 2); a copy
to a remote workdir that fails mid-run (status 1; the local directory keeps
every file); environments failing mid-run, a server pool gone, an oracle that
fails (status 1; their traceback goes to `<workdir>/error.log`, which the line
names). An unexpected exception (a bug)
shows its traceback.
"""

import functools
import os
import re
import sys
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import ml_collections  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments import configs  # noqa: E402

DEFAULT_CONFIG = "synthetic"
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Output directory (default runs/<config name>), or gs://..., s3://..."
)
_LOCAL_DIR = flags.DEFINE_string(
  "local_dir",
  None,
  "With a remote --workdir: the local directory the run writes and copies from (default: "
  "<temp dir>/seeupo_jax/<name>-<hash of the remote path>).",
)
_TAKE_REMOTE_LOCK = flags.DEFINE_bool(
  "take_remote_lock",
  False,
  "With a remote --workdir: take its lock object even if another run's is there (that run is "
  "gone).",
)
_DISTRIBUTED = flags.DEFINE_enum(
  "distributed",
  "auto",
  ["auto", "yes", "no"],
  "Start JAX's multi-process runtime: auto (explicit flags below, or SLURM/TPU pod/Open MPI "
  "announcing several processes), yes (always; JAX detects the cluster), no (one process).",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0 (with --num_processes, --process_id)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. n - 1.")


def _run_bandit(config: ml_collections.ConfigDict, workdir: str, defaults) -> None:
  from seeupo_jax.theory import sweep  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import remote  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import workdir as workdir_lib  # pylint: disable=g-import-not-at-top

  del defaults
  try:  # every name and size, before the workdir is made or anything compiles
    sweep.validate(config)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  if remote.is_remote(workdir):
    raise workdir_lib.WorkdirError(
      f"--workdir={workdir}: the bandit program writes a local directory only; pass a local "
      "--workdir and copy it"
    )
  workdir_lib.prepare(workdir)
  sweep.main(config, workdir)


def _run_train(config, workdir: str, defaults) -> None:
  """Trains; `config` is the typed `TrainConfig` (`seeupo_jax.training.config.typed`)."""
  from seeupo_jax.training import trainer  # pylint: disable=g-import-not-at-top

  trainer.main(
    config,
    workdir,
    defaults,
    local_dir=_LOCAL_DIR.value,
    take_remote_lock=_TAKE_REMOTE_LOCK.value,
  )


PROGRAMS = {
  "bandit": _run_bandit,
  "train": _run_train,
}


class UsageError(ValueError):
  """A bad command line: printed without a traceback, exit status 2."""


def split_config_name(argv: list[str]) -> tuple[str, list[str]]:
  """Removes `--config=NAME` (or `--config NAME`) from argv; returns NAME."""
  rest, name = [argv[0]], None
  args = iter(argv[1:])
  for arg in args:
    if arg.startswith("--config="):
      name = arg.split("=", 1)[1]
    elif arg == "--config":
      name = next(args, None)
    else:
      rest.append(arg)
  return name or DEFAULT_CONFIG, rest


def check_overrides(config: ml_collections.ConfigDict, name: str, argv: list[str]) -> None:
  """Every `--config.a.b=...` must name an existing key of the config."""
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config.") :].split("=", 1)[0]
    node, where = config, ""
    for part in path.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        known = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        raise UsageError(
          f"unknown config key {path!r} for --config={name}; known keys"
          f"{' of ' + repr(where) if where else ''}: {known}"
        )
      node, where = node[part], (f"{where}.{part}" if where else part)


def _type_words(kind: type, path: str) -> str:
  """What a value of config type `kind` looks like on the command line."""
  words = {
    bool: "True or False",
    int: "an int",
    float: "a number",
    str: "a string",
    tuple: f"a tuple (comma-separated: --config.{path}=a,b)",
    ml_collections.ConfigDict: "a dict (\"{'key': value}\")",
  }
  return words.get(kind, f"a {kind.__name__}")


def flag_error(
  error: flags.Error, config: ml_collections.ConfigDict, name: str, argv: list[str]
) -> str:
  """The one-line message (after `error: `) for a command line that absl refuses to parse.

  A value that does not parse as its key's type (`--config.rollout.max_turns=three`) is named
  with its key, the value as given and the type the key takes; any other flag error is absl's
  own message on one line.
  """
  text = one_line(error)
  match = re.match(r"flag --config\.([\w.]+)=", text)
  if not match:
    return text
  path = match.group(1)
  parent, _, key = path.rpartition(".")
  node = config
  for part in parent.split(".") if parent else ():
    node = node[part]
  kind = node.get_type(key)
  given = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"--config.{path}=")]
  value = given[-1] if given else text[match.end() :].split(":", 1)[0]
  return f"bad config for --config={name}: {path}={value!r}; expected {_type_words(kind, path)}"


def _parse_flags(argv: list[str], config: ml_collections.ConfigDict, name: str) -> list[str]:
  """absl's flag parsing, with a refused command line as one `error:` line, exit status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {flag_error(e, config, name, argv)}", file=sys.stderr)
    sys.exit(2)


def _main(argv: list[str], name: str) -> None:
  if len(argv) > 1:
    print(
      f"error: unexpected arguments {argv[1:]}: options are --name=value (--help lists them)",
      file=sys.stderr,
    )
    sys.exit(2)
  workdir = _WORKDIR.value or os.path.join("runs", name)
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  config = flags.FLAGS.config
  if config.program not in PROGRAMS:
    print(
      f"error: bad config for --config={name}: program={config.program!r}; allowed: "
      f"{sorted(PROGRAMS)}",
      file=sys.stderr,
    )
    sys.exit(2)
  if config.program == "train":  # the program boundary: one typed, checked config from here on
    from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

    try:
      config = config_lib.typed(config)
    except config_lib.ConfigError as e:
      print(f"error: bad config for --config={name}: {e}", file=sys.stderr)
      sys.exit(2)
  from seeupo_jax import distributed  # pylint: disable=g-import-not-at-top

  try:
    distributed.initialize(
      _DISTRIBUTED.value,
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value,
    )
  except distributed.DistributedError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  from seeupo_jax import envs  # pylint: disable=g-import-not-at-top
  from seeupo_jax import rollout  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import oracle  # pylint: disable=g-import-not-at-top
  from seeupo_jax.training import trainer  # pylint: disable=g-import-not-at-top

  try:
    # The config file's defaults: a resumed checkpoint may lack keys added since.
    PROGRAMS[config.program](config, workdir, configs.get_config(name))
  except trainer.remote.RemoteWriteFailed as e:  # mid-run: the local directory keeps everything
    print(f"error: --config={name}: {one_line(e)}", file=sys.stderr)
    sys.exit(1)
  except (envs.EnvironmentUnavailable, trainer.WorkdirError) as e:
    print(f"error: --config={name}: {one_line(e)}", file=sys.stderr)
    sys.exit(2)
  except trainer.ConfigError as e:
    print(f"error: bad config for --config={name}: {e}", file=sys.stderr)
    sys.exit(2)
  except trainer.Preempted as e:  # SIGTERM/SIGINT: saved; the same command resumes
    print(f"stopped: --config={name}: {e}", file=sys.stderr)
    sys.exit(trainer.preemption.EXIT_STATUS)
  except (rollout.EnvironmentFailure, rollout.EnvCallFailed, oracle.OracleFailure) as e:
    log = write_error_log(local_workdir(workdir))
    print(f"error: --config={name}: {one_line(e)} (traceback in {log})", file=sys.stderr)
    sys.exit(1)


def local_workdir(workdir: str) -> str:
  """The directory the run writes: `workdir`, or a remote workdir's local directory."""
  from seeupo_jax.training import remote  # pylint: disable=g-import-not-at-top

  return remote.local_dir_for(workdir, _LOCAL_DIR.value) if remote.is_remote(workdir) else workdir


def one_line(error: BaseException) -> str:
  """The error's message on one line."""
  return " ".join(str(error).split()) or type(error).__name__


def write_error_log(workdir: str) -> str:
  """Appends the exception being handled, with its traceback, to <workdir>/error.log
  (error.<p>.log in process p > 0 of a multi-process run)."""
  import jax  # pylint: disable=g-import-not-at-top

  index = jax.process_index()
  path = os.path.join(workdir, "error.log" if index == 0 else f"error.{index}.log")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
      f.write(traceback.format_exc() + "\n")
  except OSError as e:  # an unwritable workdir: say where the traceback is not
    return f"nowhere: {path} is not writable ({e.strerror})"
  return path


def run(argv: list[str]) -> None:
  """Parses the config name and overrides, then runs the program."""
  try:
    name, argv = split_config_name(argv)
    config = configs.get_config(name)
    check_overrides(config, name, argv)
  except (UsageError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  config_flags.DEFINE_config_dict("config", config, lock_config=True, sys_argv=argv)
  app.run(
    functools.partial(_main, name=name),
    argv=argv,
    flags_parser=functools.partial(_parse_flags, config=config, name=name),
  )


if __name__ == "__main__":
  run(sys.argv)
