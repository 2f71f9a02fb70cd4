"""HTTP client of AppWorld's environment server, and a pool of such servers.

AppWorld (PyPI `appworld`, 0.1.3.post1) ships an HTTP server for its `AppWorld`
class: `appworld serve environment --port P` (source:
`appworld/serve/environment.py`). It holds ONE task world at a time. The
requests this module sends, with the shapes of that source (FastAPI `Body`
parameters, so every POST body is one JSON object) and its answers, always
wrapped as {"output": ...}:

    GET  /                 -> {"message": str}                       (our health probe)
    POST /initialize       {"task_id": str, <AppWorldInitDefaults fields>...}
                           -> {"output": {"task_id", "instruction", "supervisor":
                               {"first_name", "last_name", "email", "phone_number"},
                               "datetime": str}}
    POST /execute          {"task_id": str, "code": str}            -> {"output": str}
    POST /task_completed   {"task_id": str}                         -> {"output": bool}
    POST /evaluate         {"task_id": str, "suppress_errors": bool, "report": false}
                           -> {"output": {"success": bool, "difficulty": int | None,
                               "num_tests": int, "passes": [{"requirement", "label"}],
                               "failures": [{"requirement", "trace", "label"}]}}
    POST /close            {"task_id": str}                         -> {"output": null}
    GET  /tasks/{task_id}  -> {"output": <the /initialize output>}
    GET  /api_docs         -> {app: {api: {"app_name", "api_name", "path", "method",
                               "description", "parameters": [...], "response_schemas"}}}
                              (NOT wrapped in "output")

A request for a task the server does not hold (another task is initialized,
or none) and an unknown task id at /initialize both raise inside the server:
FastAPI answers 500 "Internal Server Error" (plain text). A body that does not
fit the schema is a 422 with {"detail": [...]}. We never send
`ground_truth_mode`: in 0.1.3.post1 its schema is `Literal["full" "minimal"]`
(a missing comma: the only accepted value is "fullminimal"), so any real value
gets a 422; the server's default ("minimal") is what evaluation needs.

Failures and retries (`AppWorldClient`): every request has a connect timeout
and a read timeout. A request that never reached the server (connection
refused, connect timeout) is retried with exponential backoff. A request that
may have reached it (read timeout, connection dropped mid-answer, a 5xx) is
retried only when repeating it is harmless: everything but /execute, where a
second run of the code could repeat its side effects (a payment, a message);
such an episode is instead replayed from the start on a fresh environment by
the rollout loop. When the retries are spent, the error names the server's
URL, the request and the cause. Nothing here returns a default value for a
failed call: a failure is always an exception, and its message is one line
naming the server's URL, the endpoint and what happened.

Shapes: every answer is checked against the shapes above (types, fields, counts
that add up; /api_docs down to each doc's fields and names). A wrong shape is a
`ProtocolError` naming the endpoint, never a default or a guess.

`ServerPool` leases servers to episodes, one episode per server (see its
docstring): thread-safe, blocking with a timeout when every server is leased,
taking a server that stops answering out of rotation while at least one other
still answers, and leasing a server whose episode failed only after the others
and after it answers a health probe.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import ssl
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

from absl import logging
import httpx

T = TypeVar("T")


def start_command(
  num_servers: str | int = "<num_servers>", base_port: str | int = "<base_port>"
) -> str:
  """The command that starts servers (named in every 'no server answers' error)."""
  return (
    "APPWORLD_PYTHON=/path/to/appworld-venv/bin/python bash experiments/appworld_servers.sh "
    f"{num_servers} {base_port}"
  )


START_COMMAND = start_command()


class AppWorldError(RuntimeError):
  """An AppWorld server call failed (base class). The message names the URL and the request."""


class ServerUnreachable(AppWorldError):
  """No usable answer: connection refused or dropped, or slower than the timeout."""


class ServerError(AppWorldError):
  """The server answered 5xx: it is up, but the request failed inside it (an unknown task id,
  a task it does not hold, a crash in AppWorld)."""


class RequestRejected(AppWorldError):
  """The server answered 4xx (e.g. 422: a body its schema refuses)."""


class ProtocolError(AppWorldError):
  """The server answered 200 with a body that is not the protocol's (bad JSON, missing fields)."""


