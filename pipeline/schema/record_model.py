"""The result record as a pydantic model: the source of ``tqpipe schema record``.

Records are written as plain dicts by :mod:`pipeline.output.render` (fast,
no validation on the hot path); this model describes them for readers:
a JSON Schema other tools can validate against, and the field documentation.
A test validates real records against the generated schema, so the two
cannot drift apart.  Unknown fields are allowed: a reader must tolerate
fields added by a newer version (``schema_version`` changes only when an
existing field changes meaning).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.schema.record import WARNING_CODES


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Tokens(_Open):
    document: int = Field(description="document tokens prefilled into the cache")
    task_prompt: int = Field(description="tokens of the task's question")
    generated: int = Field(description="tokens of the answer")


class Timing(_Open):
    ingest_s: float | None = Field(None, description="reading the file: text, page images")
    prefill_s: float = Field(description="prefilling the document into the KV cache (once per document)")
    task_prefill_s: float = Field(description="prefilling this task's question")
    decode_s: float = Field(description="generating this task's answer")


class CacheFigures(_Open):
    scheme: Literal["turboquant", "fp16", "affine"]
    kv_bits: float | None = Field(description="bits per element (None for fp16)")
    nbytes_after_prefill: int = Field(description="bytes the cache holds for the document's tokens")
    tokens: int | None = Field(None, description="tokens those bytes hold")
    fp16_nbytes: int | None = Field(None, description="bytes an fp16 cache would hold for the same tokens")
    vs_fp16: float | None = Field(None, description="nbytes_after_prefill / fp16_nbytes")
    exact_tokens: int | None = Field(None, description="TurboQuant: tokens still uncompressed in the exact window")
    nbytes_end_of_task: int | None = Field(None, description="bytes held after the answer (document + task)")
    fp16_nbytes_end_of_task: int | None = Field(None, description="fp16 bytes for the same tokens")
    prefill_chunk: int
    geometry: dict[str, int] | None = Field(None, description="layers, kv_heads, k_dim, v_dim: what sets KV size")


class JsonInfo(_Open):
    decoding: Literal["constrained", "free"] = Field(description="constrained to the task's JSON Schema, or not")
    status: Literal["valid", "repaired", "invalid"] = Field(description="how the answer parsed")
    repaired: str | None = Field(None, description="what was wrong with the text json-repair fixed")


class ErrorInfo(_Open):
    type: str
    message: str
    stage: str | None = Field(None, description="ingest, model, context, prefill, decode, ...")


class Record(_Open):
    """One (document, task) result: a line of the job's JSONL output."""

    schema_version: int
    key: str = Field(description="<content_hash>/<task>/<config_hash>: the checkpoint key")
    status: Literal["ok", "error"]
    job: str
    doc_id: str = Field(description="the document's path relative to the job file's folder")
    source: str = Field(description="absolute path of the file (or image folder)")
    content_hash: str = Field(description="sha256 of the document's bytes")
    task: str
    config_hash: str = Field(description="hash of everything that shapes this task's answer")
    model: str | None
    output: str | None = Field(description="the answer as generated")
    parsed: Any = Field(description="format: json: the answer as JSON (None if it did not parse)")
    parse_error: str | None = Field(description="format: json: why the answer did not parse")
    tokens: Tokens | None
    timing: Timing | None
    cache: CacheFigures | None
    context: dict[str, Any] | None = Field(description="limits, truncation, page count, notes")
    pages: dict[str, Any] | None = Field(description="pages included and skipped, their token offsets")
    error: ErrorInfo | None
    created_at: str = Field(description="UTC, ISO 8601")
    finish_reason: Literal["stop", "length"] | None = Field(None, description="end of answer, or max_tokens hit")
    json_: JsonInfo | None = Field(None, alias="json", description="format: json tasks: decoding and parse status")
    missing_fields: list[str] | None = Field(None, description="format: json: expected keys the answer lacks")
    citations: dict[str, Any] | None = Field(None, description="pages the answer cites and whether they exist")
    memory: dict[str, Any] | None = Field(None, description="peak MLX memory and max RSS")
    warnings: list[str] = Field(description="quality warning codes of an ok answer that may be wrong or cut off "
                                            "(empty: none): " + ", ".join(WARNING_CODES))
    source_b64: str | None = Field(None, description="the file name's raw bytes (base64) when they are not UTF-8; "
                                                     "source then shows them escaped")
    same_content_as: str | None = Field(None, description="a second name of identical bytes: the doc_id whose "
                                                          "record this one copies (no second prefill)")
    worker: dict[str, Any] | None = Field(None, description="--engine ray: the worker that made it (host, pid, device)")


def record_json_schema() -> dict:
    """JSON Schema (draft 2020-12) of a result record."""
    schema = Record.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema

