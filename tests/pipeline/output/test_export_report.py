"""Exports (markdown, csv, parquet), the HTML report in a real headless Chromium, and their CLI."""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_corrupt_pdf, make_text_pdf
from pipeline.output.export import ExportError, export, records_for_export, to_csv
from pipeline.output.report import render_report, warnings_of


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_vlm_dir) -> Path:
    """A job with a text task, a JSON task and a broken PDF, run once on the tiny VLM."""
    d = tmp_path_factory.mktemp("exported")
    (d / "docs").mkdir()
    for i in range(2):
        make_text_pdf(d / "docs" / f"doc{i}.pdf", [f"Document {i}, page {p}. Total {p * 10} EUR." for p in (1, 2)])
    make_corrupt_pdf(d / "docs" / "broken.pdf")
    (d / "job.yaml").write_text(
        f"name: exp\ninputs: [docs/]\nmodel: {{path: '{tiny_vlm_dir}'}}\n"
        "cache: {prefill_chunk: 64}\n"
        "tasks:\n  - {name: summary, prompt: 'Summarize.', max_tokens: 3}\n"
        "  - {name: fields, prompt: 'Total?', format: json, fields: [total, currency], max_tokens: 60}\n"
        "output: out/results.jsonl\n")
    r = CliRunner().invoke(main, ["run", str(d / "job.yaml"), "--no-progress"])
    assert r.exit_code == 1, r.output  # the broken PDF fails, the rest is done
    return d


def test_csv_has_one_row_per_record_and_parsed_columns(run_dir):
    results = run_dir / "out" / "results.jsonl"
    records = records_for_export(results)
    rows = list(csv.DictReader(io.StringIO(to_csv(records).decode())))
    assert len(rows) == len(records) == 6
    fields = [r for r in rows if r["task"] == "fields" and r["status"] == "ok"]
    assert len(fields) == 2 and all(r["json_status"] == "valid" for r in fields)
    assert {"parsed.total", "parsed.currency"} <= set(rows[0])
    broken = [r for r in rows if r["doc_id"] == "docs/broken.pdf"]
    assert {r["status"] for r in broken} == {"error"} and all(r["error_message"] for r in broken)
    assert all(int(r["kv_fp16_nbytes"]) > 0 for r in rows if r["status"] == "ok")
    # each row carries the record's warning codes (the summaries stop at max_tokens: 3)
    by_key = {r["key"]: r for r in records}
    assert all(x["warnings"] == ",".join(by_key[x["key"]]["warnings"]) for x in rows)
    assert all("answer_truncated" in x["warnings"].split(",") for x in rows if x["task"] == "summary" and x["status"] == "ok")


def test_markdown_has_a_section_per_document_and_task(run_dir, tmp_path):
    out = tmp_path / "r.md"
    assert export(run_dir / "out" / "results.jsonl", "markdown", out, job_name="exp") == 6
    text = out.read_text()
    assert text.startswith("# exp\n") and text.count("\n## ") == 3 and text.count("\n### ") == 6
    export(run_dir / "out" / "results.jsonl", "markdown", out, job_name="exp", task_order=["summary", "fields"])
    tasks = [x for x in out.read_text().splitlines() if x.startswith("### ")]
    assert tasks[:2] == ["### summary", "### fields"]  # the job's order, not the alphabet's
    assert "```json" in text and "> **failed** (ingest)" in text
    assert "> warnings: " in text and "answer_truncated" in text  # what may be wrong is said beside the answer


def test_markdown_keeps_odd_names_literal_and_on_their_heading_line(tmp_path):
    from pipeline.output.export import to_markdown

    recs = [{"doc_id": "docs/new\n# Injected <img src=x onerror=alert(1)>.pdf", "task": "t", "status": "error",
             "error": {"stage": "ingest", "type": "IngestError", "message": "a\nb"}}]
    text = to_markdown(recs, "job_with_underscores").decode()
    lines = text.splitlines()
    assert lines[0] == "# job\\_with\\_underscores"
    assert [x for x in lines if x.startswith("#")] == [
        lines[0], "## docs/new\\n\\# Injected &lt;img src=x onerror=alert\\(1\\)&gt;.pdf", "### t"]
    assert "<img" not in text and "> **failed** (ingest): IngestError: a\\nb" in lines


