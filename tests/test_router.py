"""Data-parallel replicas behind the server's router (minfer/serve/router.py, chapter 12b).

- The routing policies, unit by unit: round_robin in turn, least_outstanding by load, prefix_aware by the hash
  of the prompt's first blocks (same prefix -> same replica, new prefixes spread, load guard, forgetting).
- `DPEngineClient` over fake replicas: outstanding counts follow adds, outputs, errors and aborts; a dead
  replica makes `alive` False and gets no new requests; none left is a 503; `/metrics` has `replica="i"`.
- The whole server over two in-process fake engines: 16 concurrent streams, 0 errors, both replicas used.
- Bad sizes (0, negative, not an integer) refused by `EngineArgs` and by `python -m minfer.serve`.

The real processes (`--data-parallel-size 2` with a tiny random model, and vllm-router in front of two
servers) are in tests/test_replicas.py.

    pytest -q tests/test_router.py
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from minfer.config import EngineArgs
from minfer.serve.engine_loop import EngineLoop
from minfer.serve.metrics import ServerMetrics
from minfer.serve.protocol import APIError
from minfer.serve.router import (
    DPEngineClient,
    LeastOutstandingPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    make_policy,
    num_replicas,
    prefix_key,
)
from tests.fake_engine import FakeEngine
from tests.serving import server_in_thread, stream_completion

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------------------
def test_round_robin_takes_replicas_in_turn_and_skips_dead_ones():
    p = RoundRobinPolicy()
    assert [p.choose([1], [0, 0, 0], [0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [p.choose([1], [0, 0, 0], [0, 2]) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(LookupError):
        p.choose([1], [0, 0, 0], [])


def test_least_outstanding_picks_the_least_loaded_live_replica():
    p = LeastOutstandingPolicy()
    assert p.choose([1], [3, 1, 2], [0, 1, 2]) == 1
    assert p.choose([1], [3, 1, 2], [0, 2]) == 2
    assert p.choose([1], [2, 2, 2], [0, 1, 2]) == 0  # ties: the lowest index


def test_prefix_key_covers_only_the_first_full_blocks():
    a = list(range(100, 140))  # 40 tokens: two full blocks of 16 and 8 more
    assert prefix_key(a, 16, 2) == prefix_key(a[:32] + [7] * 50, 16, 2)  # what follows 2 blocks is ignored
    assert prefix_key(a, 16, 2) != prefix_key(a[:31] + [7], 16, 2)       # the last token of block 2 counts
    assert prefix_key(a, 16, 2) != prefix_key(a, 16, 1)
    assert prefix_key(a[:15], 16, 2) is None                              # no full block: nothing cached
    assert prefix_key(a[:20], 16, 2) == prefix_key(a[:16] + [1, 2, 3], 16, 2)  # one full block
    assert prefix_key("a string", 16, 2) is None and prefix_key([2 ** 70] * 16, 16, 1) is None


def _prompt(system: int, user: int, system_len=40, user_len=12):
    return [1000 + system] * system_len + [2000 + user + k for k in range(user_len)]


def test_prefix_aware_sends_a_shared_prefix_back_to_its_replica():
    p = PrefixAwarePolicy(block_size=16, num_prefix_blocks=2)
    load = [0, 0, 0]
    first = {s: p.choose(_prompt(s, 0), load, [0, 1, 2]) for s in range(6)}
    assert sorted(first.values()) == [0, 0, 1, 1, 2, 2]  # new prefixes spread over the replicas
    for user in range(1, 5):
        for s in range(6):
            assert p.choose(_prompt(s, user), load, [0, 1, 2]) == first[s]
    # a prompt without a full block goes by load
    assert p.choose([5] * 10, [2, 0, 1], [0, 1, 2]) == 1


def test_prefix_aware_guards_the_load_and_moves_keys_of_dead_replicas():
    p = PrefixAwarePolicy(block_size=16, num_prefix_blocks=2, max_imbalance=3)
    owner = p.choose(_prompt(0, 0), [0, 0], [0, 1])
    other = 1 - owner
    load = [0, 0]
    load[owner] = 3
    assert p.choose(_prompt(0, 1), load, [0, 1]) == owner      # 3 more is still within max_imbalance
    load[owner] = 4
    assert p.choose(_prompt(0, 2), load, [0, 1]) == other      # 4 more: the least loaded one
    load[owner] = 0
    assert p.choose(_prompt(0, 3), load, [0, 1]) == owner      # the key kept its replica
    assert p.choose(_prompt(0, 4), [0, 0], [other]) == other   # its replica died: re-assigned
    assert p.choose(_prompt(0, 5), [0, 0], [0, 1]) == other


def test_prefix_aware_forgets_the_least_recently_used_keys():
    p = PrefixAwarePolicy(block_size=16, num_prefix_blocks=1, max_entries=2)
    for s in range(3):  # the third key evicts the first
        p.choose(_prompt(s, 0), [0, 0], [0, 1])
    keys = [prefix_key(_prompt(s, 0), 16, 1) for s in range(3)]
    assert list(p._table) == keys[1:] and sum(p._keys_per_replica.values()) == 2


def test_make_policy_refuses_unknown_names():
    assert make_policy("prefix_aware", 32).block_size == 32
    with pytest.raises(ValueError, match="round_robin, least_outstanding, prefix_aware"):
        make_policy("random")
    with pytest.raises(ValueError):
        PrefixAwarePolicy(num_prefix_blocks=0)


# ----------------------------------------------------------------------------------------------------------
# DPEngineClient over fake replicas
# ----------------------------------------------------------------------------------------------------------
class _Snap:
    def __init__(self, finished):
        self.finished = finished


class FakeClient:
    """An engine client that records what it is given; the test drives its events."""

    def __init__(self):
        self.metrics = ServerMetrics("m")
        self.added, self.aborted, self.queues = [], [], {}
        self.alive, self.exit_reason = True, None
        self.latest_stats = {"num_running": 1, "kv_cache_usage": 0.5}
        self.kv_pool_info = {"num_blocks": 10, "block_size": 16, "num_tokens": 160, "bytes": 1, "num_cpu_blocks": 0}
        self.recent_ttfts, self.num_steps, self.num_requests_added, self.num_step_errors = [], 1, 0, 0
        self.engine_view = None

    def start(self):
        pass

    def stop(self, timeout=5.0):
        pass

    def add(self, rid, prompt, params, q, arrival):
        self.added.append(rid)
        self.queues[rid] = q
        q.put_nowait((rid, "added", None))

    def abort(self, rids):
        self.aborted += rids

    def die(self):
        self.alive, self.exit_reason = False, "the engine process died (exit code -9)"


def test_dp_client_counts_outstanding_requests_and_skips_dead_replicas():
    async def run():
        a, b = FakeClient(), FakeClient()
        dp = DPEngineClient([a, b], "least_outstanding", "m")
        q = asyncio.Queue()
        for k in range(4):
            dp.add(f"r{k}", [1, 2, 3], None, q, 0.0)
        assert a.added == ["r0", "r2"] and b.added == ["r1", "r3"] and dp.outstanding == [2, 2]
        a.queues["r0"].put_nowait(("r0", "output", _Snap(False)))
        assert dp.outstanding == [2, 2]
        a.queues["r0"].put_nowait(("r0", "output", _Snap(True)))      # finished
        b.queues["r1"].put_nowait(("r1", "error", ValueError("bad")))  # refused
        assert dp.outstanding == [1, 1]
        dp.abort(["r2", "r3", "unknown"])
        assert a.aborted == ["r2"] and b.aborted == ["r3"] and dp.outstanding == [0, 0]
        assert [q.get_nowait()[1] for _ in range(q.qsize())].count("added") == 4  # every event passed on
        assert dp.alive and dp.exit_reason is None
        a.die()
        assert not dp.alive and "replica 0: the engine process died" in dp.exit_reason
        for k in range(4, 7):
            dp.add(f"r{k}", [1], None, q, 0.0)
        assert b.added[-3:] == ["r4", "r5", "r6"]  # only the live replica gets new requests
        b.die()
        dp.add("r7", [1], None, q, 0.0)
        while True:
            rid, kind, payload = q.get_nowait()
            if rid == "r7":
                break
        assert kind == "error" and isinstance(payload, APIError) and payload.status == 503
        assert dp.latest_stats["num_running"] == 2 and dp.latest_stats["kv_cache_usage"] == 0.5
        assert dp.kv_pool_info["num_blocks"] == 20 and len(dp.kv_pool_info["replicas"]) == 2
        return dp

    dp = asyncio.run(run())
    text = dp.metrics.render()[0].decode()
    assert 'minfer:num_requests_running{model_name="m",replica="0"}' in text
    assert 'minfer:num_requests_running{model_name="m",replica="1"}' in text
    assert 'minfer:router_requests_routed_total{model_name="m",replica="1"} 5.0' in text
    assert 'minfer:replica_up{model_name="m",replica="0"} 0.0' in text


def test_a_duplicate_request_id_is_refused_not_routed_twice():
    async def run():
        a = FakeClient()
        dp = DPEngineClient([a, FakeClient()], "round_robin", "m")
        q = asyncio.Queue()
        dp.add("x", [1], None, q, 0.0)
        dp.add("x", [1], None, q, 0.0)
        events = [q.get_nowait() for _ in range(q.qsize())]
        assert [e[1] for e in events] == ["added", "error"] and dp.outstanding == [1, 0]

    asyncio.run(run())


# ----------------------------------------------------------------------------------------------------------
# The server over two in-process fake replicas
# ----------------------------------------------------------------------------------------------------------
def _fake_dp(policy="prefix_aware"):
    engines = [FakeEngine(step_delay=0.002, max_num_seqs=16) for _ in range(2)]
    loops = [EngineLoop(e, ServerMetrics("fake-model")) for e in engines]
    return engines, DPEngineClient(loops, policy, "fake-model")




def test_16_concurrent_streams_over_two_replicas_have_no_errors():
    from minfer.serve.routes import build_app

    engines, dp = _fake_dp("round_robin")
    app = build_app(engines[0], engine_loop=dp, log_requests=False)
    with server_in_thread(app) as url:
        body = {"model": "fake-model", "max_tokens": 12, "temperature": 0, "stream": True}

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*[stream_completion(c, url, {**body, "prompt": f"alpha beta {i}"})
                                              for i in range(16)])

        results = asyncio.run(asyncio.wait_for(run(), 60))
        assert all(not errors for _, errors in results), [e for _, e in results if e][:2]
        alone = httpx.post(url + "/v1/completions", json={**body, "prompt": "alpha beta 3", "stream": False},
                           timeout=30).json()["choices"][0]["text"]
        assert results[3][0] == alone
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        metrics = httpx.get(url + "/metrics", timeout=5).text
        stats = httpx.get(url + "/v1/stats", timeout=5).json()
    assert engines[0].num_steps > 0 and engines[1].num_steps > 0  # both replicas did work
    assert 'minfer:router_requests_routed_total{model_name="fake-model",replica="0"} 9.0' in metrics
    assert 'minfer:router_requests_routed_total{model_name="fake-model",replica="1"} 8.0' in metrics
    assert 'minfer:generation_tokens_total{model_name="fake-model",replica="1"}' in metrics
    # vLLM's names too (chapter 15), per replica, and the cache settings of each replica
    assert 'vllm:generation_tokens_total{engine="1",model_name="fake-model",replica="1"}' in metrics
    assert 'minfer:cache_config_info{' in metrics and 'replica="0"' in metrics.split("minfer:cache_config_info{")[1]
    assert stats["num_requests_total"] == 17 and len(stats["kv_pool"]["replicas"]) == 2
    assert dp.outstanding == [0, 0]


# ----------------------------------------------------------------------------------------------------------
# Bad sizes
# ----------------------------------------------------------------------------------------------------------
def test_replicas_from_gpus_the_articles_example():
    assert num_replicas(8, tensor_parallel_size=2) == 4  # article §14: 8 GPUs, TP=2 -> 4 replicas
    assert num_replicas(8, 2, 2) == 2 and num_replicas(1) == 1
    with pytest.raises(ValueError, match="do not split"):
        num_replicas(8, 3)
    with pytest.raises(ValueError, match="num_gpus"):
        num_replicas(0)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_bad_data_parallel_sizes_are_refused(size):
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=size)


def test_an_engine_is_one_replica():
    from minfer.engine import LLMEngine

    with pytest.raises(ValueError, match="one replica"):
        LLMEngine(EngineArgs(data_parallel_size=2))


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "0"], "data_parallel_size must be an integer >= 1"),
    (["--data-parallel-size", "-2"], "data_parallel_size must be an integer >= 1"),
    (["--data-parallel-size", "2", "--no-engine-process"], "drop --no-engine-process"),
])
def test_the_server_refuses_bad_sizes_before_loading(argv, message, capsys, monkeypatch):
    from minfer.serve import __main__ as cli

    monkeypatch.setattr("minfer.serve.router.DPEngineClient.start",
                        lambda self: pytest.fail("started replicas despite a bad size"))
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_server_refuses_an_unknown_policy(capsys):
    from minfer.serve import __main__ as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--data-parallel-size", "2", "--router-policy", "random"])
    assert exc.value.code == 2 and "prefix_aware" in capsys.readouterr().err
