"""Independent NumPy (float64, explicit loops) references for `seeupo_jax.losses`.

Written from the paper's formulas, not from the JAX code:
plain Python loops over rows, groups and tokens.
"""

import collections
import math

import numpy as np

LIMIT = 20.0


def aggregate(values, mask, mode, norm_length=None):
  """norm_length: the constant C of seq-mean-token-sum-norm (None: the padded length L)."""
  values, mask = np.asarray(values, np.float64), np.asarray(mask, np.float64)
  if mode == "token-mean":
    total = mask.sum()
    return 0.0 if total == 0 else float((values * mask).sum() / total)
  row_values = []
  for v, m in zip(values, mask):
    n = m.sum()
    if n == 0:
      continue
    s = float((v * m).sum())
    if mode == "seq-mean-token-mean":
      s /= n
    elif mode == "seq-mean-token-sum-norm":
      s /= values.shape[-1] if norm_length is None else norm_length
    row_values.append(s)
  return float(np.mean(row_values)) if row_values else 0.0


def _unbiased_std(xs):
  xs = np.asarray(xs, np.float64)
  if len(xs) < 2:
    return float("nan")
  return math.sqrt(((xs - xs.mean()) ** 2).sum() / (len(xs) - 1))


def grae(rewards, group_ids, *, group_std=False, batch_norm=True, clip=3.0, valid=None, eps=1e-6):
  rewards = np.asarray(rewards, np.float64)
  n = len(rewards)
  valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
  adv = np.zeros(n)
  for i in range(n):
    if not valid[i]:
      continue
    members = [j for j in range(n) if valid[j] and group_ids[j] == group_ids[i]]
    if len(members) < 2:
      continue
    group = rewards[members]
    adv[i] = rewards[i] - group.mean()
    if group_std:
      adv[i] /= _unbiased_std(group) + eps
  if batch_norm:
    idx = [i for i in range(n) if valid[i]]
    if idx:
      mean = adv[idx].mean()
      std = _unbiased_std(adv[idx]) if len(idx) > 1 else 0.0
      for i in idx:
        adv[i] = (adv[i] - mean) / std if std > 1e-6 else adv[i] - mean
  if clip is not None:
    adv = np.clip(adv, -clip, clip)
  adv[~valid] = 0.0
  return adv


def rloo(rewards, group_ids, valid=None):
  rewards = np.asarray(rewards, np.float64)
  n = len(rewards)
  valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
  adv = np.zeros(n)
  for i in range(n):
    if not valid[i]:
      continue
    others = [rewards[j] for j in range(n) if j != i and valid[j] and group_ids[j] == group_ids[i]]
    if others:
      adv[i] = rewards[i] - np.mean(others)
  return adv


def gae(token_rewards, values, mask, gamma, lam):
  token_rewards, values, mask = (np.asarray(a, np.float64) for a in (token_rewards, values, mask))
  adv = np.zeros_like(values)
  for b in range(values.shape[0]):
    positions = [t for t in range(values.shape[1]) if mask[b, t] > 0]
    next_value, next_adv = 0.0, 0.0
    for t in reversed(positions):
      delta = token_rewards[b, t] + gamma * next_value - values[b, t]
      adv[b, t] = delta + gamma * lam * next_adv
      next_value, next_adv = values[b, t], adv[b, t]
  return adv, (adv + values) * mask


def seq_log_ratio(logp, old_logp, mask):
  out = []
  for lp, olp, m in zip(
    np.asarray(logp, np.float64), np.asarray(old_logp, np.float64), np.asarray(mask, np.float64)
  ):
    n = m.sum()
    out.append(0.0 if n == 0 else float(((lp - olp) * m).sum() / n))
  return np.array(out)


def _surrogate(ratio, adv, lo, hi, dual_clip):
  loss = max(-adv * ratio, -adv * min(max(ratio, 1 - lo), 1 + hi))
  if dual_clip is not None and adv < 0:
    loss = min(loss, -adv * dual_clip)
  return loss


def token_clip_loss(
  logp,
  old_logp,
  adv,
  mask,
  lo=0.2,
  hi=0.2,
  dual_clip=None,
  agg="seq-mean-token-mean",
  norm_length=None,
):
  logp, old_logp, mask = (np.asarray(a, np.float64) for a in (logp, old_logp, mask))
  adv = np.asarray(adv, np.float64)
  if adv.ndim == 1:
    adv = np.repeat(adv[:, None], logp.shape[1], axis=1)
  per_token = np.zeros_like(logp)
  for b in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      ratio = math.exp(min(max(logp[b, t] - old_logp[b, t], -LIMIT), LIMIT))
      per_token[b, t] = _surrogate(ratio, adv[b, t], lo, hi, dual_clip)
  return aggregate(per_token, mask, agg, norm_length)


