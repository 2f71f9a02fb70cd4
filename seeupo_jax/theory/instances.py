"""Instance families for the multi-turn contextual bandit.

Every generator has the signature `(key, num_contexts, num_actions,
num_turns) -> Bandit`, is pure JAX (vmap over keys gives a batch of
instances), and draws contexts uniformly. Families:

* `random`: r(x, a) ~ U[0, 1] i.i.d. for every trajectory. Many near-optimal
  leaves; the benign case.
* `trap` (delayed pay-off): each context has a hidden key sequence k.
  r = 1 if a = k; r = 0 if a_1 = k_1 but a later action misses; otherwise
  (a_1 != k_1) a "safe" reward 0.5 + 0.1 u, u ~ U[0, 1]. Under the uniform
  policy E[r | a_1 = k_1] = K^-(T-1) while E[r | a_1 != k_1] ~ 0.55, so an
  update of turn 1 that does not account for the later turns' improvement
  moves away from k_1: the best first action only pays off if the later
  turns find a rare action. J* = 1.
* `decoy`: a hidden key k and a decoy d with d_t != k_t at every turn.
  r = 1 if a = k, otherwise r = 0.6 * (number of turns with a_t = d_t) / T.
  The decoy gives a dense signal towards a local optimum worth 0.6; the key
  gives nothing until the whole sequence is hit (probability K^-T under the
  uniform policy). J* = 1. Turn rewards: r_t = 0.6 / T if a_t = d_t, else 0
  (a check of each step that rewards the decoy: they sum to r on every
  trajectory but the key's).
* `additive` (rewards earned turn by turn): every decision state and action
  pays u(x, a_<t, a_t) ~ U[0, 1] i.i.d., r = (1/T) sum_t u(x, a_<t, a_t), and
  the turn rewards are its terms, r_t = u(x, a_<t, a_t) / T: MT-GRPO's premise,
  a turn reward that is exactly the turn's share of the outcome. J* by
  backward induction (greedy per turn is not optimal: a turn's action also
  picks the next turn's payoffs).
* `walk` (recurring states: GiGPO's premise): the actions move a position, p_0 = 0,
  p_(t+1) = p_t + a_t, and r = g(x, p_T), g ~ U[0, 1] i.i.d. over the (K - 1) T + 1 end
  positions. The environment state before turn t is (x, t, p_t), reported as the key
  `(x T + t) M + p_t`, M = (K - 1)(T - 1) + 1 (`Bandit.turn_states`): the K^t histories of
  turn t reach only (K - 1) t + 1 positions, so rollouts of a group meet at the same state
  by different paths. J* = sum_x p(x) max_p g(x, p) (every end position is reachable).
* `stop` (early stopping chosen by the policy: MT-GRPO's bias): action 0 ends the episode
  and pays q_x ~ U[0.3, 0.5]; an episode that never stops pays 1 after turn T. The turn
  rewards are those payments, at the turn that earns them (q_x at the stop, 1 at turn T
  without one); `Bandit.turn_valid` ends each trajectory at its stop. Under the uniform
  policy an episode survives with probability ((K - 1)/K)^T, and a turn reward compared
  within the rows that reached the turn favours stopping now over a pay-off that only the
  survivors see. J* = 1.
* `sparse` (reward sparsity; option `density` rho): in each context, m =
  max(1, round(rho K^T)) trajectories drawn without replacement pay 1, all
  others 0. Under the uniform policy a rollout is rewarded with probability
  m / K^T, so a group of n rollouts sees no reward at all with probability
  (1 - m / K^T)^n. J* = 1.
* `scaled` (reward scales that differ by orders of magnitude; option
  `scale_orders` m): r(x, a) = s_x u(x, a), u ~ U[0, 1] i.i.d., with
  s_x = 10^(-m x / (X - 1)): context 0 pays on the scale 1, the last context
  on 10^-m. Dividing each group by its own std gives every context the same
  weight in the update, while J weighs context x by s_x: under a policy that
  shares its parameters across contexts (`policies.blind_policy`) the two
  objectives disagree. J* = sum_x p(x) s_x max_a u(x, a).

Options are keyword arguments of the generators, bound by `make_family`
(`FAMILY_OPTIONS` lists which family reads which config key).
"""

import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp

from seeupo_jax.theory import bandit as bandit_lib

InstanceFn = Callable[[chex.PRNGKey, int, int, int], bandit_lib.Bandit]


def _uniform_contexts(num_contexts: int) -> chex.Array:
  return jnp.full((num_contexts,), 1.0 / num_contexts)


