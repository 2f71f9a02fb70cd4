"""HTTP client of AppWorld's environment server (the pool of servers: `appworld_pool.py`).

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

"""

from __future__ import annotations

import dataclasses
import functools
import json
import ssl
import time
from typing import Any, Mapping, Optional, TypeVar

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


def health_reason(client: AppWorldClient) -> Optional[str]:
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


_MOVED_TO_POOL = ("FALLBACK_SERVERS", "ServerPool", "parse_urls", "url_listing")


def __getattr__(name: str):
  """The pool's names, which lived here before `appworld_pool.py`, resolve to it."""
  if name in _MOVED_TO_POOL:
    from seeupo_jax.envs import appworld_pool  # noqa: PLC0415  (the pool imports this module)

    return getattr(appworld_pool, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
