"""The table of `benchmarks/device_check.sh`: each step's figures from its output, as Markdown.

    python benchmarks/device_table.py OUT      # reads OUT/*.out, writes OUT/device_check.md

Each step's output ends with the JSON report of its benchmark (bench_model, bench_sampler,
bench_learner, bench_train); the parity step's figure is pytest's summary line; a step with
neither (it failed, or it ran no benchmark) is listed as such. The table is printed too.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys


def last_report(text: str):
  """The last JSON object that starts at the beginning of a line of `text` (None if none)."""
  decoder = json.JSONDecoder()
  starts = [i for i, c in enumerate(text) if c == "{" and (i == 0 or text[i - 1] == "\n")]
  for start in reversed(starts):
    try:
      report, _ = decoder.raw_decode(text[start:])
    except json.JSONDecodeError:
      continue
    if isinstance(report, dict):
      return report
  return None


def pytest_summary(text: str):
  """pytest's last summary line ("11 passed, 17 deselected in 45.40s"), without its rules."""
  for line in reversed(text.splitlines()):
    line = line.strip().strip("=").strip()
    if re.match(r"^\d+ (passed|failed|error|errors|skipped|deselected)\b.* in [\d.]+s", line):
      return line
  return None


def figures(step: str, report: dict) -> str:
  """The step's headline figures, in words."""
  if "mfu" in report:
    return (
      f"MFU {report['mfu']:.3f}, {report['jax_tokens_per_s']:.0f} tokens/s "
      f"({report['batch']} x {report['seq']}, {report['device']})"
    )
  if "jax_tok_per_s" in report:
    return f"{report['jax_tok_per_s']:.0f} tokens/s decoding ({report.get('jax_s')} s a call)"
  if "turns" in report:
    parts = []
    for turns, row in report["turns"].items():
      part = (
        f"T={turns}: SeeUPO {row['seeupo_s']:.3f} s, GSPO {row['gspo_s']:.3f} s "
        f"({row['seeupo_over_gspo']}x)"
      )
      if "seeupo_mfu" in row:
        part += f", SeeUPO MFU {row['seeupo_mfu']:.3f}"
      parts.append(part)
    return "; ".join(parts)
  if "algorithms" in report:
    return "; ".join(
      f"{name}: {row['iteration_s']:.3f} s an iteration (rollout {row['median_s']['rollout']:.3f} s)"
      for name, row in report["algorithms"].items()
    )
  return ", ".join(f"{k} {v}" for k, v in list(report.items())[:6])


def table(out: pathlib.Path) -> str:
  lines = ["| step | figures |", "|---|---|"]
  for path in sorted(out.glob("*.out"), key=lambda p: p.stat().st_mtime):
    step = path.stem.replace("_", " ")
    if step in ("devices", "table"):
      continue
    output = path.read_text(errors="replace")
    report = last_report(output)
    summary = pytest_summary(output)
    if report:
      text = figures(step, report)
    elif summary:
      text = summary
    else:
      text = "no report (see device_check.log)"
    lines.append(f"| {step} | {text} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    print(f"usage: {argv[0]} OUT", file=sys.stderr)
    return 2
  out = pathlib.Path(argv[1])
  text = table(out)
  (out / "device_check.md").write_text(text)
  print(text, end="")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
