"""Qwen2/Qwen2.5/Qwen3 causal LM applied functionally: params in, logits out.

The decoder blocks are Flax modules (`layers.DecoderLayer`) whose parameters
are stacked on a leading layer axis, one layout for both `scan_layers`
settings: with `scan_layers=True` the stack runs under `lax.scan` (compile time
independent of depth), otherwise it is unrolled. Each block may be
rematerialised with a named policy (`config.remat`).

Params pytree (with LoRA adapters beside the adapted kernels when config.lora_rank > 0:
`models/lora.py`):
  embed/embedding            [V, D]
  layers/input_norm/scale    [L, D]
  layers/attn/{q,k,v}_proj/{kernel [L, D, N*hd], bias [L, N*hd] if attention_bias}
  layers/attn/{q,k}_norm/scale [L, hd] if qk_norm
  layers/attn/o_proj/{kernel [L, H*hd, D], bias [L, D] if o_proj_bias (Qwen3 with attention_bias)}
  layers/post_attn_norm/scale [L, D]
  layers/mlp/{gate,up}_proj/kernel [L, D, F]; layers/mlp/down_proj/kernel [L, F, D]
  final_norm/scale           [D]
  lm_head/kernel             [D, V] unless tie_word_embeddings
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import chex
import flax
import jax
import jax.numpy as jnp

from seeupo_jax import sharding
from seeupo_jax.models import layers
from seeupo_jax.models import lora
from seeupo_jax.models import quant
from seeupo_jax.models.config import ModelConfig

Params = Any

_SAVE_ATTENTION = jax.checkpoint_policies.save_only_these_names(*layers.ATTENTION_RESIDUALS)
# "dots" and "dots_no_batch" also keep the causal attention's output and softmax statistics, so
# the backward pass does not redo the attention's forward pass (`layers.causal_attend`).
_REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.checkpoint_dots, _SAVE_ATTENTION
  ),
  "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_ATTENTION
  ),
}


@flax.struct.dataclass
class KVCache:
  """Per-layer keys/values of the tokens seen so far.

  Head-major (slots next to each other per kv head), so attention reads a
  layer's cache as it is stored, with no transpose.

  keys:   [num_layers, B, num_kv_heads, max_len, head_dim], config.dtype (after RoPE)
  values: [num_layers, B, num_kv_heads, max_len, head_dim], config.dtype
  valid:  bool[B, max_len], True where the slot holds a real (non-pad) token
  index:  int32 scalar, next slot to write (shared by all rows)
  """

  keys: jax.Array
  values: jax.Array
  valid: jax.Array
  index: jax.Array


def init_cache(config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
  """An empty cache (all slots invalid, index 0) in config.dtype."""
  shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
  return KVCache(
    keys=jnp.zeros(shape, config.dtype),
    values=jnp.zeros(shape, config.dtype),
    valid=jnp.zeros((batch_size, max_len), bool),
    index=jnp.zeros((), jnp.int32),
  )


@flax.struct.dataclass
class PagedKVCache:
  """Keys/values of many rows in one pool of fixed-size pages (the sampler's cache).

  Row b's token at position j (its RoPE position, counted from the row's first token) lives
  in page `page_table[b, j // page_size]` at offset `j % page_size`; the page table and the
  rows' lengths travel next to the cache (`paged_hidden_states`). Page 0 is a scratch page:
  writes of pad tokens land there, so no row may own it.

  keys:   [num_layers, num_pages, num_kv_heads, page_size, head_dim], config.dtype (after RoPE)
  values: [num_layers, num_pages, num_kv_heads, page_size, head_dim], config.dtype
  """

  keys: jax.Array
  values: jax.Array

  @property
  def num_pages(self) -> int:
    return self.keys.shape[1]

  @property
  def page_size(self) -> int:
    return self.keys.shape[3]


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int) -> PagedKVCache:
  """An empty pool of `num_pages` pages (page 0 the scratch page) in config.dtype."""
  shape = (config.num_layers, num_pages, config.num_kv_heads, page_size, config.head_dim)
  return PagedKVCache(keys=jnp.zeros(shape, config.dtype), values=jnp.zeros(shape, config.dtype))


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (normal(0.02) weights, zero biases, unit norm scales), with fresh LoRA
  adapters (`lora.init_adapters`, from `fold_in(key, 1)`) when `config.lora_rank` > 0 and the
  layers' projections quantized when `config.quantize` is "int8" or "nf4" (`models/quant.py`)."""
  k_embed, k_layers, k_head = jax.random.split(key, 3)
  pdt = jnp.dtype(config.param_dtype)
  d = config.hidden_size
  x = jnp.zeros((1, 1, d), config.dtype)
  cos, sin = layers.rope_tables(jnp.zeros((1, 1), jnp.int32), config.head_dim, config.rope_theta)
  mask = jnp.ones((1, 1), bool)

  def init_layer(k):
    return layers.DecoderLayer(config).init(k, x, cos, sin, mask)["params"]

  params = {
    "embed": {"embedding": 0.02 * jax.random.normal(k_embed, (config.vocab_size, d), pdt)},
    "layers": jax.vmap(init_layer)(jax.random.split(k_layers, config.num_layers)),
    "final_norm": {"scale": jnp.ones((d,), pdt)},
  }
  if not config.tie_word_embeddings:
    params["lm_head"] = {"kernel": 0.02 * jax.random.normal(k_head, (d, config.vocab_size), pdt)}
  params = quant.quantize_params(params, config.quantize)  # a frozen base in int8 / nf4
  return lora.combine(params, lora.init_adapters(config, jax.random.fold_in(key, 1)))


