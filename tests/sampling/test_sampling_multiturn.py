"""Tests of multi-turn sampling: `sampling.SamplerSession` over the paged KV cache.

A session is driven the way the rollout engine drives it: a row is given a prompt, prefill /
decode run until its `Reply` comes back, the row is given an observation (its reply's last
token goes in front of it), ..., and released when its conversation ends (a released row may
start a new conversation). On a tiny random Qwen3 (float32), one episode of 4 rows plays 5
conversations of very different lengths (up to the 59-token context, and under 20) and 1 to 3
turns each, with no padding between rows (each row writes at its own positions):

  BATCH  4 rows, prefill_chunk 32 (the 40-token prompt takes two prefill calls), a pool of 9
         pages that doubles mid-episode (after pages were written);
  SOLO   1 row, prefill_chunk 64 (every input in one call), a pool that never grows: every
         conversation replayed alone in a fresh session with the same reply keys.

Checks: the replies' log-probs equal the teacher-forced log-probs of the (top-k/top-p filtered)
distribution sampled from over each whole conversation; the batch's replies equal the solo ones (tokens equal, log-probs within 1e-5:
independent of the batch, the row index, the prefill chunking, the pool growth, and of a
row's earlier, released conversation); page accounting at every call; stop / limit / finish
reasons; the session's errors. The programs are module-level jits keyed by the configs and
shapes: the geometry below is chosen so that the whole file compiles a handful of them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sampling_reference

from seeupo_jax import sampling
from seeupo_jax.models import qwen
import tiny

N_NEW = 8
MAX_CONTEXT = 59
PAGE = 8
K = 4  # decode steps per sync
STOP_IDS = tuple(int(t) for t in np.random.default_rng(0).choice(512, 40, replace=False))
SAMPLE_CFG = sampling.SamplingConfig(
  max_new_tokens=N_NEW, temperature=0.7, top_k=40, top_p=0.9, stop_token_ids=STOP_IDS
)
# One page-table width (the most pages a row can need) and one prefill shape per session.
BATCH = sampling.SessionConfig(
  rows=4,
  max_context_tokens=MAX_CONTEXT,
  page_size=PAGE,
  prefill_chunk=32,
  prefill_rows=4,
  decode_steps_per_sync=K,
  initial_pages=9,  # the first prefill's 8 pages; row 0's 5th page doubles the pool
)
# A pool that holds one row, a wider prefill.
SOLO = sampling.SessionConfig(
  rows=1,
  max_context_tokens=MAX_CONTEXT,
  page_size=PAGE,
  prefill_chunk=64,
  prefill_rows=1,
  decode_steps_per_sync=K,
  initial_pages=9,
)


def _tokens(seed, n):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 500, n)]


def _key(conversation, turn):
  return np.array([1000 + conversation, turn], np.uint32)


# Conversations: a list of turns (new tokens, reply key, reply limit). Lengths in tokens at most
# (prompt + replies + observations): c0 59 (the max context), c1 18, c2a 20, c2b 19, c3 19.
CONVERSATIONS = {
  "c0": [(_tokens(1, 40), _key(0, 0), 8), (_tokens(2, 3), _key(0, 1), 6), ([], _key(0, 2), 2)],
  "c1": [(_tokens(3, 3), _key(1, 0), 3), (_tokens(4, 5), _key(1, 1), 4), ([], _key(1, 2), 3)],
  "c2a": [(_tokens(5, 12), _key(2, 0), 8)],
  "c2b": [(_tokens(6, 5), _key(3, 0), 6), (_tokens(7, 4), _key(3, 1), 4)],
  "c3": [
    (_tokens(8, 1), _key(4, 0), 5),
    (_tokens(9, 1), _key(4, 1), 5),
    (_tokens(10, 2), _key(4, 2), 5),
  ],
}
# Row -> its conversations in order (row 2 is released after c2a and starts c2b).
ROWS = {0: ["c0"], 1: ["c1"], 2: ["c2a", "c2b"], 3: ["c3"]}


@pytest.fixture(scope="module")
def model():
  cfg = tiny.model_config()
  assert cfg.dtype == "float32"
  params = jax.jit(qwen.init_params, static_argnums=0)(cfg, jax.random.key(0))
  # Sharper than the 0.02 init so that sampled sequences are far from uniform noise.
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim >= 2 else x, params)
  return cfg, params


@dataclasses.dataclass
class Played:
  session: sampling.SamplerSession
  replies: dict  # conversation name -> [Reply] per turn
  conversations: dict  # conversation name -> all its tokens (given and sampled), in order
  calls: list  # per prefill / decode call: (kind, cache_slots, live_tokens, pool_pages, n)
  # n: tokens written (prefill) or replies returned (decode)


def play(session, params, rows, release_last=False):
  """Drives `session` like the rollout engine: each row plays its conversations in order,
  one turn given as soon as the previous reply arrived, released between conversations."""
  played = Played(session, {}, {}, [])
  todo = {r: [(name, 0) for name in names] for r, names in rows.items()}

  def feed(r):
    while todo[r]:
      name, turn = todo[r][0]
      turns = CONVERSATIONS[name]
      if turn < len(turns):
        ids, key, limit = turns[turn]
        session.give(r, ids, key, limit)
        played.conversations.setdefault(name, []).extend(ids)
        played.replies.setdefault(name, [])
        return
      todo[r].pop(0)
      if todo[r] or release_last:
        session.release(r)

  def note(kind, n):
    slots, live = session.cache_slots, session.live_tokens
    played.calls.append((kind, slots, live, session.stats.pool_pages, n))
    # Pages cover the rows' tokens, with at most a page's rest + one decode call's room each.
    assert live <= slots <= live + session.config.rows * (PAGE + K), played.calls[-1]

  for r in rows:
    feed(r)
  while session.busy:
    note("prefill", session.prefill(params))
    replies = session.decode(params)
    for reply in replies:
      name, turn = todo[reply.row][0]
      played.replies[name].append(reply)
      played.conversations[name].extend(int(t) for t in reply.tokens)
      todo[reply.row][0] = (name, turn + 1)
      feed(reply.row)
    note("decode", len(replies))
  return played


@pytest.fixture(scope="module")
def batch(model):
  cfg, params = model
  return play(sampling.SamplerSession(cfg, SAMPLE_CFG, BATCH), params, ROWS)


@pytest.fixture(scope="module")
def solo(model):
  """Every conversation alone in a fresh 1-row session (the programs are shared)."""
  cfg, params = model
  out = {}
  for name in CONVERSATIONS:
    out[name] = play(sampling.SamplerSession(cfg, SAMPLE_CFG, SOLO), params, {0: [name]})
  return out


@jax.jit
def _teacher_forced_logits(params, ids, valid):
  """logits[b, s]: the next-token logits after ids[b, :s + 1], from one full forward pass:
  f32[B, S - 1, V]."""
  cfg = tiny.model_config()
  positions = sampling.prompt_positions(valid)
  logits, _ = qwen.forward(params, ids[:, :-1], positions[:, :-1], valid[:, :-1], config=cfg)
  return logits


def _teacher_forced(params, ids, valid):
  """logp[b, s] = log p(ids[b, s + 1] | ids[b, :s + 1]) by teacher forcing, under the filtered
  distribution the sampler draws from (the float64 reference
  `sampling_reference.sampled_logprobs` with SAMPLE_CFG's temperature, top-k and top-p):
  f64[B, S - 1]."""
  return sampling_reference.sampled_logprobs(
    np.asarray(_teacher_forced_logits(params, ids, valid)),
    np.asarray(ids)[:, 1:],
    temperature=SAMPLE_CFG.temperature,
    top_k=SAMPLE_CFG.top_k,
    top_p=SAMPLE_CFG.top_p,
  )


# ---------------------------------------------------------------------------------------------
# The episode against teacher forcing and against each conversation played alone.


def test_logprobs_equal_teacher_forcing_over_the_whole_conversation(model, batch):
  cfg, params = model
  names = list(CONVERSATIONS)
  width = 64
  ids = np.zeros((len(names), width), np.int32)
  valid = np.zeros((len(names), width), bool)
  for b, name in enumerate(names):
    conv = batch.conversations[name]
    ids[b, : len(conv)], valid[b, : len(conv)] = conv, True
  logp = np.asarray(_teacher_forced(params, jnp.asarray(ids), jnp.asarray(valid)))
  checked = 0
  for b, name in enumerate(names):
    start = 0  # slot of the reply's first token in the conversation
    for (new, _, _), reply in zip(CONVERSATIONS[name], batch.replies[name]):
      start += len(new)
      n = len(reply.tokens)
      np.testing.assert_array_equal(reply.tokens, ids[b, start : start + n])
      # float32 rounding between a paged decode and one full forward: the bound is relative
      # as well as absolute (on jax 0.10.2, 1.05e-5 at a log-prob of -4.57 was seen).
      np.testing.assert_allclose(
        reply.logprobs, logp[b, start - 1 : start - 1 + n], rtol=1e-5, atol=1e-5, err_msg=name
      )
      start += n
      checked += n
    assert start == len(batch.conversations[name])
  assert checked >= 40
  # Not a degenerate model: log-probs far from uniform.
  best = max(float(np.max(r.logprobs)) for rs in batch.replies.values() for r in rs)
  assert best > np.log(1 / cfg.vocab_size) + 1.0


def test_rows_equal_the_conversation_played_alone(batch, solo):
  """Determinism independent of the batch: rows of 59 and 9 tokens side by side, row 2's
  second conversation after its first was released, the same replies as in a 1-row session
  with the same keys (tokens equal, log-probs within 1e-5)."""
  for name in CONVERSATIONS:
    got, want = batch.replies[name], solo[name].replies[name]
    assert len(got) == len(want) == len(CONVERSATIONS[name])
    for turn, (g, w) in enumerate(zip(got, want)):
      np.testing.assert_array_equal(g.tokens, w.tokens, err_msg=f"{name} turn {turn}")
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, err_msg=f"{name} turn {turn}")
      assert g.finish_reason == w.finish_reason
    assert batch.conversations[name] == solo[name].conversations[name]
  # Row indices differ: the batch ran c1 in row 1, c3 in row 3, c2b in row 2; solo in row 0.
  assert {r.row for r in batch.replies["c3"]} == {3} and solo["c3"].replies["c3"][0].row == 0
  lengths = [len(batch.conversations[n]) for n in CONVERSATIONS]
  assert max(lengths) >= 50 and min(lengths) <= 20


def test_long_input_over_several_prefill_calls_equals_one_call(batch, solo):
  """c0's 40-token prompt: two prefill calls of the batch (chunk 32; the other rows decode
  between them), one call alone (chunk 64); the replies are equal (previous test). Every
  token is written once: the given ones, and each reply's last token in front of the next
  turn's."""
  prompts = [len(CONVERSATIONS[name][0][0]) for name in ("c0", "c1", "c2a", "c3")]
  assert prompts[0] > BATCH.prefill_chunk >= max(prompts[1:])
  # The first call wrote 32 of c0's 40 tokens and the other prompts whole; the other rows
  # decoded before the rest of c0 was written.
  assert batch.calls[0][::4] == ("prefill", BATCH.prefill_chunk + sum(prompts[1:]))
  assert batch.calls[1][0] == "decode" and batch.calls[2][0] == "prefill"
  assert solo["c0"].calls[0][::4] == ("prefill", prompts[0])
  want = sum(len(ids) for turns in CONVERSATIONS.values() for ids, _, _ in turns)
  want += sum(len(turns) - 1 for turns in CONVERSATIONS.values())
  assert batch.session.stats.prefill_tokens == want
  assert sum(p.session.stats.prefill_tokens for p in solo.values()) == want


