"""A dead engine process (or replica) must answer 503 at once: no blocked event loop, no request left waiting.

These tests use a real `MPEngineClient` with its ZMQ sockets bound but no engine process connected (what the
client sees once the engine process is gone), and a stand-in for the process object; no model is loaded.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from minfer.serve.engine_client import MPEngineClient
from minfer.serve.engine_loop import EngineLoop, RequestGroup
from minfer.serve.protocol import APIError
from minfer.serve.router import DPEngineClient
from tests.test_router import FakeClient


class _Proc:
    """A process that still reports alive (a clean exit not reaped yet) until `exit()`."""

    def __init__(self):
        self.exitcode, self.pid = None, 0

    def is_alive(self):
        return self.exitcode is None

    def exit(self, code=1):
        self.exitcode = code

    def terminate(self):
        self.exitcode = -15

    kill = terminate

    def join(self, timeout=None):
        pass


@pytest.fixture
def client():
    c = MPEngineClient(engine_args=None)
    c._proc = _Proc()
    yield c
    c._proc.exit()
    c.stop(timeout=1)


def _run_with_timeout(coro, timeout=5.0):
    """Run `coro` in a thread: a blocked event loop fails the test instead of hanging it."""
    result = {}

    def target():
        result["value"] = asyncio.run(coro)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the event loop was still blocked after {timeout} s"
    return result["value"]


def test_add_with_no_engine_connected_answers_503_without_blocking(client):
    # Finding 1: `alive` is still True but nobody reads the PUSH socket; a blocking send froze the loop.
    async def run():
        q = asyncio.Queue()
        t0 = time.perf_counter()
        client.add("r1", [1, 2, 3], None, q, 0.0)
        elapsed = time.perf_counter() - t0
        event = await asyncio.wait_for(q.get(), 2)
        return elapsed, event

    elapsed, (rid, kind, payload) = _run_with_timeout(run())
    assert elapsed < 1.0
    assert rid == "r1" and kind in ("error", "fatal")
    assert isinstance(payload, APIError) and payload.status == 503
    assert not client.alive and client._routes == {}  # the failed send counts as the engine's death
    client._proc.exit(-9)
    client._on_death()  # the receiver thread sees the exit afterwards: the reason gains its exit code
    assert "exit code -9" in client.exit_reason


def test_requests_fired_at_once_after_death_all_get_503(client):
    # Finding 2: five requests at once after the engine died: each gets its answer, none waits forever.
    async def run():
        qs = [asyncio.Queue() for _ in range(5)]
        for k, q in enumerate(qs):
            client.add(f"r{k}", [1], None, q, 0.0)
        return [await asyncio.wait_for(q.get(), 2) for q in qs]

    events = _run_with_timeout(run())
    assert all(isinstance(p, APIError) and p.status == 503 for _, _, p in events), events
    assert client._routes == {}


def test_requests_registered_before_death_get_a_503_at_once(client):
    # A request acknowledged before the death gets "fatal"; one still waiting for "added" (it would wait in
    # `RequestGroup.submit` for ever on a "fatal") and a job get "error"; both 503.
    from minfer.serve.engine_client import _Route

    async def run():
        loop = asyncio.get_running_loop()
        qs = {k: asyncio.Queue() for k in ("running", "waiting", "job")}
        with client._lock:
            for k, q in qs.items():
                client._routes[k] = _Route(loop, q, 0.0)
            client._routes["running"].added = True
        client._proc.exit(0)
        client._on_death()
        events = {k: await asyncio.wait_for(q.get(), 2) for k, q in qs.items()}
        q2 = asyncio.Queue()
        client.add("late", [1], None, q2, 0.0)  # after death: refused at once, never registered
        return events, q2.get_nowait()

    events, late = _run_with_timeout(run())
    assert {k: e[1] for k, e in events.items()} == {"running": "fatal", "waiting": "error", "job": "error"}
    for _, _, payload in [*events.values(), late]:
        assert isinstance(payload, APIError) and payload.status == 503
    assert "engine process died" in str(events["running"][2])
    assert late[1] == "error" and client._routes == {}


def test_submit_after_death_raises_503_not_hangs(client):
    async def run():
        group = RequestGroup(client, "cmpl-x", 3)
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(group.submit([[1], [2], [3]], [None] * 3, 0.0), 2)
        return info.value

    assert _run_with_timeout(run()).status == 503


def test_a_fatal_step_from_a_dead_worker_is_a_503(client):
    # The step that saw the worker die: the engine core marks its "fatal" message 503.
    async def run():
        q = asyncio.Queue()
        from minfer.serve.engine_client import _Route

        client._routes["r"] = _Route(asyncio.get_running_loop(), q, 0.0)
        client._on_message(["fatal", ["r"], "engine error: WorkerDiedError: worker 1 exited", 503])
        group = RequestGroup.__new__(RequestGroup)
        group.engine_loop, group.queue, group.unfinished, group._early = client, q, {"r"}, __import__(
            "collections").deque()
        with pytest.raises(APIError) as info:
            async for _ in group.events():
                pass
        return info.value

    err = _run_with_timeout(run())
    assert err.status == 503 and "WorkerDiedError" in str(err)


def test_the_router_count_does_not_leak_when_a_replica_died_unseen():
    # A replica whose client refuses the request (its engine died): the router's outstanding count returns to 0.
    async def run():
        a, b = FakeClient(), FakeClient()

        def dead_add(rid, prompt, params, q, arrival):
            q.put_nowait((rid, "error", APIError(503, "the engine process died")))

        a.add = dead_add
        dp = DPEngineClient([a, b], "round_robin", "m")
        q = asyncio.Queue()
        for k in range(6):
            dp.add(f"r{k}", [1], None, q, 0.0)
        events = [q.get_nowait() for _ in range(q.qsize())]
        return dp, events

    dp, events = asyncio.run(run())
    assert [e[1] for e in events].count("error") == 3 and dp.outstanding == [0, 3]


class _JobClient(FakeClient):
    def __init__(self):
        super().__init__()
        self.jobs, self.cancelled = {}, []

    def run_when_idle(self, job_id, fn, q):
        self.jobs[job_id] = q

    def cancel_job(self, job_id):
        self.cancelled.append(job_id)


def test_beam_search_jobs_go_to_the_least_loaded_live_replica():
    # Finding 4: DPEngineClient had no run_when_idle (beam search on -dp 2 was a 500 AttributeError).
    async def run():
        a, b = _JobClient(), _JobClient()
        dp = DPEngineClient([a, b], "round_robin", "m")
        q = asyncio.Queue()
        dp.add("r0", [1], None, q, 0.0)  # replica 0 now has one outstanding request
        dp.run_when_idle("j1", len, q)
        assert list(b.jobs) == ["j1"] and not a.jobs
        b.jobs["j1"].put_nowait(("j1", "done", ["beams"]))
        dp.cancel_job("j1")  # answered already: nothing to cancel
        dp.run_when_idle("j2", len, q)
        dp.cancel_job("j2")
        assert b.cancelled == ["j2"] and a.cancelled == []
        b.die()
        dp.run_when_idle("j3", len, q)
        assert "j3" in a.jobs
        a.die()
        dp.run_when_idle("j4", len, q)
        return [q.get_nowait() for _ in range(q.qsize())]

    events = asyncio.run(run())
    assert ("j1", "done", ["beams"]) in events
    last = events[-1]
    assert last[0] == "j4" and last[1] == "error" and last[2].status == 503


def test_beam_search_over_in_process_replicas_runs():
    from tests.fake_engine import FakeEngine

    async def run():
        loops = [EngineLoop(FakeEngine(), None) for _ in range(2)]
        dp = DPEngineClient(loops, "round_robin", "m")
        dp.start()
        try:
            q = asyncio.Queue()
            dp.run_when_idle("j", _answer, q)
            return await asyncio.wait_for(q.get(), 5)
        finally:
            dp.stop()

    assert asyncio.run(run()) == ("j", "done", 42)


def _answer(engine):
    return 42
