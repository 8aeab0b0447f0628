"""The one architecture table: architecture name -> model class and config adapter.

Adding an architecture is one model file (a class taking `(ModelConfig, max_positions, BuildOptions)` and a
config adapter `(hf_dict, Architecture, source) -> ModelConfig`) plus one `Architecture(...)` line here.
The model module is imported only when a model of that architecture is built, so reading a config does not
import every model file.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from minfer.config import ModelConfig, check_finite_numbers


@dataclass(frozen=True)
class Architecture:
    """One supported architecture.

    Attributes:
        name: Hugging Face's name in `config.json`'s `architectures` ("LlamaForCausalLM").
        model_type: HF's `model_type`, which is also GGUF's `general.architecture` ("llama").
        module: the minfer module defining it. model_class, config_adapter: names in that module.
        traits: switches the config adapter reads (e.g. Qwen2's QKV bias).
    """

    name: str
    model_type: str
    module: str
    model_class: str
    config_adapter: str
    traits: dict = field(default_factory=dict)

    def load(self, attr: str):
        return getattr(importlib.import_module(self.module), attr)


_LLAMA = dict(module="minfer.model.llama", model_class="LlamaForCausalLM", config_adapter="llama_config")

ARCHITECTURES = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama", **_LLAMA),
    Architecture("MistralForCausalLM", "mistral", **_LLAMA),
    Architecture("Qwen2ForCausalLM", "qwen2", **_LLAMA, traits=dict(qkv_bias=True, window_opt_in=True)),
    Architecture("Qwen3ForCausalLM", "qwen3", **_LLAMA, traits=dict(qk_norm=True, window_opt_in=True)),
    Architecture("GPT2LMHeadModel", "gpt2", "minfer.model.gpt2", "GPT2LMHeadModel", "gpt2_config"),
    Architecture("BloomForCausalLM", "bloom", "minfer.model.bloom", "BloomForCausalLM", "bloom_config"),
    Architecture("Gemma3ForCausalLM", "gemma3_text", "minfer.model.gemma3", "Gemma3ForCausalLM", "gemma3_config"),
)}
_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}
# GGUF's `general.architecture` where it is not HF's model_type.
_BY_GGUF_ARCH = {**_BY_MODEL_TYPE, "gemma3": ARCHITECTURES["Gemma3ForCausalLM"]}


def find_architecture(hf: dict, source: str) -> Architecture:
    """The architecture of a parsed `config.json`: its `architectures` list first, then `model_type`.

    Raises:
        ValueError: an architecture minfer does not implement (names the source and the supported ones).
    """
    for name in hf.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    arch = _BY_MODEL_TYPE.get(hf.get("model_type", ""))
    if arch is None:
        raise ValueError(f"{source}: unsupported architecture {hf.get('architectures') or hf.get('model_type')!r}; "
                         f"minfer implements {sorted(ARCHITECTURES)}")
    return arch


def architecture_for_gguf(gguf_arch: str, source: str) -> Architecture:
    """The architecture of a GGUF file's `general.architecture`. Raises ValueError for an unsupported one."""
    if gguf_arch not in _BY_GGUF_ARCH:
        raise ValueError(f"{source}: GGUF architecture {gguf_arch!r} is not supported; minfer reads "
                         f"{sorted(_BY_GGUF_ARCH)}")
    return _BY_GGUF_ARCH[gguf_arch]


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """`ModelConfig` from a parsed HF config dict, through the architecture's adapter.

    Raises:
        ValueError: unknown architecture, a missing required field, a field out of its range
            (`config.check_model_config`), or a NaN or infinity in any field, read or not
            (`config.check_finite_numbers`); the message names `source`.
    """
    arch = find_architecture(hf, source)
    try:
        cfg = arch.load(arch.config_adapter)(hf, arch, source)
    except ValueError as exc:  # ModelConfig's own checks do not know the file: name it
        msg = str(exc)
        raise ValueError(msg if msg.startswith(source) else f"{source}: {msg}") from None
    except (TypeError, ArithmeticError) as exc:  # e.g. a string or 0 where the adapter divides
        raise ValueError(f"{source}: a field has the wrong type or value ({type(exc).__name__}: {exc})") from None
    # after the adapter, whose messages give a read field's range; this catches the fields it did not read
    check_finite_numbers(hf, source)
    return cfg


def model_class(architecture: str):
    """The `nn.Module` class that implements `architecture` (a key of `ARCHITECTURES`)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; minfer implements {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[architecture]
    return arch.load(arch.model_class)
