"""AppWorld over HTTP: the client, the server pool and the environment, against fake servers.

The fake servers (tests/appworld_fake_server.py) speak the endpoints of AppWorld's own server on
loopback, so every test here goes through real HTTP. Faults: a server down at start, killed
mid-episode, HTTP 500, answers slower than the timeout, malformed JSON, a wrong task id.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest

import processes

import appworld_fake_server as fake
from seeupo_jax import envs, rollout, sampling
from seeupo_jax.text import chat_tokens, tokenizer as tokenizer_lib
from seeupo_jax.envs import appworld as aw
from seeupo_jax.envs import appworld_client as client_lib
from seeupo_jax.envs import appworld_pool as pool_lib
from seeupo_jax.models import qwen
from seeupo_jax.training import config as config_lib
import tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIKE = fake.TASKS["fake_like_1"]
LIKE_SOLVED = {  # the /evaluate output of a solved fake_like_1, as the fake server computes it
  "success": True,
  "difficulty": 1,
  "num_tests": 2,
  "passes": [
    {"requirement": "call spotify.like_song with {'song_id': 7}", "label": "no_op_fail"},
    {"requirement": "complete the task", "label": "no_op_fail"},
  ],
  "failures": [],
}


@pytest.fixture
def start():
  """start(n, **kw) -> n fake servers in this process (stopped at the end of the test)."""
  started = []

  def start_servers(n=1, **kw):
    servers = [fake.FakeAppWorldServer(**kw).start() for _ in range(n)]
    started.extend(servers)
    return servers

  yield start_servers
  for server in started:
    try:
      server.stop()
    except OSError:
      pass


def free_url() -> str:
  """A loopback URL where nothing listens."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return f"http://127.0.0.1:{port}"


def client(url, **kw):
  kw = {"retries": 2, "backoff_s": 0.01, "timeout_s": 2.0, **kw}
  return client_lib.AppWorldClient(url, **kw)


def config(servers, **kw):
  urls = ",".join(s if isinstance(s, str) else s.url for s in servers)
  kw = {"retries": 1, "backoff_s": 0.01, "timeout_s": 3.0, "code_timeout_s": 2, **kw}
  return aw.AppWorldConfig(urls=urls, **kw)


def datasets(tmp_path, train=("fake_like_1", "fake_pay_1"), dev=("fake_count_1",)) -> str:
  tmp_path.mkdir(parents=True, exist_ok=True)
  (tmp_path / "train.txt").write_text("\n".join(train) + "\n")
  (tmp_path / "dev.txt").write_text("\n".join(dev) + "\n")
  return str(tmp_path)


def make_spec(servers, tmp_path, **kw):
  return aw.spec(config(servers, datasets_dir=datasets(tmp_path), **kw))


def play(env, task, replies):
  reset = env.reset(task.task_id)
  steps = [env.step(r) for r in replies]
  return reset, steps, env.score()


# --- the client -----------------------------------------------------------------------------------


def test_client_sends_and_reads_the_servers_shapes(start):
  (server,) = start()
  c = client(server.url)
  assert c.health() is None
  task = c.initialize("fake_like_1", {"experiment_name": "x", "timeout_seconds": 7})
  assert task == client_lib.TaskInfo(
    "fake_like_1", LIKE.instruction, fake.SUPERVISOR, fake.DATETIME
  )
  assert c.execute("fake_like_1", "print(apis.spotify.show_song(song_id=7))") == json.dumps(
    {"song_id": 7, "title": "Song 7"}
  )
  assert c.task_completed("fake_like_1") is False
  assert c.execute("fake_like_1", "apis.spotify.like_song(song_id=7)") == "Execution successful."
  result = c.evaluate("fake_like_1")
  assert (result.success, result.num_tests, result.passes, result.failures) == (False, 2, 1, 1)
  assert result.failed_requirements == ("complete the task",)
  c.execute("fake_like_1", "apis.supervisor.complete_task()")
  assert c.task_completed("fake_like_1") is True
  assert c.evaluate("fake_like_1").success
  c.close("fake_like_1")
  assert c.show_task("fake_pay_1").instruction == fake.TASKS["fake_pay_1"].instruction
  assert set(c.api_docs()) == set(fake.API_DOCS)
  # The bodies are exactly the server's Body(...) parameters.
  bodies = {path: body for _, path, body in server.requests}
  assert bodies["/initialize"] == {
    "task_id": "fake_like_1",
    "experiment_name": "x",
    "timeout_seconds": 7,
  }
  assert bodies["/execute"] == {"task_id": "fake_like_1", "code": "apis.supervisor.complete_task()"}
  assert bodies["/evaluate"] == {"task_id": "fake_like_1", "suppress_errors": True, "report": False}
  assert bodies["/close"] == bodies["/task_completed"] == {"task_id": "fake_like_1"}


def test_a_server_that_is_down_fails_fast_with_its_url():
  url = free_url()
  c = client(url, retries=2)
  assert "ConnectError" in c.health()
  t0 = time.perf_counter()
  with pytest.raises(client_lib.ServerUnreachable) as info:
    c.initialize("fake_like_1", {})
  assert time.perf_counter() - t0 < 2.0  # backoff 0.01 + 0.02: no hang
  message = str(info.value)
  assert url in message and "POST /initialize" in message and "3 attempts" in message


def test_http_500_is_retried_where_a_retry_is_harmless(start):
  (server,) = start()
  c = client(server.url, retries=2)
  c.initialize("fake_like_1", {})
  server.inject("/evaluate", "500", times=2)
  assert c.evaluate("fake_like_1").num_tests == 2  # the third attempt answers
  assert server.count("/evaluate") == 3
  server.inject("/evaluate", "500", times=3)
  with pytest.raises(client_lib.ServerError, match=r"evaluate task 'fake_like_1'.*3 attempts.*500"):
    c.evaluate("fake_like_1")


