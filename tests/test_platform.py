"""The platform seam (minfer/platform.py): `kernels="reference"` is the path the chapters teach (every decode
step through `LlamaDecoderLayer.forward`, no C++ library loaded), `kernels="auto"` the CPU wing (minfer/cpu/),
`enforce_eager=True` the wing's kernels without the step runner; all three give the same greedy tokens.
One platform per `LLM`, built once, handing over objects (the attention backend's class, the fused ops, the
sampler, the step runner), never names that a lower layer would turn back into objects.
On stories260K (a 5-layer Llama; skips without ../shared/models/stories260K)."""

import json
import subprocess
import sys

import pytest
import torch

from minfer.config import EngineArgs
from minfer.model.llama import LlamaDecoderLayer
from minfer.platform import CpuPlatform, CudaPlatform, Platform, get_platform
from tests.conftest import SHARED

STORIES = SHARED / "models" / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(), reason=f"{STORIES} is not here")
ARGS = dict(max_model_len=256, kv_cache_memory_bytes=1 << 22, device="cpu", seed=0)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    from minfer.model.llama2c import llama2c_to_hf

    return str(llama2c_to_hf(STORIES / "stories260K.bin", tmp_path_factory.mktemp("stories"), STORIES / "tok512.model"))


def _cpu_kernels_build() -> bool:
    from minfer.cpu.decode_step import DecodeLayersUnavailable, _library

    try:
        _library()
        return True
    except DecodeLayersUnavailable:
        return False


def _generate_counting_layer_calls(llm, monkeypatch, prompts):
    """Greedy tokens of `prompts` and how many times `LlamaDecoderLayer.forward` ran (all layers together)."""
    from minfer import SamplingParams

    calls = []
    original = LlamaDecoderLayer.forward

    def recording(self, *args, **kwargs):  # a class attribute, not a hook: hooks would turn the step runner off
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", recording)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    monkeypatch.setattr(LlamaDecoderLayer, "forward", original)
    return [o.outputs[0].token_ids for o in outs], calls


@needs_stories
def test_reference_decode_runs_every_layer_and_auto_gives_the_same_tokens(stories, monkeypatch):
    from minfer import LLM

    prompts = [[1, 72, 43], [1, 300]]
    ref = LLM(model=stories, kernels="reference", **ARGS)
    worker = ref.llm_engine.worker
    assert worker.step_runner is None and type(worker.platform) is CpuPlatform
    n_layers = len(worker.model.model.decoder_layers())
    tokens_ref, calls = _generate_counting_layer_calls(ref, monkeypatch, prompts)
    # one prefill step and NEW_TOKENS - 1 decode steps, both prompts in each: every layer, every step
    steps = NEW_TOKENS
    assert len(calls) == steps * n_layers, f"{len(calls)} layer calls for {steps} steps of {n_layers} layers"
    assert set(calls) == set(worker.model.model.decoder_layers())

    auto = LLM(model=stories, **ARGS)
    tokens_auto, calls_auto = _generate_counting_layer_calls(auto, monkeypatch, prompts)
    assert tokens_auto == tokens_ref
    if _cpu_kernels_build():  # the one-call step ran the decode steps: only the prefill met the layers
        assert auto.llm_engine.worker.step_runner is not None
        assert len(calls_auto) == n_layers
    eager = LLM(model=stories, enforce_eager=True, **ARGS)
    assert eager.llm_engine.worker.step_runner is None
    tokens_eager, calls_eager = _generate_counting_layer_calls(eager, monkeypatch, prompts)
    assert tokens_eager == tokens_ref and len(calls_eager) == steps * n_layers
    # chapter 1's simple path honours the field too
    from minfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for llm in (ref, auto, eager):
        assert llm.generate_simple(prompts[0], params)[0].outputs[0].token_ids == tokens_ref[0]
    assert ref._simple.step_runner is None and eager._simple.step_runner is None


PROBE = r"""
import json, sys
from minfer import LLM, SamplingParams
path, kernels = sys.argv[1], sys.argv[2]
args = dict(max_model_len=256, kv_cache_memory_bytes=1 << 22, device="cpu", seed=0, kernels=kernels)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm = LLM(model=path, **args)
llm.generate([[1, 72, 43]], params)
llm.generate_simple([1, 72, 43], params)
modules = sorted(m for m in sys.modules if m == "minfer.cpu" or m.startswith("minfer.cpu."))
LLM(model=path, quantization="int8", **args).generate([[1, 72, 43]], params)
with open("/proc/self/maps") as f:
    libraries = sorted({line.split()[-1] for line in f if "minfer_" in line and ".so" in line})
print(json.dumps({"modules": modules, "libraries": libraries}))
"""


