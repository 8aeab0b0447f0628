"""`benchmarks/peer_serve.py` without any server: its plan (the commands it would run), its summary and ratios
on canned results, and the output-token check. The benchmark itself runs vLLM and llama.cpp and is never a test."""

import json

import pytest

from tests.benchmark_scripts import load_benchmark

peer_serve = load_benchmark("peer_serve")

Q4_1 = ["--gguf-q4-1", "/models/q4_1.gguf"]


def args(*argv):
    return peer_serve.parse_args([*Q4_1, *argv])


def test_defaults_are_the_issues_setup():
    a = args()
    assert a.servers == ["minfer-f32", "vllm-f32", "minfer-q4_1", "llama-q4_1", "minfer-q4_0", "llama-q4_0"]
    assert a.concurrency == [1, 16, 64] and a.rounds == 2
    assert (a.input_len, a.output_len, a.temperature) == (192, 48, 0.0)
    assert a.max_num_seqs == 64
    assert [peer_serve.num_prompts(a, c) for c in (1, 16, 64)] == [16, 32, 128]
    assert peer_serve.num_prompts(args("--num-prompts", "8"), 64) == 8


@pytest.mark.parametrize("argv", [["--servers", "minfer-f32,sglang"], ["--servers", "vllm-f32,vllm-f32"],
                                  ["--concurrency", "1,x"], ["--concurrency", "0"], ["--rounds", "0"],
                                  ["--concurrency", "16,16"],
                                  ["--input-len", "1000", "--output-len", "48"],
                                  ["--llama-np", "4", "--concurrency", "1,16"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        args(*argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_plan_restarts_llama_server_per_concurrency_and_alternates_rounds():
    a = args("--rounds", "2", "--concurrency", "1,16", "--servers", "vllm-f32,llama-q4_0")
    plan = [(rnd, s.name, slots, concs) for rnd, s, slots, concs in peer_serve.starts(a)]
    assert plan == [(0, "vllm-f32", 16, [1, 16]), (0, "llama-q4_0", 1, [1]), (0, "llama-q4_0", 16, [16]),
                    (1, "vllm-f32", 16, [1, 16]), (1, "llama-q4_0", 1, [1]), (1, "llama-q4_0", 16, [16])]
    fixed = args("--rounds", "1", "--concurrency", "1,16", "--servers", "llama-q4_1", "--llama-np", "64")
    assert [(s.name, slots, concs) for _, s, slots, concs in peer_serve.starts(fixed)] == [("llama-q4_1", 64, [1, 16])]


def test_server_commands():
    a = args("--concurrency", "1,16,64")

    def cmd(name, slots=64):
        return peer_serve.server_cmd(peer_serve.SERVERS[name], a, 8123, slots)[0]

    vllm = cmd("vllm-f32")
    assert vllm[1:3] == ["serve", "/tmp/smollm2-hf"] and "--enforce-eager" not in vllm  # its default, compiled mode
    assert vllm[vllm.index("--max-num-seqs") + 1] == "64" and vllm[vllm.index("--dtype") + 1] == "float32"
    env = peer_serve.server_cmd(peer_serve.SERVERS["vllm-f32"], a, 8123, 64)[1]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    m = cmd("minfer-q4_0")
    assert m[m.index("--model") + 1] == "/work/smollm2-q4_0.gguf" and m[m.index("--quantization") + 1] == "gguf"
    assert cmd("minfer-f32")[cmd("minfer-f32").index("--model") + 1] == "/tmp/smollm2-hf"
    llama = cmd("llama-q4_1", 16)
    assert llama[llama.index("-m") + 1] == "/models/q4_1.gguf"
    assert llama[llama.index("-np") + 1] == "16" and llama[llama.index("-c") + 1] == str(16 * 1024)
    assert llama[llama.index("-t") + 1] == "2" and "--cont-batching" in llama and "--cache-ram" in llama
    bench = peer_serve.vllm_bench_cmd(a, "http://127.0.0.1:8123", 16, "/out")
    for flag, value in (("--backend", "openai"), ("--endpoint", "/v1/completions"), ("--dataset-name", "random"),
                        ("--random-input-len", "192"), ("--random-output-len", "48"), ("--num-prompts", "32"),
                        ("--max-concurrency", "16"), ("--temperature", "0.0")):
        assert bench[bench.index(flag) + 1] == value
    assert "--ignore-eos" in bench and "--save-result" in bench and "--save-detailed" in bench
    assert bench[bench.index("--ready-check-timeout-sec") + 1] == "0"  # its test request would be counted
    assert "--metrics" in llama  # its generated-token counter


def test_no_server_start_sees_a_prompt_twice_and_every_server_the_same_prompts():
    """vllm bench's random dataset draws prompt i from the seed alone: with one seed for every run, the runs at 16
    and 64 streams would resend the earlier runs' prompts, and vLLM's default prefix cache would skip their prefill."""
    a = args("--concurrency", "1,16,64")
    seeds = [peer_serve.run_seed(a, c, client) for c in (1, 16, 64) for client in ("client_vllm", "client_minfer")]
    assert len(set(seeds)) == len(seeds)
    assert [peer_serve.run_seed(a, c, "client_vllm") for c in (1, 16, 64)] == [0, 1000, 2000]
    for c in (1, 16, 64):
        bench = peer_serve.vllm_bench_cmd(a, "http://127.0.0.1:8123", c, "/out")
        assert bench[bench.index("--seed") + 1] == str(peer_serve.run_seed(a, c, "client_vllm"))
    assert peer_serve.run_seed(args("--seed", "7", "--concurrency", "1,16,64"), 16, "client_vllm") == 1007
    same = args("--same-seed", "--seed", "3")
    assert {peer_serve.run_seed(same, c, k) for c in (1, 16, 64) for k in ("client_vllm", "client_minfer")} == {3}


def test_prefix_cache_counters_are_read_from_metrics(monkeypatch):
    text = ('vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 3072.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 1536.0\n')
    monkeypatch.setattr(peer_serve, "metrics_text", lambda url: text)
    before = peer_serve.prefix_cache_counts("http://x", "vllm")
    assert before == {"queries": 3072.0, "hits": 1536.0}
    assert peer_serve.prefix_cache_counts("http://x", "llama") is None
    assert peer_serve.counts_since({"queries": 100.0, "hits": 0.0}, before) == {"queries": 2972, "hits": 1536}
    assert peer_serve.counts_since(None, before) is None


def test_dry_run_prints_every_start(capsys):
    assert peer_serve.main([*Q4_1, "--dry-run", "--rounds", "1", "--concurrency", "1,4"]) == 0
    out = capsys.readouterr().out
    assert out.count("round 0 ") == 8  # 4 servers started once, 2 llama-servers once per concurrency
    assert out.count("vllm bench serve") == 12 and "--enforce-eager" not in out


def _res(tok_s, ttft, tpot, tokens=768, failed=0):
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": 2 * tpot, "total_output_tokens": tokens, "completed": 16 - failed, "failed": failed}


def _runs(table):
    """{server: {c: [(tok/s, ttft, tpot[, tokens]) per round]}} -> runs as main() records them."""
    return {s: {c: [{"round": i, "client_vllm": _res(*r)} for i, r in enumerate(rounds)] for c, rounds in by_c.items()}
            for s, by_c in table.items()}


CANNED = _runs({
    "minfer-f32": {1: [(50, 200, 18), (44, 210, 19), (46, 190, 17)], 16: [(160, 2000, 60), (150, 2100, 61), (170, 1900, 58)]},
    "vllm-f32": {1: [(25, 220, 38), (23, 200, 40), (26, 190, 35)], 16: [(190, 1000, 65), (170, 1100, 70), (180, 1050, 62)]},
    "minfer-q4_0": {1: [(60, 100, 15)], 16: [(280, 900, 50)]},
    "llama-q4_0": {1: [(70, 90, 13)], 16: [(150, 1000, 90)]},
})


def test_medians_over_rounds():
    med = peer_serve.medians(CANNED, "client_vllm")
    assert med["minfer-f32"][1]["output_throughput"] == 46 and med["minfer-f32"][1]["mean_ttft_ms"] == 200
    assert med["vllm-f32"][16]["output_throughput"] == 180 and med["vllm-f32"][16]["mean_tpot_ms"] == 65
    assert med["vllm-f32"][16]["p99_ttft_ms"] == 2100 and med["vllm-f32"][16]["rounds"] == 3
    assert peer_serve.medians(CANNED, "client_minfer") == {}


def test_a_peer_whose_runs_all_failed_is_left_out_not_divided_by():
    """vllm bench reports 0.0 tok/s for a run whose requests all failed: the summary must not divide by it (it runs
    after an hour of measuring, before the JSON is written)."""
    dead = {"output_throughput": 0.0, "mean_ttft_ms": 0.0, "p99_ttft_ms": 0.0, "mean_tpot_ms": 0.0,
            "p99_tpot_ms": 0.0, "total_output_tokens": 0, "completed": 0, "failed": 32}
    runs = _runs({"minfer-f32": {16: [(50, 200, 18)]}})
    runs["vllm-f32"] = {16: [{"round": 0, "client_vllm": dead}]}
    summary = peer_serve.summarize(runs, {16: 768})
    assert "vllm-f32" not in summary["client_vllm"]["medians"] and summary["client_vllm"]["comparisons"] == []
    assert not summary["client_vllm"]["token_check"]["ok"]


def test_a_failed_round_is_left_out_of_the_medians():
    runs = _runs({"vllm-f32": {1: [(20, 100, 10), (30, 100, 10)]}})
    runs["vllm-f32"][1].append({"round": 2, "error": "server exited with status 1"})
    runs["vllm-f32"][1].append({"round": 3, "client_vllm": {"error": "vllm bench serve exited 1"}})
    med = peer_serve.medians(runs, "client_vllm")
    assert med["vllm-f32"][1]["output_throughput"] == 25 and med["vllm-f32"][1]["rounds"] == 2


def test_comparisons_ratios_and_targets():
    rows = {(r["minfer"], r["concurrency"]): r for r in peer_serve.compare(peer_serve.medians(CANNED, "client_vllm"))}
    assert set(rows) == {("minfer-f32", 1), ("minfer-f32", 16), ("minfer-q4_0", 1), ("minfer-q4_0", 16)}
    c1 = rows["minfer-f32", 1]
    assert c1["throughput_ratio"] == pytest.approx(46 / 25, abs=1e-3)
    assert c1["ttft_ratio"] == pytest.approx(200 / 200) and c1["tpot_ratio"] == pytest.approx(18 / 38, abs=1e-3)
    assert c1["met"] is None  # issue 41's targets are at 16 and 64 streams
    c16 = rows["minfer-f32", 16]
    assert c16["throughput_ratio"] == pytest.approx(160 / 180, abs=1e-3) and c16["met"] is False
    assert rows["minfer-q4_0", 1]["met"] is None  # llama-server's target is at 16 and 64 only
    q16 = rows["minfer-q4_0", 16]
    assert q16["throughput_ratio"] == pytest.approx(280 / 150, abs=1e-3)
    assert q16["met"] is (q16["ttft_ratio"] <= 1 and q16["tpot_ratio"] <= 1)


def test_the_vllm_target_needs_tpot_no_worse_and_the_gguf_one_ttft_too():
    runs = _runs({"minfer-f32": {16: [(300, 1100, 50)]}, "vllm-f32": {16: [(200, 1000, 60)]},
                  "minfer-q4_0": {16: [(300, 1100, 50)]}, "llama-q4_0": {16: [(200, 1000, 60)]}})
    rows = {r["minfer"]: r for r in peer_serve.compare(peer_serve.medians(runs, "client_vllm"))}
    assert rows["minfer-f32"]["throughput_ratio"] == 1.5 and rows["minfer-f32"]["ttft_ratio"] == 1.1
    assert rows["minfer-f32"]["met"] is True  # TTFT 1.1x worse does not count against float32; TPOT is better
    assert rows["minfer-q4_0"]["met"] is False  # 1.5x, but TTFT worse
    slow = _runs({"minfer-f32": {16: [(300, 1000, 70)]}, "vllm-f32": {16: [(200, 1000, 60)]}})
    (row,) = peer_serve.compare(peer_serve.medians(slow, "client_vllm"))
    assert row["met"] is False  # TPOT worse


def test_a_failed_request_misses_the_target():
    runs = _runs({"minfer-q4_0": {64: [(300, 900, 50)]}, "llama-q4_0": {64: [(100, 1000, 60)]}})
    runs["llama-q4_0"][64][0]["client_vllm"]["failed"] = 2
    (row,) = peer_serve.compare(peer_serve.medians(runs, "client_vllm"))
    assert row["throughput_ratio"] == 3 and row["failed"] == [0, 2] and row["met"] is False


def test_the_float32_target_gives_way_to_fractions_where_vllm_is_near_the_peak():
    runs = _runs({"minfer-f32": {16: [(100, 900, 50)]}, "vllm-f32": {16: [(100, 1000, 60)]}})
    rows = peer_serve.compare(peer_serve.medians(runs, "client_vllm"))
    rows[0]["peer_peak_fraction"] = 0.8
    peer_serve.apply_peak_condition(rows)
    assert rows[0]["met"] is None and "compare the fractions" in rows[0]["verdict"]
    rows = peer_serve.compare(peer_serve.medians(runs, "client_vllm"))
    rows[0]["peer_peak_fraction"] = 0.5
    peer_serve.apply_peak_condition(rows)
    assert rows[0]["met"] is False  # 1.0x < 1.1x where vLLM leaves room


def test_token_check_flags_a_short_server():
    expected = {1: 768, 16: 768}
    assert peer_serve.token_check(CANNED, expected)["ok"]
    runs = json.loads(json.dumps(CANNED))  # a copy (int keys become strings: use the canned one's keys)
    runs = {s: {int(c): r for c, r in by_c.items()} for s, by_c in runs.items()}
    runs["llama-q4_0"][16][0]["client_vllm"]["total_output_tokens"] = 760
    runs["vllm-f32"][1][2]["client_vllm"]["failed"] = 1
    runs["minfer-f32"][1].append({"round": 3, "error": "server exited with status 1"})
    check = peer_serve.token_check(runs, expected)
    assert not check["ok"] and len(check["mismatches"]) == 3
    assert any(m.startswith("llama-q4_0 c=16 round 0: 760 output tokens, expected 768") for m in check["mismatches"])
    assert any(m.startswith("minfer-f32 c=1 round 3: no result") for m in check["mismatches"])


def test_summarize_per_client():
    runs = json.loads(json.dumps(CANNED))
    runs = {s: {int(c): r for c, r in by_c.items()} for s, by_c in runs.items()}
    for by_c in runs.values():
        for rounds in by_c.values():
            for r in rounds:
                r["client_minfer"] = dict(r["client_vllm"], output_throughput=r["client_vllm"]["output_throughput"] + 1)
    s = peer_serve.summarize(runs, {1: 768, 16: 768})
    assert set(s) == {"client_vllm", "client_minfer"}
    assert s["client_minfer"]["medians"]["vllm-f32"][1]["output_throughput"] == 26
    assert s["client_vllm"]["token_check"]["ok"] and len(s["client_vllm"]["comparisons"]) == 4


def test_bench_lock_is_held_inside_only(tmp_path):
    import fcntl

    path = tmp_path / "bench.lock"

    def free() -> bool:
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    with peer_serve.bench_lock(str(path)):
        assert not free()
    assert free()
    with peer_serve.bench_lock(None):  # no lock file: nothing taken
        pass


def test_counter_value_sums_labels_and_ignores_longer_names():
    text = ("# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{engine="0",model_name="smollm2"} 96.0\n'
            'vllm:generation_tokens_total{engine="1",model_name="smollm2"} 4.0\n'
            "vllm:generation_tokens_total_created 1.7e9\n"
            "llamacpp:tokens_predicted_total 768\n")
    assert peer_serve.counter_value(text, "vllm:generation_tokens_total") == 100.0
    assert peer_serve.counter_value(text, "llamacpp:tokens_predicted_total") == 768.0
    assert peer_serve.counter_value(text, "minfer:generation_tokens_total") is None


def test_percentile_is_numpys():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.5, 3.25, 7.0, 2.0, 11.0]
    for q in (0, 50, 90, 99, 100):
        assert peer_serve.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_recount_recomputes_throughput_and_tpot_from_the_timings():
    res = {"output_throughput": 99.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": 150.0, "mean_tpot_ms": 1.0,
           "p99_tpot_ms": 1.0, "total_output_tokens": 30, "failed": 0, "output_lens_min_max": [9, 11],
           "_detail": {"ttfts": [0.1, 0.2, 0.3], "latencies": [1.0, 1.1, 2.1], "duration": 2.5}}
    fixed = peer_serve.recount(res, 10)
    assert fixed["total_output_tokens"] == 30 and fixed["output_throughput"] == pytest.approx(30 / 2.5)
    assert fixed["mean_tpot_ms"] == pytest.approx(1000 * (0.9 / 9 + 0.9 / 9 + 1.8 / 9) / 3)
    assert fixed["p99_tpot_ms"] == pytest.approx(1000 * peer_serve.percentile([0.1, 0.1, 0.2], 99))
    assert fixed["mean_ttft_ms"] == 100.0  # TTFT does not depend on the count
    assert fixed["as_counted_by_vllm_bench"]["output_throughput"] == 99.0


def test_token_check_uses_the_servers_counter_and_reports_recounts():
    expected = {1: 768}
    runs = _runs({"llama-q4_1": {1: [(50, 100, 10), (50, 100, 10)]}})
    first, second = (r["client_vllm"] for r in runs["llama-q4_1"][1])
    first["server_output_tokens"] = 768
    first["as_counted_by_vllm_bench"] = {"total_output_tokens": 771}
    second["server_output_tokens"] = 700  # the client saw 768, the server says otherwise: flag it
    check = peer_serve.token_check(runs, expected)
    assert not check["ok"]
    assert check["mismatches"] == ["llama-q4_1 c=1 round 1: the server's counter says 700 tokens generated, "
                                   "expected 768"]
    assert check["recounted"] == ["llama-q4_1 c=1 round 0: vllm bench counted 771 by re-tokenizing the text, "
                                  "the server 768: metrics recounted"]


# ---------------------------------------------------------------------------------------------------------------
# issue 41: ports, Connection: close to llama-server, --out-dir, the machine's peaks and each server's fraction


def test_ports_parse_and_are_used(monkeypatch):
    a = args("--ports", "minfer=8100, vllm=8200,llama=8300")
    assert a.ports == {"minfer": 8100, "vllm": 8200, "llama": 8300}
    assert args().ports == {}
    assert [peer_serve.port_for(a, peer_serve.SERVERS[n]) for n in ("minfer-q4_0", "vllm-f32", "llama-q4_1")] == \
        [8100, 8200, 8300]
    monkeypatch.setattr("minfer.bench.serve.free_port", lambda: 40123)
    only_llama = args("--ports", "llama=8300")
    assert peer_serve.port_for(only_llama, peer_serve.SERVERS["minfer-f32"]) == 40123  # left out: a free port
    assert peer_serve.port_for(only_llama, peer_serve.SERVERS["llama-q4_0"]) == 8300


@pytest.mark.parametrize("ports", ["sglang=8000", "minfer=0", "minfer=70000", "minfer=8100,vllm=8100",
                                   "minfer=8100,minfer=8200", "minfer", "llama=x"])
def test_bad_ports_are_refused(ports, capsys):
    with pytest.raises(SystemExit) as exc:
        args("--ports", ports)
    assert exc.value.code == 2 and "--ports" in capsys.readouterr().err


def test_out_dir_replaces_json_and_log_dir(capsys):
    assert args("--out-dir", "/tmp/x").out_dir == peer_serve.Path("/tmp/x")
    for extra in (["--json", "/tmp/x.json"], ["--log-dir", "/tmp/logs"]):
        with pytest.raises(SystemExit):
            args("--out-dir", "/tmp/x", *extra)
        assert "--out-dir" in capsys.readouterr().err


def test_llama_server_requests_close_their_connection():
    a = args()
    llama, minfer = peer_serve.SERVERS["llama-q4_1"], peer_serve.SERVERS["minfer-q4_1"]
    assert peer_serve.request_headers(llama) == {"Connection": "close"}
    assert peer_serve.request_headers(minfer) == {} and peer_serve.request_headers(peer_serve.SERVERS["vllm-f32"]) == {}
    bench = peer_serve.vllm_bench_cmd(a, "http://127.0.0.1:8300", 16, "/out", peer_serve.request_headers(llama))
    assert bench[bench.index("--header") + 1] == "Connection=close"
    assert bench[-2:] == ["--header", "Connection=close"]  # last: its nargs="*" takes nothing else
    assert "--header" not in peer_serve.vllm_bench_cmd(a, "http://127.0.0.1:8100", 16, "/out",
                                                        peer_serve.request_headers(minfer))


def test_minfer_client_sends_the_headers_and_keeps_its_result(monkeypatch, tmp_path):
    seen = {}

    def fake_run_benchmark(url, **kw):
        seen.update(kw)
        return {"output_throughput": 10.0, "total_output_tokens": 768, "duration_s": 2.0, "output_lens": [48] * 16}

    monkeypatch.setattr("minfer.bench.serve.run_benchmark", fake_run_benchmark)
    res = peer_serve.run_minfer_client(args(), "http://x", 1, headers={"Connection": "close"}, save_dir=tmp_path / "r")
    assert seen["headers"] == {"Connection": "close"} and seen["result_json"] == str(tmp_path / "r" / "result.json")
    assert res["output_throughput"] == 10.0 and res["duration"] == 2.0 and (tmp_path / "r").is_dir()


def test_minfer_benchmark_client_puts_the_headers_on_every_request(monkeypatch):
    """The header reaches the wire through minfer's client (`benchmark` builds its httpx client with it)."""
    import httpx

    from minfer.bench import serve as bench_serve

    made = []
    real = httpx.AsyncClient

    class Recording(real):
        def __init__(self, *a, **kw):
            made.append(kw.get("headers"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(bench_serve.httpx, "AsyncClient", Recording)
    with pytest.raises(httpx.HTTPError):  # nothing listens there: the client is built, then the first call fails
        bench_serve.run_benchmark("http://127.0.0.1:9", num_prompts=1, input_len=2, output_len=1, poll_stats=False,
                                  disable_tqdm=True, headers={"Connection": "close"}, api_key="k")
    assert made and made[0] == {"Connection": "close", "Authorization": "Bearer k"}


SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
           "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def test_peak_fractions_hold_float_servers_to_fma_and_gguf_ones_to_the_idiom():
    med = peer_serve.medians(CANNED, "client_vllm")
    peaks = {"fma_gflops": 200.0, "int8_idiom_gops": 800.0}
    flops = 2e9  # per request
    fr = peer_serve.peak_fractions(med, peaks, flops, output_len=48)
    # minfer-f32 at c=1: 46 tok/s / 48 tokens per request x 2 GFLOP = 1.9167 GFLOP/s, of the 200 FMA peak
    assert fr["minfer-f32"][1]["achieved_gflops"] == pytest.approx(46 / 48 * 2, abs=1e-3)
    assert fr["minfer-f32"][1]["peak"] == "fma_gflops" and fr["vllm-f32"][16]["peak"] == "fma_gflops"
    assert fr["minfer-f32"][1]["fraction"] == pytest.approx(46 / 48 * 2 / 200, abs=1e-5)
    assert fr["llama-q4_0"][16]["peak"] == fr["minfer-q4_0"][16]["peak"] == "int8_idiom_gops"
    assert fr["minfer-q4_0"][16]["fraction"] == pytest.approx(280 / 48 * 2 / 800, abs=1e-5)
    unknown = peer_serve.peak_fractions(med, {"error": "no compiler"}, flops, 48)
    assert unknown["vllm-f32"][1]["fraction"] is None and unknown["vllm-f32"][1]["achieved_gflops"] > 0
    s = peer_serve.summarize(CANNED, {1: 768, 16: 768}, peaks=peaks, flops_per_request=flops, output_len=48)
    row = next(r for r in s["client_vllm"]["comparisons"] if r["minfer"] == "minfer-q4_0" and r["concurrency"] == 16)
    assert row["minfer_peak_fraction"] == fr["minfer-q4_0"][16]["fraction"]
    assert row["peer_peak_fraction"] == fr["llama-q4_0"][16]["fraction"]
    assert "peak_fractions" not in peer_serve.summarize(CANNED, {1: 768, 16: 768})["client_vllm"]


def test_request_flops_are_serve_rooflines(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    a = args("--model-dir", str(tmp_path), "--input-len", "192", "--output-len", "48")
    roofline = load_benchmark("serve_roofline")
    from minfer.model.registry import config_from_hf

    want = roofline.flops_per_request(config_from_hf(SMOLLM2), 192, 48)["total"]
    assert peer_serve.request_flops(a) == pytest.approx(want) and want > 1e9


def test_peaks_are_read_from_a_file_or_measured(tmp_path, monkeypatch):
    path = tmp_path / "peaks.json"
    path.write_text(json.dumps({"isa": "avx2", "fma_gflops": 100.0, "int8_idiom_gops": 300.0}))
    got = peer_serve.measure_peaks(args("--peaks-json", str(path)))
    assert got["fma_gflops"] == 100.0 and got["source"] == str(path)
    peak_idiom = peer_serve._import_sibling("peak_idiom")
    monkeypatch.setattr(peak_idiom, "measure", lambda threads=None: {"isa": "avx2", "threads": threads,
                                                                     "fma_gflops": 1.0, "int8_idiom_gops": 2.0})
    got = peer_serve.measure_peaks(args("--peak-threads", "3"))
    assert got["threads"] == 3 and got["int8_idiom_gops"] == 2.0 and "measured" in got["source"]

    def broken(threads=None):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(peak_idiom, "measure", broken)
    assert "no compiler" in peer_serve.measure_peaks(args())["error"]


def test_main_writes_everything_under_out_dir(tmp_path, monkeypatch, capsys):
    """A whole run with the servers faked: the JSON, the logs folder and the runs folder land under --out-dir,
    the peaks are measured once, and the fractions are in the summary."""
    import sys
    import types

    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2))
    tools = {name: tmp_path / name for name in ("vllm", "llama-server", "q4_1.gguf", "q4_0.gguf")}
    for p in tools.values():
        p.write_text("")
    monkeypatch.setitem(sys.modules, "peer_vllm_serve", types.SimpleNamespace(ensure_vllm_metadata=lambda v: None))
    monkeypatch.setattr(peer_serve, "environment", lambda a: {"cpu": "test"})
    calls = {"peaks": 0, "starts": []}

    def fake_peaks(a):
        calls["peaks"] += 1
        return {"isa": "avx2", "fma_gflops": 100.0, "int8_idiom_gops": 400.0, "source": "fake"}

    def fake_start(a, rnd, server, slots, concs, log_dir, runs_dir):
        calls["starts"].append((server.name, log_dir, runs_dir))
        tok = {"minfer-q4_1": 60.0, "llama-q4_1": 30.0}[server.name]
        return {c: {"round": rnd, "client_vllm": _res(tok, 100, 10, tokens=a.num_prompts * a.output_len)}
                for c in concs}

    monkeypatch.setattr(peer_serve, "measure_peaks", fake_peaks)
    monkeypatch.setattr(peer_serve, "measure_start", fake_start)
    out = tmp_path / "out"
    rc = peer_serve.main(["--out-dir", str(out), "--servers", "minfer-q4_1,llama-q4_1", "--concurrency", "16",
                          "--rounds", "2", "--num-prompts", "16", "--vllm", str(tools["vllm"]),
                          "--llama-server", str(tools["llama-server"]), "--model-dir", str(model_dir),
                          "--gguf-q4-1", str(tools["q4_1.gguf"]), "--gguf-q4-0", str(tools["q4_0.gguf"])])
    assert rc == 0, capsys.readouterr().out
    assert calls["peaks"] == 1 and len(calls["starts"]) == 4
    assert all(log == str(out / "logs") and runs == out / "runs" for _, log, runs in calls["starts"])
    assert (out / "logs").is_dir() and sorted(p.name for p in out.iterdir()) == ["logs", "peer_serve.json"]
    r = json.loads((out / "peer_serve.json").read_text())
    assert r["machine_peaks"]["fma_gflops"] == 100.0 and r["flops_per_request"] > 1e9
    fr = r["summary"]["client_vllm"]["peak_fractions"]
    assert fr["minfer-q4_1"]["16"]["peak"] == "int8_idiom_gops"
    assert fr["minfer-q4_1"]["16"]["fraction"] == pytest.approx(60 / 48 * r["flops_per_request"] / 1e9 / 400, abs=1e-5)
    (row,) = r["summary"]["client_vllm"]["comparisons"]
    assert row["minfer_peak_fraction"] == pytest.approx(2 * row["peer_peak_fraction"], rel=1e-3)
    assert "% of the int8_idiom_gops peak" in capsys.readouterr().out