@pytest.mark.parametrize(
  "fault,error", [("500", client_lib.ServerError), ("drop", client_lib.ServerUnreachable)]
)
def test_execute_is_never_sent_twice(start, fault, error):
  """The code may have run (a payment, a message): /execute is not repeated, the error says the
  episode must start over."""
  (server,) = start()
  c = client(server.url, retries=3)
  c.initialize("fake_pay_1", {})
  server.inject("/execute", fault)
  code = "apis.venmo.send_money(receiver_email='alex@example.com', amount=25)"
  with pytest.raises(error, match="not retried: the code may have run"):
    c.execute("fake_pay_1", code)
  assert server.count("/execute") == 1


def test_a_refused_execute_is_retried(start):
  """Connection refused: the request never reached a server, so /execute may be sent again."""
  (server,) = start()
  c = client(server.url, retries=3, backoff_s=0.3)
  c.initialize("fake_like_1", {})
  port = server.port
  server.stop()
  revived = []
  # The server comes back on the same port during the client's backoff.
  threading.Timer(0.15, lambda: revived.append(fake.FakeAppWorldServer(port=port).start())).start()
  with pytest.raises(client_lib.ServerError):  # the revived server holds no task: a 500
    c.execute("fake_like_1", "apis.spotify.like_song(song_id=7)")
  assert revived[0].count("/execute") == 1
  revived[0].stop()


def test_answers_slower_than_the_timeout(start):
  (server,) = start(slow_s=0.8)
  c = client(server.url, timeout_s=0.25, retries=1)
  c.initialize("fake_like_1", {})
  server.inject("/task_completed", "slow")
  t0 = time.perf_counter()
  assert c.task_completed("fake_like_1") is False  # timed out once, retried
  assert time.perf_counter() - t0 < 1.5
  server.inject("/execute", "slow")
  with pytest.raises(client_lib.ServerUnreachable, match="ReadTimeout.*not retried"):
    c.execute("fake_like_1", "print(1)")
  server.inject("/evaluate", "slow", times=2)
  with pytest.raises(client_lib.ServerUnreachable, match="2 attempts: ReadTimeout"):
    c.evaluate("fake_like_1")


def test_malformed_answers_are_protocol_errors_not_scores(start):
  (server,) = start()
  c = client(server.url)
  c.initialize("fake_like_1", {})
  server.inject("/evaluate", "bad_json")
  with pytest.raises(client_lib.ProtocolError, match="not JSON"):
    c.evaluate("fake_like_1")
  assert server.count("/evaluate") == 1


@pytest.mark.parametrize(
  "output,why",
  [
    ({"success": True, "num_tests": 2, "passes": [{}], "failures": []}, "success=True with 1 of 2"),
    (
      {"success": False, "num_tests": 1, "passes": [{}], "failures": [{}]},
      "1 failures > num_tests",
    ),
    ({"success": "yes", "num_tests": 1, "passes": [], "failures": []}, "no bool 'success'"),
    ({"success": False, "passes": [], "failures": []}, "no int 'num_tests'"),
    ({"success": False, "num_tests": 1}, "'passes' and 'failures' lists"),
    ("ok", "is not an object"),
  ],
)
def test_evaluate_checks_the_answer(output, why):
  transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"output": output}))
  c = client("http://appworld.test", transport=transport)
  with pytest.raises(client_lib.ProtocolError, match=why):
    c.evaluate("t")


def test_a_server_that_is_not_appworld_is_not_healthy():
  transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"status": "ok"}))
  assert "not an AppWorld server" in client("http://other.test", transport=transport).health()


def test_a_wrong_task_id_is_a_clear_error(start):
  (server,) = start()
  c = client(server.url, retries=1)
  with pytest.raises(client_lib.ServerError, match="initialize task 'nope_1'.*unknown task id"):
    c.initialize("nope_1", {})
  c.initialize("fake_like_1", {})
  with pytest.raises(client_lib.ServerError, match="execute code in task 'fake_pay_1'"):
    c.execute("fake_pay_1", "print(1)")  # the server holds another task
  assert server.world.executions == 0


TASK = LIKE.describe()
DOC = fake.API_DOCS["spotify"]["like_song"]


@pytest.mark.parametrize(
  "call,endpoint,body,why",
  [
    (
      lambda c: c.initialize("t", {}),
      "POST /initialize",
      {"output": {**TASK, "instruction": None}},
      "not a task",
    ),
    (
      lambda c: c.initialize("t", {}),
      "POST /initialize",
      {"output": {**TASK, "supervisor": {**fake.SUPERVISOR, "phone_number": None}}},
      "supervisor is not",
    ),
    (
      lambda c: c.initialize("t", {}),
      "POST /initialize",
      {"output": {**TASK, "datetime": 20230518}},
      "no str 'datetime'",
    ),
    (lambda c: c.show_task("t"), "GET /tasks/t", {"output": [TASK]}, "not a task"),
    (lambda c: c.execute("t", "print(1)"), "POST /execute", {"output": 3}, "not a string"),
    (lambda c: c.execute("t", "print(1)"), "POST /execute", {"result": "1"}, "no 'output' field"),
    (lambda c: c.task_completed("t"), "POST /task_completed", {"output": "false"}, "not a bool"),
    (
      lambda c: c.evaluate("t"),
      "POST /evaluate",
      {"output": {"success": True, "num_tests": 1, "passes": ["ok"], "failures": []}},
      "not an object with a str 'requirement'",
    ),
    (
      lambda c: c.evaluate("t"),
      "POST /evaluate",
      {"output": {**LIKE_SOLVED, "difficulty": "hard"}},
      "'difficulty' is neither an int nor null",
    ),
    (lambda c: c.close("t"), "POST /close", {"output": "closed"}, "not null"),
    (lambda c: c.api_docs(), "GET /api_docs", {"output": fake.API_DOCS}, "not an API doc"),
  ],
)
def test_an_answer_of_the_wrong_shape_is_a_protocol_error_naming_the_endpoint(
  call, endpoint, body, why
):
  transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
  c = client("http://appworld.test", transport=transport)
  with pytest.raises(client_lib.ProtocolError, match=why) as info:
    call(c)
  message = str(info.value)
  assert message.startswith(f"AppWorld server http://appworld.test: {endpoint} (")
  assert "\n" not in message


