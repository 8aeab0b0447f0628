"""The article's ten common confusions (§17) as questions whose answers minfer measures.

Each `Question` has options, the answer the article gives, and a `check` that runs minfer and returns
`Evidence`: what it measured, and which option the measurement supports. The recap notebook
(`notebooks/17_recap.ipynb`) shows them as a quiz; `tests/test_recap.py` asserts that every check supports
its answer, so a change in the engine that contradicts the article's statement fails a test instead of
leaving a wrong quiz behind.

A check takes a `RecapContext`: the loaded `LLM` (the real default model) for the checks that need one.
Checks that are arithmetic say so in their evidence; none of them decides from a timing (timings are
printed, never compared), so the answers are the same on every machine.

    pytest tests/test_recap.py
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from minfer import memory
from minfer.model.positions import RotaryEmbedding
from minfer.sampling_params import SamplingParams


@dataclass
class Evidence:
    """What a check measured (`lines`, printable) and the index of the option it supports."""

    supports: int
    lines: list[str] = field(default_factory=list)


@dataclass
class RecapContext:
    """What the checks share: the loaded `minfer.LLM` (float32 SmolLM2 in the notebook and test)."""

    llm: object


@dataclass(frozen=True)
class Question:
    key: str
    section: str  # where the course teaches it
    text: str
    options: tuple[str, ...]
    answer: int  # the article's answer, an index into options
    why: str
    check: Callable[[RecapContext], Evidence]


# -- 1. RoPE vs absolute positions ---------------------------------------------------------------------

def check_rope(ctx: RecapContext) -> Evidence:
    """Q·K after RoPE at positions (m, n) and at (m + s, n + s): equal, because only n − m enters.
    Absolute embeddings added before the projection make the score depend on m and n themselves."""
    cfg = ctx.llm.llm_engine.model_config.config
    d = cfg.head_dim
    rope = RotaryEmbedding(d, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, 512)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, d, generator=g), torch.randn(1, 1, d, generator=g)

    def rope_score(m, n):
        qm, _ = rope(torch.tensor([m]), q, q)
        _, kn = rope(torch.tensor([n]), k, k)
        return float((qm * kn).sum())

    table = torch.randn(512, d, generator=g)  # a learned absolute table, as GPT-2 has

    def absolute_score(m, n):
        return float(((q[0, 0] + table[m]) * (k[0, 0] + table[n])).sum())

    pairs = [(3, 10), (103, 110), (303, 310)]  # the same distance, n − m = 7, shifted
    r = [rope_score(m, n) for m, n in pairs]
    a = [absolute_score(m, n) for m, n in pairs]
    r_spread = max(r) - min(r)
    a_spread = max(a) - min(a)
    lines = [f"RoPE score at (m, n) = {pairs}: " + ", ".join(f"{x:.5f}" for x in r),
             "absolute-embedding score at the same pairs: " + ", ".join(f"{x:.3f}" for x in a),
             f"spread: RoPE {r_spread:.1e}, absolute {a_spread:.2f}"]
    relative = r_spread < 1e-3 * max(1.0, max(abs(x) for x in r)) and a_spread > 1e-2
    return Evidence(supports=1 if relative else 0, lines=lines)


# -- 2. max_model_len is prompt + output ----------------------------------------------------------------

def check_max_model_len(ctx: RecapContext, max_model_len: int = 4096, prompt_len: int = 3000) -> Evidence:
    """Ask the engine itself: with max_model_len 4096, a 3000-token prompt admits max_tokens 1096, not 1097."""
    from minfer.sequence import validate_prompt

    vocab = ctx.llm.llm_engine.model_config.vocab_size
    prompt = [1] * prompt_len
    lines, largest = [], None
    for n in (max_model_len - prompt_len, max_model_len - prompt_len + 1):
        try:
            validate_prompt(prompt, SamplingParams(max_tokens=n), max_model_len, vocab)
            lines.append(f"max_tokens={n}: accepted")
            largest = n
        except ValueError as e:
            lines.append(f"max_tokens={n}: ValueError: {e}")
    options = (max_model_len, max_model_len - prompt_len, prompt_len)
    return Evidence(supports=options.index(largest) if largest in options else -1, lines=lines)


# -- 3. prefix KV cache vs the per-session KV cache ------------------------------------------------------

def check_prefix_cache(ctx: RecapContext) -> Evidence:
    """Two different users' requests that share a system prompt: the second finds the first's blocks,
    although nothing ties the two requests together (no session id)."""
    from minfer import LLM

    base = ctx.llm
    llm = LLM(model=base.engine_args.model, max_model_len=1024, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20)
    system = ("You are a careful assistant for a bookshop. Answer in one short sentence, name the shelf, "
              "and never invent a title that the shop does not stock. ") * 3
    tok = llm.get_tokenizer()
    a = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Where is poetry?"}])
    b = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "Any maps?"}])
    params = SamplingParams(temperature=0, max_tokens=1)
    first = llm.generate([a], params)[0]
    second = llm.generate([b], params)[0]
    lines = [f"user A: {len(a)} prompt tokens, {first.num_cached_tokens} found in the cache",
             f"user B (another conversation, same system prompt): {len(b)} prompt tokens, "
             f"{second.num_cached_tokens} found in the cache"]
    shared_hit = first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    return Evidence(supports=0 if shared_hit else 1, lines=lines)


# -- 4. GQA's group count is fixed by the model ---------------------------------------------------------

def check_gqa(ctx: RecapContext) -> Evidence:
    """The group count comes from config.json, and the trained K/V projection weights have that shape."""
    model = ctx.llm.llm_engine.worker.model
    cfg = model.config
    attn = model.model.layers[0].self_attn
    rows = list(attn.qkv_proj.output_sizes)  # the [out, in] matrix's row blocks, whatever the storage layout
    q_rows, k_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    lines = [f"config: num_attention_heads={cfg.num_attention_heads}, num_key_value_heads="
             f"{cfg.num_key_value_heads} -> {cfg.num_attention_heads // cfg.num_key_value_heads} query heads "
             "per K/V head",
             f"layer 0 qkv_proj weight rows: {rows} (q {q_rows} + k {k_rows} + v {k_rows} = "
             f"{q_rows + 2 * k_rows}); the K/V rows were trained for {cfg.num_key_value_heads} heads"]
    fixed = sum(rows) == q_rows + 2 * k_rows
    return Evidence(supports=0 if fixed else 1, lines=lines)


# -- 5. max-parallel-loading is load-time I/O --------------------------------------------------------------

def check_parallel_loading(ctx: RecapContext) -> Evidence:
    """After loading, every weight is whole in this one process: reading files in parallel changes how
    fast they arrive, not how the model is split (nothing is)."""
    model = ctx.llm.llm_engine.worker.model
    cfg = model.config
    mlp = model.model.layers[0].mlp
    shapes = {name: (sum(lin.output_sizes), lin.in_features)  # logical [out, in], whatever the storage layout
              for name, lin in (("gate_up_proj", mlp.gate_up_proj), ("down_proj", mlp.down_proj))}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    n_params = sum(p.numel() for p in model.parameters())
    lines = [f"processes holding the model: {world}; parameters in this process: {n_params:,}",
             f"layer 0 MLP weights {shapes} (intermediate_size {cfg.intermediate_size}, hidden "
             f"{cfg.hidden_size}: whole, not sharded)"]
    whole = world == 1 and shapes == {"gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
                                      "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    return Evidence(supports=1 if whole else 0, lines=lines)


# -- 6. PP vs TP for decode -------------------------------------------------------------------------------

def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe-style pipeline with equal stage times: (p − 1) / (m + p − 1)
    (Huang et al. 2019, GPipe). p stages, m micro-batches in flight."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages and micro_batches must be >= 1, got {stages}, {micro_batches}")
    return (stages - 1) / (micro_batches + stages - 1)


def check_pp_vs_tp(ctx: RecapContext) -> Evidence:
    """Decode of one sequence is one micro-batch per step: a 4-stage pipeline idles 3/4 of the time.
    (Arithmetic from the formula; the measured timeline is the parallelism chapter's.)"""
    lines = []
    for p in (2, 4, 8):
        lines.append(f"p={p} stages: idle {pipeline_bubble_fraction(p, 1):.0%} with 1 micro-batch (one "
                     f"sequence decoding), {pipeline_bubble_fraction(p, 32):.0%} with 32")
    lines.append("(the formula, computed; tensor parallelism keeps every device busy on every token and "
                 "pays an all-reduce per layer instead)")
    return Evidence(supports=0 if pipeline_bubble_fraction(4, 1) > 0.5 else 1, lines=lines)


# -- 7. KV offload costs latency ---------------------------------------------------------------------------

PCIE5_X16_BYTES_S = 50e9  # effective host<->device bandwidth of PCIe Gen 5 x16, an H200 host's link (64 GB/s
#                           per direction peak, about 50 in practice): a stated figure
H200_HBM_BYTES_S = 4.8e12  # NVIDIA's H200 datasheet figure


def check_kv_offload(ctx: RecapContext, context_tokens: int = 4096) -> Evidence:
    """Bytes of one sequence's KV (from the model's shape) moved over PCIe instead of read from HBM.
    The bandwidths are stated figures, so the ratio is computed; the host copy below is measured."""
    cfg = ctx.llm.llm_engine.model_config.config
    per_token = memory.kv_bytes_per_token(cfg, "bfloat16")
    total = per_token * context_tokens
    pcie_ms = total / PCIE5_X16_BYTES_S * 1e3
    hbm_ms = total / H200_HBM_BYTES_S * 1e3
    src, dst = torch.ones(total // 4), torch.zeros(total // 4)
    dst.copy_(src)  # first touch of the pages, not counted
    t0 = time.perf_counter()
    dst.copy_(src)
    host_ms = (time.perf_counter() - t0) * 1e3
    lines = [f"KV of one {context_tokens}-token sequence (bf16): {memory.human_bytes(total)}",
             f"read from H200 HBM: {hbm_ms:.3f} ms; over PCIe Gen 5 x16: {pcie_ms:.2f} ms "
             f"({pcie_ms / hbm_ms:.0f}x, computed from stated bandwidths)",
             f"one host-memory copy of it on this machine: {host_ms:.2f} ms (measured)"]
    return Evidence(supports=1 if pcie_ms > 10 * hbm_ms else 0, lines=lines)


# -- 8. sampling vs beam search -------------------------------------------------------------------------

def check_sampling_vs_beam(ctx: RecapContext, prompt: str = "Once upon a time", seeds=(1, 2, 3)) -> Evidence:
    """Seeded sampling at temperature 1 gives different continuations; beam search gives the same output on
    every run."""
    from minfer import BeamSearchParams

    llm = ctx.llm
    sampled = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=12))[0].outputs[0].text
               for s in seeds]
    runs = [llm.beam_search([{"prompt": prompt}], BeamSearchParams(beam_width=2, max_tokens=12))[0]
            .sequences[0].text for _ in range(2)]
    kind = "beam search (width 2)"
    lines = [f"sampling, seeds {list(seeds)}: {len(set(sampled))} distinct outputs: {sampled}",
             f"{kind}, two runs: {'identical' if runs[0] == runs[1] else 'different'}: {runs[0]!r}"]
    ok = len(set(sampled)) > 1 and runs[0] == runs[1]
    return Evidence(supports=0 if ok else 1, lines=lines)


