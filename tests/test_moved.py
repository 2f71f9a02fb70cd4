"""Old import paths of moved modules resolve to the module at its new path (`seeupo_jax._moved`)."""

import importlib
import sys

import pytest

import seeupo_jax  # (importing it installs the finder)
from seeupo_jax import _moved


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED_MODULES.items()))
def test_every_moved_path_imports_the_module_at_its_new_path(old, new):
  assert importlib.import_module(old) is importlib.import_module(new)


def test_an_alias_is_the_same_module_object_and_keeps_its_own_spec(monkeypatch):
  monkeypatch.setitem(_moved.MOVED_MODULES, "seeupo_jax.an_old_name_of_losses", "seeupo_jax.losses")
  monkeypatch.delitem(sys.modules, "seeupo_jax.an_old_name_of_losses", raising=False)
  import seeupo_jax.losses as losses

  old = importlib.import_module("seeupo_jax.an_old_name_of_losses")
  assert old is losses
  assert losses.__spec__.name == "seeupo_jax.losses"
  from seeupo_jax.an_old_name_of_losses import token_clip_loss  # noqa: F401

  sys.modules.pop("seeupo_jax.an_old_name_of_losses", None)


def test_a_path_that_never_existed_still_fails():
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("seeupo_jax.no_such_module_anywhere")


def test_an_old_path_gives_the_new_module_even_where_a_file_is_left_at_the_old_path(
  monkeypatch, tmp_path
):
  # A stale copy at the old path, found by the package's path (as an editable install of another
  # checkout finds its own files): the moved path still resolves to the module at its new path.
  (tmp_path / "an_old_name_of_losses.py").write_text("STALE = True\n")
  monkeypatch.setattr(seeupo_jax, "__path__", [*seeupo_jax.__path__, str(tmp_path)])
  monkeypatch.setitem(_moved.MOVED_MODULES, "seeupo_jax.an_old_name_of_losses", "seeupo_jax.losses")
  monkeypatch.delitem(sys.modules, "seeupo_jax.an_old_name_of_losses", raising=False)
  import seeupo_jax.losses as losses

  assert importlib.import_module("seeupo_jax.an_old_name_of_losses") is losses
  sys.modules.pop("seeupo_jax.an_old_name_of_losses", None)


def test_the_old_teacher_forcing_reference_path_gives_the_filtered_logprob():
  """`seeupo_jax.sampling_probs.sampled_logprob` (its old home) is `sampling.sampled_logprob`."""
  from seeupo_jax import sampling
  from seeupo_jax.sampling_probs import sampled_logprob

  assert sampled_logprob is sampling.sampled_logprob


def test_geometry_given_to_the_rollout_config_reaches_the_session_config():
  """`RolloutConfig(decode_slots=5, page_size=8)` (the sampler's geometry before it moved to
  `sampling.SessionConfig`) still sets the session's rows and pages; geometry given to
  `session_config` wins; SessionConfig checks the values."""
  from seeupo_jax import fields
  from seeupo_jax import rollout

  config = rollout.RolloutConfig(max_turns=3, decode_slots=5, page_size=8, prefill_rows=2)
  session = config.session_config()
  assert (session.rows, session.page_size, session.prefill_rows) == (5, 8, 2)
  assert session.max_context_tokens == config.max_context_tokens
  assert config.session_config(rows=7, page_size=16).rows == 7
  default = rollout.RolloutConfig(max_turns=3).session_config()
  assert (default.rows, default.page_size) == (64, 32)
  with pytest.raises(fields.FieldError, match="rows"):
    rollout.RolloutConfig(max_turns=3, decode_slots=0).session_config()
