"""`python -m minfer.bench {decode,gemv,engine,serve,profile,spec,parallel,replicas} ...`: pick a benchmark.

- decode: batch-1 decode tokens/s, minfer vs transformers `generate()`, and the memory-bandwidth ceiling.
- gemv: batch-1 matrix-vector GB/s per weight layout (why `Linear` repacks its weights).
- engine: offline engine throughput, prefix-cache TTFT and chunked-prefill ITL (the serving engine).
- serve: a `vllm bench serve`-style client against any OpenAI-compatible server.
- profile: where one request's time goes, phase by phase and the forward by op type.
- spec: speculative decoding (n-gram, draft model) speed-up against acceptance, vs the formula.
- replicas: data-parallel replicas behind the router: prefix-cache hit rate per routing policy, 1 vs 2 replicas.
- parallel: the pipeline bubble against (p - 1)/(m + p - 1), and tensor parallelism's all-reduce cost.
"""

import importlib
import sys

_COMMANDS = {"decode": "minfer.bench.decode", "gemv": "minfer.bench.gemv", "engine": "minfer.bench.engine", "serve": "minfer.bench.serve",
             "profile": "minfer.bench.profile",
             "spec": "minfer.bench.spec", "parallel": "minfer.bench.parallel",
             "replicas": "minfer.bench.replicas"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print(__doc__.strip())
        print(f"\nusage: python -m minfer.bench {{{','.join(_COMMANDS)}}} [--help]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[argv[0]])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
