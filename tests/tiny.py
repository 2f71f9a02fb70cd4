"""The tiny model and tokenizer the tests build on: one declaration of each, shared by the suite.

    import tiny
    config = tiny.model_config()                  # the qwen3-tiny preset
    config = tiny.model_config(dtype="bfloat16")  # with numerics overrides (`get_preset`'s)
    tok = tiny.tokenizer()                        # a new offline default tokenizer (512 ids)

Test functions take the tokenizer as the `tok` fixture (and its `ChatTokens` as `chat`), from
`tests/conftest.py`; absl `TestCase`s and module-level constants call these functions. The
shapes are the ones the suite's compilation cache holds: change them and every test compiles
afresh.
"""

from __future__ import annotations

from seeupo_jax.models import config as config_lib

PRESET = "qwen3-tiny"
"""The model preset of the tests: 2 layers, hidden 64, vocab 512 (the default tokenizer's size)."""


def model_config(**overrides) -> config_lib.ModelConfig:
  """The `PRESET` model config, with numerics `overrides` (dtype, param_dtype, remat, ...)."""
  return config_lib.get_preset(PRESET, **overrides)


def tokenizer():
  """A new instance of the offline default tokenizer (`build_default_tokenizer`, 512 ids).

  Tests that change a tokenizer (its chat template, say) take a new one from here, never the
  shared `tok` fixture.
  """
  from seeupo_jax.text import tokenizer as tokenizer_lib  # noqa: PLC0415  (imports transformers)

  return tokenizer_lib.build_default_tokenizer()
