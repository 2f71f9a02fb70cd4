"""BFCL v4 multi-turn: the official executor and checker through our environment, safely."""

import ast
import builtins
import collections
import concurrent.futures
import contextlib
import functools
import gc
import json
import os
import pickle
import random
import re
import subprocess
import sys
import threading

import hypothesis
from hypothesis import strategies as st
import pytest

from seeupo_jax import envs
from seeupo_jax.envs import bfcl, bfcl_calls
import processes
import tiny

# The BFCL data and backends (README "Run the tests": pip install --no-deps bfcl-eval==...).
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RUN = os.path.join(_ROOT, "experiments", "run.py")


@pytest.fixture(scope="module")
def data():
  return bfcl.load_data()


def _play(data, entry_id, replies, config=bfcl.BfclConfig()):
  env = bfcl.BfclEnv(data, config)
  env.reset(entry_id)
  steps = []
  for reply in replies:
    steps.append(env.step(reply))
    if steps[-1].done:
      break
  score = env.score()
  env.close()
  return score, steps


def _leftover_instances():
  return [k for k in vars(multi_turn_utils) if k.startswith("seeupo_")]


def test_the_oracle_solves_all_800_entries_of_the_four_splits(data):
  assert len(data.entries) == 800
  assert {e.category for e in data.entries.values()} == set(bfcl.SPLITS)
  for entry_id in data.entries:
    score, steps = _play(data, entry_id, bfcl.oracle_replies(data, entry_id))
    assert score.success and score.reward == 1.5, (entry_id, score.details)
    assert steps[-1].done and not any("errors" in s.info for s in steps), entry_id
  assert not _leftover_instances()


def _variant(replies, rng, corrupt: bool):
  """The oracle's replies with one call removed, or with one argument of one call changed."""
  calls = [bfcl_calls.parse_tool_calls(r).calls for r in replies]
  slots = [(i, j) for i, reply in enumerate(calls) for j, _ in enumerate(reply)]
  if corrupt:
    slots = [(i, j) for i, j in slots if calls[i][j][1]]  # calls with arguments
    if not slots:
      return None
  i, j = rng.choice(slots)
  reply = [(name, dict(arguments)) for name, arguments in calls[i]]
  out = list(replies)
  if corrupt:
    arguments = reply[j][1]
    key = sorted(arguments)[0]
    value = arguments[key]
    if isinstance(value, bool):
      value = not value
    elif isinstance(value, (int, float)):
      value = value + 7
    elif isinstance(value, str):
      value = value + "_x"
    else:
      value = [value, "x"]
    arguments[key] = value
  else:
    del reply[j]
  if reply:
    out[i] = "\n".join(bfcl_calls.format_tool_call(name, args) for name, args in reply)
  else:
    del out[i]  # its turn still ends with the oracle's "Done." reply
  return out


def test_removing_or_corrupting_one_call_fails_the_checker(data):
  """Over 200 sampled entries: without one of its calls nearly every entry fails (the checker
  is lenient where a call leaves no trace, e.g. a repeated read); with one argument changed,
  most do (logins whose passwords BFCL's state ignores pass). The rates were measured over all
  800 entries: 1 of 800 passes without a call, 35 of 790 with a changed argument."""
  rng = random.Random(0)
  sample = rng.sample(sorted(data.entries), 200)
  passed = {"drop": 0, "corrupt": 0}
  tried = {"drop": 0, "corrupt": 0}
  for entry_id in sample:
    replies = bfcl.oracle_replies(data, entry_id)
    for kind in ("drop", "corrupt"):
      variant = _variant(replies, random.Random(entry_id + kind), corrupt=kind == "corrupt")
      if variant is None:
        continue
      tried[kind] += 1
      score, _ = _play(data, entry_id, variant)
      passed[kind] += score.success
      assert score.success or score.reward == 0.0
  assert tried["drop"] == 200 and passed["drop"] <= 2, passed
  assert tried["corrupt"] >= 190 and passed["corrupt"] <= 0.1 * tried["corrupt"], passed
  # A hand-checked case: entry 0 must create "temp"; creating "tmp" leaves the wrong file tree.
  replies = bfcl.oracle_replies(data, "multi_turn_base_0")
  assert '"dir_name": "temp"' in replies[0]
  score, _ = _play(
    data, "multi_turn_base_0", [replies[0].replace('"temp"', '"tmp"', 1)] + replies[1:]
  )
  assert not score.success and score.details["error_type"] == "multi_turn:instance_state_mismatch"


