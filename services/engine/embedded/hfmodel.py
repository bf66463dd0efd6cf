"""Load the embedded engine's model: a Hugging Face Llama-family causal LM on its device.

Where the model comes from (the built-in one converted on first use, or a directory) and its
identity are the shared `engine.loading`; this module puts the weights on a device in a dtype,
or builds random weights from a config.json for benchmarks of shapes whose weights are not at
hand (with a fingerprint no real model shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.engine.embedded.structs import EngineConfig
from mooncake_k8s.engine.loading import (
    ModelLoadError,
    ensure_builtin,
    load_tokenizer,
    model_fingerprint,
    model_source,
    progress_bars,
    transformers_module,
)

#: Architectures whose decoder layers have the Llama shape our forward pass implements.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A Hugging Face causal LM on its device, plus what the engine needs around it."""

    model: Any
    tokenizer: Any | None
    """None only for random weights without tokenizer files: the engine then emits no text."""
    fingerprint: bytes
    served_name: str
    device: torch.device
    dtype: torch.dtype
    eos_ids: frozenset[int]


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {config.device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _TORCH_DTYPES[config.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise InvalidArgument(f"unsupported dtype {dtype}")


def _eos_ids(model: Any, tokenizer: Any | None) -> frozenset[int]:
    ids: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None)):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(val, int):
            ids.add(val)
        elif isinstance(val, list | tuple):
            ids.update(int(v) for v in val)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _check_architecture(hf_config: Any, where: str) -> None:
    mt = getattr(hf_config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgument(
            f"{where}: model_type {mt!r} is not a Llama-family decoder this engine runs "
            f"(supported: {sorted(SUPPORTED_MODEL_TYPES)})"
        )
    window = getattr(hf_config, "sliding_window", None)
    use_window = getattr(hf_config, "use_sliding_window", window is not None)
    if window and use_window and window < hf_config.max_position_embeddings:
        raise InvalidArgument(f"{where}: sliding-window attention is not supported")


def _random_model(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    tf = transformers_module()

    if config.model is None:
        path, _ = ensure_builtin(progress=False)
    else:
        path = Path(config.model)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"random_weights needs a config.json in {path}")
    hf_config = tf.AutoConfig.from_pretrained(path)
    _check_architecture(hf_config, str(path))
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        with torch.device(device):
            model = tf.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model = model.to(device)
    tokenizer = load_tokenizer(path)
    fp = model_fingerprint(b"random-weights", (path / "config.json").read_bytes())
    name = config.served_name or f"{path.name}-random"
    return LoadedModel(model.eval(), tokenizer, fp, name, device, dtype, _eos_ids(model, tokenizer))


def load_model(config: EngineConfig, progress: bool = True) -> LoadedModel:
    """Load the configured model onto its device in its dtype (see EngineConfig)."""
    tf = transformers_module()

    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    if device.type == "cpu" and config.threads:
        torch.set_num_threads(config.threads)
    if config.random_weights:
        return _random_model(config, device, dtype)
    path, fp, name = model_source(config, progress)
    try:
        _check_architecture(tf.AutoConfig.from_pretrained(path), str(path))
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise ModelLoadError(f"{path} has no tokenizer files")
        with progress_bars(progress):
            model = tf.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, device_map=str(device) if device.type == "cuda" else None
            )
    except (OSError, ValueError) as e:
        if isinstance(e, InvalidArgument):
            raise
        hint = f" (delete {path} to convert it again)" if config.model is None else ""
        raise ModelLoadError(f"could not load the model from {path}: {e}{hint}") from e
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, fp, name, device, dtype, _eos_ids(model, tokenizer))