def params_shape(config: ModelConfig) -> Params:
  """ShapeDtypeStruct tree of `init_params(config, key)` (nothing allocated)."""
  return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def _layer_fn(config: ModelConfig):
  """(layer_params, x, cos, sin, mask, past_k, past_v) -> (x, k, v), remat applied."""
  module = layers.DecoderLayer(config)

  def apply_layer(layer_params, x, cos, sin, mask, past_k, past_v):
    return module.apply({"params": layer_params}, x, cos, sin, mask, past_k, past_v)

  if config.remat == "none":
    return apply_layer
  return jax.checkpoint(apply_layer, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)


def _run_layers(params, x, cos, sin, mask, cache, config):
  """Runs the decoder stack over x [B, S, D].

  The cache (a `KVCache` or a `PagedKVCache`) is read only: each layer attends over its
  cached slots and the S new tokens, and returns the new tokens' keys/values; the caller
  writes all layers' at once (one in-place update instead of a copy of the cache per
  layer). With a `PagedKVCache` each layer gets the whole stack of page pools and a
  `layers.PagedMask` naming its layer (the attention gathers its pages from the stack; a
  per-layer slice of the pool would be a copy of it per layer and decode step).

  Returns:
    (x [B, S, D], new_k, new_v), new_k/new_v [L, B, S, K, hd] (None without cache).
  """
  layer_fn = _layer_fn(config)

  paged = isinstance(cache, PagedKVCache)

  def decoder_step(x, layer):
    """One block over this layer's (read-only) cache; emits the new tokens' k/v."""
    layer_params, layer_index, past_k, past_v = layer
    layer_mask = mask
    if paged:  # the pools stay stacked; the mask names the layer to gather from
      layer_mask, past_k, past_v = mask.replace(layer=layer_index), cache.keys, cache.values
    x, k, v = layer_fn(layer_params, x, cos, sin, layer_mask, past_k, past_v)
    return x, (None if past_k is None else (k, v))

  if cache is None:
    stacked = (params["layers"], None, None, None)
  elif paged:
    stacked = (params["layers"], jnp.arange(config.num_layers, dtype=jnp.int32), None, None)
  else:
    stacked = (params["layers"], None, cache.keys, cache.values)
  if config.scan_layers:
    x, new_kv = jax.lax.scan(decoder_step, x, stacked)
  else:
    per_layer = []
    for i in range(config.num_layers):
      x, kv = decoder_step(x, jax.tree.map(lambda a, i=i: a[i], stacked))
      per_layer.append(kv)
    new_kv = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
  if new_kv is None:
    return x, None, None
  return (x, *new_kv)