def test_pool_growth_keeps_the_written_pages(batch, solo):
  """The batch's pool doubled (9 -> 18 pages) after pages had been written and read (a
  prefill and a decode ran at 9); its replies still equal the solo ones (which never grew)."""
  pools = [call[3] for call in batch.calls]
  assert pools[0] == pools[1] == BATCH.initial_pages
  assert pools[-1] == 2 * BATCH.initial_pages and batch.session.rows.cache.num_pages == pools[-1]
  assert all(p.calls[-1][3] == SOLO.initial_pages for p in solo.values())


def test_stops_limits_and_finish_reasons(batch):
  reasons = []
  for name, replies in batch.replies.items():
    for (_, _, limit), reply in zip(CONVERSATIONS[name], replies):
      n = len(reply.tokens)
      assert 1 <= n <= limit and reply.logprobs.shape == (n,)
      is_stop = np.isin(reply.tokens, STOP_IDS)
      assert not is_stop[:-1].any()
      if is_stop[-1]:
        assert reply.finish_reason == sampling.FinishReason.STOP
      else:
        assert reply.finish_reason == sampling.FinishReason.LENGTH and n == limit
      reasons.append((reply.finish_reason, n, limit))
  assert any(r == sampling.FinishReason.STOP and n < limit for r, n, limit in reasons)
  assert any(r == sampling.FinishReason.LENGTH and n > 1 for r, n, limit in reasons)


