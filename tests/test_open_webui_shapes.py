"""Open WebUI's request shapes against the default model (issue 42), and the two rules they rest on.

Open WebUI (0.12) attaches its 36 built-in tools (`tests/data/open_webui_tools.json`: get_current_timestamp,
search_memories, write_note, ...) to every chat sent from its UI, without `tool_choice`, and sends its
background tasks (titles, tags, follow-ups) without `max_tokens`. So:

- the tool prompt rule (`minfer/serve/tools.py`, `--tool-prompt`): under the default `template`, as vLLM, a
  template that ignores tools (SmolLM2's) adds nothing for tool_choice unset / "auto", so the chat's prompt
  stays within max(500, 2 x the same chat without tools) tokens, while "required" and a named function keep
  minfer's tool prompt for their guided call; under `minfer` the "auto" tool prompt is written within
  `--tool-prompt-max-tokens`, and over it the chat is served without it (a warning logged);
- the generation-config defaults (`--generation-config`, `--override-generation-config`, vLLM's): a request
  that omits max_tokens (max_output_tokens) gets `max_new_tokens`, one that sets it keeps its own, on
  /v1/chat/completions, /v1/completions and /v1/responses, and `LLM.generate` without SamplingParams too.

The server is the real two-process `python -m minfer.serve` on the GGUF, started with
`--override-generation-config '{"max_new_tokens": 48, "temperature": 0}'`; the `--tool-prompt minfer` cases
run in-process on the shared `llm` engine.

    PYTHONPATH=$PWD python -m pytest -q tests/test_open_webui_shapes.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from minfer.config import EngineArgs, diff_sampling_param, parse_override_generation_config
from minfer.serve.tools import parse_tools, tool_prompt_text, writes_tool_prompt

from .conftest import needs_default_model

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m-instruct"
MAX_NEW_TOKENS = 48
OVERRIDE = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}  # the server's --override-generation-config
TOOLS = json.loads((Path(__file__).parent / "data" / "open_webui_tools.json").read_text())
# A UI chat as Open WebUI sends it: its system prompt, the user's message, every built-in tool, no tool_choice
CHAT = {"model": MODEL, "stream": False, "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi! Can you give me a one-line tip for learning Python?"}]}
# A background task as Open WebUI sends it (its title-generation template): no max_tokens
TITLE_TASK = {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": (
    "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
    "### Guidelines:\n- The title should clearly represent the main theme or subject of the conversation.\n"
    "- Write the title in the chat's primary language.\n### Output:\nJSON format: { \"title\": \"your concise "
    "title here\" }\n### Chat History:\n<chat_history>\nUSER: Hi! Can you give me a one-line tip for learning "
    "Python?\nASSISTANT: Practice a little every day.\n</chat_history>")}]}


def test_the_fixture_is_open_webuis_36_tools_and_would_swamp_the_prompt(llm):
    """36 distinct function tools, and minfer's tool prompt for them thousands of tokens: the size the bound
    below guards against (6,566 with Open WebUI's own descriptions)."""
    req = parse_tools({"tools": TOOLS})
    assert len(req.functions) == 36 and req.choice == "auto"
    assert len(llm.tokenizer.encode(tool_prompt_text(req), add_special_tokens=False)) > 2000


def test_when_minfer_writes_its_tool_prompt():
    """The module's table: only for a template that ignores tools; forced choices always, "auto" only under
    `minfer`; an unknown mode is refused."""
    auto, required = parse_tools({"tools": TOOLS}), parse_tools({"tools": TOOLS, "tool_choice": "required"})
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "write_note"}}})
    for req, template, minfer in ((auto, False, True), (required, True, True), (named, True, True)):
        assert writes_tool_prompt(req, native=False, mode="template") is template
        assert writes_tool_prompt(req, native=False, mode="minfer") is minfer
        assert not writes_tool_prompt(req, native=True, mode="minfer")
    with pytest.raises(ValueError, match="template, minfer"):
        writes_tool_prompt(auto, native=False, mode="always")


# -- the real server, default flags but the generation config --------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from .serving import running_server

    with running_server(["--max-model-len", "2048", "--disable-log-requests", "--uvicorn-log-level", "warning",
                         "--override-generation-config", json.dumps(OVERRIDE)]) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    """The default model's tokenizer alone (no weights): what the server counts prompt tokens with."""
    from minfer.model.gguf import gguf_cache_path
    from minfer.model.sources import resolve_model
    from minfer.tokenizer import load_tokenizer

    source = resolve_model(MODEL)
    return load_tokenizer(source, (), cache_dir=gguf_cache_path(source.path) / "tokenizer")


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@needs_default_model
def test_a_ui_chat_with_36_tools_and_no_tool_choice_is_the_size_of_the_chat(server):
    plain = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2})["usage"]["prompt_tokens"]
    tooled = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "tools": TOOLS})
    assert tooled["usage"]["prompt_tokens"] <= max(500, 2 * plain), (plain, tooled["usage"])
    assert tooled["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")