@pytest.mark.parametrize(
  "docs,why",
  [
    # Wrapped like the other endpoints' answers: it would list an app named "output".
    ({"output": fake.API_DOCS}, "output.api_docs is not an API doc"),
    (list(fake.API_DOCS), "not a non-empty {app name"),
    ({}, "not a non-empty {app name"),
    ({"spotify": ["like_song"]}, "app 'spotify' is not a non-empty {api name"),
    ({"spotify": {}}, "app 'spotify' is not a non-empty {api name"),
    ({"spotify": {"like_song": {"description": "Like."}}}, "spotify.like_song is not an API doc"),
    (
      {"spotify": {"like_song": fake.API_DOCS["venmo"]["send_money"]}},
      "filed as spotify.like_song is 'venmo'.'send_money'",
    ),
    ({"spotify": {"like_song": {**DOC, "description": None}}}, "'description' is not a string"),
    (
      {"spotify": {"like_song": {**DOC, "parameters": {"song_id": {}}}}},
      "'parameters' is not a list of objects",
    ),
  ],
)
def test_api_docs_of_the_wrong_shape_are_a_protocol_error(start, docs, why):
  (server,) = start()
  server.api_docs = docs
  with pytest.raises(client_lib.ProtocolError, match=re.escape(why)) as info:
    client(server.url).api_docs()
  assert f"AppWorld server {server.url}: GET /api_docs (read the API docs)" in str(info.value)
  assert server.count("/api_docs") == 1  # a wrong shape is not retried


# --- the pool -------------------------------------------------------------------------------------


def test_a_lease_blocks_until_a_release_or_the_timeout(start):
  servers = start(2)
  pool = pool_lib.ServerPool([client(s.url) for s in servers], lease_timeout_s=0.3)
  a, b = pool.lease(), pool.lease()
  assert {a.url, b.url} == {s.url for s in servers}
  t0 = time.perf_counter()
  with pytest.raises(client_lib.PoolExhausted, match="all 2 answering AppWorld servers are leased"):
    pool.lease()
  assert 0.25 < time.perf_counter() - t0 < 1.5
  # Nothing was released since: the next lease fails at once instead of waiting again.
  t0 = time.perf_counter()
  with pytest.raises(client_lib.PoolExhausted, match="tasks_per_iteration x samples_per_task"):
    pool.lease()
  assert time.perf_counter() - t0 < 0.1
  # After a release, leases wait again, and a release wakes a waiting lease.
  pool.release(b)
  assert pool.lease() is b
  pool.lease_timeout_s = 5.0
  threading.Timer(0.2, pool.release, args=(a,)).start()
  t0 = time.perf_counter()
  assert pool.lease() is a
  assert time.perf_counter() - t0 < 2.0
  pool.release(a)
  pool.release(b)
  assert pool.counts()["idle"] == 2


def test_the_pool_never_leases_a_server_twice(start):
  servers = start(4)
  pool = pool_lib.ServerPool([client(s.url) for s in servers], lease_timeout_s=10.0)
  holders, lock, errors = {}, threading.Lock(), []

  def work(worker):
    for _ in range(25):
      c = pool.lease()
      with lock:
        if c.url in holders:
          errors.append((c.url, holders[c.url], worker))
        holders[c.url] = worker
      time.sleep(0.001)
      with lock:
        del holders[c.url]
      pool.release(c)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert not errors and not any(t.is_alive() for t in threads)
  assert pool.counts() == {"idle": 4, "leased": 0, "down": 0, "probing": 0}


def test_a_failed_server_leaves_the_pool_and_rejoins_when_it_answers(start):
  servers = start(2)
  pool = pool_lib.ServerPool([client(s.url) for s in servers], recheck_s=0.2)
  first = pool.lease()
  dead = next(s for s in servers if s.url == first.url)
  port = dead.port
  dead.stop()
  with pytest.raises(client_lib.ServerUnreachable) as info:
    first.evaluate("fake_like_1")
  pool.release(first, info.value)
  assert list(pool.down()) == [first.url]
  # The run goes on with the other server.
  other = pool.lease()
  assert other.url != first.url
  pool.release(other)
  # A 500 is the request's failure, not the server's: it stays in the pool.
  pool.release(pool.lease(), client_lib.ServerError("500"))
  assert pool.counts()["idle"] == 1
  # Restarted on its port, it is probed again after recheck_s and comes back.
  revived = fake.FakeAppWorldServer(port=port).start()
  try:
    time.sleep(0.25)
    leased = [pool.lease(), pool.lease()]
    assert sorted(c.url for c in leased) == sorted(s.url for s in servers)
  finally:
    revived.stop()


def test_a_server_that_failed_an_episode_is_leased_last_and_only_after_a_health_check(start):
  a, b = start(2)
  pool = pool_lib.ServerPool([client(a.url), client(b.url)], lease_timeout_s=0.3, recheck_s=60)
  first, second = pool.lease(), pool.lease()
  assert (first.url, second.url) == (a.url, b.url)  # URL order at start
  # A's episode fails with a 5xx (A still answers GET /, so it stays in rotation), and is given
  # back before B's episode ends: A has been idle longest, but B is leased first.
  pool.release(first, client_lib.ServerError("POST /evaluate failed: HTTP 500"))
  pool.release(second)
  assert pool.failed() == [a.url] and pool.counts()["idle"] == 2
  probes = a.count("/")
  assert pool.lease() is second
  assert a.count("/") == probes  # a server that did not fail is leased without a probe
  # Only A is left, and it fails its health check: it is not leased, and stays out.
  a.inject("/", "500")
  with pytest.raises(client_lib.PoolExhausted, match=r"all 1 answering .* \(1 more are down\)"):
    pool.lease()
  assert a.count("/") == probes + 1
  assert pool.down() == {a.url: f"GET {a.url}/: HTTP 500"}
  # It recovers: once recheck_s has passed it is probed again, answers, and is leased.
  pool.recheck_s = 0.0
  assert pool.lease() is first
  assert a.count("/") == probes + 2
  # An episode that ends well clears the mark: the order is idle-longest again.
  pool.release(first)
  pool.release(second)
  assert pool.failed() == []
  assert pool.lease() is first


