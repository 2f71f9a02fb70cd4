"""`bfcl`: BFCL v4 multi-turn, offline, with the official executor and checker.

The data, the executable backends (a file system, a trading bot, travel
booking, ...) and the checker all come from the PyPI package `bfcl-eval`,
installed without its dependencies:

    pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0

Only its data files, `constants`, `multi_turn_utils` and `multi_turn_checker`
are used (its `eval_runner`, `utils` and `model_handler` modules pull torch,
vllm and numpy 1.x).

An episode is one dataset entry ("multi_turn_base_12"): up to 8 user turns,
each answered by as many assistant replies as the agent needs.

  - The prompt: the entry's first user turn, with the function docs of its
    classes passed as `tools=` to the chat template (Qwen's tool format: the
    docs as JSON in the system prompt, as BFCL's own Qwen handler does).
  - A reply with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks runs them (see `bfcl_calls`: parsed with `json`, checked against
    the docs and their types, written back as executor strings from the
    checked parts) and answers with one `tool` message per call: the official
    executor's result. A reply whose calls do not all check out runs none of
    them and answers with the errors. Nothing derived from the model's text
    raises out of `step`: an exception while reading a reply is an error
    message and a garbled reply.
  - A reply without a tool call ends the user turn; the next user turn is the
    observation, and after the last one the episode is done.
  - miss_func entries withhold some functions' docs until the turn the data
    names; that turn's message lists them (BFCL's prompting-mode message, since
    the system prompt of a running conversation cannot change). As in BFCL's
    executor, every function of the entry can be called from the start (the
    data's multi_turn_miss_func_49 calls a withheld `tail` in an earlier turn).
  - The official step limit: a user turn whose replies ran tools more than
    `MAXIMUM_STEP_LIMIT` (20) times ends the episode ("force quit"), which the
    checker fails, as BFCL does.

Turn signals (`turn_signals=True`, for GiGPO and MT-GRPO): each reply also reports the
state it leaves (`Step.state`; `Reset.state` before the first) and, on the reply that ends a
user turn, a turn reward (`Step.reward`). The state is the user turn reached and a digest of
the backends' public attributes (the attributes the official `state_checker` compares), so two
conversations that leave the same backends at the same user turn are at the same state. The
turn reward is the official per-turn check the checker makes: the turn's ground-truth calls
replayed on backends of their own (f"{model_name}_ground_truth", kept across the turns as the
checker keeps them), then `state_checker` (the backends' states equal) and `response_checker`
(the ground truth's results appear among the episode's results so far): 1 if both pass, else 0;
a turn whose ground truth has no calls (the model should call nothing) pays 1 if the turn ran
no call. Every other reply's reward is 0. They cost a digest per reply and a replay per user
turn, so they are off by default.

The reward is the official checker's verdict on the episode's calls, once at
the end: `success_reward` (1.5) when valid, `failure_reward` (0) when not, and
`garbled_reward` (-1) for a failed episode in which some reply had a tool-call
block that could not be read as a call (not JSON of the right shape, nested
too deep, or any exception while decoding or writing it; a readable call that
breaks the docs is a plain failure). An episode cut short (by the turn or
context limit) has fewer user turns than the data, which the checker fails
("force terminated"). The checker's verdict (error type, message, a bounded
excerpt of its details) is kept in the score details.

Backend instances: the official module caches them in its globals under
f"{model_name}_{entry_id}_{class}_instance". Each episode uses a model name of
its own ("seeupo_<uuid>"), so parallel episodes of one entry never share an
instance, and `score()`/`close()` delete every key with that prefix.

Numeric contexts: MathAPI sets process-wide precision (`mpmath.mp.dps`, and the
thread's `decimal` context) and never restores it, so in BFCL's one-thread
evaluation a call's precision leaks into later calls, and with threads one
episode's `logarithm(precision=...)` would change another's results mid-call.
Every backend call here runs under one lock with the episode's own contexts
(starting from the libraries' defaults), saved again after the call; the
checker's replay starts from the defaults too. Backend calls are pure Python,
so the lock costs no parallelism the GIL would have allowed.

Threads (the rollout drives episodes from a thread pool): what is shared is
either read-only after loading (`BfclData`'s entries and docs), filled under a
lock (`load_data`, the `tools=` cache), or used only under a lock: the official
module's globals, the backends and the numeric contexts under `_BACKEND_LOCK`,
every `ast` parse under `bfcl_calls.AST_LOCK` (CPython 3.11's `ast.parse` is
not thread-safe, gh-106905). The official executor and checker never use
`ast` (their `eval` of a string compiles without building Python AST objects),
so the two locks need not be one, and they are never held together.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import decimal
import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import threading
import uuid
from typing import Any, Optional

from seeupo_jax import fields
from seeupo_jax.envs import base
from seeupo_jax.envs import bfcl_calls

SPLITS = (
  "multi_turn_base",
  "multi_turn_long_context",
  "multi_turn_miss_func",
  "multi_turn_miss_param",
)
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0"
_DETAILS_CHARS = 4000  # the checker's details kept per episode (its instance states can be large)
_TASK_RANGE = re.compile(r"([a-z_]+):(\d+)(?:-(\d+))?\Z")
_TASK_RANGES = fields.Allowed(
  lambda v: isinstance(v, str), "comma-separated 'split:first-last' ranges"
)


@dataclasses.dataclass(frozen=True)
class BfclConfig:
  """Which entries, and the reward.

  train_tasks, eval_tasks: comma-separated "split:first-last" ranges (inclusive), e.g.
    "multi_turn_base:0-99,multi_turn_miss_func:0-49"; splits: `SPLITS`, 200 entries each.
    Defaults: the authors' (train base 0-99, test base 100-199).
  success_reward, failure_reward, garbled_reward: see the module docstring.
  describe_functions: keep the docs' descriptions in the prompt (False drops them: names,
    types and required parameters only; a much shorter prompt for small models).
  max_steps_per_user_turn: the official MAXIMUM_STEP_LIMIT unless set (> 0).
  data_dir: a directory with BFCL's data files (BFCL_v4_multi_turn_*.json, possible_answer/,
    multi_turn_func_doc/); empty: the installed bfcl-eval package's.
  turn_signals: report each reply's state and each user turn's check (see the module
    docstring; GiGPO and MT-GRPO need them).
  """

  train_tasks: str = fields.field(_TASK_RANGES, "multi_turn_base:0-99")
  eval_tasks: str = fields.field(_TASK_RANGES, "multi_turn_base:100-199")
  success_reward: float = fields.field(fields.NUMBER, 1.5)
  failure_reward: float = fields.field(fields.NUMBER, 0.0)
  garbled_reward: float = fields.field(fields.NUMBER, -1.0)
  describe_functions: bool = fields.field(fields.BOOL, True)
  max_steps_per_user_turn: int = fields.field(
    fields.described(fields.int_at_least(0), "0: the official limit"), 0
  )
  data_dir: str = fields.field(fields.STRING, "")
  turn_signals: bool = fields.field(fields.BOOL, False)

  def __post_init__(self):
    fields.check(self, "bfcl")
    for name in ("train_tasks", "eval_tasks"):
      parse_task_ranges(getattr(self, name), name)  # says which range is wrong


def parse_task_ranges(text: str, name: str = "tasks") -> list[str]:
  """Entry ids of "split:first-last,..." (see `BfclConfig`); a bad range names the problem."""
  ids = []
  for part in str(text).split(","):
    match = _TASK_RANGE.match(part.strip())
    if not match:
      raise ValueError(
        f"bfcl.{name}: {part.strip()!r} is not 'split:first-last' (e.g. 'multi_turn_base:0-99')"
      )
    split, first, last = match.group(1), int(match.group(2)), match.group(3)
    last = first if last is None else int(last)
    if split not in SPLITS:
      raise ValueError(f"bfcl.{name}: unknown split {split!r}; allowed: {list(SPLITS)}")
    if last < first:
      raise ValueError(f"bfcl.{name}: empty range {part.strip()!r}")
    ids.extend(f"{split}_{k}" for k in range(first, last + 1))
  return ids


# --- the official package --------------------------------------------------------------------


def _official():
  """The bfcl-eval modules we use (imported by fixed names); EnvironmentUnavailable without it."""
  try:
    from bfcl_eval.constants import default_prompts, executable_backend_config  # noqa: PLC0415
    from bfcl_eval.eval_checker.multi_turn_eval import (  # noqa: PLC0415
      multi_turn_checker,
      multi_turn_utils,
    )
  except ImportError as e:
    raise base.EnvironmentUnavailable(
      f"the bfcl environment needs the bfcl-eval package ({e}); install it with: {INSTALL}"
    ) from None
  return default_prompts, executable_backend_config, multi_turn_utils, multi_turn_checker


def _read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One BFCL multi-turn entry: the dataset's fields we use, and its ground truth."""

  entry_id: str
  category: str
  questions: list  # per user turn: its messages (empty on a miss_func turn)
  initial_config: dict
  involved_classes: list
  docs: list  # the function docs shown at the start
  missed_docs: dict  # user turn index -> the docs withheld until then
  ground_truth: list  # per user turn: the official call strings

  def checker_entry(self) -> dict:
    return {
      "id": self.entry_id,
      "initial_config": self.initial_config,
      "involved_classes": self.involved_classes,
    }


