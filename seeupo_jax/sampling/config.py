"""The sampler's configs: decoding hyper-parameters (`SamplingConfig`) and a session's geometry
(`SessionConfig`), each validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Optional

from seeupo_jax import fields


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Decoding hyper-parameters, bound when the sampler is built.

  Attributes:
      max_new_tokens: N, the static length of the output buffers and the most
          tokens any row may generate (rows may ask for fewer, see `sample`).
      temperature: T > 0; logits are divided by T before filtering and
          sampling, and the reported log-probs are log softmax(logits / T).
      top_k: keep the k most likely tokens (0 = off).
      top_p: keep the smallest most-likely-first prefix of tokens whose
          probability reaches top_p (nucleus; 1.0 = off). Applied after top_k,
          on the renormalised top-k distribution (the transformers order).
      greedy: take the argmax instead of sampling (top_k/top_p/rng unused).
      stop_token_ids: stop tokens shared by all rows (added to each row's own).
      pad_id: written to `tokens` after a row has finished.
      prefill_chunk_size: run the prompt through the model in chunks of this
          many tokens (bounds the attention buffers of long prompts); None =
          the whole prompt at once.
      scan_layers: override `ModelConfig.scan_layers` while sampling (the
          params layout is the same either way); None keeps the model's. With
          the head-major cache, scanned layers decode faster on CPU than
          unrolled ones (`benchmarks/bench_sampler.py --sampler-scan-layers`):
          under the unrolled stack XLA cannot prove that every layer read the
          cache before the one in-place write, and copies the cache each step.
  """

  max_new_tokens: int = fields.field(fields.int_at_least(1))
  temperature: float = fields.field(
    fields.described(fields.number_above(0), "use greedy=True for argmax decoding"), 1.0
  )
  top_k: int = fields.field(fields.described(fields.int_at_least(0), "0: off"), 0)
  top_p: float = fields.field(
    fields.described(fields.number_in(0, 1, open_low=True), "1: off"), 1.0
  )
  greedy: bool = fields.field(fields.BOOL, False)
  stop_token_ids: tuple[int, ...] = fields.field(fields.tuple_of(fields.int_at_least(0)), ())
  pad_id: int = fields.field(fields.INT, 0)
  prefill_chunk_size: Optional[int] = fields.field(fields.optional(fields.int_at_least(1)), None)
  scan_layers: Optional[bool] = fields.field(fields.optional(fields.BOOL), None)

  def __post_init__(self):
    fields.check(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SessionConfig:
  """Geometry and schedule of a `SamplerSession` (validated on construction): the sampler's
  geometry is declared here once (the training config's `rollout.decode_slots`, `page_size`,
  `prefill_chunk`, `prefill_rows` and `decode_steps_per_sync` keys take their defaults and
  allowed values from these fields).

  rows: S, the decode slots: rows that decode together in one program (the rollout engine's
      most episodes live at once).
  max_context_tokens: the most tokens one row may hold (its context and reply); sets the
      widest page table.
  page_size: slots per KV page. A row holds ceil(its tokens / page_size) pages (plus room for
      the next `decode_steps_per_sync` tokens while it decodes); pages return to the pool when
      the row is released.
  prefill_chunk: C, the widest prefill call: the most tokens of one row written per call (a
      longer input is written over several calls, each with decode steps of the other rows).
      Calls come in the widths `prefill_widths(C)` (C / 8, C / 4, C / 2, C; those >= 8), a row's
      chunk in the smallest that holds it: the width depends on the row's own tokens only, so
      a row's tokens and log-probs do not depend on what else was prefilled with it
      (bit-exact whatever the timing).
  prefill_rows: R, the rows of every prefill call (more rows with tokens: several calls).
  decode_steps_per_sync: k, decode steps per decode call: the host reads the rows' state
      (finished replies) once per k steps, never per token; a call ends early when no row
      is decoding.
  initial_pages: the pool's first size (None: 1 + rows x the pages of one prefill chunk);
      it doubles when full (each size one compile).
  """

  rows: int = fields.field(fields.int_at_least(1), 64)
  max_context_tokens: int = fields.field(fields.int_at_least(1))
  page_size: int = fields.field(fields.int_at_least(1), 32)
  prefill_chunk: int = fields.field(fields.int_at_least(1), 64)
  prefill_rows: int = fields.field(fields.int_at_least(1), 8)
  decode_steps_per_sync: int = fields.field(fields.int_at_least(1), 8)
  initial_pages: Optional[int] = fields.field(fields.optional(fields.int_at_least(2)), None)

  def __post_init__(self):
    fields.check(self)
