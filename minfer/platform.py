"""The one place that decides how this device runs a step (vLLM's `platforms/`): once per worker, from
`EngineArgs.kernels` and `enforce_eager`.

    get_platform(kernels, device, dtype, enforce_eager) -> CpuPlatform | CudaPlatform | Platform
      .linear_method()            how every Linear stores and multiplies its weight ("nn", or a CPU layout)
      .quantization_options()     whether quantized methods may pack for the CPU's integer GEMM
      .fused_ops(backend)         RMSNorm / SiLU-and-mul / RoPE: False (plain torch), "cpu" or "triton"
      .attention_backend(name)    what attention_backend="auto" stands for here
      .contiguous_cache(...)      the simple path's KV cache (chapter 1)
      .sampler(generator, backend)
      .step_runner(model)         something that runs a whole decode step in one call, or None
      .configure_allocator()      malloc settings for a CPU server

`kernels="reference"` is the path the chapters teach: plain PyTorch model code (`F.linear` on `[out, in]`
weights, torch's RMSNorm/SiLU/RoPE), the torch attention reference, the torch sampler, no step runner, and no
C++ library loaded. `kernels="auto"` (the default) takes what is fastest here: on a CPU the wing
`minfer/cpu/` (its `__init__` is the map); on CUDA the Triton kernels where `attention_backend="triton"`.
`enforce_eager=True` keeps those kernels but runs every step through the model, op by op (no step runner:
no one-call CPU decode, and on CUDA no graph replay).

The model files never ask which device they run on: everything device-specific reaches them through what this
module hands the loader (`BuildOptions`: the `LinearMethod`, the fused ops) and the worker (the attention
backend, the sampler, the step runner).

Environment overrides, for tests and benchmarks only (`minfer.envs` documents them), are asked for here and
nowhere else:
    envs.MINFER_LINEAR_LAYOUT   force a CPU Linear layout (nn | split | onednn | hybrid | panels) under "auto"
    envs.MINFER_GGUF_ISA        force the integer GEMM's instruction set (scalar | avx2 | vnni; `minfer.cpu.qgemm`)
    envs.MINFER_MALLOC_TUNING   0 / false / no / off: leave glibc's malloc settings alone (`minfer.cpu.malloc`)
"""

from __future__ import annotations

import torch

import minfer.envs as envs
from minfer.config import KERNELS
from minfer.model.linear_method import LinearMethodBase, UnquantizedLinearMethod


class KernelUnavailable(RuntimeError):
    """A C++ kernel could not be built or loaded here (the message says why: no compiler, no ninja, a compiler
    without OpenMP...). Each library of the CPU wing raises its own subclass (`minfer.cpu.build`)."""


# -- environment overrides (tests and benchmarks) ------------------------------------------------------------
def linear_layout_override() -> str | None:
    """`envs.MINFER_LINEAR_LAYOUT`, or None when unset. Raises ValueError for a layout that does not exist."""
    return envs.MINFER_LINEAR_LAYOUT


def gguf_isa_override() -> str:
    """`envs.MINFER_GGUF_ISA` ("auto" when unset): the instruction set the integer GEMM is forced to."""
    return envs.MINFER_GGUF_ISA


def malloc_tuning_enabled() -> bool:
    """False when `envs.MINFER_MALLOC_TUNING` is 0 / false / no / off."""
    return envs.MINFER_MALLOC_TUNING


# -- names the model layer may use -------------------------------------------------------------------------
def get_linear_method(name: str) -> LinearMethodBase:
    """The `LinearMethod` called `name`: "nn" (`UnquantizedLinearMethod`), or a CPU layout of
    `minfer.cpu.linear` ("split", "onednn", "hybrid", "panels"). Raises ValueError for another name."""
    if name == "nn":
        return UnquantizedLinearMethod()
    from minfer.cpu.linear import LINEAR_METHODS

    if name not in LINEAR_METHODS:
        raise ValueError(f"unknown Linear layout {name!r}: one of {', '.join(map(repr, LINEAR_METHODS))}")
    return LINEAR_METHODS[name]()


