"""The record renderer: the one place a result record is assembled.

Every record the runner, the Ray driver or a Ray worker writes comes from
:func:`ok_record` or :func:`error_records`, both on top of
:func:`make_record`, so a record has the same fields in the same order
whichever engine produced it.  A record must answer, on its own and years
later, "what produced this output?": which file (path and content hash),
which task, which model, cache and context settings, how long it took and
how much memory it used.
"""

from __future__ import annotations

from os import PathLike
from typing import Any, Iterable, Iterator, Literal

from pipeline.inference.extract import check_citations, cited_pages, missing_fields, pages_in_text, parse_or_repair
from pipeline.inference.memory import memory_record
from pipeline.inference.prompt import DocumentPrompt, model_context_limit
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document
from pipeline.schema.job import Job, TaskSpec
from pipeline.schema.paths import path_b64, path_text, text_safe
from pipeline.schema.record import RECORD_FIELDS, SCHEMA_VERSION, add_warning, record_key, utc_now


def _base(job: Job, ref: DocumentRef, digest: str, task: str, key: str) -> dict:
    return dict(
        job=job.spec.name,
        doc_id=text_safe(ref.doc_id),
        source=ref.source,
        content_hash=digest,
        task=task,
        config_hash=key.rsplit("/", 1)[1],
    )


def quality_warnings(task: TaskSpec, prompt: DocumentPrompt, doc: Document | None, *, parse_error: str | None,
                     random_weights: bool, json_repaired: bool = False, missing: list[str] | None = None,
                     finish_reason: str | None = None) -> list[str]:
    """The ``warnings`` of an answered task (codes in :data:`~pipeline.schema.record.WARNING_CODES`).

    An answer cut off at ``max_tokens`` or a JSON answer without a requested
    field is kept (``ok``: the model ran) but never reads as a clean result:
    ``strict: true`` fails on it.
    """
    warnings: list[str] = []
    if task.format == "json" and parse_error:
        add_warning(warnings, "json_parse_failed")
    if task.format == "json" and json_repaired:
        add_warning(warnings, "json_repaired")
    if missing:
        add_warning(warnings, "missing_fields")
    if finish_reason == "length":
        add_warning(warnings, "answer_truncated")
    if prompt.truncation.get("truncated"):
        add_warning(warnings, "truncated")
    if prompt.skipped_pages or (doc is not None and doc.skipped_pages):
        add_warning(warnings, "pages_skipped")
    if doc is not None and doc.pages_clipped:
        add_warning(warnings, "pages_clipped")
    if doc is not None and prompt.included_pages and set(prompt.included_pages) <= set(doc.empty_pages):
        add_warning(warnings, "no_content")
    if doc is not None and set(doc.incomplete_pages) & set(prompt.included_pages):
        add_warning(warnings, "text_incomplete")
    if random_weights:
        add_warning(warnings, "random_weights")
    return warnings


def context_field(job: Job, prompt: DocumentPrompt | None, doc: Document | None, config: dict | None = None) -> dict:
    """The ``context`` field: the job's limits, the model's own cap, truncation, notes."""
    ctx = job.spec.context
    rec: dict = {"max_tokens": ctx.max_tokens, "overflow": ctx.overflow, "images": ctx.images}
    limit = model_context_limit(config)
    if limit is not None and limit < ctx.max_tokens:
        rec["model_max_tokens"] = limit
    if prompt is not None:
        rec.update(prompt.truncation)
        rec["n_images"] = prompt.n_images
    if doc is not None:
        rec["page_count"] = doc.page_count
        if doc.pages_clipped:
            rec["pages_clipped"] = doc.pages_clipped
        if doc.notes:
            rec["notes"] = doc.notes
    return rec


def error_records(
    job: Job, ref: DocumentRef, digest: str, tasks: Iterable[str], keys: dict[str, str], error: dict, **fields: Any
) -> Iterator[dict]:
    """One error record per task name in ``tasks``; ``error`` is an
    :func:`~pipeline.schema.record.error_info` dict, ``fields`` what is known
    (model, context, pages) when the failure hit."""
    for task in tasks:
        yield make_record(**_base(job, ref, digest, task, keys[task]), status="error", error=dict(error), **fields)


