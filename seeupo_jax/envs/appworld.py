"""`appworld`: AppWorld tasks, played over HTTP against a pool of AppWorld environment servers.

AppWorld (Trivedi et al., 2024) is 9 day-to-day apps (spotify, gmail, venmo, ...)
with 457 APIs and tasks checked by unit tests on the apps' end state. Its
package pins pydantic < 2 and needs its data, so it runs in its own venv as
servers (`appworld serve environment`, one task at a time each; start N of them
with `experiments/appworld_servers.sh`); this module talks to them with
`appworld_client` (the protocol and the failure handling are described there).

An episode:
  reset(task_id): lease a server from the pool, POST /initialize the task; the
    opening messages are a system prompt (how to act, the API lookup calls, the
    API docs index of `api_docs`) and the supervisor's task.
  step(reply): the reply's first ```python block (after any <think>...</think>)
    is POST /execute'd; the observation is the printed output (cut to
    `max_observation_chars`). A reply with no such block is "unparsable": the
    agent gets an error message as its observation, nothing runs. The episode
    ends when POST /task_completed says the agent called
    apis.supervisor.complete_task(...), or after `max_turns` replies.
  score(): POST /evaluate (the task's unit tests on the world's state):
      reward = success_reward                          if every test passed
             = garbled_reward                          else, if the episode is garbled
             = partial_reward_weight * passes / num_tests   otherwise
    (defaults 1.5, -1, 0.5: the paper's; the order is BFCL's too: a solved task
    earns its reward whatever the replies on the way). An episode is GARBLED
    when at least `garbled_min_replies` (default 1) of its replies were
    unparsable. `success` is the tests' verdict.
  close(): POST /close, and the server goes back to the pool.

A server failure is never a reward: any failed call raises (after the client's
retries), the server goes back to the pool marked by the failure (out of
rotation if it stopped answering), and the rollout loop replays the episode
from the start on a fresh instance, which leases another server; if that fails
too, the whole task group is left out of the update (`seeupo_jax/rollout.py`).

Tasks: the ids of AppWorld's splits ("train", "dev", "test_normal",
"test_challenge") are read from `<datasets_dir>/<split>.txt` (AppWorld's
`data/datasets`, one id per line), or from `train_ids_file` / `eval_ids_file`.
`task_ids("train")` is the `train_split`, `task_ids("eval")` the `eval_split`
(defaults train and dev).

API docs in the prompt (`api_docs`): read once per pool from GET /api_docs, on
the first server that answers it (start-up goes on when the first URL is down).
"names" (default): each app with its API names, one line per app (about 2-3k
tokens for AppWorld's 457 APIs); "descriptions": one line per API with its
required parameters and first sentence (several times longer); "none": only the
lookup calls (AppWorld's own ReAct prompt style). The agent reads any API's
full doc with apis.api_docs.show_api_doc(...) in every mode.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional, Sequence

from absl import logging
import httpx

from seeupo_jax import fields
from seeupo_jax.envs import appworld_client as client_lib
from seeupo_jax.envs import appworld_pool as pool_lib
from seeupo_jax.envs import base

SPLITS = ("train", "dev", "test_normal", "test_challenge")
API_DOCS_MODES = ("none", "names", "descriptions")
OUTPUT_CUT_MARKER = "\n[... output cut at {} characters]"

SYSTEM_PROMPT = """\
You are an autonomous assistant. You complete your supervisor's task by operating their apps \
(spotify, gmail, venmo, ...) through Python APIs, without asking them anything.

