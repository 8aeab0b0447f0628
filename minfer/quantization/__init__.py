"""Weight quantization (article §5): each method is a `LinearMethod` (`minfer.model.layers`).

    "int8"   per-output-channel symmetric INT8, quantized at load time   (`minfer.quantization.int8`);
             {"kernel": "torch"} keeps the activations in bfloat16 on a CPU too (W8A16, not the integer GEMM's W8A8)
    "int4"   group-wise asymmetric INT4 RTN, quantized at load time      (`minfer.quantization.int4`)
    "gguf"   the GGUF file's own Q4_0 / Q4_1 blocks, repacked, never expanded to float32
                                                                          (`minfer.quantization.gguf`)

`LLM(quantization="int4", quantization_config={"group_size": 64})`; the server's `--quantization int4
--quantization-config '{"group_size": 64}'`. `get_quantization_method` turns the pair into the method every
`Linear` of the model is built with.
"""

from __future__ import annotations

# The names and the validation live in `minfer.config` (shared data, which every layer may read).
from minfer.config import (  # noqa: F401
    CONFIG_KEYS,
    INT4_GROUP_SIZES,
    NOT_BUILT_METHODS,
    QUANTIZATION_METHODS,
    parse_quantization_config,
)
from minfer.model.layers import LinearMethodBase


def get_quantization_method(quantization: str, config: dict | str | None,
                            fallback: LinearMethodBase, cpu_kernel=None) -> LinearMethodBase:
    """The `LinearMethod` for `quantization` with `config`; `fallback` runs the layers kept in float (the
    tied LM head); `cpu_kernel` the CPU wing's integer GEMMs the platform hands over (kernels="auto"), None
    for the torch routes only. Raises ValueError as `parse_quantization_config`."""
    config = parse_quantization_config(quantization, config)
    if quantization == "int8":
        from minfer.quantization.int8 import Int8LinearMethod

        # {"kernel": "torch"}: weight-only (W8A16) torch route, not the integer GEMM's W8A8
        kernel = cpu_kernel if config.get("kernel", "qgemm") == "qgemm" else None
        return Int8LinearMethod(fallback=fallback, cpu_kernel=kernel)
    if quantization == "int4":
        from minfer.quantization.int4 import DEFAULT_GROUP_SIZE, Int4LinearMethod

        return Int4LinearMethod(group_size=config.get("group_size", DEFAULT_GROUP_SIZE), fallback=fallback,
                                cpu_kernel=cpu_kernel)
    from minfer.quantization.gguf import GGUFLinearMethod

    return GGUFLinearMethod(fallback=fallback, kernel=config.get("kernel", "blocks"), cpu_kernel=cpu_kernel)
