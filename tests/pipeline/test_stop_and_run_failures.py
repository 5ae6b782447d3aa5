"""Issue 27: SIGTERM/SIGINT stop cleanly; failures of the run are not failures of documents (exit 4)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_text_pdf
from pipeline.output.lock import JobLock

REPO = Path(__file__).resolve().parents[2]


def make_job(tmp_path: Path, model: str | Path, *, docs: int = 2, max_tokens: int = 2, output: str = "out/results.jsonl") -> Path:
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for i in range(docs):
        make_text_pdf(d / f"doc{i}.pdf", [f"Document {i}, page {p}. The code word is alpha{i}{p}." for p in range(1, 3)])
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: stop\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"tasks:\n  - {{name: t0, prompt: 'Question?', max_tokens: {max_tokens}}}\n"
        f"  - {{name: t1, prompt: 'Another?', max_tokens: {max_tokens}}}\noutput: {output}\n"
    )
    return job


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


# -- signals ------------------------------------------------------------------


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_mid_run_stops_cleanly_and_a_rerun_finishes(tmp_path, tiny_vlm_dir, sig, code):
    docs = 4
    job = make_job(tmp_path, tiny_vlm_dir, docs=docs, max_tokens=24)
    out = tmp_path / "out" / "results.jsonl"
    env = {**os.environ, "TQPIPE_PROGRESS": "off", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(job)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    err_lines = [x for x in err.decode().splitlines() if x.startswith("tqpipe:")]
    assert proc.returncode == code, err.decode()[-2000:]
    assert len(err_lines) == 1 and f"stopped by {signal.Signals(sig).name}" in err_lines[0], err.decode()
    assert "Traceback" not in err.decode() and "Aborted!" not in err.decode()
    n = len(lines(out))  # the record in flight may be the one seen: it is rolled back, not left torn
    assert n < docs * 2
    with JobLock(out):  # released
        pass
    done = subprocess.run(cmd, env=env, capture_output=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    keys = [r["key"] for r in lines(out)]
    assert len(keys) == len(set(keys)) == docs * 2  # exactly once


def test_sigterm_stops_watch_with_143(tmp_path, tiny_vlm_dir):
    (tmp_path / "docs").mkdir()
    job = make_job(tmp_path, tiny_vlm_dir, docs=0)
    job.write_text(job.read_text().replace("inputs: [docs/]", "inputs: []"))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    env = {**os.environ, "TQPIPE_PROGRESS": "off", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "watch", "inbox", "--job", str(job), "--poll", "0.05"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    ledger_lock = tmp_path / "out" / "results.jsonl.inbox.jsonl.lock"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ledger_lock.exists():
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert [x for x in err.decode().splitlines() if x.startswith("tqpipe:")] == [
        x for x in err.decode().splitlines() if "stopped by SIGTERM" in x]
    with JobLock(tmp_path / "out" / "results.jsonl.inbox.jsonl"):
        pass


# -- failures of the run --------------------------------------------------------


def test_model_that_cannot_load_writes_no_records_and_exits_4(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = make_job(tmp_path, "no-such-org/no-such-model")
    for args in (["run", str(job), "--no-progress"], ["run", str(job), "--dry-run"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 4, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1 and "no-such-org/no-such-model" in r.output, r.output
        assert "Traceback" not in r.output
    assert lines(tmp_path / "out" / "results.jsonl") == []  # no document was blamed
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "failed 0, pending 4" in r.output


def test_one_model_load_error_class():
    import pipeline.errors
    import pipeline.models.load

    assert pipeline.models.load.ModelLoadError is pipeline.errors.ModelLoadError
    assert issubclass(pipeline.errors.ModelLoadError, pipeline.errors.RunError)


def test_output_folder_that_cannot_be_created_exits_4(tmp_path, tiny_vlm_dir):
    (tmp_path / "blocker").write_text("a file where the results folder should be")
    job = make_job(tmp_path, tiny_vlm_dir, output="blocker/results.jsonl")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 4 and "blocker" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert "is a file where a folder of the output's path would have to be" in r.output  # not 'File exists'
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 4 and "is a file where a folder" in r.output, r.output  # not 'is not writable'


def test_full_disk_exits_4_and_rolls_back(tmp_path, tiny_vlm_dir, monkeypatch):
    import pipeline.output.results_log as results_log

    job = make_job(tmp_path, tiny_vlm_dir)
    real_write = os.write

    def full(fd, data):
        if bytes(data[:17]) == b'{"schema_version"':
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(results_log.os, "write", full)
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 4 and "No space left on device" in r.output, r.output
    assert (tmp_path / "out" / "results.jsonl").read_bytes() == b""
    monkeypatch.undo()
    assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0


def test_watch_with_a_model_that_cannot_load_exits_4_without_marking_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    job = make_job(tmp_path, "no-such-org/no-such-model", docs=0)
    job.write_text(job.read_text().replace("inputs: [docs/]", "inputs: []"))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(inbox / "new.pdf", ["Dropped."])
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "3"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 4 and "no-such-org/no-such-model" in r.output, r.output
    assert lines(tmp_path / "out" / "results.jsonl.inbox.jsonl") == []  # offered again once the model is fixed
    assert lines(tmp_path / "out" / "results.jsonl") == []


def test_unreadable_file_is_an_error_record_retried_by_plain_reruns_three_times(tmp_path, tiny_vlm_dir, monkeypatch):
    import pipeline.inputs.discover as discover
    from pipeline.errors import IngestError

    job = make_job(tmp_path, tiny_vlm_dir)
    real = discover.content_hash

    def flaky(ref):
        if ref.source.name == "doc0.pdf":
            raise IngestError(ref.source, "cannot read file: Input/output error", transient=True)
        return real(ref)

    for mod in ("pipeline.run.plan", "pipeline.run.document", "pipeline.inputs.ingest"):
        monkeypatch.setattr(f"{mod}.content_hash", flaky)
    codes = [CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code for _ in range(4)]
    assert codes == [1, 1, 1, 1]  # the other document is done, this one fails
    recs = lines(tmp_path / "out" / "results.jsonl")
    bad = [r for r in recs if r["doc_id"] == "docs/doc0.pdf"]
    assert len(bad) == 3 * 2 and all(r["error"]["transient"] for r in bad)  # 3 attempts x 2 tasks, then no more
    assert bad[0]["content_hash"].startswith("unreadable:") and "doc0.pdf" in bad[0]["error"]["message"]
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 1 and "done 2, failed 2, pending 0" in r.output
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress", "--retry-failed"])
    assert r.exit_code == 0, r.output