INJECTIONS = [
  # (reply, what must happen: "refused" = error observation, nothing run; "inert" = a documented
  # call whose string argument carries the attack, run as that plain string)
  (
    '<tool_call>{"name": "__import__(\'os\').system(\'touch SENTINEL\')", "arguments": {}}</tool_call>',
    "refused",
  ),
  (
    '<tool_call>{"name": "os.system", "arguments": {"command": "touch SENTINEL"}}</tool_call>',
    "refused",
  ),
  (
    '<tool_call>{"name": "(lambda: __import__(\'os\').system(\'touch SENTINEL\'))", "arguments": {}}</tool_call>',
    "refused",
  ),
  ("<tool_call>cd(folder=__import__('os').system('touch SENTINEL'))</tool_call>", "refused"),
  (
    '<tool_call>{"name": "cd", "arguments": {"folder=__import__(\'os\').system(\'touch SENTINEL\'),x": 1}}</tool_call>',
    "refused",
  ),
  ('<tool_call>{"name": "cd", "arguments": {"__class__": 1}}</tool_call>', "refused"),
  ('<tool_call>{"name": "ls", "arguments": {"a": NaN}}</tool_call>', "refused"),
  ('<tool_call>{"name": "cd", "arguments": {"folder": 1e999}}</tool_call>', "refused"),
  (
    '<tool_call>{"name": "cd", "arguments": {"folder": "x"}, "then": "exec"}</tool_call>',
    "refused",
  ),
  (
    '<tool_call>{"name": "cd", "arguments": {"folder": "x"}}</tool_call> <tool_call>{"name": "exec", "arguments": {}}</tool_call>',
    "refused",
  ),
  ('<tool_call>{"name": "cd", "arguments": {"folder": "doc"}', "refused"),
  (
    '<tool_call>{"name": "cd", "arguments": {"folder": "x\'); __import__(\'os\').system(\'touch SENTINEL\'); (\'"}}</tool_call>',
    "inert",
  ),
  (
    '<tool_call>{"name": "cd", "arguments": {"folder": "x\\"); __import__(\\"os\\").system(\\"touch SENTINEL\\"); (\\""}}</tool_call>',
    "inert",
  ),
  (
    '<tool_call>{"name": "mkdir", "arguments": {"dir_name": "__import__(\'os\').system(\'touch SENTINEL\')"}}</tool_call>',
    "inert",
  ),
  (
    '<tool_call>{"name": "echo", "arguments": {"content": "\\\\\'); import os; os.system(\'touch SENTINEL\') #", "file_name": "a.txt"}}</tool_call>',
    "inert",
  ),
]


@pytest.mark.parametrize("reply,expected", INJECTIONS)
def test_injected_code_never_runs(data, tmp_path, monkeypatch, reply, expected):
  sentinel = tmp_path / "SENTINEL"
  monkeypatch.chdir(tmp_path)  # "touch SENTINEL" would create it here
  reply = reply.replace("SENTINEL", str(sentinel))
  executed = []
  official = multi_turn_utils.execute_multi_turn_func_call

  def recording(func_call_list, *args, **kwargs):
    executed.extend(func_call_list)
    return official(func_call_list, *args, **kwargs)

  monkeypatch.setattr(multi_turn_utils, "execute_multi_turn_func_call", recording)
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset("multi_turn_base_0")
  step = env.step(reply)
  env.close()
  assert not sentinel.exists()
  assert not step.done
  if expected == "refused":
    assert executed == [] and step.info["errors"]
    assert all(m["role"] == "tool" and m["content"].startswith("Error:") for m in step.observation)
  else:
    # Run as one call of the documented function whose argument is the attack as a plain string.
    ((name, arguments),) = bfcl_calls.parse_tool_calls(reply).calls
    assert executed == [bfcl_calls.call_source(name, arguments)] and "errors" not in step.info
    assert step.observation and step.observation[0]["role"] == "tool"


json_values = st.recursive(
  st.none()
  | st.booleans()
  | st.integers()
  | st.floats(allow_nan=False, allow_infinity=False)
  | st.text(),
  lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
  max_leaves=8,
)


@hypothesis.given(st.dictionaries(st.sampled_from(["a", "b", "file_name"]), json_values))
@hypothesis.settings(max_examples=200, deadline=None)
def test_executor_strings_hold_exactly_the_parsed_values(arguments):
  """Whatever the values (quotes, backslashes, newlines, unicode), the string handed to the
  executor is one call whose arguments read back as exactly those values."""

  source = bfcl_calls.call_source("mv", arguments)
  call = ast.parse(source, mode="eval").body
  assert isinstance(call, ast.Call) and call.func.id == "mv" and not call.args
  assert {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords} == arguments


def test_no_backend_instance_remains_and_parallel_episodes_do_not_share_state(data):
  """100 episodes: 10 entries x 10 copies run at once on 8 threads, some cut short without a
  score. Every finished copy sees exactly the observations of a lone run of its entry. Four of
  the entries call `logarithm` with precisions 2, 4, 5 and 10 (MathAPI sets mpmath's
  process-wide precision: without the backend lock, one episode's precision changed another's
  result mid-call, and entry 57 failed its oracle run in a parallel check)."""
  logarithm_entries = [32, 49, 57, 59]
  entries = [f"multi_turn_base_{k}" for k in [0, 40, 80, 120, 160, 190, *logarithm_entries]]
  for k in logarithm_entries:
    assert "logarithm(" in str(data.entry(f"multi_turn_base_{k}").ground_truth)

  def run(entry_id, copy):
    env = bfcl.BfclEnv(data, bfcl.BfclConfig())
    env.reset(entry_id)
    seen = []
    for reply in bfcl.oracle_replies(data, entry_id):
      step = env.step(reply)
      seen.append([m["content"] for m in step.observation])
      if step.done or (copy == 9 and len(seen) == 2):  # copy 9: abandoned mid-episode
        break
    score = env.score() if copy != 9 else None
    env.close()
    return entry_id, copy, seen, score

  alone = {e: run(e, 0)[2] for e in entries}
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda a: run(*a), [(e, c) for c in range(10) for e in entries]))
  assert len(results) == 100
  for entry_id, copy, seen, score in results:
    if copy == 9:
      assert seen == alone[entry_id][:2]
    else:
      assert seen == alone[entry_id] and score.success
  assert not _leftover_instances()


def test_each_episode_keeps_its_own_numeric_precision():
  import decimal

  import mpmath

  mine = bfcl.NumericContext()
  with bfcl._backend_call(mine):
    mpmath.mp.dps = 4
    decimal.getcontext().prec = 7
  assert (mine.dps, mine.prec) == (4, 7)
  with bfcl._backend_call(bfcl.NumericContext()):  # another episode: the libraries' defaults
    assert mpmath.mp.dps == 15 and decimal.getcontext().prec == 28
  with bfcl._backend_call(mine):
    assert mpmath.mp.dps == 4 and decimal.getcontext().prec == 7


