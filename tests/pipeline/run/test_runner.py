"""Runner: skip done keys, one record per (document, task), error records, dry run."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from fixtures_models import *  # noqa: F403

from pipeline.errors import LockHeldError
from pipeline.inference.engines import Engines
from pipeline.inputs.discover import discover
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_corrupt_pdf, make_scanned_pdf, make_text_pdf
from pipeline.output.lock import JobLock
from pipeline.output.results_log import iter_records
from pipeline.run.document import process_document
from pipeline.run.plan import task_keys
from pipeline.run.runner import run_job
from pipeline.schema.job import with_pages

PAGES_A = ["Harbor report, page one. Revenue grew by 12 percent.", "Page two. Author: Ada Lovelace.", "Page three. Total 1250 EUR."]
PAGES_B = ["Minutes of the board meeting held on 2024-03-01.", "Decision: approve the dredging budget."]


def write_job(tmp_path: Path, *, model: str | None, tasks: str | None = None, context: str = "", inputs: str = "docs/") -> Path:
    tasks = tasks or (
        "  - {name: summary, prompt: 'Summarize.', max_tokens: 3}\n"
        "  - {name: fields, prompt: 'Give the author.', format: json, fields: [author], max_tokens: 4}\n"
    )
    model_line = f"model: {{path: '{model}'}}\n" if model else ""
    text = (
        f"name: t\ninputs: [{inputs}]\n{model_line}"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 32, window: 16}\n"
        f"context: {{max_tokens: 2048{context}}}\n"
        f"tasks:\n{tasks}output: out/results.jsonl\n"
    )
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    make_text_pdf(d / "a.pdf", PAGES_A, title="A")
    make_text_pdf(d / "b.pdf", PAGES_B, title="B")
    return d


def records(job) -> list[dict]:
    return list(iter_records(job.output_path))


def test_one_record_per_task_then_rerun_skips_everything(tmp_path, docs, tiny_vlm_dir):
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir)))
    engines = Engines(job)
    summary = run_job(job, engines=engines, progress=False)
    assert (summary.done, summary.failed, summary.records_written, summary.exit_code) == (4, 0, 4, 0)
    assert engines.loads == 1
    recs = records(job)
    assert sorted((r["doc_id"], r["task"]) for r in recs) == [
        ("docs/a.pdf", "fields"), ("docs/a.pdf", "summary"), ("docs/b.pdf", "fields"), ("docs/b.pdf", "summary")
    ]
    a = next(r for r in recs if r["doc_id"] == "docs/a.pdf" and r["task"] == "summary")
    assert a["status"] == "ok" and a["model"] == str(tiny_vlm_dir)
    assert a["pages"]["included"] == [1, 2, 3] and set(a["pages"]["token_offsets"]) == {"1", "2", "3"}
    assert a["tokens"]["document"] > 0 and a["tokens"]["generated"] <= 3
    assert a["cache"]["scheme"] == "turboquant" and a["cache"]["nbytes_after_prefill"] > 0
    assert a["context"]["truncated"] is False
    keys = task_keys(job, a["content_hash"])
    assert a["key"] == keys["summary"]
    # the JSON task records exactly one of a parsed value or a parse error
    for r in recs:
        if r["task"] == "fields":
            assert (r["parsed"] is None) != (r["parse_error"] is None)

    again = Engines(job)
    summary = run_job(job, engines=again, progress=False)
    assert (summary.records_written, summary.skipped, summary.exit_code) == (0, 2, 0)
    assert again.loads == 0  # nothing to do: no model loaded


def test_broken_pdf_becomes_error_records_and_the_rest_succeeds(tmp_path, docs, tiny_vlm_dir):
    make_corrupt_pdf(docs / "broken.pdf")
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir)))
    summary = run_job(job, progress=False)
    assert summary.exit_code == 1 and summary.failed_documents == ["docs/broken.pdf"]
    recs = records(job)
    bad = [r for r in recs if r["doc_id"] == "docs/broken.pdf"]
    assert len(bad) == 2 and all(r["status"] == "error" for r in bad)
    assert bad[0]["error"]["stage"] == "ingest" and "broken.pdf" in bad[0]["error"]["message"]
    assert sum(r["status"] == "ok" for r in recs) == 4

    # a rerun does not retry the failure (still exit 1) unless asked to
    summary = run_job(job, progress=False)
    assert summary.records_written == 0 and summary.exit_code == 1
    # documents and records counted apart, failures of earlier runs said as such
    assert summary.line().startswith("3 documents (3 already recorded); 0 records written: 0 ok, 0 failed; "
                                     "2 failed in earlier runs (--retry-failed redoes them); 4 done with warnings")
    summary = run_job(job, progress=False, retry_failed=True)
    assert summary.records_written == 2 and summary.failed == 2
    assert summary.line().startswith("3 documents (2 already recorded); 2 records written: 0 ok, 2 failed; 4 done")


@pytest.mark.parametrize("store", [False, True], ids=["no-store", "store"])
def test_editing_one_task_reruns_only_that_task(tmp_path, docs, tiny_vlm_dir, store):
    job_path = write_job(tmp_path, model=str(tiny_vlm_dir))
    if not store:
        job_path.write_text(job_path.read_text() + "cache_store: {max_gb: 0}\n")
    run_job(load_job(job_path), progress=False)
    job_path.write_text(job_path.read_text().replace("'Summarize.'", "'Summarize briefly.'"))
    job = load_job(job_path)
    engines = Engines(job)
    summary = run_job(job, engines=engines, progress=False)
    assert summary.records_written == 2
    new = records(job)[-2:]
    assert {r["task"] for r in new} == {"summary"} and {r["doc_id"] for r in new} == {"docs/a.pdf", "docs/b.pdf"}
    if not store:
        assert engines.get(False).prefill_count == 2  # one prefill per document, not per task
    else:  # both documents' caches were stored by the first run
        assert engines.get(False).prefill_count == 0 and engines.get(False).cache_loads == 2
        assert all(r["cache"]["doc_cache"]["hit"] and r["timing"]["prefill_s"] == 0 for r in new)


def test_truncation_is_stated_in_the_record(tmp_path, docs, tiny_vlm_dir):
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir), context=", overflow: truncate", inputs="docs/a.pdf"))
    job.spec.context.max_tokens = 80
    run_job(job, progress=False)
    recs = records(job)
    assert len(recs) == 2 and all(r["status"] == "ok" for r in recs)
    ctx = recs[0]["context"]
    assert ctx["truncated"] is True and ctx["tokens_dropped"] > 0 and 3 in ctx["pages_dropped"]
    assert 3 not in recs[0]["pages"]["included"]
    assert recs[0]["tokens"]["document"] + recs[0]["tokens"]["task_prompt"] + 4 <= 80

    job.spec.context.overflow = "error"
    job.output_path.unlink()
    summary = run_job(job, progress=False)
    assert summary.exit_code == 1
    err = records(job)[0]
    assert err["status"] == "error" and err["error"]["stage"] == "context" and "a.pdf" in err["error"]["message"]


def test_pages_override_selects_pages_and_is_part_of_the_key(tmp_path, docs, tiny_vlm_dir):
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir), inputs="docs/a.pdf"))
    run_job(with_pages(job, "2-3"), progress=False)
    assert {tuple(r["pages"]["included"]) for r in records(job)} == {(2, 3)}
    assert run_job(with_pages(job, "2-3"), progress=False).records_written == 0
    # the whole document is different work: it runs, it is not skipped
    assert run_job(job, progress=False).records_written == 2
    assert [r["pages"]["included"] for r in records(job)[-2:]] == [[1, 2, 3]] * 2


def test_builtin_default_reads_scanned_pages_through_ocr(tmp_path, docs, smollm2_dir):
    (docs / "b.pdf").unlink()
    make_scanned_pdf(docs / "scan.pdf", ["Scanned page: invoice 77"])
    job = load_job(write_job(tmp_path, model=None, tasks="  - {name: s, prompt: 'Summarize.', max_tokens: 2}\n"))
    engines = Engines(job)
    assert run_job(job, engines=engines, progress=False).exit_code == 0
    by_doc = {r["doc_id"]: r for r in records(job)}
    assert by_doc["docs/a.pdf"]["model"] == "builtin:smollm2-135m-instruct"
    assert by_doc["docs/a.pdf"]["pages"]["via"] == {"1": "text", "2": "text", "3": "text"}
    assert by_doc["docs/scan.pdf"]["model"] == "builtin:smollm2-135m-instruct"
    assert by_doc["docs/scan.pdf"]["context"]["n_images"] == 0
    assert by_doc["docs/scan.pdf"]["pages"]["via"] == {"1": "ocr"}
    assert by_doc["docs/scan.pdf"]["tokens"]["document"] > by_doc["docs/scan.pdf"]["tokens"]["task_prompt"]
    # no random-weight model ran; 2 tokens cannot finish a summary
    assert all(r["warnings"] == ["answer_truncated"] for r in by_doc.values())
    assert engines.loads == 1


def test_named_tiny_vlm_gets_page_images_and_warns_once(tmp_path, docs, tiny_vlm_dir, caplog):
    (docs / "b.pdf").unlink()
    make_scanned_pdf(docs / "scan.pdf", ["Scanned page: invoice 77"])
    job = load_job(write_job(tmp_path, model="builtin:tiny-qwen2-vl",
                             tasks="  - {name: s, prompt: 'Summarize.', max_tokens: 2}\n"))
    with caplog.at_level("WARNING", logger="pipeline.inference.engines"):
        assert run_job(job, engines=Engines(job), progress=False).exit_code == 0
    by_doc = {r["doc_id"]: r for r in records(job)}
    assert by_doc["docs/scan.pdf"]["pages"]["via"] == {"1": "image"}
    assert by_doc["docs/scan.pdf"]["context"]["n_images"] == 1
    assert all(set(r["warnings"]) <= {"random_weights", "answer_truncated"} and "random_weights" in r["warnings"]
               for r in by_doc.values())
    assert sum("random weights" in m for m in caplog.messages) == 1


def test_process_document_yields_records_and_writes_nothing(tmp_path, docs, tiny_vlm_dir):
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir)))
    ref = discover(job)[0]
    out = list(process_document(Engines(job), job, ref))
    assert [r["task"] for r in out] == ["summary", "fields"] and all(r["status"] == "ok" for r in out)
    assert not job.output_path.exists()
    orjson.dumps(out)  # records are plain JSON
    # a pages override (applied to the job, as the CLI does) selects pages and keys the records by it
    one = list(process_document(Engines(job), with_pages(job, "1"), ref, tasks=job.spec.tasks[:1]))
    assert one[0]["pages"]["included"] == [1]
    assert one[0]["key"] == task_keys(with_pages(job, "1"), out[0]["content_hash"])["summary"] != out[0]["key"]


def test_dry_run_loads_no_model(tmp_path, docs, smollm2_dir, monkeypatch):
    import mlx_lm
    import mlx_vlm

    import pipeline.models.load

    def forbidden(*a, **k):
        raise AssertionError("dry run loaded a model")

    monkeypatch.setattr(pipeline.models.load, "load_model", forbidden)
    monkeypatch.setattr(mlx_lm, "load", forbidden)
    monkeypatch.setattr(mlx_vlm, "load", forbidden)
    job = load_job(write_job(tmp_path, model=None))
    lines: list[str] = []
    summary = run_job(job, dry_run=True, echo=lines.append)
    assert summary.exit_code == 0 and not job.output_path.exists()
    assert lines[0].startswith("docs/a.pdf: pages=3/3 images=0 tokens=") and lines[0].endswith("fits=yes")
    assert lines[1].startswith("docs/b.pdf: pages=2/2")
    job.spec.context.max_tokens = 60
    lines.clear()
    run_job(job, dry_run=True, echo=lines.append)
    assert "fits=no" in lines[0] and "truncate would drop" in lines[0]


def test_lock_held_stops_the_run(tmp_path, docs, tiny_vlm_dir):
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir)))
    with JobLock(job.output_path):
        with pytest.raises(LockHeldError):
            run_job(job, progress=False)
    assert not job.output_path.exists() or records(job) == []


def test_progress_becomes_log_lines_without_a_terminal(tmp_path, docs, tiny_vlm_dir, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("TQPIPE_PROGRESS", "log")
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir)))
    with caplog.at_level(logging.INFO):
        run_job(job, progress=True)
    text = caplog.text
    assert "documents 2/2" in text and "\r" not in text
    assert "docs/a.pdf: " in text and "tokens prefilled in" in text  # one summary line per document


def test_text_model_on_scanned_pages_is_an_error_record(tmp_path, docs, smollm2_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    make_scanned_pdf(docs / "scan.pdf", ["Scanned page: invoice 77"])
    job = load_job(write_job(tmp_path, model=str(smollm2_dir), inputs="docs/scan.pdf", context=", images: always"))
    fake = SimpleNamespace(kind="text", model=None, processor=None, name="text-only",
                           tokenizer=AutoTokenizer.from_pretrained(str(smollm2_dir)), config={})
    out = list(process_document(Engines(job, loader=lambda *a, **k: fake), job, discover(job)[0]))
    assert [r["status"] for r in out] == ["error", "error"]
    assert out[0]["error"]["stage"] == "context" and "text-only" in out[0]["error"]["message"]
    assert out[0]["error"]["type"] == "ImagesNeedVLMError" and out[0]["model"] == "text-only"


def test_context_is_capped_at_the_models_own_limit(tmp_path, docs, tiny_vlm_dir, monkeypatch):
    from pipeline.models.load import load_model

    def small_context(path, needs_images=False):
        loaded = load_model(path, needs_images=needs_images)
        loaded.config = {**loaded.config, "max_position_embeddings": 80}
        return loaded

    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir), inputs="docs/a.pdf"))
    assert job.spec.context.max_tokens == 2048
    run_job(job, engines=Engines(job, loader=small_context), progress=False)
    rec = records(job)[0]
    assert rec["context"]["model_max_tokens"] == 80 and rec["context"]["truncated"] is True
    assert rec["tokens"]["document"] + rec["tokens"]["task_prompt"] + 4 <= 80


def test_the_document_log_line_counts_batched_decode_time_once():
    """Tasks decoded side by side overlap: the log line's decode time is the
    batch's (its slowest row), not the sum of the rows' times."""
    from pipeline.run.runner import _decode_wall_s

    batched = [{"timing": {"decode_s": s, "batch_rows": 3}} for s in (9.5, 10.0, 8.0)]
    one_by_one = [{"timing": {"decode_s": s}} for s in (9.5, 10.0, 8.0)]
    assert _decode_wall_s(batched) == 10.0 and _decode_wall_s(one_by_one) == 27.5


def test_log_lines_count_one_of_a_thing_in_the_singular(tmp_path, docs, tiny_vlm_dir, caplog):
    """One document and one task read "1 document", "1 task", "1 record", never "1 tasks"."""
    import logging

    from pipeline.run.progress import counted

    assert [counted(n, "task") for n in (0, 1, 2)] == ["0 tasks", "1 task", "2 tasks"]
    job = load_job(write_job(tmp_path, model=str(tiny_vlm_dir), inputs="docs/a.pdf",
                             tasks="  - {name: summary, prompt: 'Summarize.', max_tokens: 3}\n"))
    with caplog.at_level(logging.INFO):
        summary = run_job(job, progress=False)
    text = caplog.text
    assert re.search(r", 1 task, \d+ tokens? generated in ", text)
    assert "t: 1 document, 1 record written (1 ok, 0 failed), 0 already done" in text
    assert summary.line().startswith("1 document (0 already recorded); 1 record written: 1 ok, 0 failed")
    assert not any(s in text for s in ("1 tasks", "1 documents", "1 records"))