def _check_inputs(input_ids, positions, token_valid):
  chex.assert_rank([input_ids, positions], 2)
  chex.assert_equal_shape([input_ids, positions])
  chex.assert_type([input_ids, positions], int)
  if token_valid is None:
    return jnp.ones(input_ids.shape, bool)
  chex.assert_equal_shape([input_ids, token_valid])
  chex.assert_type(token_valid, bool)
  return token_valid


def hidden_states(
  params: Params,
  input_ids: jax.Array,
  positions: jax.Array,
  token_valid: Optional[jax.Array] = None,
  cache: Optional[KVCache] = None,
  *,
  config: ModelConfig,
):
  """Final-normed hidden states of the decoder; see `forward` for the arguments.

  Returns:
    (h [B, S, D] in config.dtype, new cache or None).
  """
  token_valid = _check_inputs(input_ids, positions, token_valid)
  dt = jnp.dtype(config.dtype)
  b, s = input_ids.shape
  x = jnp.take(params["embed"]["embedding"], input_ids, axis=0).astype(dt)
  x = sharding.constrain(x, sharding.HIDDEN)
  cos, sin = layers.rope_tables(positions, config.head_dim, config.rope_theta)
  if cache is None:
    x, _, _ = _run_layers(params, x, cos, sin, token_valid, None, config)
    new_cache = None
  else:
    chex.assert_shape(cache.valid, (b, None))
    t = cache.valid.shape[1]
    # New token s attends to the filled valid slots and to new tokens <= s (valid ones).
    past = (jnp.arange(t) < cache.index)[None, :] & cache.valid  # [B, T]
    causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]  # [S, S]
    mask = jnp.concatenate(
      [jnp.broadcast_to(past[:, None, :], (b, s, t)), causal[None] & token_valid[:, None, :]],
      axis=2,
    )
    x, new_k, new_v = _run_layers(params, x, cos, sin, mask, cache, config)

    def write(stack, new):  # new [L, B, S, K, hd] -> slots [index, index + S) of [L, B, K, T, hd]
      new = new.transpose(0, 1, 3, 2, 4).astype(stack.dtype)
      return jax.lax.dynamic_update_slice(stack, new, (0, 0, 0, cache.index, 0))

    new_cache = KVCache(
      keys=write(cache.keys, new_k),
      values=write(cache.values, new_v),
      valid=jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, cache.index)),
      index=cache.index + s,
    )
  norm = layers.RMSNorm(config.rms_norm_eps, dt, jnp.dtype(config.param_dtype))
  h = norm.apply({"params": params["final_norm"]}, x)
  return h, new_cache