# --- the model's garbage is the agent's problem, never an exception ----------------------------

_DEEP = "[" * 1000 + "]" * 1000

GARBLED = [
  # (what, reply, a fragment of the error message)
  (
    "1000-deep arrays as an argument",
    '<tool_call>{"name": "ls", "arguments": {"a": ' + _DEEP + "}}</tool_call>",
    "nested too deeply",
  ),
  (
    "100-deep arrays: valid JSON, over the limit",
    '<tool_call>{"name": "ls", "arguments": {"a": ' + "[" * 100 + "]" * 100 + "}}</tool_call>",
    "nested too deeply",
  ),
  (
    "deep arrays inside a valid-looking argument",
    '<tool_call>{"name": "post_tweet", "arguments": {"content": "hi", "tags": ["#a", '
    + _DEEP
    + "]}}</tool_call>",
    "nested too deeply",
  ),
  (
    "1000-deep objects",
    '<tool_call>{"name": "mkdir", "arguments": {"dir_name": '
    + '{"a": ' * 1000
    + "1"
    + "}" * 1000
    + "}}</tool_call>",
    "nested too deeply",
  ),
  (
    "deep arrays in an arguments string",
    '<tool_call>{"name": "ls", "arguments": "{\\"a\\": ' + _DEEP + '}"}</tool_call>',
    "the arguments string is nested too deeply",
  ),
  (
    "deep arrays after a valid call",
    '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "ls", "arguments": {"a": ' + _DEEP + "}}</tool_call>",
    "nested too deeply",
  ),
  (
    "an integer of 5000 digits",
    '<tool_call>{"name": "tail", "arguments": {"file_name": "a", '
    '"lines": ' + "9" * 5000 + "}}</tool_call>",
    "not valid JSON",
  ),
]


def _recording_executor(monkeypatch):
  """The calls the official executor receives from now on."""
  executed = []
  official = multi_turn_utils.execute_multi_turn_func_call

  def recording(func_call_list, *args, **kwargs):
    executed.extend(func_call_list)
    return official(func_call_list, *args, **kwargs)

  monkeypatch.setattr(multi_turn_utils, "execute_multi_turn_func_call", recording)
  return executed


def _assert_refused(step, executed, fragment):
  assert not step.done and executed == []
  assert step.observation and all(
    m["role"] == "tool" and m["content"].startswith("Error:") for m in step.observation
  )
  assert any(fragment in e for e in step.info["errors"]), step.info["errors"]


def _finish_with_done(env):
  """Ends every remaining user turn without a call; the episode's score."""
  while not env.step("Done.").done:
    pass
  score = env.score()
  env.close()
  return score


@pytest.mark.parametrize("what,reply,fragment", GARBLED, ids=[g[0] for g in GARBLED])
def test_garbled_replies_are_an_error_observation_and_the_garbled_reward(
  data, monkeypatch, what, reply, fragment
):
  executed = _recording_executor(monkeypatch)
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset("multi_turn_base_0")
  step = env.step(reply)
  _assert_refused(step, executed, fragment)
  assert step.info["garbled"]
  # The episode goes on: the next reply's call runs.
  step = env.step('<tool_call>{"name": "pwd", "arguments": {}}</tool_call>')
  assert executed == ["pwd()"] and "errors" not in step.info and not step.done
  score = _finish_with_done(env)
  assert not score.success and score.reward == -1.0 and score.details["garbled"]


@pytest.mark.parametrize(
  "function,error",
  [("_nesting", MemoryError), ("_check_value", RecursionError), ("call_source", MemoryError)],
)
def test_any_exception_while_reading_a_reply_is_a_garbled_call(data, monkeypatch, function, error):
  """Whatever a reading step raises (simulated here: decoding, checking, writing the call), the
  agent sees an error and the episode is garbled; nothing leaves `step`."""

  def failing(*args, **kwargs):
    raise error("simulated")

  monkeypatch.setattr(bfcl_calls, function, failing)
  executed = _recording_executor(monkeypatch)
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset("multi_turn_base_0")
  step = env.step('<tool_call>{"name": "cd", "arguments": {"folder": "document"}}</tool_call>')
  _assert_refused(step, executed, f"the tool call could not be read ({error.__name__})")
  assert step.info["garbled"]
  monkeypatch.undo()
  assert _finish_with_done(env).reward == -1.0


# --- documented types ---------------------------------------------------------------------------

