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

from typing import Any, Iterable, Iterator, Literal

from pipeline.inference.extract import check_citations, cited_pages, missing_fields, pages_in_text, parse_json_output
from pipeline.inference.memory import memory_record
from pipeline.inference.prompt import DocumentPrompt, model_context_limit
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document
from pipeline.schema.job import Job, TaskSpec
from pipeline.schema.record import RECORD_FIELDS, SCHEMA_VERSION, record_key, utc_now


def _base(job: Job, ref: DocumentRef, digest: str, task: str, key: str) -> dict:
    return dict(
        job=job.spec.name,
        doc_id=ref.doc_id,
        source=str(ref.source),
        content_hash=digest,
        task=task,
        config_hash=key.rsplit("/", 1)[1],
    )


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
) -> dict:
    """The record of one answered task (``result`` is an engine ``TaskResult``).

    A JSON task whose output does not parse is still ``ok`` with
    ``parse_error`` set: the model ran, the text is kept.
    """
    parsed = parse_error = None
    extra: dict = {"finish_reason": result.finish_reason, "memory": memory_record()}
    if task.format == "json":
        p = parse_json_output(result.text)
        parsed, parse_error = p.value, p.error
        if parse_error and result.finish_reason == "length":
            parse_error += f" (the answer hit max_tokens={task.max_tokens} and may be cut off)"
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
        **extra,
    )


def make_record(
    *,
    job: str,
    doc_id: str,
    source: str,
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
    **extra: Any,
) -> dict:
    """Build one result record (a plain dict, ready for ``ResultLog.append``).

    Adds ``schema_version``, ``key`` and ``created_at``.  ``status="error"``
    requires ``error`` (use :func:`error_info`), so a failed record always
    says why.  A JSON task whose output does not parse is still ``ok`` with
    ``parse_error`` set: the model ran, the text is kept.
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
        "doc_id": doc_id,
        "source": str(source),
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
        "created_at": utc_now(),
    }
    record.update(extra)
    return record
