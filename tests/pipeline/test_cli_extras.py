"""CLI surface added for issue 4 and the watch fixes: Ray flags, watch jobs with
empty inputs, non-document files in the inbox, peak memory in records."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.errors import JobFileError
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_text_pdf
from pipeline.run.runner import RunSummary


def write_job(tmp_path: Path, model: Path, *, inputs: str = "docs/", extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: extras\ninputs: [{inputs}]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"{extra}tasks:\n  - {{name: t0, prompt: 'Question?', max_tokens: 3}}\noutput: out/results.jsonl\n"
    )
    return job


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


# -- --address / --workers ------------------------------------------------------


@pytest.fixture
def ray_calls(monkeypatch):
    """``run_job_on_ray`` replaced by a recorder: no Ray cluster is started."""
    import pipeline.run.ray_engine as ray_engine

    calls: list[dict] = []

    def fake(job, **kwargs):
        calls.append({"job": job, **kwargs})
        return RunSummary(documents=1, done=1, records_written=1)

    monkeypatch.setattr(ray_engine, "run_job_on_ray", fake)
    return calls


def test_ray_flags_reach_run_job_on_ray(tmp_path, ray_calls):
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["page one"])
    job = write_job(tmp_path, tmp_path, extra="engine: {kind: local, address: auto, workers: 2}\n")
    r = CliRunner().invoke(main, ["run", str(job), "--engine", "ray", "--address", "ray://head:10001",
                                  "--workers", "7", "--no-progress", "--pages", "1"])
    assert r.exit_code == 0, r.output
    assert len(ray_calls) == 1
    call = ray_calls[0]
    assert (call["address"], call["workers"], call["progress"]) == ("ray://head:10001", 7, False)
    assert call["job"].spec.context.pages == "1"  # --pages reaches Ray inside the job (hence in the keys)
    assert call["job"].spec.engine.address == "auto"  # the job file is untouched; the flags override it

    ray_calls.clear()  # no flags: None, so RayRun falls back to the job's engine block
    job = write_job(tmp_path, tmp_path, extra="engine: {kind: ray, workers: 3}\n")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert (ray_calls[0]["address"], ray_calls[0]["workers"]) == (None, None)


def test_ray_flags_with_local_engine_are_a_usage_error(tmp_path, ray_calls, monkeypatch):
    import pipeline.run.runner

    monkeypatch.setattr(pipeline.run.runner, "run_job", lambda *a, **k: pytest.fail("nothing may run"))
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["page one"])
    job = write_job(tmp_path, tmp_path)
    for flags in (["--workers", "4"], ["--address", "auto"], ["--engine", "local", "--workers", "2"]):
        r = CliRunner().invoke(main, ["run", str(job), *flags])
        assert r.exit_code == 2, (flags, r.output)
        assert "only apply to the Ray engine" in r.output and "--engine ray" in r.output, r.output
        assert flags[-2] in r.output
    r = CliRunner().invoke(main, ["run", str(job), "--engine", "ray", "--workers", "0"])
    assert r.exit_code == 2 and "--workers" in r.output
    assert ray_calls == []


# -- watch ----------------------------------------------------------------------


def test_load_job_check_inputs_keyword(tmp_path):
    (tmp_path / "docs").mkdir()
    job = write_job(tmp_path, tmp_path)
    with pytest.raises(JobFileError, match=r"inputs\[0\]: .*matches no PDF"):
        load_job(job)
    assert load_job(job, check_inputs=False).spec.inputs == ["docs/"]
    # every other check still applies
    (tmp_path / "docs" / "x.txt").write_text("hi")
    bad = write_job(tmp_path, tmp_path / "no-such-model", inputs="docs/x.txt")
    with pytest.raises(JobFileError, match=r"inputs\[0\]: .*neither a PDF nor an image"):
        load_job(bad, check_inputs=False)
    bad = write_job(tmp_path, tmp_path / "no-such-model")
    with pytest.raises(JobFileError, match=r"model.path: local model folder"):
        load_job(bad, check_inputs=False)


def test_watch_job_with_empty_inputs_processes_dropped_file(tmp_path, tiny_vlm_dir, caplog):
    (tmp_path / "docs").mkdir()  # the job's own inputs folder: empty
    job = write_job(tmp_path, tiny_vlm_dir)
    assert CliRunner().invoke(main, ["run", str(job)]).exit_code == 2  # run still insists on inputs
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(inbox / "new.pdf", ["Dropped into the inbox. The code word is beta."])
    (inbox / "notes.txt").write_text("not a document")
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "4"]
    with caplog.at_level(logging.INFO):
        r = CliRunner().invoke(main, args)
    # a file that failed makes the watch exit 1, as run does, and the last line names it
    assert r.exit_code == 1, r.output
    last = r.output.splitlines()[-1]
    assert "2 file(s) handled, 1 failed: " in last and last.endswith("notes.txt"), last
    recs = lines(tmp_path / "out" / "results.jsonl")
    assert [(x["task"], x["status"]) for x in recs] == [("t0", "ok")] and recs[0]["source"].endswith("inbox/new.pdf")
    # the stray file gets a message naming IT, not the job file
    errors = [m.getMessage() for m in caplog.records if m.levelno >= logging.ERROR]
    assert any("notes.txt" in m and "not a PDF, an image or a folder of images" in m for m in errors), errors
    assert not any("job.yaml" in m for m in errors), errors
    ledger = {e["path"]: e["status"] for e in lines(tmp_path / "out" / "results.jsonl.inbox.jsonl")}
    assert ledger == {"new.pdf": "ok", "notes.txt": "failed"}
    # status reads a job without documents of its own (fed by watch) from its results
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0, r.output
    assert "done 1, failed 0, pending 0 (of 1 recorded; the job's inputs match no documents;" in r.output
    # reported once: a restarted watcher neither redoes the PDF nor repeats the message
    caplog.clear()
    with caplog.at_level(logging.INFO):
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and len(lines(tmp_path / "out" / "results.jsonl")) == 1  # nothing failed this time
    assert "0 file(s) handled, 0 failed" in r.output
    assert not [m for m in caplog.records if m.levelno >= logging.ERROR]


# -- memory in records ----------------------------------------------------------


def test_records_carry_peak_memory_and_ingest_time(tmp_path, tiny_vlm_dir, caplog):
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["First page text.", "Second page text."])
    job = write_job(tmp_path, tiny_vlm_dir)
    with caplog.at_level(logging.INFO, logger="pipeline.run.runner"):
        r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output
    (rec,) = lines(tmp_path / "out" / "results.jsonl")
    mem = rec["memory"]
    # MLX peak covers at least the model weights and the cache the document filled
    assert mem["mx_peak_bytes"] >= rec["cache"]["nbytes_after_prefill"] > 0
    assert mem["max_rss_bytes"] > 50 * 2**20  # a Python process with MLX and a model loaded
    assert rec["timing"]["ingest_s"] > 0 and rec["timing"]["prefill_s"] > 0
    line = next(m.getMessage() for m in caplog.records if "tokens prefilled" in m.getMessage())
    assert f"{mem['mx_peak_bytes'] / 2**20:.0f} MiB MLX" in line and "max RSS" in line


def test_watch_ignores_its_own_results_file_in_the_inbox(tmp_path, tiny_vlm_dir, caplog):
    (tmp_path / "docs").mkdir()
    job = write_job(tmp_path, tiny_vlm_dir)
    job.write_text(job.read_text().replace("output: out/results.jsonl", "output: inbox/results.jsonl"))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(inbox / "a.pdf", ["A page."])
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "6"]
    with caplog.at_level(logging.INFO):
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert [x["status"] for x in lines(inbox / "results.jsonl")] == ["ok"]
    assert not [m.getMessage() for m in caplog.records if m.levelno >= logging.ERROR]
    ledger = {e["path"]: e["status"] for e in lines(inbox / "results.jsonl.inbox.jsonl")}
    assert ledger["a.pdf"] == "ok" and ledger.get("results.jsonl") == "ignored"
