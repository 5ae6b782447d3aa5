"""JSON Schemas from the pydantic models: real records and the shipped jobs validate; the reference page is current."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import orjson
import pytest
import yaml
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_corrupt_pdf, make_text_pdf
from pipeline.schema.record_model import record_json_schema
from pipeline.schema.reference import job_json_schema, job_reference_markdown

REPO = Path(__file__).resolve().parents[3]


def test_reference_page_is_generated_from_the_schema():
    page = (REPO / "docs" / "job-file.md").read_text()
    assert page == job_reference_markdown(), "docs/job-file.md is stale: tqpipe schema job --markdown > docs/job-file.md"
    for key in ("`cache.kv_bits` | float | (see meaning) | turboquant: 2, 2.5, 3, 3.5, 4", "`context.max_tokens` | int | `8192`", "`tasks[].schema`",
                "`engine.workers` | int \\| null | `null`", "`output` | str | **required**"):
        assert key in page, key


def test_reference_page_lists_every_key_of_the_json_schema():
    """Every key the JSON Schema accepts, nested mappings included, has a row
    (read off the JSON Schema, not the page generator's own walk)."""
    page = job_reference_markdown()
    schema = job_json_schema()
    defs = schema["$defs"]

    def refs(prop: dict) -> list[str]:
        found = [prop["$ref"]] if "$ref" in prop else []
        for k in ("items", "anyOf", "oneOf", "allOf"):
            sub = prop.get(k)
            for p in (sub if isinstance(sub, list) else [sub] if sub else []):
                found += refs(p)
        return [r.rsplit("/", 1)[-1] for r in found]

    keys = []
    for name, prop in schema["properties"].items():
        keys.append(name)
        for ref in refs(prop):
            listed = prop.get("type") == "array"
            keys += [f"{name}{'[]' if listed else ''}.{k}" for k in defs[ref]["properties"]]
    assert "cache_store.max_gb" in keys and "inputs[].images" in keys
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, missing


@pytest.mark.parametrize("job", sorted((REPO / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_jobs_validate_against_the_job_schema(job):
    jsonschema.validate(yaml.safe_load(job.read_text()), job_json_schema())


def test_job_schema_refuses_unknown_keys():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "inputs": ["a"], "tasks": [{"name": "t", "prompt": "p"}], "output": "o",
                             "cache": {"kv_bitz": 3}}, job_json_schema())


def test_records_of_a_run_validate_against_the_record_schema(tmp_path, tiny_vlm_dir):
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["Total: 12 EUR."])
    make_corrupt_pdf(tmp_path / "docs" / "bad.pdf")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: s\ninputs: [docs/]\nmodel: {{path: '{tiny_vlm_dir}'}}\n"
                   "tasks:\n  - {name: t, prompt: 'Sum?', max_tokens: 2}\n"
                   "  - {name: j, prompt: 'Total?', format: json, fields: {total: number}, max_tokens: 40}\n"
                   "output: out.jsonl\n")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 1, r.output
    records = [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert {r["status"] for r in records} == {"ok", "error"}, [(r["doc_id"], r["status"]) for r in records]
    schema = record_json_schema()
    for rec in records:
        jsonschema.validate(rec, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**records[0], "status": "maybe"}, schema)


def test_schema_command_prints_json_schema():
    r = CliRunner().invoke(main, ["schema", "record"])
    assert r.exit_code == 0 and json.loads(r.output)["title"] == "Record"
    record = json.loads(r.output)
    for field in ("warnings", "source_b64", "same_content_as", "worker"):  # written by render / ray_engine
        assert field in record["properties"], field
    assert "warnings" in record["required"] and "answer_truncated" in record["properties"]["warnings"]["description"]
    r = CliRunner().invoke(main, ["schema", "job"])
    assert r.exit_code == 0 and "tasks" in json.loads(r.output)["properties"]
    assert CliRunner().invoke(main, ["schema", "record", "--markdown"]).exit_code == 2
