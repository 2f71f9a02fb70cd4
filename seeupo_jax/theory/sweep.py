"""The bandit comparison: every (algorithm, family, learning rate), many seeds.

`run_sweep(config)` returns the normalised learning curves; `main(config,
workdir)` prints the table and writes the plots (it is what
`python experiments/run.py --config=bandit --workdir=DIR` calls).

Common random numbers: seed s draws the same instance and the same sampling
keys for every algorithm and learning rate, so differences between
algorithms are not differences in luck.
"""

import dataclasses
import functools
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from seeupo_jax import fields
from seeupo_jax.learner.config import TIS_LEVELS
from seeupo_jax.theory import algorithms
from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import instances
from seeupo_jax.theory import policies
from seeupo_jax.theory import report


@dataclasses.dataclass(frozen=True, kw_only=True)
class BanditConfig:
  """The bandit comparison's keys (`--config=bandit`), each declared once with its default and
  what it allows (`seeupo_jax.fields`); `default_config()` is generated from it and `validate`
  checks a config against it.

  `seed`, `num_seeds` (runs per setting); problem size `num_contexts` X, `num_actions` K,
  `num_turns` T (2..10, with X K^T <= `MAX_TRAJECTORIES`); `policy` ("tabular", "shared" or
  "blind"); `families` and `algorithms` (comma-separated names); the family options `density`
  (`sparse`) and `scale_orders` (`scaled`); `num_iterations` I and `group_size` n (the sample
  budget, I * X * n rollouts, is the same for every algorithm); `epochs_per_turn`,
  `minibatches_per_turn`; `clip_eps` (policy clip), `correction_clip` (SeeUPO's M clip);
  `gamma`, `gae_lambda`, `critic_lr` (PPO's critic); `learning_rates` (the SGD grid,
  comma-separated; each table row uses the best); `lag` k (iteration i samples with the params
  of iteration max(0, i - 1 - k); 0: on-policy), `tis` and `tis_cap` (the truncated importance
  weight min(pi_prox / pi_behav, tis_cap) on the policy loss, `LearnerConfig.tis`; "off": none).
  """

  program: str = fields.field(fields.one_of(("bandit",)), "bandit")
  seed: int = fields.field(fields.int_at_least(0), 0)
  num_seeds: int = fields.field(fields.int_at_least(2), 100)
  num_contexts: int = fields.field(fields.int_at_least(1), 3)
  num_actions: int = fields.field(fields.int_at_least(2), 2)
  num_turns: int = fields.field(fields.int_in(2, 10), 4)
  policy: str = fields.field(fields.one_of(tuple(policies.POLICIES)), "tabular")
  families: str = fields.field(fields.STRING, "random,trap,decoy")
  algorithms: str = fields.field(
    fields.STRING,
    "seeupo,seeupo_forward,seeupo_random,seeupo_nocorr,seeupo_groupstd,grpo,gspo,reinforce,rloo,ppo",
  )
  density: float = fields.field(fields.number_in(0, 1, open_low=True), 0.05)
  scale_orders: float = fields.field(fields.number_at_least(0), 2.0)
  num_iterations: int = fields.field(fields.int_at_least(1), 200)
  group_size: int = fields.field(fields.int_at_least(1), 16)
  epochs_per_turn: int = fields.field(fields.int_at_least(1), 2)
  minibatches_per_turn: int = fields.field(fields.int_at_least(1), 2)
  clip_eps: float = fields.field(fields.number_above(0), 0.2)
  correction_clip: float = fields.field(fields.number_above(0), 0.2)
  gamma: float = fields.field(fields.number_in(0, 1), 1.0)
  gae_lambda: float = fields.field(fields.number_in(0, 1), 1.0)
  critic_lr: float = fields.field(fields.number_above(0), 1.0)
  learning_rates: str = fields.field(fields.STRING, "0.3,1,3,10")
  lag: int = fields.field(fields.int_at_least(0), 0)
  tis: str = fields.field(fields.one_of(TIS_LEVELS), "off")
  tis_cap: float = fields.field(fields.number_at_least(1), 2.0)


def default_config() -> ml_collections.ConfigDict:
  """Defaults of the bandit comparison (`--config=bandit`): every `BanditConfig` field."""
  return ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(BanditConfig)})


