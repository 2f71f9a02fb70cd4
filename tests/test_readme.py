"""README.md's code runs as written, so the page a user reads first cannot rot.

- Every ```python block runs in a fresh interpreter from the repository root and exits 0.
- Every `python experiments/run.py ...` line of its ```bash blocks names a config that exists and
  flags the program accepts: the config name, each `--config.a.b=value` override and the other
  flags go through `experiments/run.py`'s own parsing (its `split_config_name` and
  `check_overrides`, `ml_collections.config_flags` with its flags), then the program's own checks
  (`seeupo_jax.training.config.typed` and the environment's options for training,
  `sweep.validate` for the bandits). Nothing trains, so commands that need a checkpoint or
  servers a user supplies are checked this far only.
  `--config=nope`, the line that lists the configs, is run and must exit 2 naming them.
- The test command under "Run the tests" is the one `.ci/run` runs, line for line.
- Every relative link (README, docs/results.md, docs/install.md) points to a file and a heading
  that exist, and every script a README command runs exists.
"""

import copy
import os
import re
import shlex
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from experiments import configs  # noqa: E402
from experiments import run  # noqa: E402

with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as _f:
  README = _f.read()

BAD_CONFIG_NAME = "nope"  # README's example of a refused config name


def fenced_blocks(text: str, language: str) -> list[str]:
  """The bodies of the ```<language> blocks of a Markdown text, in order."""
  pattern = re.compile(r"^```" + re.escape(language) + r"[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
  return pattern.findall(text)


def shell_lines(block: str) -> list[str]:
  """A shell block's commands, with backslash-continued lines joined."""
  lines, current = [], ""
  for raw in block.splitlines():
    stripped = raw.rstrip()
    if stripped.endswith("\\"):
      current += stripped[:-1] + " "
      continue
    current += stripped
    if current.strip():
      lines.append(current.strip())
    current = ""
  return lines


def run_py_commands(text: str) -> list[list[str]]:
  """argv (`run.py` first) of every `python experiments/run.py ...` line in the bash blocks."""
  commands = []
  for block in fenced_blocks(text, "bash"):
    for line in shell_lines(block):
      words = shlex.split(line, comments=True)
      if "experiments/run.py" in words:
        args = words[words.index("experiments/run.py") + 1 :]
        commands.append(["run.py"] + [a for a in args if a != "&"])
  return commands


def check_command(argv: list[str]) -> None:
  """Parses a run.py command line as run.py does and runs the program's config checks.

  Raises what run.py would report: `run.UsageError` or ValueError (a config name, an unknown key),
  `flags.Error` (an unknown flag, a value of the wrong type), `ConfigError` or ValueError (a value
  the program refuses).
  """
  name, rest = run.split_config_name(argv)
  config = configs.get_config(name)
  run.check_overrides(config, name, rest)
  # A FlagValues of its own: run.py's flags (copies) and the config flag with these overrides.
  flag_values = flags.FlagValues()
  for flag in flags.FLAGS.get_flags_for_module(run.__name__):
    flag_values[flag.name] = copy.deepcopy(flag)
  config_flags.DEFINE_config_dict(
    "config", config, flag_values=flag_values, lock_config=True, sys_argv=rest
  )
  left = flag_values(rest)
  if left != ["run.py"]:
    raise run.UsageError(f"unexpected arguments: {left[1:]}")
  parsed = flag_values.config
  if parsed.program == "train":
    from seeupo_jax import envs  # pylint: disable=g-import-not-at-top
    from seeupo_jax.envs import appworld  # pylint: disable=g-import-not-at-top
    from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

    train_config = config_lib.typed(parsed)
    options = train_config.env_options()
    if train_config.env.name == "appworld":  # its spec probes the servers: the options only
      appworld.AppWorldConfig(**options)
    else:  # the environment's options, as the trainer builds them (BFCL reads its data)
      envs.make_spec(train_config.env.name, options)
  elif parsed.program == "bandit":
    from seeupo_jax.theory import sweep  # pylint: disable=g-import-not-at-top

    sweep.validate(parsed)
  else:
    raise run.UsageError(f"config.program={parsed.program!r}; allowed: {sorted(run.PROGRAMS)}")


def run_python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout
  )


PYTHON_BLOCKS = fenced_blocks(README, "python")
RUN_COMMANDS = run_py_commands(README)
GOOD_COMMANDS = [c for c in RUN_COMMANDS if f"--config={BAD_CONFIG_NAME}" not in c]