def test_held_tokens_are_the_conversations(batch):
  """At the end of the episode (before the tests above changed it) each row held its last
  conversation but its pending last token."""
  kind, slots, live, _, _ = batch.calls[-1]
  last = [names[-1] for names in ROWS.values()]
  assert kind == "decode"
  assert live == sum(len(batch.conversations[n]) - 1 for n in last)


def test_errors():
  cfg = tiny.model_config()
  session = sampling.SamplerSession(cfg, SAMPLE_CFG, BATCH)
  key = _key(0, 0)
  with pytest.raises(ValueError, match=r"limit must be in \[1, 8\], got 0"):
    session.give(0, [1, 2], key, 0)
  with pytest.raises(ValueError, match=r"limit must be in \[1, 8\], got 9"):
    session.give(0, [1, 2], key, N_NEW + 1)
  with pytest.raises(ValueError, match="row 1 was given no token to continue from"):
    session.give(1, [], key, 1)
  with pytest.raises(ValueError, match=r"row 0: 0 tokens \+ 52 new \+ a reply of 8 exceed "):
    session.give(0, [1] * 52, key, 8)
  session.give(0, [1] * 51, key, 8)  # 51 + 8 = 59 fits
  with pytest.raises(ValueError, match="row 0 still owes a reply"):
    session.give(0, [3], key, 1)
  session.release(0)  # a queued input is dropped with the row
  assert not session.busy
  session.give(0, [3], key, 1)
  with pytest.raises(TypeError, match="SessionConfig"):
    sampling.SamplerSession(cfg, SAMPLE_CFG, {"rows": 4})
  with pytest.raises(ValueError, match="SessionConfig.page_size=0; allowed: an int >= 1"):
    dataclasses.replace(BATCH, page_size=0)
  with pytest.raises(
    ValueError, match="SessionConfig.initial_pages=1; allowed: None or an int >= 2"
  ):
    dataclasses.replace(BATCH, initial_pages=1)


