"""Admission control (issue 17, the engine half): what one request may cost the engine, and what it may send.

- stop strings are capped in number and length, and the stop check costs each step only the new characters
  (minfer/sampling_params.py, minfer/detokenizer.py);
- a request with many sequences cannot starve the requests that arrive after it (minfer/scheduler.py);
- a `top_p` that underflows float32 is refused, and the sampler always keeps the top token (sampling.py);
- weights holding NaN or infinities, or of the wrong kind, are refused at load time (model/loader.py);
- NumPy numbers are numbers, and `LLM.chat` takes the messages the server takes (sampling_params.py,
  tokenizer.py).
"""

import random

import numpy as np
import pytest
import torch

from minfer.detokenizer import OutputProcessor, StopMatcher, find_stop, held_back
from minfer.sampling import Sampler, apply_top_k_top_p
from minfer.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from minfer.sequence import Sequence, SequenceStatus
from minfer.tokenizer import normalize_messages
from tests.conftest import needs_default_model
from tests.test_block_manager import sched, step  # a scheduler over blocks of 4 tokens; one step, no model

# -- item 2: stop strings -----------------------------------------------------------------------------------

def test_stop_strings_are_capped_in_number_and_length():
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)  # the limits themselves are fine
    with pytest.raises(ValueError, match=rf"SamplingParams\.stop .*at most {MAX_STOP_STRINGS} strings.*got 10000"):
        SamplingParams(stop=["y" * 300] * 10_000)
    with pytest.raises(ValueError, match=rf"SamplingParams\.stop .*{MAX_STOP_STRING_CHARS} characters.*got 300"):
        SamplingParams(stop=["ok", "y" * 300])
    with pytest.raises(ValueError, match=r"SamplingParams\.stop.*non-empty"):
        SamplingParams(stop=["ok", ""])


def reference_find_stop(text, stops, new_chars):
    """The stop check as it was first written (every stop string searched at every step): the oracle."""
    best = None
    for s in stops:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def reference_held_back(text, stops):
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def random_text(rng, alphabet, length):
    return "".join(rng.choice(alphabet) for _ in range(length))


def random_stops(rng, alphabet, longest, most):
    """1 to `most` stop strings of 1 to `longest` characters: over a small alphabet they overlap a lot."""
    return [random_text(rng, alphabet, rng.randint(1, longest)) for _ in range(rng.randint(1, most))]


def test_stop_matcher_agrees_with_the_plain_search():
    """Random stop strings over a 3-letter alphabet (many overlaps: "aa", "aab", "ab"...) on random texts."""
    rng = random.Random(0)
    for _ in range(400):
        stops = random_stops(rng, "abc", longest=5, most=6)
        text = random_text(rng, "abc", rng.randint(0, 12))
        new = rng.randint(1, max(1, len(text)))
        assert find_stop(text, stops, new) == reference_find_stop(text, stops, new), (text, stops, new)
        assert held_back(text, stops) == reference_held_back(text, stops), (text, stops)


