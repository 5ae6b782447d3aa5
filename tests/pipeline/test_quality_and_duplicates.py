"""Issue 27: quality warnings counted (and ``strict``), clipped page ranges, identical bytes under two names."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inference.engines import Engines
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_text_pdf
from pipeline.run.runner import run_job


def make_job(tmp_path: Path, model: Path, *, extra: str = "", context: str = "", json_task: bool = True) -> Path:
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for name in ("a", "b"):
        if not (d / f"{name}.pdf").exists():
            make_text_pdf(d / f"{name}.pdf", [f"Document {name}, page {p}. Author: Ada." for p in range(1, 4)])
    tasks = "  - {name: summary, prompt: 'Summarize.', max_tokens: 3}\n"
    if json_task:
        tasks += "  - {name: fields, prompt: 'Return JSON with key author.', format: json, fields: [author], max_tokens: 3}\n"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: q\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"context: {{max_tokens: 2048{context}}}\n{extra}tasks:\n{tasks}output: out/results.jsonl\n"
    )
    return job


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_warnings_api_rejects_unknown_codes():
    from pipeline.schema.record import WARNING_CODES, add_warning

    assert add_warning(add_warning([], "truncated"), "truncated") == ["truncated"]
    with pytest.raises(ValueError, match="unknown warning code"):
        add_warning([], "made_up")
    assert {"json_parse_failed", "truncated", "pages_skipped", "pages_clipped", "random_weights"} <= set(WARNING_CODES)


def test_quality_warnings_are_flagged_counted_and_strict_decides(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir, context=", overflow: truncate")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output  # not strict: warned records are done
    recs = lines(tmp_path / "out" / "results.jsonl")
    assert all("random_weights" in x["warnings"] for x in recs)  # the seeded VLM's answers are noise
    for x in recs:  # a JSON task whose answer does not parse is flagged, not silently done
        assert ("json_parse_failed" in x["warnings"]) == bool(x["parse_error"])
    assert "4 done with warnings (" in r.output and "random_weights 4" in r.output
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "4 done with warnings" in r.output
    counts = orjson.loads(CliRunner().invoke(main, ["status", str(job), "--json"]).output)
    assert counts["warned"] == 4 and counts["warnings"]["random_weights"] == 4

    job.write_text(job.read_text().replace("tasks:", "strict: true\ntasks:"))
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])  # nothing to do, but the job is not clean
    assert r.exit_code == 1 and "0 records" in r.output and "failing under strict" in r.output
    assert CliRunner().invoke(main, ["status", str(job)]).exit_code == 1  # run and status agree


def test_truncation_is_a_warning(tmp_path, tiny_vlm_dir):
    job = load_job(make_job(tmp_path, tiny_vlm_dir, context=", overflow: truncate", json_task=False))
    job.spec.context.max_tokens = 60
    summary = run_job(job, progress=False)
    recs = lines(job.output_path)
    assert all(x["context"]["truncated"] and "truncated" in x["warnings"] for x in recs)
    assert summary.warnings["truncated"] == 2 and summary.exit_code == 0


def test_readme_pages_example_works_on_short_documents(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir, json_task=False)
    r = CliRunner().invoke(main, ["run", str(job), "--pages", "1-20,35,-5", "--no-progress"])
    assert r.exit_code == 0, r.output
    recs = lines(tmp_path / "out" / "results.jsonl")
    assert len(recs) == 2 and all(x["status"] == "ok" and "pages_clipped" in x["warnings"] for x in recs)
    assert recs[0]["pages"]["included"] == [1, 2, 3]
    assert "3-page document: 1-20 (kept 1-3), 35 (none left), -5 (none left)" in recs[0]["context"]["pages_clipped"]


def test_random_weights_come_from_the_build_marker(tmp_path, tiny_vlm_dir):
    from pipeline.models.load import has_random_weights

    assert has_random_weights(tiny_vlm_dir)
    other = tmp_path / "model"
    shutil.copytree(tiny_vlm_dir, other, ignore=shutil.ignore_patterns(".tqpipe-model.json"))
    assert not has_random_weights(other)


# -- identical bytes under two names ---------------------------------------------


def test_identical_bytes_get_a_record_per_name_from_one_prefill(tmp_path, tiny_vlm_dir):
    job_path = make_job(tmp_path, tiny_vlm_dir)
    docs = tmp_path / "docs"
    shutil.copy(docs / "a.pdf", docs / "copy of a.pdf")
    job = load_job(job_path)
    engines = Engines(job)
    summary = run_job(job, engines=engines, progress=False)
    assert summary.records_written == 6 and summary.exit_code == 0
    assert engines.get(False).prefill_count == 2  # a and b; the copy shares a's prefill
    recs = {(x["doc_id"], x["task"]): x for x in lines(job.output_path)}
    assert len(recs) == 6
    for task in ("summary", "fields"):
        first, copy = recs[("docs/a.pdf", task)], recs[("docs/copy of a.pdf", task)]
        assert copy["same_content_as"] == "docs/a.pdf" and copy["output"] == first["output"]
        assert copy["content_hash"] == first["content_hash"] and copy["key"] != first["key"]
        assert copy["source"].endswith("docs/copy of a.pdf") and "same_content_as" not in first
    r = CliRunner().invoke(main, ["status", str(job_path)])
    assert r.exit_code == 0 and "done 6, failed 0, pending 0" in r.output
    again = Engines(job)
    assert run_job(job, engines=again, progress=False).records_written == 0 and again.loads == 0

    (docs / "a.pdf").unlink()  # the first name is gone: the copy now owns the content, nothing is redone
    again = Engines(job)
    summary = run_job(job, engines=again, progress=False)
    assert summary.records_written == 0 and again.loads == 0


def add_task(job_path: Path) -> None:
    text = job_path.read_text()
    job_path.write_text(text.replace("output:", "  - {name: extra, prompt: 'Say more.', max_tokens: 3}\noutput:"))


def test_a_copied_project_owns_its_documents(tmp_path, tiny_vlm_dir):
    """The results of a copied project name the original's files, which still
    exist: they are not this run's documents, so the copy's files keep their
    keys, and a task added in the copy is run, not left waiting on them."""
    first = tmp_path / "p1"
    first.mkdir()
    run_job(load_job(make_job(first, tiny_vlm_dir)), progress=False)
    copy = tmp_path / "p2"
    shutil.copytree(first, copy)
    add_task(copy / "job.yaml")
    job = load_job(copy / "job.yaml")
    summary = run_job(job, progress=False)
    assert summary.records_written == 2 and summary.skipped == 0 and summary.exit_code == 0
    new = lines(job.output_path)[4:]
    assert {(x["doc_id"], x["task"]) for x in new} == {("docs/a.pdf", "extra"), ("docs/b.pdf", "extra")}
    assert all("same_content_as" not in x and x["source"].startswith(str(copy)) for x in new)
    r = CliRunner().invoke(main, ["status", str(copy / "job.yaml")])
    assert r.exit_code == 0 and "done 6, failed 0, pending 0" in r.output, r.output


def test_a_second_name_before_its_recorded_first_name_is_done_in_one_run(tmp_path, tiny_vlm_dir):
    """A copy that sorts before the name its content is recorded under waits
    for that name's new task within the same run, not for the next run."""
    job_path = make_job(tmp_path, tiny_vlm_dir)
    run_job(load_job(job_path), progress=False)
    docs = tmp_path / "docs"
    shutil.copy(docs / "b.pdf", docs / "0 copy of b.pdf")
    add_task(job_path)
    job = load_job(job_path)
    summary = run_job(job, progress=False)
    assert summary.records_written == 5 and summary.exit_code == 0  # 2 new tasks, 3 copies
    copies = [x for x in lines(job.output_path) if x["doc_id"] == "docs/0 copy of b.pdf"]
    assert sorted(x["task"] for x in copies) == ["extra", "fields", "summary"]
    assert all(x["same_content_as"] == "docs/b.pdf" for x in copies)
    r = CliRunner().invoke(main, ["status", str(job_path)])
    assert r.exit_code == 0 and "done 9, failed 0, pending 0" in r.output, r.output


