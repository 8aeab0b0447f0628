"""The offline `LLM` under several callers and many prompts (issue 28): two threads sharing one `LLM` each get
their own, correct answers (calls are serialised by the LLM's lock), and one 5,000-prompt `generate` with a
progress bar finishes with every KV block free. stories260K (../shared) keeps it to seconds; skips without it."""

from __future__ import annotations

import io
import threading

import pytest

from tests.conftest import SHARED

STORIES = SHARED / "models" / "stories260K"
pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"{STORIES} is not here")


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from minfer import LLM
    from minfer.model.llama2c import llama2c_to_hf

    path = llama2c_to_hf(STORIES / "stories260K.bin", tmp_path_factory.mktemp("stories"), STORIES / "tok512.model")
    llm = LLM(model=str(path), max_model_len=256, kv_cache_memory_bytes=1 << 24, device="cpu", seed=0)
    yield llm
    del llm


def _prompts(n: int, offset: int = 0) -> list[list[int]]:
    """Distinct short token-id prompts (BOS, then two ids from the 512-piece vocabulary)."""
    return [[1, 3 + (i + offset) % 500, 3 + (7 * (i + offset)) % 500] for i in range(n)]


def test_two_threads_share_one_llm(tiny_llm):
    from minfer import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {k: [o.outputs[0].token_ids for o in tiny_llm.generate(_prompts(40, 100 * k), sp)] for k in range(2)}
    got, errors = {}, []

    def worker(k):
        try:
            for _ in range(3):
                outs = tiny_llm.generate(_prompts(40, 100 * k), sp)
                got.setdefault(k, []).append([o.outputs[0].token_ids for o in outs])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for k in range(2):
        assert got[k] == [want[k]] * 3, f"thread {k} got another thread's or a wrong answer"
    assert tiny_llm.llm_engine.all_blocks_free() and not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.slow
def test_5000_prompt_generate_finishes_with_a_progress_bar(tiny_llm, monkeypatch):
    import minfer.llm as llm_module
    from minfer import SamplingParams

    bars, files = [], []
    real_tqdm = llm_module.tqdm

    def recording_tqdm(*args, **kwargs):
        files.append(io.StringIO())
        bar = real_tqdm(*args, file=files[-1], **kwargs)
        bars.append(bar)
        return bar

    monkeypatch.setattr(llm_module, "tqdm", recording_tqdm)
    prompts = _prompts(5000)
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=True)
    assert len(outs) == 5000
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts  # in prompt order
    assert bars and bars[0].n == 5000 and bars[0].total == 5000
    assert "5000/5000" in files[0].getvalue()  # the bar was drawn, up to the last prompt
    assert tiny_llm.llm_engine.all_blocks_free()
