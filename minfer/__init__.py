"""minfer: a readable, tested LLM inference engine that is also a course.

The public surface is vLLM's offline API: `LLM`, `SamplingParams`, `RequestOutput`.
"""

import os

# How long an OpenMP thread spins at a barrier before it sleeps (libgomp's GOMP_SPINCOUNT, in spin iterations;
# about 10-50 us here). Long enough that the two threads of a decode step stay awake across the short gaps
# between its matmuls (sleeping and waking them costs more than a small matmul: measured 1.5x slower
# decode); short enough that a thread whose partner is descheduled (a server's HTTP threads, a benchmark
# client or a notebook sharing the cores) soon yields its core instead of spinning for its whole time slice
# (libgomp's default spins 30x longer: measured up to 5x slower decode on a busy 2-core machine).
# Read once, when torch loads its OpenMP runtime, so it must be set before `import torch`. A user's own
# OMP_WAIT_POLICY (PASSIVE is the safer choice on a crowded machine) or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

if "TRITON_INTERPRET" not in os.environ:
    # Triton reads this when it is first imported (transformers may import it before minfer.kernels does):
    # without a GPU, kernels run in Triton's interpreter on the CPU.
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from minfer.outputs import CompletionOutput, RequestOutput
from minfer.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch models and transformers: import it lazily so `import minfer` stays fast.
    if name == "LLM":
        from minfer.llm import LLM

        return LLM
    if name == "LLMEngine":
        from minfer.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
