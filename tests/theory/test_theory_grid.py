"""The theory grid: the new families and the blind policy by hand, paired statistics by hand,
and the grid's cells equal to the sweep they run (and read back, not recomputed)."""

import dataclasses
import itertools
import pathlib
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from seeupo_jax.theory import bandit as bandit_lib
from seeupo_jax.theory import grid
from seeupo_jax.theory import instances
from seeupo_jax.theory import policies
from seeupo_jax.theory import report
from seeupo_jax.theory import sweep

_REPO = pathlib.Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------------------------
# Families and the blind policy.


@pytest.mark.parametrize(
  "density,k,t_,want", [(0.03, 2, 6, 2), (0.01, 2, 6, 1), (0.5, 2, 6, 32), (0.125, 3, 3, 3)]
)
def test_sparse_family_rewards_exactly_m_leaves_per_context(density, k, t_, want):
  # m = max(1, round(density K^T)): 0.03 * 64 = 1.92 -> 2; 0.64 -> 1; 32; 0.125 * 27 = 3.4 -> 3.
  assert instances.rewarded_leaves(density, k, t_) == want
  bandit = instances.sparse_instance(jax.random.PRNGKey(0), 5, k, t_, density=density)
  r = np.asarray(bandit.rewards)
  assert set(np.unique(r)) <= {0.0, 1.0}
  np.testing.assert_array_equal(r.sum(-1), want)
  np.testing.assert_allclose(bandit_lib.optimal_return(bandit), 1.0)
  # The rewarded leaves are drawn per context: not the same set in every context.
  assert want == k**t_ or len({tuple(np.flatnonzero(row)) for row in r}) > 1


def test_scaled_family_is_the_random_family_times_the_context_scales():
  key = jax.random.PRNGKey(4)
  scaled = instances.scaled_instance(key, 3, 2, 3, scale_orders=2.0)
  plain = instances.random_instance(key, 3, 2, 3)
  np.testing.assert_allclose(instances.context_scales(3, 2.0), [1.0, 0.1, 0.01], rtol=1e-6)
  want = np.asarray(plain.rewards) * np.array([1.0, 0.1, 0.01])[:, None]
  np.testing.assert_allclose(scaled.rewards, want, rtol=1e-6)
  np.testing.assert_allclose(instances.context_scales(3, 0.0), 1.0)


def test_family_options_come_from_the_config_and_bad_values_name_the_key():
  config = sweep.default_config()
  config.update(density=0.5, num_turns=2)
  make = instances.make_family("sparse", config)
  assert np.asarray(make(jax.random.PRNGKey(0), 3, 2, 2).rewards).sum(-1).tolist() == [2, 2, 2]
  config.density = 0.0
  with pytest.raises(ValueError, match=r"`density` must be in \(0, 1\], got 0.0"):
    instances.make_family("sparse", config)
  config.density, config.scale_orders = 0.5, -1.0
  with pytest.raises(ValueError, match="`scale_orders` must be >= 0, got -1.0"):
    instances.make_family("scaled", config)


def test_blind_policy_is_the_same_in_every_context():
  enum = bandit_lib.enumerate_bandit(3, 2, 3)
  policy = policies.blind_policy(enum)
  assert policy.num_params == (1 + 2 + 4) * 2
  theta = jax.random.normal(jax.random.PRNGKey(0), (policy.num_params,))
  log_pi = np.asarray(policies.log_policy(policy, theta)).reshape(3, 7, 2)
  np.testing.assert_allclose(log_pi[1], log_pi[0])
  np.testing.assert_allclose(log_pi[2], log_pi[0])
  # State (t=2, a_1=1, a_2=0) is the within-context state 1 + 2 + (1 * 2 + 0) = 5.
  want = jax.nn.log_softmax(np.asarray(theta)[10:12])
  np.testing.assert_allclose(log_pi[0, 5], want, rtol=1e-6)


def test_blind_class_optimum_is_the_best_deterministic_blind_policy():
  x_, k, t_ = 3, 2, 2
  enum = bandit_lib.enumerate_bandit(x_, k, t_)
  bandit = instances.scaled_instance(jax.random.PRNGKey(2), x_, k, t_, scale_orders=1.0)
  per_context = enum.states_per_context  # 3: (t=0), (t=1, a_1=0), (t=1, a_1=1)
  best = -np.inf
  for choice in itertools.product(range(k), repeat=per_context):
    log_pi = np.full((enum.num_states, k), -1e9, np.float32)
    for s in range(enum.num_states):
      log_pi[s, choice[s % per_context]] = 0.0
    best = max(best, float(bandit_lib.expected_return(bandit, enum, log_pi)))
  np.testing.assert_allclose(policies.class_optimum("blind", bandit), best, rtol=1e-6)
  # By hand: the best single sequence of the context-averaged reward.
  r = np.asarray(bandit.rewards)
  np.testing.assert_allclose(best, r.mean(0).max(), rtol=1e-6)
  assert best <= float(policies.class_optimum("tabular", bandit)) + 1e-7