class CharTokenizer:
    """Token id i is the character chr(i): enough for the detokenizer, with no model."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def run_output_processor(params, text, n=1):
    """Generate `text`, one character a token, in n sequences of one request, as the engine steps them."""
    proc = OutputProcessor(CharTokenizer())
    seqs = [Sequence("r", i, [ord(">")], params, max_model_len=100_000) for i in range(n)]
    for ch in text:
        for seq in seqs:
            if not seq.is_finished:
                seq.append_token(ord(ch))
                proc.process(seq)
    return seqs


def test_output_processor_stops_as_the_plain_search_does():
    """Stop strings across token boundaries, held-back tails, include_stop_str_in_output: the same answers."""
    rng = random.Random(1)
    for _ in range(200):
        stops = random_stops(rng, "ab ", longest=4, most=4)
        text = random_text(rng, "ab ", 30)
        keep = rng.random() < 0.5
        params = SamplingParams(max_tokens=1000, stop=stops, include_stop_str_in_output=keep)
        seq = run_output_processor(params, text)[0]
        # What the plain search gives, replayed character by character.
        want, held = text, 0
        for end in range(1, len(text) + 1):
            hit = reference_find_stop(text[:end], stops, 1)
            if hit is not None:
                want = text[:hit[0] + (len(hit[1]) if keep else 0)]
                assert seq.finish_reason == "stop" and seq.stop_reason == hit[1]
                break
            held = reference_held_back(text[:end], stops)
        else:
            assert not seq.is_finished and seq.num_held_chars == held
        assert seq.text == want, (text, stops)


def test_stop_check_reads_each_new_character_once(monkeypatch):
    """64 stop strings of 256 characters and n=4: the matcher is built once for the request, and each step
    feeds it only that step's new characters (so a step costs O(new chars), whatever the stop strings)."""
    built, fed = [], []
    real_init, real_advance = StopMatcher.__init__, StopMatcher.advance

    def init(self, stops):
        built.append(len(stops))
        real_init(self, stops)

    def advance(self, state, chars, base):
        fed.append(len(chars))
        return real_advance(self, state, chars, base)

    monkeypatch.setattr(StopMatcher, "__init__", init)
    monkeypatch.setattr(StopMatcher, "advance", advance)
    rng = random.Random(2)
    stops = [random_text(rng, "xyz", MAX_STOP_STRING_CHARS) for _ in range(MAX_STOP_STRINGS)]
    seqs = run_output_processor(SamplingParams(max_tokens=10_000, stop=stops), "x" * 50 + "yz" * 200, n=4)
    assert all(not s.is_finished and len(s.text) == 450 for s in seqs)
    assert built == [MAX_STOP_STRINGS]
    assert sum(fed) == 4 * 450 and max(fed) == 1


# -- item 4: one request cannot starve the next ----------------------------------------------------------

def seqs_of(rid, count, prompt_len=5, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens)
    return [Sequence(rid, i, list(range(1, prompt_len + 1)), params, max_model_len=4096) for i in range(count)]


def test_a_later_request_is_scheduled_while_a_huge_one_waits():
    """1,000 sequences of one request fill the 8 slots; a request that arrives next runs as soon as a slot
    frees (here within max_tokens steps), not after the 1,000 are all admitted (~500 steps of FCFS)."""
    s, bm = sched(num_blocks=4096, max_num_seqs=8)
    for q in seqs_of("huge", 1000, max_tokens=4):
        s.add(q)
    step(s)
    [small] = seqs_of("small", 1, max_tokens=4)
    s.add(small)
    for steps in range(1, 6):
        if small in step(s).seqs:
            break
    assert small in s.running and steps <= 4, f"the small request waited {steps} steps"
    while s.has_unfinished():  # and everything still finishes
        step(s)
    assert small.finish_reason == "length" and bm.num_free_blocks == bm.num_total_blocks


def test_admission_takes_turns_across_requests():
    """Two requests of 6 sequences and 4 slots: two of each run, not four of the first."""
    s, _ = sched(max_num_seqs=4)
    a, b = seqs_of("a", 6), seqs_of("b", 6)
    for q in a + b:
        s.add(q)
    batch = s.schedule()
    assert sorted(batch.seqs, key=lambda q: (q.request_id, q.index)) == [a[0], a[1], b[0], b[1]]
    assert list(s.waiting) == a[2:] + b[2:]  # the rest wait, each request's in order


def test_one_sequence_requests_stay_first_come_first_served():
    s, _ = sched(max_num_seqs=3)
    singles = [seqs_of(str(i), 1)[0] for i in range(7)]
    for q in singles:
        s.add(q)
    order = []
    while s.has_unfinished():
        order += [q.request_id for q in step(s).seqs if q.request_id not in order]
    assert order == [str(i) for i in range(7)]


def test_a_blocked_request_still_blocks_the_ones_behind_it():
    """Taking turns changes whose turn it is, not the rule that a turn is never skipped when blocks run out."""
    s, _ = sched(num_blocks=5)
    a = seqs_of("a", 1, prompt_len=12)[0]
    b = seqs_of("b", 2, prompt_len=12)
    c = seqs_of("c", 1, prompt_len=2)[0]
    for q in [a, *b, c]:
        s.add(q)
    assert s.schedule().seqs == [a]  # b[0] needs 3 blocks, 2 are left; c waits behind it
    assert a.status is SequenceStatus.RUNNING and list(s.waiting) == [*b, c]


