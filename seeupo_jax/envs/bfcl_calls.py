"""BFCL tool calls: parse the model's `<tool_call>` blocks, check them, build executor strings.

The official BFCL executor (`multi_turn_utils.execute_multi_turn_func_call`)
runs calls given as Python source strings with `eval`. The reference code of
the paper fed it strings cut out of the model's text, so a reply could run any
Python (defect 7 in `docs/seeupo.md`). Here the model's text never reaches it:

  1. `parse_tool_calls` finds the `<tool_call>...</tool_call>` blocks (Qwen's
     Hermes format) and decodes each with `json` (NaN and Infinity refused,
     containers nested at most `MAX_NESTING` deep);
  2. `check_call` accepts a call only if its name is one of the task's
     documented functions, its argument names are that function's parameters
     (the required ones all present), every value is a JSON literal (numbers
     finite) of the parameter's documented type (`DOC_TYPES`; array items and
     documented object fields too), except where the data's own ground truth
     breaks its docs (`DATA_TYPE_EXCEPTIONS`);
  3. `call_source` then writes the executor's string itself, from the checked
     parts: the name (an identifier from the docs) and `repr()` of each parsed
     value, and re-parses its own output with `ast` to prove it is a single call
     of that name with literal arguments.

`read_reply` runs the three steps over one reply and never raises: anything
that fails becomes an error message for the agent, and nothing of its reply
runs. A reply is *garbled* when one of its blocks could not be read as a call
at all (not JSON of the right shape, nested too deep, an unclosed tag, or any
exception while decoding or writing it: `RecursionError`, `MemoryError`, ...);
a readable call that breaks the docs (unknown name, wrong type) is refused but
not garbled. The oracle's direction (`ground_truth_call`) goes the other way:
the dataset's ground-truth strings are parsed with `ast` (never evaluated) into
name + literal arguments.

Threads: CPython 3.11's `ast.parse` keeps the recursion depth of its AST
constructor in interpreter-wide state (CPython gh-106905), so two threads
parsing at once can fail with "SystemError: AST constructor recursion depth
mismatch". Every use of `ast` here holds `AST_LOCK`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_NESTING = 16  # containers in one tool call, its object included (the docs need 3)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

AST_LOCK = threading.Lock()
"""Held around every `ast` call of this module (CPython gh-106905: not thread-safe in 3.11).
Other code of this process that parses with `ast` on threads should hold it too."""


class CallError(ValueError):
  """A tool call the environment refuses to run; the message is shown to the agent."""


class GarbledCall(CallError):
  """A tool-call block that cannot be read as a call at all (the episode counts as garbled)."""


# --- documented types ---------------------------------------------------------------------------


def json_type(value: Any) -> str:
  """The JSON name of a decoded value's type (null, boolean, integer, number, ...)."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, int):
    return "integer"
  if isinstance(value, float):
    return "number"
  if isinstance(value, str):
    return "string"
  if isinstance(value, list):
    return "array"
  if isinstance(value, dict):
    return "object"
  return type(value).__name__


DOC_TYPES: dict[str, frozenset[str]] = {
  # The types of the multi-turn docs (`multi_turn_func_doc/*.json`) -> the JSON types they accept.
  "string": frozenset({"string"}),
  "integer": frozenset({"integer"}),  # not true/false, not 2.0
  "float": frozenset({"number", "integer"}),
  "boolean": frozenset({"boolean"}),
  "array": frozenset({"array"}),  # items checked against "items" when documented
  "dict": frozenset({"object"}),  # fields checked against "properties" when documented
}


@dataclasses.dataclass(frozen=True)
class TypeException:
  """Where the data's own ground truth breaks its docs: `function(parameter=...)` also
  accepts values that `accepts` (described by `extra`), which `entries` pass."""

  function: str
  parameter: str
  extra: str
  accepts: Callable[[Any], bool]
  entries: tuple[str, ...]


DATA_TYPE_EXCEPTIONS: tuple[TypeException, ...] = (
  # Entry 173 of every split: the ticket in its initial state has the id 'ticket_001', and the
  # ground truth closes it with close_ticket(ticket_id='ticket_001').
  TypeException(
    function="close_ticket",
    parameter="ticket_id",  # documented "integer"
    extra="a string",
    accepts=lambda value: isinstance(value, str),
    entries=(
      "multi_turn_base_173",
      "multi_turn_long_context_173",
      "multi_turn_miss_func_173",
      "multi_turn_miss_param_173",
    ),
  ),
)
_EXCEPTIONS = {(e.function, e.parameter): e for e in DATA_TYPE_EXCEPTIONS}