def sequence_clip_loss(logp, old_logp, adv, mask, lo=0.2, hi=0.2, dual_clip=None):
  """GSPO with one advantage per row, seq-mean aggregation (the paper's form)."""
  s_log = seq_log_ratio(logp, old_logp, mask)
  mask = np.asarray(mask, np.float64)
  rows = []
  for b in range(len(s_log)):
    if mask[b].sum() == 0:
      continue
    s = math.exp(min(max(s_log[b], -LIMIT), LIMIT))
    rows.append(_surrogate(s, float(adv[b]), lo, hi, dual_clip))
  return float(np.mean(rows)) if rows else 0.0


def kl(logp, ref_logp, kind):
  logp, ref_logp = np.asarray(logp, np.float64), np.asarray(ref_logp, np.float64)
  if kind == "k1":
    return logp - ref_logp
  if kind == "k2":
    return 0.5 * (logp - ref_logp) ** 2
  d = np.clip(ref_logp - logp, -20, 20)
  return np.clip(np.exp(d) - d - 1, -10, 10)


def value_loss(values, old_values, returns, mask, clip=None):
  values, old_values, returns = (np.asarray(a, np.float64) for a in (values, old_values, returns))
  per = 0.5 * (values - returns) ** 2
  if clip is not None:
    vc = old_values + np.clip(values - old_values, -clip, clip)
    per = np.maximum(per, 0.5 * (vc - returns) ** 2)
  return aggregate(per, mask, "token-mean")


def correction(m, new_logp, old_logp, mask, lo=0.2, hi=0.2):
  s_log = seq_log_ratio(new_logp, old_logp, mask)
  mask = np.asarray(mask, np.float64)
  out = np.array(m, np.float64, copy=True)
  for b in range(len(out)):
    if mask[b].sum() == 0:
      continue
    rho = min(max(math.exp(min(max(s_log[b], -LIMIT), LIMIT)), 1 - lo), 1 + hi)
    out[b] = min(max(out[b] * rho, 1 - lo), 1 + hi)
  return out


def _norm(values, group_std):
  """{key: values} -> f(key, v): v minus its group's mean [/ (unbiased std + 1e-6)]; 0 in a
  group of one."""
  stats = {}
  for key, vs in values.items():
    vs = np.asarray(vs, np.float64)
    std = vs.std(ddof=1) if len(vs) > 1 else 0.0
    stats[key] = (vs.mean(), std, len(vs))

  def f(key, v):
    mean, std, n = stats[key]
    if n < 2:
      return 0.0
    return (v - mean) / (std + 1e-6) if group_std else v - mean

  return f


def gigpo(rewards, groups, keys, turn_valid, valid, gamma, omega, group_std):
  """GiGPO's advantages [B, T] (arXiv 2505.10978): episode term + omega * anchor-state term."""
  b, t = turn_valid.shape
  turn_valid = turn_valid & valid[:, None]
  by_group = collections.defaultdict(list)
  for i in range(b):
    if valid[i]:
      by_group[groups[i]].append(rewards[i])
  episode = _norm(by_group, group_std)
  returns, by_state = {}, collections.defaultdict(list)
  for i in range(b):
    n_turns = int(turn_valid[i].sum())
    for u in range(t):
      if turn_valid[i, u]:
        returns[i, u] = gamma ** (n_turns - 1 - u) * rewards[i]
        if keys[i, u] >= 0:
          by_state[groups[i], keys[i, u]].append(returns[i, u])
  step = _norm(by_state, group_std)
  out = np.zeros((b, t))
  for i in range(b):
    for u in range(t):
      if turn_valid[i, u]:
        s = step((groups[i], keys[i, u]), returns[i, u]) if keys[i, u] >= 0 else 0.0
        out[i, u] = episode(groups[i], rewards[i]) + omega * s
  return out


def mt_grpo(rewards, turn_rewards, groups, turn_valid, valid, lam, group_std):
  """MT-GRPO's advantages [B, T] (arXiv 2505.11821): normalised turn rewards to go + lam * the
  outcome's."""
  b, t = turn_valid.shape
  turn_valid = turn_valid & valid[:, None]
  by_group, by_turn = collections.defaultdict(list), collections.defaultdict(list)
  for i in range(b):
    if valid[i]:
      by_group[groups[i]].append(rewards[i])
    for k in range(t):
      if turn_valid[i, k]:
        by_turn[groups[i], k].append(turn_rewards[i, k])
  outcome, per_turn = _norm(by_group, group_std), _norm(by_turn, group_std)
  out = np.zeros((b, t))
  for i in range(b):
    n_turns = int(turn_valid[i].sum())
    for u in range(n_turns):
      to_go = sum(per_turn((groups[i], k), turn_rewards[i, k]) for k in range(u, n_turns))
      out[i, u] = to_go + lam * outcome(groups[i], rewards[i])
  return out
