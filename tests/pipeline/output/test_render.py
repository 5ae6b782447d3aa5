"""The record renderer: make_record's contract and what an answered task's record holds."""

from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from pipeline.inference.engine import TaskResult
from pipeline.inference.prompt import DocumentPrompt
from pipeline.output.render import make_record, ok_record
from pipeline.schema.job import TaskSpec
from pipeline.schema.record import SCHEMA_VERSION, error_info, record_key, task_config_hash

TASK = {"name": "summary", "prompt": "Summarize.", "max_tokens": 64, "temperature": 0.0, "format": "text", "fields": None}


def h():
    return task_config_hash(TASK, model="m", cache={}, context={})


def _record(**kw):
    base = dict(job="j", doc_id="doc1", source=Path("/in/a.pdf"), content_hash="c0ffee", task="summary", config_hash=h(), status="ok")
    base.update(kw)
    return make_record(**base)


def test_make_record_is_self_describing_and_serializable():
    rec = _record(output="text", tokens={"document": 10, "generated": 3}, timing={"prefill_s": 0.5},
                  cache={"scheme": "turboquant", "kv_bits": 3.5, "nbytes": 1234}, model="tiny",
                  pages={"included": [1, 2], "skipped": [], "token_offsets": {1: 0, 2: 7}}, run_id="r1")
    assert rec["schema_version"] == SCHEMA_VERSION
    assert rec["key"] == record_key("c0ffee", "summary", h())
    assert rec["source"] == "/in/a.pdf"  # Path -> str
    assert rec["run_id"] == "r1"  # extras kept
    assert datetime.fromisoformat(rec["created_at"].replace("Z", "+00:00")).tzinfo is not None
    for field in ("job", "doc_id", "content_hash", "task", "config_hash", "status", "output", "parsed",
                  "parse_error", "tokens", "timing", "cache", "model", "context", "pages", "error"):
        assert field in rec
    assert orjson.loads(orjson.dumps(rec, option=orjson.OPT_NON_STR_KEYS))["pages"]["token_offsets"] == {"1": 0, "2": 7}


def test_make_record_rejects_bad_status_and_errors_without_reason():
    with pytest.raises(ValueError, match="status"):
        _record(status="done")
    with pytest.raises(ValueError, match="error"):
        _record(status="error")
    rec = _record(status="error", error=error_info(ValueError("bad page 3"), stage="ingest"))
    assert rec["error"] == {"type": "ValueError", "message": "bad page 3", "stage": "ingest"}


def test_make_record_extra_cannot_overwrite_standard_fields():
    with pytest.raises(ValueError, match="key"):
        _record(key="forged")


def test_json_record_checks_cited_pages_and_fields():
    job = SimpleNamespace(spec=SimpleNamespace(name="j", context=SimpleNamespace(max_tokens=100, overflow="error", images="auto")))
    ref = SimpleNamespace(doc_id="d.pdf", source=Path("/d.pdf"))
    prompt = DocumentPrompt(prefix_ids=[1, 2, 3], task_ids={"f": [4]}, page_offsets={1: 0, 2: 2},
                            included_pages=[1, 2], skipped_pages=[])
    task = TaskSpec(name="f", prompt="p", format="json", fields=["total", "author"])
    text = 'Here you go:\n```json\n{"total": {"value": 1250, "page": 2}, "note": "see [Page 40]"}\n```'
    result = TaskResult(task="f", text=text, token_ids=[5], finish_reason="stop",
                        tokens={"document": 3, "task_prompt": 1, "generated": 1}, timing={}, cache={})
    rec = ok_record(job, ref, "sha256:ab", task, "sha256:ab/f/0123", result, prompt, None, "m")
    assert rec["parsed"]["total"]["value"] == 1250 and rec["parse_error"] is None
    assert rec["missing_fields"] == ["author"] and rec["warnings"] == ["missing_fields"]
    assert rec["citations"] == {"cited": [2, 40], "unknown": [40], "valid": False}
    bad = ok_record(job, ref, "sha256:ab", task, "sha256:ab/f/0123",
                     TaskResult(**{**result.__dict__, "text": '{'}), prompt, None, "m")
    assert bad["status"] == "ok" and bad["parsed"] is None and "invalid JSON" in bad["parse_error"]
    assert bad["json"] == {"decoding": "free", "status": "invalid"}
    # json-repair closes a cut-off object; the record says it was repaired and from what
    fixed = ok_record(job, ref, "sha256:ab", task, "sha256:ab/f/0123",
                      TaskResult(**{**result.__dict__, "text": '{"total": 12'}), prompt, None, "m")
    assert fixed["parsed"] == {"total": 12} and fixed["parse_error"] is None
    assert fixed["json"]["status"] == "repaired" and "invalid JSON" in fixed["json"]["repaired"]
    assert fixed["warnings"] == ["json_repaired", "missing_fields"] and bad["warnings"] == ["json_parse_failed"]
    assert "max_tokens" not in bad["parse_error"]
    cut = ok_record(job, ref, "sha256:ab", task, "sha256:ab/f/0123",
                     TaskResult(**{**result.__dict__, "text": '{', "finish_reason": "length"}), prompt, None, "m")
    assert cut["parse_error"].endswith("(the answer hit max_tokens=256 and may be cut off)")
    assert cut["warnings"] == ["json_parse_failed", "answer_truncated"]
    # a text answer cut off at max_tokens is kept, and says so
    text_task = TaskSpec(name="s", prompt="p", max_tokens=2)
    long = ok_record(job, ref, "sha256:ab", text_task, "sha256:ab/s/0123",
                     TaskResult(**{**result.__dict__, "task": "s", "text": "A long", "finish_reason": "length"}),
                     prompt, None, "m")
    assert long["status"] == "ok" and long["warnings"] == ["answer_truncated"] and long["finish_reason"] == "length"
