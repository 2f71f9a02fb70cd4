"""Tests of the multi-turn sampler: `make_continuer` and the `Context` helpers.

A 3-turn episode on a tiny random Qwen3 (float32): turn 1 gives each row its
prompt, turns 2 and 3 its "environment" tokens (different lengths per row,
left-padded, one row with none). Two independent routes check each turn: the
one-shot `make_sampler` on the whole conversation so far (prompt + earlier
samples + new tokens, left-padded) with the same row keys, and teacher-forced
`qwen.token_logprobs` over the final conversation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeupo_jax import sampling
from seeupo_jax import sharding
from seeupo_jax.models import config as model_config_lib
from seeupo_jax.models import qwen

N_NEW = 8
B = 4
NEW_WIDTH = 8  # width of new_ids every turn (each turn uses NEW_WIDTH + N_NEW slots at most)
CAPACITY = 3 * (NEW_WIDTH + N_NEW)
REF_WIDTH = 40  # the whole conversation before turn 3 is at most 7 + 8 + 6 + 8 + 6 = 35 tokens

PROMPTS = [[5, 17, 300, 42, 9, 77, 101], [8, 8, 9], [250, 251, 252, 253, 12], [3, 1, 4, 1, 5, 9]]
ENV_LENGTHS = {2: [3, 6, 1, 5], 3: [2, 0, 6, 4]}  # row 1 gets no new token on turn 3
# Per-row max new tokens: 0 makes the row a passenger for that turn.
LIMITS = {1: [8, 3, 0, 8], 2: [8, 0, 8, 2], 3: [0, 8, 8, 8]}

SAMPLE_CFG = sampling.SamplingConfig(max_new_tokens=N_NEW, temperature=0.7, top_k=40, top_p=0.9)
GREEDY_CFG = sampling.SamplingConfig(max_new_tokens=N_NEW, greedy=True)


def _stop_table():
  """int32[B, 40]: 40 distinct random stop ids per row (about 1 in 13 tokens under uniform)."""
  rng = np.random.default_rng(0)
  return np.stack([rng.choice(512, 40, replace=False) for _ in range(B)]).astype(np.int32)


STOPS = _stop_table()


def _env_tokens(turn):
  rng = np.random.default_rng(turn)
  return [list(rng.integers(0, 500, n)) for n in ENV_LENGTHS[turn]]


def _left_pad(rows, width):
  ids = np.zeros((len(rows), width), np.int32)
  valid = np.zeros((len(rows), width), bool)
  for b, r in enumerate(rows):
    assert len(r) <= width
    if r:
      ids[b, width - len(r) :] = r
      valid[b, width - len(r) :] = True
  return jnp.asarray(ids), jnp.asarray(valid)


@pytest.fixture(scope="module")
def model():
  cfg = model_config_lib.get_preset("qwen3-tiny")
  assert cfg.dtype == "float32"
  params = jax.jit(qwen.init_params, static_argnums=0)(cfg, jax.random.key(0))
  # Sharper than the 0.02 init so that sampled sequences are far from uniform noise.
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
  return cfg, params


@functools.lru_cache(maxsize=None)
def _continuer(cfg, sc):
  return sampling.make_continuer(cfg, sc)


@functools.lru_cache(maxsize=None)
def _sampler(cfg, sc):
  return sampling.make_sampler(cfg, sc)


def _turn_inputs(turn):
  """(new token lists per row, keys [B], limits int32[B]) of one turn."""
  rows = PROMPTS if turn == 1 else _env_tokens(turn)
  keys = jax.random.split(jax.random.key(100 + turn), B)
  return rows, keys, jnp.asarray(LIMITS[turn], jnp.int32)


@dataclasses.dataclass
class Turn:
  new_rows: list  # the new tokens of each row
  keys: jax.Array
  limits: jax.Array
  context_before: sampling.Context
  out: sampling.SampleOutput  # continue_sample's
  context_after: sampling.Context
  ref: sampling.SampleOutput  # make_sampler's on the whole conversation
  sampled_at: list  # per row: index in the conversation of the first token sampled this turn


def _run_episode(model, sc, continue_sample=None, turns=3, reference=True):
  """Runs the episode with continue_sample (and make_sampler on the whole conversation)."""
  cfg, params = model
  continue_sample = continue_sample or _continuer(cfg, sc)
  context = sampling.init_context(cfg, B, CAPACITY)
  conversation = [[] for _ in range(B)]
  stops = jnp.asarray(STOPS)
  record = []
  for turn in range(1, turns + 1):
    rows, keys, limits = _turn_inputs(turn)
    new_ids, new_valid = _left_pad(rows, NEW_WIDTH)
    out, new_context = continue_sample(params, context, new_ids, new_valid, keys, stops, limits)
    for b in range(B):
      conversation[b] += [int(t) for t in rows[b]]
    ref_ids, ref_valid = _left_pad(conversation, REF_WIDTH)
    ref = _sampler(cfg, sc)(params, ref_ids, ref_valid, keys, stops, limits) if reference else None
    sampled_at = [len(c) for c in conversation]
    for b in range(B):
      conversation[b] += [int(t) for t in np.asarray(out.tokens[b, : int(out.lengths[b])])]
    record.append(Turn(rows, keys, limits, context, out, new_context, ref, sampled_at))
    context = new_context
  return record, conversation


@pytest.fixture(scope="module", params=["sample", "greedy"])
def episode(model, request):
  sc = {"sample": SAMPLE_CFG, "greedy": GREEDY_CFG}[request.param]
  record, conversation = _run_episode(model, sc)
  return sc, record, conversation


@functools.partial(jax.jit, static_argnames=("cfg", "temperature"))
def _teacher_forced(params, ids, valid, *, cfg, temperature):
  """logp[b, s] = log p(ids[b, s + 1] | ids[b, :s + 1]) by teacher forcing: f32[B, S - 1]."""
  positions = sampling.prompt_positions(valid)
  return qwen.token_logprobs(
    params,
    ids[:, :-1],
    ids[:, 1:],
    positions[:, :-1],
    valid[:, :-1],
    config=cfg,
    temperature=temperature,
  )


def _assert_same_output(got, want, rows=slice(None)):
  np.testing.assert_array_equal(got.tokens, np.asarray(want.tokens)[rows])
  np.testing.assert_array_equal(got.lengths, np.asarray(want.lengths)[rows])
  np.testing.assert_array_equal(got.mask, np.asarray(want.mask)[rows])
  np.testing.assert_array_equal(got.finish_reason, np.asarray(want.finish_reason)[rows])
  np.testing.assert_allclose(got.logprobs, np.asarray(want.logprobs)[rows], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The episode against its two references.


def test_turns_equal_make_sampler_on_the_whole_conversation(episode):
  _, record, _ = episode
  for turn in record:
    _assert_same_output(turn.out, turn.ref)


def test_logprobs_equal_teacher_forcing_over_the_whole_conversation(model, episode):
  cfg, params = model
  sc, record, conversation = episode
  width = max(len(c) for c in conversation)
  ids, valid = _left_pad(conversation, width)
  logp = np.asarray(_teacher_forced(params, ids, valid, cfg=cfg, temperature=sc.temperature))
  checked = 0
  for turn in record:
    for b in range(B):
      n = int(turn.out.lengths[b])
      start = width - len(conversation[b]) + turn.sampled_at[b]  # slot of the first sample
      # float32 rounding between a cached decode and one full forward: on jax 0.10.2, 1.05e-5
      # at a log-prob of -4.57 (2.3e-6 relative), so the bound is relative as well as absolute.
      np.testing.assert_allclose(
        np.asarray(turn.out.logprobs[b, :n]),
        logp[b, start - 1 : start - 1 + n],
        rtol=1e-5,
        atol=1e-5,
      )
      checked += n
  assert checked >= 30
  # Not a degenerate model: log-probs far from uniform.
  assert max(float(np.max(t.out.logprobs)) for t in record) > np.log(1 / cfg.vocab_size) + 1.0


def test_stops_limits_and_passengers(episode):
  """Finish reasons from the stop table and the limits (NumPy), and a few early stops."""
  _, record, _ = episode
  reasons = []
  for turn in record:
    tokens, lengths = np.asarray(turn.out.tokens), np.asarray(turn.out.lengths)
    for b in range(B):
      n, limit = int(lengths[b]), int(turn.limits[b])
      row = tokens[b, :n]
      is_stop = np.isin(row, STOPS[b])
      if n and is_stop[-1]:
        want_reason = sampling.FinishReason.STOP
        assert not is_stop[:-1].any()
      else:
        want_reason = sampling.FinishReason.LENGTH
        assert n == limit and not is_stop.any()
      assert int(turn.out.finish_reason[b]) == want_reason
      assert np.all(tokens[b, n:] == 0)  # pad_id
      reasons.append((want_reason, n, limit))
  assert any(r == sampling.FinishReason.STOP and n < limit for r, n, limit in reasons)
  assert any(r == sampling.FinishReason.LENGTH and n > 1 for r, n, limit in reasons)
  assert sum(limit == 0 for _, _, limit in reasons) == 3


def test_context_holds_the_conversation(episode):
  """After every turn: pending = the row's last token, lengths = the tokens before it, and
  the cache holds exactly `lengths` valid slots."""
  _, record, _ = episode
  conversation = [[] for _ in range(B)]
  for turn in record:
    for b in range(B):
      conversation[b] += [int(t) for t in turn.new_rows[b]]
      conversation[b] += [int(t) for t in np.asarray(turn.out.tokens[b, : turn.out.lengths[b]])]
    ctx = turn.context_after
    np.testing.assert_array_equal(ctx.pending, [c[-1] for c in conversation])
    np.testing.assert_array_equal(ctx.lengths, [len(c) - 1 for c in conversation])
    np.testing.assert_array_equal(np.asarray(ctx.cache.valid).sum(1), ctx.lengths)
    # Slots used: the prefill (NEW_WIDTH + 1 columns) and one per decode step after the first.
    used = int(ctx.cache.index) - int(turn.context_before.cache.index)
    most = int(np.max(np.asarray(turn.out.lengths)))
    assert used == NEW_WIDTH + 1 + max(most - 1, 0)
    assert used <= sampling.slots_needed(ctx, NEW_WIDTH, int(np.max(np.asarray(turn.limits))))


def test_passenger_with_new_tokens_writes_all_but_the_last(episode):
  """Turn 3, row 0: max 0 new tokens and two new tokens. Its old pending token and its first
  new token enter the cache (the slots it held stay as they were), the last one is pending."""
  _, record, _ = episode
  turn = record[2]
  before, after = turn.context_before, turn.context_after
  assert int(turn.limits[0]) == 0 and len(turn.new_rows[0]) == 2
  assert int(after.pending[0]) == int(turn.new_rows[0][-1])
  assert int(after.lengths[0]) == int(before.lengths[0]) + 2
  old = np.asarray(before.cache.valid[0])
  new = np.asarray(after.cache.valid[0])
  assert new[old].all() and new.sum() == old.sum() + 2
  np.testing.assert_array_equal(
    np.asarray(after.cache.keys[:, 0])[:, :, old], np.asarray(before.cache.keys[:, 0])[:, :, old]
  )


def test_passenger_without_new_tokens_is_unchanged(model):
  """max_new_tokens 0 and no new token: the row's cache slots, lengths and pending stay."""
  cfg, params = model
  continue_sample = _continuer(cfg, GREEDY_CFG)
  context = sampling.init_context(cfg, B, CAPACITY)
  ids, valid = _left_pad(PROMPTS, NEW_WIDTH)
  keys = jax.random.split(jax.random.key(1), B)
  _, context = continue_sample(params, context, ids, valid, keys)
  ids2, valid2 = _left_pad([[7, 7], [], [9], []], NEW_WIDTH)
  limits = jnp.asarray([N_NEW, 0, N_NEW, 0], jnp.int32)
  out, after = continue_sample(params, context, ids2, valid2, keys, None, limits)
  np.testing.assert_array_equal(np.asarray(out.lengths), [N_NEW, 0, N_NEW, 0])
  for b in (1, 3):
    assert int(after.pending[b]) == int(context.pending[b]) >= 0
    assert int(after.lengths[b]) == int(context.lengths[b])
    t = context.cache.valid.shape[1]
    np.testing.assert_array_equal(after.cache.valid[b], context.cache.valid[b])
    assert not np.asarray(after.cache.valid[b, int(context.cache.index) : t]).any()
  # A row with no valid token at all (fresh context, nothing given) samples nothing.
  empty = sampling.init_context(cfg, B, CAPACITY)
  out, after = continue_sample(params, empty, ids2, valid2, keys)
  np.testing.assert_array_equal(np.asarray(out.lengths), [N_NEW, 0, N_NEW, 0])
  np.testing.assert_array_equal(after.pending[jnp.array([1, 3])], -1)
  np.testing.assert_array_equal(after.lengths[jnp.array([1, 3])], 0)