def test_a_failed_server_that_answers_its_probe_is_leased_when_no_other_is_idle(start):
  a, b = start(2)
  pool = pool_lib.ServerPool([client(a.url), client(b.url)], lease_timeout_s=0.3)
  first, second = pool.lease(), pool.lease()
  pool.release(first, client_lib.RequestRejected("HTTP 422"))
  probes = a.count("/")  # release probed it once
  assert pool.lease() is first  # B is still leased: A, probed again first, is leased
  assert a.count("/") == probes + 1
  pool.release(first)
  pool.release(second)


def test_the_replay_of_a_failed_task_waits_for_another_server_while_one_is_leased(start):
  a, b = start(2)
  pool = pool_lib.ServerPool([client(a.url), client(b.url)], lease_timeout_s=5.0)
  first, second = pool.lease("t1"), pool.lease("t2")
  assert (first.url, second.url) == (a.url, b.url)
  pool.release(first, client_lib.ServerError("POST /evaluate failed: HTTP 500"))
  # A is the only idle server, but its last episode failed on t1 and B is leased: the replay
  # of t1 waits for B. A lease for another task takes A at once (after its probe).
  got = []
  waiter = threading.Thread(target=lambda: got.append(pool.lease("t1")))
  waiter.start()
  waiter.join(0.3)
  assert waiter.is_alive() and not got
  assert pool.lease("t3") is first
  pool.release(second)
  waiter.join(5.0)
  assert got == [second]
  pool.release(first)
  pool.release(second)
  # With no other server leased, the replay takes the server that failed it (after a probe).
  pool = pool_lib.ServerPool([client(a.url), client(b.url)], lease_timeout_s=5.0)
  first, second = pool.lease("t1"), pool.lease("t2")
  pool.release(first, client_lib.ServerError("HTTP 500"))
  pool.release(second)
  assert pool.lease("t1") is second  # another server is idle: it goes there
  assert pool.lease("t1") is first  # none other left, and none leased but by this caller
  pool.release(first)
  pool.release(second)
  # The wait is bounded by lease_timeout_s: then it takes the failed server after all.
  pool = pool_lib.ServerPool([client(a.url), client(b.url)], lease_timeout_s=0.2)
  first, second = pool.lease("t1"), pool.lease("t2")
  pool.release(first, client_lib.ServerError("HTTP 500"))
  assert pool.lease("t1") is first
  assert pool.counts() == {"idle": 0, "leased": 2, "down": 0, "probing": 0}


def test_no_answering_server_is_an_error_naming_every_url_and_the_command():
  urls = [free_url(), free_url()]
  pool = pool_lib.ServerPool([client(u) for u in urls], recheck_s=60)
  assert all("Connection refused" in why for why in pool.probe().values())
  with pytest.raises(client_lib.PoolExhausted) as info:
    pool.lease()  # all down: probed once more, then the error
  assert all(u in str(info.value) for u in urls)
  assert "experiments/appworld_servers.sh" in str(info.value)
  assert "\n" not in str(info.value)


# --- the environment ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "reply,code",
  [
    ("```python\nprint(1)\n```", "print(1)"),
    ("Let me look.\n```py\nx = 1\nprint(x)\n```\nthen", "x = 1\nprint(x)"),
    ("```python\na()\n```\n```python\nb()\n```", "a()"),  # only the first block runs
    ("<think>```python\nleak()\n```</think>```python\nok()\n```", "ok()"),
    ("<think>```python\nleak()\n```", None),  # unclosed thinking: nothing visible
    ("```python\nprint(1)\n", None),  # unclosed block (a cut reply)
    ("```python\n   \n```", None),  # blank code
    ("```\nprint(1)\n```", None),  # not marked as python
    ("apis.supervisor.complete_task()", None),  # no block at all
  ],
)
def test_extract_code(reply, code):
  assert aw.extract_code(reply) == code


def test_a_scripted_agent_solves_every_kind_of_task(start, tmp_path):
  servers = start(2)
  spec = make_spec(servers, tmp_path)
  for task in (LIKE, fake.TASKS["fake_pay_1"], fake.TASKS["fake_count_1"]):
    env = spec.make()
    reset, steps, score = play(env, task, task.solution)
    system, user = reset.messages
    assert system["role"] == "system" and "```python" in system["content"]
    assert "- spotify: show_song, like_song, show_liked_songs" in system["content"]  # API index
    assert user["content"].endswith(f"Task: {task.instruction}")
    assert "Ada Byron" in user["content"] and "ada@example.com" in user["content"]
    assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]  # complete_task ends it
    assert all(s.info["parsed"] for s in steps)
    assert score.reward == 1.5 and score.success
    assert score.details["passes"] == score.details["num_tests"]
    assert not score.details["garbled"] and score.details["server"] in {s.url for s in servers}
    env.close()
  like_steps = play(spec.make(), LIKE, LIKE.solution[:1])[1]
  assert like_steps[0].observation == [
    {"role": "user", "content": '{"song_id": 7, "title": "Song 7"}'}
  ]
  # The API docs were read once for the pool, each server has its own experiment directory.
  assert sum(s.count("/api_docs") for s in servers) == 1
  names = {o["experiment_name"] for s in servers for o in s.init_options}
  assert names == {aw.experiment_name("seeupo", s.url) for s in servers}
  assert all(o["timeout_seconds"] == 2 for s in servers for o in s.init_options)