@pytest.mark.parametrize("fmt", ["csv", "markdown", "parquet", "report"])
def test_a_failed_export_leaves_the_previous_file_whole(run_dir, tmp_path, monkeypatch, fmt):
    """Export and report write a sibling and rename it: a write that fails
    (a full disk) leaves the last good file, and no stray temporary."""
    from pipeline.output import report

    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    out = tmp_path / "prev.out"
    results = run_dir / "out" / "results.jsonl"
    write = (lambda: report.write_report(results, out, job_name="exp")) if fmt == "report" else (
        lambda: export(results, fmt, out, job_name="exp"))
    write()
    before = out.read_bytes()
    assert before

    def full(path, data=b"", *a, **k):  # the disk fills after the first bytes
        with open(path, "wb") as f:
            f.write(b"torn")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.setattr(Path, "write_text", full)
    monkeypatch.setattr("pyarrow.parquet.write_table", lambda table, path, *a, **k: full(path), raising=False)
    with pytest.raises(OSError, match="No space left"):
        write()
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["prev.out"]


def test_parquet_round_trips_and_missing_pyarrow_is_a_clear_error(run_dir, tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "r.parquet"
    export(run_dir / "out" / "results.jsonl", "parquet", out, job_name="exp")
    table = pq.read_table(out)
    assert table.num_rows == 6 and "parsed.total" in table.column_names
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(ExportError, match=r"needs pyarrow: pip install 'tqpipe\[parquet\]'"):
        export(run_dir / "out" / "results.jsonl", "parquet", tmp_path / "x.parquet", job_name="exp")


def test_export_and_report_commands(run_dir, tmp_path):
    job = str(run_dir / "job.yaml")
    r = CliRunner().invoke(main, ["export", job, "--format", "csv"])
    assert r.exit_code == 0 and (run_dir / "out" / "results.csv").is_file(), r.output
    r = CliRunner().invoke(main, ["report", job, "-o", str(tmp_path / "rep.html")])
    assert r.exit_code == 0 and "6 records" in r.output
    empty = tmp_path / "empty.yaml"
    empty.write_text(f"name: e\ninputs: [{run_dir / 'docs'}]\ntasks: [{{name: a, prompt: p}}]\noutput: none.jsonl\n")
    r = CliRunner().invoke(main, ["report", str(empty)])
    assert r.exit_code == 2 and "no results yet" in r.stderr


@pytest.mark.parametrize("cmd", [["export", "--format", "csv"], ["export", "--format", "markdown"], ["report"]])
def test_export_and_report_never_overwrite_what_is_not_theirs(run_dir, tmp_path, cmd):
    """They overwrite their target, so -o must not name the results, the job
    file, an input or a folder; a place that cannot be written is exit 4."""
    job = run_dir / "job.yaml"
    keep = {p: p.read_bytes() for p in (run_dir / "out" / "results.jsonl", job, run_dir / "docs" / "doc0.pdf")}
    for target, reason in [(run_dir / "out" / "results.jsonl", "is the job's results file"),
                           (job, "exists and is not a"), (run_dir / "docs" / "doc0.pdf", "exists and is not a"),
                           (run_dir / "docs", "is a folder")]:
        r = CliRunner().invoke(main, [cmd[0], str(job), *cmd[1:], "-o", str(target)])
        assert r.exit_code == 2 and f"-o/--output: {target}: {reason}" in r.stderr, (target, r.output)
    assert all(p.read_bytes() == data for p, data in keep.items())
    blocker = tmp_path / "note.txt"
    blocker.write_text("a file where a folder would have to be")
    r = CliRunner().invoke(main, [cmd[0], str(job), *cmd[1:], "-o", str(blocker / "x.out")])
    assert r.exit_code == 4 and "cannot be written" in r.stderr and "Traceback" not in r.output, r.output


def test_export_and_report_show_the_current_config_only(tmp_path, tiny_vlm_dir):
    """After a task is edited its older records are stale (status says so):
    exports and the report show each (document, task) once, as it stands."""
    (tmp_path / "docs").mkdir()
    for i in range(2):
        make_text_pdf(tmp_path / "docs" / f"d{i}.pdf", [f"Document {i}."])
    job = tmp_path / "job.yaml"
    job.write_text(f"name: cur\ninputs: [docs/]\nmodel: {{path: '{tiny_vlm_dir}'}}\n"
                   "tasks:\n  - {name: summary, prompt: 'Summarize.', max_tokens: 2}\n"
                   "  - {name: other, prompt: 'Other?', max_tokens: 2}\noutput: out/r.jsonl\n")
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    job.write_text(job.read_text().replace("'Summarize.'", "'Summarize briefly.'"))
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    assert "2 stale keys" in CliRunner().invoke(main, ["status", str(job)]).output
    r = CliRunner().invoke(main, ["export", str(job), "--format", "csv"])
    assert r.exit_code == 0 and r.output.startswith("4 records"), r.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "out" / "r.csv").read_text())))
    assert sorted((x["doc_id"], x["task"]) for x in rows) == [(f"docs/d{i}.pdf", t) for i in range(2)
                                                              for t in ("other", "summary")]
    r = CliRunner().invoke(main, ["report", str(job)])
    assert r.exit_code == 0 and r.output.startswith("4 records"), r.output
    job.write_text(job.read_text().replace("'Other?'", "'Else?'").replace("'Summarize briefly.'", "'Sum up.'"))
    r = CliRunner().invoke(main, ["export", str(job), "--format", "csv"])
    assert r.exit_code == 2 and "no results yet for the job's current tasks and config (6 records" in r.stderr