class PoolExhausted(AppWorldError):
  """No server could be leased: none answers, or all stayed leased for `lease_timeout_s`."""


@dataclasses.dataclass(frozen=True)
class TaskInfo:
  """A task as /initialize and /tasks/{id} describe it.

  supervisor: {"first_name", "last_name", "email", "phone_number"}: str each.
  datetime: the task world's frozen date and time, as the server serialised it (ISO text).
  """

  task_id: str
  instruction: str
  supervisor: dict
  datetime: str


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The unit tests of a task's end state (/evaluate).

  success: every test passed. num_tests: the task's test count (>= passes + failures).
  passes, failures: counts. failed_requirements: what each failed test checks.
  difficulty: AppWorld's 1-3 difficulty of the task, or None.
  """

  success: bool
  num_tests: int
  passes: int
  failures: int
  failed_requirements: tuple[str, ...] = ()
  difficulty: Optional[int] = None


_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport errors raised before any byte of the request reached the server."""
_MAYBE_SENT = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class AppWorldClient:
  """One AppWorld environment server. Thread-safe (one `httpx.Client`, pooled connections).

  Args:
    url: the server's base URL, e.g. "http://127.0.0.1:8000".
    timeout_s: read/write timeout of a task call (/initialize, /execute, /evaluate, ...);
      longer than AppWorld's own code timeout, or a slow but healthy execution looks dead.
    connect_timeout_s: time to open a connection.
    health_timeout_s: whole-request timeout of the health probe (GET /) and of /api_docs's
      connect; /api_docs reads with `timeout_s`.
    retries: extra attempts of a failed request (see the module docstring for which).
    backoff_s: the wait before retry k is backoff_s * 2**k, at most `max_backoff_s`.
    transport: an httpx transport (tests).
  """

  def __init__(
    self,
    url: str,
    *,
    timeout_s: float = 180.0,
    connect_timeout_s: float = 5.0,
    health_timeout_s: float = 5.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    max_backoff_s: float = 8.0,
    transport: Optional[httpx.BaseTransport] = None,
  ):
    self.url = url.rstrip("/")
    self.timeout_s = timeout_s
    self.connect_timeout_s = connect_timeout_s
    self.health_timeout_s = health_timeout_s
    self.retries = retries
    self.backoff_s = backoff_s
    self.max_backoff_s = max_backoff_s
    # keepalive_expiry below uvicorn's 5 s keep-alive: a pooled connection is dropped by us
    # before the server closes it, so a request never goes out on a connection the server
    # already closed. trust_env=False: the servers are addressed directly, never via a proxy
    # from HTTP_PROXY.
    self._http = httpx.Client(
      base_url=self.url,
      timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
      limits=httpx.Limits(max_keepalive_connections=4, keepalive_expiry=2.0),
      trust_env=False,
      verify=_ssl_context(),
      transport=transport,
    )

  def __repr__(self) -> str:
    return f"AppWorldClient({self.url!r})"

  def shutdown(self) -> None:
    """Closes the connections (the client cannot be used after)."""
    self._http.close()

  # --- the requests -------------------------------------------------------------------------

  def health(self) -> Optional[str]:
    """None when GET / answers AppWorld's welcome ({"message": "Welcome to AppWorld Server! ..."})
    within `health_timeout_s`, else why not (one line naming the URL).

    One attempt, no retry: the pool decides what to do with a server that does not answer.
    """
    try:
      response = self._http.get("/", timeout=self.health_timeout_s)
    except httpx.HTTPError as e:
      return f"GET {self.url}/: {_describe(e)}"
    if response.status_code != 200:
      return f"GET {self.url}/: HTTP {response.status_code}"
    try:
      body = response.json()
    except ValueError:
      return f"GET {self.url}/: the answer is not JSON: {response.text[:80]!r}"
    if not isinstance(body, dict) or "AppWorld" not in str(body.get("message", "")):
      return f"GET {self.url}/: not an AppWorld server's welcome: {response.text[:80]!r}"
    return None

  def initialize(self, task_id: str, options: Mapping[str, Any]) -> TaskInfo:
    """POST /initialize: loads `task_id`'s world on the server (replacing the one it held).

    options: more `AppWorldInitDefaults` fields (experiment_name, timeout_seconds, ...).
    Retried like every idempotent call: initializing again starts the same world afresh.
    """
    where = self._where("POST", "/initialize", f"initialize task {task_id!r}")
    output = self._call("POST", "/initialize", {**options, "task_id": task_id}, where=where)
    return _task_info(output, where)

  def execute(self, task_id: str, code: str) -> str:
    """POST /execute: runs `code` in the task's Python session; the printed output.

    Retried only when the request cannot have reached the server (see the module docstring).
    """
    where = self._where("POST", "/execute", f"execute code in task {task_id!r}")
    body = {"task_id": task_id, "code": code}
    output = self._call("POST", "/execute", body, where=where, idempotent=False)
    if not isinstance(output, str):
      raise _wrong_shape(where, "output is not a string", output)
    return output

  def task_completed(self, task_id: str) -> bool:
    """POST /task_completed: whether the agent has called apis.supervisor.complete_task."""
    where = self._where("POST", "/task_completed", f"ask if task {task_id!r} is completed")
    output = self._call("POST", "/task_completed", {"task_id": task_id}, where=where)
    if not isinstance(output, bool):
      raise _wrong_shape(where, "output is not a bool", output)
    return output

  def evaluate(self, task_id: str) -> Evaluation:
    """POST /evaluate: runs the task's unit tests on the world's current state."""
    where = self._where("POST", "/evaluate", f"evaluate task {task_id!r}")
    body = {"task_id": task_id, "suppress_errors": True, "report": False}
    return _evaluation(self._call("POST", "/evaluate", body, where=where), where)

  def close(self, task_id: str) -> None:
    """POST /close: releases the task world's resources on the server."""
    where = self._where("POST", "/close", f"close task {task_id!r}")
    output = self._call("POST", "/close", {"task_id": task_id}, where=where)
    if output is not None:
      raise _wrong_shape(where, "output is not null", output)

  def show_task(self, task_id: str) -> TaskInfo:
    """GET /tasks/{task_id}: the task's description, without initializing it."""
    where = self._where("GET", f"/tasks/{task_id}", f"look up task {task_id!r}")
    return _task_info(self._call("GET", f"/tasks/{task_id}", None, where=where), where)

  def api_docs(self) -> dict[str, dict[str, dict]]:
    """GET /api_docs: {app name: {api name: doc}} (see the module docstring), shape-checked:
    every doc has AppWorld's fields and names the app and the API it is filed under."""
    where = self._where("GET", "/api_docs", "read the API docs")
    docs = self._call("GET", "/api_docs", None, where=where, wrapped=False)
    _check_api_docs(docs, where)
    return docs

  # --- plumbing ------------------------------------------------------------------------------

  def _where(self, method: str, path: str, what: str) -> str:
    """The prefix of every error about one request: the server, the endpoint, the purpose."""
    return f"AppWorld server {self.url}: {method} {path} ({what})"

  def _call(
    self,
    method: str,
    path: str,
    body: Optional[dict],
    *,
    where: str,
    idempotent: bool = True,
    wrapped: bool = True,
  ) -> Any:
    """Sends the request with retries; the answer's "output" (or the whole body if not wrapped).

    where: the error messages' prefix (`_where`).

    Raises:
      ServerUnreachable, ServerError, RequestRejected, ProtocolError (see their docstrings).
    """
    attempts = self.retries + 1
    for attempt in range(attempts):
      last = attempt == attempts - 1
      try:
        response = self._http.request(method, path, json=body)
      except _NOT_SENT as e:
        if last:
          raise ServerUnreachable(
            f"{where} failed after {attempts} attempts: {_describe(e)}"
          ) from None
        self._backoff(attempt, where, e)
        continue
      except _MAYBE_SENT as e:
        if not idempotent:
          raise ServerUnreachable(
            f"{where} failed: {_describe(e)} (not retried: the code may have run; the episode "
            "must start over)"
          ) from None
        if last:
          raise ServerUnreachable(
            f"{where} failed after {attempts} attempts: {_describe(e)}"
          ) from None
        self._backoff(attempt, where, e)
        continue
      except httpx.HTTPError as e:  # anything else httpx raises (a bad URL, a proxy error)
        raise ServerUnreachable(f"{where} failed: {_describe(e)}") from None
      status = response.status_code
      if status >= 500:
        detail = f"HTTP {status}: {response.text[:300]!r}"
        if not idempotent:
          raise ServerError(
            f"{where} failed: {detail} (not retried: the code may have run; the episode must "
            "start over). The server's log has AppWorld's traceback"
          )
        if last:
          raise ServerError(
            f"{where} failed after {attempts} attempts: {detail}. The server's log has "
            "AppWorld's traceback (an unknown task id, or a task the server does not hold, "
            "answers 500)"
          )
        self._backoff(attempt, where, detail)
        continue
      if status != 200:
        raise RequestRejected(f"{where} was refused: HTTP {status}: {response.text[:300]!r}")
      try:
        parsed = response.json()
      except ValueError:
        raise ProtocolError(f"{where}: the answer is not JSON: {response.text[:200]!r}") from None
      if not wrapped:
        return parsed
      if not isinstance(parsed, dict) or "output" not in parsed:
        raise ProtocolError(f"{where}: the answer has no 'output' field: {response.text[:200]!r}")
      return parsed["output"]
    raise AssertionError("unreachable")

  def _backoff(self, attempt: int, where: str, cause) -> None:
    wait = min(self.max_backoff_s, self.backoff_s * 2**attempt)
    logging.warning(
      "%s: %s; retry %d/%d in %.1f s",
      where,
      _describe(cause) if isinstance(cause, Exception) else cause,
      attempt + 1,
      self.retries,
      wait,
    )
    time.sleep(wait)


