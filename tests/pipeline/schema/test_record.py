"""Record schema and the hashes that decide what a rerun skips."""

from datetime import datetime
from pathlib import Path

import orjson
import pytest
from pydantic import BaseModel

from pipeline.schema.record import (
    SCHEMA_VERSION,
    error_info,
    make_record,
    record_key,
    task_config_hash,
)

TASK = {"name": "summary", "prompt": "Summarize.", "max_tokens": 64, "temperature": 0.0, "format": "text", "fields": None}
CACHE = {"kv_quant_scheme": "turboquant", "kv_bits": 3.5, "key_bits": None, "value_bits": None, "window": 128, "prefill_chunk": 512}
CONTEXT = {"max_tokens": 8192, "overflow": "truncate", "images": "auto", "dpi": 72, "pages": None}


def h(task=TASK, model="m", cache=CACHE, context=CONTEXT):
    return task_config_hash(task, model=model, cache=cache, context=context)


def test_hash_is_stable_short_hex_and_ignores_key_order():
    a = h()
    assert len(a) == 16 and int(a, 16) >= 0
    reordered = dict(reversed(list(TASK.items())))
    assert h(task=reordered) == a
    assert h(cache=dict(reversed(list(CACHE.items())))) == a


@pytest.mark.parametrize(
    "change",
    [
        lambda t, c, x: ({**t, "prompt": "Summarize briefly."}, c, x),
        lambda t, c, x: ({**t, "max_tokens": 65}, c, x),
        lambda t, c, x: ({**t, "format": "json"}, c, x),
        lambda t, c, x: (t, {**c, "kv_bits": 3}, x),
        lambda t, c, x: (t, {**c, "kv_quant_scheme": "fp16"}, x),
        lambda t, c, x: (t, c, {**x, "pages": "1-3"}),
        lambda t, c, x: (t, c, {**x, "images": "never"}),
    ],
)
def test_hash_changes_with_anything_that_changes_output(change):
    t, c, x = change(TASK, CACHE, CONTEXT)
    assert h(task=t, cache=c, context=x) != h()


def test_hash_changes_with_model():
    assert h(model="other") != h()


def test_integral_floats_hash_like_ints():
    # YAML "kv_bits: 3" and pydantic's 3.0 must not split the checkpoint.
    assert h(cache={**CACHE, "kv_bits": 3}) == h(cache={**CACHE, "kv_bits": 3.0})


def test_pydantic_models_hash_like_their_dicts():
    class Task(BaseModel):
        name: str
        prompt: str
        max_tokens: int = 64

    model = Task(name="a", prompt="p")
    assert task_config_hash(model, model="m", cache={}, context={}) == task_config_hash(
        {"name": "a", "prompt": "p", "max_tokens": 64}, model="m", cache={}, context={}
    )


def test_record_key_format_and_validation():
    assert record_key("abc123", "qa/1", "ff00") == "abc123/qa/1/ff00"
    with pytest.raises(ValueError, match="content_hash"):
        record_key("", "t", "ff")
    with pytest.raises(ValueError, match="config_hash"):
        record_key("abc", "t", "a/b")
    with pytest.raises(ValueError, match="task_name"):
        record_key("abc", "", "ff")


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
