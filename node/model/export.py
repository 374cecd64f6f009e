"""A trained policy as a ``save_pretrained`` folder: safetensors weights, config, tokenizer, generation config.

The folder is what plain transformers (``AutoModelForCausalLM.from_pretrained(folder)``), vLLM
and ``hivespec join --model folder`` read. The model passed in already holds the trained
weights (`hivespec.node.export` restores them into the base architecture); this module only
casts and writes, because it is transformers that knows the folder layout.

The generation config names every token the node stopped completions at (`stop_token_ids`),
so ``generate`` on the exported model stops where the node's rollouts stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hivespec.node.model.loader import stop_token_ids
from hivespec.node.model.progress_bars import bars_fit_for_a_log

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, *, dtype: str = "float32") -> list[Path]:
    """Write ``model`` (cast to ``dtype``) and ``tokenizer`` into ``out`` with ``save_pretrained``; the files written.

    ``out`` must exist and be empty (the caller stages and renames it). The model is cast in
    place: callers pass a copy they no longer train.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    model = model.to(EXPORT_DTYPES[dtype]).eval()
    generation = _generation_config(model, tokenizer)
    model.generation_config = generation
    with bars_fit_for_a_log():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "generation_config.json").is_file():  # a model class that cannot generate skips it
        generation.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    if not any(out.glob("*.safetensors")) or "architectures" not in config:
        raise RuntimeError(f"save_pretrained wrote no safetensors weights or no architecture into {out}")
    return sorted(p for p in out.iterdir() if p.is_file())


def _generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """The base model's generation config with the node's stop tokens as ``eos_token_id``."""
    base = getattr(model, "generation_config", None)
    generation = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig.from_model_config(model.config)
    stops = list(stop_token_ids(tokenizer, base))
    if stops:
        generation.eos_token_id = stops[0] if len(stops) == 1 else stops
    if generation.pad_token_id is None and tokenizer.pad_token_id is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    return generation