# ----------------------------------------------------------------------------------------------
# Paired statistics.


def test_paired_difference_by_hand():
  # d = [1, 2, 3]: mean 2, sd 1, half width 1.96 / sqrt(3) = 1.1316.
  p = grid.paired_difference(np.array([1.0, 2.0, 3.0]), np.zeros(3))
  assert p.mean == pytest.approx(2.0) and p.ci == pytest.approx(1.96 / np.sqrt(3))
  assert p.verdict == "+"
  assert grid.paired_difference(np.zeros(3), np.array([1.0, 2.0, 3.0])).verdict == "-"
  # d = [1, -1, 0.5, -0.5]: mean 0, the interval contains 0.
  assert grid.paired_difference(np.array([1.0, -1.0, 0.5, -0.5]), np.zeros(4)).verdict == "="
  # Pairing: a common offset per run cancels (unpaired intervals would be wide).
  base = np.array([0.1, 0.9, 0.4, 0.7])
  p = grid.paired_difference(base + 0.01, base)
  assert p.mean == pytest.approx(0.01) and p.ci == pytest.approx(0.0, abs=1e-12)
  with pytest.raises(ValueError, match="two"):
    grid.paired_difference(np.zeros(3), np.zeros(4))


def test_drop_shares_by_hand():
  curves = np.array([[0.5, 0.6, 0.55, 0.7], [0.1, 0.2, 0.3, 0.4]])
  np.testing.assert_allclose(grid.drop_shares(curves), [1 / 3, 0.0])


def test_cell_rows_compare_every_algorithm_with_seeupo_run_by_run():
  axis = grid.Axis("horizon", "num_turns", (3,), ("tabular",), {})
  ref = np.array([[0.5, 0.9, 1.0], [0.5, 0.8, 0.9], [0.5, 0.4, 0.95]])
  other = np.array([[0.5, 0.6, 0.8], [0.5, 0.7, 0.6], [0.5, 0.9, 0.7]])
  rows = grid.cell_rows(
    axis, 3, "tabular", {("seeupo", "trap"): (3.0, ref), ("grpo", "trap"): (1.0, other)}
  )
  assert [r.algorithm for r in rows] == ["seeupo", "grpo"]
  assert rows[0].final_gap is None and rows[0].summary == report.summarise(ref)
  assert rows[1].final_gap.mean == pytest.approx(0.25)
  assert rows[1].final_gap.ci == pytest.approx(1.96 * 0.05 / np.sqrt(3))
  # Drops (of 2 iterations): seeupo [0, 0, 1/2] (0.5 -> 0.4), grpo [0, 1/2, 1/2]; grpo minus
  # seeupo = [0, 1/2, 0]: mean 1/6, sd 0.2887, half width 1.96 * 0.2887 / sqrt(3) = 0.327.
  assert rows[1].drop_gap.mean == pytest.approx(1 / 6)
  assert rows[1].drop_gap.ci == pytest.approx(1.96 * np.std([0, 0.5, 0], ddof=1) / np.sqrt(3))
  table = grid.region_table(rows)
  assert "| horizon | policy | family | vs | 3 |" in table
  assert "|  | tabular | trap | (seeupo J/J*c) | 0.950 |" in table
  assert "|  | tabular | trap | grpo | +0.2500 + |" in table
  drops = grid.region_table(rows, "drops")
  assert "|  | tabular | trap | (seeupo J drops) | 16.7% |" in drops
  assert "|  | tabular | trap | grpo | +0.167 = |" in drops
  with pytest.raises(ValueError, match="metric='best'; allowed"):
    grid.region_table(rows, "best")


# ----------------------------------------------------------------------------------------------
# The grid runs the sweep, keeps its cells, and reads them back.