# ---------------------------------------------------------------------------------------------
# Context helpers.


def test_compact_then_continue_equals_continue(model, episode):
  cfg, params = model
  sc, record, _ = episode
  turn = record[2]
  compact = sampling.compact_context(turn.context_before)
  # Layout: each row's valid slots first, in order; index = the most valid slots of a row.
  before = np.asarray(turn.context_before.cache.valid)
  counts = before.sum(1)
  np.testing.assert_array_equal(
    np.asarray(compact.cache.valid), np.arange(CAPACITY)[None] < counts[:, None]
  )
  assert int(compact.cache.index) == counts.max() < int(turn.context_before.cache.index)
  for b in range(B):
    np.testing.assert_array_equal(
      np.asarray(compact.cache.keys)[:, b, :, : counts[b]],
      np.asarray(turn.context_before.cache.keys)[:, b][:, :, before[b]],
    )
  new_ids, new_valid = _left_pad(turn.new_rows, NEW_WIDTH)
  out, after = _continuer(cfg, sc)(
    params, compact, new_ids, new_valid, turn.keys, jnp.asarray(STOPS), turn.limits
  )
  _assert_same_output(out, turn.out)
  np.testing.assert_array_equal(after.pending, turn.context_after.pending)
  np.testing.assert_array_equal(after.lengths, turn.context_after.lengths)