def _health(client: AppWorldClient) -> Optional[str]:
  """`client.health()`, with any unexpected exception turned into the reason (a probe must end)."""
  try:
    return client.health()
  except Exception as e:  # pylint: disable=broad-except
    return f"GET {client.url}/: {_describe(e)}"


@functools.cache
def _ssl_context() -> ssl.SSLContext:
  """One TLS context for every client (building one per client costs ~25 ms: 6 s for 256)."""
  return httpx.create_ssl_context()


def _describe(error: Exception) -> str:
  """`ErrorType: message`, on one line."""
  text = " ".join(str(error).split()) or "no detail"
  return f"{type(error).__name__}: {text}"


def _snippet(value: Any, limit: int = 200) -> str:
  """The start of `value` as JSON (what a wrong-shape error quotes)."""
  try:
    text = json.dumps(value, default=str)
  except ValueError:  # a circular structure: never from JSON, but an error must not fail
    text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


def _wrong_shape(where: str, why: str, value: Any) -> ProtocolError:
  return ProtocolError(f"{where} answered a wrong shape: {why}: {_snippet(value)}")


_TASK_FIELDS = ("task_id", "instruction", "supervisor", "datetime")
_PERSON_FIELDS = ("first_name", "last_name", "email", "phone_number")


def _task_info(output: Any, where: str) -> TaskInfo:
  """The output of /initialize or /tasks/{id}: {task_id, instruction, datetime: str,
  supervisor: {first_name, last_name, email, phone_number: str}}."""
  if not isinstance(output, dict) or any(
    not isinstance(output.get(k), str) for k in _TASK_FIELDS[:2]
  ):
    raise _wrong_shape(where, "output is not a task (str task_id and instruction)", output)
  if not isinstance(output.get("datetime"), str):
    raise _wrong_shape(where, "the task has no str 'datetime'", output)
  supervisor = output.get("supervisor")
  if not isinstance(supervisor, dict) or any(
    not isinstance(supervisor.get(k), str) for k in _PERSON_FIELDS
  ):
    raise _wrong_shape(
      where, f"the task's supervisor is not {{{', '.join(_PERSON_FIELDS)}: str}}", supervisor
    )
  return TaskInfo(
    task_id=output["task_id"],
    instruction=output["instruction"],
    supervisor={k: supervisor[k] for k in _PERSON_FIELDS},
    datetime=output["datetime"],
  )


