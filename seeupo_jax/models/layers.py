"""Flax building blocks of a Qwen2/Qwen3 decoder block.

RMSNorm, rotary embeddings, grouped-query attention and the SwiGLU MLP. The
stack of blocks, the KV cache and the log-prob head live in `qwen.py`.
Parameter names follow the Hugging Face checkpoint (`q_proj`, `gate_proj`,
...) so the checkpoint mapping is one table.
"""

from __future__ import annotations

import functools
from typing import Optional

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from seeupo_jax.models import quant
from seeupo_jax.models.config import ModelConfig
from seeupo_jax import sharding

_INIT = nn.initializers.normal(stddev=0.02)  # HF initializer_range
_MASKED = float(jnp.finfo(jnp.float32).min)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
  """cos/sin tables of rotary embeddings (half-split layout, as in HF Qwen).

  inv_freq_i = theta^(-2i / head_dim), angle = position * inv_freq, and the
  tables repeat the head_dim/2 angles twice: cos = [cos(angle), cos(angle)].

  Args:
    positions: int32[B, S] RoPE position of each token.
    head_dim: even per-head width.
    theta: RoPE base.

  Returns:
    (cos, sin): float32[B, S, 1, head_dim] each (broadcast over heads).
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, hd/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x * cos + rotate_half(x) * sin, with rotate_half([a, b]) = [-b, a].

  Args:
    x: [B, S, N, head_dim] queries or keys, any float dtype.
    cos, sin: float32[B, S, 1, head_dim] from `rope_tables`.

  Returns:
    [B, S, N, head_dim] in x's dtype (computed in float32).
  """
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


class RMSNorm(nn.Module):
  """y = scale * x / sqrt(mean(x^2) + eps), statistics in float32 (HF Qwen2RMSNorm)."""

  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return scale.astype(self.dtype) * normed.astype(self.dtype)


def _dense(x: jax.Array, kernel: jax.Array, bias, dtype) -> jax.Array:
  """x [..., in] @ kernel [in, out] (+ bias [out]) in `dtype`, as `nn.Dense` computes it."""
  x, kernel = x.astype(dtype), kernel.astype(dtype)
  y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
  return y if bias is None else y + bias.astype(dtype)


class _Kernel(nn.Module):
  """The parameters of an `nn.Dense` (same names, init and tree path), returned, not applied.

  Lets a caller concatenate several projections' kernels and run them as one
  matmul while the params tree keeps one entry per Hugging Face projection.
  Where the params hold a quantized kernel (`models/quant.py`: `kernel_int8` or `kernel_nf4`
  and `kernel_scale` instead of `kernel`), the kernel returned is its dequantization in
  param_dtype.
  """

  in_features: int
  features: int
  use_bias: bool
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self):
    if self.has_variable("params", "kernel_scale"):  # a quantized base, frozen
      leaves = {
        n: self.get_variable("params", n)
        for n in (*quant.CODES, "kernel_scale")
        if self.has_variable("params", n)
      }
      kernel = quant.dequantize(leaves, self.param_dtype)
    else:
      kernel = self.param("kernel", _INIT, (self.in_features, self.features), self.param_dtype)
    if not self.use_bias:
      return kernel, None
    return kernel, self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)


def _lora_delta(module: nn.Module, name: str, x: jax.Array, scale: float, dtype):
  """scale * (x A) B for projection `name` of `module` where the params hold its adapter
  (`models/lora.py`: `<name>/lora_a` [in, r], `<name>/lora_b` [r, out]), else None.

  x [..., in] -> [..., out] in dtype. The adapters are read, not declared: the same module runs
  the base (no adapters in its params) and the adapted policy.
  """
  params = module.variables.get("params", {}).get(name, {})
  if "lora_a" not in params:
    return None
  a, b = params["lora_a"].astype(dtype), params["lora_b"].astype(dtype)
  low = jnp.einsum("...i,ir->...r", x.astype(dtype), a)
  return (jnp.einsum("...r,ro->...o", low, b) * jnp.asarray(scale, dtype)).astype(dtype)


def _plus(y: jax.Array, delta) -> jax.Array:
  return y if delta is None else y + delta