def test_room_check_and_slots_needed(model):
  cfg, params = model
  context = sampling.init_context(cfg, B, 20)
  assert sampling.slots_needed(context, NEW_WIDTH, N_NEW) == NEW_WIDTH + N_NEW
  assert sampling.slots_needed(context, 3, 0) == 4  # the prefill still writes the pending column
  continue_sample = _continuer(cfg, GREEDY_CFG)
  ids, valid = _left_pad(PROMPTS, NEW_WIDTH)
  keys = jax.random.split(jax.random.key(0), B)
  context = context.replace(cache=context.cache.replace(index=jnp.int32(5)))
  with pytest.raises(ValueError, match="compact_context"):
    continue_sample(params, context, ids, valid, keys)  # 5 + 16 > 20: refused before tracing
  with pytest.raises(ValueError, match="compact_context"):  # limits bound the need
    continue_sample(params, context, ids, valid, keys, None, jnp.full((B,), 8, jnp.int32))


def test_take_rows_then_continue_equals_the_full_batch(model):
  cfg, params = model
  record, _ = _run_episode(model, SAMPLE_CFG, turns=2, reference=False)
  rows = jnp.asarray([2, 0], jnp.int32)  # drop rows 1 and 3, reorder the rest
  turn3_rows, keys, limits = _turn_inputs(3)
  limits = jnp.full((B,), N_NEW, jnp.int32)
  stops = jnp.asarray(STOPS)
  new_ids, new_valid = _left_pad(turn3_rows, NEW_WIDTH)
  continue_sample = _continuer(cfg, SAMPLE_CFG)
  full, full_after = continue_sample(
    params, record[-1].context_after, new_ids, new_valid, keys, stops, limits
  )
  small = sampling.take_context_rows(record[-1].context_after, rows)
  assert small.cache.keys.shape[1] == 2 and int(small.cache.index) == int(
    record[-1].context_after.cache.index
  )
  out, after = continue_sample(
    params, small, new_ids[rows], new_valid[rows], keys[rows], stops[rows], limits[rows]
  )
  _assert_same_output(out, full, rows=np.asarray(rows))
  np.testing.assert_array_equal(after.pending, np.asarray(full_after.pending)[np.asarray(rows)])
  np.testing.assert_array_equal(after.lengths, np.asarray(full_after.lengths)[np.asarray(rows)])