class BfclData:
  """The multi-turn data: entries, ground truth and function docs (loaded once, read-only)."""

  def __init__(self, data_dir: str = ""):
    prompts, backends, self.utils, self.checker = _official()
    self.step_limit = int(prompts.MAXIMUM_STEP_LIMIT)
    self.additional_function_prompt = prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
    self.class_modules = dict(backends.CLASS_FILE_PATH_MAPPING)
    self.doc_files = dict(backends.MULTI_TURN_FUNC_DOC_FILE_MAPPING)
    if not data_dir:
      import bfcl_eval  # noqa: PLC0415

      data_dir = os.path.join(os.path.dirname(bfcl_eval.__file__), "data")
    if not os.path.isdir(data_dir):
      raise base.EnvironmentUnavailable(f"no BFCL data directory at {data_dir!r}")
    self.data_dir = data_dir
    self._lock = threading.Lock()  # for the caches below
    self._docs: dict[str, list] = {}
    self._tools: dict[tuple[str, bool], list] = {}
    self.entries: dict[str, Entry] = {}
    for split in SPLITS:
      rows = _read_jsonl(os.path.join(data_dir, f"BFCL_v4_{split}.json"))
      answers = {
        r["id"]: r["ground_truth"]
        for r in _read_jsonl(os.path.join(data_dir, "possible_answer", f"BFCL_v4_{split}.json"))
      }
      for row in rows:
        self.entries[row["id"]] = self._entry(row, answers[row["id"]], split)
    # Import the backend modules once, here, so that worker threads never race on the import.
    for module in {
      self.class_modules[c] for e in self.entries.values() for c in e.involved_classes
    }:
      importlib.import_module(module)

  def class_docs(self, class_name: str) -> list:
    """A class's function docs (read once; every documented type one that `bfcl_calls` checks)."""
    with self._lock:
      if class_name not in self._docs:
        path = os.path.join(self.data_dir, "multi_turn_func_doc", self.doc_files[class_name])
        docs = _read_jsonl(path)
        for doc in docs:
          bfcl_calls.check_doc(doc, path)
        self._docs[class_name] = docs
      return self._docs[class_name]

  def _entry(self, row: dict, ground_truth: list, split: str) -> Entry:
    docs = [d for c in row["involved_classes"] for d in self.class_docs(c)]
    missed = {}
    for turn, names in row.get("missed_function", {}).items():
      missed[int(turn)] = [d for d in docs if d["name"] in names]
      docs = [d for d in docs if d["name"] not in names]
    return Entry(
      entry_id=row["id"],
      category=split,
      questions=row["question"],
      initial_config=row.get("initial_config", {}),
      involved_classes=list(row["involved_classes"]),
      docs=docs,
      missed_docs=missed,
      ground_truth=ground_truth,
    )

  def entry(self, entry_id: str) -> Entry:
    if entry_id not in self.entries:
      raise KeyError(f"no BFCL multi-turn entry {entry_id!r}")
    return self.entries[entry_id]

  def tools(self, entry: Entry, describe: bool) -> list[dict]:
    """The `tools=` of an entry's prompt (built once, shared: read-only)."""
    key = (entry.entry_id, describe)
    with self._lock:
      if key not in self._tools:
        self._tools[key] = [_describe(d, describe) for d in entry.docs]
      return self._tools[key]

  def parameter_names(self, entry: Entry, function: str) -> list[str]:
    """The backend method's parameters in signature order (for positional ground truth)."""
    for class_name in entry.involved_classes:
      cls = getattr(importlib.import_module(self.class_modules[class_name]), class_name)
      method = getattr(cls, function, None)
      if method is not None and not function.startswith("_"):
        return [p for p in inspect.signature(method).parameters if p != "self"]
    raise ValueError(f"{entry.entry_id}: no backend method {function!r}")


