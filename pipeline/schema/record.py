"""Result record fields and keys: what a record holds and how it is identified.

A record must answer, on its own and years later, "what produced this
output?": which file (path *and* content hash), which task, which model,
cache and context settings, how long it took and how much KV memory it used.
The ``key`` ties the record to the checkpoint: a rerun skips every key that
is already in the results file, so the key must change exactly when the
output could change.  That is why it is built from the document's content
hash (renaming or moving a file does not rerun it, editing it does) and a
hash over everything that shapes one task's output (editing one task reruns
only that task).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

SCHEMA_VERSION = 1

#: Fields :func:`pipeline.output.render.make_record` sets itself; extras may not override them.
RECORD_FIELDS = (
    "schema_version", "key", "created_at", "job", "doc_id", "source",
    "content_hash", "task", "config_hash", "status", "output", "parsed",
    "parse_error", "tokens", "timing", "cache", "model", "context", "pages",
    "error", "warnings", "source_b64",
)

#: The quality warnings a record can carry in ``warnings``: stable short codes
#: (scripts and ``tqpipe status`` count them), each with what it means.  A
#: warned record is ``ok`` (the model ran, its text is kept) but the answer
#: may be wrong or incomplete; with ``strict: true`` in the job it counts as a
#: failure for the exit code.  Details live in the record's other fields (the
#: field named here).  New codes are added here, nowhere else.
WARNING_CODES: dict[str, str] = {
    "json_parse_failed": "a format: json task whose answer holds no JSON object (parse_error)",
    "json_repaired": "a format: json answer that was not valid JSON as written; json-repair read it (json.repaired)",
    "missing_fields": "a format: json answer without some of the keys the task's fields name (missing_fields)",
    "answer_truncated": "the answer stopped at the task's max_tokens, not at its end (finish_reason: length)",
    "truncated": "the document did not fit the context; trailing pages were dropped (context.truncated)",
    "pages_skipped": "pages that could not be read were left out (pages.skipped)",
    "pages_clipped": "the page selection reached past the document's end and was clipped (context.pages_clipped)",
    "no_content": "every page that went in was empty (no text, no image): the answer cannot come from the document (context.notes)",
    "text_incomplete": "the PDF reader reported damage on pages whose text was kept: parts may be missing (context.notes)",
    "random_weights": "the model has seeded random weights (the built-in tiny VLM): its answers are noise",
}


def add_warning(warnings: list[str], code: str) -> list[str]:
    """Append ``code`` to ``warnings`` once; unknown codes are a programming error."""
    if code not in WARNING_CODES:
        raise ValueError(f"unknown warning code {code!r}; add it to pipeline.schema.record.WARNING_CODES")
    if code not in warnings:
        warnings.append(code)
    return warnings


_CONFIG_HASH_CHARS = 16  # 64 bits: collisions between configs are not a concern


def json_default(obj: Any) -> Any:
    """orjson ``default``: turn config objects, paths and array scalars into
    plain JSON values (shared by hashing and the results writer)."""
    if hasattr(obj, "model_dump"):  # pydantic models (TaskSpec, CacheSpec, ...)
        return obj.model_dump(mode="json")
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / mlx scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot serialize {type(obj).__name__} to JSON")


def _normalize(obj: Any) -> Any:
    """Make equal configs serialize equally: ``3`` and ``3.0`` are the same
    kv_bits whether they came from YAML, pydantic or a test literal."""
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): _normalize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_normalize(v) for v in obj]
    if hasattr(obj, "model_dump") or isinstance(obj, (set, frozenset, Path)):
        return _normalize(json_default(obj))
    return obj


def canonical_json(obj: Any) -> bytes:
    """Key-sorted, whitespace-free JSON: the same config always hashes the same."""
    return orjson.dumps(_normalize(obj), default=json_default, option=orjson.OPT_SORT_KEYS)


def task_config_hash(task: dict, *, model: str, cache: dict, context: dict) -> str:
    """Short stable hash of everything that changes one task's output.

    Covers the task's own fields (prompt, max_tokens, temperature, format,
    fields), the model name, the cache spec (scheme and bit widths change the
    numbers) and the context spec (page ranges, image policy, limits).  Other
    tasks of the job are deliberately NOT included, so editing one task
    reruns only that task.  Pydantic models are accepted as well as dicts.
    """
    payload = {"task": task, "model": model, "cache": cache, "context": context}
    return hashlib.sha256(canonical_json(payload)).hexdigest()[:_CONFIG_HASH_CHARS]


def record_key(content_hash: str, task_name: str, config_hash: str) -> str:
    """The checkpoint key ``<content_hash>/<task>/<config_hash>``.

    Readable on purpose (grep a results file for a task name); unambiguous
    because both hashes are fixed hex strings without ``/``.
    """
    for name, value in (("content_hash", content_hash), ("config_hash", config_hash)):
        if not value or "/" in value:
            raise ValueError(f"record_key: {name} must be a non-empty string without '/', got {value!r}")
    if not task_name:
        raise ValueError("record_key: task_name must be non-empty")
    return f"{content_hash}/{task_name}/{config_hash}"


def error_info(exc: BaseException, *, stage: str | None = None) -> dict:
    """The ``error`` field of a record for an exception: type, message, and
    the pipeline stage (ingest, context, prefill, decode, ...) where it hit."""
    from pipeline.schema.paths import text_safe

    info = {"type": type(exc).__name__, "message": text_safe(str(exc) or repr(exc))}
    if stage is not None:
        info["stage"] = stage
    if getattr(exc, "transient", False) or isinstance(exc, (OSError, MemoryError)):
        info["transient"] = True  # not the document's fault: a plain rerun retries it (pipeline.run.plan)
    return info


def utc_now() -> str:
    """UTC timestamp in ISO 8601 with milliseconds, e.g. ``2026-01-31T12:00:00.123Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