def fused_kernels(kind: bool | str):
    """The module holding `rms_norm`, `fused_add_rms_norm`, `silu_and_mul` and `apply_rotary_` for a
    `BuildOptions.fused_ops` value: the CPU wing's C++ loops (`minfer.cpu.fused_ops`) for "cpu", `minfer.kernels`
    (Triton) for "triton" or True. Raises ValueError for another value."""
    if kind == "cpu":
        from minfer.cpu import fused_ops

        return fused_ops
    if kind is True or kind == "triton":
        import minfer.kernels

        return minfer.kernels
    raise ValueError(f"fused_ops must be False, True, 'triton' or 'cpu', got {kind!r}")


def cpu_attention_reads(model_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the CPU wing's paged attention (`minfer.cpu.attention.CpuPagedBackend`) reads a pool of `kv_dtype`
    under a model computing in `model_dtype` (what attention_backend="auto" picks it for); builds nothing."""
    return model_dtype in (torch.float32, torch.bfloat16) and kv_dtype in (
        torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def cpu_paged_backend(kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None, spec=None,
                      model_dtype: torch.dtype | None = None):
    """The CPU wing's paged attention backend over `kv_caches` (attention_backend="cpu").

    Raises:
        KernelUnavailable: its kernel cannot be built here, or cannot run this model or pool (says why).
    """
    from minfer.cpu.attention import KERNEL_MODEL_DTYPES, CpuKernelUnavailable, CpuPagedBackend

    if model_dtype not in (None, *KERNEL_MODEL_DTYPES):
        raise CpuKernelUnavailable(f"it runs float32 or bfloat16 models; this one runs in {model_dtype}")
    return CpuPagedBackend(kv_caches, kv_scales, spec)


def default_device() -> "torch.device":
    """The device a model goes to when none is named (the loader's default, and every notebook's `DEVICE`).

    In order: a rank of a tensor/pipeline-parallel job, the device `init_parallel` gave it (gloo ranks run on
    the CPU even where a GPU is visible); `envs.MINFER_DEVICE` ("cpu", "cuda", "cuda:N"), so a notebook or a
    test can be pinned; otherwise "cuda" when torch sees a GPU, else "cpu".

    Raises:
        ValueError: `envs.MINFER_DEVICE` is not a device name, or names CUDA where torch finds none.
    """
    import torch

    from minfer.parallel.parallel_state import get_parallel_state

    st = get_parallel_state()
    if st.world_size > 1:
        return st.device
    forced = envs.MINFER_DEVICE
    if forced is not None:
        return forced
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")



# -- the platforms ------------------------------------------------------------------------------------------
class Platform:
    """Any device, plain torch: the reference everywhere (also the base of the others).

    Args:
        device, dtype: where and in what the model computes.
        kernels: "auto" (the fastest this platform has) or "reference" (the textbook path).
        enforce_eager: no step runner (every step through the model's forward).
    """

    name = "generic"

    def __init__(self, device: torch.device | str, dtype: torch.dtype, kernels: str = "auto",
                 enforce_eager: bool = False):
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
        self.device, self.dtype = torch.device(device), dtype
        self.kernels, self.enforce_eager = kernels, bool(enforce_eager)

    @property
    def reference(self) -> bool:
        return self.kernels == "reference"

    def linear_method(self) -> LinearMethodBase:
        """The method of every float `Linear` (quantized methods fall back to it for the layers they keep)."""
        return UnquantizedLinearMethod()

    def quantization_options(self) -> dict:
        """Keyword arguments of `minfer.quantization.get_quantization_method`: `cpu_kernel`, the integer GEMM
        CPU layers are packed for (None: the quantized methods' torch routes)."""
        return {"cpu_kernel": None}

    def fused_ops(self, attention_backend: str = "auto") -> bool | str:
        """`BuildOptions.fused_ops`: "triton" with the Triton attention backend (it wants them), else False."""
        return "triton" if attention_backend == "triton" else False

    def attention_backend(self, requested: str) -> str:
        """The `attention_backend` name to build (`minfer.attention.get_attn_backend`): "auto" stays "auto"
        (the selector decides), except on the reference path, where it is the torch reference."""
        return "torch" if self.reference and requested == "auto" else requested

    def contiguous_cache(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                         kv_cache_dtype: str = "auto", attention_backend: str = "auto"):
        """The simple path's KV cache (`minfer.attention.ContiguousBackend`) for `max_len` tokens."""
        from minfer.attention import ContiguousBackend

        return ContiguousBackend(num_layers, max_len, num_kv_heads, head_dim, self.dtype, self.device,
                                 kv_cache_dtype)

    def sampler(self, generator: torch.Generator | None, attention_backend: str = "auto"):
        """The sampler: Triton's fused one with the Triton backend, else `minfer.sampling.Sampler`."""
        if attention_backend == "triton" and not self.reference:
            from minfer.kernels.sampler import TritonSampler

            return TritonSampler(generator)
        from minfer.sampling import Sampler

        return Sampler(generator)

    def step_runner(self, model: torch.nn.Module):
        """Something with `run(input_ids, ctx) -> hidden | None` that runs a whole step in one call (None from
        `run`: not this step, run the model), or None: every step runs `model(...)`."""
        return None

    def graph_runner(self, model: torch.nn.Module, backend, max_num_seqs: int, max_blocks_per_seq: int):
        """A step runner that needs the KV pool and the attention backend (CUDA graphs capture over them), built
        once they exist; None where the platform has none."""
        return None

    def configure_allocator(self) -> None:
        """Allocator settings for this device (once per process). Default: none."""


class CpuPlatform(Platform):
    """A CPU. "auto": the CPU wing (`minfer/cpu/`): the hybrid / panels Linear layouts, the integer GEMM of the
    quantized methods, the fused C++ element-wise ops (float32), the C++ paged attention (by the selector's
    "auto"), the fused C++ sampler, the one-call decode step, malloc tuning. Each falls back to the torch
    reference where its C++ does not build here."""

    name = "cpu"

    def linear_method(self) -> LinearMethodBase:
        """"nn" on the reference path; else `envs.MINFER_LINEAR_LAYOUT` if set, "hybrid" for float32, or bfloat16 where
        oneDNN's bfloat16 product runs on this CPU (`onednn_supports`), "split" otherwise. Raises ValueError for a
        bad override.

        bfloat16 goes to oneDNN's packed product where it runs: several times faster than a batched matmul
        for the linears of a decode step (chapter 9b §9b.6)."""
        if self.reference:
            return UnquantizedLinearMethod()
        from minfer.cpu.linear import HybridLinearMethod, SplitLinearMethod, onednn_supports

        forced = linear_layout_override()
        if forced:
            return get_linear_method(forced)
        if onednn_supports(self.dtype):
            return HybridLinearMethod()
        return SplitLinearMethod()

    def quantization_options(self) -> dict:
        """The CPU wing's integer GEMMs (`minfer.cpu.linear.CpuQuantKernels`) under "auto"; none on the
        reference path."""
        if self.reference:
            return {"cpu_kernel": None}
        from minfer.cpu.linear import CpuQuantKernels

        return {"cpu_kernel": CpuQuantKernels()}

    def fused_ops(self, attention_backend: str = "auto") -> bool | str:
        """"cpu" for a float32 model whose C++ loops build here (they are batch-invariant: a row's bits do not
        depend on its batch, tests/test_fused_cpu.py), else False; False on the reference path."""
        if attention_backend == "triton":
            return "triton"
        if self.reference or self.dtype != torch.float32:
            return False
        from minfer.cpu.fused_ops import fused_cpu_available

        return "cpu" if fused_cpu_available() else False

    def contiguous_cache(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                         kv_cache_dtype: str = "auto", attention_backend: str = "auto"):
        """`minfer.cpu.attention.CpuContiguousBackend` (its decode steps attend with the C++ kernel the engine
        decodes with) for a float32 or bfloat16 model, unless `attention_backend="torch"` (the engine's choice,
        followed here so that both sides attend alike) or the kernel does not build; else the torch reference."""
        if not self.reference and self.dtype in (torch.float32, torch.bfloat16) and attention_backend != "torch":
            from minfer.cpu.attention import CpuContiguousBackend, CpuKernelUnavailable

            try:
                return CpuContiguousBackend(num_layers, max_len, num_kv_heads, head_dim, self.dtype, self.device,
                                            kv_cache_dtype)
            except CpuKernelUnavailable:
                pass
        return super().contiguous_cache(num_layers, max_len, num_kv_heads, head_dim, kv_cache_dtype)

    def sampler(self, generator: torch.Generator | None, attention_backend: str = "auto"):
        """The C++ fused sampler (chapter 7 §7.4: the same greedy tokens and the same distribution in fewer
        passes over the logits), or the torch one on the reference path and where it does not build."""
        if not self.reference and attention_backend != "triton":
            from minfer.cpu.sampler import CpuFusedSampler, cpu_sampler_available

            if cpu_sampler_available():
                return CpuFusedSampler(generator)
        return super().sampler(generator, attention_backend)

    def step_runner(self, model: torch.nn.Module):
        """The one-call decode step (`minfer.cpu.decode_step.CpuDecodeStep`) where it covers the model, built
        now (its C++ libraries too, not during the first request); None on the reference path, with
        `enforce_eager`, or where it does not cover the model."""
        if self.reference or self.enforce_eager:
            return None
        from minfer.cpu.decode_step import CpuDecodeStep

        return CpuDecodeStep.build(model)

    def configure_allocator(self) -> None:
        """glibc malloc tuning (`minfer.cpu.malloc`): a forward's large buffers stay mapped for the next one."""
        if self.reference or not malloc_tuning_enabled():
            return
        from minfer.cpu.malloc import keep_freed_memory

        keep_freed_memory()


class CudaPlatform(Platform):
    """A CUDA GPU: "nn" Linear layout (cuBLAS); with kernels="auto" the Triton attention backend (the selector's
    "auto" on CUDA), Triton's fused element-wise ops and sampler, and the decode step replayed from CUDA graphs
    (`minfer/cuda_graphs.py`, the same `run(input_ids, ctx) -> hidden | None` shape as the CPU's one-call
    step); `enforce_eager` turns the graphs off, kernels="reference" all of it."""

    name = "cuda"

    def fused_ops(self, attention_backend: str = "auto") -> bool | str:
        if self.reference and attention_backend != "triton":
            return False
        return "triton" if attention_backend in ("auto", "triton") else False

    def sampler(self, generator: torch.Generator | None, attention_backend: str = "auto"):
        return super().sampler(generator, "triton" if attention_backend == "auto" else attention_backend)

    def graph_runner(self, model: torch.nn.Module, backend, max_num_seqs: int, max_blocks_per_seq: int):
        if self.reference or self.enforce_eager:
            return None
        from minfer.cuda_graphs import CudaGraphRunner

        return CudaGraphRunner.build(model, backend, max_num_seqs=max_num_seqs,
                                     max_blocks_per_seq=max_blocks_per_seq, device=self.device)


def get_platform(kernels: str = "auto", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 enforce_eager: bool = False) -> Platform:
    """The platform of `device` (CPU, CUDA, else the generic plain-torch one) for a model in `dtype`.

    Raises:
        ValueError: `kernels` is not "auto" or "reference".
    """
    kind = torch.device(device).type
    cls = {"cpu": CpuPlatform, "cuda": CudaPlatform}.get(kind, Platform)
    return cls(device, dtype, kernels, enforce_eager)