TYPE_ERRORS = [
  # (entry, function, arguments, the error message)
  (
    "multi_turn_base_0",
    "ls",
    {"a": "__import__('os').system('ls')"},
    "ls(a=...): the documented type is 'boolean', the call gives a JSON string",
  ),
  (
    "multi_turn_base_0",
    "ls",
    {"a": 1},
    "ls(a=...): the documented type is 'boolean', the call gives a JSON integer",
  ),
  (
    "multi_turn_base_0",
    "ls",
    {"a": None},
    "ls(a=...): the documented type is 'boolean', the call gives a JSON null",
  ),
  (
    "multi_turn_base_0",
    "tail",
    {"file_name": "a", "lines": True},
    "tail(lines=...): the documented type is 'integer', the call gives a JSON boolean",
  ),
  (
    "multi_turn_base_0",
    "tail",
    {"file_name": "a", "lines": 2.0},
    "tail(lines=...): the documented type is 'integer', the call gives a JSON number",
  ),
  (
    "multi_turn_base_0",
    "cd",
    {"folder": ["document"]},
    "cd(folder=...): the documented type is 'string', the call gives a JSON array",
  ),
  (
    "multi_turn_base_0",
    "post_tweet",
    {"content": "hi", "tags": ["#a", 3]},
    "post_tweet(tags=...)[1]: the documented type is 'string', the call gives a JSON integer",
  ),
  (
    "multi_turn_base_0",
    "post_tweet",
    {"content": "hi", "tags": "#a"},
    "post_tweet(tags=...): the documented type is 'array', the call gives a JSON string",
  ),
  (
    "multi_turn_base_15",
    "mean",
    {"numbers": [1, "2"]},
    "mean(numbers=...)[1]: the documented type is 'float', the call gives a JSON string",
  ),
  (
    "multi_turn_base_15",
    "mean",
    {"numbers": [1, False]},
    "mean(numbers=...)[1]: the documented type is 'float', the call gives a JSON boolean",
  ),
  (
    "multi_turn_base_48",
    "edit_ticket",
    {"ticket_id": 654321, "updates": []},
    "edit_ticket(updates=...): the documented type is 'dict', the call gives a JSON array",
  ),
  (
    "multi_turn_base_48",
    "edit_ticket",
    {"ticket_id": 654321, "updates": {"priority": "2"}},
    "edit_ticket(updates=...)['priority']: the documented type is 'integer', the call gives a JSON string",
  ),
  (
    "multi_turn_base_48",
    "edit_ticket",
    {"ticket_id": 654321, "updates": {"owner": "me"}},
    "edit_ticket(updates=...): no field 'owner'; its fields: ['title', 'description', 'status', 'priority']",
  ),
  # The data's exception is close_ticket's alone, and only for strings.
  (
    "multi_turn_base_48",
    "get_ticket",
    {"ticket_id": "654321"},
    "get_ticket(ticket_id=...): the documented type is 'integer', the call gives a JSON string",
  ),
  (
    "multi_turn_base_48",
    "close_ticket",
    {"ticket_id": True},
    "close_ticket(ticket_id=...): the documented type is 'integer', the call gives a JSON boolean",
  ),
]


@pytest.mark.parametrize("entry_id,function,arguments,message", TYPE_ERRORS)
def test_documented_types_are_enforced(data, monkeypatch, entry_id, function, arguments, message):
  executed = _recording_executor(monkeypatch)
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset(entry_id)
  step = env.step(bfcl_calls.format_tool_call(function, arguments))
  _assert_refused(step, executed, message)
  assert step.info["errors"] == [message] and "garbled" not in step.info
  assert step.observation == [
    {"role": "tool", "content": f"Error: {message}. None of the calls in this reply were run."}
  ]
  score = _finish_with_done(env)
  assert not score.success and score.reward == 0.0 and not score.details["garbled"]


@pytest.mark.parametrize(
  "entry_id,function,arguments",
  [
    ("multi_turn_base_0", "ls", {"a": True}),
    ("multi_turn_base_0", "tail", {"file_name": "a", "lines": 3}),
    ("multi_turn_base_0", "post_tweet", {"content": "hi", "tags": ["#a", "#b"], "mentions": []}),
    ("multi_turn_base_15", "mean", {"numbers": [1, 2.5, -3]}),  # a float accepts an integer
    ("multi_turn_base_48", "edit_ticket", {"ticket_id": 654321, "updates": {"priority": 2}}),
  ],
)
def test_calls_of_the_documented_types_run(data, monkeypatch, entry_id, function, arguments):
  executed = _recording_executor(monkeypatch)
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset(entry_id)
  step = env.step(bfcl_calls.format_tool_call(function, arguments))
  env.close()
  assert "errors" not in step.info
  assert executed == [bfcl_calls.call_source(function, arguments)]


def _ground_truth_type_errors(data) -> dict[tuple[str, str], set[str]]:
  """(function, parameter) -> the entries whose ground truth `check_call` refuses there."""
  refused = collections.defaultdict(set)
  for entry in data.entries.values():
    docs = {d["name"]: d for d in entry.docs}
    docs.update({d["name"]: d for withheld in entry.missed_docs.values() for d in withheld})
    names = functools.partial(data.parameter_names, entry)
    for source in [s for turn in entry.ground_truth for s in turn]:
      name, arguments = bfcl_calls.ground_truth_call(source, names)
      try:
        bfcl_calls.check_call(name, arguments, docs)
      except bfcl_calls.CallError as e:
        where = re.match(r"(\w+)\((\w+)=\.\.\.\)", str(e))
        assert where, (entry.entry_id, source, str(e))  # only types may fail, never names
        refused[where.groups()].add(entry.entry_id)
  return dict(refused)


def test_the_type_exceptions_are_exactly_what_the_ground_truth_needs(data, monkeypatch):
  """Every ground-truth call of the 800 entries is checked against its docs: with the table of
  exceptions the data's calls all pass; without it, exactly the table's calls are refused."""
  table = {(e.function, e.parameter): set(e.entries) for e in bfcl_calls.DATA_TYPE_EXCEPTIONS}
  assert table == {
    ("close_ticket", "ticket_id"): {f"{split}_173" for split in bfcl.SPLITS},
  }
  assert _ground_truth_type_errors(data) == {}
  monkeypatch.setattr(bfcl_calls, "_EXCEPTIONS", {})
  assert _ground_truth_type_errors(data) == table
  monkeypatch.undo()
  for exception in bfcl_calls.DATA_TYPE_EXCEPTIONS:
    for entry_id in exception.entries:
      score, _ = _play(data, entry_id, bfcl.oracle_replies(data, entry_id))
      assert score.success, (entry_id, score.details)


