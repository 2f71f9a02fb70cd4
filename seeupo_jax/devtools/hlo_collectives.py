"""The collective ops of a compiled XLA program and the bytes they move, read from its HLO text.

    compiled = jax.jit(fn).lower(*args).compile()
    ops = hlo_collectives.collectives(compiled.as_text())        # one run of the program
    ops = hlo_collectives.collectives(compiled.as_text(), root=hlo_collectives.dynamic_loop(text))
    totals = hlo_collectives.summarize(ops)   # {"all-gather": {"ops": ..., "bytes": ..., ...}, ...}

An op inside a loop body counts once per trip: a `while` with a known trip count
(XLA writes it in the op's `backend_config`, e.g. a `lax.scan` over the layers)
multiplies everything in its body and condition; a `while` without one (a
`lax.while_loop` that stops on a data-dependent condition, such as the
sampler's decode loop) is counted once, i.e. per iteration. `dynamic_loop`
names the body of the program's one such loop, so that `root=` gives the
collectives of one iteration of it (one decode step).

Bytes are per device. `operand_bytes` is the size of the op's operands on one
device (for an all-gather, its shard); `link_bytes` is what one device sends
(= receives) over the interconnect under ring algorithms on a group of n
devices:

    all-gather          operand x (n - 1)            (n - 1 shards arrive)
    reduce-scatter      operand x (n - 1) / n
    all-reduce          operand x 2 (n - 1) / n      (reduce-scatter + all-gather)
    all-to-all          operand x (n - 1) / n
    collective-permute  operand
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Optional

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of the program.

  kind: one of `KINDS` (an async `-start` op counts as its kind; `-done` is skipped).
  name: the HLO instruction name.
  computation: the HLO computation that holds it.
  operand_bytes: int, bytes of its operands on one device, per execution.
  group_size: n, the devices in each of its replica groups.
  count: executions per run of the root computation (the trip counts of the enclosing loops).
  promoted: a reduction XLA widened (its reducer is named `*_promoted`): XLA:CPU runs bf16
    all-reduces in float32, so the values it carries are narrower than `operand_bytes` says
    (a GPU reduces them in bf16, at half the bytes).
  """

  kind: str
  name: str
  computation: str
  operand_bytes: int
  group_size: int
  count: int
  promoted: bool = False

  @property
  def link_bytes(self) -> float:
    """Bytes one device sends per execution (ring algorithms, see the module docstring)."""
    n, b = self.group_size, self.operand_bytes
    if n <= 1:
      return 0.0
    if self.kind == "all-gather":
      return float(b * (n - 1))
    if self.kind == "all-reduce":
      return 2.0 * b * (n - 1) / n
    if self.kind in ("reduce-scatter", "all-to-all"):
      return b * (n - 1) / n
    return float(b)  # collective-permute


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: str
  op: str
  operands: list[str]
  attributes: str


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (`f32[8,4]{1,0}`, or a tuple of them); token/opaque: 0."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _DTYPE_BYTES:
      continue
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += size * _DTYPE_BYTES[dtype]
  return int(math.ceil(total))


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start] ('(' or '{')."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _split_top(text: str) -> list[str]:
  """Splits on the commas outside brackets."""
  parts, depth, current = [], 0, []
  for c in text:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(c)
  if "".join(current).strip():
    parts.append("".join(current))
  return parts


def _parse_instruction(line: str) -> Optional[_Instruction]:
  m = _INSTRUCTION.match(line)
  if m is None:
    return None
  rest = line[m.end() :]
  if rest.startswith("("):  # a tuple shape
    end = _balanced(rest, 0)
  else:
    end = rest.index(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  op = rest[:paren].strip()
  close = _balanced(rest, paren)
  operands = []
  for part in _split_top(rest[paren + 1 : close - 1]):
    names = re.findall(r"%([\w.\-]+)", part)
    operands.append(names[-1] if names else part.strip())
  return _Instruction(m.group(2), shape, op, operands, rest[close:])


def parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str, int]:
  """(computation name -> its instructions, the entry computation's name, num_partitions)."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  partitions = 1
  for line in hlo_text.splitlines():
    if line.startswith("HloModule"):
      m = re.search(r"num_partitions=(\d+)", line)
      partitions = int(m.group(1)) if m else 1
      continue
    if not line.startswith((" ", "\t")) and line.rstrip().endswith("{"):
      m = _HEADER.match(line)
      if m:
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry, partitions


def _group_size(attributes: str, partitions: int) -> int:
  """Devices per replica group, from any of XLA's three printings of `replica_groups`."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if m:  # mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
    sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
  if m:  # iota: [groups, size]<=[devices]
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
  if m:  # explicit {{0,1},{2,3}}
    return len([x for x in m.group(1).split(",") if x.strip()])
  return partitions  # {} = one group of every device


