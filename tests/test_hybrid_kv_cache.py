"""The hybrid KV cache (minfer/kv_cache_groups.py, minfer/attention/grouped.py): one block table per layer group, local groups freed behind
their window, global groups keeping everything.

(a) The layout of Gemma 3 270M's 18 layers (5 local + 1 global groups of 3) and of a small mix.
(b) The block manager against the attention mask: while a sequence grows token by token and chunk by chunk,
    each local group holds exactly the blocks holding a key that the next query or a later one can see
    (`torch_ref.visibility_mask`), the global group every block, for block sizes 1 and 16 and windows around
    the block edges; admission counts every group; nothing leaks.
(c) A random Gemma 3 model (two local layers with a window of 8, one global layer) through the engine: greedy
    tokens on prompts longer than the window equal transformers' and the no-freeing path's, with chunked
    prefill and with preemption (recompute and swap); the blocks in use grow with the global group only.
(d) The prefix cache on the hybrid layout: a hit is the longest prefix every group serves (the local group
    holds exactly the window's blocks at the hit point), greedy tokens with the cache equal those without
    (a shared prefix longer than the window, block sizes 1 and 16, with preemption), the hit counter counts
    the shared blocks; beam search forks every group and equals transformers' beams.

    PYTHONPATH=$PWD python -m pytest -q tests/test_hybrid_kv_cache.py
"""

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.attention.grouped import KVCacheGroup, KVCacheLayout, hybrid_layout
from minfer.attention.torch_ref import visibility_mask
from minfer.config import ModelConfig
from minfer.kv_cache_groups import HybridBlockManager
from minfer.sampling_params import SamplingParams as SP
from minfer.sequence import Sequence
from tests.test_models_gpt2_bloom import hf_greedy, make_model, prompt


def _cfg(windows):
    return ModelConfig("Gemma3ForCausalLM", 512, 64, 128, len(windows), 4, 1, 16, layer_windows=tuple(windows))


def test_gemma3_layout_groups_of_three():
    layout = hybrid_layout(_cfg([None if (i + 1) % 6 == 0 else 512 for i in range(18)]))
    assert layout.group_size == 3 and layout.num_groups == 6
    assert layout.groups[0] == KVCacheGroup((5, 11, 17), None)
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert all(g.window == 512 for g in layout.groups[1:])
    assert layout.layer_slot[17] == 2 and layout.layer_group[17] == 0 and layout.layer_group[6] == 2
    assert layout.pool_config(_cfg([512] * 18)).num_hidden_layers == 3


def test_no_layout_unless_local_and_global_mix():
    assert hybrid_layout(_cfg([None, None])) is None
    assert hybrid_layout(_cfg([7, 7])) is None  # all local: freed per sequence by BlockManager
    with pytest.raises(ValueError, match="num_hidden_layers"):  # no layers is no model (ModelConfig's bounds)
        _cfg([])
    small = hybrid_layout(_cfg([8, 8, None]))
    assert small.group_size == 1 and [g.layers for g in small.groups] == [(2,), (0,), (1,)]


