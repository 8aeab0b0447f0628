"""minfer: a readable, tested LLM inference engine that is also a course.

The public surface is vLLM's offline API: `LLM`, `SamplingParams`, `BeamSearchParams`, `RequestOutput`.
Importing the package changes no environment variable and does not import torch; the OpenMP settings of a
process that runs the model are made where it starts (`minfer.envs.configure_process`).
"""

from minfer.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from minfer.sampling_params import BeamSearchParams, GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch models and transformers: import it lazily so `import minfer` stays fast.
    # Both run their worker in this process: its OpenMP settings go in before they import torch.
    if name == "LLM":
        import minfer.envs as envs

        envs.configure_process("offline")
        from minfer.llm import LLM

        return LLM
    if name == "LLMEngine":
        import minfer.envs as envs

        envs.configure_process("offline")
        from minfer.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "GuidedDecodingParams", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence"]