MIB = 1 << 20


@needs_default_model
def test_engine_serves_a_later_request_beside_a_huge_one(llm):
    """The real model: a request with n=32 and 4 slots, then a 4-token request. The second runs in the first
    step, next to the first completion, and gives what it gives alone; the huge request still completes."""
    from minfer import LLM

    small_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate("1, 2, 3,", small_params)[0].outputs[0].token_ids
    busy = LLM(max_model_len=256, seed=0, max_num_seqs=4, kv_cache_memory_bytes=32 * MIB)
    engine = busy.llm_engine
    engine.add_request("huge", "Once upon a time", SamplingParams(n=32, temperature=1.0, seed=3, max_tokens=3,
                                                                   ignore_eos=True))
    engine.add_request("small", "1, 2, 3,", small_params)
    first_token_step, done, steps = None, {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.request_id == "small" and first_token_step is None and out.outputs[0].token_ids:
                first_token_step = steps
            if out.finished:
                done[out.request_id] = out
    assert first_token_step == 1, f"the 4-token request got its first token at step {first_token_step}"
    assert done["small"].outputs[0].token_ids == alone
    assert len(done["huge"].outputs) == 32 and all(len(o.token_ids) == 3 for o in done["huge"].outputs)
    assert engine.all_blocks_free()


# -- item 5: top_p that underflows float32 -------------------------------------------------------------------

@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-39])
def test_top_p_below_float32_range_is_refused(top_p):
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p.*float32"):
        SamplingParams(top_p=top_p)


def test_smallest_float32_top_p_is_greedy():
    tiny = float(torch.finfo(torch.float32).tiny)
    assert SamplingParams(top_p=tiny).top_p == tiny


def test_top_k_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [1.0, 1.0, 0.0, -2.0]])
    for top_p in (0.0, 1e-30):  # 0.0: what a top_p below float32's range became
        out = apply_top_k_top_p(logits, None, torch.tensor([top_p, top_p]))
        assert out.argmax(dim=-1).tolist() == [1, 0]
        assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 1]


def test_sampler_with_a_vanished_top_p_picks_the_argmax():
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    params.top_p = 1e-300  # as SamplingParams accepted before it checked float32's range
    seqs = [Sequence("r", i, [1], params, max_model_len=16) for i in range(2)]
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [4.0, 0.0, 1.0, 3.0]])
    tokens, _, _ = Sampler(torch.Generator().manual_seed(0))(logits, seqs)
    assert tokens.tolist() == [2, 0]


# -- item 13: weights are checked at load time ---------------------------------------------------------------

class TinyModel(torch.nn.Module):
    """A float weight and an integer parameter (a quantized method's codes), with no tied embedding."""

    class config:
        tie_word_embeddings = False

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=dtype), requires_grad=False)
        self.codes = torch.nn.Parameter(torch.zeros(4, dtype=torch.int8), requires_grad=False)


def test_integer_codes_and_finite_floats_load():
    from minfer.model.loader import load_weights

    model = TinyModel()
    load_weights(model, [("scale", torch.tensor([1.0, 2.0, 3.0, 4.0])),
                         ("codes", torch.tensor([1, -2, 3, -4], dtype=torch.int8))], "ckpt")
    assert model.codes.tolist() == [1, -2, 3, -4] and model.scale.tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(bad):
    from minfer.model.loader import load_weights

    scale = torch.tensor([1.0, bad, 3.0, 4.0])
    with pytest.raises(ValueError, match=r"ckpt: checkpoint tensor 'scale' holds NaN or infinite values"):
        load_weights(TinyModel(), [("scale", scale), ("codes", torch.zeros(4, dtype=torch.int8))], "ckpt")