def needed_blocks(q: int, window: int, num_blocks: int, bs: int) -> set[int]:
    """Table indices holding a key visible to some query at position >= q (the mask decides, not a formula)."""
    queries = torch.arange(q, q + window + 2 * bs)
    keys = torch.arange(num_blocks * bs)
    seen = visibility_mask(queries, keys, window).any(0)
    return {int(k) // bs for k in keys[seen]}


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("window", [1, 7, 15, 16, 17, 32])
@pytest.mark.parametrize("chunk", [1, 5])
def test_local_groups_hold_exactly_the_readable_blocks(bs, window, chunk):
    layout = KVCacheLayout((KVCacheGroup((2,), None), KVCacheGroup((0,), window), KVCacheGroup((1,), window)), 1, 3)
    bm = HybridBlockManager(600, bs, layout)
    seq = Sequence("r", 0, list(range(3, 3 + 90)), SP(max_tokens=1), 4096)
    assert bm.can_allocate(seq, 90) == (3 * -(-90 // bs) <= 600)
    bm.allocate_prefix(seq)
    total = bm.num_free_blocks
    while seq.num_computed_tokens < 90:
        n = min(chunk, 90 - seq.num_computed_tokens)
        before = bm.num_free_blocks
        need = -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_table)
        bm.append_slots(seq, n)
        assert before - bm.num_free_blocks == 3 * need  # every group grows by the same number of entries
        seq.num_computed_tokens += n
        bm.free_out_of_window(seq)
        q, freed = seq.num_computed_tokens, bm._freed(seq)
        assert freed[0] == 0 and seq.block_table.count(0) <= 1  # the global group keeps every block
        want = needed_blocks(q, window, len(seq.block_table), bs)
        for g, table in enumerate(seq.group_block_tables, start=1):
            held = set(range(freed[g], len(table)))
            assert held == want, (g, q, sorted(held ^ want))
            for i in held:
                assert bm.blocks[table[i]].ref_count == 1
        assert bm.num_live_blocks(seq) == total - bm.num_free_blocks
    bm.free_seq(seq)
    assert bm.num_free_blocks == total and not bm.group_freed


def test_swap_out_and_in_keeps_every_group():
    layout = KVCacheLayout((KVCacheGroup((1,), None), KVCacheGroup((0,), 4)), 1, 2)
    bm = HybridBlockManager(40, 2, layout, num_cpu_blocks=40)
    seq = Sequence("r", 0, list(range(3, 23)), SP(max_tokens=1), 4096)
    bm.allocate_prefix(seq)
    bm.append_slots(seq, 20)
    seq.num_computed_tokens = 20
    bm.free_out_of_window(seq)
    assert bm.num_live_blocks(seq) == 10 + 2  # window 4, next query at 20: tokens 17.. in blocks 8, 9
    out = bm.swap_out(seq)  # only the live entries move: placeholders hold no K/V
    assert len(out) == 12 and bm.num_free_blocks == 40 and bm.can_swap_in(seq)
    back = bm.swap_in(seq)
    assert sorted(c for c, _ in back) == sorted(c for _, c in out)
    assert len(seq.block_table) == len(seq.group_block_tables[0]) == 10
    assert seq.group_block_tables[0][:8] == [0] * 8 and bm.num_live_blocks(seq) == 12
    assert bm.free_out_of_window(seq) == 0  # nothing came back that the window had released
    bm.free_seq(seq)
    assert bm.num_free_blocks == 40 and len(bm.swap.cpu_free) == 40


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    return path, make_model(path, "gemma3")  # layers 0, 1 local (window 8), layer 2 global


PROMPTS = [prompt(60 + i, n) for i, n in enumerate((5, 13, 30, 41))]
N_NEW = 10


@pytest.fixture(scope="module")
def reference(gemma):
    _, hf = gemma
    return [hf_greedy(hf, p, N_NEW) for p in PROMPTS]


CONFIGS = {
    "bs1": dict(block_size=1, kv_cache_memory_bytes=1 << 20),
    "bs16": dict(block_size=16, kv_cache_memory_bytes=1 << 20),
    "bs4-chunked": dict(block_size=4, enable_chunked_prefill=True, max_num_batched_tokens=8,
                        kv_cache_memory_bytes=1 << 20),
    # 3 groups x 1 layer x 2 x 4 tokens x 1 head x 16 x 4 bytes = 512 bytes a block: 24 blocks. With chunks of 8
    # a 51-token sequence holds up to 13 (global) + 2 x 5 (local) = 23, and the four sequences' global tables
    # alone reach 4 + 6 + 10 + 13 = 33: they cannot all run, something is preempted.
    "recompute": dict(block_size=4, kv_cache_memory_bytes=24 * 512, max_model_len=51, enable_chunked_prefill=True,
                      max_num_batched_tokens=8),
    "swap": dict(block_size=4, kv_cache_memory_bytes=24 * 512, max_model_len=51, enable_chunked_prefill=True,
                 max_num_batched_tokens=8, swap_space=0.001, preemption_mode="swap"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_equals_transformers_and_no_freeing(gemma, reference, name, monkeypatch):
    path, _ = gemma
    kw = {"max_model_len": 96, **CONFIGS[name]}
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    llm = LLM(model=str(path), attention_backend="torch", device="cpu", **kw)
    eng = llm.llm_engine
    assert isinstance(eng.block_manager, HybridBlockManager)
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert eng.all_blocks_free() and not eng.block_manager.group_freed
    if name in ("recompute", "swap"):
        assert eng.scheduler.num_preemptions > 0
    if name == "bs4-chunked":  # the same engine with freeing turned off gives the same tokens
        monkeypatch.setattr(HybridBlockManager, "free_out_of_window", lambda self, seq, window=None: 0)
        plain = LLM(model=str(path), attention_backend="torch", device="cpu", **kw)
        assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)] == reference


def _filled(bm, seq, n_tokens):
    """Compute `n_tokens` of `seq` the way the scheduler does: chunk by chunk, naming, then freeing."""
    while seq.num_computed_tokens < n_tokens:
        n = min(5, n_tokens - seq.num_computed_tokens)
        bm.append_slots(seq, n)
        seq.num_computed_tokens += n
        bm.register_computed_blocks(seq)
        bm.free_out_of_window(seq)


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 7, 8, 17])
def test_a_prefix_hit_holds_exactly_the_blocks_its_window_reads(bs, window):
    """A second sequence sharing 48 tokens hits the longest prefix every group serves; the local group gets
    the window's blocks at the hit point (the mask decides which) and placeholders before them; evicting a
    block inside that window shortens the hit to one that needs no evicted block; nothing leaks."""
    layout = KVCacheLayout((KVCacheGroup((1,), None), KVCacheGroup((0,), window)), 1, 2)
    bm = HybridBlockManager(400, bs, layout, enable_prefix_caching=True)
    shared = list(range(3, 51))
    a = Sequence("a", 0, shared + [60, 61, 62], SP(max_tokens=1), 4096)
    bm.allocate_prefix(a, bm.cached_prefix(a))
    _filled(bm, a, len(a))
    bm.free_seq(a)
    assert bm.num_free_blocks == 400  # all released, the named ones still hittable
    b = Sequence("b", 1, shared + [70, 71], SP(max_tokens=1), 4096)
    hits = bm.cached_prefix(b)
    k = len(hits)
    assert k == 48 // bs  # the whole shared prefix, in full blocks (b's 49th token differs from a's)
    want = needed_blocks(k * bs, window, k, bs) & set(range(k))
    assert {i for i, row in enumerate(hits) if row[1] != 0} == want  # local group: the window's blocks only
    chain = [h for h, _ in bm.prefix_cache.chain(b.all_token_ids)[:k]]
    assert [bm.blocks[row[0]].hash for row in hits] == [(0, h) for h in chain]  # full group: every block
    assert all(bm.blocks[hits[i][1]].hash == (1, chain[i]) for i in want)
    assert bm.can_allocate(b, len(b) - k * bs, hits)
    assert bm.allocate_prefix(b, hits) == k * bs
    assert bm.num_live_blocks(b) == k + len(want)
    _filled(bm, b, len(b))
    bm.free_seq(b)
    assert bm.num_free_blocks == 400 and not bm.group_freed
    # Evict the local group's first block inside that window: the hit must end before it ... and still be
    # one whose own window's blocks are all cached.
    if not want:
        return  # window 1: a query sees only itself, the local group needs no cached block at all
    first = min(want)
    victim = hits[first][1]
    del bm.prefix_cache.cached[bm.blocks[victim].hash]
    bm.blocks[victim].hash, bm.blocks[victim].token_ids = None, ()
    c = Sequence("c", 2, shared + [80], SP(max_tokens=1), 4096)
    short = bm.cached_prefix(c)
    assert len(short) == first  # any longer hit's window reads the evicted block; this one's is all cached
    live = needed_blocks(len(short) * bs, window, len(short), bs) & set(range(len(short)))
    assert {i for i, row in enumerate(short) if row[1] != 0} == live
    assert all(bm.blocks[row[1]].hash == (1, bm.blocks[row[0]].hash[1]) for row in short if row[1] != 0)