def _evaluation(output: Any, where: str) -> Evaluation:
  """The output of /evaluate (AppWorld's TestTracker.to_dict): {success: bool, difficulty:
  int | None, num_tests: int, passes: [{requirement, label}], failures: [{requirement, trace,
  label}]}, with counts that add up."""

  def bad(why: str) -> ProtocolError:
    return _wrong_shape(where, why, output)

  if not isinstance(output, dict):
    raise bad("output is not an object")
  success, num_tests = output.get("success"), output.get("num_tests")
  passes, failures = output.get("passes"), output.get("failures")
  difficulty = output.get("difficulty")
  if not isinstance(success, bool):
    raise bad("output has no bool 'success'")
  if not isinstance(num_tests, int) or isinstance(num_tests, bool) or num_tests < 0:
    raise bad("output has no int 'num_tests' >= 0")
  if not isinstance(passes, list) or not isinstance(failures, list):
    raise bad("output has no 'passes' and 'failures' lists")
  if len(passes) + len(failures) > num_tests:
    raise bad(f"counts {len(passes)} passes + {len(failures)} failures > num_tests={num_tests}")
  if success != (len(passes) == num_tests):
    raise bad(f"says success={success} with {len(passes)} of {num_tests} tests passed")
  if not all(
    isinstance(t, dict) and isinstance(t.get("requirement"), str) for t in passes + failures
  ):
    raise bad("a pass or failure is not an object with a str 'requirement'")
  if difficulty is not None and (not isinstance(difficulty, int) or isinstance(difficulty, bool)):
    raise bad("'difficulty' is neither an int nor null")
  return Evaluation(
    success=success,
    num_tests=num_tests,
    passes=len(passes),
    failures=len(failures),
    failed_requirements=tuple(f["requirement"] for f in failures),
    difficulty=difficulty,
  )


