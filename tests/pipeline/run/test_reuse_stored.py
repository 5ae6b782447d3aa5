"""A stored document cache answers without reading the document, exactly as a full run would."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_text_pdf

PAGES = [f"Page {p} of the harbor report. The code word for page {p} is kestrel{p}." for p in range(1, 5)]
# fields that differ between two runs of the same document by design
RUN_FIELDS = {"created_at", "timing", "memory", "job", "key", "config_hash"}


def write_job(folder: Path, model: Path, tasks: list[tuple[str, int]], *, store: str = "store",
              max_tokens: int = 8192, output: str = "out.jsonl", name: str = "reuse") -> Path:
    lines = "".join(f"  - {{name: {t}, prompt: 'What is the code word for page 2?', max_tokens: {n}}}\n"
                    for t, n in tasks)
    job = folder / f"{name}.yaml"
    job.write_text(
        f"name: {name}\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"context: {{max_tokens: {max_tokens}}}\n"
        f"tasks:\n{lines}output: {output}\ncache_store: {{path: {store}, max_gb: 1}}\n")
    return job


def run(job: Path) -> list[dict]:
    """``tqpipe run JOB``; every record of the job's output so far."""
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    output = next(line.split(": ", 1)[1] for line in job.read_text().splitlines() if line.startswith("output: "))
    return [orjson.loads(x) for x in (job.parent / output).read_bytes().splitlines()]


@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "report.pdf", PAGES)
    return tmp_path


def no_reading(monkeypatch):
    """Make any reading of a document fail the test."""
    def read(*a, **k):
        raise AssertionError("the document was read")

    monkeypatch.setattr("pipeline.run.document.ingest", read)


def comparable(record: dict) -> dict:
    out = {k: v for k, v in record.items() if k not in RUN_FIELDS}
    out["cache"] = {k: v for k, v in record["cache"].items() if k not in ("doc_cache", "nbytes_allocated")}
    return out


def test_an_added_task_is_answered_from_the_store_without_reading(folder, tiny_vlm_dir, monkeypatch, caplog):
    first = run(write_job(folder, tiny_vlm_dir, [("a", 4)]))
    assert first[0]["cache"]["doc_cache"]["saved"] and first[0]["timing"]["ingest_s"] > 0

    fresh = run(write_job(folder, tiny_vlm_dir, [("b", 5)], store="other-store", output="fresh.jsonl",
                          name="fresh"))  # the reference: a full reading and prefill
    no_reading(monkeypatch)
    added = run(write_job(folder, tiny_vlm_dir, [("a", 4), ("b", 5)]))[1:]
    assert [r["task"] for r in added] == ["b"]
    rec = added[0]
    assert rec["status"] == "ok" and rec["cache"]["doc_cache"]["hit"] is True
    assert rec["cache"]["doc_cache"]["ingest"] == "skipped" and rec["cache"]["doc_cache"]["lookup_s"] >= 0
    assert rec["timing"]["ingest_s"] == 0.0 and rec["timing"]["prefill_s"] == 0.0
    assert comparable(rec) == comparable(fresh[0])  # output, pages, context, warnings, tokens, cache sizes
    assert "tokens loaded from the document cache in" in caplog.text and "(document not read)" in caplog.text


def test_a_renamed_copy_is_answered_from_the_store(folder, tiny_vlm_dir, monkeypatch):
    run(write_job(folder, tiny_vlm_dir, [("a", 4)]))
    shutil.move(folder / "docs" / "report.pdf", folder / "docs" / "renamed copy (1).pdf")
    no_reading(monkeypatch)
    (rec,) = run(write_job(folder, tiny_vlm_dir, [("a", 4)], output="renamed.jsonl"))
    assert rec["doc_id"] == "docs/renamed copy (1).pdf" and rec["cache"]["doc_cache"]["ingest"] == "skipped"


def test_a_cut_document_is_read_again_and_compared(folder, tiny_vlm_dir):
    """A document cut to fit is stored, but its tokens depend on the tasks'
    room: a later run reads it and uses the entry only if the tokens match."""
    run(write_job(folder, tiny_vlm_dir, [("a", 4)], max_tokens=160))
    (entry,) = (folder / "store").glob("*.safetensors")
    again = run(write_job(folder, tiny_vlm_dir, [("a", 4), ("b", 4)], max_tokens=160))[1:]
    doc_cache = again[0]["cache"]["doc_cache"]
    assert again[0]["context"]["truncated"] is True and "truncated" in again[0]["warnings"]
    assert doc_cache["hit"] is True and "ingest" not in doc_cache and again[0]["timing"]["ingest_s"] > 0
    # a task that needs more room cuts the document shorter: the entry is replaced, not reused
    longer = run(write_job(folder, tiny_vlm_dir, [("a", 4), ("b", 4), ("c", 40)], max_tokens=160))[2:]
    assert longer[0]["cache"]["doc_cache"]["hit"] is False and longer[0]["cache"]["doc_cache"]["saved"]
    assert longer[0]["tokens"]["document"] < again[0]["tokens"]["document"]
    (replaced,) = (folder / "store").glob("*.safetensors")
    assert replaced.name == entry.name  # same key, new reading


