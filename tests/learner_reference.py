"""Independent float64 NumPy reference of one learner call, per algorithm, written from the
algorithms' definitions (the paper, the formulas in `docs/losses.md` and the learner's docstrings),
never from the learner's code: plain loops, gradients derived by hand, plain SGD.

The policy is a table of logits shared by all rows position by position: params table[L, V],
    logp[i, j] = log_softmax(table[j])[tokens[i, j]]   (0 at j = 0 and on padding),
so  d logp[i, j] / d table[j, v] = onehot(tokens[i, j])[v] - softmax(table[j])[v],  and a loss
with g[i, j] = d loss / d logp[i, j] has  d loss / d table[j, v] = sum_i g[i, j] (onehot - softmax).
PPO's critic is a value table v[L]: V[i, j] = v[j] on valid tokens, 0 elsewhere.

Aggregation: loss = sum_it w_it l_it with n_i = sum_t m_it, R = {i : n_i > 0} and
  seq-mean-token-mean (the default):  w_it = m_it / (n_i |R|)
  seq-mean-token-sum-norm (Dr. GRPO): w_it = m_it / (C |R|), C = norm_length, or the padded
                                      length L when it is None
  token-mean (DAPO):                  w_it = m_it / sum_jt m_jt

Per-token gradients g = d loss / d logp (the clip's max picks the unclipped branch at a tie, where
both branches have the same gradient):
  token clip (GRPO, PPO), rho_it = exp(logp_it - old_it):
      l = max(-A rho, -A clip(rho, 1 - lo, 1 + hi));  g = w (-A rho) unclipped, 0 clipped.
  sequence clip (GSPO, SeeUPO's turn loss), s_i = exp(mean_t over the row's mask of (logp - old)):
      l_it = max(-A_it s_i, -A_it clip(s_i));  d s_i / d logp_it = s_i / n_i, so
      g_it = w_it (-A_it s_i) on the unclipped branch, 0 on the clipped one (the 1/n_i is in w).
  reinforce:  l = -A logp;  g = w (-A).
  KL low_var_kl (k3): d = clip(ref - logp, -20, 20), kl = clip(e^d - d - 1, -10, 10),
      d kl / d logp = 1 - e^d inside both clips; added as kl_coef * (same aggregation, same mask).
  PPO critic: l = 1/2 max((V - Ret)^2, (Vold + clip(V - Vold, -c, c) - Ret)^2), token-mean;
      d l / d V = (V - Ret) on the unclipped branch, 0 on the clipped one.
"""

from __future__ import annotations

import math

import numpy as np

import losses_reference as lref

CRITIC_FREE_ADVANTAGES = {
  # algorithm: (group_std, batch_norm, clamped)
  "seeupo": (False, True, True),
  "grpo": (True, False, False),
  "gspo": (True, False, False),
  "reinforce": (False, False, False),
  "dr_grpo": (False, False, False),  # Dr. GRPO: R - group mean, no std
  "gspo_token": (True, False, False),
  "dapo": (True, False, False),
}
TOKEN_CLIP = ("grpo", "ppo", "dr_grpo", "dapo", "gigpo", "mt_grpo")
TURN_LEVEL = ("gigpo", "mt_grpo")  # per-turn advantages from Batch.turn_states / turn_rewards
SEQUENCE_CLIP = ("seeupo", "gspo", "gspo_token")


# ----------------------------------------------------------------------------------------------
# The table-of-logits policy and its gradient.


def _log_softmax(row):
  row = np.asarray(row, np.float64)
  top = row.max()
  return row - top - math.log(np.exp(row - top).sum())


def table_logp(table, tokens, token_valid):
  """float64[N, L]: logp[i, j] = log_softmax(table[j])[tokens[i, j]], 0 at j = 0 and padding."""
  n, length = tokens.shape
  out = np.zeros((n, length))
  for j in range(1, length):
    log_probs = _log_softmax(table[j])
    for i in range(n):
      if token_valid[i, j]:
        out[i, j] = log_probs[tokens[i, j]]
  return out