_DOC_FIELDS = (
  "app_name",
  "api_name",
  "path",
  "method",
  "description",
  "parameters",
  "response_schemas",
)


def _check_api_docs(docs: Any, where: str) -> None:
  """Raises a ProtocolError unless `docs` is {app name: {api name: doc}}: at least one app, each
  with at least one API, each doc an object with AppWorld's fields (`_DOC_FIELDS`) whose
  app_name and api_name are the keys it is filed under, and a list of parameter objects.

  This is what catches an answer wrapped like the other endpoints' ({"output": {...}}), which
  would otherwise put an app named "output" in the prompt.
  """
  if not isinstance(docs, dict) or not docs:
    raise _wrong_shape(where, "not a non-empty {app name: {api name: doc}} object", docs)
  for app, apis in docs.items():
    if not isinstance(apis, dict) or not apis:
      raise _wrong_shape(where, f"app {app!r} is not a non-empty {{api name: doc}} object", apis)
    for api, doc in apis.items():
      if not isinstance(doc, dict) or any(k not in doc for k in _DOC_FIELDS):
        raise _wrong_shape(where, f"{app}.{api} is not an API doc ({', '.join(_DOC_FIELDS)})", doc)
      if doc["app_name"] != app or doc["api_name"] != api:
        raise _wrong_shape(
          where, f"the doc filed as {app}.{api} is {doc['app_name']!r}.{doc['api_name']!r}", doc
        )
      if not isinstance(doc["description"], str):
        raise _wrong_shape(where, f"{app}.{api}: 'description' is not a string", doc)
      parameters = doc["parameters"]
      if not isinstance(parameters, list) or not all(isinstance(p, dict) for p in parameters):
        raise _wrong_shape(where, f"{app}.{api}: 'parameters' is not a list of objects", doc)


# --- the pool -------------------------------------------------------------------------------------

_IDLE, _LEASED, _DOWN, _PROBING = "idle", "leased", "down", "probing"

FALLBACK_SERVERS = 3
"""`ServerPool.run_on_one` tries a call on at most this many servers before it gives up."""


@dataclasses.dataclass
class _Server:
  client: AppWorldClient
  state: str = _IDLE
  reason: str = ""  # why it is down
  checked_at: float = 0.0  # time.monotonic() of the last health probe
  released_at: float = 0.0
  failed_at: float = 0.0  # when its last episode failed; 0.0: it did not (or never ran one)
  task: Optional[str] = None  # the task of its current (or last) lease, when the lease named one
  failed_task: Optional[str] = None  # the task its last episode failed on, when it failed one