def test_rewards_partial_garbled_and_configured(start, tmp_path):
  servers = start(1)
  spec = make_spec(servers, tmp_path)
  complete = fake._block("apis.supervisor.complete_task()")
  # Completed without liking the song: 1 of 2 tests -> 0.5 * 1/2.
  env = spec.make()
  _, _, score = play(env, LIKE, [complete])
  assert score.reward == pytest.approx(0.25) and not score.success
  env.close()
  # One reply without code: garbled, but the task is solved: the success reward.
  env = spec.make()
  _, steps, score = play(env, LIKE, ["I will like it now.", *LIKE.solution])
  assert steps[0].observation[0]["content"] == aw.NO_CODE_MESSAGE and not steps[0].done
  assert score.reward == 1.5 and score.success and score.details["unparsable_replies"] == 1
  assert score.details["garbled"]
  env.close()
  # Garbled and not solved: the penalty (-1), not the partial credit of 0.25.
  env = spec.make()
  _, _, score = play(env, LIKE, ["no code here", complete])
  assert score.reward == -1.0 and not score.success and score.details["garbled"]
  env.close()
  # Configured: other rewards, and the penalty only from 2 unparsable replies on.
  spec = make_spec(
    servers,
    tmp_path,
    success_reward=2.0,
    partial_reward_weight=1.0,
    garbled_reward=-3.0,
    garbled_min_replies=2,
  )
  env = spec.make()
  assert play(env, LIKE, ["no code", "none", *LIKE.solution])[2].reward == 2.0
  env.close()
  env = spec.make()
  assert play(env, LIKE, ["no code", complete])[2].reward == pytest.approx(0.5)
  env.close()
  env = spec.make()
  assert play(env, LIKE, ["no code", "none either", complete])[2].reward == -3.0
  env.close()


def test_a_reply_without_code_runs_nothing_and_the_turn_limit_ends_the_episode(start, tmp_path):
  (server,) = start()
  spec = make_spec([server], tmp_path, max_turns=2)
  env = spec.make()
  env.reset("fake_like_1")
  first = env.step("Sure! I'll like the song.")
  assert not first.done and first.info == {"parsed": False, "completed": False}
  second = env.step(fake._block("print(apis.spotify.show_song(song_id=7))"))
  assert second.done and not second.info["completed"]  # the limit, not completion
  assert server.count("/execute") == 1
  with pytest.raises(RuntimeError, match="after the episode ended"):
    env.step("more")
  assert env.score().details["turns"] == 2
  env.close()


def test_long_output_is_cut(start, tmp_path):
  (server,) = start()
  env = make_spec([server], tmp_path, max_observation_chars=20).make()
  env.reset("fake_like_1")
  step = env.step(fake._block(f"print({'x' * 50!r})"))
  assert step.observation[0]["content"] == "x" * 20 + aw.OUTPUT_CUT_MARKER.format(20)
  env.close()


def test_a_server_killed_mid_episode_fails_the_episode_and_a_fresh_one_runs_elsewhere(
  start, tmp_path
):
  proc, url = fake.start_subprocess()
  try:
    (healthy,) = start()
    spec = make_spec([url, healthy], tmp_path)
    first, second = spec.make(), spec.make()
    first.reset("fake_like_1")
    second.reset("fake_like_1")
    env, other = (first, second) if first.server_url == url else (second, first)
    assert env.server_url == url and other.server_url == healthy.url
    other.close()
    env.step(LIKE.solution[0])
    proc.kill()
    proc.wait()
    with pytest.raises(client_lib.ServerUnreachable, match=f"{url}.*POST /execute"):
      env.step(LIKE.solution[1])
    with pytest.raises(RuntimeError, match="after a server failure"):
      env.score()  # no score for a broken episode
    env.close()
    env = spec.make()  # what the rollout loop does next: a fresh instance
    _, _, score = play(env, LIKE, LIKE.solution)
    assert env.server_url == healthy.url and score.reward == 1.5
    env.close()
  finally:
    proc.kill()


def test_evaluate_failures_raise_instead_of_scoring(start, tmp_path):
  (server,) = start()
  env = make_spec([server], tmp_path).make()
  env.reset("fake_like_1")
  server.inject("/evaluate", "bad_json")
  with pytest.raises(client_lib.ProtocolError):
    env.score()


def test_spec_without_servers_names_the_urls_and_the_command(tmp_path):
  urls = [free_url(), free_url()]
  t0 = time.perf_counter()
  with pytest.raises(envs.EnvironmentUnavailable) as info:
    envs.make_spec("appworld", {"urls": ",".join(urls), "datasets_dir": str(tmp_path)})
  assert time.perf_counter() - t0 < 3.0
  message = str(info.value)
  assert all(u in message for u in urls) and "experiments/appworld_servers.sh" in message
  assert "\n" not in message
  # From ports: the command in the message uses them.
  with pytest.raises(envs.EnvironmentUnavailable, match="appworld_servers.sh 2 1"):
    envs.make_spec("appworld", {"host": "127.0.0.1", "base_port": 1, "num_servers": 2})


def test_spec_reads_task_lists_and_maps_the_splits(start, tmp_path, monkeypatch):
  servers = start(1)
  (tmp_path / "train.txt").write_text("# AppWorld ids\nfake_like_1\n\nfake_pay_1:tagged\n")
  (tmp_path / "dev.txt").write_text("fake_count_1\n")
  (tmp_path / "test_normal.txt").write_text("gen_0_1\ngen_1_1\n")
  spec = aw.spec(config(servers, datasets_dir=str(tmp_path)))
  assert list(spec.task_ids("train")) == ["fake_like_1", "fake_pay_1"]
  assert list(spec.task_ids("eval")) == ["fake_count_1"]
  assert list(spec.task_ids("test_normal")) == ["gen_0_1", "gen_1_1"]
  with pytest.raises(ValueError, match="unknown split 'valid'"):
    spec.task_ids("valid")
  spec = aw.spec(config(servers, datasets_dir=str(tmp_path), eval_split="test_normal"))
  assert list(spec.task_ids("eval")) == ["gen_0_1", "gen_1_1"] and spec.max_turns == 30
  # APPWORLD_ROOT/data/datasets when datasets_dir is empty; an ids file overrides a split.
  root = tmp_path / "root"
  (root / "data").mkdir(parents=True)
  (root / "data" / "datasets").symlink_to(tmp_path)
  monkeypatch.setenv("APPWORLD_ROOT", str(root))
  ids_file = tmp_path / "mine.txt"
  ids_file.write_text("gen_5_1\n")
  spec = aw.spec(config(servers, eval_ids_file=str(ids_file)))
  assert list(spec.task_ids("train")) == ["fake_like_1", "fake_pay_1"]
  assert list(spec.task_ids("eval")) == ["gen_5_1"]
  # Missing lists, and lists the servers do not know, are explained.
  with pytest.raises(envs.EnvironmentUnavailable, match="cannot read the train.*nowhere/train.txt"):
    aw.spec(config(servers, datasets_dir=str(tmp_path / "nowhere")))
  ids_file.write_text("nope_1\n")
  with pytest.raises(envs.EnvironmentUnavailable, match="task 'nope_1'.*cannot be looked up"):
    aw.spec(config(servers, eval_ids_file=str(ids_file)))
  monkeypatch.delenv("APPWORLD_ROOT")
  with pytest.raises(envs.EnvironmentUnavailable, match="set --config.env.datasets_dir"):
    aw.spec(config(servers))