def table_grad(table, tokens, g):
  """d loss / d table[L, V] from g[N, L] = d loss / d logp."""
  grad = np.zeros(table.shape)
  n, length = tokens.shape
  for j in range(length):
    probs = np.exp(_log_softmax(table[j]))
    for i in range(n):
      if g[i, j] != 0.0:
        onehot = np.zeros(table.shape[1])
        onehot[tokens[i, j]] = 1.0
        grad[j] += g[i, j] * (onehot - probs)
  return grad


# ----------------------------------------------------------------------------------------------
# Losses with their hand-derived gradients.


def aggregation_weights(mask, agg="seq-mean-token-mean", norm_length=None):
  """w[N, L] with loss = sum w * l (see the module doc)."""
  mask = np.asarray(mask, np.float64)
  if agg == "token-mean":
    return mask / max(mask.sum(), 1.0)
  counts = mask.sum(1)
  rows = int((counts > 0).sum())
  w = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    if counts[i] > 0:
      constant = mask.shape[1] if norm_length is None else norm_length
      per_row = {"seq-mean-token-mean": counts[i], "seq-mean-token-sum-norm": constant}[agg]
      w[i] = mask[i] / per_row / rows
  return w


class _Margin:
  """The smallest distance of a ratio (or value step) from its clip boundary at a clip decision:
  float32 and float64 could take different branches closer than ~1e-5."""

  def __init__(self):
    self.value = math.inf

  def see(self, x, low, high):
    self.value = min(self.value, abs(x - low), abs(x - high))


def _clip_branch(ratio, adv, low, high):
  """(per-element loss, clipped?) of max(-A r, -A clip(r, low, high))."""
  unclipped = -adv * ratio
  clipped = -adv * min(max(ratio, low), high)
  return max(unclipped, clipped), clipped > unclipped


def policy_loss_and_grad(kind, logp, old_logp, ref_logp, adv, mask, hp, margin):
  """Loss, metrics and g = d loss / d logp of one policy step (aggregation hp["agg"]).

  Args:
    kind: "token" (token clip), "sequence" (sequence clip) or "reinforce".
    logp, old_logp, ref_logp: float64[N, L] (ref_logp None: no KL).
    adv: float64[N, L] per-token advantages.
    mask: float64[N, L].
    hp: dict with clip_low, clip_high, kl_coef, agg and optionally norm_length.
    margin: a `_Margin`.
  """
  low, high = 1.0 - hp["clip_low"], 1.0 + hp["clip_high"]
  w = aggregation_weights(mask, hp["agg"], hp.get("norm_length"))
  n, length = mask.shape
  g = np.zeros((n, length))
  pg = 0.0
  clipped_count, decisions = 0, 0
  if kind == "sequence":
    log_s = lref.seq_log_ratio(logp, old_logp, mask)
  for i in range(n):
    if mask[i].sum() == 0:
      continue
    row_clipped = False
    if kind == "sequence":
      s = math.exp(min(max(log_s[i], -20.0), 20.0))
      margin.see(s, low, high)
    for t in range(length):
      if mask[i, t] == 0:
        continue
      if kind == "reinforce":
        pg += w[i, t] * (-adv[i, t] * logp[i, t])
        g[i, t] = w[i, t] * (-adv[i, t])
        continue
      if kind == "token":
        ratio = math.exp(min(max(logp[i, t] - old_logp[i, t], -20.0), 20.0))
        margin.see(ratio, low, high)
      else:
        ratio = s
      value, clipped = _clip_branch(ratio, adv[i, t], low, high)
      pg += w[i, t] * value
      g[i, t] = 0.0 if clipped else w[i, t] * (-adv[i, t] * ratio)
      if kind == "token":
        clipped_count += clipped
        decisions += 1
      row_clipped |= clipped
    if kind == "sequence":
      clipped_count += row_clipped
      decisions += 1
  kl = 0.0
  if ref_logp is not None:
    for i in range(n):
      for t in range(length):
        if mask[i, t] == 0:
          continue
        d = ref_logp[i, t] - logp[i, t]
        dc = min(max(d, -20.0), 20.0)
        k3 = math.exp(dc) - dc - 1.0
        kl += w[i, t] * min(max(k3, -10.0), 10.0)
        if -20.0 < d < 20.0 and -10.0 < k3 < 10.0:
          g[i, t] += hp["kl_coef"] * w[i, t] * (1.0 - math.exp(d))
  metrics = {
    "loss": pg + hp["kl_coef"] * kl,
    "pg_loss": pg,
    "kl": kl,
    "clip_fraction": clipped_count / max(decisions, 1),
  }
  return metrics, g