def test_owes_a_reply_while_decoding_and_overflow_counts_the_pending_token(model, batch):
  """On the played batch (it runs after the tests that read it: it changes the session). A
  row whose reply has begun on device refuses tokens; a row's context counts its pending
  last token."""
  cfg, params = model
  session = batch.session
  held = len(batch.conversations["c0"])  # the cache holds held - 1 tokens, pending 1 more
  room = MAX_CONTEXT - held
  with pytest.raises(ValueError, match=rf"row 0: {held - 1} tokens \+ {room + 1} new \+ a reply"):
    session.give(0, [7] * room, _key(9, 0), 1)
  session.release(2)  # its pages make room for row 1's (the pool stays at 18 pages)
  session.give(1, [7] * 5, _key(9, 1), 1)
  assert session.prefill(params) == 6  # the pending token and the 5 new ones
  with pytest.raises(ValueError, match="row 1 still owes a reply"):
    session.give(1, [7], _key(9, 2), 1)
  (reply,) = session.decode(params)  # it ended on its first token, in the prefill
  assert reply.row == 1 and len(reply.tokens) == 1
  assert session.stats.pool_pages == 2 * BATCH.initial_pages
  held = len(batch.conversations["c1"]) + 5 + 1  # the cache holds held - 1, pending 1
  with pytest.raises(ValueError, match="exceed max_context_tokens=59"):
    session.give(1, [7] * (MAX_CONTEXT - held), _key(9, 3), 1)
  session.give(1, [7] * (MAX_CONTEXT - held - 1), _key(9, 3), 1)  # fits exactly
  session.release(1)


def test_page_accounting_and_release(batch):
  """Runs after the episode: the rows hold their conversations (but the pending last token),
  and releasing every row frees every page (page 0 is the scratch page)."""
  session = batch.session
  pool = session.stats.pool_pages
  assert pool == session.rows.cache.num_pages
  live = session.live_tokens
  assert live <= session.cache_slots <= live + BATCH.rows * (PAGE + K)
  peak = session.stats.peak_cache_slots
  assert session.stats.live_tokens_at_peak <= peak <= pool * PAGE
  for r in range(BATCH.rows):
    session.release(r)
  assert session.cache_slots == 0 and session.live_tokens == 0 and not session.busy
  assert sorted(session._free) == list(range(1, pool))  # every page but the scratch page