def test_spec_runs_with_the_servers_that_answer(start, tmp_path):
  servers = start(1)
  down = free_url()
  spec = make_spec([down, *servers], tmp_path)
  env = spec.make()
  env.reset("fake_like_1")
  assert env.server_url == servers[0].url
  env.close()


@pytest.mark.parametrize("first", ["refused", "silent", "api_docs_500", "api_docs_dropped"])
def test_the_run_starts_when_the_first_url_is_down(start, tmp_path, first):
  """Start-up probes every server and reads the API docs from the first one that answers them:
  a first URL that refuses connections, accepts them but never answers, or fails GET /api_docs
  does not stop the run while others answer."""
  healthy = start(2)
  listener = None
  if first == "refused":
    url = free_url()
  elif first == "silent":  # connections are accepted (the kernel's backlog), never answered
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = "http://127.0.0.1:%d" % listener.getsockname()[1]
  else:
    (broken,) = start()
    broken.inject("/api_docs", "500" if first == "api_docs_500" else "drop", times=10)
    url = broken.url
  try:
    options = {
      "urls": ",".join([url, *(s.url for s in healthy)]),
      "datasets_dir": datasets(tmp_path),
      "retries": 1,
      "backoff_s": 0.01,
      "health_timeout_s": 0.5,
    }
    t0 = time.perf_counter()
    spec = envs.make_spec("appworld", options)  # what run.py calls
    assert time.perf_counter() - t0 < 5.0
    env = spec.make()
    system, _ = env.reset("fake_like_1").messages
    assert "- spotify: show_song, like_song, show_liked_songs" in system["content"]
    # The docs came from the first healthy server, read once; the episode runs on a healthy one.
    assert [s.count("/api_docs") for s in healthy] == [1, 0]
    assert env.server_url in {s.url for s in healthy}
    env.close()
    if first.startswith("api_docs"):
      assert broken.count("/api_docs") == 2  # 1 retry, then the next server
      assert broken.count("/initialize") == 0
  finally:
    if listener is not None:
      listener.close()


def test_api_docs_of_the_wrong_shape_stop_the_start_with_the_endpoint_named(start, tmp_path):
  servers = start(2)
  for server in servers:
    server.api_docs = {"output": fake.API_DOCS}  # wrapped, as a wrong server version might
  with pytest.raises(envs.EnvironmentUnavailable) as info:
    make_spec(servers, tmp_path)
  message = str(info.value)
  assert "\n" not in message and "GET /api_docs" in message and "wrong shape" in message
  assert all(s.url in message and s.count("/api_docs") == 1 for s in servers)
  # One server of the wrong shape among right ones: the run starts with the right docs.
  servers[1].api_docs = fake.API_DOCS
  env = make_spec(servers, tmp_path).make()
  system, _ = env.reset("fake_like_1").messages
  assert "- output:" not in system["content"] and "- spotify: " in system["content"]
  assert env.server_url == servers[1].url  # the first one gave a wrong shape: out of the pool
  env.close()


@pytest.mark.parametrize(
  "options,message",
  [
    (
      {"api_docs": "all"},
      r"appworld.api_docs='all'; allowed: one of \['none', 'names', 'descriptions'\]",
    ),
    (
      {"train_split": "training"},
      r"appworld.train_split='training'; allowed: one of \['train', 'dev'",
    ),
    ({"num_servers": 0}, "appworld.num_servers=0; allowed: an int >= 1"),
    ({"base_port": 70000}, r"appworld.base_port=70000; allowed: an int in \[1, 65535\] \(a port\)"),
    (
      {"timeout_s": 50.0},
      r"appworld.timeout_s=50.0; allowed: a number > appworld.code_timeout_s = 100",
    ),
    (
      {"urls": "127.0.0.1:8000"},
      "appworld.urls='127.0.0.1:8000'; allowed: comma-separated http:// or https:// URLs",
    ),
    ({"retries": -1}, "appworld.retries=-1; allowed: an int >= 0"),
    ({"success_reward": float("nan")}, "appworld.success_reward=nan; allowed: a finite number"),
    ({"experiment_name": "a/b"}, "appworld.experiment_name='a/b'; allowed: a non-empty name"),
    (
      {"lease_timeout_s": 0},
      r"appworld.lease_timeout_s=0; allowed: a finite number > 0 \(seconds\)",
    ),
  ],
)
def test_bad_config_names_the_field_and_the_allowed_values(options, message):
  with pytest.raises(ValueError, match=message):
    envs.make_spec("appworld", options)


def test_unknown_option_names_the_environment():
  with pytest.raises(ValueError, match="bad options for environment 'appworld'.*num_server"):
    envs.make_spec("appworld", {"num_server": 2})


def test_the_config_file_holds_every_field_flat():
  sys.path.insert(0, str(ROOT))
  from experiments import configs  # pylint: disable=g-import-not-at-top

  config = configs.get_config("appworld")
  options = {k: v for k, v in config.env.to_dict().items() if k != "name"}
  assert aw.AppWorldConfig(**options).num_servers == 32 * 8  # tasks_per_iteration x samples
  config.rollout.tasks_per_iteration = 2
  config.rollout.samples_per_task = 3
  config.rollout.max_turns = 7
  assert config.env.num_servers == 6 and config.env.name == "appworld"
  # The reply limit has one name, rollout.max_turns, which the environment receives.
  assert "max_turns" not in config.env
  assert config_lib.typed(config).env_options()["max_turns"] == 7
  config.env.unlock()
  config.env.max_turns = 7
  with pytest.raises(config_lib.ConfigError, match=r"env.max_turns: .*rollout.max_turns"):
    config_lib.typed(config)


