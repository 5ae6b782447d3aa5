"""Issue 27, watch: empty ``inputs:``, a relative inbox, files still open for writing, retries after a change."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_text_pdf
from pipeline.run.watch import InboxWatcher


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def job_with_no_inputs(folder: Path, model: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(
        f"name: w\ninputs: []\nmodel: {{path: '{model}'}}\n"
        "tasks:\n  - {name: t0, prompt: 'Question?', max_tokens: 2}\noutput: out/results.jsonl\n"
    )
    return job


def test_empty_inputs_and_an_inbox_relative_to_the_current_folder(tmp_path, tiny_vlm_dir, monkeypatch):
    job = job_with_no_inputs(tmp_path / "jobs", tiny_vlm_dir)
    load_job(job, check_inputs=False)  # inputs: [] is a valid job for watch
    assert CliRunner().invoke(main, ["run", str(job)]).exit_code == 2  # ... and not for run
    work = tmp_path / "work"
    (work / "inbox").mkdir(parents=True)
    make_text_pdf(work / "inbox" / "real.pdf", ["A real PDF."])
    monkeypatch.chdir(work)
    args = ["watch", "inbox", "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "3"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    recs = lines(tmp_path / "jobs" / "out" / "results.jsonl")
    assert [(x["status"], x["source"]) for x in recs] == [("ok", str(work / "inbox" / "real.pdf"))]


def test_a_file_still_open_for_writing_waits_past_the_settle_time(tmp_path):
    from pipeline.run.watch import open_for_writing_elsewhere

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    w = InboxWatcher(inbox, tmp_path / "ledger.jsonl", settle_seconds=0.1, poll_seconds=0.05)
    target = inbox / "scan.pdf"
    with open(target, "wb") as f:  # a copy that pauses far longer than --settle
        f.write(b"%PDF-1.4 first half")
        f.flush()
        assert open_for_writing_elsewhere(target)
        found = []
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            found += w.poll()
            time.sleep(0.05)
        assert found == []
        f.write(b" second half")
    assert not open_for_writing_elsewhere(target)
    found = []
    end = time.monotonic() + 0.6
    while time.monotonic() < end and not found:
        found += w.poll()
        time.sleep(0.05)
    assert found == [target]


def test_a_file_that_changes_after_a_failure_is_retried(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    target = inbox / "a.pdf"
    target.write_bytes(b"%PDF half-copied")
    w = InboxWatcher(inbox, tmp_path / "ledger.jsonl", settle_seconds=0.05, poll_seconds=0.02)
    seen = []

    def handle(path: Path) -> str:
        seen.append(path.read_bytes())
        return "failed" if len(seen) == 1 else "ok"

    w.run(handle, max_iterations=8)
    target.write_bytes(b"%PDF half-copied, and the rest")
    w.run(handle, max_iterations=8)
    assert seen == [b"%PDF half-copied", b"%PDF half-copied, and the rest"]
    assert [e["status"] for e in lines(tmp_path / "ledger.jsonl")] == ["failed", "ok"]


def test_a_copy_dropped_later_gets_its_own_records(tmp_path, tiny_vlm_dir):
    job = job_with_no_inputs(tmp_path / "jobs", tiny_vlm_dir)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(inbox / "a.pdf", ["Dropped first."])
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "3"]
    assert CliRunner().invoke(main, args).exit_code == 0
    (inbox / "b.pdf").write_bytes((inbox / "a.pdf").read_bytes())  # the same scan, sent again
    assert CliRunner().invoke(main, args).exit_code == 0
    recs = lines(tmp_path / "jobs" / "out" / "results.jsonl")
    assert [(Path(x["source"]).name, x.get("same_content_as")) for x in recs] == [
        ("a.pdf", None), ("b.pdf", "../inbox/a.pdf")]
    ledger = [(e["path"], e["status"]) for e in lines(tmp_path / "jobs" / "out" / "results.jsonl.inbox.jsonl")]
    assert ledger == [("a.pdf", "ok"), ("b.pdf", "duplicate")]


def test_a_files_newer_result_supersedes_its_half_copy_in_status_and_export(tmp_path, tiny_vlm_dir):
    """A half-copied PDF fails (its error record stays in the file), then the
    whole copy is processed: the file's latest result is what status counts
    and export shows, not a failure forever beside it."""
    job = job_with_no_inputs(tmp_path / "jobs", tiny_vlm_dir)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(tmp_path / "whole.pdf", ["A letter that arrives in two steps."])
    data = (tmp_path / "whole.pdf").read_bytes()
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "3"]
    (inbox / "letter.pdf").write_bytes(data[:400])
    assert CliRunner().invoke(main, args).exit_code == 1  # the half copy failed
    (inbox / "letter.pdf").write_bytes(data)
    assert CliRunner().invoke(main, args).exit_code == 0
    recs = lines(tmp_path / "jobs" / "out" / "results.jsonl")
    assert [x["status"] for x in recs] == ["error", "ok"]
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "done 1, failed 0" in r.output, r.output
    r = CliRunner().invoke(main, ["export", str(job), "--format", "csv"])
    assert r.exit_code == 0 and r.output.startswith("1 records"), r.output


def test_a_folder_of_pdfs_dropped_into_the_inbox_is_read(tmp_path, tiny_vlm_dir):
    """A dropped folder is read as an input folder is: its PDFs, each a
    document (it was skipped without a word for holding no images)."""
    job = job_with_no_inputs(tmp_path / "jobs", tiny_vlm_dir)
    inbox = tmp_path / "inbox"
    (inbox / "batch").mkdir(parents=True)
    for i in range(2):
        make_text_pdf(inbox / "batch" / f"doc{i}.pdf", [f"Document {i} of the batch."])
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "3"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    recs = lines(tmp_path / "jobs" / "out" / "results.jsonl")
    assert sorted(Path(x["source"]).name for x in recs if x["status"] == "ok") == ["doc0.pdf", "doc1.pdf"]
    assert CliRunner().invoke(main, args).exit_code == 0  # handled once: a restart does not redo it
    assert len(lines(tmp_path / "jobs" / "out" / "results.jsonl")) == 2