def _trip_count(attributes: str) -> Optional[int]:
  m = re.search(r"backend_config=(\{.*\})", attributes)
  if not m:
    return None
  try:
    config = json.loads(m.group(1))
  except ValueError:
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', m.group(1))
    return int(found.group(1)) if found else None
  n = config.get("known_trip_count", {}).get("n")
  return int(n) if n is not None else None


def _called(instruction: _Instruction) -> list[tuple[str, Optional[int]]]:
  """(computation, trip count or None) called by one instruction (reducers of collectives and
  fusion bodies excluded: they hold no collectives)."""
  a = instruction.attributes
  if instruction.op == "while":
    body = re.search(r"body=%?([\w.\-]+)", a).group(1)
    cond = re.search(r"condition=%?([\w.\-]+)", a).group(1)
    trips = _trip_count(a)
    return [(body, trips), (cond, None if trips is None else trips + 1)]
  if instruction.op in ("call", "async-start", "custom-call"):
    found = re.findall(r"(?:to_apply|calls|called_computations)=\{?%?([\w.\-]+)", a)
    return [(c, 1) for c in found]
  if instruction.op == "conditional":
    branches = re.search(r"branch_computations=\{([^}]*)\}", a)
    if branches:
      return [(c, 1) for c in re.findall(r"%?([\w.\-]+)", branches.group(1))]
    return [(c, 1) for c in re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", a)]
  return []


def dynamic_loops(hlo_text: str) -> list[str]:
  """Bodies of the `while` ops without a known trip count (e.g. the sampler's decode loop)."""
  computations, _, _ = parse(hlo_text)
  return [
    re.search(r"body=%?([\w.\-]+)", i.attributes).group(1)
    for instructions in computations.values()
    for i in instructions
    if i.op == "while" and _trip_count(i.attributes) is None
  ]


def _reachable(computations: dict, start: str) -> set[str]:
  """The computations that `start` runs, directly or through calls and loops (itself included)."""
  seen, stack = set(), [start]
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    for instruction in computations.get(name, []):
      stack.extend(callee for callee, _ in _called(instruction))
  return seen


def dynamic_loop(hlo_text: str) -> str:
  """The body of the program's outermost loop without a known trip count: the one no other
  such loop runs (e.g. the sampler's decode loop, which runs the paged attention's loop over
  page blocks, whose trip count follows the rows' lengths, in every step; `collectives` counts
  the inner loop's ops once per outer iteration).

  Raises:
    ValueError: there are none, or several outermost ones.
  """
  computations, _, _ = parse(hlo_text)
  bodies = dynamic_loops(hlo_text)
  nested = set()
  for body in bodies:
    nested |= _reachable(computations, body) - {body}
  outermost = [body for body in bodies if body not in nested]
  if len(outermost) != 1:
    raise ValueError(
      f"expected one outermost while loop without a known trip count, found {len(outermost)}"
    )
  return outermost[0]


def collectives(hlo_text: str, root: Optional[str] = None) -> list[Collective]:
  """Every collective op executed by one run of `root` (default: the entry computation).

  Loops inside `root` multiply `count` by their known trip counts (a loop without one: once).
  When `root` is a loop body, its condition is not included.
  """
  computations, entry, partitions = parse(hlo_text)
  shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}
  root = entry if root is None else root
  if root not in computations:
    raise ValueError(f"no computation {root!r} in the HLO text")
  found: list[Collective] = []

  def visit(name: str, count: int, depth: int = 0):
    if depth > 64:
      raise ValueError("HLO call graph too deep")
    for i in computations.get(name, []):
      kind = i.op.removesuffix("-start")
      if kind in KINDS and not i.op.endswith("-done"):
        operand_bytes = sum(shape_bytes(shapes.get(o, o)) for o in i.operands)
        n = 2 if kind == "collective-permute" else _group_size(i.attributes, partitions)
        promoted = bool(re.search(r"to_apply=%?[\w.\-]*_promoted\b", i.attributes))
        found.append(Collective(kind, i.name, name, operand_bytes, n, count, promoted))
      for callee, trips in _called(i):
        visit(callee, count * (1 if trips is None else trips), depth + 1)

  visit(root, 1)
  return found


def summarize(ops: list[Collective]) -> dict[str, dict[str, float]]:
  """Per kind (and "total"): ops executed, operand bytes and link bytes, all per device.

  `promoted_link_bytes` is the part of `link_bytes` carried by promoted reductions.
  """
  out: dict[str, dict[str, float]] = collections.defaultdict(
    lambda: {"ops": 0, "operand_bytes": 0, "link_bytes": 0.0, "promoted_link_bytes": 0.0}
  )
  for op in ops:
    for key in (op.kind, "total"):
      out[key]["ops"] += op.count
      out[key]["operand_bytes"] += op.count * op.operand_bytes
      out[key]["link_bytes"] += op.count * op.link_bytes
      if op.promoted:
        out[key]["promoted_link_bytes"] += op.count * op.link_bytes
  return {k: dict(v) for k, v in sorted(out.items())}