def test_weights_that_overflow_the_model_dtype_are_refused():
    from minfer.model.loader import load_weights

    big = torch.tensor([1.0, 1e5, 3.0, 4.0], dtype=torch.bfloat16)  # finite in bfloat16, inf in float16
    with pytest.raises(ValueError, match=r"ckpt: scale: .*float16"):
        load_weights(TinyModel(torch.float16), [("scale", big), ("codes", torch.zeros(4, dtype=torch.int8))], "ckpt")


@pytest.mark.parametrize("case", ["nan", "int32-norm"])
def test_bad_checkpoint_fails_to_load(tmp_path, case):
    from safetensors.torch import load_file, save_file

    from minfer.model.loader import load_model
    from tests.test_llama import make_hf_model

    make_hf_model(tmp_path, "LlamaConfig", {})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if case == "nan":
        tensors["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
        match = r"'model.layers.1.self_attn.k_proj.weight' holds NaN"
    else:
        tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.int32)
        match = r"model.norm.weight: dtype mismatch.*int32"
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_model(str(tmp_path))


# -- item 14: one rule for numbers and for chat messages -----------------------------------------------------

def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    p = SamplingParams(n=np.int64(2), seed=np.int64(7), temperature=np.float32(0.5), top_p=np.float64(0.9),
                       top_k=np.int32(5), min_p=np.float32(0.25), max_tokens=np.int64(4), logprobs=np.int16(2),
                       stop_token_ids=[np.int64(3)])
    assert (p.n, p.seed, p.top_k, p.max_tokens, p.logprobs, p.stop_token_ids) == (2, 7, 5, 4, 2, [3])
    assert p.temperature == 0.5 and p.top_p == 0.9 and p.min_p == 0.25
    for name in ("n", "seed", "top_k", "max_tokens", "logprobs"):
        assert type(getattr(p, name)) is int, name
    assert type(p.stop_token_ids[0]) is int
    for name in ("temperature", "top_p", "min_p"):
        assert type(getattr(p, name)) is float, name
    assert p.clone(max_tokens=np.int64(5)).max_tokens == 5


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=np.bool_(True)), "n"), (dict(n=2.0), "n"), (dict(seed=np.float64(3)), "seed"),
    (dict(temperature=np.bool_(False)), "temperature"), (dict(top_p="0.5"), "top_p"),
    (dict(stop_token_ids=[np.float32(3)]), "stop_token_ids"), (dict(max_tokens=np.float32(4)), "max_tokens"),
])
def test_non_numbers_are_still_refused(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_normalize_messages_rules():
    assert normalize_messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
    assert normalize_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]
    parts = [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": parts, "name": "x"}]) == [{"role": "user",
                                                                                      "content": "a b"}]
    for bad, match in [([], "non-empty list"), ("hi", "non-empty list"), ([{"content": "x"}], r"messages\[0\].*role"),
                       ([{"role": "user"}], r"messages\[0\].*content"),
                       ([{"role": "user", "content": "x"}, {"role": "user", "content": 3}], r"messages\[1\]\.content"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts")]:
        with pytest.raises(ValueError, match=match):
            normalize_messages(bad)


def test_server_uses_the_same_message_rule():
    from minfer.serve.protocol import APIError
    from minfer.serve.protocol import normalize_messages as server_normalize

    msgs = [{"role": "system", "content": None}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert server_normalize(msgs) == normalize_messages(msgs)
    with pytest.raises(APIError) as err:
        server_normalize([{"role": "user", "content": 3}])
    assert err.value.status == 400 and err.value.param == "messages" and "messages[0].content" in err.value.message


@needs_default_model
def test_chat_takes_null_content_and_text_parts(llm):
    plain = [{"role": "system", "content": ""}, {"role": "user", "content": "Name a colour."}]
    other = [{"role": "system", "content": None},
             {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    assert llm.tokenizer.encode_chat(other) == llm.tokenizer.encode_chat(plain)
    params = SamplingParams(temperature=0, max_tokens=3)
    assert llm.chat(other, params)[0].outputs[0].token_ids == llm.chat(plain, params)[0].outputs[0].token_ids
