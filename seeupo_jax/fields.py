"""One way for a config dataclass to say what each field allows, and one check of it.

    @dataclasses.dataclass(frozen=True)
    class RolloutConfig:
      max_turns: int = fields.field(fields.int_at_least(1))           # no default
      env_workers: int = fields.field(fields.int_at_least(1), 16)

      def __post_init__(self):
        fields.check(self)   # FieldError: "RolloutConfig.max_turns=0; allowed: an int >= 1"

`check` reads each field's `Allowed` (its metadata) and raises one `FieldError` naming every
bad field, as "<prefix>.<field>=<value>; allowed: <what>". A check that involves several fields
stays in the class's `__post_init__` and raises `FieldError.of(...)`, so every refusal has the
same shape. The training program's typed config (`training/config.py`) checks its whole tree
with the same function and names dotted keys (`rollout.max_turns=0; allowed: an int >= 1`);
`FieldError.under(prefix)` re-names a library dataclass's refusal after the config key.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

METADATA_KEY = "allowed"


class Allowed(NamedTuple):
  """What one field allows: `ok(value)` and the words the refusal uses."""

  ok: Callable[[Any], bool]
  description: str


class Problem(NamedTuple):
  """One refused field: its name, its value and what it allows."""

  name: str
  value: Any
  allowed: str


class FieldError(ValueError):
  """A config field's value is not allowed; the message names each field and what it allows.

  Attributes:
    prefix: what the field names are relative to ("RolloutConfig", "rollout", ...).
    problems: the refused fields, in field order.
  """

  def __init__(self, prefix: str, problems: Sequence[Problem]):
    self.prefix = prefix
    self.problems = tuple(problems)
    super().__init__(
      "; ".join(f"{_dotted(prefix, p.name)}={p.value!r}; allowed: {p.allowed}" for p in problems)
    )

  @classmethod
  def of(cls, prefix: str, name: str, value: Any, allowed: str) -> "FieldError":
    """The refusal of one field (a check that involves other fields, phrased for this one)."""
    return cls(prefix, [Problem(name, value, allowed)])

  def under(self, prefix: str) -> "FieldError":
    """The same refusal with the fields named under `prefix` (e.g. the config section)."""
    return FieldError(prefix, self.problems)


def _dotted(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


def field(allowed: Allowed, default: Any = dataclasses.MISSING, **kwargs) -> Any:
  """A dataclass field that allows what `allowed` says (with `default`, if given)."""
  return dataclasses.field(default=default, metadata={METADATA_KEY: allowed}, **kwargs)


def allowed_of(cls, name: str) -> Allowed:
  """The `Allowed` of field `name` of dataclass `cls` (to declare the same value elsewhere)."""
  for f in dataclasses.fields(cls):
    if f.name == name and METADATA_KEY in f.metadata:
      return f.metadata[METADATA_KEY]
  raise KeyError(f"{cls.__name__}.{name} declares no Allowed")


def default_of(cls, name: str) -> Any:
  """The default of field `name` of dataclass `cls` (`dataclasses.MISSING` if it has none), so
  another declaration can take it by reference instead of repeating it."""
  for f in dataclasses.fields(cls):
    if f.name == name:
      return f.default
  raise KeyError(f"{cls.__name__} has no field {name!r}")


def problems(obj) -> list[Problem]:
  """The fields of dataclass instance `obj` whose values their `Allowed` refuses."""
  out = []
  for f in dataclasses.fields(obj):
    allowed = f.metadata.get(METADATA_KEY)
    value = getattr(obj, f.name)
    if allowed is not None and not allowed.ok(value):
      out.append(Problem(f.name, value, allowed.description))
  return out


def check(obj, prefix: str | None = None) -> None:
  """Raises FieldError naming every field of `obj` that its `Allowed` refuses.

  Args:
    obj: a dataclass instance whose fields were made with `field`.
    prefix: what the names are relative to; None: the class's name.
  """
  found = problems(obj)
  if found:
    raise FieldError(type(obj).__name__ if prefix is None else prefix, found)


# --- what a field allows ---------------------------------------------------------------------


def is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
  """An int or float (not a bool), finite."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


BOOL = Allowed(lambda v: isinstance(v, bool), "True or False")
INT = Allowed(is_int, "an int")
STRING = Allowed(lambda v: isinstance(v, str), "a string")
NUMBER = Allowed(is_number, "a finite number")


def int_at_least(low: int) -> Allowed:
  return Allowed(lambda v: is_int(v) and v >= low, f"an int >= {low}")


def int_in(low: int, high: int) -> Allowed:
  return Allowed(lambda v: is_int(v) and low <= v <= high, f"an int in [{low}, {high}]")


def number_above(low: float) -> Allowed:
  return Allowed(lambda v: is_number(v) and v > low, f"a finite number > {low:g}")


def number_at_least(low: float) -> Allowed:
  return Allowed(lambda v: is_number(v) and v >= low, f"a finite number >= {low:g}")


def number_in(low: float, high: float, *, open_low: bool = False, open_high: bool = False):
  """A finite number in [low, high], either end open as asked ("(0, 1]", "[0, 1)")."""

  def ok(v):
    if not is_number(v):
      return False
    above = v > low if open_low else v >= low
    below = v < high if open_high else v <= high
    return above and below

  brackets = ("(" if open_low else "[", ")" if open_high else "]")
  return Allowed(ok, f"a number in {brackets[0]}{low:g}, {high:g}{brackets[1]}")


def one_of(values: Sequence[Any]) -> Allowed:
  values = tuple(values)
  return Allowed(
    lambda v: any(v == x and type(v) is type(x) for x in values), f"one of {list(values)}"
  )


def optional(allowed: Allowed) -> Allowed:
  """None, or what `allowed` allows."""
  return Allowed(lambda v: v is None or allowed.ok(v), f"None or {allowed.description}")


def tuple_of(allowed: Allowed) -> Allowed:
  """A tuple whose every item `allowed` allows."""
  return Allowed(
    lambda v: isinstance(v, tuple) and all(allowed.ok(x) for x in v),
    f"a tuple of items each {allowed.description}",
  )


def described(allowed: Allowed, note: str) -> Allowed:
  """`allowed` with a note after its description ("an int >= 0 (0: none)")."""
  return Allowed(allowed.ok, f"{allowed.description} ({note})")