def check_doc(doc: Mapping[str, Any], where: str) -> None:
  """Raises ValueError unless every parameter type of a function doc is one of `DOC_TYPES`."""

  def check(schema: Mapping[str, Any], path: str) -> None:
    if schema.get("type") not in DOC_TYPES:
      raise ValueError(
        f"{where}: {path} has type {schema.get('type')!r}; supported: {sorted(DOC_TYPES)}"
      )
    if "items" in schema:
      check(schema["items"], f"{path}[]")
    for key, field in schema.get("properties", {}).items():
      check(field, f"{path}.{key}")

  for key, schema in doc.get("parameters", {}).get("properties", {}).items():
    check(schema, f"{doc.get('name')}.{key}")


def _check_type(value: Any, schema: Mapping[str, Any], where: str) -> None:
  """Raises `CallError` unless `value` has the documented type of `schema` (recursively)."""
  documented = schema["type"]
  given = json_type(value)
  if given not in DOC_TYPES[documented]:
    raise CallError(
      f"{where}: the documented type is {documented!r}, the call gives a JSON {given}"
    )
  if "enum" in schema and value not in schema["enum"]:
    raise CallError(f"{where}: must be one of {schema['enum']}")
  if isinstance(value, list) and "items" in schema:
    for k, item in enumerate(value):
      _check_type(item, schema["items"], f"{where}[{k}]")
  if isinstance(value, dict) and "properties" in schema:
    fields = schema["properties"]
    for key, item in value.items():
      if key not in fields:
        raise CallError(f"{where}: no field {key!r}; its fields: {list(fields)}")
      _check_type(item, fields[key], f"{where}[{key!r}]")
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
      raise CallError(f"{where}: missing required fields {missing}")


# --- reading replies ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParsedReply:
  """The tool calls of one reply.

  calls: (name, arguments) of every block that decoded, in order.
  errors: one message per block that did not decode (bad JSON, wrong shape, nested too deep,
    unclosed tag): each of them makes the reply garbled.
  has_tool_call: the reply contains a tool-call tag at all (without one the user turn ends).
  """

  calls: list[tuple[str, dict]]
  errors: list[str]
  has_tool_call: bool


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


def _nesting(value: Any) -> int:
  """How deep lists and dicts nest in `value` (0 for a scalar), without recursion; stops counting
  past `MAX_NESTING`."""
  deepest, stack = 0, [(value, 1)]
  while stack and deepest <= MAX_NESTING:
    item, depth = stack.pop()
    if isinstance(item, (list, dict)):
      deepest = max(deepest, depth)
      stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict) else item))
  return deepest


def _loads(text: str, what: str) -> Any:
  try:
    value = json.loads(text, parse_constant=_refuse_constant)
  except RecursionError:
    raise GarbledCall(f"{what} is nested too deeply (at most {MAX_NESTING} levels)") from None
  except ValueError as e:
    raise GarbledCall(f"{what} is not valid JSON ({e})") from None
  if _nesting(value) > MAX_NESTING:
    raise GarbledCall(f"{what} is nested too deeply (at most {MAX_NESTING} levels)")
  return value


