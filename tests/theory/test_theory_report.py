"""Summary statistics on hand-made curves."""

import numpy as np
import pytest

from seeupo_jax.theory import report


def test_summarise_by_hand():
  curves = np.array(
    [
      [0.5, 0.96, 0.95, 1.0],  # reaches; one drop; 0.95 at iteration 1
      [0.5, 0.6, 0.94, 0.97],  # misses 0.99; 0.95 at iteration 3
      [0.5, 0.5, 0.5, 0.5],  # never gets to 0.95; no drop (flat)
    ]
  )
  s = report.summarise(curves)
  assert s.reach_share == pytest.approx(1 / 3)
  final = np.array([1.0, 0.97, 0.5])
  assert s.final_mean == pytest.approx(final.mean())
  assert s.final_ci == pytest.approx(1.96 * final.std(ddof=1) / np.sqrt(3))
  assert s.violation_share == pytest.approx(1 / 9)
  assert s.iters_to_95 == pytest.approx(2.0)  # median of 1 and 3
  assert s.share_to_95 == pytest.approx(2 / 3)


def test_drop_threshold_is_strict():
  flat_noise = np.array([[0.5, 0.5 - 5e-7, 0.5 - 2e-6 - 5e-7]])
  flat_noise = np.concatenate([flat_noise, flat_noise])
  assert report.summarise(flat_noise).violation_share == pytest.approx(0.5)


def test_format_table_and_plot(tmp_path):
  s = report.summarise(np.array([[0.2, 1.0], [0.2, 0.9]]))
  text = report.format_table([("seeupo", "random", 3.0, s)])
  assert "| seeupo | random | 3 | 50.0% |" in text
  path = tmp_path / "c.png"
  report.plot_curves(str(path), "random", {"seeupo": np.array([[0.2, 1.0]])})
  assert path.read_bytes()[:4] == b"\x89PNG"


def test_bad_curves_shape():
  with pytest.raises(ValueError, match="iterations"):
    report.summarise(np.zeros(5))
