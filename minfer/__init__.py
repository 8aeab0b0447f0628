"""minfer: a readable, tested LLM inference engine that is also a course.

The public surface is vLLM's offline API: `LLM`, `SamplingParams`, `RequestOutput`.
"""

import os

# Threads that sleep at OpenMP barriers instead of spinning. With spinning (the default), a matmul whose
# two threads share the cores with anything else (a server's HTTP threads, a benchmark client, a notebook)
# waits for a descheduled thread at every barrier: measured 5x slower decode on a busy 2-core machine.
# Read once, when torch loads its OpenMP runtime, so it must be set before `import torch`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
