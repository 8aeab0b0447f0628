"""Decode attention that reads the paged pool in place, on the CPU (chapter 6 §6.5 and notebook 06 §5c;
the pool and its block tables are chapter 3's).

The plain-torch `PagedTorchBackend` gathers each decode sequence's blocks into a padded tensor and then
calls SDPA, so every K/V byte crosses the memory bus three times; in a wide decode step that is most of
the attention time. `csrc/paged_decode_cpu.cpp` walks the block table itself (vLLM's PagedAttention idea,
Kwon et al. 2023, on a CPU): each byte is read once, and the query heads that share a K/V head (GQA) are
done together. It is about 100 lines of plain C++ with OpenMP; this module builds it with torch's
extension builder)
and calls it through `ctypes` with the tensors' data pointers, so the C++ needs no torch headers and builds
in about a second.

`CpuPagedBackend` is `minfer.attention.torch_ref.PagedTorchBackend` with the decode part replaced, and its
prefill (one sequence's causal attention) on `csrc/prefill_cpu.cpp` where that applies (`attend_prefill_cpu`:
float32, no ALiBi or short window; lab notes 9b §9b.8), as `CpuContiguousBackend`'s. It also reads a quantized
pool (`kv_cache_dtype` int8 / fp8, `minfer.attention.kv_quant`): the codes in place, with their per-token scales
(`minfer_paged_decode_q8`). The engine uses it by default for float32 on the CPU when the kernel builds
(`attention_backend="auto"`), and falls
back to the torch reference, with one warning, when it does not (no C++ compiler, no ninja, a platform
whose compiler lacks OpenMP). `kernels="reference"` (`minfer.platform`) leaves it out.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from minfer.attention.base import Attention, ForwardContext
from minfer.attention.kv_quant import KVCacheSpec, code_table
from minfer.attention.torch_ref import ContiguousBackend, PagedTorchBackend
from minfer.cpu.build import F32, I32, I64, PTR, CppLibrary, KernelUnavailable

logger = logging.getLogger(__name__)

# -ffast-math lets gcc vectorize the exp loops (glibc's libmvec; 16 lanes where AVX-512 exists, with
# -mprefer-vector-width=512, instead of gcc's default 8). A NaN in q or k still reaches the rows that see it
# (tests/test_prefill_attention_cpu.py).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
MAX_HEADS = 256  # query heads the kernel's per-item stack buffer holds (kMaxHeadsPerItem)
PREFILL_MAX_HEAD_DIM = 256  # kMaxD of prefill_cpu.cpp


class CpuKernelUnavailable(KernelUnavailable):
    """The C++ attention kernel could not be built or loaded here (the message says why)."""


_DECODE_ARGS = [PTR, PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64, F32, I64, PTR, I32]
DECODE = CppLibrary("minfer_paged_decode_cpu", "paged_decode_cpu.cpp", CFLAGS, {
    "minfer_paged_decode_f32": (_DECODE_ARGS, None),
    "minfer_paged_decode_bf16": (_DECODE_ARGS, None),
    "minfer_paged_decode_q8": ([PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64, F32, I64,
                                PTR, I32], None),
}, CpuKernelUnavailable)
PREFILL = CppLibrary("minfer_prefill_cpu", "prefill_cpu.cpp", CFLAGS, {
    "minfer_prefill_attention_f32": ([PTR, PTR, PTR, PTR, I64, I64, I64, I64, I64, I64, I64, I64, F32, PTR, I32], I32),
    "minfer_prefill_scratch_floats": ([I64, I64, I64], I64),
}, CpuKernelUnavailable)
_library = DECODE.load
cpu_kernel_available = DECODE.available


@functools.cache
def _prefill_library() -> ctypes.CDLL | None:
    """The prefill attention kernel, or None where it cannot be built (the callers then run torch's SDPA)."""
    try:
        return PREFILL.load()
    except CpuKernelUnavailable as e:
        logger.info("prefill attention runs torch's SDPA: %s", e)
        return None


def attend_prefill_cpu(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`minfer.attention.torch_ref.attend` (causal attention of one sequence whose queries are the last Tq of
    its Tk keys: q `[Tq, H, D]`, k/v `[Tk, KVH, D]` -> `[Tq, H, D]`) on the C++ kernel of csrc/prefill_cpu.cpp
    where it applies: float32 CPU tensors, no ALiBi, no sliding window shorter than the keys, head_dim <= 256,
    each head's D floats contiguous. Elsewhere (and where the kernel does not build) torch's SDPA, as before.

    A row's result does not depend on how many queries come with it (a chunk of a prompt gives the same bits
    as the whole prompt for its rows), unlike SDPA's; it equals SDPA's to float32 rounding
    (tests/test_prefill_attention_cpu.py). Chapter 9 §9.2.6 measures it."""
    from minfer.attention.torch_ref import attend

    tq, h, d = q.shape
    tk, kvh = k.shape[0], k.shape[1]
    window = layer.sliding_window
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 or not q.is_cpu
            or layer.alibi_slopes is not None or (window and window < tk) or d > PREFILL_MAX_HEAD_DIM
            or tq > tk or h % kvh or any(t.stride(2) != 1 or t.stride(1) != d for t in (q, k, v))):
        return attend(layer, q, k, v)
    lib = _prefill_library()
    if lib is None:
        return attend(layer, q, k, v)
    nt = torch.get_num_threads()
    out = torch.empty(tq, h, d, dtype=torch.float32)
    scratch = torch.empty(lib.minfer_prefill_scratch_floats(tk, kvh, d), dtype=torch.float32)
    lib.minfer_prefill_attention_f32(out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), tq, tk, h, kvh, d,
                                     q.stride(0), k.stride(0), v.stride(0), layer.scale, scratch.data_ptr(), nt)
    return out


def check_block_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Raise ValueError unless every context length fits its table row and every block id is in the pool.

    The C++ kernel reads raw memory and would not notice; this runs on the caller's integers, before any
    int32 cast could wrap a large one into range."""
    lens = context_lens.tolist()
    if not lens:
        return
    if min(lens) < 1 or max(lens) > block_tables.shape[1] * block_size:
        raise ValueError(f"context_lens must be in [1, {block_tables.shape[1] * block_size}] (the block table's "
                         f"{block_tables.shape[1]} blocks of {block_size}), got {min(lens)}..{max(lens)}")
    if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {int(block_tables.min())}.."
                         f"{int(block_tables.max())}")


