"""Weight quantization (article §5): each method is a `LinearMethod` (`minfer.model.linear_method`).

    "int8"   per-output-channel symmetric INT8, quantized at load time   (`minfer.quantization.int8`)
    "int4"   group-wise asymmetric INT4 RTN, quantized at load time      (`minfer.quantization.int4`)
    "gguf"   the GGUF file's own Q4_0 / Q4_1 blocks, repacked, never expanded to float32
                                                                          (`minfer.quantization.gguf`)

`LLM(quantization="int4", quantization_config={"group_size": 64})`; the server's `--quantization int4
--quantization-config '{"group_size": 64}'`. `get_quantization_method` turns the pair into the method every
`Linear` of the model is built with.
"""

from __future__ import annotations

import json

from minfer.model.linear_method import LinearMethodBase

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
# Names vLLM has that minfer does not build (yet): refused with a message that says so.
NOT_BUILT_METHODS = ("awq", "gptq", "fp8", "bitsandbytes", "marlin", "gptq_marlin", "awq_marlin")
# The keys each method's quantization_config accepts.
CONFIG_KEYS = {"int8": (), "int4": ("group_size",), "gguf": ()}


def parse_quantization_config(quantization: str | None, config) -> dict:
    """Validate `quantization` and its config (a dict, a JSON object string, or None) -> the config dict.

    Raises:
        ValueError: an unknown method (lists the known ones), a method that is not built, a config that is
            not a JSON object, an unknown key for the method, a config without a method, or a bad group size.
    """
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization_config is not valid JSON ({e}): give an object such as "
                             '\'{"group_size": 64}\'') from None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be a JSON object (a dict), got {type(config).__name__}")
    if quantization in (None, "none"):
        if config:
            raise ValueError(f"quantization_config={config!r} was given without a quantization method")
        return {}
    if quantization in NOT_BUILT_METHODS:
        raise ValueError(f"quantization={quantization!r} is not built in minfer yet; built: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {quantization!r}; known: {', '.join(QUANTIZATION_METHODS)}")
    unknown = sorted(set(config) - set(CONFIG_KEYS[quantization]))
    if unknown:
        allowed = ", ".join(CONFIG_KEYS[quantization]) or "none"
        raise ValueError(f"quantization_config for {quantization!r} has unknown key(s) {unknown}; allowed: {allowed}")
    if quantization == "int4":
        from minfer.quantization.int4 import INT4_GROUP_SIZES

        g = config.get("group_size", None)
        if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g not in INT4_GROUP_SIZES):
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {g!r}")
    return dict(config)


def get_quantization_method(quantization: str, config: dict | str | None,
                            fallback: LinearMethodBase) -> LinearMethodBase:
    """The `LinearMethod` for `quantization` with `config`; `fallback` runs the layers kept in float (the
    tied LM head). Raises ValueError as `parse_quantization_config`."""
    config = parse_quantization_config(quantization, config)
    if quantization == "int8":
        from minfer.quantization.int8 import Int8LinearMethod

        return Int8LinearMethod(fallback=fallback)
    if quantization == "int4":
        from minfer.quantization.int4 import DEFAULT_GROUP_SIZE, Int4LinearMethod

        return Int4LinearMethod(group_size=config.get("group_size", DEFAULT_GROUP_SIZE), fallback=fallback)
    from minfer.quantization.gguf import GGUFLinearMethod

    return GGUFLinearMethod(fallback=fallback)
