"""Constrained JSON decoding: whatever the logits say, the answer parses and fits the schema."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import orjson
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from pipeline.cli import main
from pipeline.inference.constrained import JsonConstraint, json_processor, task_json_schema
from pipeline.inference.extract import parse_or_repair
from pipeline.inputs.samples import write_samples
from pipeline.schema.job import TaskSpec

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _decode(processor, tokenizer, max_tokens: int, seed: int, vocab: int = 49152) -> tuple[str, str]:
    """Greedy decoding over random logits (the worst possible model) through ``processor``."""
    key = mx.random.key(seed)
    out: list[int] = []
    while len(out) < max_tokens:
        key, sub = mx.random.split(key)
        logits = processor(out, mx.random.normal((1, vocab), key=sub))
        tok = int(mx.argmax(logits, axis=-1).item())
        if tok == tokenizer.eos_token_id:
            return tokenizer.decode(out), "stop"
        out.append(tok)
    return tokenizer.decode(out), "length"


def test_schema_from_fields_list_mapping_and_schema():
    listed = task_json_schema(TaskSpec(name="t", prompt="p", format="json", fields=["a", "b"], max_tokens=100))
    assert listed["required"] == ["a", "b"] and listed["additionalProperties"] is False
    assert listed["properties"]["a"]["type"] == ["string", "null"]
    # the whole object fits the token budget: {} + 2 x ("name": + comma) + quotes + both strings
    assert 2 + 2 * 5 + 2 * 2 + 2 * listed["properties"]["a"]["maxLength"] <= 100
    typed = task_json_schema(TaskSpec(name="t", prompt="p", format="json", fields={"n": "integer", "s": "string"}))
    assert typed["properties"]["n"] == {"type": ["integer", "null"], "minimum": -(10**15 - 1), "maximum": 10**15 - 1}
    own = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}
    assert task_json_schema(TaskSpec(name="t", prompt="p", format="json", schema=own)) == own
    assert task_json_schema(TaskSpec(name="t", prompt="p", format="json")) == {"type": "object"}
    with pytest.raises(ValueError, match="only meaningful with format: json"):
        TaskSpec(name="t", prompt="p", schema=own)


def test_text_tasks_get_no_processor(tokenizer):
    assert json_processor(TaskSpec(name="t", prompt="p"), tokenizer) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_still_give_the_schemas_json_within_budget(tokenizer, seed):
    task = TaskSpec(name="t", prompt="p", format="json", fields={"title": "string", "n": "integer", "ok": "boolean"},
                    max_tokens=120)
    text, finish = _decode(json_processor(task, tokenizer), tokenizer, task.max_tokens, seed)
    assert finish == "stop", text  # the budget bound made the object close in time
    value = json.loads(text)
    assert set(value) == {"title", "n", "ok"}
    assert value["n"] is None or isinstance(value["n"], int)
    assert value["ok"] is None or isinstance(value["ok"], bool)


def test_enum_schema_is_obeyed(tokenizer):
    schema = {"type": "object", "properties": {"x": {"enum": ["yes", "no"]}}, "required": ["x"],
              "additionalProperties": False}
    text, finish = _decode(JsonConstraint(tokenizer, schema), tokenizer, 20, seed=3)
    assert finish == "stop" and json.loads(text)["x"] in ("yes", "no")


def test_repair_fallback_closes_a_cut_off_object():
    p = parse_or_repair('Sure! {"title": "Annual rep')
    assert p.ok and p.value == {"title": "Annual rep"} and "invalid JSON" in p.repaired
    assert parse_or_repair('{"a": 1}').repaired is None
    assert not parse_or_repair("{").ok
    huge = "1" * 30  # a record must serialize whatever number a model writes
    assert parse_or_repair('{"n": %s, "m": [-%s], "k": 5}' % (huge, huge)).value == {"n": huge, "m": ["-" + huge], "k": 5}


@pytest.mark.slow
def test_every_record_of_the_extract_job_parses_with_the_builtin_model(tmp_path):
    """The shipped jobs/extract.yaml over the shipped samples: 100% parse, all constrained."""
    (tmp_path / "jobs").mkdir()
    shutil.copy(REPO / "jobs" / "extract.yaml", tmp_path / "jobs" / "extract.yaml")
    write_samples(tmp_path / "samples")
    r = CliRunner().invoke(main, ["run", str(tmp_path / "jobs" / "extract.yaml"), "--no-progress"])
    assert r.exit_code == 0, r.output
    records = [orjson.loads(x) for x in (tmp_path / "results" / "extract.jsonl").read_bytes().splitlines()]
    pdfs = sorted((tmp_path / "samples").glob("*.pdf"))
    assert len(records) == len(pdfs) >= 4 and all(rec["status"] == "ok" for rec in records)
    for rec in records:
        assert rec["json"] == {"decoding": "constrained", "status": "valid"}, rec["output"]
        assert rec["parse_error"] is None and set(rec["parsed"]) == {"title", "author", "date", "total"}
        assert rec["missing_fields"] == []