def test_function_docs_use_only_the_checked_types():
  bfcl_calls.check_doc({"name": "f", "parameters": {"properties": {"x": {"type": "float"}}}}, "f")
  for schema, path in [
    ({"type": "tuple"}, "f.x"),
    ({"type": "array", "items": {"type": "any"}}, "f.x[]"),
    ({"type": "dict", "properties": {"y": {}}}, "f.x.y"),
  ]:
    doc = {"name": "f", "parameters": {"properties": {"x": schema}}}
    with pytest.raises(ValueError, match=re.escape(f"docs.json: {path} has type")):
      bfcl_calls.check_doc(doc, "docs.json")
  doc = {"name": "f", "parameters": {"properties": {"m": {"type": "string", "enum": ["a", "b"]}}}}
  bfcl_calls.check_call("f", {"m": "a"}, {"f": doc})
  with pytest.raises(bfcl_calls.CallError, match=re.escape("f(m=...): must be one of ['a', 'b']")):
    bfcl_calls.check_call("f", {"m": "c"}, {"f": doc})


# --- threads ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _thread_switch_stress(gc_threshold: int = 100):
  """Thread switches every microsecond, and Python code run inside garbage collections, which
  happen every `gc_threshold` allocations. A thread in `ast.parse`'s C code gives the GIL away
  only when Python code runs mid-parse, as finalizers and gc callbacks do in a collection that
  the parse's allocations start (a training process has plenty; here a no-op gc callback stands
  for them). On the unlocked code, switches alone crashed 0 of 13 runs of the 800-entry oracle;
  this (threshold 100) crashed 5 of 5."""
  interval, threshold = sys.getswitchinterval(), gc.get_threshold()

  def in_every_collection(phase, info):
    pass

  sys.setswitchinterval(1e-6)
  gc.set_threshold(gc_threshold)
  gc.callbacks.append(in_every_collection)
  try:
    yield
  finally:
    gc.callbacks.remove(in_every_collection)
    gc.set_threshold(*threshold)
    sys.setswitchinterval(interval)


def _parse_on_threads(data, rounds: int) -> None:
  """8 threads reading ground truth and writing executor strings, as the oracle's episodes do."""
  entry = data.entry("multi_turn_base_0")
  sources = [s for turn in entry.ground_truth for s in turn]
  names = functools.partial(data.parameter_names, entry)

  def work(_):
    for _ in range(rounds):
      for source in sources:
        name, arguments = bfcl_calls.ground_truth_call(source, names)
        assert bfcl_calls.call_source(name, arguments).startswith(name + "(")

  # A collection at every allocation: parsing alone allocates and frees in balance.
  with concurrent.futures.ThreadPoolExecutor(8) as pool, _thread_switch_stress(gc_threshold=1):
    list(pool.map(work, range(8)))


def test_ast_parsing_on_threads_holds_up_under_thread_switch_stress(data):
  # The control, that parses interleaved without `AST_LOCK` break:
  # test_without_the_lock_interleaved_parses_break_exactly_on_the_pythons_with_gh_106905.
  _parse_on_threads(data, rounds=40)


def _has_gh_106905(version: tuple[int, ...]) -> bool:
  """Whether CPython `version` keeps the AST constructor's recursion depth in interpreter-wide
  state (3.11.0-3.11.7, 3.12.0-3.12.1; fixed in 3.11.8 and 3.12.2 by per-call state)."""
  return (3, 11) <= version < (3, 11, 8) or (3, 12) <= version < (3, 12, 2)


def _parse_with_another_threads_parse_inside(parse):
  """`parse()` on this thread, while at every garbage collection in the middle of it (its AST
  constructor allocates) another thread runs `parse()` from start to end: the interleaving that
  thread switches make by chance under `_thread_switch_stress`, here at every allocation. The
  other thread is new (a shallow stack) and this one runs under pytest (a deep one), so an AST
  constructor whose depth count is interpreter-wide ends this parse below the depth it began at.
  Returns (this thread's result or exception, the number of parses run inside it)."""
  here = threading.get_ident()
  inside = []

  def in_every_collection(phase, info):
    if phase == "start" and threading.get_ident() == here:
      other = threading.Thread(target=lambda: inside.append(parse()))
      other.start()
      other.join()  # collections wait while this one runs: none starts on the other thread

  threshold = gc.get_threshold()
  gc.set_threshold(1)
  gc.callbacks.append(in_every_collection)
  try:
    result = parse()
  except SystemError as e:
    result = e
  finally:
    gc.callbacks.remove(in_every_collection)
    gc.set_threshold(*threshold)
  return result, len(inside)


@pytest.mark.parametrize(
  "version,broken",
  [
    ((3, 11, 7), True),
    ((3, 11, 8), False),
    ((3, 12, 1), True),
    ((3, 12, 2), False),
    ((3, 13), False),
  ],
)
def test_the_cpython_versions_with_the_shared_ast_depth_are_known(version, broken):
  assert _has_gh_106905(version) == broken


def test_without_the_lock_interleaved_parses_break_exactly_on_the_pythons_with_gh_106905(
  data, monkeypatch
):
  """The control of the stress test: `AST_LOCK` is what keeps parses on threads whole. Without
  it, a ground-truth parse with another thread's parse run inside it fails on the CPython
  versions with gh-106905 ("AST constructor recursion depth mismatch"), and gives the call on
  the others."""
  entry = data.entry("multi_turn_base_0")
  source = entry.ground_truth[0][0]
  names = functools.partial(data.parameter_names, entry)
  expected = bfcl_calls.ground_truth_call(source, names)
  monkeypatch.setattr(bfcl_calls, "AST_LOCK", contextlib.nullcontext())
  result, inside = _parse_with_another_threads_parse_inside(
    lambda: bfcl_calls.ground_truth_call(source, names)
  )
  assert inside > 0  # the other thread did parse in the middle of this parse
  if _has_gh_106905(sys.version_info[:3]):
    assert isinstance(result, SystemError), result
    assert "AST constructor recursion depth mismatch" in str(result)
  else:
    assert result == expected