def ok_record(
    job: Job,
    ref: DocumentRef,
    digest: str,
    task: TaskSpec,
    key: str,
    result: Any,
    prompt: DocumentPrompt,
    doc: Document | None,
    model_name: str,
    config: dict | None = None,
    ingest_s: float | None = None,
    random_weights: bool = False,
) -> dict:
    """The record of one answered task (``result`` is an engine ``TaskResult``).

    A JSON task whose output does not parse is still ``ok`` with
    ``parse_error`` set and the ``json_parse_failed`` warning: the model
    ran, the text is kept.  ``random_weights``: the model is the seeded
    built-in VLM, so the answer is flagged as noise.
    """
    parsed = parse_error = None
    extra: dict = {"finish_reason": result.finish_reason, "memory": memory_record()}
    if task.format == "json":
        p = parse_or_repair(result.text)
        parsed, parse_error = p.value, p.error
        if parse_error and result.finish_reason == "length":
            parse_error += f" (the answer hit max_tokens={task.max_tokens} and may be cut off)"
        extra["json"] = json_field(p, getattr(result, "constrained", False))
        if p.ok:
            extra["missing_fields"] = missing_fields(p.value, task.fields)
            extra["citations"] = check_citations(cited_pages(p.value), prompt.included_pages)
    else:
        cited = pages_in_text(result.text)
        if cited:
            extra["citations"] = check_citations(list(dict.fromkeys(cited)), prompt.included_pages)
    return make_record(
        **_base(job, ref, digest, task.name, key),
        status="ok",
        output=result.text,
        parsed=parsed,
        parse_error=parse_error,
        tokens=result.tokens,
        timing=result.timing if ingest_s is None else {"ingest_s": round(ingest_s, 4), **result.timing},
        cache=result.cache,
        model=model_name,
        context=context_field(job, prompt, doc, config),
        pages=prompt.pages_record(),
        warnings=quality_warnings(task, prompt, doc, parse_error=parse_error, random_weights=random_weights,
                                  json_repaired=extra.get("json", {}).get("status") == "repaired",
                                  missing=extra.get("missing_fields"), finish_reason=result.finish_reason),
        **extra,
    )


def json_field(parsed: Any, constrained: bool) -> dict:
    """The ``json`` field of a JSON task's record: how the answer was decoded
    (``constrained`` or ``free``) and how it parsed (``valid``, ``repaired``
    by json-repair, or ``invalid``: then ``parse_error`` says why)."""
    status = "invalid" if not parsed.ok else "repaired" if parsed.repaired else "valid"
    out = {"decoding": "constrained" if constrained else "free", "status": status}
    if parsed.repaired:
        out["repaired"] = parsed.repaired  # what was wrong with the text as written
    return out


def same_content_record(original: dict, job: Job, ref: DocumentRef, key: str) -> dict:
    """The record of ``ref`` whose bytes equal those of ``original``'s document:
    ``original`` copied (answer, timings, status), under ``ref``'s name and
    ``key``, with ``same_content_as`` naming the first document.  No second
    prefill: the answer is the same by construction."""
    record = {k: v for k, v in original.items() if k not in ("worker", "source_b64", "same_content_as")}
    record.update(key=key, job=job.spec.name, doc_id=text_safe(ref.doc_id), source=path_text(ref.source),
                  created_at=utc_now())
    raw = path_b64(ref.source)
    if raw is not None:
        record["source_b64"] = raw
    record["same_content_as"] = original["doc_id"]
    return record


def make_record(
    *,
    job: str,
    doc_id: str,
    source: str | PathLike,
    content_hash: str,
    task: str,
    config_hash: str,
    status: Literal["ok", "error"],
    output: str | None = None,
    parsed: Any = None,
    parse_error: str | None = None,
    tokens: dict | None = None,
    timing: dict | None = None,
    cache: dict | None = None,
    model: str | None = None,
    context: dict | None = None,
    pages: dict | None = None,
    error: dict | None = None,
    warnings: list[str] | None = None,
    **extra: Any,
) -> dict:
    """Build one result record (a plain dict, ready for ``ResultLog.append``).

    Adds ``schema_version``, ``key`` and ``created_at``.  ``status="error"``
    requires ``error`` (use :func:`error_info`), so a failed record always
    says why.  A JSON task whose output does not parse is still ``ok`` with
    ``parse_error`` set: the model ran, the text is kept.  ``source`` may be
    a path: it is stored as text with undecodable bytes escaped as ``\\xNN``,
    plus ``source_b64`` (the raw name bytes, base64) when the name is not
    valid UTF-8 (see :mod:`pipeline.schema.paths`).  ``warnings`` holds
    quality codes from :data:`~pipeline.schema.record.WARNING_CODES`.
    """
    if status not in ("ok", "error"):
        raise ValueError(f"make_record: status must be 'ok' or 'error', got {status!r}")
    if status == "error" and not error:
        raise ValueError("make_record: an error record needs error={'type': ..., 'message': ...}")
    clash = sorted(set(extra) & set(RECORD_FIELDS))
    if clash:
        raise ValueError(f"make_record: extra fields {clash} would overwrite standard fields")
    record = {
        "schema_version": SCHEMA_VERSION,
        "key": record_key(content_hash, task, config_hash),
        "status": status,
        "job": job,
        "doc_id": text_safe(doc_id),
        "source": path_text(source),
        "content_hash": content_hash,
        "task": task,
        "config_hash": config_hash,
        "model": model,
        "output": output,
        "parsed": parsed,
        "parse_error": parse_error,
        "tokens": tokens,
        "timing": timing,
        "cache": cache,
        "context": context,
        "pages": pages,
        "error": error,
        "warnings": list(warnings or []),
        "created_at": utc_now(),
    }
    raw = path_b64(source)
    if raw is not None:
        record["source_b64"] = raw
    record.update(extra)
    return record
