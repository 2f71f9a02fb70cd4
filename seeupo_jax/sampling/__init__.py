"""Jitted KV-cache sampler over a paged cache: every row has its own length.

Two ways in, one set of steps:

* `make_sampler(model_config, sampling_config)` binds the hyper-parameters and returns one
  jitted one-shot function

      sample(params, prompt_ids, prompt_valid, rng, stop_tokens=None, max_new_tokens=None)
          -> SampleOutput(tokens, logprobs, mask, lengths, finish_reason)

  (the session below started from an empty context, inside one compiled program).

* `SamplerSession(model_config, sampling_config, SessionConfig(rows=S))` is the decode batch
  of the rollout engine: S rows that episodes take and give back, a pool of KV pages, and two
  compiled programs, `prefill` (write the tokens that arrived for some rows, chunked; rows
  whose input is complete sample their first token) and `decode` (k steps of every decoding
  row, then one host sync). A row's tokens go where its own context ends: nothing pads one
  row to another, no index is shared.

Prompts of different lengths share one batch (pad anywhere; RoPE positions count only valid
tokens). Each sampled token's log-prob is taken under the distribution it was drawn from,
softmax(filter(logits / temperature)) (`filter_logits`: top-k, then top-p): the behaviour
policy of an importance weight (`LearnerConfig.tis`). With top-k and top-p off (the training
default) that is the full tempered distribution, so it equals the teacher-forced
`qwen.token_logprobs(..., temperature=temperature)` of the same sequence (the learner's
`sample_logp_gap_*` metrics check it); with them on it is log p_full - log(kept mass), and the
gap metrics show the filter's share. Greedy decoding takes the argmax and reports the log-prob
of the full distribution at `temperature`.

Randomness: a row draws the token of its reply's step t with `fold_in(reply_key, t)`. The
one-shot sampler's reply keys are `rng` itself ([B] keys) or `split(rng, B)` (one key); a
session's are given per reply (`SamplerSession.give`). So a reply depends only on its context,
its key and the params, not on the rest of the batch, the row it sits in, or when it ran.

Modules, one role each:
  config.py     `SamplingConfig` (decoding hyper-parameters) and `SessionConfig` (a session's
                geometry: rows, pages, prefill rows and widths, decode steps per sync);
  selection.py  token selection: temperature, top-k, top-p (`filter_logits`, `select_token`,
                `sampled_logprob`);
  steps.py      the device row state (`DecodeRows`) and the steps over it: `write_tokens` ->
                `begin_replies` -> `decode_loop`, shared by both entry points;
  sampler.py    the one-shot sampler (`make_sampler`);
  programs.py   the session's compiled programs (prefill of staged rows, decode, pool growth);
  session.py    the host session (`SamplerSession`): slots, the page pool, prefill staging and
                widths, reply collection;
  layout.py     the decode layout: the sampler's tensor-parallel copy of the learner's params.
"""

from seeupo_jax.sampling.config import SamplingConfig, SessionConfig
from seeupo_jax.sampling.programs import (
  _STATICS,
  PrefillCall,
  _decode_jit,
  _decode_program,
  _grow_jit,
  _prefill_jit,
  _prefill_program,
)
from seeupo_jax.sampling.sampler import (
  SampleOutput,
  _row_keys,
  _sample,
  _stops_and_limits,
  make_sampler,
)
from seeupo_jax.sampling.selection import filter_logits, sampled_logprob, select_token
from seeupo_jax.sampling.session import (
  Reply,
  SamplerSession,
  SessionStats,
  prefill_widths,
)
from seeupo_jax.sampling.steps import (
  DecodeRows,
  FinishReason,
  Params,
  _check_configs,
  _last_valid_slot,
  begin_replies,
  constrain_cache,
  decode_loop,
  decode_step,
  emit,
  init_rows,
  next_logits,
  prompt_positions,
  write_tokens,
)

__all__ = [
  "DecodeRows",
  "FinishReason",
  "Params",
  "PrefillCall",
  "Reply",
  "SampleOutput",
  "SamplerSession",
  "SamplingConfig",
  "SessionConfig",
  "SessionStats",
  "begin_replies",
  "constrain_cache",
  "decode_loop",
  "decode_step",
  "emit",
  "filter_logits",
  "init_rows",
  "make_sampler",
  "next_logits",
  "prefill_widths",
  "prompt_positions",
  "sampled_logprob",
  "select_token",
  "write_tokens",
]
