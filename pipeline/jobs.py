"""Job files: the YAML that says what to read, with which model, and what to ask.

A job is validated completely before anything expensive happens: schema
(pydantic, unknown keys rejected), value ranges, and the file system (every
input must match something, a local model directory must exist).  Any
problem becomes ONE :class:`~pipeline.errors.JobFileError` whose message
names the job file, the key and the problem, e.g.::

    jobs/x.yaml: tasks[1].max_tokens: must be greater than 0 (got -5)

Paths inside a job file are relative to the job file's folder, so a cron job
behaves the same whatever its working directory.  This module imports no
model code (no mlx): validating a job must stay instant.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from .errors import JobFileError, PageRangeError
from .pages import parse_page_ranges

try:  # the quantizer owns the list of widths; fall back if it is not there yet
    from turboquant.widths import ALLOWED_COMPONENT_BITS, ALLOWED_KV_BITS
except ImportError:  # pragma: no cover
    ALLOWED_KV_BITS, ALLOWED_COMPONENT_BITS = (2, 2.5, 3, 3.5, 4), (1, 2, 3, 4)

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
    kind: Literal["local", "ray"] = "local"
    address: str | None = None
    workers: int = Field(2, ge=1)
    max_retries: int = Field(2, ge=0)
    max_in_flight_per_worker: int = Field(2, ge=1)


class ImageSetInput(_Spec):
    """``{images: folder-or-glob}``: ONE document of all matching images, natural sort."""

    images: str = Field(min_length=1)


class JobSpec(_Spec):
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
    spec: JobSpec
    path: Path  # the job file, absolute
    base_dir: Path  # its folder: relative paths in the job resolve here

    @property
    def output_path(self) -> Path:
        return self.resolve(self.spec.output)

    def resolve(self, p: str | Path) -> Path:
        """A path from the job file, made absolute against the job's folder."""
        p = Path(p).expanduser()
        return Path(os.path.normpath(p if p.is_absolute() else self.base_dir / p))


def load_job(path: str | Path, *, check_inputs: bool = True) -> Job:
    """Read, validate and check a job file; raise :class:`JobFileError` on any problem.

    ``check_inputs=False`` skips only the "every input matches something"
    check, for ``tqpipe watch``: its documents come from the inbox, so an
    empty (or not yet created) inputs folder is normal there.  Schema,
    output and model checks still apply.
    """
    path = Path(path)
    shown = str(path)
    if not path.is_file():
        raise JobFileError(shown, None, "job file not found" if not path.exists() else "not a file")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except OSError as e:
        raise JobFileError(shown, None, f"cannot read job file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JobFileError(shown, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.MarkedYAMLError as e:
        raise JobFileError(shown, None, _yaml_problem(e)) from None
    except yaml.YAMLError as e:
        raise JobFileError(shown, None, f"invalid YAML: {e}") from None
    if data is None:
        raise JobFileError(shown, None, "job file is empty")
    if not isinstance(data, dict):
        raise JobFileError(shown, None, f"top level must be a mapping of keys, got {type(data).__name__}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        key, problem = _first_problem(e)
        raise JobFileError(shown, key, problem) from None
    job = Job(spec=spec, path=path.resolve(), base_dir=path.resolve().parent)
    _check_filesystem(job, shown, check_inputs=check_inputs)
    return job


# -- filesystem checks ------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _check_filesystem(job: Job, shown: str, *, check_inputs: bool = True) -> None:
    from .ingest import expand_input  # lazy: ingest imports this module

    for i, item in enumerate(job.spec.inputs):
        key = f"inputs[{i}]" if isinstance(item, str) else f"inputs[{i}].images"
        try:
            refs = expand_input(job, item)
        except JobFileError as e:
            raise JobFileError(shown, key, e.problem) from None
        if not refs and check_inputs:
            raw = _raw(item)
            if any(c in raw for c in "*?[") or job.resolve(raw).exists():
                raise JobFileError(shown, key, f"{raw!r} matches no PDF or image files")
            raise JobFileError(shown, key, f"{str(job.resolve(raw))!r} does not exist")
    out = job.output_path
    if out.is_dir():
        raise JobFileError(shown, "output", f"{job.spec.output!r} is a folder; give a .jsonl file path")
    mp = job.spec.model.path
    if mp is not None:
        local = job.resolve(mp)
        if local.exists():
            job.spec.model.path = str(local)
        elif not _HUB_ID.match(mp) or mp.startswith((".", "~")):
            raise JobFileError(shown, "model.path", f"local model folder {str(local)!r} does not exist")


def _raw(item: str | ImageSetInput) -> str:
    return item if isinstance(item, str) else item.images


# -- error messages ---------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: YAML keeps the last one silently,
    which turns a copy-paste slip into a job that quietly does the wrong thing."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    what = e.problem or e.context or "invalid YAML"
    return f"invalid YAML at {where}{what}"


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "ImageSetInput") or str(part).startswith(("function-", "literal[")):
            continue  # union-branch labels pydantic adds; not keys the user wrote
        else:
            out += f".{part}" if out else str(part)
    return out


def _first_problem(e: ValidationError) -> tuple[str | None, str]:
    errors = e.errors(include_url=False)
    # A union (inputs[i]: str | {images: ...}) reports one error per branch; say it once.
    err = errors[0]
    key = _loc(err["loc"]) or None
    problem = _problem(err, key)
    others = {k for x in errors[1:] if not (k := _loc(x["loc"])).startswith(key or "\0")}
    if others:
        problem += f" (also check: {', '.join(sorted(others)[:3])}{', ...' if len(others) > 3 else ''})"
    return key, problem


def _problem(err: dict, key: str | None) -> str:
    kind, msg, value = err["type"], err["msg"], err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(err["loc"][:-1])
        return f"unknown key{f'; allowed keys: {allowed}' if allowed else ''}"
    if kind == "missing":
        return "required key is missing"
    if key and key.startswith("inputs[") and kind in ("string_type", "model_type", "model_attributes_type"):
        return f"an input must be a path/glob string or {{images: folder-or-glob}} (got {value!r})"
    msg = msg.removeprefix("Value error, ")
    msg = re.sub(r"^Input should be", "must be", msg)
    msg = re.sub(r"^String should", "must", msg)
    msg = re.sub(r"^List should", "must", msg)
    if kind not in ("value_error", "assertion_error") and not isinstance(value, (dict, list)):
        msg += f" (got {value!r})"
    return msg


def _allowed_keys(loc: tuple) -> str:
    model: Any = JobSpec
    for part in loc:
        if isinstance(part, int) or part in ("ImageSetInput", "str"):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        model = next((a for a in _flatten(ann) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return ""
    return ", ".join(model.model_fields)


def _flatten(ann: Any) -> list:
    args = getattr(ann, "__args__", None)
    if not args:
        return [ann]
    return [x for a in args for x in _flatten(a)]