def test_an_empty_document_and_damaged_text_are_warnings_not_clean_answers(tmp_path, tiny_vlm_dir):
    """A blank PDF whose pages go in empty (images: never) gets an answer made
    of nothing, and a page MuPDF reports damage on keeps partial text: each
    record says so with a code (strict fails it), not only in a free-text note."""
    import pymupdf

    job_path = make_job(tmp_path, tiny_vlm_dir, context=", images: never", json_task=False)
    docs = tmp_path / "docs"
    blank = pymupdf.open()
    blank.new_page()
    blank.new_page()
    blank.save(docs / "blank.pdf")
    make_text_pdf(docs / "c.pdf", ["first page", "second page"])
    pdf = pymupdf.open(docs / "c.pdf")
    pdf.update_stream(pdf[1].get_contents()[0], b"BT /Helv 12 Tf 72 700 Td (partial text) Tj ET ((( unbalanced ] >>")
    pdf.save(docs / "damaged.pdf")
    pdf.close()
    (docs / "c.pdf").unlink()
    r = CliRunner().invoke(main, ["run", str(job_path), "--no-progress"])
    assert r.exit_code == 0, r.output
    recs = {x["doc_id"]: x for x in lines(tmp_path / "out" / "results.jsonl")}
    assert "no_content" in recs["docs/blank.pdf"]["warnings"]
    assert "text_incomplete" in recs["docs/damaged.pdf"]["warnings"]
    assert not {"no_content", "text_incomplete"} & set(recs["docs/a.pdf"]["warnings"])
    assert "no_content 1" in r.output and "text_incomplete 1" in r.output
    job_path.write_text(job_path.read_text().replace("tasks:", "strict: true\ntasks:"))
    assert CliRunner().invoke(main, ["status", str(job_path)]).exit_code == 1