def test_report_page_holds_plot_documents_and_warnings(run_dir):
    records = records_for_export(run_dir / "out" / "results.jsonl")
    page = render_report(records, job_name="exp", results=run_dir / "out" / "results.jsonl")
    assert page.count('<tr class="doc">') == 6 and page.count('class="measured"') == 4  # one point per ok record
    assert "<script src" not in page and "http" not in page.split("<body", 1)[1]  # self-contained
    assert "fp16 (formula" in page and "turboquant 3.5 bits" in page
    assert "answer hit max_tokens" in warnings_of({"finish_reason": "length"})
    assert warnings_of({"context": {"truncated": True, "tokens_dropped": 9}, "warnings": ["random_weights", "truncated"]}
                       ) == ["random_weights: the model's answers are noise", "truncated: 9 tokens dropped"]
    assert warnings_of({"context": {"truncated": True, "tokens_dropped": 9}}) == ["truncated: 9 tokens dropped"]


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no Chromium binary on this machine (apt-get install chromium)")
def test_report_renders_in_headless_chromium_with_a_screenshot(run_dir, tmp_path):
    page = tmp_path / "report.html"
    CliRunner().invoke(main, ["report", str(run_dir / "job.yaml"), "-o", str(page)])
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1400",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-rendered="6"' in dom.stdout  # the page's script ran in the browser and saw every row
    assert dom.stdout.count("<circle") == 4 and "<polyline" in dom.stdout
    shot = tmp_path / "report.png"
    r = subprocess.run([*base, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1400)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, lines and points, not a blank page
    assert any(abs(r - 0xD9) < 30 and abs(g - 0x48) < 30 and b < 60 for _, (r, g, b) in colors)  # the cache's line


def test_status_export_and_report_take_the_flags_a_run_used(tmp_path, tiny_vlm_dir):
    """Records of a run with overrides carry that config's keys: status,
    export and report find them when given the same flags (without them,
    the job file's config, whose records are still pending)."""
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "d.pdf", ["Document."])
    job = tmp_path / "job.yaml"
    job.write_text(f"name: ov\ninputs: [docs/]\nmodel: {{path: '{tiny_vlm_dir}'}}\n"
                   "tasks: [{name: s, prompt: 'Summarize.', max_tokens: 2}]\noutput: out/r.jsonl\n")
    flags = ["--kv-bits", "4", "--max-tokens", "3", "--pages", "1"]
    assert CliRunner().invoke(main, ["run", str(job), *flags, "--no-progress"]).exit_code == 0
    r = CliRunner().invoke(main, ["status", str(job)])
    assert "pending 1" in r.output and "1 stale" in r.output, r.output
    r = CliRunner().invoke(main, ["status", str(job), *flags])
    assert r.exit_code == 0 and "done 1, failed 0, pending 0" in r.output, r.output
    assert CliRunner().invoke(main, ["export", str(job), "--format", "csv"]).exit_code == 2
    r = CliRunner().invoke(main, ["export", str(job), "--format", "csv", *flags])
    assert r.exit_code == 0 and r.output.startswith("1 records"), r.output
    r = CliRunner().invoke(main, ["report", str(job), *flags])
    assert r.exit_code == 0 and "1 records" in r.output, r.output