@needs_default_model
def test_a_forced_tool_choice_still_gets_its_guided_call(server, tokenizer):
    """"required" / a named function keep minfer's tool prompt (the call needs the tools' descriptions):
    its prompt holds the tools, and the answer is a valid call."""
    plain = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2})["usage"]["prompt_tokens"]
    forced = {**CHAT, "tools": TOOLS[:10], "temperature": 0, "max_tokens": 60,  # up to write_note: a short prefill
              "tool_choice": {"type": "function", "function": {"name": "write_note"}}}
    shown = len(tokenizer.encode(tool_prompt_text(parse_tools(forced)), add_special_tokens=False))
    r = _post(server, "/v1/chat/completions", forced)
    assert r["usage"]["prompt_tokens"] >= plain + shown - 4, (plain, shown, r["usage"])
    call = r["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "write_note"


@needs_default_model
def test_a_background_task_without_max_tokens_gets_the_servers_default(server):
    r = _post(server, "/v1/chat/completions", TITLE_TASK)  # as Open WebUI sends it
    assert r["usage"]["completion_tokens"] <= MAX_NEW_TOKENS, r["usage"]
    # With EOS ignored the default is what ends it: exactly max_new_tokens, not max_model_len
    r = _post(server, "/v1/chat/completions", {**TITLE_TASK, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS and r["choices"][0]["finish_reason"] == "length"
    # A request that sets max_tokens keeps its own value, above the default too
    for field in ("max_tokens", "max_completion_tokens"):
        r = _post(server, "/v1/chat/completions", {**TITLE_TASK, "ignore_eos": True, field: MAX_NEW_TOKENS + 12})
        assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS + 12, (field, r["usage"])
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == MAX_NEW_TOKENS, r["usage"]
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True,
                                          "max_tokens": 5})
    assert r["usage"]["completion_tokens"] == 5, r["usage"]


@needs_default_model
def test_an_omitted_temperature_is_the_servers_and_a_given_one_is_kept(server):
    """The override's temperature 0: requests without one are greedy (the same text each time, the text of
    an explicit temperature 0); one that sets temperature 1 samples (two seeds, two texts)."""
    body = {**TITLE_TASK, "ignore_eos": True, "max_tokens": 24}
    texts = [_post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"] for _ in range(2)]
    greedy = _post(server, "/v1/chat/completions", {**body, "temperature": 0})["choices"][0]["message"]["content"]
    assert texts == [greedy, greedy]
    sampled = {_post(server, "/v1/chat/completions", {**body, "temperature": 1.0, "seed": seed})["choices"][0][
        "message"]["content"] for seed in (1, 2)}
    assert len(sampled) == 2 and greedy not in sampled


@needs_default_model
def test_responses_without_max_output_tokens_get_the_servers_default(server):
    body = {"model": MODEL, "temperature": 0, "store": False,
            "input": "Count from 1 to 200, separated by commas: 1, 2, 3,"}
    r = _post(server, "/v1/responses", body)
    assert r["usage"]["output_tokens"] == MAX_NEW_TOKENS and r["status"] == "incomplete", r["usage"]
    r = _post(server, "/v1/responses", {**body, "max_output_tokens": MAX_NEW_TOKENS + 12})
    assert r["usage"]["output_tokens"] == MAX_NEW_TOKENS + 12, r["usage"]


# -- --tool-prompt minfer, in-process ----------------------------------------------------------------------------
@pytest.fixture
def minfer_mode(llm):  # one app at a time on the shared engine: two engine loops must not step it together
    from fastapi.testclient import TestClient

    from minfer.serve.routes import build_app

    with TestClient(build_app(llm.llm_engine, served_model_names=[MODEL], log_requests=False,
                              tool_prompt="minfer")) as c:
        yield c


def _prompt_tokens(client, body: dict) -> int:
    r = client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_minfer_mode_shows_few_tools_and_drops_too_many_with_a_warning(minfer_mode, llm, caplog):
    plain = _prompt_tokens(minfer_mode, CHAT)
    few = parse_tools({"tools": TOOLS[:2]})
    few_text = len(llm.tokenizer.encode(tool_prompt_text(few), add_special_tokens=False))
    assert _prompt_tokens(minfer_mode, {**CHAT, "tools": TOOLS[:2]}) >= plain + few_text - 4  # under the budget
    with caplog.at_level(logging.WARNING, logger="minfer.serve"):
        assert _prompt_tokens(minfer_mode, {**CHAT, "tools": TOOLS}) == plain  # over it: not shown
    assert any("--tool-prompt-max-tokens 1024" in r.getMessage() for r in caplog.records)


def test_minfer_mode_budget_is_a_setting(llm):
    from fastapi.testclient import TestClient

    from minfer.serve.routes import build_app

    few = parse_tools({"tools": TOOLS[:2]})
    few_text = len(llm.tokenizer.encode(tool_prompt_text(few), add_special_tokens=False))
    with TestClient(build_app(llm.llm_engine, served_model_names=[MODEL], log_requests=False,
                              tool_prompt="minfer", tool_prompt_max_tokens=few_text - 1)) as c:
        assert _prompt_tokens(c, {**CHAT, "tools": TOOLS[:2]}) == _prompt_tokens(c, CHAT)
        # a forced choice keeps its tool prompt whatever the budget
        forced = {**CHAT, "tools": TOOLS[:2], "tool_choice": "required"}
        forced_text = len(llm.tokenizer.encode(tool_prompt_text(parse_tools(forced)), add_special_tokens=False))
        assert forced_text >= few_text - 20
        assert _prompt_tokens(c, forced) >= _prompt_tokens(c, CHAT) + forced_text - 4
    for bad in ({"tool_prompt": "always"}, {"tool_prompt_max_tokens": 0}):
        with pytest.raises(ValueError):
            build_app(llm.llm_engine, log_requests=False, **bad)


# -- the generation config ---------------------------------------------------------------------------------------
def test_generation_config_is_read_as_vllm_reads_it(tmp_path):
    """"auto": the file's sampling fields that differ from transformers' defaults, max_new_tokens as
    max_tokens; "vllm": none; a directory: its file; the override over it; none: {}."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "do_sample": True,
         "repetition_penalty": 1.0, "max_new_tokens": 300}))
    assert diff_sampling_param(tmp_path, "auto") == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 300}
    assert diff_sampling_param(tmp_path, "vllm") == {}
    assert diff_sampling_param(None, str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 300}
    over = parse_override_generation_config('{"max_new_tokens": 48, "top_k": 50, "repetition_penalty": 1.1}')
    assert diff_sampling_param(tmp_path, "auto", over) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50,
                                                          "repetition_penalty": 1.1, "max_tokens": 48}
    assert diff_sampling_param(tmp_path, "vllm", over) == {"top_k": 50, "repetition_penalty": 1.1, "max_tokens": 48}
    assert diff_sampling_param(tmp_path / "nothing", "auto") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        diff_sampling_param(None, str(tmp_path / "nothing"))
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match="top_p"):
        diff_sampling_param(tmp_path, "auto")


@pytest.mark.parametrize("bad, words", [
    ("{max_new_tokens: 48}", "not valid JSON"), ("[48]", "JSON object"), ('{"max_tokens": 48}', "unknown field"),
    ('{"max_new_tokens": 0}', "max_new_tokens"), ('{"temperature": -1}', "temperature")])
def test_a_bad_override_is_refused_at_start_up(bad, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(override_generation_config=bad)
    from minfer.serve.__main__ import main

    assert main(["--override-generation-config", bad]) == 2


def test_help_says_what_an_omitted_field_gets():
    from minfer.serve.__main__ import build_parser

    text = " ".join(build_parser().format_help().split())
    for words in ("A request that omits max_tokens", "a request that sets one keeps its own",
                  "--override-generation-config JSON", "--tool-prompt {template,minfer}"):
        assert words in text, words


def test_the_offline_llm_takes_the_generation_config_beside_a_gguf(tmp_path, llm, monkeypatch):
    """"auto" reads the generation_config.json beside a .gguf file (`ModelSource.directory`), and
    `LLM.generate` without SamplingParams uses `get_default_sampling_params`, as vLLM's LLM: the engine's
    defaults, the override over the file."""
    from minfer import SamplingParams
    from minfer.model.sources import find_default_gguf, resolve_model

    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(find_default_gguf())
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 7}))
    source = resolve_model(str(gguf))
    assert source.directory == tmp_path and resolve_model(str(tmp_path)).directory == tmp_path
    defaults = diff_sampling_param(source.directory, "auto", {"max_new_tokens": 5})
    assert llm.llm_engine.default_sampling_params == {}  # the shipped GGUF has no generation_config.json
    monkeypatch.setattr(llm.llm_engine, "default_sampling_params", defaults)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    out = llm.generate("Count from 1 to 100: 1, 2, 3,")[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert len(llm.generate("Count from 1 to 100: 1, 2, 3,", SamplingParams(max_tokens=9))[0].outputs[0].token_ids) == 9