def test_prompt_logprobs_and_turned_off_cache_hit_nothing():
    layout = KVCacheLayout((KVCacheGroup((1,), None), KVCacheGroup((0,), 4)), 1, 2)
    for on in (True, False):
        bm = HybridBlockManager(100, 2, layout, enable_prefix_caching=on)
        a = Sequence("a", 0, list(range(3, 23)), SP(max_tokens=1), 4096)
        bm.allocate_prefix(a)
        _filled(bm, a, 20)
        bm.free_seq(a)
        again = Sequence("b", 1, list(range(3, 23)), SP(max_tokens=1), 4096)
        logprobs = Sequence("c", 2, list(range(3, 23)), SP(max_tokens=1, prompt_logprobs=1), 4096)
        assert len(bm.cached_prefix(again)) == (9 if on else 0)  # never the last token
        assert bm.cached_prefix(logprobs) == []


SHARED = prompt(90, 40)  # longer than the window (8) at every block size below
FAMILY = [SHARED + prompt(91 + i, n) for i, n in enumerate((3, 9, 17))]


@pytest.fixture(scope="module")
def family_reference(gemma):
    _, hf = gemma
    return [hf_greedy(hf, p, N_NEW) for p in FAMILY]


def _common(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("bs", [1, 16])
def test_prefix_caching_gives_the_tokens_of_no_caching(gemma, family_reference, bs):
    """Prompts sharing a 40-token prefix (window 8): the first request's blocks are hit by the later ones,
    the greedy tokens equal transformers' (and so the uncached engine's, checked above), the hit counter
    counts exactly the shared full blocks, and every block comes back."""
    path, _ = gemma
    llm = LLM(model=str(path), max_model_len=96, attention_backend="torch", device="cpu", block_size=bs,
              kv_cache_memory_bytes=1 << 20, enable_prefix_caching=True)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    first = llm.generate(FAMILY[:1], params)
    rest = llm.generate(FAMILY[1:], params)  # after the first finished: its prefix is cached
    assert [o.outputs[0].token_ids for o in first + rest] == family_reference
    st = eng.stats()
    hit = sum(_common(FAMILY[0], p) // bs * bs for p in FAMILY[1:])  # the other two share this much
    assert st.prefix_cache_hits == hit > 0
    assert st.prefix_cache_queries == sum(len(p) for p in FAMILY)
    assert st.prefix_cache_hit_rate == pytest.approx(hit / st.prefix_cache_queries)
    assert [o.num_cached_tokens for o in rest] == [_common(FAMILY[0], p) // bs * bs for p in FAMILY[1:]]
    assert eng.all_blocks_free() and not eng.block_manager.group_freed
    again = llm.generate(FAMILY, params)  # everything cached now, prompts all at once
    assert [o.outputs[0].token_ids for o in again] == family_reference
    assert eng.all_blocks_free() and not eng.block_manager.group_freed


@pytest.mark.parametrize("name", ["recompute", "swap"])
def test_prefix_caching_with_preemption_gives_the_same_tokens(gemma, reference, name):
    """The tight pools of the preemption configs, with the prefix cache on: a preempted sequence comes back
    through the cache (recompute) or from swap space, and the tokens do not change."""
    path, _ = gemma
    llm = LLM(model=str(path), attention_backend="torch", device="cpu", enable_prefix_caching=True,
              **{"max_model_len": 96, **CONFIGS[name]})
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference
    assert eng.scheduler.num_preemptions > 0 and eng.all_blocks_free() and not eng.block_manager.group_freed
    if name == "recompute":
        assert eng.stats().prefix_cache_hits > 0  # the recomputed sequences found their own blocks


@pytest.mark.parametrize("bs", [1, 16])
def test_blocks_in_use_grow_with_the_global_group_only(gemma, bs):
    path, _ = gemma
    llm = LLM(model=str(path), max_model_len=96, attention_backend="torch", device="cpu",
              kv_cache_memory_bytes=1 << 20, block_size=bs)
    eng = llm.llm_engine
    eng.add_request("a", prompt(7, 20), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        used.append(eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks)
        assert 0 <= eng.stats().fragmentation < 1
    full = -(-79 // bs)  # the global group's blocks after the last step's forward
    local = -(-8 // bs) + 1  # window 8: at most this many blocks per local group
    assert full < max(used[:-1]) <= full + 2 * local < 3 * full


@pytest.mark.parametrize("bs,caching", [(1, False), (4, False), (4, True)])
def test_beam_search_equals_transformers(gemma, bs, caching, monkeypatch):
    """Beam search on the hybrid KV cache: every group's table forks, a shared partial block is copied in
    every group before a beam writes it, blocks behind the window are released while the beams run; beams
    and scores equal transformers' on a prompt past the window, with the prefix cache on too (run twice: the
    second run hits), and every block comes back."""
    from minfer import BeamSearchParams

    released = []
    free = HybridBlockManager.free_out_of_window
    monkeypatch.setattr(HybridBlockManager, "free_out_of_window",
                        lambda self, seq, window=None: released.append(free(self, seq, window)) or released[-1])
    path, hf = gemma
    llm = LLM(model=str(path), max_model_len=96, kv_cache_memory_bytes=1 << 20, block_size=bs,
              attention_backend="torch", device="cpu", enable_prefix_caching=caching)
    ids, width, n = prompt(3, 14), 3, 8
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=width,
                      num_return_sequences=width, max_new_tokens=n, do_sample=False, early_stopping=False,
                      eos_token_id=2, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for _ in range(2 if caching else 1):
        out = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=width, max_tokens=n))[0]
        for k, beam in enumerate(out.sequences):
            hf_ids = ref.sequences[k, len(ids):].tolist()[:len(beam.output_token_ids)]
            assert beam.output_token_ids == hf_ids, k
            assert beam.score == pytest.approx(float(ref.sequences_scores[k]), abs=1e-3)
        assert llm.llm_engine.all_blocks_free() and not llm.llm_engine.block_manager.group_freed
    assert sum(released) > 0  # the local group's blocks behind the window went back during the search
    if caching:
        assert llm.llm_engine.stats().prefix_cache_hits > 0


def test_fork_and_copy_before_write_in_every_group():
    layout = KVCacheLayout((KVCacheGroup((1,), None), KVCacheGroup((0,), 4)), 1, 2)
    bm = HybridBlockManager(60, 4, layout)
    parent = Sequence("r", 0, list(range(3, 21)), SP(max_tokens=4), 4096)
    bm.allocate_prefix(parent)
    _filled(bm, parent, 18)  # 5 entries a group; the local group's first 3 released (next query at 18)
    assert bm._freed(parent) == [0, 3]
    child = Sequence("r", 1, parent.prompt_token_ids, SP(max_tokens=4), 4096)
    bm.fork(parent, child)
    child.num_computed_tokens = 18
    assert bm.tables(child) == bm.tables(parent) and bm._freed(child) == [0, 3]
    assert all(bm.blocks[b].ref_count == 2 for t, d in zip(bm.tables(child), [0, 3]) for b in t[d:])
    copies = bm.copies_before_write(child, 18)  # block 4 of both groups is shared and partial
    assert [src for src, _ in copies] == [parent.block_table[4], parent.group_block_tables[0][4]]
    assert bm.copies_before_write(child, 19) == []  # now its own
    bm.free_seq(parent)
    bm.free_seq(child)
    assert bm.num_free_blocks == 60 and not bm.group_freed


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_in_the_hybrid_layout_equals_the_simple_path(gemma, kv_cache_dtype):
    """A quantized pool (chapter 5) under the hybrid layout: each layer's scales follow its K/V tensor, so the
    engine (chunked, local groups freed) gives the simple path's tokens, whose cache quantizes the same way."""
    path, _ = gemma
    llm = LLM(model=str(path), max_model_len=96, attention_backend="torch", device="cpu", block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=8, kv_cache_memory_bytes=1 << 20,
              kv_cache_dtype=kv_cache_dtype)
    eng = llm.llm_engine
    assert isinstance(eng.block_manager, HybridBlockManager) and eng.worker.pool.scales is not None
    params = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    simple = [llm.generate_simple(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == simple
    assert eng.all_blocks_free()
