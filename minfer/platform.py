"""The one place that decides how this device runs a step (vLLM's `platforms/`): once per engine worker, from
`EngineArgs.kernels` and `enforce_eager`, for the model's device and dtype. It hands over objects, never names
that a lower layer would turn back into objects:

    get_platform(kernels, device, dtype, enforce_eager) -> CpuPlatform | CudaPlatform | Platform
      .linear_method()                      the `LinearMethod` of every float `Linear`
      .quantization_options()               keyword arguments of the quantized methods (`cpu_kernel`)
      .fused_ops(attention_backend)         the fused RMSNorm / SiLU-and-mul / RoPE kernels, or None (plain torch)
      .get_attn_backend_cls(name, ...)      what builds the attention backend `name` stands for here
      .contiguous_cache(...)                the simple path's KV cache (chapter 1)
      .sampler(generator, attention_backend)
      .step_runner(model)                   something that runs a whole decode step in one call, or None
      .graph_runner(model, backend, ...)    the CUDA-graph step runner, or None
      .configure_allocator()                malloc settings for a CPU server

`kernels="reference"` is the path the chapters teach: plain PyTorch model code (`F.linear` on `[out, in]`
weights, torch's RMSNorm/SiLU/RoPE), the torch attention reference, the torch sampler, no step runner, and no
C++ library loaded. `kernels="auto"` (the default) takes what is fastest here: on a CPU the wing
`minfer/cpu/` (its `__init__` is the map); on CUDA the Triton kernels. `enforce_eager=True` keeps those kernels
but runs every step through the model, op by op (no step runner: no one-call CPU decode, and on CUDA no graph
replay).

The platform sits above what it chooses from: it imports the model's interfaces, the attention backends and
(inside its methods, for the step that asks) the CPU wing; none of them imports it. The model files never ask
which device they run on: the loader (`minfer.model.loader`) builds the platform with the model and hands the
model its `BuildOptions` (the `LinearMethod`, the fused ops); the worker takes the same platform from the
loaded model for the attention backend (`minfer.attention.get_attn_backend(..., platform=)`), the sampler and
the step runner.

Environment overrides, for tests and benchmarks only (`minfer.envs` documents them), are asked for here and
nowhere else:
    envs.MINFER_LINEAR_LAYOUT   force a CPU Linear layout (nn | split | onednn | hybrid | panels) under "auto"
    envs.MINFER_GGUF_ISA        force the integer GEMM's instruction set (scalar | avx2 | vnni; `minfer.cpu.qgemm`)
    envs.MINFER_MALLOC_TUNING   0 / false / no / off: leave glibc's malloc settings alone (`minfer.cpu.malloc`)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

import minfer.envs as envs
from minfer.attention.base import AttentionBackend, PagedReferenceBackend
from minfer.attention.torch_ref import ContiguousBackend, PagedTorchBackend
from minfer.config import KERNELS
from minfer.model.layers import LinearMethodBase, UnquantizedLinearMethod

if TYPE_CHECKING:
    from minfer.model.layers import FusedOps

logger = logging.getLogger(__name__)

# What `get_attn_backend_cls` returns: called as `cls(kv_caches, kv_scales, spec)` -> the backend.
AttentionBackendCls = Callable[..., AttentionBackend]


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


def triton_fused_ops() -> FusedOps:
    """The Triton element-wise kernels (`minfer.kernels`: rms_norm, fused_add_rms_norm, silu_and_mul,
    apply_rotary_), which the Triton attention backend wants beside it."""
    import minfer.kernels

    return minfer.kernels


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

    Raises:
        ValueError: `kernels` is not "auto" or "reference".
    """

    name = "generic"

    def __init__(self, device: torch.device | str, dtype: torch.dtype, kernels: str = "auto",
                 enforce_eager: bool = False):
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(map(repr, KERNELS))}, got {kernels!r}")
        self.device, self.dtype = torch.device(device), dtype
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())  # the device "cuda" puts a model on
        self.kernels, self.enforce_eager = kernels, bool(enforce_eager)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={str(self.device)!r}, dtype={self.dtype}, kernels={self.kernels!r}, "
                f"enforce_eager={self.enforce_eager})")

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

    def fused_ops(self, attention_backend: str = "auto") -> FusedOps | None:
        """`BuildOptions.fused_ops` of a model run with `attention_backend`: the Triton kernels with the Triton
        backend (it wants them), else None (plain torch)."""
        return triton_fused_ops() if attention_backend == "triton" else None

    def get_attn_backend_cls(self, name: str, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackendCls:
        """What builds the backend `attention_backend=name` stands for here (vLLM's `get_attn_backend_cls`),
        called as `cls(kv_caches, kv_scales, spec)` over a paged pool of `kv_dtype` read by a model computing in
        `model_dtype`. `name` is one of `minfer.config.ATTENTION_BACKENDS` (the selector checked it). Here:
        "triton" the Triton backend; "torch", and "auto" with kernels="reference", over a pool of the model's
        dtype the plain reference (`PagedReferenceBackend`); else the batched torch one (`PagedTorchBackend`).

        Raises:
            ValueError: "cpu": the CPU wing's kernel attends on a CPU only.
        """
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' cannot run here: the C++ kernel attends on a CPU, and this "
                             f"model runs on {self.device}")
        if name == "triton":
            from minfer.attention.triton import TritonBackend

            return TritonBackend
        if (name == "torch" or self.reference) and kv_dtype == model_dtype:
            return PagedReferenceBackend  # the plain paged attention the chapters teach (attention/base.py)
        return PagedTorchBackend  # batched; reads quantized and cast pools

    def contiguous_cache(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                         kv_cache_dtype: str = "auto", attention_backend: str = "auto") -> ContiguousBackend:
        """The simple path's KV cache (`minfer.attention.ContiguousBackend`) for `max_len` tokens."""
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
    quantized methods, the fused C++ element-wise ops (float32), the C++ paged attention, the fused C++
    sampler, the one-call decode step, malloc tuning. Each falls back to the torch reference where its C++ does
    not build here."""

    name = "cpu"

    def linear_method(self) -> LinearMethodBase:
        """"nn" on the reference path; else `envs.MINFER_LINEAR_LAYOUT` if set, "hybrid" for float32, or bfloat16 where
        oneDNN's bfloat16 product runs on this CPU (`onednn_supports`), "split" otherwise. Raises ValueError for a
        bad override.

        bfloat16 goes to oneDNN's packed product where it runs: several times faster than a batched matmul
        for the linears of a decode step (lab notes 9b (chapters/lab/09b-cpu-performance.md) §9b.6)."""
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

    def fused_ops(self, attention_backend: str = "auto") -> FusedOps | None:
        """The C++ loops (`minfer.cpu.fused_ops`) for a float32 model where they build here (they are
        batch-invariant: a row's bits do not depend on its batch, tests/test_fused_cpu.py); the Triton kernels
        with the Triton backend; else None, and None on the reference path."""
        if attention_backend == "triton":
            return triton_fused_ops()
        if self.reference or self.dtype != torch.float32:
            return None
        from minfer.cpu import fused_ops

        return fused_ops if fused_ops.fused_cpu_available() else None

    def get_attn_backend_cls(self, name: str, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackendCls:
        """"cpu", and "auto" under kernels="auto" where the kernel reads this model and pool (a float32 or
        bfloat16 model; a float32, bfloat16, int8 or fp8 pool): the CPU wing's `CpuPagedBackend`. Built by
        the factory returned, which falls back to the torch reference with one warning where "auto" finds the
        kernel unbuildable, and raises ValueError (saying why) where "cpu" does. Else as `Platform`."""
        if name == "auto" and not self.reference:
            from minfer.cpu.attention import KERNEL_MODEL_DTYPES, KERNEL_POOL_DTYPES

            if model_dtype in KERNEL_MODEL_DTYPES and kv_dtype in KERNEL_POOL_DTYPES:
                return _cpu_paged_backend_cls(model_dtype, fall_back=True)
        if name == "cpu":
            return _cpu_paged_backend_cls(model_dtype, fall_back=False)
        return super().get_attn_backend_cls(name, model_dtype, kv_dtype)

    def contiguous_cache(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                         kv_cache_dtype: str = "auto", attention_backend: str = "auto") -> ContiguousBackend:
        """`minfer.cpu.attention.CpuContiguousBackend` (its decode steps attend with the C++ kernel the engine
        decodes with) for a float32 or bfloat16 model, unless `attention_backend="torch"` (the engine's choice,
        followed here so that both sides attend alike), kernels="reference", or the kernel does not build; else
        the torch reference."""
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


def _cpu_paged_backend_cls(model_dtype: torch.dtype, fall_back: bool) -> AttentionBackendCls:
    """A factory of the CPU wing's `CpuPagedBackend` for a model computing in `model_dtype`. Where the kernel
    cannot run (no compiler, this model's dtype, a pool it cannot read): with `fall_back` (attention_backend
    "auto") the torch reference and one warning, else ValueError saying why."""

    def build(kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
              spec=None) -> AttentionBackend:
        from minfer.cpu.attention import KERNEL_MODEL_DTYPES, CpuKernelUnavailable, CpuPagedBackend

        try:
            if model_dtype not in KERNEL_MODEL_DTYPES:
                raise CpuKernelUnavailable(f"it runs float32 or bfloat16 models; this one runs in {model_dtype}")
            return CpuPagedBackend(kv_caches, kv_scales, spec)
        except CpuKernelUnavailable as e:
            if not fall_back:
                raise ValueError(f"attention_backend='cpu' cannot run here: {e}") from e
            logger.warning("the C++ decode-attention kernel is unavailable (%s); using the torch reference", e)
            return PagedTorchBackend(kv_caches, kv_scales, spec)

    return build


class CudaPlatform(Platform):
    """A CUDA GPU: "nn" Linear layout (cuBLAS); with kernels="auto" the Triton attention backend, Triton's fused
    element-wise ops and sampler, and the decode step replayed from CUDA graphs (`minfer/cuda_graphs.py`, the
    same `run(input_ids, ctx) -> hidden | None` shape as the CPU's one-call step); `enforce_eager` turns the
    graphs off, kernels="reference" all of it."""

    name = "cuda"

    def fused_ops(self, attention_backend: str = "auto") -> FusedOps | None:
        if self.reference and attention_backend != "triton":
            return None
        return triton_fused_ops() if attention_backend in ("auto", "triton") else None

    def get_attn_backend_cls(self, name: str, model_dtype: torch.dtype, kv_dtype: torch.dtype) -> AttentionBackendCls:
        """"auto" under kernels="auto": the Triton backend, unless the pool is cast (16-bit K/V under a float32
        model, which it refuses): then the torch reference, as on the reference path."""
        if name == "auto" and not self.reference:
            cast = kv_dtype.is_floating_point and kv_dtype.itemsize > 1 and kv_dtype != model_dtype
            name = "torch" if cast else "triton"
        return super().get_attn_backend_cls(name, model_dtype, kv_dtype)

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