Every reply of yours contains one block of Python code:
```python
# your code
```
It runs in a persistent Python session (variables stay defined from one reply to the next), \
and you see what it printed. Only the first ```python block of a reply runs; a reply without \
one runs nothing. Print every value you need to see.

The apps' APIs are methods of the object `apis`: apis.<app>.<api>(<keyword arguments>). Look \
them up as you need them:
```python
print(apis.api_docs.show_app_descriptions())
print(apis.api_docs.show_api_descriptions(app_name="spotify"))
print(apis.api_docs.show_api_doc(app_name="spotify", api_name="login"))
```
Most APIs need the access token that apis.<app>.login(username=..., password=...) returns; \
apis.supervisor.show_account_passwords() lists the supervisor's passwords. APIs that list \
things return one page at a time: ask for page_index=0, 1, ... until a page comes back empty.

Work in small steps, read each result before you rely on it, and never invent a value. When \
the task is done, call apis.supervisor.complete_task(); if the task asks for information, \
pass only that as the answer, e.g. apis.supervisor.complete_task(answer=42). The episode \
ends at that call, or after {max_turns} replies."""

NO_CODE_MESSAGE = (
  "Your reply has no ```python code block, so nothing ran. Reply with the code of your next "
  "step in one ```python block."
)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\r?\n(.*?)```", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_POSITIVE = fields.int_at_least(1)
_SECONDS = fields.described(fields.number_above(0), "seconds")


@dataclasses.dataclass(frozen=True)
class AppWorldConfig:
  """Where the servers are, which tasks, the prompt, the reward and the failure handling.

  Servers:
    urls: comma-separated server URLs ("http://127.0.0.1:8000,http://127.0.0.1:8001"); when
      empty, `num_servers` servers on `host` at ports base_port, base_port + 1, ...
    host, base_port, num_servers: see urls.
  Tasks:
    datasets_dir: a directory of <split>.txt task id lists (AppWorld's data/datasets); empty:
      $APPWORLD_ROOT/data/datasets.
    train_split, eval_split: the AppWorld splits behind task_ids("train") / task_ids("eval").
    train_ids_file, eval_ids_file: files of task ids (one a line) used instead of the splits.
  Episode:
    max_turns: replies per episode at most.
    api_docs: "none" | "names" | "descriptions" (see the module docstring).
    max_observation_chars: an execution output longer than this is cut, with a marker.
    code_timeout_s: AppWorld's own limit on one code execution (its `timeout_seconds`).
    experiment_name: prefix of the AppWorld experiment name each server writes its outputs under
      (suffixed with the server's host and port, so servers never share a directory).
  Reward (see the module docstring):
    success_reward, partial_reward_weight, garbled_reward, garbled_min_replies.
  Failures:
    timeout_s: read timeout of a server call (> code_timeout_s: an execution may take that).
    connect_timeout_s, health_timeout_s: connection and health-probe timeouts.
    retries, backoff_s: extra attempts of a failed call, and the first backoff (doubling).
    lease_timeout_s: how long an episode waits for a server when all are leased.
    recheck_s: a server out of the pool is probed again after this long.
  """

  urls: str = fields.field(fields.STRING, "")
  host: str = fields.field(fields.STRING, "127.0.0.1")
  base_port: int = fields.field(fields.described(fields.int_in(1, 65535), "a port"), 8000)
  num_servers: int = fields.field(_POSITIVE, 1)
  datasets_dir: str = fields.field(fields.STRING, "")
  train_split: str = fields.field(fields.one_of(SPLITS), "train")
  eval_split: str = fields.field(fields.one_of(SPLITS), "dev")
  train_ids_file: str = fields.field(fields.STRING, "")
  eval_ids_file: str = fields.field(fields.STRING, "")
  max_turns: int = fields.field(_POSITIVE, 30)
  api_docs: str = fields.field(fields.one_of(API_DOCS_MODES), "names")
  max_observation_chars: int = fields.field(_POSITIVE, 20_000)
  code_timeout_s: int = fields.field(_POSITIVE, 100)
  experiment_name: str = fields.field(
    fields.Allowed(
      lambda v: isinstance(v, str) and bool(_NAME.match(v)),
      "a non-empty name of letters, digits, '_', '.' or '-'",
    ),
    "seeupo",
  )
  success_reward: float = fields.field(fields.NUMBER, 1.5)
  partial_reward_weight: float = fields.field(fields.NUMBER, 0.5)
  garbled_reward: float = fields.field(fields.NUMBER, -1.0)
  garbled_min_replies: int = fields.field(_POSITIVE, 1)
  timeout_s: float = fields.field(_SECONDS, 180.0)
  connect_timeout_s: float = fields.field(_SECONDS, 5.0)
  health_timeout_s: float = fields.field(_SECONDS, 5.0)
  retries: int = fields.field(fields.int_at_least(0), 3)
  backoff_s: float = fields.field(_SECONDS, 0.5)
  lease_timeout_s: float = fields.field(_SECONDS, 30.0)
  recheck_s: float = fields.field(_SECONDS, 30.0)

  def __post_init__(self):
    fields.check(self, "appworld")
    if self.base_port + self.num_servers - 1 > 65535:
      raise fields.FieldError.of(
        "appworld",
        "num_servers",
        self.num_servers,
        f"at most {65536 - self.base_port} (base_port + num_servers - 1 <= 65535)",
      )
    if self.timeout_s <= self.code_timeout_s:
      raise fields.FieldError.of(
        "appworld",
        "timeout_s",
        self.timeout_s,
        f"a number > appworld.code_timeout_s = {self.code_timeout_s}: a healthy server may take "
        "that long to run one reply's code",
      )
    if not self.urls and not self.host:
      raise fields.FieldError.of(
        "appworld", "host", self.host, "a host name or address when appworld.urls is empty"
      )
    for url in pool_lib.parse_urls(self.urls):
      try:
        parsed = httpx.URL(url)
      except httpx.InvalidURL as e:
        parsed = None
        why = f" ({url!r} is not a URL: {e})"
      if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise fields.FieldError.of(
          "appworld",
          "urls",
          self.urls,
          "comma-separated http:// or https:// URLs with a host, e.g. http://127.0.0.1:8000"
          + (why if parsed is None else f" ({url!r} is not one)"),
        )


def options_for_process(options: dict, index: int, count: int, local_index: int) -> dict:
  """The `env` options of process `index` of `count` in a multi-process run: its own servers.

  Every process plays its own episodes and leases servers from its own pool, so no two
  processes may share a server:
    urls "A,B;C,D": ';' separates the processes' lists (process 0 takes A and B, process 1 C
      and D); there must be one list per process.
    urls "A,B" (no ';'): every process uses the same URLs, which must then be on its own host
      (e.g. http://127.0.0.1:8000): allowed only with one process per host.
    urls "": `num_servers` servers on `host` (by default this machine) at ports from
      base_port + local_index x num_servers, so processes that share a host take disjoint
      port ranges (one process per host: base_port on every host).

  Raises:
    ValueError: a ';' list of the wrong length, or shared URLs on a host with more processes.
  """
  urls = str(options.get("urls", ""))
  out = dict(options)
  if ";" in urls:
    lists = urls.split(";")
    if len(lists) != count:
      raise ValueError(
        f"appworld.urls has {len(lists)} ';'-separated lists, but the run has {count} "
        "processes (one list each)"
      )
    out["urls"] = lists[index]
  elif urls:
    if local_index > 0:
      raise ValueError(
        "appworld.urls (without ';') would be shared by several processes of one host: give "
        "each process its own list, separated by ';', or leave urls empty (port ranges)"
      )
  else:
    base = int(options.get("base_port", AppWorldConfig.base_port))
    out["base_port"] = base + local_index * int(
      options.get("num_servers", AppWorldConfig.num_servers)
    )
  return out


def server_urls(config: AppWorldConfig) -> list[str]:
  """The pool's URLs: `urls` if given, else num_servers ports from base_port on `host`."""
  if config.urls:
    urls = pool_lib.parse_urls(config.urls)
    if len(set(urls)) != len(urls):
      raise ValueError(f"appworld.urls names a server twice: {urls}")
    return urls
  return [f"http://{config.host}:{config.base_port + i}" for i in range(config.num_servers)]


def make_pool(config: AppWorldConfig) -> pool_lib.ServerPool:
  """A `ServerPool` of the config's servers (not probed yet)."""
  clients = [
    client_lib.AppWorldClient(
      url,
      timeout_s=config.timeout_s,
      connect_timeout_s=config.connect_timeout_s,
      health_timeout_s=config.health_timeout_s,
      retries=config.retries,
      backoff_s=config.backoff_s,
    )
    for url in server_urls(config)
  ]
  return pool_lib.ServerPool(
    clients, lease_timeout_s=config.lease_timeout_s, recheck_s=config.recheck_s
  )


# --- text ---------------------------------------------------------------------------------------


def extract_code(reply: str) -> Optional[str]:
  """The code of the reply's first ```python (or ```py / ```python3) block, or None.

  <think>...</think> blocks are dropped first (code inside them never runs). None when there
  is no closed block or its code is blank: the reply is "unparsable".
  """
  visible = _THINK.sub("", reply)
  if "<think>" in visible:  # an unclosed thinking block: the rest of the reply is thinking
    visible = visible[: visible.index("<think>")]
  match = _CODE_BLOCK.search(visible)
  if match is None or not match.group(1).strip():
    return None
  return match.group(1).strip("\n")


def cap_output(text: str, max_chars: int) -> str:
  """`text`, cut to `max_chars` characters with a marker when longer."""
  if len(text) <= max_chars:
    return text
  return text[:max_chars] + OUTPUT_CUT_MARKER.format(max_chars)


def format_api_docs(docs: dict[str, dict[str, dict]], mode: str) -> str:
  """The prompt's API index from GET /api_docs ({app: {api: doc}}); "" for mode "none".

  names:        "- spotify: login, show_song, ..."
  descriptions: "- spotify.show_song(song_id): Get details of a specific song."
  """
  if mode == "none":
    return ""
  lines = []
  for app, apis in docs.items():
    if mode == "names":
      lines.append(f"- {app}: {', '.join(apis)}")
      continue
    for api, doc in apis.items():
      required = [
        str(p.get("name"))
        for p in doc.get("parameters") or []
        if isinstance(p, dict) and p.get("required")
      ]
      description = str(doc.get("description") or "").strip().split("\n")[0]
      first = re.split(r"(?<=\.)\s", description, maxsplit=1)[0]
      lines.append(f"- {app}.{api}({', '.join(required)}): {first}".rstrip(": "))
  header = (
    "The apps and their APIs (apis.api_docs.show_api_doc gives an API's parameters and response):"
    if mode == "names"
    else "The APIs, with their required parameters (apis.api_docs.show_api_doc gives the rest):"
  )
  return header + "\n" + "\n".join(lines)


def system_prompt(max_turns: int, docs_text: str) -> str:
  text = SYSTEM_PROMPT.format(max_turns=max_turns)
  return f"{text}\n\n{docs_text}" if docs_text else text


def task_message(task: client_lib.TaskInfo) -> str:
  s = task.supervisor
  return (
    f"My name is {s['first_name']} {s['last_name']}; my email is {s['email']} and my phone "
    f"number is {s['phone_number']}.\n\nTask: {task.instruction}"
  )


def reward_of(evaluation: client_lib.Evaluation, garbled: bool, config: AppWorldConfig) -> float:
  """The training reward (see the module docstring)."""
  if evaluation.success:
    return float(config.success_reward)
  if garbled:
    return float(config.garbled_reward)
  if evaluation.num_tests == 0:
    return 0.0
  return float(config.partial_reward_weight) * evaluation.passes / evaluation.num_tests


# --- the environment ----------------------------------------------------------------------------


class AppWorldEnv:
  """One AppWorld episode at a time on a leased server (see the module docstring).

  Args:
    config: the `AppWorldConfig`.
    pool: the shared `ServerPool`.
    docs_text: the API index put in the system prompt (`format_api_docs`).
  """

  def __init__(self, config: AppWorldConfig, pool: pool_lib.ServerPool, docs_text: str):
    self.config = config
    self.pool = pool
    self.docs_text = docs_text
    self._client: Optional[client_lib.AppWorldClient] = None
    self._task_id: Optional[str] = None
    self._turns = 0
    self._unparsable = 0
    self._executions = 0
    self._completed = False
    self._done = False
    self._broken: Optional[str] = None
    self._scored: Optional[tuple[int, base.Score]] = None

  @property
  def server_url(self) -> Optional[str]:
    """The leased server's URL (None between episodes)."""
    return None if self._client is None else self._client.url

  def reset(self, task_id: str) -> base.Reset:
    if self._client is not None:
      self.close()
    self._task_id, self._turns, self._unparsable, self._executions = task_id, 0, 0, 0
    self._completed, self._done, self._broken, self._scored = False, False, None, None
    client = self.pool.lease(task_id)
    self._client = client
    options = {
      "experiment_name": experiment_name(self.config.experiment_name, client.url),
      "timeout_seconds": self.config.code_timeout_s,
    }
    task = self._call(lambda: client.initialize(task_id, options))
    if task.task_id != task_id:
      self._fail(
        client_lib.ProtocolError(
          f"AppWorld server {client.url}: POST /initialize for task {task_id!r} answered task "
          f"{task.task_id!r}"
        )
      )
    messages = [
      {"role": "system", "content": system_prompt(self.config.max_turns, self.docs_text)},
      {"role": "user", "content": task_message(task)},
    ]
    return base.Reset(messages=messages, tools=None)

  def step(self, assistant_text: str) -> base.Step:
    client = self._live("step")
    if self._done:
      raise RuntimeError("AppWorldEnv.step called after the episode ended")
    self._turns += 1
    out_of_turns = self._turns >= self.config.max_turns
    code = extract_code(assistant_text)
    if code is None:
      self._unparsable += 1
      self._done = out_of_turns
      observation = [{"role": "user", "content": NO_CODE_MESSAGE}]
      return base.Step(observation, self._done, {"parsed": False, "completed": False})
    output = self._call(lambda: client.execute(self._task_id, code))
    self._executions += 1
    self._completed = self._call(lambda: client.task_completed(self._task_id))
    self._done = self._completed or out_of_turns
    text = cap_output(output, self.config.max_observation_chars)
    info = {"parsed": True, "completed": self._completed, "output_chars": len(output)}
    return base.Step([{"role": "user", "content": text}], self._done, info)

  def score(self) -> base.Score:
    client = self._live("score")
    if self._scored is not None and self._scored[0] == self._executions:
      return self._scored[1]  # the world has not changed since the last evaluation
    evaluation = self._call(lambda: client.evaluate(self._task_id))
    garbled = self._unparsable >= self.config.garbled_min_replies
    details = {
      "server": client.url,
      "num_tests": evaluation.num_tests,
      "passes": evaluation.passes,
      "failures": evaluation.failures,
      "failed_requirements": list(evaluation.failed_requirements[:5]),
      "difficulty": evaluation.difficulty,
      "completed": self._completed,
      "unparsable_replies": self._unparsable,
      "garbled": garbled,
      "turns": self._turns,
    }
    score = base.Score(
      reward=reward_of(evaluation, garbled, self.config),
      success=evaluation.success,
      details=details,
    )
    self._scored = (self._executions, score)
    return score

  def close(self) -> None:
    """POST /close and give the server back (never raises: a failed close marks the server)."""
    client, self._client = self._client, None
    if client is None:
      return
    failure = None
    try:
      client.close(self._task_id)
    except client_lib.AppWorldError as e:
      failure = e
      logging.warning("closing task %s: %s", self._task_id, e)
    self.pool.release(client, failure)

  # --- failure handling -----------------------------------------------------------------------

  def _live(self, what: str) -> client_lib.AppWorldClient:
    if self._broken is not None:
      raise RuntimeError(f"AppWorldEnv.{what} after a server failure: {self._broken}")
    if self._client is None:
      raise RuntimeError(f"AppWorldEnv.{what} called before reset")
    return self._client

  def _call(self, fn):
    try:
      return fn()
    except Exception as e:  # pylint: disable=broad-except  (never keep a lease past a failure)
      self._fail(e)

  def _fail(self, error: Exception):
    """Gives the server back marked by `error` and raises it: the episode is over."""
    client, self._client = self._client, None
    self._broken = (str(error) or type(error).__name__).splitlines()[0]
    self.pool.release(client, error)
    raise error