def test_a_task_that_no_longer_fits_reads_the_document(folder, tiny_vlm_dir):
    """Stored whole, but this run's task needs more room than is left: read
    and cut, never answered from the whole stored reading."""
    first = run(write_job(folder, tiny_vlm_dir, [("a", 4)], max_tokens=512))
    tokens = first[0]["tokens"]["document"]
    big = 512 - tokens  # now the document no longer fits beside this task
    (rec,) = run(write_job(folder, tiny_vlm_dir, [("a", 4), ("b", big)], max_tokens=512))[1:]
    assert rec["timing"]["ingest_s"] > 0 and rec["context"]["truncated"] is True
    assert rec["tokens"]["document"] < tokens


def test_page_images_are_answered_from_the_store_without_rendering(tmp_path, tiny_vlm_dir, monkeypatch):
    """A VLM document with a scanned page: the stored cache holds the image
    tokens' keys and values and the multimodal position offset, so the page
    is not rendered again and the answer equals a full run's."""
    from pipeline.inputs.samples import make_mixed_pdf

    (tmp_path / "docs").mkdir()
    make_mixed_pdf(tmp_path / "docs" / "mixed.pdf", [("Harbor report, page one.", False),
                                                     ("A scanned page: revenue grew by 12 percent.", True)])
    first = run(write_job(tmp_path, tiny_vlm_dir, [("a", 4)]))
    assert first[0]["context"]["n_images"] == 1 and first[0]["pages"]["via"]["2"] == "image"
    fresh = run(write_job(tmp_path, tiny_vlm_dir, [("b", 4)], store="other-store", output="fresh.jsonl", name="fresh"))
    no_reading(monkeypatch)
    (rec,) = run(write_job(tmp_path, tiny_vlm_dir, [("a", 4), ("b", 4)]))[1:]
    assert rec["cache"]["doc_cache"]["ingest"] == "skipped"
    assert comparable(rec) == comparable(fresh[0])


def test_an_entry_whose_stored_prompt_is_unusable_is_dropped_and_the_document_read(folder, tiny_vlm_dir, monkeypatch,
                                                                                   caplog):
    import pipeline.inference.prompt as prompt_mod

    run(write_job(folder, tiny_vlm_dir, [("a", 4)]))

    def broken(cls, *a, **k):
        raise ValueError("stored prompt lists 3 tokens, the cache holds 4")

    monkeypatch.setattr(prompt_mod.DocumentPrompt, "from_stored", classmethod(broken))
    (rec,) = run(write_job(folder, tiny_vlm_dir, [("a", 4), ("b", 4)]))[1:]
    assert rec["status"] == "ok" and rec["timing"]["ingest_s"] > 0 and rec["cache"]["doc_cache"]["hit"] is False
    assert "its stored prompt is unusable" in caplog.text


def test_an_entry_with_page_images_is_no_candidate_for_a_job_whose_model_reads_none(tmp_path, monkeypatch):
    """A default-model job (text only: scans go through OCR) must not load a
    vision model for an entry another model stored with page images: that
    load fails (the built-in default reads no images) and stopped the run."""
    from types import SimpleNamespace

    from pipeline.inputs.job_file import load_job
    from pipeline.run import document as run_document

    job_path = tmp_path / "job.yaml"
    job_path.write_text("name: j\ninputs: []\nmodel: {}\ntasks:\n  - {name: t, prompt: 'Who?'}\n"
                        "output: out.jsonl\ncache_store: {path: store, max_gb: 1}\n")
    job = load_job(job_path, check_inputs=False)
    entry = SimpleNamespace(info={"reusable": True, "needs_images": True}, path=tmp_path / "store" / "x")
    store = SimpleNamespace(candidates=lambda digest: [entry])
    monkeypatch.setattr("pipeline.inference.doc_cache.store_for_job", lambda job: store)

    class TextOnly:
        def reads_images(self):
            return False

        def get(self, needs_images):
            raise AssertionError(f"a model was loaded for needs_images={needs_images}")

    ref = SimpleNamespace(source=tmp_path / "a.pdf", doc_id="a.pdf")
    assert run_document.reuse_stored(TextOnly(), job, ref, "sha256:00", job.spec.tasks) is None