def critic_loss_and_grad(values, old_values, returns, mask, value_clip, margin):
  """PPO's clipped value loss (token-mean), its share of clipped tokens, and d loss / d V[N, L]."""
  total = mask.sum()
  loss, grad, clipped = 0.0, np.zeros(values.shape), 0
  for i in range(values.shape[0]):
    for t in range(values.shape[1]):
      if mask[i, t] == 0:
        continue
      err = values[i, t] - returns[i, t]
      if value_clip is None:
        loss += 0.5 * err**2 / total
        grad[i, t] = err / total
        continue
      step = values[i, t] - old_values[i, t]
      margin.see(step, -value_clip, value_clip)
      clipped_err = old_values[i, t] + min(max(step, -value_clip), value_clip) - returns[i, t]
      loss += 0.5 * max(err**2, clipped_err**2) / total
      grad[i, t] = 0.0 if clipped_err**2 > err**2 else err / total
      clipped += clipped_err**2 > err**2
  return loss, clipped / total, grad


# ----------------------------------------------------------------------------------------------
# Advantages.


def critic_free_advantages(algorithm, rewards, group_ids, row_valid, advantage_clip):
  """float64[N], one advantage per trajectory (GRAE variants or RLOO)."""
  if algorithm == "rloo":
    return lref.rloo(rewards, group_ids, row_valid)
  group_std, batch_norm, clamped = CRITIC_FREE_ADVANTAGES[algorithm]
  return lref.grae(
    rewards,
    group_ids,
    group_std=group_std,
    batch_norm=batch_norm,
    clip=advantage_clip if clamped else None,
    valid=row_valid,
  )


def turn_discount(turn_ids, mask, gamma):
  """float64[N, L]: gamma^(T_i - 1 - t) on turn t's tokens, T_i = the row's number of turns."""
  out = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    turns = [turn_ids[i, j] for j in range(mask.shape[1]) if mask[i, j] > 0]
    if not turns:
      continue
    last = max(turns)
    for j in range(mask.shape[1]):
      if mask[i, j] > 0:
        out[i, j] = gamma ** (last - turn_ids[i, j])
  return out


def whiten(adv, mask, clip):
  """PPO's token whitening over the masked tokens, clamped to +-clip."""
  cells = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] > 0]
  xs = np.array([adv[c] for c in cells])
  mean = xs.mean()
  std = math.sqrt(((xs - mean) ** 2).sum() / max(len(xs) - 1, 1))
  out = np.zeros(adv.shape)
  for c in cells:
    x = (adv[c] - mean) / std if std > 1e-6 else adv[c] - mean
    out[c] = x if clip is None else min(max(x, -clip), clip)
  return out


# ----------------------------------------------------------------------------------------------
# One learner call.


def _f64(x):
  return np.array(x, np.float64, copy=True)