@pytest.mark.fresh_compiles
def test_no_decode_step_copies_a_layer_s_page_pool(model):
  """The decode program reads a layer's cache only block by block, gathered from the stacked
  pools: no instruction of the compiled program produces one layer's whole pool (a slice of it
  is a copy, every layer of every step: the step's cost then grows with the pool, used or not).
  The stacked pools themselves appear (the program's inputs and the in-place scatter)."""
  cfg, params = model
  pages = 37  # a pool size that no other dimension of the program has
  session = sampling.SamplerSession(
    cfg, SAMPLE_CFG, dataclasses.replace(BATCH, initial_pages=pages)
  )
  session.give(0, _tokens(11, 5), _key(9, 0), 4)
  session.prefill(params)
  session.rows = jax.block_until_ready(session.rows)
  hlo = (
    sampling._decode_jit.lower(
      params,
      session.rows,
      session.page_table(),
      num_steps=K,
      model_config=session.model_config,
      sampling_config=SAMPLE_CFG,
      cache_sharding=None,
    )
    .compile()
    .as_text()
  )
  kv, hd = cfg.num_kv_heads, cfg.head_dim
  one_layer = f"[{pages},{kv},{PAGE},{hd}]"
  stacked = f"[{cfg.num_layers},{pages},{kv},{PAGE},{hd}]"
  assert stacked in hlo
  producers = [
    line.strip()[:160]
    for line in hlo.splitlines()
    if "=" in line and one_layer in line.split("=", 1)[1].split("(", 1)[0]
  ]
  assert producers == [], producers


def test_a_row_s_prefill_width_follows_from_its_own_chunk(model):
  """Prefill calls come in the widths C/8, C/4, C/2, C (those >= 8); a row's chunk goes in
  the smallest that holds it, whatever else arrives with it (its numbers cannot depend on
  that)."""
  cfg, params = model
  assert sampling.prefill_widths(64) == (8, 16, 32, 64)
  assert sampling.prefill_widths(256) == (32, 64, 128, 256)
  assert sampling.prefill_widths(32) == (8, 16, 32)  # 4 is below 8
  assert sampling.prefill_widths(8) == (8,)
  config = dataclasses.replace(
    BATCH, rows=8, max_context_tokens=80, prefill_chunk=64, prefill_rows=2, initial_pages=80
  )
  session = sampling.SamplerSession(cfg, SAMPLE_CFG, config)
  lengths = {0: 3, 1: 8, 2: 9, 3: 16, 4: 17, 5: 50, 6: 44, 7: 33}
  for row, n in lengths.items():
    session.give(row, _tokens(20 + row, n), _key(20 + row, 0), 4)
  session.prefill(params)
  calls = [
    (call.ids.shape[1], sorted(int(r) for r in call.row_ids if r < 8))
    for call in session.staged_prefills
  ]
  # Width 8: rows 0, 1 (3 and 8 tokens); 16: rows 2, 3 (9, 16); 32: row 4 (17); 64: rows 5, 6,
  # 7 (50, 44, 33), 2 rows a call.
  assert calls == [(8, [0, 1]), (16, [2, 3]), (32, [4]), (64, [5, 6]), (64, [7])]
  for call in session.staged_prefills:  # each row's tokens in its call, in order, the rest padding
    width = call.ids.shape[1]
    for i, row in enumerate(call.row_ids):
      if row < 8:
        n = lengths[int(row)]
        assert call.ids[i, :n].tolist() == _tokens(20 + int(row), n) and call.valid[i].sum() == n
        assert width >= n
  # A longer input: chunks of C, the last in the width that holds what is left (70 = 64 + 6).
  session = sampling.SamplerSession(cfg, SAMPLE_CFG, config)
  session.give(0, _tokens(30, 70), _key(30, 0), 4)
  session.prefill(params)
  session.prefill(params)
  staged = session.staged_prefills
  assert [(c.ids.shape[1], int(c.valid[0].sum())) for c in staged] == [(64, 64), (8, 6)]