def test_every_ast_parse_of_an_episode_holds_the_lock(data, monkeypatch):
  """Each AST the process builds while 100 entries (all splits) are played, by our code or the
  official executor and checker, is built under `bfcl_calls.AST_LOCK`: one lock is enough."""
  built = []
  original = builtins.compile

  def watching(source, filename, mode, flags=0, *args, **kwargs):
    if flags & ast.PyCF_ONLY_AST:
      built.append(bfcl_calls.AST_LOCK.locked())
    return original(source, filename, mode, flags, *args, **kwargs)

  monkeypatch.setattr(builtins, "compile", watching)
  for entry_id in sorted(data.entries)[::8]:
    score, _ = _play(data, entry_id, bfcl.oracle_replies(data, entry_id))
    assert score.success, entry_id
  monkeypatch.undo()
  assert len(built) > 500 and all(built), (len(built), built.count(False))


def test_threads_asking_for_the_data_at_once_share_one_load():
  import bfcl_eval

  data_dir = os.path.join(os.path.dirname(bfcl_eval.__file__), "data")  # a fresh cache key
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    loaded = list(pool.map(lambda _: bfcl.load_data(data_dir), range(8)))
  assert len(loaded[0].entries) == 800 and all(d is loaded[0] for d in loaded)


def _all_800_entries_spec():
  config = bfcl.BfclConfig(
    train_tasks="multi_turn_base:0-199,multi_turn_long_context:0-199",
    eval_tasks="multi_turn_miss_func:0-199,multi_turn_miss_param:0-199",
  )
  spec = bfcl.spec(config)
  task_ids = list(spec.task_ids("train")) + list(spec.task_ids("eval"))
  assert len(set(task_ids)) == 800
  return spec, task_ids


@pytest.mark.slow
def test_the_800_entry_oracle_passes_under_thread_switch_stress():
  """The oracle's 800 episodes on 8 threads under `_thread_switch_stress`. Without the `ast` lock
  every such run crashed within its first 1.5 s (SystemError: AST constructor recursion depth
  mismatch), so one run of all 800 catches it; with the lock, 3 runs in a row passed (6-10 s each
  on 2 busy cores)."""
  from seeupo_jax.training import oracle

  spec, task_ids = _all_800_entries_spec()
  with _thread_switch_stress():
    episodes = oracle.run_oracle(spec, task_ids, workers=8)
  assert [e.task_id for e in episodes] == task_ids
  failed = [(e.task_id, e.details) for e in episodes if not e.success]
  assert not failed, failed[:3]
  assert not _leftover_instances()


# --- worker processes ---------------------------------------------------------------------------

_PLAY_IN_A_FRESH_PROCESS = """
import json, pickle, sys
make = pickle.loads(sys.stdin.buffer.read())  # imports seeupo_jax.envs.bfcl by itself
env = make()
from seeupo_jax.envs import bfcl
env.reset("multi_turn_base_0")
for reply in bfcl.oracle_replies(env.data, "multi_turn_base_0"):
  if env.step(reply).done:
    break
score = env.score()
env.close()
print(json.dumps({"reward": score.reward, "success": score.success}))
"""


def test_the_spec_factory_pickles_and_builds_a_working_env_in_a_fresh_process():
  spec = bfcl.spec(bfcl.BfclConfig(train_tasks="multi_turn_base:0", eval_tasks="multi_turn_base:1"))
  blob = pickle.dumps(spec.make)
  assert len(blob) < 1000  # the config, not the data
  env = pickle.loads(blob)()
  assert isinstance(env, bfcl.BfclEnv) and env.config == bfcl.BfclConfig(
    train_tasks="multi_turn_base:0", eval_tasks="multi_turn_base:1"
  )
  env.reset("multi_turn_base_0")
  env.close()
  proc = subprocess.run(
    [sys.executable, "-c", _PLAY_IN_A_FRESH_PROCESS],
    input=blob,
    capture_output=True,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=_ROOT),
    cwd=_ROOT,
  )
  assert proc.returncode == 0, proc.stderr.decode()[-3000:]
  assert json.loads(proc.stdout) == {"reward": 1.5, "success": True}