def experiment_name(prefix: str, url: str) -> str:
  """`prefix` + the server's host and port: where that server writes its task outputs."""
  parsed = httpx.URL(url)
  port = parsed.port or (443 if parsed.scheme == "https" else 80)
  return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prefix}_{parsed.host}_{port}")


# --- tasks ----------------------------------------------------------------------------------------


def read_task_ids(path: str) -> list[str]:
  """Task ids of a file: one a line; blank lines and '#' comments skipped; a ':tag' suffix
  (AppWorld's dataset files may tag ids) removed."""
  with open(path, encoding="utf-8") as f:
    lines = [line.split("#", 1)[0].strip() for line in f]
  return [line.split(":", 1)[0].strip() for line in lines if line]


def _datasets_dir(config: AppWorldConfig) -> str:
  if config.datasets_dir:
    return config.datasets_dir
  root = os.environ.get("APPWORLD_ROOT", "")
  return os.path.join(root, "data", "datasets") if root else ""


def _split_file(config: AppWorldConfig, split: str, override: str) -> str:
  if override:
    return override
  directory = _datasets_dir(config)
  if not directory:
    raise base.EnvironmentUnavailable(
      f"appworld: no task list for split {split!r}: set --config.env.datasets_dir to AppWorld's "
      "data/datasets directory (or export APPWORLD_ROOT), or give --config.env.train_ids_file / "
      "--config.env.eval_ids_file (one task id a line)"
    )
  return os.path.join(directory, f"{split}.txt")