def paged_attention_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, validate: bool = True,
                               k_scales: torch.Tensor | None = None,
                               v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its paged context, read in place (no gather).

    Args:
        q: float32 `[B, H, D]`, the query of each decoding sequence (position `context_lens[b] - 1`).
        k_cache, v_cache: float32 or bfloat16 `[num_blocks, block_size, KVH, D]`, one layer's pool (K/V of
            this step already stored; bfloat16 is widened to float32 exactly as it is read); or a quantized
            pool (`minfer.attention.kv_quant`): int8 / float8_e4m3fn / float8_e5m2 codes of that shape, with
            `k_scales`, `v_scales` float32 `[num_blocks, block_size, KVH]` (x = code * scale per token and head).
        block_tables: int32 `[B, max_blocks]`; context_lens: int32 `[B]`, keys each sequence sees (>= 1).
        scale: softmax scale (usually D ** -0.5). sliding_window: attend only to the newest W keys.
        alibi_slopes: float32 `[H]` or None (bias -slope * distance, Press et al. 2022).
        out: optional float32 `[B, H, D]` contiguous to write into.
        validate: check that every block id and length stays inside the pool and the table (the C++ reads
            raw memory and would not notice); the backend checks once per forward and skips it per layer.

    Returns:
        float32 `[B, H, D]`.

    Raises:
        CpuKernelUnavailable: the kernel cannot be built here.
        ValueError: a tensor of the wrong dtype, device, shape or layout, or a block id or context length
            outside the pool or the block table.
    """
    lib = _library()
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [B, H, D] and the caches [num_blocks, block_size, KVH, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    b, h, d = q.shape
    num_blocks, bs, kvh = k_cache.shape[:3]
    quantized = k_cache.dtype in QUANTIZED_CODES
    if q.dtype != torch.float32 or q.device.type != "cpu" or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous float32 CPU tensor, got {q.dtype} on {q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KERNEL_POOL_DTYPES or t.dtype != k_cache.dtype or t.device.type != "cpu" \
                or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, float32, bfloat16 or 8-bit codes "
                             f"({', '.join(map(str, QUANTIZED_CODES))}) like k_cache, got {t.dtype} on {t.device}")
    if quantized != (k_scales is not None and v_scales is not None):
        raise ValueError("k_scales and v_scales go with an 8-bit pool, and only with one: got a "
                         f"{k_cache.dtype} pool with{'out' if k_scales is None else ''} scales")
    if quantized:
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if t.dtype != torch.float32 or t.shape != k_cache.shape[:3] or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"{name} must be a contiguous float32 CPU tensor of shape {tuple(k_cache.shape[:3])}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same "
                         f"shape, ending in head_dim {d}")
    if kvh < 1 or h % kvh or h > MAX_HEADS:
        raise ValueError(f"{h} query heads over {kvh} K/V heads: need a multiple of {kvh}, at most {MAX_HEADS}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64) or t.device.type != "cpu":
            raise ValueError(f"{name} must be an int32 or int64 CPU tensor, got {t.dtype} on {t.device}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables must be [{b}, max_blocks] and context_lens [{b}], got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of q's shape {tuple(q.shape)}")
    if b == 0:
        return out
    if validate:  # on the caller's integers, before the int32 cast could wrap a large one into range
        check_block_tables(block_tables, context_lens, num_blocks, bs)
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device="cpu", dtype=torch.float32).contiguous()
        if slopes.shape != (h,):
            raise ValueError(f"alibi_slopes must be [{h}], got {tuple(slopes.shape)}")
    _decode_unchecked(lib, out, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, slopes,
                      k_scales, v_scales)
    return out


def _decode_unchecked(lib, out, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, slopes,
                      k_scales, v_scales) -> None:
    """The kernel call itself, on tensors `paged_attention_decode_cpu` checked (or a backend checked once per
    forward): contiguous, of the right dtypes and shapes, int32 tables, `slopes` contiguous float32 or None.
    A backend calls this per layer so that a decode step pays the checks once, not once per layer."""
    b, h, d = q.shape
    common = (block_tables.data_ptr(), context_lens.data_ptr(), b, h, k_cache.shape[2], d, k_cache.shape[1],
              block_tables.shape[1], scale, sliding_window or 0, slopes.data_ptr() if slopes is not None else None,
              torch.get_num_threads())
    if k_scales is not None:
        lut = None if k_cache.dtype == torch.int8 else _code_table(k_cache.dtype)
        lib.minfer_paged_decode_q8(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   k_scales.data_ptr(), v_scales.data_ptr(),
                                   lut.data_ptr() if lut is not None else None, *common)
    elif k_cache.dtype == torch.bfloat16:
        lib.minfer_paged_decode_bf16(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *common)
    else:
        lib.minfer_paged_decode_f32(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *common)


QUANTIZED_CODES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16, *QUANTIZED_CODES)  # the pools the kernel reads
# Model dtypes whose decode the kernel does: float32, and bfloat16, whose query is widened to float32 (exact)
# and whose output is rounded back, so one decode step is one kernel call per layer instead of SDPA in
# bfloat16 over gathered K/V, otherwise most of a bfloat16 decode step's attention (lab notes 9b §9b.7).
KERNEL_MODEL_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _code_table(dtype: torch.dtype) -> torch.Tensor:
    """The fp8 decoding table the kernel reads (kept alive here: the C++ side holds only its pointer)."""
    return code_table(dtype).contiguous()


@dataclass
class DecodeStepTables:
    """What a fused decode step (`minfer.cpu.decode_step`) reads to attend as the kernel does: block tables
    `[rows, max_blocks]` int32, context lengths `[rows]` int32, the K/V slots of the new tokens `[rows]` int64,
    the block size (tokens) and the table width."""

    block_table: torch.Tensor
    context_lens: torch.Tensor
    slots: torch.Tensor
    block_size: int
    max_blocks: int


@dataclass
class CpuDecodeTables:
    """The decode rows' block tables and context lengths as contiguous int32, converted (and checked) once
    per forward and shared by all layers: `block_tables [B, max_blocks]`, `context_lens [B]`."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor


class CpuPagedBackend(PagedTorchBackend):
    """`PagedTorchBackend` whose decode part runs the C++ kernel (a float32 or bfloat16 model on the CPU; the
    pool float32, bfloat16, or int8 / fp8 codes with their scales; the kernel computes in float32).

    Raises at construction (CpuKernelUnavailable) when the kernel cannot be built or cannot read this pool,
    so the engine can fall back to the torch reference before serving anything.
    """

    name = "cpu"
    attend_prefill = staticmethod(attend_prefill_cpu)  # prefill on the C++ kernel too, where it applies

    def __init__(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None = None,
                 spec: KVCacheSpec | None = None):
        self._lib = _library()
        if any(c.dtype not in KERNEL_POOL_DTYPES or c.device.type != "cpu" for c in kv_caches):
            raise CpuKernelUnavailable(f"the CPU kernel reads a float32, bfloat16, int8 or fp8 KV pool on the CPU; got "
                                       f"{kv_caches[0].dtype} on {kv_caches[0].device}")
        if not all(c.is_contiguous() for c in kv_caches + list(kv_scales or [])):
            raise CpuKernelUnavailable("the CPU kernel reads contiguous K/V (and scale) tensors in place")
        _prefill_library()  # built now (once per machine), not in the first request's prefill
        super().__init__(kv_caches, kv_scales, spec)

    def decode_tables(self, ctx: ForwardContext) -> DecodeStepTables | None:
        """A step whose every row is a decoding sequence (no prefill): its tables, as the kernel reads them;
        None otherwise."""
        plan = ctx.attn_metadata.decode if ctx.num_prefills == 0 and ctx.attn_metadata is not None else None
        if not isinstance(plan, CpuDecodeTables):
            return None
        slots = ctx.slot_mapping
        rows = plan.block_tables.shape[0]
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.shape != (rows,):
            return None
        return DecodeStepTables(plan.block_tables, plan.context_lens, slots, self.block_size,
                                plan.block_tables.shape[1])

    def _decode_plan(self, ctx: ForwardContext) -> CpuDecodeTables:
        p = ctx.num_prefills
        plan = CpuDecodeTables(ctx.block_tables[p:], ctx.context_lens[p:])
        # Every layer's pool has the same shape, so bounds checked once hold for all layers.
        check_block_tables(plan.block_tables, plan.context_lens, self.kv_caches[0].shape[1], self.block_size)
        plan.block_tables = plan.block_tables.to(torch.int32).contiguous()
        plan.context_lens = plan.context_lens.to(torch.int32).contiguous()
        return plan

    def _decode(self, layer: Attention, kv, q, ctx: ForwardContext) -> torch.Tensor:
        plan = ctx.attn_metadata.decode
        if q.dtype not in KERNEL_MODEL_DTYPES:
            raise ValueError(f"attention_backend='cpu' runs float32 or bfloat16 models; this one runs in {q.dtype}")
        if q.shape[1] > MAX_HEADS:
            raise ValueError(f"{q.shape[1]} query heads: the CPU kernel holds at most {MAX_HEADS}")
        sc = self.kv_scales[layer.layer_idx] if self.kv_scales is not None else (None, None)
        # The pool's tensors were checked at construction and the tables once per forward (`_decode_plan`):
        # the kernel is called without `paged_attention_decode_cpu`'s per-call checks (tens of microseconds of
        # Python per layer, more than the kernel at batch 1).
        dtype = q.dtype
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        slopes = layer.alibi_slopes
        if slopes is not None:
            slopes = slopes.to(device="cpu", dtype=torch.float32).contiguous()
        _decode_unchecked(self._lib, out, q, kv[0], kv[1], plan.block_tables, plan.context_lens, layer.scale,
                          layer.sliding_window, slopes, sc[0], sc[1])
        return out.to(dtype)