def test_user_turns_miss_func_step_limit_and_rewards(data):
  # A reply without a tool call ends the user turn: the next question arrives.
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  reset = env.reset("multi_turn_base_0")
  entry = data.entry("multi_turn_base_0")
  assert reset.messages == entry.questions[0]
  assert {t["name"] for t in reset.tools} == {d["name"] for d in entry.docs}
  step = env.step("I think I am done.")
  assert not step.done and step.observation == entry.questions[1]
  env.close()

  # miss_func: the withheld docs are absent from the prompt and arrive at their turn.
  entry = data.entry("multi_turn_miss_func_0")
  ((turn, withheld),) = entry.missed_docs.items()
  assert turn > 0
  names = [d["name"] for d in withheld]
  reset = env.reset("multi_turn_miss_func_0")
  assert not {t["name"] for t in reset.tools} & set(names)
  for _ in range(turn):
    step = env.step("Done.")
  assert step.observation[0]["role"] == "user"
  assert all(name in step.observation[0]["content"] for name in names)
  assert "I have updated some more functions" in step.observation[0]["content"]
  env.close()

  # The official step limit: more than 20 tool-running replies in one user turn end the episode.
  env = bfcl.BfclEnv(data, bfcl.BfclConfig())
  env.reset("multi_turn_base_0")
  pwd = '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'
  steps = [env.step(pwd) for _ in range(21)]
  assert not any(s.done for s in steps[:20]) and steps[20].done and steps[20].info["force_quit"]
  score = env.score()
  env.close()
  assert score.details["error_type"] == "multi_turn:force_terminated" and score.reward == 0.0

  # Rewards: success, plain failure, garbled failure, configurable; cut short fails.
  replies = bfcl.oracle_replies(data, "multi_turn_base_0")
  config = bfcl.BfclConfig(success_reward=2.0, failure_reward=-0.5, garbled_reward=-3.0)
  assert _play(data, "multi_turn_base_0", replies, config)[0].reward == 2.0
  assert _play(data, "multi_turn_base_0", ["Done."] * 4, config)[0].reward == -0.5
  assert (
    _play(data, "multi_turn_base_0", ["<tool_call>{bad</tool_call>"] + ["Done."] * 4, config)[
      0
    ].reward
    == -3.0
  )
  score, _ = _play(data, "multi_turn_base_0", replies[:-1], config)
  assert score.details["error_type"] == "multi_turn:force_terminated" and score.reward == -0.5
  assert not _leftover_instances()


_SIGNALS = bfcl.BfclConfig(turn_signals=True)


def test_turn_signals_of_the_oracle_pass_every_user_turn_and_change_nothing_else(data):
  """With `turn_signals`, the oracle's reply that ends a user turn earns the turn check's 1 and
  its other replies 0, on 25 sampled entries of each split; the final score is unchanged, and
  without them no reply reports a state or a reward."""
  rng = random.Random(1)
  for split in bfcl.SPLITS:
    for entry_id in rng.sample([e for e in sorted(data.entries) if e.startswith(split)], 25):
      entry = data.entry(entry_id)
      replies = bfcl.oracle_replies(data, entry_id)
      score, steps = _play(data, entry_id, replies, _SIGNALS)
      assert score.success, (entry_id, score.details)
      ends = [not bfcl_calls.parse_tool_calls(r).calls for r in replies]
      assert [s.reward for s in steps] == [1.0 if end else 0.0 for end in ends], entry_id
      assert sum(ends) == len(entry.questions)
      assert all(isinstance(s.state, str) for s in steps), entry_id
      user_turns = [int(s.state.split(":")[0]) for s in steps]
      assert user_turns == [sum(ends[: i + 1]) for i in range(len(steps))]
      plain_score, plain = _play(data, entry_id, replies)
      assert plain_score.reward == score.reward
      assert all(s.state is None and s.reward is None for s in plain), entry_id
  assert not _leftover_instances()


