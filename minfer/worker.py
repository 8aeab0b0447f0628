"""One device's worker (vLLM's `Worker`): the model, the KV pool, the attention backend and the sampler. Each
step runs through the `ModelRunner` it is (`minfer.model_runner`: prepare inputs, run the model, sample).

    Worker(args)                  the platform (`minfer.platform`, built once by the loader), the model with its
                                  layout and ops
    .profile_forward(n)           CUDA: measure the peak activation memory of an n-token forward
    .init_kv_cache(blocks, cpu)   allocate the paged pool; pick the attention backend and the sampler
    .execute_model(batch)         one step (`ModelRunner.execute_model`): a `ModelRunnerOutput`

The scheduler and block manager stay with the engine (the driver): a worker receives a step's sequences
with their block tables and returns the sampled tokens. A rank of a tensor- or pipeline-parallel job runs a
`minfer.parallel.worker.ParallelWorker`, this class with its shard of the model and of the pool.
"""

from __future__ import annotations

import logging

import torch

from minfer.attention import ContiguousBackend, ForwardContext, get_attn_backend
from minfer.config import EngineArgs, ModelConfig
from minfer.extensions import load_verifier
from minfer.kv_cache import KVCachePool
from minfer.kv_cache_plan import kv_cache_groups, make_kv_pool
from minfer.model.loader import load_model
from minfer.model_runner import ModelRunner
from minfer.sampling import Sampler

logger = logging.getLogger("minfer.worker")


class Worker(ModelRunner):
    """The model and everything that holds device memory for it.

    Attributes:
        model, config (`ModelConfig`), source (`ModelSource`), eos_token_ids, dtype, device: the loaded model.
        pool (`KVCachePool`), backend (`AttentionBackend`), sampler: set by `init_kv_cache`.
        build_time_s: seconds spent turning batches into tensors (part of the scheduling overhead).
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                            # Triton's fused element-wise kernels with its attention; else the platform's
                            # ("auto"), the same ops as any model `load_model` gives with these kernels (the
                            # simple path's, a saved directory's round trip).
                            fused_ops="triton" if args.attention_backend == "triton" else "auto",
                            quantization=args.quantization,
                            quantization_config=args.quantization_config,
                            max_parallel_loading_workers=getattr(args, "max_parallel_loading_workers", None),
                            kernels=args.kernels, enforce_eager=args.enforce_eager)
        self.model = loaded.model
        self.config, self.source, self.eos_token_ids, self.dtype = (
            loaded.config, loaded.source, loaded.eos_token_ids, loaded.dtype)
        self.device = next(self.model.parameters()).device
        # How this device runs a step (minfer/platform.py): allocator settings now, the step runner (built now,
        # with its C++ libraries, not during the first request), the attention backend and sampler in
        # init_kv_cache.
        self.platform = loaded.platform
        self.platform.configure_allocator()
        self.step_runner = self.platform.step_runner(self.model)
        self.cuda_graphs = None  # the CUDA-graph runner, once init_kv_cache has captured it (CudaPlatform)
        self.kv_config = self.kv_cache_config(self.config)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed)
        self.pool: KVCachePool | None = None
        self.backend = None
        self.sampler: Sampler | None = None
        self.verifier = None
        self.block_size = args.block_size
        self.kv_groups = None  # the pool's layer groups when there are several (set by init_kv_cache)
        self.build_time_s = 0.0

    def kv_cache_config(self, cfg: ModelConfig) -> ModelConfig:
        """The layers and KV heads this worker's pool holds: all of them (a parallel rank holds its share)."""
        return cfg

    def profile_forward(self, num_tokens: int) -> None:
        """Run one forward of `num_tokens` tokens so the peak activation memory is measured before the KV pool
        takes the rest of the device (vLLM's profile run). Only meaningful on CUDA."""
        cfg = self.kv_config
        cache = ContiguousBackend(cfg.num_hidden_layers, num_tokens, cfg.num_key_value_heads, cfg.head_dim,
                                  self.dtype, self.device)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            self.model(ids, ForwardContext(cache, positions=torch.arange(num_tokens, device=self.device)))
        del cache
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the pool (and its CPU space), and choose the attention backend and the sampler for it.

        Raises:
            ValueError: attention_backend="cpu" where its kernel cannot run, or "triton" over a cast pool
                (16-bit K/V under a float32 model).
        """
        # One tensor per layer, all layers sharing each sequence's block table (one group). A model mixing
        # sliding-window and full layers has several layer groups, each with its own block table, over
        # `group_size` shared tensors (minfer/kv_cache_groups.py). A quantized pool (chapter 5) has a scale
        # tensor beside each K/V tensor, mapped to the layers the same way.
        self.kv_groups = groups = kv_cache_groups(self.config)
        pool_cfg = self.kv_config if groups is None else groups.pool_config(self.kv_config)
        self.pool = make_kv_pool(pool_cfg, num_blocks, self.block_size, self.dtype, self.device, num_cpu_blocks,
                                 self.args.kv_cache_dtype)
        caches, scales = self.pool.layers, self.pool.scales
        if groups is not None:  # each layer reads its group's tensor, through its group's block table
            caches, scales = groups.layer_caches(caches), None if scales is None else groups.layer_caches(scales)
        self.backend = get_attn_backend(self.args.attention_backend, caches, scales, self.pool.spec, self.dtype,
                                        platform=self.platform)
        if groups is not None:
            self.backend = groups.wrap_backend(self.backend)
        # Triton's fused sampler with its backend, the C++ one on a CPU, else torch's (the platform decides).
        self.sampler = self.platform.sampler(self.generator, self.args.attention_backend)
        # Rows carrying proposed tokens are verified, not sampled, by what the settings attach (or nothing).
        self.verifier = load_verifier(self.args, self.sampler, self.generator)
        self.build_graph_runner()

    def build_graph_runner(self) -> None:
        """CUDA graphs capture over the pool and the backend, so their runner is built after them."""
        max_len = self.args.max_model_len or self.config.max_position_embeddings
        graphs = self.platform.graph_runner(self.model, self.backend, self.args.max_num_seqs,
                                            -(-max_len // self.block_size))
        if graphs is not None:
            self.step_runner = self.cuda_graphs = graphs
