"""A loopback stand-in for `appworld serve environment` (tests and benchmarks only).

It speaks the endpoints of appworld 0.1.3.post1's `appworld/serve/environment.py`
with the same request bodies and answers (see `seeupo_jax/envs/appworld_client.py`
for the list), including its failure modes: an unknown task id, or a task the
server does not hold, answers 500 "Internal Server Error" in plain text (FastAPI's
answer to an exception inside AppWorld); a body that misses a field answers 422
{"detail": [...]}. One server holds one task world at a time and handles one
request at a time, like the real one (its handlers block the event loop).

The world is scripted and never runs the code it gets: `FakeWorld.execute`
parses it with `ast` and accepts only statements of the forms

    apis.<app>.<api>(<keyword>=<literal>, ...)
    print(apis.<app>.<api>(...))      print(<literal>)

answering the scripted API results (printed as JSON, as AppWorld's `print`
does), AppWorld's messages for syntax errors, unknown APIs and empty code, and
an error for anything else. A task's unit tests check that given API calls were
made, that the task was completed, and the answer.

Faults (`FakeAppWorldServer.inject(path, fault, times)`, any path, GET / and
/api_docs included): "500" (an HTTP 500), "slow" (the answer comes after
`slow_s`), "bad_json" (200 with a body that is not JSON), "drop" (the
connection is closed without an answer). `stop()` closes the listening socket
and every open connection (a crash). `api_docs` is the GET /api_docs answer
(set it to a wrong shape to test the client's check).

    server = FakeAppWorldServer(latency_s=0.01).start()   # in this process, a free port
    proc, url = start_subprocess()                        # as a process (kill it to crash it)
    python tests/appworld_fake_server.py --port 0         # prints {"url": ...}
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import http.server
import json
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

SUPERVISOR = {
  "first_name": "Ada",
  "last_name": "Byron",
  "email": "ada@example.com",
  "phone_number": "5550100",
}
DATETIME = "2023-05-18T12:00:00"
LIKED_SONGS = [7, 11, 13]


@dataclasses.dataclass(frozen=True)
class FakeTask:
  """A scripted task.

  calls: the (app, api, keyword arguments) the tests require (each a unit test).
  answer: the answer complete_task must get (a test), or None (no answer test).
  solution: replies that solve it (a scripted policy).
  """

  task_id: str
  instruction: str
  calls: tuple = ()
  answer: Any = None
  solution: tuple[str, ...] = ()

  def describe(self) -> dict:
    return {
      "task_id": self.task_id,
      "instruction": self.instruction,
      "supervisor": dict(SUPERVISOR),
      "datetime": DATETIME,
    }


def _block(code: str) -> str:
  return f"```python\n{code}\n```"


def like_task(task_id: str, song_id: int) -> FakeTask:
  return FakeTask(
    task_id=task_id,
    instruction=f"Like the song with id {song_id} on Spotify.",
    calls=(("spotify", "like_song", {"song_id": song_id}),),
    solution=(
      "Let me look at the song first.\n"
      + _block(f"print(apis.spotify.show_song(song_id={song_id}))"),
      _block(f"apis.spotify.like_song(song_id={song_id})"),
      _block("apis.supervisor.complete_task()"),
    ),
  )


TASKS: dict[str, FakeTask] = {
  t.task_id: t
  for t in [
    like_task("fake_like_1", 7),
    FakeTask(
      task_id="fake_pay_1",
      instruction="Send $25 to alex@example.com on Venmo.",
      calls=(("venmo", "send_money", {"receiver_email": "alex@example.com", "amount": 25}),),
      solution=(
        _block("apis.venmo.send_money(receiver_email='alex@example.com', amount=25)"),
        _block("apis.supervisor.complete_task()"),
      ),
    ),
    FakeTask(
      task_id="fake_count_1",
      instruction="How many songs have I liked on Spotify?",
      answer=len(LIKED_SONGS),
      solution=(
        _block("print(apis.spotify.show_liked_songs())"),
        _block(f"apis.supervisor.complete_task(answer={len(LIKED_SONGS)})"),
      ),
    ),
    *[like_task(f"gen_{i}_1", 100 + i) for i in range(64)],
  ]
}


def _doc(app: str, api: str, description: str, required: tuple[str, ...] = ()) -> dict:
  return {
    "app_name": app,
    "api_name": api,
    "path": f"/{app}/{api}",
    "method": "POST",
    "description": description,
    "parameters": [
      {
        "name": name,
        "type": "string",
        "required": True,
        "description": f"The {name}.",
        "default": None,
        "constraints": [],
      }
      for name in required
    ],
    "response_schemas": {
      "success": '```json\n{"message": "string"}\n```',
      "failure": "```json\n{}\n```",
    },
  }


API_DOCS = {
  "api_docs": {
    "show_app_descriptions": _doc("api_docs", "show_app_descriptions", "List the apps."),
    "show_api_descriptions": _doc(
      "api_docs", "show_api_descriptions", "List an app's APIs. Short form.", ("app_name",)
    ),
    "show_api_doc": _doc(
      "api_docs", "show_api_doc", "Show an API's doc.", ("app_name", "api_name")
    ),
  },
  "supervisor": {
    "show_account_passwords": _doc("supervisor", "show_account_passwords", "Show passwords."),
    "complete_task": _doc("supervisor", "complete_task", "Mark the task completed."),
  },
  "spotify": {
    "show_song": _doc("spotify", "show_song", "Show a song. With details.", ("song_id",)),
    "like_song": _doc("spotify", "like_song", "Like a song.", ("song_id",)),
    "show_liked_songs": _doc("spotify", "show_liked_songs", "Show the liked songs."),
  },
  "venmo": {
    "send_money": _doc("venmo", "send_money", "Send money.", ("receiver_email", "amount")),
  },
}


class FakeApiError(Exception):
  pass


def _api_result(app: str, api: str, kwargs: dict) -> Any:
  if app not in API_DOCS:
    raise FakeApiError(f"No app named '{app}' found in the AppWorld.")
  if api not in API_DOCS[app]:
    raise FakeApiError(f"No API named '{api}' found in the {app} app.")
  required = [p["name"] for p in API_DOCS[app][api]["parameters"]]
  missing = [name for name in required if name not in kwargs]
  if missing:
    raise FakeApiError(f"Response status code is 422:\n{{'missing': {missing}}}")
  if (app, api) == ("spotify", "show_song"):
    return {"song_id": kwargs["song_id"], "title": f"Song {kwargs['song_id']}"}
  if (app, api) == ("spotify", "show_liked_songs"):
    return [{"song_id": i} for i in LIKED_SONGS]
  if (app, api) == ("supervisor", "show_account_passwords"):
    return [{"account_name": "spotify", "password": "pw"}]
  if (app, api) == ("api_docs", "show_app_descriptions"):
    return [{"name": name} for name in API_DOCS]
  if (app, api) == ("api_docs", "show_api_descriptions"):
    return [{"name": name} for name in API_DOCS.get(kwargs["app_name"], {})]
  if (app, api) == ("api_docs", "show_api_doc"):
    return API_DOCS.get(kwargs["app_name"], {}).get(kwargs["api_name"], {})
  return {"message": "Done."}


class FakeWorld:
  """One task's world: the API calls made so far and whether (and how) the task was completed."""

  def __init__(self, task: FakeTask):
    self.task = task
    self.calls: list[tuple[str, str, dict]] = []
    self.completed = False
    self.answer: Any = None
    self.closed = False
    self.executions = 0

  def execute(self, code: str) -> str:
    """AppWorld's answer to running `code`, computed from its syntax tree (never run)."""
    code = code.strip()
    try:
      tree = ast.parse(code)
    except SyntaxError as e:
      return (
        "Execution failed. Traceback:\nSyntax error in line:\n"
        + (e.text or "").rstrip()
        + "\nMessage: "
        + e.msg
      )
    if not code:
      return "No code available to execute."
    self.executions += 1
    printed = []
    for statement in tree.body:
      try:
        value = self._statement(statement)
      except FakeApiError as e:
        return (
          f'Execution failed. Traceback:\n  File "<python-input>", line {statement.lineno}, in '
          f"<module>\nException: {e}"
        )
      if value is not None:
        printed.append(value)
    output = "\n".join(printed)
    return output if output.strip() else "Execution successful."

  def _statement(self, node: ast.stmt) -> Optional[str]:
    """The printed text of one statement (None if it prints nothing)."""
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
      raise FakeApiError("the fake world runs only API calls and print(...) of them")
    call = node.value
    if isinstance(call.func, ast.Name) and call.func.id == "print":
      if len(call.args) != 1 or call.keywords:
        raise FakeApiError("the fake world prints one value at a time")
      (arg,) = call.args
      if isinstance(arg, ast.Call):
        value = self._api_call(arg)
      else:
        value = self._literal(arg)
      return value if isinstance(value, str) else json.dumps(value)
    self._api_call(call)
    return None

  def _api_call(self, call: ast.Call) -> Any:
    func = call.func
    if not (
      isinstance(func, ast.Attribute)
      and isinstance(func.value, ast.Attribute)
      and isinstance(func.value.value, ast.Name)
      and func.value.value.id == "apis"
    ):
      raise FakeApiError("the fake world calls only apis.<app>.<api>(...)")
    if call.args:
      raise FakeApiError("APIs take keyword arguments only")
    kwargs = {kw.arg: self._literal(kw.value) for kw in call.keywords}
    app, api = func.value.attr, func.attr
    result = _api_result(app, api, kwargs)
    self.calls.append((app, api, kwargs))
    if (app, api) == ("supervisor", "complete_task"):
      self.completed = True
      self.answer = kwargs.get("answer")
    return result

  @staticmethod
  def _literal(node: ast.AST) -> Any:
    try:
      return ast.literal_eval(node)
    except ValueError:
      raise FakeApiError("the fake world takes literal arguments only") from None

  def evaluate(self) -> dict:
    """The /evaluate output: AppWorld's TestTracker.to_dict(stats_only=False) shape."""
    passes, failures = [], []
    checks = [
      (
        f"call {app}.{api} with {args}",
        any(c[:2] == (app, api) and c[2] == args for c in self.calls),
      )
      for app, api, args in self.task.calls
    ]
    if self.task.answer is not None:
      checks.append((f"answer {self.task.answer!r}", self.answer == self.task.answer))
    checks.append(("complete the task", self.completed))
    for requirement, passed in checks:
      if passed:
        passes.append({"requirement": requirement, "label": "no_op_fail"})
      else:
        failures.append({"requirement": requirement, "trace": "AssertionError", "label": None})
    return {
      "success": not failures,
      "difficulty": 1,
      "num_tests": len(checks),
      "passes": passes,
      "failures": failures,
    }