def _grouped_qkv(x, kernels, biases, num_kv_heads, head_dim, dtype):
  """q, k, v projections of x as one matmul, grouped by kv head.

  The q/k/v kernels [D, H*hd], [D, K*hd] x2 are viewed as [D, K, G, hd],
  [D, K, 1, hd] x2 (query head h = kv * G + g, as in `_to_heads`) and
  concatenated on the group axis: [D, K, G+2, hd], one dot (fewer, larger
  matmuls thread better on a CPU) whose kv-head axis is the one tensor
  parallelism shards, so the concatenation stays local to each shard.

  Returns:
    q [B, S, H, hd], k [B, S, K, hd], v [B, S, K, hd] in dtype.
  """
  d = x.shape[-1]
  grouped = [w.reshape(d, num_kv_heads, -1, head_dim) for w in kernels]
  g = grouped[0].shape[2]
  w = jnp.concatenate(grouped, axis=2).astype(dtype)
  out = jnp.einsum("bsd,dkgh->bskgh", x.astype(dtype), w)
  if biases[0] is not None:
    out = out + jnp.concatenate(
      [b.reshape(num_kv_heads, -1, head_dim) for b in biases], axis=1
    ).astype(dtype)
  b, s = x.shape[:2]
  q = out[:, :, :, :g].reshape(b, s, num_kv_heads * g, head_dim)
  return q, out[:, :, :, g], out[:, :, :, g + 1]


def _to_heads(q, k, v):
  """[B,S,H,hd], [B,T,K,hd] x2 -> scaled q [B,K,G,S,hd], k/v [B,K,T,hd] (head-major)."""
  b, s, h, hd = q.shape
  kv = k.shape[2]
  q = (q * jnp.asarray(hd**-0.5, q.dtype)).reshape(b, s, kv, h // kv, hd)
  return q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _from_heads(out):
  """[B,K,G,S,hd] -> [B,S,H*hd]."""
  b, kv, g, s, hd = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, s, kv * g * hd)