_LOAD_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load_data(data_dir: str) -> BfclData:
  return BfclData(data_dir)


def load_data(data_dir: str = "") -> BfclData:
  """The shared, read-only `BfclData` of a data directory (loaded once, on first use)."""
  with _LOAD_LOCK:  # threads asking at once wait for the one load
    return _load_data(data_dir)


def _describe(doc: dict, describe: bool) -> dict:
  if describe:
    return copy.deepcopy(doc)
  parameters = doc.get("parameters", {})
  return {
    "name": doc["name"],
    "parameters": {
      "type": parameters.get("type", "dict"),
      "properties": {
        k: {"type": v.get("type")} | ({"items": v["items"]} if "items" in v else {})
        for k, v in parameters.get("properties", {}).items()
      },
      "required": list(parameters.get("required", [])),
    },
  }


# --- the environment --------------------------------------------------------------------------

# Backend calls change process-wide numeric contexts and the official module's globals.
_BACKEND_LOCK = threading.Lock()
_DEFAULT_DPS = 15  # mpmath's default precision (decimal digits)
_DEFAULT_PREC = decimal.DefaultContext.prec


@dataclasses.dataclass
class NumericContext:
  """The numeric precision the backends see (mpmath's `mp.dps`, the thread's `decimal` prec)."""

  dps: int = _DEFAULT_DPS
  prec: int = _DEFAULT_PREC


