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
from turboquant.widths import AFFINE_BITS, ALLOWED_COMPONENT_BITS, ALLOWED_KV_BITS  # the quantizer owns the widths


#: JSON types a ``fields: {name: type}`` entry may name.
FieldType = Literal["string", "number", "integer", "boolean", "array", "object"]
#: How ``format: json`` answers are decoded; part of their config hash.
JSON_DECODING = "json-constrained"


#: Task keys added after records existed: in the config hash only when set.
SAMPLING_KEYS = ("top_p", "min_p", "top_k", "repetition_penalty", "repetition_context_size")


class _Spec(BaseModel):
    # strict: a YAML value of the wrong type is an error, not converted
    # (``max_tokens: true`` read as 1, ``strict: "yes"`` as True); integers
    # still stand for floats (``kv_bits: 4``).  Keys only by their written
    # name (``schema``, never the attribute ``schema_``).
    model_config = ConfigDict(extra="forbid", strict=True)


class TaskSpec(_Spec):
    """One question asked of every document (the document is prefilled once)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="unique within the job; part of each record's key")
    prompt: str = Field(min_length=1, description="the question asked after the document")
    max_tokens: int = Field(256, gt=0, description="answer budget in tokens")
    temperature: float = Field(0.0, ge=0, description="0 = greedy (reproducible)")
    # Sampling filters and the repetition penalty follow mlx-lm's
    # (sample_utils); unset, they stay out of the config hash, so records
    # written before they existed keep their keys.
    top_p: float | None = Field(None, gt=0, le=1, description="sampling: draw from the likeliest tokens that together "
                                "reach this probability (needs temperature > 0)")
    min_p: float | None = Field(None, gt=0, lt=1, description="sampling: drop tokens less likely than this times the "
                                "likeliest one (needs temperature > 0)")
    top_k: int | None = Field(None, gt=0,
                              description="sampling: draw from the k likeliest tokens (needs temperature > 0)")
    repetition_penalty: float | None = Field(
        None, gt=0, description="above 1 discourages tokens of the answer's last repetition_context_size tokens "
        "(their logits divided by it, negative ones multiplied); greedy or sampled")
    repetition_context_size: int | None = Field(
        None, gt=0, description="answer tokens the repetition penalty looks back over (default 20, as mlx-lm)")
    format: Literal["text", "json"] = Field(
        "text", description="json: decoding is constrained to valid JSON (the schema below), the record gets `parsed`")
    fields: list[str] | dict[str, FieldType] | None = Field(
        None, description="json: the keys the answer must have, as a list (string values) or {name: JSON type}")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="json: a JSON Schema the answer must satisfy (wins over fields)")

    @field_validator("fields", "schema_")
    @classmethod
    def _fields_need_json(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("format") != "json":
            raise ValueError("only meaningful with format: json")
        return v

    @field_validator("top_p", "min_p", "top_k")
    @classmethod
    def _filters_need_sampling(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("temperature"):
            raise ValueError("only meaningful with temperature > 0 (temperature 0 takes the likeliest token)")
        return v

    @field_validator("repetition_context_size")
    @classmethod
    def _context_needs_penalty(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and info.data.get("repetition_penalty") is None:
            raise ValueError("only meaningful with repetition_penalty")
        return v

    def hash_fields(self) -> dict[str, Any]:
        """What of this task enters its config hash.

        A ``format: json`` answer is decoded under a JSON constraint, so its
        hash carries the decoding mode (answers decoded freely by an older
        version are redone); ``schema`` enters only when set, so text tasks
        keep the keys they always had.
        """
        out = self.model_dump(exclude={"schema_"})
        for key in SAMPLING_KEYS:
            if out[key] is None:
                del out[key]
        if self.schema_ is not None:
            out["schema"] = self.schema_
        if self.format == "json":
            out["decoding"] = JSON_DECODING
        return out


class ModelSpec(_Spec):
    """``path``: a local model folder, a hub id (``org/name``), or None for the built-in default.

    After :func:`load_job` a local path is absolute (resolved against the job
    file's folder); a hub id is left as written.
    """

    path: str | None = Field(None, description="local model folder or hub id (org/name); unset = built-in default")


class CacheSpec(_Spec):
    """The KV cache: scheme and widths, parsed and checked here so the engine only reads them."""

    kv_quant_scheme: Literal["turboquant", "fp16", "affine"] = Field("turboquant", description="KV cache storage")
    kv_bits: float = Field(None, validate_default=True,
                           description="turboquant: 2, 2.5, 3, 3.5, 4 (2.5 = 3-bit keys/2-bit values, 3.5 = 4/3; "
                                       "default 3.5); affine: 2, 3, 4, 5, 6, 8 (default 4)")
    key_bits: int | None = Field(None, description="turboquant: key bits 1-4, overriding kv_bits' split")
    value_bits: int | None = Field(None, description="turboquant: value bits 1-4, overriding kv_bits' split")
    window: int = Field(128, ge=0, description="turboquant: most recent tokens kept exact")
    # "tcq": trellis-coded TurboQuant (same bytes, ~0.75x the attention error
    # of "scalar" on Gaussian K/V, 14-30x slower to quantize, no GPU kernels:
    # docs/architecture.md says why).
    quantizer: Literal["scalar", "tcq"] = Field("scalar", description="turboquant: scalar, or tcq (trellis-coded)")
    prefill_chunk: int = Field(512, gt=0, description="tokens per prefill step (bounds peak memory)")

    # Field validators (not one model validator) so the error names the exact key.
    @field_validator("kv_bits", mode="before")
    @classmethod
    def _default_kv_bits(cls, v: Any, info: ValidationInfo) -> Any:
        """Unset: the scheme's usual width (3.5 has no affine form)."""
        if v is None:
            return 4 if info.data.get("kv_quant_scheme") == "affine" else 3.5
        return v

    @field_validator("kv_bits")
    @classmethod
    def _check_kv_bits(cls, v: float, info: ValidationInfo) -> float:
        scheme = info.data.get("kv_quant_scheme")
        if scheme == "turboquant" and v not in ALLOWED_KV_BITS:
            allowed = ", ".join(f"{b:g}" for b in ALLOWED_KV_BITS)
            raise ValueError(f"{v:g} is not allowed with turboquant; choose one of {allowed}")
        if scheme == "affine" and v not in AFFINE_BITS:
            raise ValueError(f"{v:g} is not allowed with affine; choose one of {', '.join(map(str, AFFINE_BITS))}")
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

    max_tokens: int = Field(8192, gt=0, description="document context limit in tokens (capped at the model's own)")
    overflow: Literal["error", "truncate"] = Field(
        "truncate", description="a document over max_tokens: truncated (stated in the record) or an error record")
    images: Literal["auto", "ocr", "always", "never"] = Field(
        "auto", description="pages without a text layer: auto = images to a VLM, OCR'd text to a text-only model; "
        "ocr = always OCR'd text; always = every page as an image; never = text layer only")
    dpi: int = Field(72, ge=18, le=600, description="resolution of rendered page images")
    pages: str | None = Field(None, description="page ranges, e.g. '1-20,35,-5' (-1 = last page)")
    page_retries: int = Field(1, ge=0, description="retries of a page that fails to extract before it is skipped")
    max_failed_page_fraction: float = Field(
        0.25, ge=0, le=1, description="more skipped pages than this fraction fail the document")
    page_markers: bool = Field(True, description="'[Page N]' before each page so answers can cite pages")

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

    path: str | None = Field(None, description="store folder (relative to the job file); unset = $TQPIPE_HOME/doc-caches, else ~/.cache/tqpipe/doc-caches")
    max_gb: float = Field(20.0, ge=0, description="size cap: least recently used entries are evicted first; 0 turns the store off")


class EngineSpec(_Spec):
    """Where documents run: locally, or on Ray with these workers and retry bounds.

    ``workers`` None: one actor per GPU of the cluster (2 CPU actors where it
    has none); ``gpus_per_worker`` None: 1 where there are GPUs, 0 forces CPU
    actors (``pipeline.run.ray_resources``).
    """

    kind: Literal["local", "ray"] = Field("local", description="local, or ray (a cluster, see docs/ray.md)")
    address: str | None = Field(None, description="ray: cluster address ('auto', 'ray://host:10001'); unset = local Ray")
    workers: int | None = Field(None, ge=1, description="ray: worker actors, one model each; unset = one per GPU (2 CPU actors without GPUs)")
    gpus_per_worker: float | None = Field(None, ge=0, description="ray: GPUs per actor; unset = 1 where the cluster has GPUs, 0 forces CPU actors")
    max_retries: int = Field(2, ge=0, description="ray: retries of a document whose worker died")
    max_in_flight_per_worker: int = Field(2, ge=1, description="ray: documents queued per worker")


class ImageSetInput(_Spec):
    """``{images: folder-or-glob}``: ONE document of all matching images, natural sort."""

    images: str = Field(min_length=1, description="a folder or glob of images: one document, natural sort")


class JobSpec(_Spec):
    """A whole job file as validated; the root of every key ``load_job`` reports."""

    name: str = Field(min_length=1, description="the job's name, in every record")
    # May be empty for ``tqpipe watch`` (documents come from the inbox);
    # ``load_job`` rejects an empty list for every other command.
    inputs: list[str | ImageSetInput] = Field(
        default_factory=list, description="files, folders, globs (relative to the job file), or {images: folder}")
    model: ModelSpec = Field(ModelSpec(), description="which model")
    cache: CacheSpec = Field(CacheSpec(), description="the KV cache")
    context: ContextSpec = Field(ContextSpec(), description="how a document becomes a context")
    tasks: list[TaskSpec] = Field(min_length=1, description="questions asked of every document")
    output: str = Field(min_length=1, description="results file (.jsonl), relative to the job file")
    engine: EngineSpec = Field(EngineSpec(), description="where documents run")
    # Not in the config hash: it changes no output.
    strict: bool = Field(False, description="records with quality warnings count as failures for the exit code")
    cache_store: CacheStoreSpec = Field(CacheStoreSpec(), description="where prefilled document caches are kept between runs")

    @field_validator("tasks")
    @classmethod
    def _unique_names(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        seen: set[str] = set()
        for t in tasks:
            if t.name in seen:
                raise ValueError(f"task name {t.name!r} is used twice; names must be unique")
            seen.add(t.name)
        return tasks

    @field_validator("tasks")
    @classmethod
    def _answers_leave_room(cls, tasks: list[TaskSpec], info: ValidationInfo) -> list[TaskSpec]:
        # The context holds the document, the task's prompt and its answer:
        # an answer budget that fills it leaves no token for any document, and
        # every document would fail for the job file's sake.
        context = info.data.get("context")
        if context is not None:
            for i, t in enumerate(tasks):
                if t.max_tokens >= context.max_tokens:
                    raise ValueError(f"tasks[{i}].max_tokens ({t.max_tokens}) leaves no room for a document "
                                     f"within context.max_tokens ({context.max_tokens})")
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
