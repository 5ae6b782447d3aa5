"""``tqpipe export``: a job's results as Markdown, CSV or Parquet.

The JSONL file is the record of truth (every field, retries, old configs);
people want a document to read (olmocr ``--markdown``, marker
``--output_format markdown``) or a table for a spreadsheet or a dataframe.
Exports read the record that counts for each key
(:func:`~pipeline.output.results_log.latest_records`) and never write the
results file.  Table columns are fixed and flat: one row per (document,
task), a JSON task's parsed keys as ``parsed.<key>`` columns.

Parquet needs pyarrow, an optional dependency (``pip install
'tqpipe[parquet]'``); without it the export says so instead of failing on
an import deep inside.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import orjson

from pipeline.errors import TqpipeError
from pipeline.output.atomic import write_whole
from pipeline.output.results_log import latest_records

FORMATS = ("markdown", "csv", "parquet")
SUFFIX = {"markdown": ".md", "csv": ".csv", "parquet": ".parquet"}

#: The fixed columns of csv/parquet exports, in order (``parsed.<key>`` columns follow).
COLUMNS = (
    "doc_id", "task", "status", "warnings", "output", "parse_error", "json_status", "error_type", "error_message",
    "missing_fields",
    "pages", "tokens_document", "tokens_generated", "truncated", "kv_scheme", "kv_nbytes", "kv_fp16_nbytes",
    "ingest_s", "prefill_s", "decode_s", "model", "source", "content_hash", "config_hash", "key", "created_at",
)


class ExportError(TqpipeError):
    """An export that cannot be written (no records, pyarrow missing)."""


def records_for_export(results: Path, current: Callable[[str], bool] | None = None,
                       task_order: Sequence[str] = ()) -> list[dict]:
    """The counting record of each key, ordered by document, then by task in
    ``task_order`` (the job's order; others after, by name); with
    ``current`` (true for the keys of the job's present tasks and config),
    only those: a record of an edited task or an older config is stale, and
    would otherwise show a (document, task) twice."""
    latest = latest_records(results)
    records = [r for k, r in latest.items() if current is None or current(k)]
    if not records:
        stale = f" ({len(latest)} records of older tasks or configs)" if latest else ""
        raise ExportError(f"{results}: no results yet for the job's current tasks and config{stale} (run the job first)")
    rank = {name: i for i, name in enumerate(task_order)}
    return sorted(records, key=lambda r: (r.get("doc_id", ""), rank.get(r.get("task"), len(rank)), r.get("task", "")))


def _get(rec: dict, *path: str) -> Any:
    for p in path:
        rec = rec.get(p) if isinstance(rec, dict) else None
    return rec


def _cell(value: Any) -> Any:
    """Scalars stay; lists and objects become compact JSON text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return orjson.dumps(value).decode()


def row(rec: dict) -> dict[str, Any]:
    """One flat row for a record (see :data:`COLUMNS`)."""
    out = {
        "doc_id": rec.get("doc_id"), "task": rec.get("task"), "status": rec.get("status"),
        # the record's quality warning codes (an ok answer that may be wrong or cut off), comma-separated
        "warnings": ",".join(rec.get("warnings") or []),
        "output": rec.get("output"), "parse_error": rec.get("parse_error"),
        "missing_fields": ",".join(rec.get("missing_fields") or []),
        "json_status": _get(rec, "json", "status"),
        "error_type": _get(rec, "error", "type"), "error_message": _get(rec, "error", "message"),
        "pages": _cell(_get(rec, "pages", "included")),
        "tokens_document": _get(rec, "tokens", "document"), "tokens_generated": _get(rec, "tokens", "generated"),
        "truncated": _get(rec, "context", "truncated"),
        "kv_scheme": _get(rec, "cache", "scheme"), "kv_nbytes": _get(rec, "cache", "nbytes_after_prefill"),
        "kv_fp16_nbytes": _get(rec, "cache", "fp16_nbytes"),
        "ingest_s": _get(rec, "timing", "ingest_s"), "prefill_s": _get(rec, "timing", "prefill_s"),
        "decode_s": _get(rec, "timing", "decode_s"),
        "model": rec.get("model"), "source": rec.get("source"), "content_hash": rec.get("content_hash"),
        "config_hash": rec.get("config_hash"), "key": rec.get("key"), "created_at": rec.get("created_at"),
    }
    parsed = rec.get("parsed")
    if isinstance(parsed, dict):
        out.update({f"parsed.{k}": _cell(v) for k, v in parsed.items()})
    return out


def table(records: Iterable[dict]) -> tuple[list[str], list[dict]]:
    """Column names (fixed, then every ``parsed.*`` key in first-seen order) and rows."""
    rows = [row(r) for r in records]
    extra: dict[str, None] = {}
    for r in rows:
        extra.update({k: None for k in r if k not in COLUMNS})
    columns = [*COLUMNS, *extra]
    return columns, [{c: r.get(c) for c in columns} for r in rows]


def to_csv(records: Iterable[dict]) -> bytes:
    columns, rows = table(records)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue().encode("utf-8")


def to_parquet(records: Iterable[dict], path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError("parquet export needs pyarrow: pip install 'tqpipe[parquet]' (or pip install pyarrow)") from None
    columns, rows = table(records)
    # Every column as its values are: parsed.* cells mix types across tasks, so they are text.
    data = {c: [r[c] for r in rows] for c in columns}
    arrays = {}
    for c, values in data.items():
        try:
            arrays[c] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[c] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
    pq.write_table(pa.table(arrays), path)


_MD_PUNCT = str.maketrans({c: "\\" + c for c in "\\`*_[]()#|~!"}
                          | {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\n": "\\n", "\r": "\\r", "\t": " "})


def md_text(text: Any) -> str:
    """``text`` as one line of literal Markdown: a name with a newline, ``#``
    or ``<img ...>`` in it stays inside its heading and renders as written."""
    return str(text).translate(_MD_PUNCT)


def to_markdown(records: Iterable[dict], job_name: str) -> bytes:
    """One section per document, one sub-section per task: its warning codes
    (if any), the answer as text, a JSON answer as a fenced block, a failure as
    a quoted error."""
    lines = [f"# {md_text(job_name)}", ""]
    current = None
    for rec in records:
        if rec.get("doc_id") != current:
            current = rec.get("doc_id")
            lines += [f"## {md_text(current)}", ""]
        lines += [f"### {md_text(rec.get('task'))}", ""]
        if rec.get("warnings"):
            lines += [f"> warnings: {', '.join(rec['warnings'])}", ""]
        if rec.get("status") != "ok":
            err = rec.get("error") or {}
            lines += [f"> **failed** ({err.get('stage', '?')}): {err.get('type', '')}: {md_text(err.get('message', ''))}", ""]
        elif rec.get("parsed") is not None:
            lines += ["```json", orjson.dumps(rec["parsed"], option=orjson.OPT_INDENT_2).decode(), "```", ""]
        else:
            lines += [(rec.get("output") or "").strip(), ""]
            if rec.get("parse_error"):
                lines += [f"> not valid JSON: {md_text(rec['parse_error'])}", ""]
    return "\n".join(lines).encode("utf-8")


def export(results: Path, fmt: str, out: Path, *, job_name: str, current: Callable[[str], bool] | None = None,
           task_order: Sequence[str] = ()) -> int:
    """Write ``results`` (the ``current`` keys, see :func:`records_for_export`)
    as ``fmt`` to ``out``; return the number of records exported."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    records = records_for_export(results, current, task_order)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        write_whole(out, lambda path: to_parquet(records, path))
    else:
        data = to_csv(records) if fmt == "csv" else to_markdown(records, job_name)
        write_whole(out, lambda path: path.write_bytes(data))
    return len(records)