@contextlib.contextmanager
def _backend_call(context: NumericContext):
  """Runs backend code alone, in `context`, and keeps what it set there for the next call."""
  import mpmath  # noqa: PLC0415  (a dependency of the BFCL backends)

  with _BACKEND_LOCK:
    mpmath.mp.dps = context.dps
    decimal.getcontext().prec = context.prec
    try:
      yield
    finally:
      context.dps = mpmath.mp.dps
      context.prec = decimal.getcontext().prec


class BfclEnv:
  """One BFCL episode at a time (see the module docstring)."""

  def __init__(self, data: BfclData, config: BfclConfig):
    self.data = data
    self.config = config
    self.step_limit = config.max_steps_per_user_turn or data.step_limit
    self.entry: Optional[Entry] = None
    self.model_name = ""

  # Episode state: user turn, steps taken in it, the calls run per turn, flags.
  def reset(self, task_id: str) -> base.Reset:
    self.close()
    self.entry = entry = self.data.entry(task_id)
    self.model_name = f"seeupo_{uuid.uuid4().hex}"
    self.user_turn = 0
    self.steps_in_turn = 0
    self.turn_calls: list[list[list[str]]] = [[]]  # per user turn, per step: call strings
    self.allowed = {d["name"]: d for d in entry.docs}
    self.allowed.update({d["name"]: d for docs in entry.missed_docs.values() for d in docs})
    self.garbled = False
    self.invalid_replies = 0
    self.numeric = NumericContext()
    self.force_quit = False
    self.finished = False
    self._score: Optional[base.Score] = None
    self.results: list[str] = []  # every call's result so far (the per-turn response check)
    self.truth_numeric = NumericContext()  # the ground truth's replay (`_turn_check`)
    tools = self.data.tools(entry, self.config.describe_functions)
    return base.Reset(messages=self._user_messages(0), tools=tools, state=self._state())

  def _user_messages(self, turn: int) -> list[base.Message]:
    entry = self.entry
    if turn in entry.missed_docs:
      docs = [_describe(d, self.config.describe_functions) for d in entry.missed_docs[turn]]
      text = self.data.additional_function_prompt.format(functions=json.dumps(docs))
      return [{"role": "user", "content": text}]
    return [{"role": m["role"], "content": m["content"]} for m in entry.questions[turn]]

  def step(self, assistant_text: str) -> base.Step:
    if self.entry is None or self.finished:
      raise RuntimeError("step() before reset() or after the episode ended")
    reply = bfcl_calls.read_reply(assistant_text, self.allowed)  # never raises
    info: dict[str, Any] = {"user_turn": self.user_turn}
    if not reply.has_tool_call:  # the user turn is over
      reward = self._turn_check(self.user_turn)
      self.user_turn += 1
      self.steps_in_turn = 0
      if self.user_turn == len(self.entry.questions):
        self.finished = True
        return base.Step([], True, info, state=self._state(), reward=reward)
      self.turn_calls.append([])
      observation = self._user_messages(self.user_turn)
      return base.Step(observation, False, info, state=self._state(), reward=reward)

    if reply.sources is None:
      self.invalid_replies += 1
      self.garbled = self.garbled or reply.garbled
      info["errors"] = reply.errors
      if reply.garbled:
        info["garbled"] = True
      observation = [
        {"role": "tool", "content": f"Error: {e}. None of the calls in this reply were run."}
        for e in reply.errors
      ]
    else:
      results = self._execute(reply.sources)
      self.turn_calls[-1].append(reply.sources)
      info["calls"] = reply.sources
      observation = [{"role": "tool", "content": r} for r in results]
    self.steps_in_turn += 1
    reward = 0.0 if self.config.turn_signals else None
    if self.steps_in_turn > self.step_limit:
      self.force_quit = self.finished = True
      info["force_quit"] = True
      return base.Step([], True, info, state=self._state(), reward=reward)
    return base.Step(observation, False, info, state=self._state(), reward=reward)

  def _run_calls(self, sources: list[str], model_name: str, numeric: NumericContext):
    """The official executor on `model_name`'s backends (made on first use): (results, the
    backend instances by class)."""
    entry = self.entry
    with _backend_call(numeric):
      return self.data.utils.execute_multi_turn_func_call(
        func_call_list=sources,
        initial_config=entry.initial_config,
        involved_classes=entry.involved_classes,
        model_name=model_name,
        test_entry_id=entry.entry_id,
        long_context="long_context" in entry.category,
        is_evaL_run=False,
      )

  def _execute(self, sources: list[str]) -> list[str]:
    results, _ = self._run_calls(sources, self.model_name, self.numeric)
    results = [str(r) for r in results]
    self.results.extend(results)
    return results

  def _state(self) -> Optional[str]:
    """The state key after the replies so far (None without `turn_signals`): the user turn
    reached and a BLAKE2b digest of the backends' public attributes."""
    if not self.config.turn_signals:
      return None
    _, instances = self._run_calls([], self.model_name, self.numeric)
    with _BACKEND_LOCK:
      return f"{self.user_turn}:{backend_digest(instances)}"

  def _turn_check(self, turn: int) -> Optional[float]:
    """The official check of user turn `turn` as it ends (None without `turn_signals`): 1.0 if
    the backends' states equal the ground truth's after its calls and its results appear among
    the episode's results (`state_checker`, `response_checker`), else 0.0; a turn with no
    ground-truth calls: 1.0 if it ran none."""
    if not self.config.turn_signals:
      return None
    truth, ran_calls = self.entry.ground_truth[turn], any(self.turn_calls[turn])
    if not truth:
      return float(not ran_calls)
    # The ground truth's backends replay every turn's calls, as the checker's do.
    expected, truth_instances = self._run_calls(
      truth, f"{self.model_name}_ground_truth", self.truth_numeric
    )
    if not ran_calls:  # the checker's "empty turn model response"
      return 0.0
    _, instances = self._run_calls([], self.model_name, self.numeric)
    checker = self.data.checker
    with _BACKEND_LOCK:
      state = checker.state_checker(instances, truth_instances)
      if not state["valid"]:
        return 0.0
      response = checker.response_checker(self.results, expected, turn)
    return 1.0 if response["valid"] else 0.0

  def score(self) -> base.Score:
    if self.entry is None:
      raise RuntimeError("score() before reset()")
    if self._score is not None:
      return self._score
    entry = self.entry
    if not self.finished or self.force_quit:  # cut short: BFCL fails the whole entry
      verdict = {
        "valid": False,
        "error_type": "multi_turn:force_terminated",
        "error_message": (
          f"the episode ended after {self.user_turn} of {len(entry.ground_truth)} user turns"
          + (f" (more than {self.step_limit} steps in one turn)" if self.force_quit else "")
        ),
      }
    else:
      # The checker wants, per user turn, the decoded calls of each step that had any.
      decoded = [[step for step in turn if step] for turn in self.turn_calls]
      try:
        with _backend_call(NumericContext()):
          verdict = self.data.checker.multi_turn_checker(
            decoded, entry.ground_truth, entry.checker_entry(), entry.category, self.model_name
          )
      finally:
        self._drop_instances()
    success = bool(verdict.get("valid"))
    if success:
      reward = self.config.success_reward
    elif self.garbled:
      reward = self.config.garbled_reward
    else:
      reward = self.config.failure_reward
    details = {
      "valid": success,
      "error_type": verdict.get("error_type"),
      "error_message": verdict.get("error_message"),
      "user_turns": self.user_turn,
      "calls": sum(len(s) for t in self.turn_calls for s in t),
      "invalid_replies": self.invalid_replies,
      "garbled": self.garbled,
    }
    extra = {k: v for k, v in verdict.items() if k not in ("valid", "error_type", "error_message")}
    if extra:
      details["checker_details"] = json.dumps(extra, default=str)[:_DETAILS_CHARS]
    if self.finished:  # a score of a finished episode does not change
      self._score = base.Score(float(reward), success, details)
    return base.Score(float(reward), success, details)

  def _drop_instances(self) -> None:
    if self.model_name:
      drop_instances(self.data.utils, self.model_name)

  def close(self) -> None:
    self._drop_instances()


