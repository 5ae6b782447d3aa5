"""The job file's JSON Schema and its reference page, both generated from :mod:`pipeline.schema.job`.

The pydantic models are the one place a key, its type, its default and its
description live; ``tqpipe schema job`` prints their JSON Schema and
``tqpipe schema job --markdown`` the reference page checked in as
``docs/job-file.md`` (a test regenerates it and compares, so the page is
never stale).
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pipeline.schema.job import JobSpec

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# Section titles beyond the key itself
_TITLES = {"": "top level", "tasks[]": "tasks[] (each task)", "inputs[]": "inputs[] ({images: ...} entries)"}


def job_json_schema() -> dict:
    """JSON Schema (draft 2020-12) of a job file."""
    return {"$schema": DRAFT, **JobSpec.model_json_schema(by_alias=True)}


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is list:
        (arg,) = typing.get_args(ann)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        k, v = typing.get_args(ann)
        return f"mapping {_type_name(k)} → {_type_name(v)}"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "mapping"
    return getattr(ann, "__name__", str(ann))


def _default(field: Any) -> str:
    if field.is_required():
        return "**required**"
    value = field.default
    if value is PydanticUndefined:
        return ""
    if isinstance(value, BaseModel):
        return "(see below)"
    if value is None and field.validate_default:  # filled in by a validator (e.g. per scheme): the meaning says how
        return "(see meaning)"
    return f"`{json.dumps(value)}`"


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        rows.append((f"{prefix}{key}", _type_name(field.annotation), _default(field), field.description or ""))
    return rows


def models_in(ann: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (directly, in a list or a union)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for a in typing.get_args(ann) for m in models_in(a)]


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """``("", JobSpec)``, then every sub-mapping of the job in field order
    (``key`` or ``key[]`` for a list), read off the schema so no key can be
    left out of the page."""
    out: list[tuple[str, type[BaseModel]]] = [("", JobSpec)]
    for name, field in JobSpec.model_fields.items():
        key = field.alias or name
        listed = typing.get_origin(field.annotation) is list
        out += [(f"{key}[]" if listed else key, m) for m in models_in(field.annotation)]
    return out


def job_reference_markdown() -> str:
    """The job-file reference page: every key with its type, default and meaning."""
    sections = _sections()
    out = [
        "# Job file reference",
        "",
        "Generated from `pipeline/schema/job.py` by `tqpipe schema job --markdown`; do not edit by hand.",
        "The machine-readable form is `tqpipe schema job` (JSON Schema); unknown keys are refused.",
        "Command-line flags override some keys: `--model`, `--kv-bits`, `--kv-quant-scheme`,",
        "`--kv-key-bits`, `--kv-value-bits`, `--max-tokens`, `--prompt`, `--output`, `--pages`.",
        "",
    ]
    for prefix, model in sections:
        out += [f"## {_TITLES.get(prefix, prefix)}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        dotted = f"{prefix}." if prefix else ""
        out += [f"| `{k}` | {t} | {d} | {m} |" for k, t, d, m in _rows(model, dotted)]
        out.append("")
    return "\n".join(out)