def _softmax_attention(q, k, v, allowed):
  """softmax(q k^T, masked) v, head-major: q [B,K,G,S,hd], k/v [B,K,T,hd], allowed bool[B,S,T]."""
  scores = jnp.einsum("bkgsd,bktd->bkgst", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(allowed[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgst,bktd->bkgsd", probs, v)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
  """Grouped-query softmax attention under an arbitrary mask.

  out[b,s,h] = sum_t softmax_t(q[b,s,h] . k[b,t,h//G] / sqrt(hd), masked) v[b,t,h//G]
  with G = H / K query heads per key/value head; scores and softmax in float32.

  Args:
    q: [B, S, H, hd] queries (after RoPE).
    k, v: [B, T, K, hd] keys (after RoPE) and values.
    allowed: bool[B, S, T], True where query s may attend to key t. A row with
      no allowed key gives a uniform average (no NaN).

  Returns:
    [B, S, H * hd] in q's dtype.
  """
  chex.assert_rank([q, k, v, allowed], [4, 4, 4, 3])
  qh, kh, vh = _to_heads(q, k, v)
  return _from_heads(_softmax_attention(qh, kh, vh, allowed))


# Names of the causal attention's saved values, for remat policies (`qwen._REMAT_POLICIES`).
ATTENTION_RESIDUALS = ("attn_out", "attn_row_max", "attn_inv_row_sum")


def _query_blocks(s: int, block_size: int):
  """[(start, stop)] of the query blocks of a length-s sequence."""
  return [(start, min(start + block_size, s)) for start in range(0, s, block_size)]


def _block_allowed(key_valid, start, stop):
  """bool[B, 1, 1, stop - start, stop]: query s in [start, stop) may see key t (t <= s, valid)."""
  causal = jnp.arange(stop)[None, :] <= jnp.arange(start, stop)[:, None]
  return (causal[None] & key_valid[:, None, :stop])[:, None, None]


def _block_scores(qh, kh, key_valid, start, stop):
  """Masked float32 scores of query block [start, stop) over keys [0, stop): [B,K,G,c,stop]."""
  scores = jnp.einsum(
    "bkgsd,bktd->bkgst",
    qh[:, :, :, start:stop],
    kh[:, :, :stop],
    preferred_element_type=jnp.float32,
  )
  return jnp.where(_block_allowed(key_valid, start, stop), scores, _MASKED)


def _causal_attention_fwd(qh, kh, vh, key_valid, block_size):
  """Forward pass of `_causal_attention`; saves out and the softmax statistics, not the scores."""
  outs, row_maxes, inv_row_sums = [], [], []
  for start, stop in _query_blocks(qh.shape[3], block_size):
    scores = _block_scores(qh, kh, key_valid, start, stop)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - row_max)  # unnormalised probabilities
    inv_row_sum = 1.0 / jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkgst,bktd->bkgsd", weights.astype(vh.dtype), vh[:, :, :stop])
    outs.append(out * inv_row_sum.astype(vh.dtype))
    row_maxes.append(row_max)
    inv_row_sums.append(inv_row_sum)
  out = checkpoint_name(jnp.concatenate(outs, axis=3), ATTENTION_RESIDUALS[0])
  row_max = checkpoint_name(jnp.concatenate(row_maxes, axis=3), ATTENTION_RESIDUALS[1])
  inv_row_sum = checkpoint_name(jnp.concatenate(inv_row_sums, axis=3), ATTENTION_RESIDUALS[2])
  return out, (qh, kh, vh, key_valid, out, row_max, inv_row_sum)


def _causal_attention_bwd(block_size, residuals, d_out):
  """Backward pass: recomputes each block's probabilities from the saved statistics.

  With P = softmax(S) (masked), O = P V and dO the cotangent of O:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dO * O)),  dQ = dS K,  dK = dS^T Q.
  dS is zero where the mask is False (the forward replaced those scores by a
  constant), which also covers rows with no allowed key.
  """
  qh, kh, vh, key_valid, out, row_max, inv_row_sum = residuals
  s = qh.shape[3]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  d_qs = []
  d_k = jnp.zeros(kh.shape, jnp.float32)
  d_v = jnp.zeros(vh.shape, jnp.float32)
  for start, stop in _query_blocks(s, block_size):
    rows = slice(start, stop)
    scores = _block_scores(qh, kh, key_valid, start, stop)
    probs = jnp.exp(scores - row_max[:, :, :, rows]) * inv_row_sum[:, :, :, rows]
    d_out_block = d_out[:, :, :, rows]
    d_v_block = jnp.einsum(
      "bkgst,bkgsd->bktd",
      probs.astype(vh.dtype),
      d_out_block,
      preferred_element_type=jnp.float32,
    )
    d_probs = jnp.einsum(
      "bkgsd,bktd->bkgst", d_out_block, vh[:, :, :stop], preferred_element_type=jnp.float32
    )
    d_scores = jnp.where(
      _block_allowed(key_valid, start, stop), probs * (d_probs - delta[:, :, :, rows]), 0.0
    ).astype(qh.dtype)
    d_qs.append(jnp.einsum("bkgst,bktd->bkgsd", d_scores, kh[:, :, :stop]))
    d_k_block = jnp.einsum(
      "bkgst,bkgsd->bktd", d_scores, qh[:, :, :, rows], preferred_element_type=jnp.float32
    )
    pad = ((0, 0), (0, 0), (0, s - stop), (0, 0))
    d_k = d_k + jnp.pad(d_k_block, pad)
    d_v = d_v + jnp.pad(d_v_block, pad)
  return jnp.concatenate(d_qs, axis=3), d_k.astype(kh.dtype), d_v.astype(vh.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _causal_attention(qh, kh, vh, key_valid, block_size):
  """Block-causal softmax attention, head-major; see `causal_attend`."""
  return _causal_attention_fwd(qh, kh, vh, key_valid, block_size)[0]


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def causal_attend(
  q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, block_size: int
) -> jax.Array:
  """Causal grouped-query self-attention, computed block by block.

  Same result as `attend` with allowed[b,s,t] = (t <= s) & key_valid[b,t], but
  the queries are split into blocks of `block_size` and block i only scores
  the keys [0, end of block i): about half the work of the full [S, S] score
  matrix, with blocks small enough to stay in cache on a CPU.

  The gradient is hand-written (flash-attention style): the forward pass
  keeps the output and each row's softmax max and 1/sum, not the [S, S]
  scores or probabilities, and the backward pass recomputes each block's
  probabilities from them. Under `jax.checkpoint`, save the names in
  `ATTENTION_RESIDUALS` to keep the forward pass from being recomputed.

  Args:
    q: [B, S, H, hd] queries; k, v: [B, S, K, hd] keys and values.
    key_valid: bool[B, S], False for pad tokens (never attended to). A query
      with no allowed key gets the uniform average of the keys up to its
      block's end (as `attend` does), and passes no gradient to q or k.
    block_size: query block length (static).

  Returns:
    [B, S, H * hd] in q's dtype.
  """
  chex.assert_rank([q, k, v, key_valid], [4, 4, 4, 2])
  qh, kh, vh = _to_heads(q, k, v)
  return _from_heads(_causal_attention(qh, kh, vh, key_valid, block_size))


def cached_attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  past_k: jax.Array,
  past_v: jax.Array,
  allowed: jax.Array,
) -> jax.Array:
  """Grouped-query attention of S new tokens over T cached slots and the S new keys.

  out = softmax([q past_k^T, q k^T] / sqrt(hd), masked by allowed) [past_v; v]
  per query head, with the kv head h // G: the same result as `attend` over
  the keys [cached slots..., new keys...], but the cache is only read (not
  concatenated with the new keys, not transposed): the scores of the cached
  slots and of the new keys are computed apart and share one float32 softmax.

  Args:
    q: [B, S, H, hd] queries of the new tokens (after RoPE).
    k, v: [B, S, K, hd] keys (after RoPE) and values of the new tokens.
    past_k, past_v: [B, K, T, hd] cached keys and values, head-major.
    allowed: bool[B, S, T + S], True where new token s may attend to cache
      slot t (t < T) or to new token t - T.

  Returns:
    [B, S, H * hd] in q's dtype.
  """
  chex.assert_rank([q, k, v, past_k, past_v, allowed], [4, 4, 4, 4, 4, 3])
  chex.assert_equal_shape([past_k, past_v])
  qh, kh, vh = _to_heads(q, k, v)
  t = past_k.shape[2]
  past_scores = jnp.einsum(
    "bkgsd,bktd->bkgst", qh, past_k.astype(q.dtype), preferred_element_type=jnp.float32
  )
  new_scores = jnp.einsum("bkgsd,bktd->bkgst", qh, kh, preferred_element_type=jnp.float32)
  scores = jnp.concatenate([past_scores, new_scores], axis=-1)
  scores = jnp.where(allowed[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1)
  past_out = jnp.einsum("bkgst,bktd->bkgsd", probs[..., :t].astype(q.dtype), past_v.astype(q.dtype))
  new_out = jnp.einsum("bkgst,bktd->bkgsd", probs[..., t:].astype(q.dtype), vh)
  return _from_heads(past_out + new_out)


NEW_KEY_BLOCK = 32  # new keys per block in `paged_attend`


@flax.struct.dataclass
class PagedMask:
  """What a layer needs to attend over a paged cache (`paged_attend`), in place of a mask.

  page_table:  int32[B, W], each row's pages in order (W a multiple of pages_per_block).
  lengths:     int32[B], each row's cached tokens (positions < lengths[b] are attended).
  new_allowed: bool[B, S, S], new token s may attend to new token s'.
  num_blocks:  int32 scalar, blocks of pages to visit (enough for the longest row).
  layer:       int32 scalar, the layer whose pool to read in the stacked pools (each layer
               gets the mask with its own index: `replace(layer=i)`).
  pages_per_block: static, pages per attention block.
  """

  page_table: jax.Array
  lengths: jax.Array
  new_allowed: jax.Array
  num_blocks: jax.Array
  layer: jax.Array
  pages_per_block: int = flax.struct.field(pytree_node=False, default=4)


def paged_attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  pool_k: jax.Array,
  pool_v: jax.Array,
  paged: PagedMask,
) -> jax.Array:
  """Grouped-query attention of S new tokens over each row's paged cache and the new keys.

  out = softmax([q K_b^T, q k^T] / sqrt(hd), masked) [V_b; v], where K_b, V_b are row b's
  cached positions 0 .. lengths[b] - 1, read from its pages (`paged.page_table`) one block of
  `pages_per_block` pages at a time, under an online softmax: with running max m, sum l and
  output o, a block with scores x updates m' = max(m, max x), l' = l e^(m - m') +
  sum_allowed e^(x - m'), o' = o e^(m - m') + sum_allowed e^(x - m') v; out = o / l. The new
  keys come last, in blocks of NEW_KEY_BLOCK. `paged.num_blocks` blocks are visited (a `fori_loop`, so the work follows
  the longest row, not the page table's width); a block with no allowed slot leaves
  (m, l, o) exactly as they were, so a row's output is bit-identical whatever the other rows
  and however many blocks run.

  Args:
    q: [B, S, H, hd] queries of the new tokens (after RoPE).
    k, v: [B, S, K, hd] keys (after RoPE) and values of the new tokens.
    pool_k, pool_v: [L, pages, K, page_size, hd] every layer's page pool; the blocks of
      layer `paged.layer` are gathered straight from the stack (a slice of the layer's whole
      pool first would copy it, every layer of every decode step).
    paged: the `PagedMask`.

  Returns:
    [B, S, H * hd] in q's dtype.
  """
  chex.assert_rank([q, k, v, pool_k, pool_v], [4, 4, 4, 5, 5])
  qh, kh, vh = _to_heads(q, k, v)
  b, kv, g, s, hd = qh.shape
  page = pool_k.shape[3]
  ppb = paged.pages_per_block
  block = ppb * page

  def absorb(carry, keys, values, ok):
    """(m, l, o) after the keys [B, K, C, hd] of one block (ok bool[B, S, C])."""
    m, l, o = carry
    scores = jnp.einsum(
      "bkgsd,bkcd->bkgsc", qh, keys.astype(q.dtype), preferred_element_type=jnp.float32
    )
    ok = ok[:, None, None]
    m_new = jnp.maximum(m, jnp.max(jnp.where(ok, scores, _MASKED), axis=-1))
    p = jnp.where(ok, jnp.exp(scores - m_new[..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    l = l * scale + jnp.sum(p, axis=-1)
    o = o * scale[..., None] + jnp.einsum(
      "bkgsc,bkcd->bkgsd",
      p.astype(q.dtype),
      values.astype(q.dtype),
      preferred_element_type=jnp.float32,
    )
    return m_new, l, o

  def read(pool, pages):  # [L, pages, K, page, hd] x int32[B, ppb] -> [B, K, ppb * page, hd]
    # One gather of the block's pages from the pools seen as [L * pages, K, page, hd] (a
    # bitcast): [B, ppb, K, page, hd].
    flat = pool.reshape((-1,) + pool.shape[2:])
    rows = jnp.take(flat, paged.layer * pool.shape[1] + pages, axis=0)
    return rows.transpose(0, 2, 1, 3, 4).reshape(b, kv, block, hd)

  def past_block(j, carry):
    pages = jax.lax.dynamic_slice_in_dim(paged.page_table, j * ppb, ppb, axis=1)
    positions = j * block + jnp.arange(block)
    ok = positions[None, :] < paged.lengths[:, None]  # [B, C]
    ok = jnp.broadcast_to(ok[:, None, :], (b, s, block))
    return absorb(carry, read(pool_k, pages), read(pool_v, pages), ok)

  carry = (
    jnp.full((b, kv, g, s), _MASKED, jnp.float32),
    jnp.zeros((b, kv, g, s), jnp.float32),
    jnp.zeros((b, kv, g, s, hd), jnp.float32),
  )
  carry = jax.lax.fori_loop(0, paged.num_blocks, past_block, carry)
  # The new keys too, in blocks of NEW_KEY_BLOCK (masked ones past the end): a row's numbers
  # do not depend on how wide the prefill call that carried its tokens was.
  n_new = -(-s // NEW_KEY_BLOCK)
  pad = n_new * NEW_KEY_BLOCK - s
  kh_p = jnp.pad(kh, ((0, 0), (0, 0), (0, pad), (0, 0)))
  vh_p = jnp.pad(vh, ((0, 0), (0, 0), (0, pad), (0, 0)))
  new_ok = jnp.pad(paged.new_allowed, ((0, 0), (0, 0), (0, pad)))
  for j in range(n_new):
    cut = slice(j * NEW_KEY_BLOCK, (j + 1) * NEW_KEY_BLOCK)
    carry = absorb(carry, kh_p[:, :, cut], vh_p[:, :, cut], new_ok[..., cut])
  _, l, o = carry
  out = o / jnp.where(l > 0, l, 1.0)[..., None]
  return _from_heads(out.astype(q.dtype))


class Attention(nn.Module):
  """GQA self-attention with optional q/k/v bias (Qwen2), q/k RMSNorm (Qwen3) and o_proj bias.

  The o_proj bias exists only for Qwen3 with attention_bias=True
  (`ModelConfig.o_proj_bias`), where transformers biases all four projections.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, mask, past_k=None, past_v=None):
    """Attention of the S new tokens over past + new keys.

    Args:
      x: [B, S, D] normed hidden states (compute dtype).
      cos, sin: float32[B, S, 1, hd] RoPE tables of the new tokens.
      mask: without cache, bool[B, S] key validity (causal attention over
        the S tokens, see `causal_attend`); with cache, bool[B, S, T + S],
        True where new token s may attend to cache slot t (t < T) or to new
        token t - T (see `cached_attend`).
      past_k, past_v: optional [B, K, T, hd] this layer's cache, head-major;
        read only (the caller stores the returned k/v). With a `PagedMask`, every
        layer's page pools [L, pages, K, page_size, hd] (`paged_attend`).

    Returns:
      (out [B, S, D], k [B, S, K, hd], v [B, S, K, hd]): the new tokens' keys
      (after RoPE) and values, for the caller to store in the cache.
    """
    c = self.config
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    d = x.shape[-1]
    params = [
      _Kernel(d, n * c.head_dim, c.attention_bias, pdt, name=name)()
      for name, n in (
        ("q_proj", c.num_heads),
        ("k_proj", c.num_kv_heads),
        ("v_proj", c.num_kv_heads),
      )
    ]
    q, k, v = _grouped_qkv(
      x, [w for w, _ in params], [bias for _, bias in params], c.num_kv_heads, c.head_dim, dt
    )
    heads = {"q_proj": q, "k_proj": k, "v_proj": v}
    for name, y in heads.items():
      delta = _lora_delta(self, name, x, c.lora_scale, dt)
      if delta is not None:
        heads[name] = y + delta.reshape(y.shape)
    q, k, v = heads["q_proj"], heads["k_proj"], heads["v_proj"]
    if c.qk_norm:
      q = RMSNorm(c.rms_norm_eps, dt, pdt, name="q_norm")(q)
      k = RMSNorm(c.rms_norm_eps, dt, pdt, name="k_norm")(k)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if past_k is None:
      out = causal_attend(q, k, v, mask, c.attn_block_size)
    elif isinstance(mask, PagedMask):
      out = paged_attend(q, k, v, past_k, past_v, mask)
    else:
      out = cached_attend(q, k, v, past_k, past_v, mask)
    o_kernel, o_bias = _Kernel(out.shape[-1], c.hidden_size, c.o_proj_bias, pdt, name="o_proj")()
    projected = _dense(out, o_kernel, o_bias, dt)
    return _plus(projected, _lora_delta(self, "o_proj", out, c.lora_scale, dt)), k, v


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    d, f = x.shape[-1], c.intermediate_size
    # gate and up as one matmul: kernels stacked [D, 2, F] (F stays the sharded axis).
    w = jnp.stack(
      [_Kernel(d, f, False, pdt, name=n)()[0] for n in ("gate_proj", "up_proj")], axis=1
    ).astype(dt)
    gate_up = jnp.einsum("bsd,dcf->bscf", x.astype(dt), w)
    gate = _plus(gate_up[:, :, 0], _lora_delta(self, "gate_proj", x, c.lora_scale, dt))
    up = _plus(gate_up[:, :, 1], _lora_delta(self, "up_proj", x, c.lora_scale, dt))
    hidden = sharding.constrain(nn.silu(gate) * up, sharding.MLP_HIDDEN)
    down = _dense(hidden, _Kernel(f, c.hidden_size, False, pdt, name="down_proj")()[0], None, dt)
    return _plus(down, _lora_delta(self, "down_proj", hidden, c.lora_scale, dt))


class DecoderLayer(nn.Module):
  """Pre-norm block: x += attn(norm(x)); x += mlp(norm(x))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, mask, past_k=None, past_v=None):
    """See `Attention`; returns (x [B, S, D], k_new, v_new)."""
    c = self.config
    dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    h = RMSNorm(c.rms_norm_eps, dt, pdt, name="input_norm")(x)
    attn_out, k, v = Attention(c, name="attn")(h, cos, sin, mask, past_k, past_v)
    x = x + attn_out
    h = RMSNorm(c.rms_norm_eps, dt, pdt, name="post_attn_norm")(x)
    x = x + MLP(c, name="mlp")(h)
    return sharding.constrain(x, sharding.HIDDEN), k, v