def _load_ids(path: str, what: str) -> list[str]:
  try:
    ids = read_task_ids(path)
  except OSError as e:
    raise base.EnvironmentUnavailable(
      f"appworld: cannot read the {what} task ids from {path!r} ({e.strerror}). They are "
      "AppWorld's data/datasets/<split>.txt (after `appworld download data`): set "
      "--config.env.datasets_dir, or --config.env.train_ids_file / --config.env.eval_ids_file"
    ) from None
  if not ids:
    raise base.EnvironmentUnavailable(f"appworld: {path!r} lists no task ids ({what})")
  return ids


def _first_of(failures: list[tuple[str, Optional[str]]]) -> str:
  """Servers that failed, in a few words: their count, the first URL and why it failed, and
  the last URL ("256 tried, http://h:8000 .. http://h:8255; the first: GET ...: refused")."""
  (first, why), last = failures[0], failures[-1][0]
  reason = why if why and first in why else f"{first}: {why or 'no reason recorded'}"
  if len(failures) == 1:
    return f"1 tried: {reason}"
  return f"{len(failures)} tried, {first} .. {last}; the first: {reason}"


def spec(config: AppWorldConfig, pool: Optional[pool_lib.ServerPool] = None) -> base.EnvSpec:
  """The registry entry: probes the servers, reads the API docs and the task ids.

  Every server is probed; the API docs and the first task of each id list are read from the
  first one that answers, or the next if that call fails there (`ServerPool.run_on_one`).

  Raises:
    EnvironmentUnavailable (one line): no server answers (the message names the URLs tried and
      the command that starts servers), the API docs cannot be read (or have the wrong shape) on
      any server tried, a task id list is missing, or its first task is unknown to the servers.
  """
  pool = pool or make_pool(config)
  results = pool.probe(log=False)
  answering = [url for url, reason in results.items() if reason is None]
  if not answering:
    tried = _first_of(list(results.items()))
    if config.urls:
      command = client_lib.start_command()
      flags = "--config.env.urls=http://<host>:<port>,..."
    else:
      command = client_lib.start_command(config.num_servers, config.base_port)
      flags = (
        f"--config.env.base_port={config.base_port} --config.env.num_servers={config.num_servers}"
      )
    raise base.EnvironmentUnavailable(
      f"no AppWorld environment server answers ({tried}). Start them "
      f"(from AppWorld's own venv) with `{command}` and run with {flags} (docs/appworld.md)"
    )
  if len(answering) < len(results):
    logging.warning(
      "%d of %d AppWorld servers answer; running without the others (%s)",
      len(answering),
      len(results),
      _first_of([(url, why) for url, why in results.items() if why is not None]),
    )

  train_file = _split_file(config, config.train_split, config.train_ids_file)
  eval_file = _split_file(config, config.eval_split, config.eval_ids_file)
  ids = {
    "train": _load_ids(train_file, f"train ({config.train_split})"),
    "eval": _load_ids(eval_file, f"eval ({config.eval_split})"),
  }
  # The API docs, and one task of each id list (the lists and the servers must come from the
  # same AppWorld data), from the first answering server; another one if that call fails there.
  try:
    docs_text = (
      format_api_docs(pool.api_docs(), config.api_docs) if config.api_docs != "none" else ""
    )
  except client_lib.AppWorldError as e:
    raise base.EnvironmentUnavailable(f"appworld: cannot read the API docs: {e}") from None
  for role, path in (("train", train_file), ("eval", eval_file)):
    task_id = ids[role][0]
    try:
      pool.run_on_one(lambda client, task_id=task_id: client.show_task(task_id))
    except client_lib.AppWorldError as e:
      raise base.EnvironmentUnavailable(
        f"appworld: task {task_id!r} (the first of {path!r}) cannot be looked up: {e}. Do the "
        "id lists come from the servers' AppWorld data?"
      ) from None
  logging.info(
    "appworld: %d servers (%d answer), %d train / %d eval tasks, system prompt %d characters",
    len(pool),
    len(answering),
    len(ids["train"]),
    len(ids["eval"]),
    len(system_prompt(config.max_turns, docs_text)),
  )

  other_splits: dict[str, list[str]] = {}

  def task_ids(split: str) -> Sequence[str]:
    if split in ids:
      return ids[split]
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; allowed: {['train', 'eval', *SPLITS]}")
    if split not in other_splits:
      other_splits[split] = _load_ids(_split_file(config, split, ""), split)
    return other_splits[split]

  return base.EnvSpec(
    make=lambda: AppWorldEnv(config, pool, docs_text),
    task_ids=task_ids,
    max_turns=config.max_turns,
    capacity=lambda: len(pool) - pool.counts()["down"],  # one episode per healthy server
  )


def make_spec(options) -> base.EnvSpec:
  """The registry factory: `spec(AppWorldConfig(**options))`."""
  return spec(AppWorldConfig(**options))