FAULTS = ("500", "slow", "bad_json", "drop")


class _Unavailable(Exception):
  """Maps to 500 'Internal Server Error' (an exception inside the AppWorld server)."""


class _Invalid(Exception):
  """Maps to 422 (FastAPI's request validation)."""


class FakeAppWorldServer:
  """The fake server (see the module docstring).

  Args:
    tasks: task id -> FakeTask.
    latency_s: time each POST takes inside the server (it handles one request at a time).
    slow_s: the delay of the "slow" fault.
  """

  def __init__(
    self,
    tasks: Optional[dict[str, FakeTask]] = None,
    *,
    latency_s: float = 0.0,
    slow_s: float = 1.0,
    host: str = "127.0.0.1",
    port: int = 0,
  ):
    self.tasks = dict(TASKS if tasks is None else tasks)
    self.latency_s = latency_s
    self.slow_s = slow_s
    self.world: Optional[FakeWorld] = None
    self.api_docs: Any = API_DOCS  # the GET /api_docs answer (a test may give a wrong shape)
    self.requests: list[tuple[str, str, Any]] = []  # (method, path, body), in arrival order
    self.init_options: list[dict] = []  # the /initialize bodies
    self._faults: dict[str, list[str]] = {}
    self._lock = threading.Lock()  # one request at a time, as the real server
    self._log_lock = threading.Lock()
    self._connections: set[socket.socket] = set()
    self._httpd = _HTTPServer((host, port), _Handler, self)
    self._thread: Optional[threading.Thread] = None

  @property
  def url(self) -> str:
    host, port = self._httpd.server_address[:2]
    return f"http://{host}:{port}"

  @property
  def port(self) -> int:
    return self._httpd.server_address[1]

  def start(self) -> "FakeAppWorldServer":
    self._thread = threading.Thread(
      target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    self._thread.start()
    return self

  def stop(self) -> None:
    """A crash: no more connections, and the open ones are cut."""
    self._httpd.shutdown()
    self._httpd.server_close()
    with self._log_lock:
      connections = list(self._connections)
    for conn in connections:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass

  def inject(self, path: str, fault: str, times: int = 1) -> None:
    """The next `times` requests to `path` (e.g. "/execute") get `fault` (one of FAULTS)."""
    if fault not in FAULTS:
      raise ValueError(f"unknown fault {fault!r}; allowed: {FAULTS}")
    with self._log_lock:
      self._faults.setdefault(path, []).extend([fault] * times)

  def count(self, path: str) -> int:
    """How many requests reached `path`."""
    with self._log_lock:
      return sum(1 for _, p, _ in self.requests if p == path)

  def _next_fault(self, path: str) -> Optional[str]:
    with self._log_lock:
      queue = self._faults.get(path)
      return queue.pop(0) if queue else None

  # --- the endpoints (called with the body parsed; return the JSON answer) --------------------

  def handle(self, method: str, path: str, body: Any) -> Any:
    with self._log_lock:
      self.requests.append((method, path, body))
    if method == "GET" and path == "/":
      return {"message": "Welcome to the fake AppWorld server!"}
    if method == "GET" and path == "/api_docs":
      return self.api_docs
    with self._lock:
      if self.latency_s:
        time.sleep(self.latency_s)
      if method == "GET" and path.startswith("/tasks/"):
        task_id = path[len("/tasks/") :]
        if task_id not in self.tasks:
          raise _Unavailable(task_id)
        return {"output": self.tasks[task_id].describe()}
      if method != "POST":
        raise KeyError(path)
      fields = {
        "/initialize": ("task_id",),
        "/execute": ("task_id", "code"),
        "/task_completed": ("task_id",),
        "/evaluate": ("task_id",),
        "/close": ("task_id",),
      }
      if path not in fields:
        raise KeyError(path)
      if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in fields[path]):
        raise _Invalid(fields[path])
      task_id = body["task_id"]
      if path == "/initialize":
        if task_id not in self.tasks:
          raise _Unavailable(task_id)
        self.init_options.append(dict(body))
        self.world = FakeWorld(self.tasks[task_id])
        return {"output": self.tasks[task_id].describe()}
      if self.world is None or self.world.task.task_id != task_id:
        raise _Unavailable(task_id)  # AppWorld: "The active task world is ..."
      if path == "/execute":
        return {"output": self.world.execute(body["code"])}
      if path == "/task_completed":
        return {"output": self.world.completed}
      if path == "/evaluate":
        return {"output": self.world.evaluate()}
      self.world.closed = True
      return {"output": None}