def _probe(path: str, kernels: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, path, kernels], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_stories
def test_reference_loads_no_cpp_in_a_fresh_interpreter(stories):
    """kernels="reference": after a generate (engine and simple path) no module of the CPU wing is imported,
    and after an int8 model's generate too no minfer C++ library is mapped into the process."""
    ref = _probe(stories, "reference")
    assert ref == {"modules": [], "libraries": []}
    if _cpu_kernels_build():  # the probe can see them: kernels="auto" maps the wing's libraries
        auto = _probe(stories, "auto")
        assert "minfer.cpu.decode_step" in auto["modules"] and auto["libraries"]


def test_kernels_is_an_engine_field_and_a_flag():
    assert EngineArgs().kernels == "auto" and EngineArgs().enforce_eager is False
    with pytest.raises(ValueError, match="kernels"):
        EngineArgs(kernels="fast")
    from minfer.serve.__main__ import build_parser, engine_args_from

    parser = build_parser()
    assert "--kernels" in parser.format_help()
    args = engine_args_from(parser.parse_args(["--kernels", "reference", "--enforce-eager"]))
    assert args.kernels == "reference" and args.enforce_eager
    from minfer import LLM

    assert "kernels" in LLM.__doc__ and "reference" in LLM.__doc__


def test_get_platform_picks_by_device_and_kernels():
    assert type(get_platform("auto", "cpu", torch.float32)) is CpuPlatform
    assert type(get_platform("auto", "cuda", torch.bfloat16)) is CudaPlatform
    assert type(get_platform("auto", "meta", torch.float32)) is Platform
    with pytest.raises(ValueError, match="kernels"):
        get_platform("fastest", "cpu", torch.float32)
    ref = get_platform("reference", "cpu", torch.float32)
    assert ref.linear_method().name == "nn" and ref.fused_ops() is None
    from minfer.attention import PagedReferenceBackend, PagedTorchBackend

    # the reference path attends with the plain backend the chapters teach; a quantized pool with the batched one
    assert ref.get_attn_backend_cls("auto", torch.float32, torch.float32) is PagedReferenceBackend
    assert ref.get_attn_backend_cls("auto", torch.float32, torch.int8) is PagedTorchBackend
    assert ref.get_attn_backend_cls("cpu", torch.float32, torch.float32) not in (PagedReferenceBackend,
                                                                                  PagedTorchBackend)  # named: kept
    assert ref.quantization_options() == {"cpu_kernel": None}
    from minfer.sampling import Sampler

    assert type(ref.sampler(None)) is Sampler
    # CUDA: no step runner yet, and none with enforce_eager (its CUDA-graph runner's place)
    assert get_platform("auto", "cuda", torch.bfloat16, enforce_eager=True).step_runner(torch.nn.Linear(1, 1)) is None


def test_cuda_platform_auto_takes_triton_ops_and_sampler_and_graphs_follow_enforce_eager(monkeypatch):
    """On CUDA, kernels="auto" with attention_backend="auto" (the selector's Triton there) builds the Triton fused
    ops and sampler too; the CUDA-graph runner is asked for unless enforce_eager or kernels="reference"
    (checked without a GPU: the platform is built for a "cuda" device and the capture is stubbed)."""
    import minfer.cuda_graphs as cg
    import minfer.kernels
    from minfer.kernels.sampler import TritonSampler

    built = []
    monkeypatch.setattr(cg.CudaGraphRunner, "build", classmethod(lambda cls, *a, **kw: built.append(kw) or "runner"))
    auto = CudaPlatform("cuda", torch.bfloat16)
    assert auto.fused_ops("auto") is minfer.kernels and auto.fused_ops("torch") is None
    assert isinstance(auto.sampler(None, "auto"), TritonSampler)
    assert auto.graph_runner(object(), object(), max_num_seqs=8, max_blocks_per_seq=4) == "runner"
    assert built and built[0]["max_num_seqs"] == 8 and built[0]["max_blocks_per_seq"] == 4
    assert CudaPlatform("cuda", torch.bfloat16, enforce_eager=True).graph_runner(None, None, 8, 4) is None
    ref = CudaPlatform("cuda", torch.bfloat16, kernels="reference")
    assert ref.graph_runner(None, None, 8, 4) is None and ref.fused_ops("auto") is None
    assert not isinstance(ref.sampler(None, "auto"), TritonSampler)
    assert CpuPlatform("cpu", torch.float32).graph_runner(None, None, 8, 4) is None


