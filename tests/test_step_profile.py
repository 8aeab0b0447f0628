"""`benchmarks/step_profile.py`'s folding of py-spy raw stacks into categories, on small synthetic inputs (no
server, no py-spy)."""

import pytest

from tests.benchmark_scripts import load_benchmark

sp = load_benchmark("step_profile")

ENGINE = ("thread (1): MainThread;<module> (<string>:1);core_main (minfer/serve/engine_core.py:451);"
          "EngineCore.run (minfer/serve/engine_core.py:383)")
STEP = ENGINE + ";LLMEngine.step (minfer/engine.py:259);ModelRunner.execute_model (minfer/model_runner.py:86)"
FORWARD = STEP + (";ModelRunner.compute_logits (minfer/model_runner.py:121);ModelRunner.run_model "
                  "(minfer/model_runner.py:133);CpuDecodeStep.run (minfer/cpu/decode_step.py:299);"
                  "minfer_decode_layers (minfer_decode_layers_cpu_1.so)")
RAW = "\n".join([
    FORWARD + ";gemm.isra.0 (minfer_decode_layers_cpu_1.so);minfer_gemm_f32 (minfer_gemm_f32_cpu_2.so) 40",
    FORWARD + ";minfer_paged_decode_f32 (minfer_paged_decode_cpu_3.so);GOMP_parallel (libgomp.so.1) 20",
    FORWARD + ";minfer_silu_and_mul_f32 (minfer_fused_cpu_4.so) 10",
    STEP + ";ModelRunner.prepare_inputs (minfer/model_runner.py:50);torch::autograd::THPVariable_repeat_interleave "
           "(libtorch_python.so);at::native::repeat_interleave_cpu (libtorch_cpu.so) 5",
    STEP + ";ModelRunner._sample (minfer/model_runner.py:104);Sampler.__call__ (minfer/sampling.py:227);"
           "at::native::argmax_kernel (libtorch_cpu.so) 3",
    ENGINE + ";LLMEngine.step (minfer/engine.py:250);Scheduler.schedule (minfer/scheduler.py:218) 2",
    ENGINE + ";EngineCore._send (minfer/serve/engine_core.py:230);Socket.send (zmq/sugar/socket.py:713) 4",
    # the forward's Python around a torch op is element-wise; its own Python alone is forward_py
    STEP + ";ModelRunner.compute_logits (minfer/model_runner.py:121);LlamaModel.embed (minfer/model/llama.py:80);"
           "at::native::index (libtorch_cpu.so) 6",
    STEP + ";ModelRunner.compute_logits (minfer/model_runner.py:121);Linear.forward (minfer/model/layers.py:10) 1",
    # waits are idle, not busy
    "thread (2): minfer-engine-heartbeat;Heartbeat.run (minfer/serve/engine_core.py:151);Event.wait "
    "(threading.py:629);lock_PyThread_acquire_lock (libpython3.11.so.1.0);PyThread_acquire_lock_timed "
    "(libpython3.11.so.1.0);0x7f59 (libc.so.6) 50",
    "thread (1): MainThread;mystery (somewhere.py:1) 9",
    "not a stack line",
])


def test_parse_raw_splits_thread_frames_and_count():
    stacks = sp.parse_raw("thread (7): MainThread;a (x.py:1);b (y.so) 12\nbroken line\n")
    assert stacks == [("thread (7): MainThread", ["a (x.py:1)", "b (y.so)"], 12)]


def test_fold_categories_seconds_and_shares():
    out = sp.fold(RAW, "minfer", rate=10)
    cats = {c: v["samples"] for c, v in out["categories"].items()}
    assert cats == {"gemm": 40, "attention": 20, "elementwise": 16, "prepare": 5, "sample": 3, "schedule": 2,
                    "ipc": 4, "forward_py": 1, "other": 9, "detokenize": 0, "http": 0}
    assert out["samples"] == 100 and out["busy_s"] == pytest.approx(10.0) and out["idle_s"] == pytest.approx(5.0)
    assert out["categories"]["gemm"]["s"] == pytest.approx(4.0) and out["categories"]["gemm"]["share"] == 0.4
    assert sum(v["share"] for v in out["categories"].values()) == pytest.approx(1.0)
    assert out["threads"] == {"MainThread": pytest.approx(10.0)}  # the heartbeat only waited
    assert out["other_top_leaves"] == [["mystery (somewhere.py:1)", 9]]  # what no pattern names stays visible


def test_innermost_kernel_wins_over_its_context():
    rules = sp.compile_patterns("vllm")
    attn = ["LlamaAttention.forward (vllm/model_executor/models/llama.py:1)",
            "cpu_attention::AttentionMainLoop (cpu_attn.cpp:277)", "gemm_micro<4> (cpu_attn_vec.hpp:121)"]
    assert sp.categorize(attn, rules) == "attention"  # its gemm_micro is the attention kernel's own
    proj = ["LlamaAttention.forward (vllm/model_executor/models/llama.py:1)", "onednn_mm (vllm/_custom_ops.py:1)",
            "dnnl::impl::cpu::x64::matmul::brgemm_matmul_t (vllm/_C.abi3.so)"]
    assert sp.categorize(proj, rules) == "gemm"  # a projection called from the attention module is a GEMM
    spin = ["MessageQueue.acquire_read (vllm/distributed/device_communicators/shm_broadcast.py:1)",
            "sched_yield (vllm/distributed/utils.py:46)", "sched_yield (libc.so.6)"]
    assert sp.categorize(spin, rules) == "ipc"  # a spin-wait burns CPU: busy, not idle


def test_every_table_names_known_categories():
    for engine, table in sp.PATTERNS.items():
        for cat, kind, _ in table:
            assert kind in ("kernel", "context") and (cat in sp.CATEGORIES or cat == "forward"), (engine, cat)