def _public_state(value: Any, seen: frozenset = frozenset()) -> Any:
  """A JSON-able copy of a backend value: objects as their class and public attributes (the
  attributes the official `state_checker` compares), containers element by element, anything
  else as its `repr` (a cycle as "<cycle>")."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if id(value) in seen:
    return "<cycle>"
  seen = seen | {id(value)}
  if isinstance(value, dict):
    return sorted(([repr(k), _public_state(v, seen)] for k, v in value.items()), key=str)
  if isinstance(value, (list, tuple)):
    return [_public_state(v, seen) for v in value]
  if isinstance(value, (set, frozenset)):
    return sorted((_public_state(v, seen) for v in value), key=str)
  if hasattr(value, "__dict__"):
    attributes = {k: v for k, v in vars(value).items() if not k.startswith("_")}
    return [type(value).__name__, _public_state(attributes, seen)]
  return repr(value)


def backend_digest(instances: dict) -> str:
  """A BLAKE2b digest (16 hex digits) of the backend instances' public state, by class name:
  equal digests for backends whose public attributes are equal."""
  state = {name: _public_state(instance) for name, instance in sorted(instances.items())}
  text = json.dumps(state, sort_keys=True, default=repr)
  return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def drop_instances(utils, model_name: str) -> None:
  """Deletes the backend instances of `model_name` (and the checker's copies of them) from the
  official `multi_turn_utils` module's globals, where its executor keeps them."""
  prefix = re.sub(r"[-./:]", "_", model_name) + "_"
  namespace = vars(utils)
  with _BACKEND_LOCK:
    for key in [k for k in namespace if k.startswith(prefix)]:
      del namespace[key]


# --- the oracle ---------------------------------------------------------------------------------


def oracle_replies(data: BfclData, entry_id: str) -> list[str]:
  """The replies of a policy that replays the ground truth: per user turn, one reply with all of
  its calls (when it has any), then a reply without a call to end the turn."""
  entry = data.entry(entry_id)
  replies = []
  for calls in entry.ground_truth:
    if calls:
      blocks = [
        bfcl_calls.format_tool_call(
          *bfcl_calls.ground_truth_call(source, functools.partial(data.parameter_names, entry))
        )
        for source in calls
      ]
      replies.append("\n".join(blocks))
    replies.append("Done.")
  return replies


def make_env(config: BfclConfig) -> BfclEnv:
  """A fresh environment on the shared data of `config.data_dir` (loaded on first use in this
  process). `functools.partial(make_env, config)` pickles, so worker processes can build one."""
  return BfclEnv(load_data(config.data_dir), config)


def spec(config: BfclConfig) -> base.EnvSpec:
  data = load_data(config.data_dir)
  train = parse_task_ranges(config.train_tasks, "train_tasks")
  evaluation = parse_task_ranges(config.eval_tasks, "eval_tasks")
  for name, ids in (("train_tasks", train), ("eval_tasks", evaluation)):
    missing = [i for i in ids if i not in data.entries]
    if missing:
      raise ValueError(f"bfcl.{name}: no such entries {missing[:5]} (200 per split: 0-199)")
  splits = {"train": train, "eval": evaluation}
  most_turns = max(len(e.questions) for e in data.entries.values())

  def task_ids(split: str) -> list[str]:
    if split not in splits:
      raise ValueError(f"unknown split {split!r}; allowed: {sorted(splits)}")
    return list(splits[split])

  return base.EnvSpec(
    make=functools.partial(make_env, config),
    task_ids=task_ids,
    max_turns=most_turns * (data.step_limit + 2),
    oracle=functools.partial(oracle_replies, data),
    isolation="process",  # a model's arguments can hang a backend call (power, square_root)
    turn_states=config.turn_signals,
    turn_rewards=config.turn_signals,
    turn_signals_option="turn_signals",
  )