def paged_hidden_states(
  params: Params,
  input_ids: jax.Array,
  positions: jax.Array,
  token_valid: jax.Array,
  cache: PagedKVCache,
  page_table: jax.Array,
  lengths: jax.Array,
  *,
  config: ModelConfig,
):
  """Final-normed hidden states of S new tokens per row over each row's own paged cache.

  Each row has its own length: row b holds positions [0, lengths[b]) in the pages
  page_table[b, :]; its valid new tokens carry their positions (lengths[b], lengths[b] + 1,
  ... in order: the caller's contract) and are written at those positions, so nothing
  pads one row to another. New token s of row b attends to the row's cached positions
  j < lengths[b] (read page block by page block, `layers.paged_attend`: the work follows the
  longest row, and a row's result does not depend on the other rows or on the table's
  width) and to its valid new tokens <= s. Pad tokens are written to the scratch page 0 and
  attended by nobody.

  Args:
    params: the model's params.
    input_ids: int32[B, S] token ids (pads must be valid ids, e.g. 0).
    positions: int32[B, S] RoPE positions = cache positions of the valid tokens.
    token_valid: bool[B, S].
    cache: the `PagedKVCache` pool.
    page_table: int32[B, W] each row's pages in order (unused entries: 0); every valid new
      token's position must be < W * page_size; W a multiple of the pages per attention
      block, max(1, attn_block_size // page_size).
    lengths: int32[B] tokens of each row already in the cache.
    config: the `ModelConfig` (static).

  Returns:
    (h [B, S, D] in config.dtype, the cache with the valid new tokens written).
  """
  token_valid = _check_inputs(input_ids, positions, token_valid)
  chex.assert_rank([page_table, lengths], [2, 1])
  dt = jnp.dtype(config.dtype)
  b, s = input_ids.shape
  w, page = page_table.shape[1], cache.page_size
  x = jnp.take(params["embed"]["embedding"], input_ids, axis=0).astype(dt)
  x = sharding.constrain(x, sharding.HIDDEN)
  cos, sin = layers.rope_tables(positions, config.head_dim, config.rope_theta)
  t = w * page
  ppb = max(1, min(w, config.attn_block_size // page))  # pages per attention block
  if w % ppb:
    raise ValueError(f"page table width {w} is not a multiple of {ppb} pages per block")
  causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]  # [S, S]
  reading = jnp.where(jnp.any(token_valid, axis=1), lengths, 0)  # rows given no token: none
  mask = layers.PagedMask(
    page_table=page_table,
    lengths=lengths,
    new_allowed=causal[None] & token_valid[:, None, :],
    num_blocks=(jnp.max(reading) + ppb * page - 1) // (ppb * page),
    layer=jnp.zeros((), jnp.int32),  # each layer's own index, set by `_run_layers`
    pages_per_block=ppb,
  )
  x, new_k, new_v = _run_layers(params, x, cos, sin, mask, cache, config)
  slot = jnp.clip(positions, 0, t - 1)
  pages = jnp.take_along_axis(page_table, slot // page, axis=1)
  pages = jnp.where(token_valid, pages, 0)  # pads go to the scratch page
  offsets = jnp.where(token_valid, slot % page, 0)

  def write(pool, new):  # new [L, B, S, K, hd] -> pool[:, pages[b, s], :, offsets[b, s]]
    return pool.at[:, pages, :, offsets].set(new.transpose(1, 2, 0, 3, 4).astype(pool.dtype))

  new_cache = PagedKVCache(keys=write(cache.keys, new_k), values=write(cache.values, new_v))
  norm = layers.RMSNorm(config.rms_norm_eps, dt, jnp.dtype(config.param_dtype))
  h = norm.apply({"params": params["final_norm"]}, x)
  return h, new_cache


def output_kernel(params: Params, config: ModelConfig) -> jax.Array:
  """[D, V] output projection (the embedding transposed when tied). With an adapter on the head
  (`models/lora.py`, target "lm_head"): W + alpha / r * A B, summed in float32 and cast to W's
  dtype, as `lora.merge` exports it."""
  if config.tie_word_embeddings:
    return params["embed"]["embedding"].T
  w = params["lm_head"]["kernel"]
  delta = lora.head_delta(params, config.lora_scale)
  return w if delta is None else (w.astype(jnp.float32) + delta).astype(w.dtype)


def forward(
  params: Params,
  input_ids: jax.Array,
  positions: jax.Array,
  token_valid: Optional[jax.Array] = None,
  cache: Optional[KVCache] = None,
  *,
  config: ModelConfig,
):
  """Logits of every position.

  Args:
    params: tree from `init_params` or `checkpoint.load_params`.
    input_ids: int32[B, S] token ids.
    positions: int32[B, S] RoPE positions per row (left-padded prompts work).
    token_valid: bool[B, S], False for pad tokens (None = all True). Pad tokens
      are never attended to.
    cache: optional `KVCache`. Without it: causal self-attention over the S
      tokens restricted to valid keys. With it: the new k/v go to slots
      [cache.index, cache.index + S), cache.valid there is set from
      token_valid, and the query at slot cache.index + s attends to slots
      j <= cache.index + s with valid[b, j].
    config: the model's `ModelConfig` (static).

  Returns:
    (logits float32[B, S, V], new cache with index += S, or None).
  """
  h, new_cache = hidden_states(params, input_ids, positions, token_valid, cache, config=config)
  w = output_kernel(params, config).astype(h.dtype)
  logits = jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=jnp.float32)
  return sharding.constrain(logits, sharding.LOGITS), new_cache


def _chunk_logits(h_c, w, temperature):
  """h [B, C, D] @ w [D, V] / temperature -> float32 [B, C, V]."""
  return jnp.einsum("bcd,dv->bcv", h_c, w, preferred_element_type=jnp.float32) / temperature


def _chunk_logprobs(h_c, t_c, w, temperature):
  """One chunk: (log-probs [B, C], logsumexp [B, C], float32 logits [B, C, V])."""
  logits = _chunk_logits(h_c, w, temperature)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
  return target_logits - lse, lse, logits


def _chunked_logprobs_fwd(h, targets, w, temperature):
  """Forward of `_chunked_logprobs`: log-probs and each row's log-normaliser, chunk by chunk.

  The last chunk's logits are kept for the backward pass, which starts with
  that chunk: they are the buffer the forward pass ends with and the backward
  pass would otherwise recompute first. That saves one chunk's logits matmul;
  no buffer grows beyond one chunk's logits (XLA's peak holds two or three
  of them, BENCHMARKS.md). The other chunks keep only their logsumexp.
  """

  def logprob_step(_, chunk_inputs):
    """Log-probs and logsumexp of one chunk of positions."""
    logp_c, lse_c, _ = _chunk_logprobs(*chunk_inputs, w, temperature)
    return None, (logp_c, lse_c)

  last_logp, last_lse, last_logits = _chunk_logprobs(h[-1], targets[-1], w, temperature)
  _, (logp, lse) = jax.lax.scan(logprob_step, None, (h[:-1], targets[:-1]))  # may be empty
  logp = jnp.concatenate([logp, last_logp[None]])
  lse = jnp.concatenate([lse, last_lse[None]])
  return logp, (h, targets, w, lse, last_logits)


def _chunked_logprobs_bwd(temperature, residuals, d_logp):
  """Backward: d logp[t] / d logits = onehot(t) - softmax(logits), one chunk at a time.

  With g the cotangent of logp and P = softmax(h w / T):
    dlogits = g (onehot(target) - P) / T,  dh = dlogits w^T,  dw = sum over chunks h^T dlogits.
  The last chunk uses the logits the forward pass kept; the others recompute theirs.
  """
  h, targets, w, lse, last_logits = residuals
  vocab = w.shape[1]
  d_logp = d_logp.astype(jnp.float32)

  def chunk_grads(h_c, t_c, lse_c, g_c, logits):
    """(dw [D, V] float32, dh [B, C, D]) of one chunk from its logits."""
    probs = jnp.exp(logits - lse_c[..., None])
    onehot = jnp.arange(vocab, dtype=t_c.dtype) == t_c[..., None]
    d_logits = (g_c / temperature)[..., None] * (onehot.astype(jnp.float32) - probs)
    d_h = jnp.einsum("bcv,dv->bcd", d_logits.astype(w.dtype), w)
    d_w = jnp.einsum(
      "bcd,bcv->dv", h_c, d_logits.astype(h_c.dtype), preferred_element_type=jnp.float32
    )
    return d_w, d_h.astype(h_c.dtype)

  def grad_step(d_w, chunk_inputs):
    """Adds one chunk's dw (its logits recomputed); emits its dh."""
    h_c, t_c, lse_c, g_c = chunk_inputs
    d_w_c, d_h_c = chunk_grads(h_c, t_c, lse_c, g_c, _chunk_logits(h_c, w, temperature))
    return d_w + d_w_c, d_h_c

  d_w, last_d_h = chunk_grads(h[-1], targets[-1], lse[-1], d_logp[-1], last_logits)
  d_w, d_h = jax.lax.scan(grad_step, d_w, (h[:-1], targets[:-1], lse[:-1], d_logp[:-1]))
  return jnp.concatenate([d_h, last_d_h[None]]), None, d_w.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked_logprobs(h, targets, w, temperature):
  """log softmax(h @ w / T)[targets] per chunk: h [N, B, C, D], targets [N, B, C] -> f32 [N, B, C]."""
  return _chunked_logprobs_fwd(h, targets, w, temperature)[0]


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)