def test_readme_has_the_examples_this_file_checks():
  assert len(PYTHON_BLOCKS) >= 2, "README lost its Python examples (losses, learner)"
  assert len(GOOD_COMMANDS) >= 5, GOOD_COMMANDS
  assert [c for c in RUN_COMMANDS if c not in GOOD_COMMANDS], "README lost `--config=nope`"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index):
  proc = run_python(PYTHON_BLOCKS[index])
  assert proc.returncode == 0, f"README's Python block {index} failed:\n{proc.stderr[-3000:]}"


def test_a_broken_block_fails():
  """The runner above reports a failing block (here a name used before it is defined)."""
  proc = run_python("import jax.numpy as jnp\nx = jnp.ones(3) * correction\ncorrection = 1.0\n")
  assert proc.returncode != 0 and "NameError" in proc.stderr


@pytest.mark.parametrize("argv", GOOD_COMMANDS, ids=lambda argv: " ".join(argv[1:]) or "default")
def test_run_command_flags_are_accepted(argv):
  check_command(argv)


@pytest.mark.parametrize(
  "args",
  [
    ["--config=synthetic_x"],  # no such config
    ["--config.rollout.max_turn=3"],  # no such key (run.py's own check)
    ["--config.rollout.max_turns=0"],  # a value the training config refuses
    ["--config.learner.algorithm=ppo2"],
    ["--config.env.num_dials=0"],  # an option the environment refuses
    ["--config.seed=zero"],  # not an int (config_flags)
    ["--workdirr=/tmp/x"],  # no such flag
    ["--config=bandit", "--config.algorithms=seeupo,grpo2"],  # the bandit program's check
    ["--config=bandit", "stray"],
  ],
)
def test_bad_commands_are_refused(args):
  """The check above can fail: each of these is a command run.py refuses."""
  from seeupo_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top

  with pytest.raises((run.UsageError, ValueError, flags.Error, config_lib.ConfigError)):
    check_command(["run.py"] + args)


def test_unknown_config_exits_2_and_lists_the_configs():
  (argv,) = [c for c in RUN_COMMANDS if c not in GOOD_COMMANDS]
  proc = subprocess.run(
    [sys.executable, "experiments/run.py"] + argv[1:],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
  for name in configs.CONFIGS:
    assert repr(name) in proc.stderr, (name, proc.stderr)


def test_the_test_command_is_the_one_ci_runs():
  with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
    ci_lines = f.read().splitlines()
  (marker,) = [i for i, line in enumerate(ci_lines) if line.startswith("# --- README:")]
  section = re.search(r'README: "([^"]+)"', ci_lines[marker]).group(1)
  ci_commands = [line for line in ci_lines[marker + 1 :] if line.strip()]
  assert len(ci_commands) == 3, ci_commands
  # README's section of that name, and its first bash block.
  heading = re.search(r"^#+ " + re.escape(section) + r"\s*$", README, re.M)
  assert heading, f"README has no section {section!r}, which .ci/run names"
  first_block = fenced_blocks(README[heading.end() :], "bash")[0]
  assert first_block.splitlines() == ci_commands


def heading_anchors(path: str) -> set[str]:
  """GitHub's anchors of a Markdown file's headings (code blocks left out)."""
  with open(path, encoding="utf-8") as f:
    text = re.sub(r"^```.*?^```[ \t]*$", "", f.read(), flags=re.M | re.S)
  headings = re.findall(r"^#{1,6} +(.+?) *$", text, re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", ["README.md", "docs/results.md", "docs/install.md"])
def test_links_exist(page):
  """Every relative link of the page points to a file that exists, and to a heading of it."""
  path = os.path.join(ROOT, page)
  with open(path, encoding="utf-8") as f:
    links = re.findall(r"\]\(([^)\s]+)\)", f.read())
  relative = [link for link in links if not re.match(r"[a-z]+:", link)]
  assert relative, "no relative links found"
  broken = []
  for link in relative:
    target, _, anchor = link.partition("#")
    target = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
    if not os.path.exists(target):
      broken.append(link)
    elif anchor and anchor not in heading_anchors(target):
      broken.append(link)
  assert not broken, broken


def test_scripts_in_readme_commands_exist():
  scripts = [
    word
    for block in fenced_blocks(README, "bash")
    for line in shell_lines(block)
    for word in shlex.split(line, comments=True)
    if re.fullmatch(r"[\w./-]+\.(py|sh)", word)
  ]
  assert "experiments/run.py" in scripts
  missing = [p for p in scripts if not os.path.exists(os.path.join(ROOT, p))]
  assert not missing, missing
