"""A pool of AppWorld environment servers, leased to episodes one episode per server.

    pool = ServerPool([AppWorldClient(url) for url in urls], lease_timeout_s=600)
    client = pool.lease(task_id)         # blocks (with a timeout) while every server is leased
    ...                                  # the episode's requests (`appworld_client.py`)
    pool.release(client)                 # or release(client, failure): see the lease order

Thread-safe; blocking with a timeout when every server is leased; taking a server that stops
answering out of rotation while at least one other still answers; leasing a server whose episode
failed only after the others and after it answers a health probe (`ServerPool`'s docstring).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar

from absl import logging

from seeupo_jax.envs import appworld_client as client_lib
from seeupo_jax.envs.appworld_client import (
  START_COMMAND,
  AppWorldClient,
  AppWorldError,
  PoolExhausted,
  ProtocolError,
  ServerUnreachable,
)

T = TypeVar("T")

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
      reasons = [client_lib.health_reason(targets[0].client)]
    else:
      with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as workers:
        reasons = list(workers.map(lambda s: client_lib.health_reason(s.client), targets))
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
            reason = client_lib.health_reason(server.client)
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
        reason = client_lib.health_reason(client) or ""
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