# ---------------------------------------------------------------------------------------------
# Chunked prefill and sharding.


@pytest.mark.slow
def test_chunked_prefill_continues_the_same(model):
  """Chunks of 3 (each call prefills 9 columns: 3 chunks; turn widths not multiples of 3 would
  add a shorter tail chunk, tested by chunks of 4: 2 chunks + a tail of 1); the same tokens,
  and the same slots used as without chunks."""
  want, _ = _run_episode(model, SAMPLE_CFG, turns=2, reference=False)
  for chunk in (3, 4):
    sc = dataclasses.replace(SAMPLE_CFG, prefill_chunk_size=chunk)
    got, _ = _run_episode(model, sc, turns=2, reference=False)
    for g, w in zip(got, want):
      _assert_same_output(g.out, w.out)
      assert int(g.context_after.cache.index) == int(w.context_after.cache.index)
      np.testing.assert_array_equal(g.context_after.cache.valid, w.context_after.cache.valid)


@pytest.mark.slow
def test_sharded_equals_unsharded(model):
  cfg, params = model
  assert jax.device_count() == 8, "conftest provides 8 simulated CPU devices"
  want, _ = _run_episode(model, SAMPLE_CFG, turns=2, reference=False)

  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = (cfg, jax.device_put(params, sharding.param_shardings(params, mesh)))
  continue_sample = sampling.make_continuer(
    cfg, SAMPLE_CFG, cache_sharding=functools.partial(sharding.cache_shardings, mesh=mesh)
  )
  with jax.set_mesh(mesh):
    got, _ = _run_episode(
      sharded, SAMPLE_CFG, continue_sample=continue_sample, turns=2, reference=False
    )
  assert len(sharded[1]["embed"]["embedding"].sharding.device_set) == 8
  keys_sharding = got[-1].context_after.cache.keys.sharding
  assert len(keys_sharding.device_set) == 8 and not keys_sharding.is_fully_replicated
  for g, w in zip(got, want):
    _assert_same_output(g.out, w.out)
    np.testing.assert_array_equal(g.context_after.pending, w.context_after.pending)