def _all_sequences(num_actions: int, num_turns: int) -> chex.Array:
  """[K^T, T] int32, every action sequence in trajectory order."""
  idx = jnp.arange(num_actions**num_turns)
  digits = [(idx // num_actions ** (num_turns - 1 - t)) % num_actions for t in range(num_turns)]
  return jnp.stack(digits, -1)


def random_instance(key, num_contexts, num_actions, num_turns):
  """r(x, a) ~ U[0, 1] i.i.d.; uniform contexts."""
  rewards = jax.random.uniform(key, (num_contexts, num_actions**num_turns), jnp.float32)
  return bandit_lib.Bandit(rewards, _uniform_contexts(num_contexts), num_turns, num_actions)


def trap_instance(key, num_contexts, num_actions, num_turns):
  """Delayed pay-off: 1 for the key, 0 after a_1 = k_1 otherwise, ~0.55 else."""
  key_seq, key_safe = jax.random.split(key)
  seqs = _all_sequences(num_actions, num_turns)  # [K^T, T]
  keys = jax.random.randint(key_seq, (num_contexts, num_turns), 0, num_actions)
  hit = jnp.all(seqs[None] == keys[:, None], -1)  # [X, K^T]
  first = seqs[None, :, 0] == keys[:, None, 0]
  safe = 0.5 + 0.1 * jax.random.uniform(key_safe, hit.shape)
  rewards = jnp.where(hit, 1.0, jnp.where(first, 0.0, safe))
  return bandit_lib.Bandit(
    rewards.astype(jnp.float32), _uniform_contexts(num_contexts), num_turns, num_actions
  )


def decoy_instance(key, num_contexts, num_actions, num_turns):
  """1 for the key; 0.6 * (share of turns matching a decoy) otherwise."""
  key_seq, key_shift = jax.random.split(key)
  seqs = _all_sequences(num_actions, num_turns)
  keys = jax.random.randint(key_seq, (num_contexts, num_turns), 0, num_actions)
  shift = jax.random.randint(key_shift, keys.shape, 1, num_actions)
  decoys = (keys + shift) % num_actions  # d_t != k_t at every turn
  hit = jnp.all(seqs[None] == keys[:, None], -1)
  decoy_hits = seqs[None] == decoys[:, None]  # [X, K^T, T]
  rewards = jnp.where(hit, 1.0, 0.6 * jnp.mean(decoy_hits, -1))
  turn_rewards = (0.6 / num_turns) * decoy_hits.astype(jnp.float32)
  return bandit_lib.Bandit(
    rewards.astype(jnp.float32),
    _uniform_contexts(num_contexts),
    num_turns,
    num_actions,
    turn_rewards=turn_rewards,
  )


def additive_instance(key, num_contexts, num_actions, num_turns):
  """r = (1/T) sum_t u(x, a_<t, a_t), u ~ U[0, 1] per (state, action); turn rewards u / T."""
  leaves = num_actions**num_turns
  leaf = jnp.arange(leaves)
  turn_rewards = []
  for t, turn_key in enumerate(jax.random.split(key, num_turns)):
    # u of every (x, a_1..a_t) (row-major prefix index), read at each leaf's prefix of length t + 1.
    payoffs = jax.random.uniform(turn_key, (num_contexts, num_actions ** (t + 1)), jnp.float32)
    turn_rewards.append(payoffs[:, leaf // num_actions ** (num_turns - 1 - t)] / num_turns)
  turn_rewards = jnp.stack(turn_rewards, -1)  # [X, K^T, T]
  return bandit_lib.Bandit(
    turn_rewards.sum(-1),
    _uniform_contexts(num_contexts),
    num_turns,
    num_actions,
    turn_rewards=turn_rewards,
  )


def walk_instance(key, num_contexts, num_actions, num_turns):
  """r = g(x, p_T), p_T = sum_t a_t, g ~ U[0, 1]; turn states (x T + t) M + p_t."""
  seqs = _all_sequences(num_actions, num_turns)  # [K^T, T]
  positions = jnp.cumsum(seqs, -1) - seqs  # [K^T, T], p_t before turn t
  ends = seqs.sum(-1)  # [K^T], p_T
  payoffs = jax.random.uniform(key, (num_contexts, (num_actions - 1) * num_turns + 1))
  rewards = payoffs[:, ends]  # [X, K^T]
  width = (num_actions - 1) * (num_turns - 1) + 1  # M: positions before any turn
  contexts = jnp.arange(num_contexts)[:, None, None]
  turns = jnp.arange(num_turns)[None, None, :]
  turn_states = (contexts * num_turns + turns) * width + positions[None]
  return bandit_lib.Bandit(
    rewards.astype(jnp.float32),
    _uniform_contexts(num_contexts),
    num_turns,
    num_actions,
    turn_states=turn_states.astype(jnp.int32),
  )


def stop_instance(key, num_contexts, num_actions, num_turns):
  """Action 0 stops and pays q_x ~ U[0.3, 0.5]; never stopping pays 1; turn rewards = payments."""
  seqs = _all_sequences(num_actions, num_turns)  # [K^T, T]
  stops = seqs == 0
  stopped_before = jnp.cumsum(stops, -1) - stops  # stops at turns < t
  turn_valid = stopped_before == 0  # [K^T, T]: the turns up to and with the stop
  first_stop = stops & turn_valid  # one-hot at the stop turn, if any
  never = ~jnp.any(stops, -1)  # [K^T]
  quit_pay = jax.random.uniform(key, (num_contexts, 1, 1), minval=0.3, maxval=0.5)
  last = jnp.arange(num_turns) == num_turns - 1
  turn_rewards = jnp.where(first_stop[None], quit_pay, 0.0) + jnp.where(
    (never[:, None] & last[None, :])[None], 1.0, 0.0
  )  # [X, K^T, T]
  return bandit_lib.Bandit(
    turn_rewards.sum(-1).astype(jnp.float32),
    _uniform_contexts(num_contexts),
    num_turns,
    num_actions,
    turn_rewards=turn_rewards.astype(jnp.float32),
    turn_valid=jnp.broadcast_to(turn_valid[None], turn_rewards.shape),
  )


def sparse_instance(key, num_contexts, num_actions, num_turns, density=0.05):
  """m = max(1, round(density K^T)) random trajectories per context pay 1, the rest 0."""
  leaves = num_actions**num_turns
  rewarded = rewarded_leaves(density, num_actions, num_turns)
  # The m smallest of K^T i.i.d. uniforms are m distinct leaves drawn uniformly.
  ranks = jnp.argsort(jnp.argsort(jax.random.uniform(key, (num_contexts, leaves)), -1), -1)
  rewards = (ranks < rewarded).astype(jnp.float32)
  return bandit_lib.Bandit(rewards, _uniform_contexts(num_contexts), num_turns, num_actions)


def rewarded_leaves(density: float, num_actions: int, num_turns: int) -> int:
  """m = max(1, round(density K^T)): the rewarded trajectories per context of `sparse`."""
  if not 0.0 < density <= 1.0:
    raise ValueError(f"config key `density` must be in (0, 1], got {density}")
  return max(1, int(round(density * num_actions**num_turns)))


def context_scales(num_contexts: int, scale_orders: float) -> chex.Array:
  """[X] float32, s_x = 10^(-m x / (X - 1)) (all 1 for X = 1 or m = 0)."""
  if scale_orders < 0:
    raise ValueError(f"config key `scale_orders` must be >= 0, got {scale_orders}")
  steps = jnp.arange(num_contexts, dtype=jnp.float32) / max(num_contexts - 1, 1)
  return jnp.power(10.0, -float(scale_orders) * steps)


def scaled_instance(key, num_contexts, num_actions, num_turns, scale_orders=2.0):
  """r(x, a) = s_x u(x, a), u ~ U[0, 1], s_x = 10^(-m x / (X - 1))."""
  u = jax.random.uniform(key, (num_contexts, num_actions**num_turns), jnp.float32)
  rewards = context_scales(num_contexts, scale_orders)[:, None] * u
  return bandit_lib.Bandit(rewards, _uniform_contexts(num_contexts), num_turns, num_actions)


FAMILIES: dict[str, InstanceFn] = {
  "random": random_instance,
  "trap": trap_instance,
  "decoy": decoy_instance,
  "additive": additive_instance,
  "walk": walk_instance,
  "stop": stop_instance,
  "sparse": sparse_instance,
  "scaled": scaled_instance,
}

FAMILY_OPTIONS: dict[str, tuple[str, ...]] = {"sparse": ("density",), "scaled": ("scale_orders",)}
"""The config keys each family reads (keyword arguments of its generator)."""


def get_family(name: str) -> InstanceFn:
  """Looks up an instance family by name; a bad name lists the allowed ones."""
  if name not in FAMILIES:
    raise ValueError(
      f"unknown instance family {name!r} (config key `families`); allowed: {sorted(FAMILIES)}"
    )
  return FAMILIES[name]


def make_family(name: str, config) -> InstanceFn:
  """The generator of family `name` with its options read from `config` (a mapping)."""
  make = get_family(name)
  options = {key: float(config[key]) for key in FAMILY_OPTIONS.get(name, ())}
  # The options are checked here, on the config's sizes, before anything is traced.
  if name == "sparse":
    rewarded_leaves(options["density"], int(config["num_actions"]), int(config["num_turns"]))
  if name == "scaled":
    context_scales(int(config["num_contexts"]), options["scale_orders"])
  return functools.partial(make, **options) if options else make