def reference_update(
  algorithm,
  table,
  batch,
  *,
  num_turns,
  lr,
  epochs=1,
  order="reverse",
  correction=True,
  clip_low=0.2,
  clip_high=0.2,
  correction_clip_low=0.2,
  correction_clip_high=0.2,
  advantage_clip=3.0,
  kl_coef=0.0,
  gamma=1.0,
  gae_lambda=1.0,
  value_clip=0.5,
  agg="seq-mean-token-mean",
  norm_length=None,
  dynamic_sampling=False,
  overlong_max_tokens=None,
  overlong_cache_tokens=0,
  critic=None,
  critic_lr=None,
  normalisation=None,
  step_weight=None,
  outcome_weight=None,
):
  """One training iteration with SGD, one mini-batch per epoch, from the definitions.

  Args:
    algorithm: seeupo, grpo, gspo, reinforce, rloo, ppo, dr_grpo, gspo_token or dapo.
    table: float[L, V] initial policy params (also the KL reference).
    batch: anything with NumPy-convertible attributes tokens, token_valid, turn_ids, rewards,
      group_ids, row_valid (the learner's `Batch` fields).
    critic, critic_lr: PPO's value table float[L] and its SGD learning rate.
    The other keywords are the `LearnerConfig` fields of the same names.

  Returns:
    dict: "table" float64[L, V], "critic" float64[L] or None, "metrics" (means over the optimizer
    steps: loss, pg_loss, kl, clip_fraction, value_loss; optimizer_steps), "groups_dropped"
    (dynamic sampling), "turn_M_mean"
    float64[num_turns] (SeeUPO: mean M each turn was weighted with, over its rows; 0 for a turn
    no row has), "clip_margin" (smallest distance of a ratio from a clip boundary).
  """
  tokens = np.asarray(batch.tokens)
  token_valid = np.asarray(batch.token_valid, bool)
  turn_ids = np.asarray(batch.turn_ids)
  rewards = _f64(batch.rewards)
  group_ids = np.asarray(batch.group_ids)
  row_valid = np.asarray(batch.row_valid, bool)
  n, length = tokens.shape
  table = _f64(table)
  dropped_groups = 0
  if dynamic_sampling:  # DAPO: a group whose valid rows' rewards are all equal is left out
    row_valid = row_valid.copy()
    for g in set(group_ids[row_valid].tolist()):
      members = [i for i in range(n) if group_ids[i] == g and row_valid[i]]
      if len({float(rewards[i]) for i in members}) == 1:
        dropped_groups += 1
        row_valid[members] = False
  hp = dict(
    clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, agg=agg, norm_length=norm_length
  )
  margin = _Margin()
  generated = np.zeros((n, length))
  for i in range(n):
    for j in range(length):
      if row_valid[i] and token_valid[i, j] and 0 <= turn_ids[i, j] < num_turns:
        generated[i, j] = 1.0

  if overlong_max_tokens is not None:  # DAPO's soft overlong punishment, on all turns' tokens
    start = overlong_max_tokens - overlong_cache_tokens
    for i in range(n):
      y = generated[i].sum()
      if y > overlong_max_tokens:
        rewards[i] -= 1.0
      elif y > start:
        rewards[i] += (start - y) / overlong_cache_tokens

  def logp_at(params):
    return table_logp(params, tokens, token_valid)

  ref_logp = logp_at(table) if kl_coef > 0 else None
  kind = (
    "token"
    if algorithm in TOKEN_CLIP
    else "sequence"
    if algorithm in SEQUENCE_CLIP
    else "reinforce"
  )
  steps = []  # per optimizer step: metrics dict
  turn_m_mean = np.zeros(num_turns)

  def policy_steps(params, old_logp, adv, mask, count):
    """`count` SGD steps of the policy loss (critic-free algorithms)."""
    for _ in range(count):
      metrics, g = policy_loss_and_grad(
        kind, logp_at(params), old_logp, ref_logp, adv, mask, hp, margin
      )
      params = params - lr * table_grad(params, tokens, g)
      steps.append(metrics)
    return params

  if algorithm == "ppo":
    v = _f64(critic)
    old_values = np.where(token_valid, v[None, :], 0.0)
    token_rewards = np.zeros((n, length))
    for i in range(n):
      cols = np.flatnonzero(generated[i])
      if cols.size:
        token_rewards[i, cols[-1]] = rewards[i]
    adv, returns = lref.gae(token_rewards, old_values, generated, gamma, gae_lambda)
    adv = whiten(adv, generated, advantage_clip)
    old_logp = logp_at(table)
    for _ in range(epochs):
      metrics, g = policy_loss_and_grad(
        kind, logp_at(table), old_logp, ref_logp, adv, generated, hp, margin
      )
      values = np.where(token_valid, v[None, :], 0.0)
      metrics["value_loss"], metrics["value_clip_fraction"], dvalues = critic_loss_and_grad(
        values, old_values, returns, generated, value_clip, margin
      )
      table = table - lr * table_grad(table, tokens, g)
      v = v - critic_lr * (dvalues * token_valid).sum(0)
      steps.append(metrics)
  elif algorithm in TURN_LEVEL:
    turn_valid = np.array(
      [
        [bool((generated[i] * (turn_ids[i] == t)).any()) for t in range(num_turns)]
        for i in range(n)
      ]
    )
    group_std = normalisation in (None, "group")
    if algorithm == "gigpo":
      per_turn = lref.gigpo(
        rewards,
        group_ids,
        np.asarray(batch.turn_states),
        turn_valid,
        row_valid,
        gamma,
        1.0 if step_weight is None else step_weight,
        group_std,
      )
    else:
      per_turn = lref.mt_grpo(
        rewards,
        _f64(batch.turn_rewards),
        group_ids,
        turn_valid,
        row_valid,
        1.0 if outcome_weight is None else outcome_weight,
        group_std,
      )
    adv = np.zeros((n, length))
    for i in range(n):
      for j in range(length):
        if generated[i, j]:
          adv[i, j] = per_turn[i, turn_ids[i, j]]
    table = policy_steps(table, logp_at(table), adv, generated, epochs)
  elif algorithm == "seeupo":
    adv_rows = critic_free_advantages(algorithm, rewards, group_ids, row_valid, advantage_clip)
    discount = turn_discount(turn_ids, generated, gamma)
    m = np.ones(n)
    turns = list(range(num_turns))
    turn_order = turns[::-1] if order == "reverse" else turns
    per_turn = []
    for t in turn_order:
      mask = generated * (turn_ids == t)
      rows = mask.sum(1) > 0
      if not rows.any():
        continue
      turn_m_mean[t] = m[rows].mean()
      old_logp = logp_at(table)
      first = len(steps)
      table = policy_steps(table, old_logp, (adv_rows * m)[:, None] * discount, mask, epochs)
      per_turn.append(steps[first:])
      if correction:
        m = lref.correction(
          m, logp_at(table), old_logp, mask, correction_clip_low, correction_clip_high
        )
    # The learner reports each turn's mean over its steps, then the mean over the turns.
    steps_mean = {
      name: float(np.mean([np.mean([s[name] for s in turn]) for turn in per_turn]))
      for name in per_turn[0][0]
    }
  else:
    adv_rows = critic_free_advantages(algorithm, rewards, group_ids, row_valid, advantage_clip)
    adv = adv_rows[:, None] * turn_discount(turn_ids, generated, gamma)
    table = policy_steps(table, logp_at(table), adv, generated, epochs)
    v = None
  if algorithm != "seeupo":
    steps_mean = {name: float(np.mean([s[name] for s in steps])) for name in steps[0]}
  steps_mean["optimizer_steps"] = len(steps)
  steps_mean["clip_fraction_max"] = max(s["clip_fraction"] for s in steps)
  return {
    "table": table,
    "critic": v if algorithm == "ppo" else None,
    "metrics": steps_mean,
    "turn_M_mean": turn_m_mean,
    "clip_margin": margin.value,
    "groups_dropped": dropped_groups,
  }
