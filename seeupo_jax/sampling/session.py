"""The host session: a decode batch of rows that episodes join and leave (slots, the page pool,
prefill staging and widths, reply collection), over the compiled programs of `programs.py`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from seeupo_jax.models import qwen
from seeupo_jax.models.config import ModelConfig
from seeupo_jax.sampling.config import SamplingConfig, SessionConfig
from seeupo_jax.sampling.programs import PrefillCall, _decode_jit, _grow_jit, _prefill_jit
from seeupo_jax.sampling.steps import (
  DecodeRows,
  FinishReason,
  _check_configs,
  constrain_cache,
  init_rows,
)


@dataclasses.dataclass(frozen=True)
class Reply:
  """A finished reply of one session row: its sampled tokens, their log-probs, why it ended."""

  row: int
  tokens: np.ndarray  # int32[n]
  logprobs: np.ndarray  # float32[n]
  finish_reason: FinishReason


@dataclasses.dataclass
class SessionStats:
  """Counters of a session (cumulative; `SamplerSession.stats`)."""

  prefill_calls: int = 0
  prefill_tokens: int = 0
  decode_calls: int = 0
  decode_steps: int = 0  # batch steps run (each computes every row)
  decode_row_steps: int = 0  # steps x rows that were decoding (generated tokens after the first)
  replies: int = 0
  peak_cache_slots: int = 0  # pages in use x page_size, at its peak
  live_tokens_at_peak: int = 0  # the rows' tokens in the cache at that moment
  pool_pages: int = 0


def prefill_widths(chunk: int) -> tuple[int, ...]:
  """The widths of a session's prefill calls: C / 8, C / 4, C / 2 and C (C = `prefill_chunk`),
  those >= 8, ascending. A row's chunk of L tokens goes in a call of the smallest width >= L,
  so it pays for at most 2L tokens (or C / 8, or 8), never C; a run compiles at most 4
  prefill programs per pool size."""
  return tuple(sorted({w for w in (chunk // 8, chunk // 4, chunk // 2) if w >= 8} | {chunk}))


class SamplerSession:
  """A decode batch of S rows over a paged KV cache, driven from the host.

  Episodes take a row, `give` it tokens (a prompt, then each observation) and get `Reply`s
  back from `decode`; `release` returns the row and its pages. The session owns the cache:
  rows, their positions, the page pool (grown by doubling when it runs out), the page
  table, and the insertion of new tokens (chunked `prefill`). Two kinds of compiled program:

      prefill(R = prefill_rows rows, W tokens each; W in prefill_widths(prefill_chunk))
      decode(k steps of all S rows)

  each also keyed by the pool size; a row's prefill width follows from its own chunk, so a
  row's tokens and log-probs are the same bits whatever else shares its calls. The page table has one width (the most pages a row can need); attention visits
  only the blocks of pages the longest live row fills. The programs are module-level: sessions of the same
  configs share them.

      session = SamplerSession(model_config, sampling_config, SessionConfig(rows=16, ...))
      session.give(row, prompt_ids, key_data, limit)       # the row owes a reply
      session.prefill(params); replies = session.decode(params)
      session.give(row, observation_ids, key_data, limit)  # the reply's last token goes first
      session.release(row)

  A reply's last token is not written to the cache when it ends; the row's next `give` writes
  it in front of the new tokens. So a row's cache always holds its conversation so far
  except that token, at positions 0, 1, ... (its RoPE positions).
  """

  def __init__(
    self,
    model_config: ModelConfig,
    sampling_config: SamplingConfig,
    config: SessionConfig,
    *,
    cache_sharding: Optional[Callable[[qwen.PagedKVCache], Any]] = None,
  ):
    if not isinstance(config, SessionConfig):
      raise TypeError(f"config must be a SessionConfig, got {type(config).__name__}")
    self.model_config = _check_configs(model_config, sampling_config)
    self.sampling_config = sampling_config
    self.config = config
    self.num_stops = len(sampling_config.stop_token_ids)
    pages = -(-(config.max_context_tokens + config.decode_steps_per_sync + 1) // config.page_size)
    per_block = max(1, self.model_config.attn_block_size // config.page_size)
    # One page-table width for every program: the work of attention follows the longest row
    # (`layers.paged_attend`), not the width, and a row's numbers do not depend on it.
    self.max_pages_per_row = -(-pages // per_block) * per_block
    self._constrain = functools.partial(constrain_cache, cache_sharding=cache_sharding)
    self._cache_sharding = cache_sharding
    self._statics = statics = dict(
      model_config=self.model_config, sampling_config=sampling_config, cache_sharding=cache_sharding
    )
    # Module-level jitted programs: sessions of the same configs share their compiled programs.
    self._decode = functools.partial(_decode_jit, num_steps=config.decode_steps_per_sync, **statics)
    self._prefill = functools.partial(_prefill_jit, **statics)
    self._grow = functools.partial(_grow_jit, cache_sharding=cache_sharding)
    self.prefill_widths = prefill_widths(config.prefill_chunk)
    self._staged: list[PrefillCall] = []  # run by the next decode call
    self.stats = SessionStats()
    self.rows: Optional[DecodeRows] = None
    s = config.rows
    self._pages: list[list[int]] = [[] for _ in range(s)]
    self._free: list[int] = []
    self._lengths = np.zeros((s,), np.int64)  # tokens of the row in the cache (host mirror)
    self._pending = np.full((s,), -1, np.int64)  # the last reply's last token, not in the cache
    self._input: list[list[int]] = [[] for _ in range(s)]  # tokens still to write
    self._reply_args: list[Optional[tuple]] = [None] * s  # (key data, limit) once input is written
    self._fresh = np.ones((s,), bool)  # the row's next write starts a new context
    self._awaiting = np.zeros((s,), bool)  # the row owes a reply (begun on device)
    self._reply_steps = np.zeros((s,), np.int64)  # tokens of its reply so far (host mirror)

  # --- rows ---------------------------------------------------------------------------------

  def give(self, row: int, ids: Sequence[int], key_data: np.ndarray, limit: int) -> None:
    """Queues the row's new tokens; once they are written the row samples a reply of at most
    `limit` tokens (>= 1) from `key_data` (raw uint32[2] PRNG key)."""
    if self._awaiting[row] or self._reply_args[row] is not None:
      raise ValueError(f"row {row} still owes a reply")
    if not 1 <= limit <= self.sampling_config.max_new_tokens:
      raise ValueError(f"limit must be in [1, {self.sampling_config.max_new_tokens}], got {limit}")
    new = ([int(self._pending[row])] if self._pending[row] >= 0 else []) + [int(t) for t in ids]
    if not new:
      raise ValueError(f"row {row} was given no token to continue from")
    if self._lengths[row] + len(new) + limit > self.config.max_context_tokens:
      raise ValueError(
        f"row {row}: {self._lengths[row]} tokens + {len(new)} new + a reply of {limit} exceed "
        f"max_context_tokens={self.config.max_context_tokens}"
      )
    self._pending[row] = -1
    self._input[row] = new
    self._reply_args[row] = (np.asarray(key_data, np.uint32).reshape(2), int(limit))

  def release(self, row: int) -> None:
    """Ends the row's context: its pages go back to the pool."""
    self._free.extend(self._pages[row])
    self._pages[row] = []
    self._lengths[row] = 0
    self._pending[row] = -1
    self._input[row] = []
    self._reply_args[row] = None
    self._fresh[row] = True
    self._awaiting[row] = False

  def reply_progress(self) -> dict[int, int]:
    """{row: the tokens of its reply sampled so far} for the rows whose reply has begun and not
    ended (as of the last `decode`; no device read)."""
    return {int(r): int(self._reply_steps[r]) for r in np.flatnonzero(self._awaiting)}

  @property
  def busy(self) -> bool:
    """Some row has tokens to write or a reply to finish."""
    return bool(self._awaiting.any()) or any(self._input)

  @property
  def cache_slots(self) -> int:
    """Slots of the pages rows hold now."""
    return sum(len(p) for p in self._pages) * self.config.page_size

  @property
  def live_tokens(self) -> int:
    """Tokens the rows hold in the cache now."""
    return int(self._lengths.sum())

  # --- pages --------------------------------------------------------------------------------

  def _start(self) -> None:
    s, cfg = self.config.rows, self.config
    pages = cfg.initial_pages or 1 + s * -(
      -min(cfg.prefill_chunk, cfg.max_context_tokens) // cfg.page_size
    )
    cache = self._constrain(qwen.init_paged_cache(self.model_config, pages, cfg.page_size))
    rows = init_rows(
      cache, s, self.num_stops, self.sampling_config.max_new_tokens, self.sampling_config.pad_id
    )
    shared = jnp.asarray(self.sampling_config.stop_token_ids, jnp.int32).reshape(1, -1)
    self.rows = rows.replace(stops=jnp.broadcast_to(shared, (s, self.num_stops)))
    self._free = list(range(pages - 1, 0, -1))  # page 0 is the scratch page
    self.stats.pool_pages = pages

  def _reserve(self, row: int, tokens: int) -> None:
    """Gives the row pages for its first `tokens` positions."""
    need = -(-tokens // self.config.page_size)
    if need > self.max_pages_per_row:
      raise ValueError(f"row {row} needs {need} pages > {self.max_pages_per_row}")
    while len(self._pages[row]) < need:
      if not self._free:
        old = self.rows.cache.num_pages
        self.rows = self._grow(self.rows, 2 * old)
        self._free = list(range(2 * old - 1, old - 1, -1))
        self.stats.pool_pages = 2 * old
      self._pages[row].append(self._free.pop())

  def page_table(self) -> np.ndarray:
    """int32[S, max_pages_per_row]: row r's pages in order, 0 (the scratch page) after."""
    table = np.zeros((self.config.rows, self.max_pages_per_row), np.int32)
    for r, pages in enumerate(self._pages):
      table[r, : len(pages)] = pages
    return table

  def _note_peak(self) -> None:
    slots = self.cache_slots
    if slots > self.stats.peak_cache_slots:
      self.stats.peak_cache_slots = slots
      self.stats.live_tokens_at_peak = self.live_tokens

  # --- the programs ---------------------------------------------------------------------------

  def prefill(self, params) -> int:
    """Writes up to `prefill_chunk` queued tokens of every row that has some (one call);
    rows whose input is then complete begin their reply. Returns the tokens written.

    The calls are dispatched by the next `decode` (before its decode steps, with no host
    read in between): `decode` must follow (before `give` or `release`)."""
    if self.rows is None:
      self._start()
    cfg = self.config
    todo = [r for r in range(cfg.rows) if self._input[r]]
    if not todo:
      return 0
    # R rows a call, and a width that is a function of the row's own chunk alone (the
    # smallest of `prefill_widths` that holds it): a row's numbers do not depend on what
    # else was prefilled with it, or when (a wider or taller call changes the float
    # rounding of its matmuls). Rows of one width share calls; more than R: several calls.
    n = min(cfg.prefill_rows, cfg.rows)
    by_width: dict[int, list[int]] = {}
    for r in todo:
      chunk_len = min(len(self._input[r]), cfg.prefill_chunk)
      width = next(w for w in self.prefill_widths if w >= chunk_len)
      by_width.setdefault(width, []).append(r)
    written = 0
    for width, start, group in (
      (width, start, rows)
      for width, rows in sorted(by_width.items())
      for start in range(0, len(rows), n)
    ):
      row_ids = np.full((n,), cfg.rows, np.int32)
      fresh = np.zeros((n,), bool)
      ids = np.zeros((n, width), np.int32)
      valid = np.zeros((n, width), bool)
      begin = np.zeros((n,), bool)
      keys = np.zeros((n, 2), np.uint32)
      limits = np.zeros((n,), np.int32)
      for i, r in enumerate(group[start : start + n]):
        chunk = self._input[r][:width]
        self._input[r] = self._input[r][len(chunk) :]
        self._reserve(r, int(self._lengths[r]) + len(chunk))
        row_ids[i], fresh[i] = r, self._fresh[r]
        ids[i, : len(chunk)] = chunk
        valid[i, : len(chunk)] = True
        self._fresh[r] = False
        self._lengths[r] += len(chunk)
        written += len(chunk)
        if not self._input[r]:
          begin[i] = True
          keys[i], limits[i] = self._reply_args[r]
          self._reply_args[r] = None
          self._awaiting[r] = True
          self._reply_steps[r] = 0
      self._staged.append(PrefillCall(row_ids, fresh, ids, valid, begin, keys, limits))
      self.stats.prefill_calls += 1
    self._note_peak()
    self.stats.prefill_tokens += written
    return written

  @property
  def staged_prefills(self) -> tuple[PrefillCall, ...]:
    """The prefill calls `prefill` staged, in the order the next decode call runs them."""
    return tuple(self._staged)

  def prepare_decode(self, params) -> np.ndarray:
    """The first half of `decode`, with no host read: reserves the pages of the next k
    decode steps of every decoding row, dispatches the staged prefill calls on the session's
    rows, and returns the page table the decode program reads (`page_table()`)."""
    k = self.config.decode_steps_per_sync
    for r in np.flatnonzero(self._awaiting):
      self._reserve(int(r), int(self._lengths[r]) + k)
    self._note_peak()
    table = self.page_table()
    staged, self._staged = self._staged, []
    for call in staged:
      self.rows = self.prefill_program(params, self.rows, table, call)
    return table

  def prefill_program(self, params, rows: DecodeRows, table: np.ndarray, call: PrefillCall):
    """The session's compiled prefill program on `rows` (donated) for one `PrefillCall`:
    writes its rows' tokens and begins the replies of its `begin` rows. Returns the rows
    after. `prepare_decode` runs the staged calls with it; a benchmark times it alone."""
    return self._prefill(params, rows, table, *call)

  def decode_program(self, params, rows: DecodeRows, table: np.ndarray):
    """The session's compiled decode program on `rows` (donated): up to k decode steps of
    every decoding row. Returns (rows after, int32 steps run). `decode` runs it on the
    session's rows; a benchmark times it alone after `prepare_decode`."""
    return self._decode(params, rows, table)

  def full_pool_pages(self) -> int:
    """The pages of a pool in which every row holds its most tokens (`max_pages_per_row`),
    plus the scratch page: the most the session's pool needs."""
    return 1 + self.config.rows * self.max_pages_per_row

  def lower_decode(self, params, num_pages: Optional[int] = None):
    """The session's decode program lowered ahead of time (`.compile()` it), on a pool of
    `num_pages` pages (default `full_pool_pages()`).

    `params` may be `jax.ShapeDtypeStruct`s with the decode layout's shardings, on any
    backend's devices (a TPU topology's on a CPU host): nothing is allocated. The rows' cache
    takes the session's cache shardings, the other row fields are replicated. Lower under
    `jax.set_mesh` of the decode mesh, as the rollout runs it.
    """
    cfg = self.config
    pages = self.full_pool_pages() if num_pages is None else num_pages

    def idle_rows():
      cache = qwen.init_paged_cache(self.model_config, pages, cfg.page_size)
      return init_rows(
        cache,
        cfg.rows,
        self.num_stops,
        self.sampling_config.max_new_tokens,
        self.sampling_config.pad_id,
      )

    rows = jax.eval_shape(idle_rows)
    table = jax.ShapeDtypeStruct((cfg.rows, self.max_pages_per_row), jnp.int32)
    if self._cache_sharding is not None:
      cache_shardings = self._cache_sharding(rows.cache)
      whole = jax.sharding.NamedSharding(
        jax.tree.leaves(cache_shardings)[0].mesh, jax.sharding.PartitionSpec()
      )

      def placed(x, sharding=whole):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

      rows = jax.tree.map(placed, rows).replace(
        cache=jax.tree.map(placed, rows.cache, cache_shardings)
      )
      table = placed(table)
    return _decode_jit.lower(
      params, rows, table, num_steps=cfg.decode_steps_per_sync, **self._statics
    )

  def decode(self, params) -> list[Reply]:
    """Up to k decode steps of every decoding row, then one host read; returns the replies
    that ended (also those that ended on their first token, in `prefill`)."""
    if not self._awaiting.any() and not self._staged:
      return []
    table = self.prepare_decode(params)
    self.rows, steps = self.decode_program(params, self.rows, table)
    state = jax.device_get(
      (self.rows.lengths, self.rows.decoding, self.rows.steps, self.rows.finish_reason, steps)
    )
    lengths, decoding, reply_steps, finish, steps = state
    self.stats.decode_calls += 1
    self.stats.decode_steps += int(steps)
    self.stats.decode_row_steps += int(np.sum((lengths - self._lengths)[self._awaiting]))
    # Only the rows that were decoding moved (released rows keep a stale device length).
    self._lengths = np.where(self._awaiting, lengths, self._lengths).astype(np.int64)
    self._reply_steps = np.where(self._awaiting, reply_steps, self._reply_steps).astype(np.int64)
    done = np.flatnonzero(self._awaiting & ~decoding)
    if not len(done):
      return []
    tokens, logprobs = jax.device_get((self.rows.tokens, self.rows.logprobs))
    replies = []
    for r in done:
      n = int(reply_steps[r])
      self._awaiting[r] = False
      self._pending[r] = int(tokens[r, n - 1]) if n else -1
      replies.append(
        Reply(int(r), tokens[r, :n].copy(), logprobs[r, :n].copy(), FinishReason(int(finish[r])))
      )
    self.stats.replies += len(replies)
    return replies
