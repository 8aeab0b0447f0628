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
    assert c1["met"] is True  # 1.84x, TTFT equal, TPOT better
    c16 = rows["minfer-f32", 16]
    assert c16["throughput_ratio"] == pytest.approx(160 / 180, abs=1e-3) and c16["met"] is False
    assert rows["minfer-q4_0", 1]["met"] is None  # llama-server's target is at 16 and 64 only
    q16 = rows["minfer-q4_0", 16]
    assert q16["throughput_ratio"] == pytest.approx(280 / 150, abs=1e-3) and q16["met"] is True


def test_the_vllm_target_needs_ttft_and_tpot_no_worse():
    runs = _runs({"minfer-f32": {16: [(300, 1100, 50)]}, "vllm-f32": {16: [(200, 1000, 60)]}})
    (row,) = peer_serve.compare(peer_serve.medians(runs, "client_vllm"))
    assert row["throughput_ratio"] == 1.5 and row["ttft_ratio"] == 1.1 and row["met"] is False


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