class CpuContiguousBackend(ContiguousBackend):
    """Chapter 1's contiguous one-sequence cache whose decode steps (one query) run the C++ kernel of
    `CpuPagedBackend`, reading the cache in place as one block of `max_len` tokens (block table `[[0]]`).

    The simple path (`minfer.generate.SimpleGenerator`) takes it for a float32 model on the CPU where the
    kernel builds, so that it attends with the very kernel the engine decodes with (the engine's greedy tokens
    are tested against it, token for token), and pays one kernel call per layer instead of the transposes and
    the SDPA call of the torch reference: at batch 1 those were about a seventh of a gguf decode token
    (chapter 9). Prefill (more than one query) attends through `ContiguousBackend`'s SDPA, as the paged
    backends' prefill does. A quantized cache (`kv_cache_dtype` int8 / fp8) is read as codes with their
    per-token scales, as in the pool.

    Raises (construction): CpuKernelUnavailable where the kernel cannot be built, or cannot read this cache
    (not float32 / 8-bit codes on the CPU), so the caller can fall back to `ContiguousBackend`.
    """

    name = "contiguous-cpu"
    attend_prefill = staticmethod(attend_prefill_cpu)  # the engine's prefill kernel, so both paths agree

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto"):
        self._lib = _library()
        if dtype not in KERNEL_MODEL_DTYPES or torch.device(device).type != "cpu":
            raise CpuKernelUnavailable(f"the CPU decode kernel runs float32 or bfloat16 models on the CPU, not {dtype} "
                                       f"on {device}")
        super().__init__(num_layers, max_len, num_kv_heads, head_dim, dtype, device, kv_cache_dtype)
        self._block_table = torch.zeros(1, 1, dtype=torch.int32)

    def decode_tables(self, ctx: ForwardContext) -> DecodeStepTables | None:
        """One decoding token over the contiguous cache (one block of `max_len` tokens); None otherwise."""
        lens = ctx.attn_metadata
        if lens is None or ctx.positions.shape[0] != 1:
            return None
        return DecodeStepTables(self._block_table, lens, torch.tensor([ctx.start_pos], dtype=torch.int64),
                                self.max_len, 1)

    def prepare(self, ctx: ForwardContext):
        """A one-token forward: the context length `[1]` int32, shared by all layers (None for a prefill)."""
        if ctx.positions.shape[0] != 1:
            return None
        end = ctx.start_pos + 1
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; this forward needs {end}")
        return torch.tensor([end], dtype=torch.int32)

    def attend(self, layer: Attention, q, k, v, ctx: ForwardContext) -> torch.Tensor:
        lens = ctx.attn_metadata
        kv = self.kv_caches[layer.layer_idx]
        if (lens is None or q.dtype not in KERNEL_MODEL_DTYPES or kv.dtype not in KERNEL_POOL_DTYPES
                or layer.num_heads > MAX_HEADS):
            return super().attend(layer, q, k, v, ctx)
        sc = self.kv_scales[layer.layer_idx] if self.kv_scales is not None else None
        slopes = layer.alibi_slopes
        if slopes is not None:
            slopes = slopes.to(dtype=torch.float32).contiguous()
        dtype = q.dtype
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        # kv[i] is [max_len, KVH, D]: one block of max_len tokens, [1, max_len, KVH, D] without a copy.
        _decode_unchecked(self._lib, out, q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), self._block_table, lens,
                          layer.scale, layer.sliding_window, slopes,
                          None if sc is None else sc[0].unsqueeze(0), None if sc is None else sc[1].unsqueeze(0))
        return out.to(dtype)
