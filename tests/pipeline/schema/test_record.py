"""Record fields, keys and the hashes that decide what a rerun skips."""

from pathlib import Path

import pytest
from pydantic import BaseModel

from pipeline.schema.record import (
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