class _HTTPServer(http.server.ThreadingHTTPServer):
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, address, handler, app: FakeAppWorldServer):
    self.app = app
    super().__init__(address, handler)

  def process_request(self, request, client_address):
    with self.app._log_lock:
      self.app._connections.add(request)
    super().process_request(request, client_address)

  def shutdown_request(self, request):
    with self.app._log_lock:
      self.app._connections.discard(request)
    super().shutdown_request(request)


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

  def setup(self):
    super().setup()
    # Headers and body go out in two writes: without this, Nagle's algorithm and the client's
    # delayed ACK add ~40 ms to every answer (uvicorn's asyncio sockets set it too).
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args

  def do_GET(self):
    self._serve("GET", None)

  def do_POST(self):
    length = int(self.headers.get("Content-Length") or 0)
    raw = self.rfile.read(length) if length else b""
    try:
      body = json.loads(raw) if raw else None
    except ValueError:
      self._send(422, {"detail": [{"msg": "JSON decode error"}]})
      return
    self._serve("POST", body)

  def _serve(self, method: str, body: Any):
    app: FakeAppWorldServer = self.server.app
    path = self.path
    fault = app._next_fault(path)
    if fault == "drop":
      with app._log_lock:
        app.requests.append((method, path, body))
      self.close_connection = True
      self.connection.shutdown(socket.SHUT_RDWR)
      return
    if fault == "slow":
      time.sleep(app.slow_s)
    if fault == "500":
      with app._log_lock:
        app.requests.append((method, path, body))
      self._send_text(500, "Internal Server Error")
      return
    try:
      answer = app.handle(method, path, body)
    except _Unavailable:
      self._send_text(500, "Internal Server Error")
      return
    except _Invalid as e:
      missing = [{"loc": ["body", k], "msg": "field required"} for k in e.args[0]]
      self._send(422, {"detail": missing})
      return
    except KeyError:
      self._send(404, {"detail": "Not Found"})
      return
    if fault == "bad_json":
      self._send_text(200, '{"output": "unterminated', content_type="application/json")
      return
    self._send(200, answer)

  def _send(self, status: int, payload: Any):
    self._send_text(status, json.dumps(payload), content_type="application/json")

  def _send_text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8"):
    data = text.encode("utf-8")
    try:
      self.send_response(status)
      self.send_header("Content-Type", content_type)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)
    except OSError:  # the client went away (e.g. it timed out)
      self.close_connection = True


def start_subprocess(
  latency_s: float = 0.0, timeout_s: float = 30.0
) -> tuple[subprocess.Popen, str]:
  """Starts a fake server as a process on a free port; (the process, its URL)."""
  proc = subprocess.Popen(
    [sys.executable, __file__, "--port", "0", "--latency-s", str(latency_s)],
    stdout=subprocess.PIPE,
    text=True,
  )
  ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
  line = proc.stdout.readline() if ready else ""
  if not line:
    proc.kill()
    raise RuntimeError(f"the fake AppWorld server process did not start within {timeout_s} s")
  return proc, json.loads(line)["url"]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--latency-s", type=float, default=0.0)
  args = parser.parse_args(argv)
  server = FakeAppWorldServer(host=args.host, port=args.port, latency_s=args.latency_s)
  print(json.dumps({"url": server.url}), flush=True)
  server._httpd.serve_forever()


if __name__ == "__main__":
  main()
