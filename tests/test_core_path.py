"""The closed core (issue 38): what a learner steps through in one greedy `LLM.generate`.

A profiler hook (`sys.setprofile`) records every `minfer` function that runs while a loaded `LLM` on
`kernels="reference"` with default features generates greedily. The files those functions live in are
the per-step path; it must stay small (at most 15 files and 3,500 lines) and its code (comments and
strings aside) must name no feature wing: speculative decoding, grammars, pipeline stages, the hybrid KV
cache, swap or beam search. Those attach from outside through the core's extension points, and act on the
core through a few neutral fields the core defines for any extension (vLLM's names where it has them):
`Sequence.spec_token_ids` (tokens to verify), `ScheduledBatch.token_bitmask` (allowed tokens),
`Sequence.group_block_tables` (more block tables), `ScheduledBatch.kv_transfer` (block moves a preemption
policy asks for), `BlockManager.fork` (shared blocks). The settings
dataclasses `SamplingParams` and `EngineArgs` are excepted from the naming rule: they carry every knob.

    pytest tests/test_core_path.py
"""

from __future__ import annotations

import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "minfer"
SHARED = PKG.parent.parent / "shared" / "models" / "stories260K"

MAX_FILES, MAX_LINES = 15, 3500
FEATURE_WORDS = re.compile(
    r"specul|draft|spec_decode|grammar|guided|structured_output|micro_?batch|pp_rank|pp_size|PPMissingLayer|"
    r"intermediate(?!_size)|hybrid|swap|beam", re.IGNORECASE)
SETTINGS_FILES = {"sampling_params.py", "config.py"}  # SamplingParams / EngineArgs: every knob, by design


def code_tokens(source: str) -> list[tuple[int, str]]:
    """(line, name) of every identifier-like token of `source`, comments and strings left out."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.OP):
            out.append((tok.start[0], tok.string))
    return out


def feature_names(path: Path) -> list[tuple[int, str]]:
    """Identifiers in `path`'s code (not its comments or strings) that name a feature wing."""
    return [(line, s) for line, s in code_tokens(path.read_text()) if FEATURE_WORDS.search(s)]


def record_step_path(llm, prompts, params) -> set[Path]:
    """The minfer files whose functions run during `llm.generate(prompts, params)`."""
    seen: set[str] = set()
    root = str(PKG)

    def hook(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(root):
                seen.add(f)

    sys.setprofile(hook)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        sys.setprofile(None)
    return {Path(f) for f in seen}


def _build_llm(tmp_path):
    from minfer import LLM
    from tests.conftest import default_model_available

    if default_model_available():
        return LLM(max_model_len=256, seed=0, kernels="reference")
    if (SHARED / "stories260K.bin").exists():
        from minfer.model.llama2c import llama2c_to_hf

        path = llama2c_to_hf(SHARED / "stories260K.bin", tmp_path / "stories", SHARED / "tok512.model")
        return LLM(model=str(path), max_model_len=256, seed=0, kernels="reference")
    pytest.skip("neither the default model nor ../shared/models/stories260K is here")


@pytest.fixture(scope="module")
def step_path(tmp_path_factory):
    from minfer import SamplingParams

    llm = _build_llm(tmp_path_factory.mktemp("core_path"))
    params = SamplingParams(temperature=0, max_tokens=8)
    llm.generate(["Once upon a time"], params, use_tqdm=False)  # first-call set-up is not the step
    return record_step_path(llm, ["Once upon a time", "The KV cache holds"], params)


def test_step_path_is_small(step_path):
    rel = sorted(str(p.relative_to(PKG)) for p in step_path)
    lines = sum(len(p.read_text().splitlines()) for p in step_path)
    print(f"per-step path: {len(rel)} files, {lines} lines: {rel}")
    assert len(step_path) <= MAX_FILES and lines <= MAX_LINES, (
        f"the per-step path has {len(rel)} files and {lines} lines (at most {MAX_FILES} and {MAX_LINES}): {rel}")


def test_step_path_names_no_feature(step_path):
    found = {str(p.relative_to(PKG)): feature_names(p) for p in step_path if p.name not in SETTINGS_FILES}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"core files name feature wings: { {k: v[:5] for k, v in found.items()} }"


def test_feature_probe_can_fail(tmp_path):
    """The naming rule sees code, not comments or strings, and it does see code."""
    f = tmp_path / "probe.py"
    f.write_text('"""speculative decoding is a feature."""\n# a draft model\nx = "beam"\n')
    assert feature_names(f) == []
    f.write_text("def step(self):\n    self.draft_model.propose()\n")
    assert feature_names(f) == [(2, "draft_model")]


CORE_FILES = ["llm.py", "engine.py", "scheduler.py", "block_manager.py", "prefix_cache.py", "sequence.py",
              "sampling_params.py", "sampling.py", "worker.py", "model_runner.py", "kv_cache.py", "tokenizer.py",
              "detokenizer.py", "attention/base.py", "model/llama.py", "model/layers.py", "model/positions.py",
              "extensions.py", "kv_cache_plan.py"]


def unannotated(source: str) -> list[str]:
    """Public module-level functions and methods of `source` with a parameter or the return not annotated."""
    import ast

    found = []

    def check(fn, owner=""):
        if fn.name.startswith("_") and fn.name != "__init__":
            return
        params = [a for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
        if any(a.annotation is None for a in params) or (fn.returns is None and fn.name != "__init__"):
            found.append(owner + fn.name)

    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            check(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    check(item, node.name + ".")
    return found


def test_the_cores_public_functions_are_typed():
    missing = {f: unannotated((PKG / f).read_text()) for f in CORE_FILES}
    assert not {f: m for f, m in missing.items() if m}


def test_the_typing_check_can_fail():
    assert unannotated("def f(x) -> int:\n    return x\n") == ["f"]
    assert unannotated("class A:\n    def g(self, y: int):\n        pass\n") == ["A.g"]
    assert unannotated("def _private(x):\n    pass\ndef ok(x: int) -> None:\n    pass\n") == []