def test_grid_cells_are_the_sweep_and_are_read_back_not_recomputed(tmp_path, monkeypatch):
  base = sweep.default_config()
  base.update(num_seeds=3, num_iterations=4, learning_rates="1,3")
  # Two cells of the default `scale` axis (the benchmark command below reads them back).
  default = {a.name: a for a in grid.DEFAULT_AXES}["scale"]
  axis = default._replace(values=(0.0, 2.0), policies=("blind",))
  rows = grid.run_grid(base, [axis], str(tmp_path), log=lambda _: None)
  algorithms = ["seeupo", "seeupo_groupstd", "seeupo_nonorm", "grpo"]
  assert [(r.value, r.algorithm) for r in rows] == [(v, a) for v in (0.0, 2.0) for a in algorithms]
  # The cell at scale_orders = 2 is the sweep of that config, run directly.
  config = grid.cell_config(base, axis, 2.0, "blind")
  assert (config.scale_orders, config.policy, config.families) == (2.0, "blind", "scaled")
  direct = sweep.run_sweep(config, log=lambda _: None)
  for r in rows[4:]:
    want = direct[(r.algorithm, "scaled")]
    assert r.lr == want.learning_rates[want.best]
    assert r.summary == report.summarise(want.best_curves)
  # J / J*_class: the blind class's optimum, so the uniform policy's start is J(uniform) / J*_blind.
  bandits = sweep.make_instances(config, "scaled")
  j0 = np.asarray(bandits.rewards).mean((-1, -2))
  j_star = np.asarray(jax.vmap(lambda b: policies.class_optimum("blind", b))(bandits))
  np.testing.assert_allclose(direct[("seeupo", "scaled")].best_curves[:, 0], j0 / j_star, rtol=1e-5)

  def _no_sweep(*args, **kwargs):
    raise AssertionError("a finished cell was recomputed")

  monkeypatch.setattr(sweep, "run_sweep", _no_sweep)
  again = grid.run_grid(base, [axis], str(tmp_path), log=lambda _: None)
  assert again == rows
  only_read = grid.run_grid(base, [axis], str(tmp_path), log=lambda _: None, compute=False)
  assert only_read == rows
  # A cell run with another config is refused by name, not reused.
  longer = ml_collections.ConfigDict(base.to_dict())
  longer.num_iterations = 5
  with pytest.raises(
    ValueError, match=r"scale__0__blind.npz was run with another config \(keys num_iterations\)"
  ):
    grid.run_grid(longer, [axis], str(tmp_path), log=lambda _: None)
  grid.plot_axis(str(tmp_path / "scale.png"), rows, "scale")
  assert (tmp_path / "scale.png").stat().st_size > 0

  # The benchmark command reads the same cells (its `scale` axis names the same files).
  command = [sys.executable, str(_REPO / "benchmarks" / "bench_theory_grid.py")]
  command += [f"--workdir={tmp_path}", "--axes=scale", "--plot_only", "--num_seeds=3"]
  command += ["--learning_rates=1,3"]
  done = subprocess.run(
    command + ["--num_iterations=4"], capture_output=True, text=True, timeout=300, check=True
  )
  assert grid.region_table(rows).strip() in done.stdout
  assert "scale=1 blind: not run yet" in done.stdout + done.stderr
  assert (tmp_path / "regions.md").read_text().strip() == grid.region_table(rows).strip()
  assert (tmp_path / "grid_scale.png").read_bytes()[:4] == b"\x89PNG"
  # Run with another config, the command refuses the cells in one line (exit 2, no traceback).
  refused = subprocess.run(
    command + ["--num_iterations=5"], capture_output=True, text=True, timeout=300
  )
  assert refused.returncode == 2
  assert "Traceback" not in refused.stderr
  assert (
    "was run with another config (keys num_iterations)" in refused.stderr.strip().splitlines()[-1]
  )


def test_sweep_takes_ten_turns_and_refuses_eleven():
  config = sweep.default_config()
  config.num_turns = 10
  sweep.validate(config)
  config.num_turns = 11
  with pytest.raises(ValueError, match=r"^num_turns=11; allowed: an int in \[2, 10\]$"):
    sweep.validate(config)
  config.update(num_turns=8, num_actions=4)
  with pytest.raises(ValueError, match=r"196608 trajectories .*allowed: <= 12288"):
    sweep.validate(config)


def test_bandit_keys_are_declared_once_and_checked_with_their_allowed_values():
  """`default_config()` is `BanditConfig`'s fields with their defaults; `validate` names every
  refused key with what it allows, an unknown key, and a missing one."""
  config = sweep.default_config()
  assert sorted(config.keys()) == sorted(f.name for f in dataclasses.fields(sweep.BanditConfig))
  assert config.num_turns == 4 and config.group_size == 16 and config.policy == "tabular"
  sweep.validate(config)
  config.update(num_seeds=1, density=0.0, gamma=1.5)
  with pytest.raises(ValueError) as error:
    sweep.validate(config)
  assert str(error.value) == (
    "num_seeds=1; allowed: an int >= 2; density=0.0; allowed: a number in (0, 1]; "
    "gamma=1.5; allowed: a number in [0, 1]"
  )
  config = sweep.default_config()
  config.unlock()
  config.num_sedes = 3
  with pytest.raises(ValueError, match="unknown config key 'num_sedes'; known: "):
    sweep.validate(config)
  del config["num_sedes"], config["gamma"]
  with pytest.raises(ValueError, match="config key 'gamma' is missing"):
    sweep.validate(config)