# -- 9. kernels: the same math, less memory traffic ---------------------------------------------------------

def rms_norm_passes(fused: bool) -> tuple[int, int]:
    """(tensor-sized reads, writes) of RMSNorm over x: unfused as torch's separate ops
    (x², mean, rsqrt·x, ·w each a kernel that reads and writes a full tensor), fused as one pass."""
    return (1, 1) if fused else (3, 2)  # x*x (r x, w x²), x*rsqrt (r x, w y), y*w (r y, w out); mean is a row


def check_kernels(ctx: RecapContext, rows: int = 4096) -> Evidence:
    """Fused and unfused RMSNorm compute the same numbers; the fused one moves fewer bytes (counted), and
    the timing (printed, not compared) shows what that is worth on this machine."""
    cfg = ctx.llm.llm_engine.model_config.config
    h = cfg.hidden_size
    x = torch.randn(rows, h)
    w = torch.randn(h)
    eps = cfg.rms_norm_eps

    def unfused(x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def fused(x):
        return torch.nn.functional.rms_norm(x, (h,), w, eps)

    diff = float((unfused(x) - fused(x)).abs().max())
    times = {}
    for name, f in (("unfused", unfused), ("fused", fused)):
        f(x)
        t0 = time.perf_counter()
        for _ in range(10):
            f(x)
        times[name] = (time.perf_counter() - t0) / 10 * 1e6
    bytes_of = {k: sum(rms_norm_passes(k == "fused")) * x.numel() * 4 for k in times}
    lines = [f"max |unfused − fused| = {diff:.1e} (the same math)",
             f"bytes moved for a [{rows}, {h}] float32 x: unfused {memory.human_bytes(bytes_of['unfused'])}, "
             f"fused {memory.human_bytes(bytes_of['fused'])} (counted)",
             f"time: unfused {times['unfused']:.0f} µs, fused {times['fused']:.0f} µs (measured, this machine)"]
    return Evidence(supports=1 if diff < 1e-4 and bytes_of["fused"] < bytes_of["unfused"] else 0, lines=lines)


# -- 10. fused sampling ------------------------------------------------------------------------------------

def check_fused_sampling(ctx: RecapContext, draws: int = 256) -> Evidence:
    """The fused kernel (`minfer.kernels.fused_sample`, one pass from logits to token) draws from the same
    top-k/top-p distribution as the unfused torch sampler: both histograms against the exact one."""
    from minfer.kernels import fused_sample
    from minfer.sampling import apply_top_k_top_p

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    v = logits.numel()
    top_k, top_p, temp = 5, 0.9, 0.8
    exact = apply_top_k_top_p((logits / temp)[None], torch.tensor([top_k]), torch.tensor([top_p]))[0].softmax(-1)
    rows = logits.expand(draws, v).contiguous()
    g = torch.Generator().manual_seed(0)
    fused = fused_sample(rows, torch.full((draws,), temp), torch.full((draws,), top_k),
                         torch.full((draws,), top_p), generator=g)
    unfused = torch.multinomial(exact.expand(draws, v), 1, generator=g).squeeze(1)

    def tv(tokens):
        return 0.5 * float((torch.bincount(tokens, minlength=v) / draws - exact).abs().sum())

    tv_f, tv_u = tv(fused), tv(unfused)
    outside = int((exact[fused] == 0).sum())
    noise = math.sqrt(v / draws)  # the scale of total variation expected from sampling noise alone
    lines = [f"exact distribution after top-k={top_k}, top-p={top_p}, T={temp}: "
             + " ".join(f"{p:.2f}" for p in exact.tolist()),
             f"{draws} draws: total variation from it: fused kernel {tv_f:.3f}, torch sampler {tv_u:.3f} "
             f"(noise scale {noise:.2f}); fused draws outside the kept set: {outside}"]
    return Evidence(supports=0 if outside == 0 and tv_f < noise else 1, lines=lines)


QUESTIONS: tuple[Question, ...] = (
    Question("rope", "chapter 2, §2", "With RoPE, the attention score between a query at position m and a key "
             "at position n depends on ...",
             ("m and n separately, like an absolute position embedding", "only the distance n − m",
              "neither: RoPE only changes the values V"), 1,
             "RoPE rotates q and k by angles proportional to their positions, so their dot product keeps only "
             "the difference. Absolute embeddings are added to the input once; RoPE acts on Q/K in every layer. "
             "A model uses one or the other: Llama, Qwen and SmolLM2 have no absolute table, GPT-2 has only one.",
             check_rope),
    Question("max_model_len", "chapter 1, §10", "max_model_len is 4096 and the prompt has 3000 tokens. The "
             "largest max_tokens the engine accepts is ...", ("4096", "1096", "3000"), 1,
             "max_model_len bounds prompt + output together; the prompt's own length is the sequence length so "
             "far.", check_max_model_len),
    Question("prefix_cache", "chapter 11", "Two users in different conversations send the same system prompt. "
             "Does the prefix cache save the second one's prefill of it?",
             ("yes: blocks are named by their content, not by a session",
              "no: only a per-session KV cache keeps K/V, and only for the same conversation"), 0,
             "A prefix cache is content-addressed and shared across requests; the per-session KV cache is the "
             "one request's own past.", check_prefix_cache),
    Question("gqa", "chapter 4", "Where is the number of query heads per K/V head (the GQA group) set?",
             ("in the model's config and trained weights; a server flag cannot change it",
              "by the serving engine at start-up, to trade quality for memory"), 0,
             "num_attention_heads and num_key_value_heads in config.json fix the K/V projection's shape.",
             check_gqa),
    Question("parallel_loading", "chapter 9", "vLLM's --max-parallel-loading-workers ...",
             ("splits the model across workers (a kind of model parallelism)",
              "only reads weight files in parallel at start-up; it changes load time, not how the model runs"), 1,
             "It is load-time I/O; tensor and pipeline parallelism are separate flags.", check_parallel_loading),
    Question("pp_vs_tp", "chapter 12", "Why is tensor parallelism usually preferred over pipeline parallelism "
             "for inference?",
             ("token-by-token decode leaves pipeline stages idle (bubbles) that training hides with many "
              "micro-batches", "pipeline parallelism cannot split a model's layers"), 0,
             "With one micro-batch in flight, p − 1 of p stages wait at every step.", check_pp_vs_tp),
    Question("kv_offload", "chapter 3, §8", "Offloading the KV cache to CPU memory or NVMe ...",
             ("is free, because only the GPU's compute matters",
              "is for emergencies: every step that needs the K/V pays for moving it over PCIe"), 1,
             "Keep KV on the device; swap only under memory pressure (minfer's swap preemption).",
             check_kv_offload),
    Question("sampling_vs_beam", "chapter 7", "Which is true of sampling and beam search?",
             ("sampling is fast and diverse; beam search is slower and deterministic",
              "beam search is faster, because it keeps fewer candidates"), 0,
             "Beam search scores several beams per step; sampling draws one token from the distribution.",
             check_sampling_vs_beam),
    Question("kernels", "chapter 4", "Two kernels compute the same RMSNorm. What usually decides which is faster?",
             ("the number of FLOPs, which differs between them",
              "memory traffic: fusion, tiling and access order, since the math is the same"), 1,
             "Normalization is memory-bound; a fused kernel reads x once and writes once.", check_kernels),
    Question("fused_sampling", "chapter 4, §7", "Fused sampling ...",
             ("draws the token from the filtered softmax in one kernel, with the same distribution",
              "approximates top-k/top-p to save time, so its distribution differs"), 0,
             "It saves kernel launches and memory passes, not exactness.", check_fused_sampling),
)
