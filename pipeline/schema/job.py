"""The job schema: what to read, with which model, what to ask, where to write.

Every setting is checked here, once, when the job is loaded (pydantic,
unknown keys rejected, value ranges, ``kv_bits`` against the widths the
quantizer supports, ``pages`` syntax); everything downstream reads the
validated :class:`Job` and checks nothing again.  A ``--pages`` override
enters the job through :func:`with_pages`, the one place it is applied, so
it is part of the context spec and hence of every record key.

Pure data: reading the YAML file and checking the file system is
:mod:`pipeline.inputs.job_file`.  No mlx import: validating a job is instant.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from pipeline.errors import PageRangeError
from pipeline.schema.pages import parse_page_ranges
from turboquant.widths import ALLOWED_COMPONENT_BITS, ALLOWED_KV_BITS  # the quantizer owns the widths

AFFINE_KV_BITS = (4, 8)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSpec(_Spec):
    """One question asked of every document (the document is prefilled once)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0)
    format: Literal["text", "json"] = "text"
    fields: list[str] | None = None  # json: the keys the answer should have

    @field_validator("fields")
    @classmethod
    def _fields_need_json(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is not None and info.data.get("format") != "json":
            raise ValueError("only meaningful with format: json")
        return v


class ModelSpec(_Spec):
    """``path``: a local model folder, a hub id (``org/name``), or None for the built-in default.

    After :func:`load_job` a local path is absolute (resolved against the job
    file's folder); a hub id is left as written.
    """

    path: str | None = None


class CacheSpec(_Spec):
    """The KV cache: scheme and widths, parsed and checked here so the engine only reads them."""

    kv_quant_scheme: Literal["turboquant", "fp16", "affine"] = "turboquant"
    kv_bits: float = 3.5
    key_bits: int | None = None
    value_bits: int | None = None
    window: int = Field(128, ge=0)
    # "tcq": trellis-coded TurboQuant (same bytes, ~0.65x the attention error
    # of "scalar" on Gaussian K/V, ~90x slower to quantize, no GPU kernels).
    quantizer: Literal["scalar", "tcq"] = "scalar"
    prefill_chunk: int = Field(512, gt=0)

    # Field validators (not one model validator) so the error names the exact key.
    @field_validator("kv_bits")
    @classmethod
    def _check_kv_bits(cls, v: float, info: ValidationInfo) -> float:
        scheme = info.data.get("kv_quant_scheme")
        if scheme == "turboquant" and v not in ALLOWED_KV_BITS:
            allowed = ", ".join(f"{b:g}" for b in ALLOWED_KV_BITS)
            raise ValueError(f"{v:g} is not allowed with turboquant; choose one of {allowed}")
        if scheme == "affine" and v not in AFFINE_KV_BITS:
            raise ValueError(f"{v:g} is not allowed with affine; choose 4 or 8")
        return v

    @field_validator("quantizer")
    @classmethod
    def _check_quantizer(cls, v: str, info: ValidationInfo) -> str:
        if v != "scalar" and info.data.get("kv_quant_scheme") != "turboquant":
            raise ValueError("only applies to kv_quant_scheme: turboquant")
        return v

    @field_validator("key_bits", "value_bits")
    @classmethod
    def _check_side_bits(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return v
        if info.data.get("kv_quant_scheme") != "turboquant":
            raise ValueError("only applies to kv_quant_scheme: turboquant")
        if v not in ALLOWED_COMPONENT_BITS:
            raise ValueError(f"{v} is not allowed; choose one of {', '.join(map(str, ALLOWED_COMPONENT_BITS))}")
        return v


class ContextSpec(_Spec):
    """How a document becomes a context: limits, images, page selection, page failures."""

    max_tokens: int = Field(8192, gt=0)
    overflow: Literal["error", "truncate"] = "truncate"
    images: Literal["auto", "always", "never"] = "auto"
    dpi: int = Field(72, ge=18, le=600)
    pages: str | None = None
    page_retries: int = Field(1, ge=0)
    max_failed_page_fraction: float = Field(0.25, ge=0, le=1)
    page_markers: bool = True

    @field_validator("pages", mode="before")
    @classmethod
    def _check_pages(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # `pages: 3` in YAML is an int
        if isinstance(v, str):
            try:
                parse_page_ranges(v)
            except PageRangeError as e:
                raise ValueError(e.problem) from None
        return v


class CacheStoreSpec(_Spec):
    """Where prefilled document caches are kept between runs (``pipeline.inference.doc_cache``)."""

    path: str | None = None  # default: $TQPIPE_HOME/doc-caches, else ~/.cache/tqpipe/doc-caches
    max_gb: float = Field(20.0, ge=0)  # least recently used entries go first; 0 turns the store off


class EngineSpec(_Spec):
    """Where documents run: locally, or on Ray with these workers and retry bounds."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None
    workers: int = Field(2, ge=1)
    max_retries: int = Field(2, ge=0)
    max_in_flight_per_worker: int = Field(2, ge=1)


class ImageSetInput(_Spec):
    """``{images: folder-or-glob}``: ONE document of all matching images, natural sort."""

    images: str = Field(min_length=1)


class JobSpec(_Spec):
    """A whole job file as validated; the root of every key ``load_job`` reports."""

    name: str = Field(min_length=1)
    inputs: list[str | ImageSetInput] = Field(min_length=1)
    model: ModelSpec = ModelSpec()
    cache: CacheSpec = CacheSpec()
    context: ContextSpec = ContextSpec()
    tasks: list[TaskSpec] = Field(min_length=1)
    output: str = Field(min_length=1)
    engine: EngineSpec = EngineSpec()
    cache_store: CacheStoreSpec = CacheStoreSpec()

    @field_validator("tasks")
    @classmethod
    def _unique_names(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        seen: set[str] = set()
        for t in tasks:
            if t.name in seen:
                raise ValueError(f"task name {t.name!r} is used twice; names must be unique")
            seen.add(t.name)
        return tasks


@dataclass(frozen=True)
class Job:
    """A validated job and where it lives (relative paths in it resolve against ``base_dir``)."""

    spec: JobSpec
    path: Path  # the job file, absolute
    base_dir: Path  # its folder: relative paths in the job resolve here

    @property
    def output_path(self) -> Path:
        """The results file, absolute."""
        return self.resolve(self.spec.output)

    def resolve(self, p: str | Path) -> Path:
        """A path from the job file, made absolute against the job's folder."""
        p = Path(p).expanduser()
        return Path(os.path.normpath(p if p.is_absolute() else self.base_dir / p))


def with_pages(job: Job, pages: str | None) -> Job:
    """``job`` with ``context.pages`` replaced by a ``--pages`` override.

    The one place an override is applied: the CLI calls it when it loads the
    job, and the runner, Ray, watch and status only ever see the result.  It
    must live in the job's context (not a side argument) so it enters the
    config hash: output from pages 1-2 must not count as done for a later run
    over the whole document.  Raises :class:`PageRangeError` on bad syntax.
    """
    if pages is None:
        return job
    parse_page_ranges(pages)
    context = job.spec.context.model_copy(update={"pages": pages})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"context": context}))