# --- with the rollout loop --------------------------------------------------------------------


def play_rollout(spec, task_ids, samples_per_task):
  """One `Roller.run` of a random qwen3-tiny (it never writes a code block) with 2 turns."""
  model = tiny.model_config()
  tok = tiny.tokenizer()
  sc = sampling.SamplingConfig(
    max_new_tokens=4, stop_token_ids=tuple(tokenizer_lib.stop_token_ids(tok)), pad_id=0
  )
  rc = rollout.RolloutConfig(
    max_turns=2, max_context_tokens=256, max_env_tokens=64, max_failed_group_fraction=0.5
  )
  roller = rollout.Roller(spec, chat_tokens.ChatTokens(tok), model, sc, rc)
  params = qwen.init_params(model, jax.random.key(0))
  try:
    return roller.run(params, task_ids, samples_per_task, jax.random.key(1))
  finally:
    roller.close()


def test_an_episode_replayed_after_a_5xx_runs_on_another_server(start, tmp_path, monkeypatch):
  """The rollout loop replays an episode whose server answered 500 on a fresh environment. The
  failing server was given back first (when its episode failed, before the other episodes
  closed), so it may be the only idle one when the replay starts; the replay still goes to
  another server (it waits for one while the others are leased), and the group is kept."""
  monkeypatch.setattr(aw, "SYSTEM_PROMPT", "Write ```python code. {max_turns} turns.")
  servers = start(3, slow_s=0.5)
  failing = servers[0]  # the first lease gets it: one of the three episodes plays there
  failing.inject("/evaluate", "500", times=100)
  for other in servers[1:]:  # the others score late: the replay starts while they are leased
    other.inject("/evaluate", "slow")
  spec = make_spec(servers, tmp_path, api_docs="none", max_turns=2)
  result = play_rollout(spec, ["fake_like_1", "fake_pay_1", "fake_count_1"], 1)
  (replayed,) = [t for t in result.trajectories if t.retried_errors]
  (error,) = replayed.retried_errors
  assert failing.url in error and "POST /evaluate" in error and "HTTP 500" in error
  assert replayed.error is None and not replayed.dropped, replayed.error
  assert replayed.score_details["server"] in {servers[1].url, servers[2].url}
  assert result.metrics["rollout/failed_groups"] == 0
  assert result.metrics["rollout/retried_episodes"] == 1
  assert failing.count("/initialize") == 1 and failing.count("/evaluate") == 2  # 1 retry
  pool = spec.make().pool
  assert pool.failed() == [failing.url]  # still answers GET /: in the pool, leased last
  assert pool.counts() == {"idle": 3, "leased": 0, "down": 0, "probing": 0}


def test_the_rollout_loop_replays_a_failed_episode_and_drops_a_failing_group(
  start, tmp_path, monkeypatch
):
  """A server crash mid-episode: replayed from the start on another server, the group kept.
  An unknown task: its whole group dropped and counted, never trained on."""
  monkeypatch.setattr(aw, "SYSTEM_PROMPT", "Write ```python code. {max_turns} turns.")
  servers = start(6)
  spec = make_spec(servers, tmp_path, api_docs="none", max_turns=2)
  killed, lock = [], threading.Lock()

  def make():  # the first episode of fake_pay_1 loses its server after reset
    env = spec.make()
    reset = env.reset

    def reset_then_crash(task_id):
      out = reset(task_id)
      with lock:
        if task_id == "fake_pay_1" and not killed:
          server = next(s for s in servers if s.url == env.server_url)
          server.stop()
          killed.append(server.url)
      return out

    env.reset = reset_then_crash
    return env

  result = play_rollout(
    envs.EnvSpec(make, spec.task_ids, spec.max_turns), ["fake_like_1", "fake_pay_1", "nope_1"], 2
  )
  by_task = {}
  for t in result.trajectories:
    by_task.setdefault(t.task_id, []).append(t)
  (replayed,) = [t for t in by_task["fake_pay_1"] if t.retried_errors]
  assert killed[0] in replayed.retried_errors[0]
  assert all(not t.dropped and t.error is None for t in by_task["fake_pay_1"])
  assert all(t.score_details["server"] != killed[0] for t in by_task["fake_pay_1"])
  assert all(t.dropped and "nope_1" in t.error for t in by_task["nope_1"])
  assert result.metrics["rollout/failed_groups"] == 1
  # A random model never writes a code block: every kept episode is garbled, scored by a real
  # /evaluate.
  kept = [t for t in result.trajectories if not t.dropped]
  assert len(kept) == 4 and all(t.reward == -1.0 and t.score_details["garbled"] for t in kept)
  batch = rollout.collate(result.trajectories, num_turns=2, max_len=256)
  np.testing.assert_array_equal(batch.row_valid, [True] * 4 + [False] * 2)
  # Every server leased by an episode was given back; the dead one is out of the pool.
  pool = spec.make().pool
  assert pool.counts() == {"idle": 5, "leased": 0, "down": 1, "probing": 0}
  assert list(pool.down()) == killed


# --- the server script and the training program -------------------------------------------------


def test_the_server_script_starts_waits_and_stops_its_servers(tmp_path):
  """experiments/appworld_servers.sh with a stand-in AppWorld python that runs the fake."""
  python = tmp_path / "python"
  python.write_text(
    "#!/usr/bin/env bash\n"
    "if [[ $1 == -m && $2 == appworld.cli ]]; then\n"
    "  while [[ $# -gt 0 && $1 != --port ]]; do shift; done\n"
    f'  exec {sys.executable} {ROOT / "tests" / "appworld_fake_server.py"} --port "$2"\n'
    "fi\n"
    'if [[ $1 == -c && $2 == "import appworld" ]]; then exit 0; fi\n'
    f'exec {sys.executable} "$@"\n'
  )
  python.chmod(0o755)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    base = s.getsockname()[1]
  env = dict(os.environ, APPWORLD_PYTHON=str(python), APPWORLD_LOG_DIR=str(tmp_path / "logs"))
  script = ROOT / "experiments" / "appworld_servers.sh"
  proc = subprocess.Popen(
    ["bash", str(script), "2", str(base)], env=env, stderr=subprocess.PIPE, text=True
  )
  try:
    lines = []
    while "train with" not in "".join(lines):
      line = proc.stderr.readline()
      assert line, "".join(lines)
      lines.append(line)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    assert all(client(u).health() is None for u in urls)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert all(client(u).health() is not None for u in urls)  # stopped on exit
  finally:
    proc.kill()
  # Without the AppWorld python: a clear error, nothing started.
  env.pop("APPWORLD_PYTHON")
  done = subprocess.run(
    ["bash", str(script), "1", str(base)], env=env, capture_output=True, text=True
  )
  assert done.returncode == 1 and "set APPWORLD_PYTHON" in done.stderr