def _decode_block(body: str) -> tuple[str, dict]:
  value = _loads(body, "the tool call")
  if not isinstance(value, dict) or not set(value) <= {"name", "arguments"} or "name" not in value:
    raise GarbledCall('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
  name, arguments = value["name"], value.get("arguments", {})
  if isinstance(arguments, str):  # some models emit the arguments as a JSON string
    arguments = _loads(arguments, "the arguments string")
  if not isinstance(name, str) or not isinstance(arguments, dict):
    raise GarbledCall('"name" must be a string and "arguments" a JSON object')
  return name, arguments


def _unreadable(e: BaseException) -> str:
  return f"the tool call could not be read ({type(e).__name__})"


def parse_tool_calls(text: str) -> ParsedReply:
  """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a reply.

  `<think>...</think>` blocks are ignored. A `<tool_call>` tag that is never
  closed is an error (the reply was cut or garbled). Never raises on any text.
  """
  visible = _THINK.sub("", text)
  calls, errors = [], []
  for match in _BLOCK.finditer(visible):
    try:
      calls.append(_decode_block(match.group(1).strip()))
    except CallError as e:
      errors.append(str(e))
    except Exception as e:  # noqa: BLE001  (MemoryError, ...: the model's text, not our fault)
      errors.append(_unreadable(e))
  rest = _BLOCK.sub("", visible)
  if TOOL_CALL_OPEN in rest or TOOL_CALL_CLOSE in rest:
    errors.append("a <tool_call> tag is not closed (or a </tool_call> is not opened)")
  return ParsedReply(calls, errors, has_tool_call=TOOL_CALL_OPEN in visible)


def _check_value(value: Any, where: str) -> None:
  """A JSON literal: finite numbers, strings, bools, None, lists and string-keyed dicts."""
  if value is None or isinstance(value, (bool, int, str)):
    return
  if isinstance(value, float):
    if not math.isfinite(value):
      raise CallError(f"{where}: {value!r} is not a finite number")
    return
  if isinstance(value, list):
    for k, item in enumerate(value):
      _check_value(item, f"{where}[{k}]")
    return
  if isinstance(value, dict):
    for key, item in value.items():
      if not isinstance(key, str):
        raise CallError(f"{where}: dictionary keys must be strings")
      _check_value(item, f"{where}[{key!r}]")
    return
  raise CallError(f"{where}: {type(value).__name__} is not a JSON value")


def check_call(name: str, arguments: Mapping[str, Any], docs: Mapping[str, dict]) -> None:
  """Raises `CallError` unless the call matches one of `docs` (name -> BFCL function doc)."""
  if name not in docs:
    raise CallError(f"unknown function {name!r}; the functions you can call: {sorted(docs)}")
  parameters = docs[name].get("parameters", {})
  properties = parameters.get("properties", {})
  for key, value in arguments.items():
    if key not in properties:
      raise CallError(f"{name}() has no parameter {key!r}; its parameters: {list(properties)}")
    where = f"{name}({key}=...)"
    _check_value(value, where)
    exception = _EXCEPTIONS.get((name, key))
    if exception is None or not exception.accepts(value):
      _check_type(value, properties[key], where)
  missing = [p for p in parameters.get("required", []) if p not in arguments]
  if missing:
    raise CallError(f"{name}() is missing required arguments: {missing}")


def call_source(name: str, arguments: Mapping[str, Any]) -> str:
  """The executor's string `name(key=<repr of value>, ...)` of a checked call.

  The result is parsed back with `ast` and must be exactly one call of `name`
  with keyword arguments whose values `ast.literal_eval` accepts; otherwise
  this raises `GarbledCall` (a guard: checked calls always pass).
  """
  if not _IDENTIFIER.match(name) or any(not _IDENTIFIER.match(k) for k in arguments):
    raise CallError(f"{name!r} or one of its argument names is not an identifier")
  source = f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
  with AST_LOCK:
    try:
      call = ast.parse(source, mode="eval").body
    except SyntaxError as e:
      raise GarbledCall(f"could not write the call safely ({e.msg})") from None
    if not (
      isinstance(call, ast.Call)
      and isinstance(call.func, ast.Name)
      and call.func.id == name
      and not call.args
      and [kw.arg for kw in call.keywords] == list(arguments)
    ):
      raise GarbledCall("could not write the call safely")
    for kw in call.keywords:
      try:
        ast.literal_eval(kw.value)
      except ValueError:
        raise GarbledCall(f"argument {kw.arg!r} is not a literal") from None
  return source


@dataclasses.dataclass(frozen=True)
class ReplyCalls:
  """What to do with one reply.

  sources: the executor strings of its calls when every call checked out, else None.
  errors: one message per problem (empty when `sources` is not None).
  garbled: some block could not be read as a call at all (see the module docstring).
  has_tool_call: the reply contains a tool-call tag (without one the user turn ends).
  """

  sources: Optional[list[str]]
  errors: list[str]
  garbled: bool
  has_tool_call: bool


def read_reply(text: str, docs: Mapping[str, dict]) -> ReplyCalls:
  """Parses, checks and writes every call of a reply; never raises on any model text.

  A reply runs all of its calls or none: one bad call stops the whole reply.
  """
  try:
    parsed = parse_tool_calls(text)
  except Exception as e:  # noqa: BLE001  (a guard: parse_tool_calls catches per block)
    return ReplyCalls(None, [_unreadable(e)], True, TOOL_CALL_OPEN in str(text))
  errors = list(parsed.errors)
  garbled = bool(errors)
  sources = []
  for name, arguments in parsed.calls:
    try:
      check_call(name, arguments, docs)
      sources.append(call_source(name, arguments))
    except CallError as e:
      errors.append(str(e))
      garbled = garbled or isinstance(e, GarbledCall)
    except Exception as e:  # noqa: BLE001  (RecursionError, MemoryError, ...)
      errors.append(_unreadable(e))
      garbled = True
  if errors:
    return ReplyCalls(None, errors, garbled, parsed.has_tool_call)
  return ReplyCalls(sources, [], False, parsed.has_tool_call)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """One `<tool_call>` block in Qwen's format."""
  return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{TOOL_CALL_CLOSE}"


def ground_truth_call(
  source: str, parameter_names: Callable[[str], Sequence[str]]
) -> tuple[str, dict]:
  """(name, arguments) of a dataset call string such as "sort('final_report.pdf')".

  Parsed with `ast` (never evaluated); positional arguments are named with
  `parameter_names(function_name)` (the backend method's signature).
  """
  with AST_LOCK:
    call = ast.parse(source, mode="eval").body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
      raise ValueError(f"not a plain function call: {source!r}")
    if any(kw.arg is None for kw in call.keywords):
      raise ValueError(f"{source!r}: **kwargs are not supported")
    positional = [ast.literal_eval(node) for node in call.args]
    keywords = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
  name = call.func.id
  names = list(parameter_names(name))
  if len(positional) > len(names):
    raise ValueError(f"{source!r}: more positional arguments than {name} has parameters")
  return name, {**dict(zip(names, positional)), **keywords}
