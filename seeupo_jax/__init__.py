"""seeupo-jax: SeeUPO (arXiv 2602.06554) in JAX/Flax."""

import logging as _logging

__version__ = "0.1.0"


class _NoTorchAdvice(_logging.Filter):
  """Drops transformers' "PyTorch was not found..." advice, logged when it is imported without
  torch: seeupo-jax takes only tokenizers and configs from transformers, which need no torch."""

  def filter(self, record: _logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found")


# Before any module of the package imports transformers (text/tokenizer.py, text/chat_tokens.py):
# the filter sits on the logger that transformers' import logs to.
_logging.getLogger("transformers").addFilter(_NoTorchAdvice())

from seeupo_jax import _moved  # noqa: E402

_moved.install()
