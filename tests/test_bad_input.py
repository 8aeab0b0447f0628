"""Bad input gets a clear error and loses nothing (engine.py, llm.py, config.py, sampling_params.py).

Each case found by trying to break minfer; after every failure no request is left queued and no KV block
is held, and the next good request works.
"""

import pytest

from minfer import SamplingParams
from minfer.config import EngineArgs


def assert_clean(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=10 ** 9), "n"), (dict(n=True), "n"), (dict(logprobs=10 ** 6), "logprobs"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(stop=5), "stop"), (dict(stop_token_ids=5), "stop_token_ids"), (dict(max_tokens=True), "max_tokens"),
    (dict(seed=True), "seed"), (dict(seed=2 ** 64), "seed"), (dict(top_p=True), "top_p"), (dict(top_k=True), "top_k"),
    (dict(min_p=False), "min_p"),
    # booleans are checked, not coerced: "no" is truthy, and reached the detokenizer (failing the whole batch)
    (dict(skip_special_tokens="no"), "skip_special_tokens"), (dict(ignore_eos="no"), "ignore_eos"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"), (dict(ignore_eos=None), "ignore_eos"),
])
def test_sampling_params_bounds(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boolean_fields_take_real_booleans_only():
    import numpy as np

    from minfer import BeamSearchParams

    p = SamplingParams(ignore_eos=np.bool_(True), skip_special_tokens=False)
    assert p.ignore_eos is True and p.skip_special_tokens is False  # NumPy's bool stored as Python's
    for name in ("ignore_eos", "include_stop_str_in_output"):
        with pytest.raises(ValueError, match=f"BeamSearchParams.{name} must be a boolean"):
            BeamSearchParams(beam_width=2, max_tokens=3, **{name: "no"})


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=None), "seed"), (dict(seed=2 ** 64), "seed"), (dict(block_size=16.0), "block_size"),
    (dict(kv_cache_memory_bytes="64M"), "kv_cache_memory_bytes"), (dict(swap_space=float("nan")), "swap_space"),
    (dict(max_num_seqs=1.5), "max_num_seqs"), (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(max_model_len=0), "max_model_len"), (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype"),
    (dict(kv_cache_dtype="float16", attention_backend="cpu"), "cpu"), (dict(quantization="bitsandbytes"), "not built"),
    (dict(attention_backend="flash"), "attention_backend"), (dict(attention_backend="cpu", dtype="float16"), "float32 or bfloat16"),
])
def test_engine_args_checked_before_loading(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("prompt", [None, 3.5, b"bytes", [1, "2"], [True, 2], {"text": "x"}, [[1, 2]]])
def test_bad_prompt_types(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert_clean(llm)


def test_vllm_dict_prompts(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=4)
    a = llm.generate([{"prompt": "The capital of France is"}], params)[0]
    b = llm.generate([{"prompt_token_ids": ids}], params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids
    # One dict on its own is one prompt, not a list of its keys.
    c = llm.generate({"prompt": "The capital of France is"}, params)
    assert len(c) == 1 and c[0].prompt_token_ids == ids and c[0].outputs[0].token_ids == a.outputs[0].token_ids
    # A tuple of ids is one prompt like a list; a dict with both keys runs the ids and keeps the text.
    d = llm.generate(tuple(ids), params)
    e = llm.generate({"prompt": "The capital of France is", "prompt_token_ids": ids}, params)[0]
    assert len(d) == 1 and d[0].outputs[0].token_ids == a.outputs[0].token_ids
    assert e.prompt == "The capital of France is" and e.outputs[0].token_ids == a.outputs[0].token_ids
    # The simple path takes the same prompt forms.
    f, _ = llm.generate_simple({"prompt_token_ids": ids}, params)
    assert f.outputs[0].token_ids == a.outputs[0].token_ids
    # NumPy integer ids (e.g. from a tokenizer's numpy output) are plain token ids.
    import numpy as np

    g = llm.generate([np.array(ids, dtype=np.int64).tolist(), list(np.array(ids, dtype=np.int32))], params)
    assert all(o.prompt_token_ids == ids and o.outputs[0].token_ids == a.outputs[0].token_ids for o in g)


@pytest.mark.parametrize("prompts", [None, 5, b"bytes", 3.5])
def test_prompts_argument_of_the_wrong_type(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert_clean(llm)


def test_bad_sampling_params_object_queues_nothing(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), {"temperature": 0}])
    assert_clean(llm)


def test_error_inside_a_step_leaves_nothing_behind(llm, monkeypatch):
    worker = llm.llm_engine.worker

    def boom(batch):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(worker, "execute_model", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["one", "two"], SamplingParams(max_tokens=4))
    monkeypatch.undo()
    assert_clean(llm)


def test_chat_needs_a_list(llm):
    with pytest.raises(ValueError, match="non-empty list"):
        llm.chat({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}])
    assert_clean(llm)


def test_max_model_len_beyond_the_model(llm):
    from minfer import LLM

    with pytest.raises(ValueError, match=r"max_model_len=16384 is longer than the model's limit \(8192"):
        LLM(max_model_len=16384)
    with pytest.raises(ValueError, match="memory"):
        LLM(max_model_len=256, kv_cache_memory_bytes=10 ** 15)


def test_tokenizer_argument_is_used(tmp_path):
    from minfer import LLM
    from minfer.model.sources import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="nonexistent"):
        LLM(max_model_len=256, kv_cache_memory_bytes=16 << 20, tokenizer=str(tmp_path / "nonexistent"))


# `python -m minfer.bench engine`: bad arguments stop at once with argparse's usage error (exit 2), before the
# default model is looked up or any run starts; --quantization-config is checked as `LLM` checks it.
@pytest.mark.parametrize("argv,needle", [
    (["--num-requests", "0"], "--num-requests"),
    (["--num-requests", "-3"], "--num-requests"),
    (["--quantization", "int4", "--quantization-config", "{bad"], "not valid JSON"),
    (["--quantization", "int4", "--quantization-config", "[1]"], "JSON object"),
    (["--quantization", "int4", "--quantization-config", '{"group_size":7}', "--quick"], "group_size"),
    (["--quantization", "int8", "--quantization-config", '{"group_size":64}'], "int4 only"),
    (["--quantization", "int8", "--quantization-config", "[1]"], "int4 only"),
    (["--quantization-config", '{"group_size":64}'], "needs --quantization"),
])
def test_bench_engine_rejects_bad_arguments_up_front(argv, needle, capsys, monkeypatch):
    from minfer.bench import engine as B
    from minfer.model import sources

    def no_run(*a, **k):
        raise AssertionError("the benchmark ran despite bad arguments")

    monkeypatch.setattr(sources, "find_default_gguf", no_run)
    monkeypatch.setattr(B, "run_quant_throughput", no_run)
    monkeypatch.setattr(B, "run_all", no_run)
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