class SettingResult(NamedTuple):
  """Result of one (algorithm, family) over the learning-rate grid.

  Attributes:
    learning_rates: [L] float, the grid.
    curves: [L, runs, I + 1] float32, J / J*_class per run (`policies.class_optimum`:
      J* for the tabular and shared classes, the open-loop optimum for the blind one).
    best: index into the grid with the highest mean final J / J*_class.
  """

  learning_rates: np.ndarray
  curves: np.ndarray
  best: int

  @property
  def best_curves(self) -> np.ndarray:
    return self.curves[self.best]


MAX_TRAJECTORIES = 3 * 4**6
"""The largest X K^T the exact enumeration runs (3 contexts x 2 actions x 10 turns fits)."""


def _names(config_value: str, key: str) -> list[str]:
  names = [n.strip() for n in str(config_value).split(",") if n.strip()]
  if not names:
    raise ValueError(f"config key `{key}` is empty")
  return names


def learning_rates(config: ml_collections.ConfigDict) -> np.ndarray:
  """Parses `config.learning_rates` ("0.3,1,3") into a positive array."""
  try:
    lrs = np.array([float(v) for v in _names(config.learning_rates, "learning_rates")], np.float32)
  except ValueError as e:
    raise ValueError(
      f"config key `learning_rates` must be comma-separated numbers, got {config.learning_rates!r}"
    ) from e
  if np.any(lrs <= 0):
    raise ValueError(f"config key `learning_rates` must be > 0, got {lrs}")
  return lrs


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks every key, name and size of the config before anything is compiled.

  Raises:
    ValueError: naming the key and what it allows (a `fields.FieldError` for the keys'
      own values: "num_turns=11; allowed: an int in [2, 10]").
  """
  names = [f.name for f in dataclasses.fields(BanditConfig)]
  unknown = sorted(set(config.keys()) - set(names))
  if unknown:
    raise ValueError(f"unknown config key {unknown[0]!r}; known: {names}")
  missing = [n for n in names if n not in config]
  if missing:
    raise ValueError(f"config key {missing[0]!r} is missing")
  fields.check(BanditConfig(**{n: config[n] for n in names}), prefix="")
  for name in _names(config.algorithms, "algorithms"):
    algorithms.get_algorithm(name)
  for name in _names(config.families, "families"):
    instances.make_family(name, config)
  trajectories = int(config.num_contexts) * int(config.num_actions) ** int(config.num_turns)
  if trajectories > MAX_TRAJECTORIES:
    raise ValueError(
      f"num_contexts * num_actions ** num_turns = {trajectories} trajectories (config keys "
      f"`num_contexts`, `num_actions`, `num_turns`); allowed: <= {MAX_TRAJECTORIES}"
    )
  learning_rates(config)


def _seed_keys(config) -> tuple[jax.Array, jax.Array]:
  """[runs] instance keys and [runs] training keys, from `config.seed`."""
  base = jax.random.PRNGKey(int(config.seed))
  keys = jax.vmap(lambda s: jax.random.split(jax.random.fold_in(base, s)))(
    jnp.arange(int(config.num_seeds))
  )
  return keys[:, 0], keys[:, 1]


def make_instances(config, family: str) -> bandit_lib.Bandit:
  """A batch of `num_seeds` instances of one family (leading axis = run)."""
  instance_keys, _ = _seed_keys(config)
  make = instances.make_family(family, config)
  shape = (int(config.num_contexts), int(config.num_actions), int(config.num_turns))
  return jax.jit(jax.vmap(lambda k: make(k, *shape)))(instance_keys)


_RUN_KEYS = (
  "seed",
  "num_seeds",
  "families",
  "algorithms",
  "learning_rates",
  "density",
  "scale_orders",
)


def make_setting_fn(config, algorithm: str):
  """Jitted (bandits[runs], train_keys[runs], lrs[L]) -> [L, runs, I+1] J/J*_class.

  Cached on the keys that shape the computation, so a second sweep with
  another seed or grid does not compile again.
  """
  static = {k: v for k, v in config.items() if k not in _RUN_KEYS}
  return _cached_setting_fn(json.dumps(static, sort_keys=True), algorithm)


@functools.lru_cache(maxsize=64)
def _cached_setting_fn(static_json: str, algorithm: str):
  config = ml_collections.ConfigDict(json.loads(static_json))
  enum = bandit_lib.enumerate_bandit(
    int(config.num_contexts), int(config.num_actions), int(config.num_turns)
  )
  policy = policies.get_policy(config.policy, enum)
  train = algorithms.make_train_fn(config, enum, policy, algorithms.get_algorithm(algorithm))

  def _one_run(bandit, key, lr):
    out = train(key, bandit, lr)
    return out.returns / policies.class_optimum(config.policy, bandit)

  over_runs = jax.vmap(_one_run, in_axes=(0, 0, None))
  return jax.jit(
    jax.vmap(over_runs, in_axes=(None, None, 0)), compiler_options=algorithms.compiler_options()
  )


def grid_text(lrs: np.ndarray) -> str:
  """The learning-rate grid as written: "[0.3, 1, 3]" (shortest form, not float32's digits)."""
  return "[" + ", ".join(f"{float(lr):g}" for lr in lrs) + "]"


def run_sweep(config: ml_collections.ConfigDict, log=print) -> dict[tuple[str, str], SettingResult]:
  """Runs every (algorithm, family) on the grid; see module doc."""
  validate(config)
  lrs = learning_rates(config)
  _, train_keys = _seed_keys(config)
  families = {f: make_instances(config, f) for f in _names(config.families, "families")}
  results = {}
  for algorithm in _names(config.algorithms, "algorithms"):
    setting_fn = make_setting_fn(config, algorithm)
    for family, bandits in families.items():
      start = time.perf_counter()
      curves = np.asarray(setting_fn(bandits, train_keys, jnp.asarray(lrs)))
      best = int(np.argmax(curves[:, :, -1].mean(1)))
      results[(algorithm, family)] = SettingResult(lrs, curves, best)
      log(
        f"{algorithm:>16s} on {family:<7s} {time.perf_counter() - start:5.1f}"
        f" s (lr grid {grid_text(lrs)}, best {lrs[best]:g})"
      )
  return results


def table(results: dict[tuple[str, str], SettingResult]) -> str:
  """The markdown comparison table, rows grouped by family."""
  rows = []
  for family in dict.fromkeys(f for _, f in results):
    for (algorithm, fam), r in results.items():
      if fam == family:
        rows.append(
          (algorithm, family, float(r.learning_rates[r.best]), report.summarise(r.best_curves))
        )
  return report.format_table(rows)


def describe(config: ml_collections.ConfigDict) -> str:
  """One paragraph with the setting, for the top of the output."""
  b = config.num_contexts * config.group_size
  return (
    f"{config.num_turns}-turn bandit, {config.num_contexts} contexts, "
    f"{config.num_actions} actions, {config.policy} policy"
    f"{' (J* of the class: the best open-loop sequence)' if config.policy == 'blind' else ''}; "
    f"{config.num_iterations} iterations x {b} rollouts "
    f"({config.group_size} per context); {config.epochs_per_turn} epochs x "
    f"{config.minibatches_per_turn} minibatches per turn (per iteration for "
    f"simultaneous updates, 1 x 1 for REINFORCE/RLOO); clip "
    f"{config.clip_eps}, correction clip {config.correction_clip}, gamma "
    f"{config.gamma}; {_staleness(config)}{config.num_seeds} seeds (seed {config.seed}); SGD, "
    f"learning-rate grid {grid_text(learning_rates(config))}, best per row."
  )


def _staleness(config: ml_collections.ConfigDict) -> str:
  """ "lag 2 (...), TIS token (cap 2); " or "" for the on-policy program without TIS."""
  parts = []
  if int(config.lag):
    parts.append(
      f"lag {config.lag} (iteration i samples with the params of iteration i-1-{config.lag})"
    )
  if config.tis != "off":
    parts.append(f"TIS {config.tis} (cap {config.tis_cap:g})")
  return ", ".join(parts) + "; " if parts else ""


def main(config: ml_collections.ConfigDict, workdir: str) -> str:
  """Runs the sweep, prints the table, writes table.md, curves.npz, PNGs."""
  os.makedirs(workdir, exist_ok=True)
  results = run_sweep(config)
  text = describe(config) + "\n\n" + table(results)
  print(text)
  with open(os.path.join(workdir, "table.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  np.savez_compressed(
    os.path.join(workdir, "curves.npz"),
    **{f"{a}__{f}": r.curves for (a, f), r in results.items()},
    learning_rates=learning_rates(config),
  )
  for family in dict.fromkeys(f for _, f in results):
    curves = {a: r.best_curves for (a, f), r in results.items() if f == family}
    path = os.path.join(workdir, f"curves_{family}.png")
    report.plot_curves(path, family, curves)
    print(f"wrote {path}")
  return text