def logprobs_from_hidden(
  h: jax.Array,
  targets: jax.Array,
  w: jax.Array,
  *,
  temperature: float = 1.0,
  chunk_size: int = 256,
) -> jax.Array:
  """Per-token log-probs of `targets`, chunked over the sequence.

  logp[b, s] = log softmax(h[b, s] @ w / temperature)[targets[b, s]]. Logits
  are computed for one chunk of `chunk_size` positions at a time, in the
  forward and in the backward pass: the largest buffers are float32
  [B, chunk_size, V] (a few at once), never [B, S, V]. The
  gradient is hand-written: the forward pass keeps each position's
  logsumexp and the last chunk's logits (the buffer it ends with); the
  backward pass starts from those logits, recomputes the other chunks' and
  forms dlogits = g (onehot(target) - softmax) / temperature directly.

  Args:
    h: [B, S, D] final hidden states.
    targets: int32[B, S] token ids to score.
    w: [D, V] output projection.
    temperature: positive float, divides the logits.
    chunk_size: positions per chunk (S is padded up to a multiple).

  Returns:
    float32[B, S].
  """
  chex.assert_rank([h, targets, w], [3, 2, 2])
  b, s, d = h.shape
  chunk = min(chunk_size, s)
  n_chunks = -(-s // chunk)
  pad = n_chunks * chunk - s
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  h = h.reshape(b, n_chunks, chunk, d).swapaxes(0, 1)
  targets = targets.reshape(b, n_chunks, chunk).swapaxes(0, 1)
  logp = _chunked_logprobs(h, targets, w.astype(h.dtype), float(temperature))
  return logp.swapaxes(0, 1).reshape(b, n_chunks * chunk)[:, :s]


def token_logprobs(
  params: Params,
  input_ids: jax.Array,
  targets: jax.Array,
  positions: jax.Array,
  token_valid: Optional[jax.Array] = None,
  *,
  config: ModelConfig,
  temperature: float = 1.0,
  chunk_size: int = 256,
) -> jax.Array:
  """log softmax(logits / temperature)[target] at each position (teacher forcing).

  Args:
    params, input_ids, positions, token_valid, config: as in `forward`.
    targets: int32[B, S] ids to score at each position (usually input_ids
      shifted left by one).
    temperature: positive float.
    chunk_size: positions per logits chunk; float32 [B, chunk_size, V] is the
      largest logits buffer, also under jax.grad.

  Returns:
    float32[B, S]; values at pad positions are finite but meaningless.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}")
  chex.assert_equal_shape([input_ids, targets])
  h, _ = hidden_states(params, input_ids, positions, token_valid, config=config)
  return logprobs_from_hidden(
    h, targets, output_kernel(params, config), temperature=temperature, chunk_size=chunk_size
  )