def run_program(servers, tmp_path, workdir) -> subprocess.CompletedProcess:
  """`run.py --config=appworld`: one SeeUPO iteration of a random qwen3-tiny (2 tasks x 2
  samples, 2 turns), then an evaluation of 2 tasks x 2 attempts, on CPU."""
  ds = datasets(tmp_path / "ds", train=("fake_like_1", "fake_count_1"), dev=("gen_0_1", "gen_1_1"))
  # The session's compilation cache (tests/conftest.py): the evaluation sampler is the
  # training sampler's program, and every run of this config compiles the same programs.
  env = processes.env()
  return subprocess.run(
    [
      sys.executable,
      str(ROOT / "experiments" / "run.py"),
      "--config=appworld",
      f"--workdir={workdir}",
      f"--config.env.urls={','.join(s.url for s in servers)}",
      f"--config.env.datasets_dir={ds}",
      "--config.env.retries=1",
      "--config.env.backoff_s=0.05",
      "--config.env.recheck_s=0.5",
      f"--config.model.preset={tiny.PRESET}",
      "--config.rollout.tasks_per_iteration=2",
      "--config.rollout.samples_per_task=2",
      "--config.rollout.max_turns=2",
      "--config.rollout.max_context_tokens=1280",
      "--config.rollout.max_reply_tokens=8",
      "--config.rollout.max_env_tokens=96",
      "--config.eval.tasks_per_call=2",
      "--config.eval.k=2",
      "--config.eval.num_tasks=2",
      "--config.eval.every=1",
      "--config.num_iterations=1",
      "--config.checkpoint.every=1000",
      "--config.learner.kl_coef=0.0",
      # SeeUPO's turns on the whole batch at full length: one length program of the update to
      # compile instead of several (the bucketed update equals it:
      # tests/learner/test_learner_turn_buckets.py).
      "--config.learner.turn_buckets=1",
      "--config.log.progress_bar=False",
      "--config.log.plot=False",
      "--config.log.tensorboard=False",
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=ROOT,
    timeout=600,
  )


@pytest.mark.slow
def test_a_short_seeupo_run_against_four_fake_servers(start, tmp_path):
  servers = start(4)
  servers[0].inject("/evaluate", "drop", times=2)  # the first episode there fails: replayed
  workdir = tmp_path / "run"
  proc = run_program(servers, tmp_path, workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (record,) = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert record["rollout/retried_episodes"] == 1 and record["rollout/failed_groups"] == 0
  assert record["reward"] == -1.0 and record["finish/done"] == 1.0
  assert "eval/avg@2" in record
  trajectories = [json.loads(x) for x in (workdir / "trajectories.jsonl").read_text().splitlines()]
  assert trajectories and all(t["score_details"]["garbled"] for t in trajectories)
  assert "apis.supervisor.complete_task" in trajectories[0]["text"]
  # Every episode's server was released with a /close, but the failed one's.
  opened = sum(s.count("/initialize") for s in servers)
  closed = sum(s.count("/close") for s in servers)
  assert opened == closed + 1 == 4 + 1 + 4  # training, its replay, evaluation
  assert sum(s.count("/api_docs") for s in servers) == 1


@pytest.mark.slow
def test_all_servers_failing_mid_run_end_it_with_one_error_line_and_no_traceback(start, tmp_path):
  """Once the first episode has started, two servers are killed and two answer 500 to every task
  call (their GET / still answers): the run stops with exit status 1 and one `error: ` line
  naming the failure, and the traceback goes to <workdir>/error.log, not the terminal."""
  servers = start(4)
  broke, stop_watching = threading.Event(), threading.Event()

  def break_every_server_once_an_episode_started():
    while not stop_watching.is_set():
      if any(s.count("/initialize") for s in servers):
        for server in servers[:2]:
          server.stop()
        for server in servers[2:]:
          for path in ("/initialize", "/execute", "/task_completed", "/evaluate", "/close"):
            server.inject(path, "500", times=10**6)
        broke.set()
        return
      time.sleep(0.005)

  watcher = threading.Thread(target=break_every_server_once_an_episode_started, daemon=True)
  watcher.start()
  workdir = tmp_path / "run"
  try:
    proc = run_program(servers, tmp_path, workdir)
  finally:
    stop_watching.set()
    watcher.join(5)
  assert broke.is_set(), proc.stderr[-3000:]  # the run got past start-up, then the servers broke
  assert sum(s.count("/api_docs") for s in servers) == 1
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback (most recent call last)" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
  error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(error_lines) == 1, proc.stderr[-3000:]
  (line,) = error_lines
  assert line.endswith(f"(traceback in {workdir}/error.log)"), line
  assert "AppWorld server http://127.0.0.1:" in line, line  # it names the failure: which server
  assert "Traceback (most recent call last)" in (workdir / "error.log").read_text()


def test_the_benchmark_runs_small():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_appworld  # pylint: disable=g-import-not-at-top

  args = ["--steps", "20", "--episodes", "4", "--servers", "1,2", "--latency-ms", "1"]
  result = bench_appworld.main(args)
  assert result["overhead"]["steps"] == 20 and result["overhead"]["step_median_ms"] > 0
  assert [row["servers"] for row in result["throughput"]] == [1, 2]
  for row in result["throughput"]:
    assert row["episodes_per_s"] == pytest.approx(4 / row["wall_s"])
    assert row["ideal_episodes_per_s"] == pytest.approx(row["servers"] / (9 * 1e-3))
