"""The model and the rollout engines: the only modules that import transformers (import-linter holds it).

- `loader.py`: `load_model` / `load_tokenizer` (the embedded SmolLM2 GGUF, a local folder, a
  Hugging Face id, or the tiny preset), `model_fingerprint`, `stop_token_ids`,
  `configure_threads`, `cache_dir`.
- `source.py`: `check_model_source` (what `model.name` may name, without torch), `ModelSourceError`;
  `device.py`: `check_device` (`model.device` against this torch and machine), `DeviceError`.
- `precision.py`: `resolve_precision` -> `PrecisionPlan` (engine dtype and trainer autocast,
  explicit, measured on this machine, or cached), `follower_engine_dtype`.
- `engine.py`: `RolloutEngine` (the interface), `TorchEngine` (keyed sampling, speculative
  verification; `from_config` reads the `rollout` section), `SamplingParams`,
  `GenerationRequest`, `Sample`, `SpeculationStats`.
- `vllm_engine.py`: `VllmEngine` (`model.engine: vllm`, CUDA only), `build_vllm_engine`.
"""