def test_bfloat16_takes_onednn_only_where_the_cpu_runs_it():
    """oneDNN packs a bfloat16 weight only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only EPYC has
    neither): there the platform picks "hybrid", elsewhere "split", and a bfloat16 model loads either way."""
    from minfer.cpu.linear import onednn_supports
    from minfer.model.layers import Linear

    method = get_platform("auto", "cpu", torch.bfloat16).linear_method()
    assert method.name == ("hybrid" if onednn_supports(torch.bfloat16) else "split")
    assert get_platform("auto", "cpu", torch.float32).linear_method().name == (
        "hybrid" if onednn_supports(torch.float32) else "split")
    lin = Linear(32, 32, method=method)
    lin.weight.data = torch.randn(32, 32).bfloat16()
    lin.process_weights_after_loading()
    x = torch.randn(3, 32).bfloat16()
    torch.testing.assert_close(lin(x).float(), x.float() @ lin.weight_rows(torch.arange(32)).float().T,
                               rtol=2e-2, atol=2e-2)


@needs_stories
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_one_platform_per_llm(stories, monkeypatch, kernels):
    """`LLM(...)`, `generate` and `generate_simple` build one platform between them (the loader's, which the
    worker and the simple path take over), whichever way it is asked for."""
    from minfer import LLM, SamplingParams

    built = []
    init = Platform.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(Platform, "__init__", counting)
    llm = LLM(model=stories, **{**ARGS, "kernels": kernels})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = llm.generate([[1, 72, 43]], params)[0].outputs[0].token_ids
    assert llm.generate_simple([1, 72, 43], params)[0].outputs[0].token_ids == tokens
    assert built == [CpuPlatform], built
    worker = llm.llm_engine.worker
    assert llm._simple.platform is worker.platform and worker.platform.kernels == kernels


def test_the_platform_hands_over_objects_not_names():
    """What the model and the selector receive are the kernels themselves: a fused-ops object (or None), a
    backend class or factory; a name or a bool where an object belongs is refused, not re-interpreted."""
    from minfer.attention import PagedReferenceBackend, PagedTorchBackend, get_attn_backend
    from minfer.model.layers import FUSED_OP_NAMES, BuildOptions, RMSNorm

    auto = get_platform("auto", "cpu", torch.float32)
    ops = auto.fused_ops()
    assert ops is None or all(callable(getattr(ops, n)) for n in FUSED_OP_NAMES)
    if _cpu_kernels_build():
        from minfer.cpu import fused_ops
        from minfer.cpu.attention import CpuPagedBackend

        assert ops is fused_ops
        pool = [torch.zeros(2, 2, 4, 1, 8)]
        assert type(get_attn_backend("auto", pool, platform=auto)) is CpuPagedBackend
        assert type(get_attn_backend("cpu", pool, platform=auto)) is CpuPagedBackend
        assert type(get_attn_backend("torch", pool, platform=auto)) is PagedReferenceBackend
    assert get_platform("auto", "cpu", torch.bfloat16).fused_ops() is None  # the C++ loops are float32 only
    for name in ("cpu", "triton", True, False):
        with pytest.raises(TypeError, match="fused ops"):
            BuildOptions(fused_ops=name)
        with pytest.raises(TypeError, match="fused ops"):
            RMSNorm(8, fused=name)
    with pytest.raises(ValueError, match="unknown Linear layout 'hybrid'"):
        from minfer.model.layers import Linear

        Linear(4, 4, method="hybrid")  # a layout of the CPU wing is an object the platform gives
    # Without a platform the selector builds only its own folder's backends.
    pool = [torch.zeros(2, 2, 4, 1, 8)]
    assert type(get_attn_backend("auto", pool)) is PagedTorchBackend
    with pytest.raises(ValueError, match="platform"):
        get_attn_backend("cpu", pool)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attn_backend("flash", pool, platform=auto)