class ServerPool:
  """Leases AppWorld servers to episodes: one episode per server, from reset to close.

  `lease()` hands out an idle server, marking it leased; `release(client,
  failure)` gives it back. A server whose call failed for transport reasons
  (unreachable, timeouts, malformed answers) goes DOWN: out of rotation. A
  server that answered 5xx or 4xx is probed (GET /) at once and goes DOWN if it
  does not answer. Either way the server is marked as having failed its
  episode, until an episode on it ends without failure. The lease order:

    1. servers that did not fail their last episode, the one idle longest
       first: an episode replayed after a failure goes to another server when
       one is idle. A lease that names its task (`lease(task_id)`) does not
       take a server whose last episode failed on that same task while any
       other server is leased: it waits for one to be released (at most
       `lease_timeout_s`, then takes it after all), so the replay of a failed
       episode runs elsewhere even when every other server is busy;
    2. then servers that did, the one that failed longest ago first, each
       health-probed (GET /) right before it is leased: it is leased only if it
       answers, else it goes DOWN;
    3. when no server is idle: DOWN servers whose last probe is `recheck_s` old
       are probed again (a restarted server rejoins; one that fails the probe
       stays out), and when no server is leased either, every DOWN server is
       probed once, now.

  The run goes on while at least one server answers; when none does,
  `lease()` raises `PoolExhausted` naming every URL and why, and the command
  that starts servers.

  When every live server is leased, `lease()` waits for a release, at most
  `lease_timeout_s`, then raises. Leases that would wait again before any
  server was released since such a timeout fail at once (each episode holds
  its server until it ends, so waiting longer does not help). The rollout loop
  starts at most as many episodes as there are healthy servers
  (`EnvSpec.capacity`), so a lease waits only when servers go down mid-wave or
  something else leases them.

  Every message is one line. Thread-safe: the rollout loop resets, steps and
  closes environments from a thread pool.
  """

  def __init__(
    self,
    clients: Sequence[AppWorldClient],
    *,
    lease_timeout_s: float = 30.0,
    recheck_s: float = 30.0,
  ):
    if not clients:
      raise ValueError("a ServerPool needs at least one server")
    urls = [c.url for c in clients]
    if len(set(urls)) != len(urls):
      raise ValueError(f"a server URL appears twice in the pool: {urls}")
    self._servers = [_Server(c) for c in clients]
    self._by_client = {id(s.client): s for s in self._servers}
    self.lease_timeout_s = lease_timeout_s
    self.recheck_s = recheck_s
    self._cond = threading.Condition()
    self._releases = 0
    self._starved_at = -1  # the release count when a lease last timed out
    self._docs: Optional[dict] = None
    self._docs_lock = threading.Lock()

  @property
  def urls(self) -> list[str]:
    return [s.client.url for s in self._servers]

  def __len__(self) -> int:
    return len(self._servers)

  def counts(self) -> dict[str, int]:
    """{"idle", "leased", "down", "probing"}: how many servers are in each state."""
    with self._cond:
      out = {_IDLE: 0, _LEASED: 0, _DOWN: 0, _PROBING: 0}
      for s in self._servers:
        out[s.state] += 1
      return out

  def down(self) -> dict[str, str]:
    """{url: why} of the servers out of rotation."""
    with self._cond:
      return {s.client.url: s.reason for s in self._servers if s.state == _DOWN}

  def failed(self) -> list[str]:
    """The URLs of the servers whose last episode failed (leased last, probed first)."""
    with self._cond:
      return [s.client.url for s in self._servers if s.failed_at]

  def probe(self, log: bool = True) -> dict[str, Optional[str]]:
    """Health-probes every server not leased, in parallel; {url: None if it answers, else why}.

    Idle servers that do not answer go DOWN; DOWN servers that answer become idle. `log`:
    log each server that changes state (the caller reports otherwise).
    """
    with self._cond:
      targets = [s for s in self._servers if s.state in (_IDLE, _DOWN)]
      for s in targets:
        s.state = _PROBING
    results = self._probe_outside_lock(targets, log)
    return {s.client.url: results[id(s)] for s in self._servers if id(s) in results}

  def _probe_outside_lock(
    self, targets: list[_Server], log: bool = True
  ) -> dict[int, Optional[str]]:
    """Probes `targets` (already marked PROBING) without holding the lock; records the results."""
    if not targets:
      return {}
    if len(targets) == 1:
      reasons = [_health(targets[0].client)]
    else:
      with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as workers:
        reasons = list(workers.map(lambda s: _health(s.client), targets))
    with self._cond:
      for s, reason in zip(targets, reasons):
        self._record_probe(s, reason, log)
    return {id(s): r for s, r in zip(targets, reasons)}

  def _record_probe(self, server: _Server, reason: Optional[str], log: bool = True) -> None:
    """A probe's result (under the lock): the server becomes idle if it answered, else DOWN."""
    server.checked_at = time.monotonic()
    if reason is None:
      if server.reason and log:
        logging.warning("AppWorld server %s answers again; back in the pool", server.client.url)
      server.state, server.reason = _IDLE, ""
    else:
      if server.reason != reason and log:
        logging.warning("AppWorld server %s is out of the pool: %s", server.client.url, reason)
      server.state, server.reason = _DOWN, reason
    self._cond.notify_all()

  def lease(self, task_id: Optional[str] = None) -> AppWorldClient:
    """An idle, answering server, now leased to the caller (see the class docstring).

    Args:
      task_id: the task the lease is for: a server whose last episode failed on it is
        taken only when no other server is leased, or after `lease_timeout_s`.

    Raises:
      PoolExhausted: no server answers, or none was released within `lease_timeout_s`.
    """
    return self._lease(frozenset(), task_id)

  def _lease(self, skip: frozenset[int], task_id: Optional[str] = None) -> AppWorldClient:
    """`lease(task_id)` among the servers whose id() is not in `skip`."""
    deadline = time.monotonic() + self.lease_timeout_s
    probed_all = False
    passed: set[int] = set()  # servers that answered a probe during this call
    with self._cond:
      while True:
        servers = [s for s in self._servers if id(s) not in skip]
        idle = [s for s in servers if s.state == _IDLE]
        if task_id is not None and idle:
          others = [s for s in idle if s.failed_task != task_id]
          remaining = deadline - time.monotonic()
          busy = any(s.state in (_LEASED, _PROBING) for s in servers)
          if not others and busy and remaining > 0:
            self._cond.wait(remaining)  # a server that failed this task: wait for another
            continue
          idle = others or idle
        if idle:
          server = min(idle, key=lambda s: (s.failed_at, s.released_at))
          if not server.failed_at or id(server) in passed:
            server.state, server.task = _LEASED, task_id
            return server.client
          # Its last episode failed: leased only if it answers a health probe now.
          server.state = _PROBING
          self._cond.release()
          try:
            reason = _health(server.client)
          finally:
            self._cond.acquire()
          self._record_probe(server, reason)
          if reason is None:
            passed.add(id(server))
          continue
        now = time.monotonic()
        live = [s for s in servers if s.state in (_LEASED, _PROBING)]
        due = [s for s in servers if s.state == _DOWN and now - s.checked_at >= self.recheck_s]
        if not live and not probed_all:  # everything is down: probe all of them once, now
          due, probed_all = [s for s in servers if s.state == _DOWN], True
        if due:
          for s in due:
            s.state = _PROBING
          self._cond.release()
          try:
            results = self._probe_outside_lock(due)
          finally:
            self._cond.acquire()
          passed.update(i for i, reason in results.items() if reason is None)
          continue
        if not live:
          raise PoolExhausted(self._all_down_message())
        if self._releases == self._starved_at:
          raise PoolExhausted(self._starved_message(waited=False))
        remaining = deadline - now
        if remaining <= 0:
          self._starved_at = self._releases
          raise PoolExhausted(self._starved_message(waited=True))
        self._cond.wait(remaining)

  def release(self, client: AppWorldClient, failure: Optional[BaseException] = None) -> None:
    """Gives a leased server back; `failure` is the error its episode ended with, if any.

    ServerUnreachable / ProtocolError: the server goes DOWN (out of rotation).
    Any other error (a 5xx or 4xx answer, a bug outside the server): it is probed (GET /)
    and stays in rotation if it answers. With a failure, the server is leased after the
    others and probed again before it is (see the class docstring); without one, that mark
    is cleared.
    """
    server = self._by_client.get(id(client))
    if server is None:
      raise ValueError(f"{client!r} is not a server of this pool")
    reason = ""
    if failure is not None:
      if isinstance(failure, (ServerUnreachable, ProtocolError)):
        reason = " ".join((str(failure) or type(failure).__name__).split())[:300]
      else:
        reason = _health(client) or ""
    with self._cond:
      if server.state != _LEASED:
        raise ValueError(f"{client!r} is not leased (state {server.state})")
      now = time.monotonic()
      self._releases += 1
      server.released_at = now
      server.failed_at = now if failure is not None else 0.0
      server.failed_task = server.task if failure is not None else None
      if reason:
        server.state, server.reason, server.checked_at = _DOWN, reason, now
        healthy = sum(s.state != _DOWN for s in self._servers)
        logging.warning(
          "AppWorld server %s is out of the pool (%d of %d left): %s",
          client.url,
          healthy,
          len(self._servers),
          reason,
        )
      else:
        server.state = _IDLE
      self._cond.notify_all()

  def run_on_one(self, fn: Callable[[AppWorldClient], T], tries: int = FALLBACK_SERVERS) -> T:
    """fn(client) on one leased server, the next one when it fails: at most `tries` servers.

    The servers come in lease order: at start-up, the first answering one in URL order. A
    server whose call raised an `AppWorldError` is released with it (marked, or DOWN).

    Raises:
      the first server's error (of its type, naming the other servers tried) when every
      server tried failed; PoolExhausted when no server could be leased at all.
    """
    errors: list[tuple[str, AppWorldError]] = []
    tried: set[int] = set()
    while len(tried) < min(tries, len(self._servers)):
      try:
        client = self._lease(frozenset(tried))
      except PoolExhausted:
        if not errors:
          raise
        break
      tried.add(id(self._by_client[id(client)]))
      failure = None
      try:
        return fn(client)
      except AppWorldError as e:
        failure = e
        errors.append((client.url, e))
        logging.warning("%s; trying another server", e)
      finally:
        self.release(client, failure)
    first = errors[0][1]
    if len(errors) == 1:
      raise first
    others = ", ".join(url for url, _ in errors[1:])
    raise type(first)(f"{first} (the same call failed on {others} too)") from None

  def api_docs(self) -> dict[str, dict[str, dict]]:
    """GET /api_docs from the first server that answers it, read once per pool and cached."""
    with self._docs_lock:
      if self._docs is None:
        self._docs = self.run_on_one(lambda client: client.api_docs())
      return self._docs

  def shutdown(self) -> None:
    for s in self._servers:
      s.client.shutdown()

  def _all_down_message(self) -> str:
    listing = url_listing([(s.client.url, s.reason) for s in self._servers])
    return (
      f"no AppWorld server of the pool answers ({len(self._servers)} tried: {listing}); start "
      f"servers with: {START_COMMAND}"
    )

  def _starved_message(self, waited: bool) -> str:
    down = sum(s.state == _DOWN for s in self._servers)
    leased = sum(s.state == _LEASED for s in self._servers)
    how = (
      f"waited {self.lease_timeout_s:g} s"
      if waited
      else "a lease already waited lease_timeout_s and none was released since"
    )
    return (
      f"all {leased} answering AppWorld servers are leased ({down} more are down): {how}. Each "
      "running episode holds one server from reset to close, and the rollout loop starts at "
      "most as many episodes as there are healthy servers (up to tasks_per_iteration x "
      "samples_per_task at once, in waves with fewer): another program (or a second run) may "
      "be leasing the same servers, or servers went down during the wave. Give each run "
      f"servers of its own (--config.env.num_servers / --config.env.urls; {START_COMMAND})"
    )


def url_listing(pairs: Sequence[tuple[str, Optional[str]]], limit: int = 8) -> str:
  """One line: "why; why; ..." for the first `limit` (url, why) pairs (the url is prefixed
  when `why` does not name it), then a count of the rest."""
  items = [
    why if why and url in why else f"{url}: {why or 'no reason recorded'}"
    for url, why in pairs[:limit]
  ]
  if len(pairs) > limit:
    items.append(f"... and {len(pairs) - limit} more")
  return "; ".join(items)


def parse_urls(text: str) -> list[str]:
  """ "http://h:p,http://h:q" -> ["http://h:p", "http://h:q"] (stripped, no trailing '/')."""
  return [u.strip().rstrip("/") for u in text.split(",") if u.strip()]