def test_turn_signals_fail_the_turn_that_goes_wrong_and_key_the_backend_state(data):
  """Entry 0 must create "temp" in its first turn: creating "tmp" fails that turn's check
  (the backends' states differ), and the next turn's, whose calls then act on the wrong tree.
  A read-only call leaves the state key where it was; a call that writes changes it; two
  episodes that reach the same backends at the same user turn have the same key."""
  replies = bfcl.oracle_replies(data, "multi_turn_base_0")
  wrong = [replies[0].replace('"temp"', '"tmp"', 1)] + replies[1:]
  _, steps = _play(data, "multi_turn_base_0", wrong, _SIGNALS)
  rewards = [s.reward for s in steps if s.reward]
  _, right = _play(data, "multi_turn_base_0", replies, _SIGNALS)
  assert steps[1].reward == 0.0 and right[1].reward == 1.0  # the first turn's check
  assert len(rewards) < sum(s.reward for s in right)

  env = bfcl.BfclEnv(data, _SIGNALS)
  start = env.reset("multi_turn_base_0").state
  pwd = env.step('<tool_call>{"name": "pwd", "arguments": {}}</tool_call>')
  assert pwd.state == start and pwd.reward == 0.0 and start.startswith("0:")
  mkdir = env.step('<tool_call>{"name": "mkdir", "arguments": {"dir_name": "x"}}</tool_call>')
  assert mkdir.state != start and mkdir.state.startswith("0:")
  env.close()
  other = bfcl.BfclEnv(data, _SIGNALS)
  assert other.reset("multi_turn_base_0").state == start
  ls = other.step('<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
  assert ls.state == start
  again = other.step('<tool_call>{"name": "mkdir", "arguments": {"dir_name": "x"}}</tool_call>')
  assert again.state == mkdir.state
  other.close()
  assert not _leftover_instances()


def test_backend_digest_reads_public_attributes_only_and_survives_cycles():
  class Node:
    def __init__(self, name, hidden):
      self.name, self.children, self._hidden = name, [], hidden

  def tree(hidden):
    root = Node("root", hidden)
    child = Node("a", hidden)
    child.parent = root  # a cycle
    root.children.append(child)
    return root

  assert bfcl.backend_digest({"Fs": tree(1)}) == bfcl.backend_digest({"Fs": tree(2)})
  changed = tree(1)
  changed.children[0].name = "b"
  assert bfcl.backend_digest({"Fs": changed}) != bfcl.backend_digest({"Fs": tree(1)})
  assert bfcl.backend_digest({"Fs": tree(1)}) != bfcl.backend_digest({"Other": tree(1)})


def test_config_names_bad_values(data):
  with pytest.raises(ValueError, match="unknown split 'multi_turn_web'; allowed"):
    bfcl.BfclConfig(train_tasks="multi_turn_web:0-9")
  with pytest.raises(ValueError, match="is not 'split:first-last'"):
    bfcl.BfclConfig(eval_tasks="base 0..9")
  with pytest.raises(ValueError, match="no such entries"):
    bfcl.spec(bfcl.BfclConfig(eval_tasks="multi_turn_base:150-250"))
  with pytest.raises(ValueError, match="bad options for environment 'bfcl'"):
    envs.make_spec("bfcl", {"split": "base"})
  spec = envs.make_spec("bfcl", {"train_tasks": "multi_turn_miss_param:5-6,multi_turn_base:0"})
  assert spec.task_ids("train") == [
    "multi_turn_miss_param_5",
    "multi_turn_miss_param_6",
    "multi_turn_base_0",
  ]
  assert spec.task_ids("eval") == [f"multi_turn_base_{k}" for k in range(100, 200)]


def test_a_turn_level_algorithm_without_turn_signals_is_refused_naming_the_key(data):
  from seeupo_jax import learner  # noqa: PLC0415
  from seeupo_jax.training import program  # noqa: PLC0415

  spec = bfcl.spec(bfcl.BfclConfig())
  assert not spec.turn_states and not spec.turn_rewards
  for algorithm in ("gigpo", "mt_grpo"):
    config = learner.LearnerConfig(algorithm=algorithm)
    with pytest.raises(program.ConfigError, match=r"env.name='bfcl'.*set env.turn_signals=True$"):
      program._check_turn_inputs(config, spec, "bfcl")
    program._check_turn_inputs(config, bfcl.spec(bfcl.BfclConfig(turn_signals=True)), "bfcl")


def _run(*args, timeout=600, **env_vars):
  env = dict(processes.env(devices=1), PYTHONPATH=_ROOT, **env_vars)
  return subprocess.run(
    [sys.executable, _RUN, "--config=bfcl", *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=env,
    cwd=_ROOT,
  )


def test_run_py_oracle_checks_the_install(tmp_path):
  proc = _run(f"--workdir={tmp_path}", "--config.policy=oracle", timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads((tmp_path / "oracle.json").read_text())
  for split in ("train", "eval"):
    assert report[split]["tasks"] == 100 and report[split]["success"] == 1.0
    assert report[split]["reward"] == 1.5
  assert "the oracle solved every task" in proc.stderr + proc.stdout


def test_run_py_without_a_model_path_says_what_to_pass(tmp_path):
  proc = _run(f"--workdir={tmp_path}", timeout=300)
  assert proc.returncode == 2
  assert "--config.model.path=/path/to/a/local/Qwen3-checkpoint" in proc.stderr
  assert "Traceback" not in proc.stderr


TINY = (
  f"--config.model.preset={tiny.PRESET}",
  "--config.env.describe_functions=False",  # a 1.4k-token prompt instead of 7k
  "--config.env.train_tasks=multi_turn_base:29,multi_turn_base:37",
  "--config.env.eval_tasks=multi_turn_base:9",
  "--config.rollout.tasks_per_iteration=2",
  "--config.rollout.samples_per_task=2",
  "--config.rollout.env_workers=2",  # worker processes (BFCL's default isolation)
  "--config.rollout.max_turns=3",
  "--config.rollout.max_context_tokens=2048",
  "--config.rollout.max_reply_tokens=16",
  "--config.rollout.max_env_tokens=64",
  # SeeUPO's turns on the whole batch at full length: one length program of the update to compile
  # instead of 4 (the bucketed update equals it: tests/learner/test_learner_turn_buckets.py).
  "--config.learner.turn_buckets=1",
  "--config.eval.num_tasks=1",
  "--config.eval.k=2",
  "--config.log.progress_bar=False",
  "--config.log.tensorboard=False",
  "--config.log.plot=False",
)


@pytest.mark.slow
def test_a_short_seeupo_run_on_bfcl_entries_then_eval_only(tmp_path):
  """An iteration of SeeUPO (tiny model, 2 entries x 2 samples, 3 turns), then --eval_only on the
  workdir's checkpoint. It need not learn; every reward must be one the checker gives. The turn
  signals are on: each turn's state and turn reward cross the worker processes into the
  trajectories."""
  # The second run's sampler is the first's program: it reads it from the session's compilation
  # cache (tests/conftest.py).
  signals = "--config.env.turn_signals=True"
  proc = _run(f"--workdir={tmp_path}", "--config.num_iterations=1", signals, *TINY)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["iteration"] for r in records] == [1]
  assert all(r["rollout/failed_groups"] == 0 and r["optimizer_steps"] >= 1 for r in records)
  trajectories = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
  for t in trajectories:
    assert t["reward"] in (1.5, 0.0, -1.0) and t["task_id"] in (
      "multi_turn_base_29",
      "multi_turn_base_37",
    )
    assert t["score_details"]["error_type"] is not None or t["success"]
    turns = len(t["replies"])
    # A state before each reply; a turn reward for each reply the environment stepped on (all
    # but a last one cut by the context).
    assert len(t["turn_states"]) == turns and len(t["turn_rewards"]) in (turns, turns - 1)
    assert t["turn_states"][0].startswith("0:")  # before the first reply: user turn 0
    assert all(re.fullmatch(r"\d+:[0-9a-f]{16}", state) for state in t["turn_states"])
    assert set(t["turn_rewards"]) <= {0.0, 1.0}
  assert not _leftover_instances()

  proc = _run(
    f"--workdir={tmp_path}", "--config.num_iterations=1", "--config.eval_only=True", signals, *TINY
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "evaluating" in proc.stderr + proc.stdout and "at iteration 1" in proc.stderr + proc.stdout
  scores = json.loads((tmp_path / "eval_1.json").read_text())
  assert scores["iteration"] == 1 and scores["tasks"] == 1 and 0.0 <= scores["avg@2"] <= 1.0
