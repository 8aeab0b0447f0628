"""minfer: a readable, tested LLM inference engine that is also a course.

The public surface is vLLM's offline API: `LLM`, `SamplingParams`, `BeamSearchParams`, `RequestOutput`.
"""

import os
import sys

# How an OpenMP thread waits at a barrier. Read once, when torch loads its OpenMP runtime, so it must be set
# before `import torch`; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
#
# Offline (LLM, notebooks, benchmarks): spin for GOMP_SPINCOUNT=10000 iterations (about 10-50 us here), then
# sleep. The two threads of a decode step's split matmuls (minfer/model/layers.py) stay awake across the
# short gaps between matmuls; sleeping and waking them costs more than a small matmul (measured: 1.5x slower
# decode). libgomp's default spins 30x longer, which wastes whole time slices when another process needs
# the core (measured: up to 5x slower decode on a busy 2-core machine).
#
# The server (`python -m minfer.serve`) always shares its cores: with its HTTP threads and, in benchmarks,
# with its clients. There a waiting thread sleeps at once (PASSIVE): measured on 2 cores with 32 streaming
# clients, 117 vs 110 output tok/s.
#
# MINFER_OMP_DEFAULT names the variable minfer itself set, so that a process started from this one (a test
# or a benchmark starting the server) chooses again instead of inheriting the choice as if it were the user's.
_inherited = os.environ.pop("MINFER_OMP_DEFAULT", None)
if _inherited:
    os.environ.pop(_inherited, None)
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    _name, _value = (("OMP_WAIT_POLICY", "PASSIVE") if "minfer.serve" in getattr(sys, "orig_argv", ())
                     else ("GOMP_SPINCOUNT", "10000"))
    os.environ[_name] = _value
    os.environ["MINFER_OMP_DEFAULT"] = _name

if "TRITON_INTERPRET" not in os.environ:
    # Triton reads this when it is first imported (transformers may import it before minfer.kernels does):
    # without a GPU, kernels run in Triton's interpreter on the CPU.
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from minfer.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from minfer.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch models and transformers: import it lazily so `import minfer` stays fast.
    if name == "LLM":
        from minfer.beam_search import llm_beam_search
        from minfer.llm import LLM

        LLM.beam_search = llm_beam_search  # vLLM's LLM.beam_search, attached from its own module
        return LLM
    if name == "LLMEngine":
        from minfer.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence"]
