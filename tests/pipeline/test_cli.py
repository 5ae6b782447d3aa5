"""The tqpipe CLI: exit codes, status, validate, samples, watch, and kill -9 / resume."""

from __future__ import annotations

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
from pipeline.inputs.samples import make_corrupt_pdf, make_text_pdf
from pipeline.output.lock import JobLock

REPO = Path(__file__).resolve().parents[2]


def make_job(tmp_path: Path, model: Path, *, docs: int = 2, tasks: int = 2, max_tokens: int = 3, extra: str = "") -> Path:
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for i in range(docs):
        make_text_pdf(d / f"doc{i}.pdf", [f"Document {i}, page {p}. The code word is alpha{i}{p}." for p in range(1, 4)])
    task_lines = "".join(f"  - {{name: t{j}, prompt: 'Question {j}?', max_tokens: {max_tokens}}}\n" for j in range(tasks))
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: cli\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"{extra}tasks:\n{task_lines}output: out/results.jsonl\n"
    )
    return job


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_help_documents_exit_codes():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("run", "watch", "status", "validate", "samples"):
        out = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "Exit codes" in out and "3  the job's lock is held" in out, cmd
    assert "--dry-run" in CliRunner().invoke(main, ["run", "--help"]).output


def test_bad_job_file_exits_2_without_loading_a_model(tmp_path, monkeypatch):
    import pipeline.models.load

    called = []
    monkeypatch.setattr(pipeline.models.load, "load_model", lambda *a, **k: called.append(a))
    job = tmp_path / "bad.yaml"
    job.write_text("name: x\ninputs: [nothing/]\ntasks:\n  - {name: a, prompt: p, max_tokens: -5}\noutput: o.jsonl\n")
    for cmd in (["run"], ["validate"], ["status"], ["run", "--dry-run"]):
        r = CliRunner().invoke(main, [*cmd, str(job)])
        assert r.exit_code == 2, (cmd, r.output)
        assert "bad.yaml" in r.output and "max_tokens" in r.output
    assert called == []
    r = CliRunner().invoke(main, ["run", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "not found" in r.output
    # an input that is gone is an error for status too (an empty one is a watch job's)
    job.write_text("name: x\ninputs: [nothing/]\ntasks:\n  - {name: a, prompt: p}\noutput: o.jsonl\n")
    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 2 and r.output.strip().endswith(f"inputs[0]: {str(tmp_path / 'nothing')!r} does not exist")


def test_bad_pages_option_exits_2(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir)
    r = CliRunner().invoke(main, ["run", str(job), "--pages", "3-x"])
    assert r.exit_code == 2 and "--pages" in r.output


def test_run_status_validate_and_failures(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir)
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0 and "documents: 2 (2 PDF" in r.output

    r = CliRunner().invoke(main, ["status", str(job)])
    assert r.exit_code == 0 and "done 0, failed 0, pending 4" in r.output

    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "2 documents (0 already recorded); 4 records written: 4 ok, 0 failed" in r.output
    r = CliRunner().invoke(main, ["status", str(job)])
    assert "done 4, failed 0, pending 0" in r.output

    make_corrupt_pdf(tmp_path / "docs" / "zz-broken.pdf")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 1 and "zz-broken.pdf" in r.output
    r = CliRunner().invoke(main, ["status", str(job), "--json"])
    counts = orjson.loads(r.output.strip().splitlines()[-1])
    assert r.exit_code == 1 and (counts["done"], counts["failed"], counts["pending"]) == (4, 2, 0)


def test_validate_names_files_a_folder_input_passes_over(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir)
    (tmp_path / "docs" / "notes.txt").write_text("not a document")
    (tmp_path / "docs" / "prog.exe").write_bytes(b"MZ")
    (tmp_path / "docs" / ".~lock.a.pdf#").write_text("editor lock")  # hidden: never a document
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0, r.output
    assert (f"passed over: 2 file(s) in input folders that are neither PDF nor image: "
            f"{tmp_path / 'docs' / 'notes.txt'}, {tmp_path / 'docs' / 'prog.exe'}") in r.output


def test_validate_and_run_name_sub_folders_of_pdfs_and_dangling_links(tmp_path, tiny_vlm_dir, caplog):
    """Folders are read one level deep: PDFs below that, and a document name
    that links to nothing, are not read, and validate and run say so."""
    job = make_job(tmp_path, tiny_vlm_dir, docs=1)
    (tmp_path / "docs" / "archive" / "2023").mkdir(parents=True)
    make_text_pdf(tmp_path / "docs" / "archive" / "2023" / "old.pdf", ["Old."])
    (tmp_path / "docs" / "gone.pdf").symlink_to(tmp_path / "nowhere.pdf")
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0 and "documents: 1 (1 PDF" in r.output, r.output
    assert f"not read:  {tmp_path / 'docs' / 'archive'}: a folder of PDFs, not searched" in r.output
    assert "'docs/**/*.pdf'" in r.output and f"not read:  {tmp_path / 'docs' / 'gone.pdf'}: a symlink to nothing" in r.output
    with caplog.at_level("WARNING"):
        assert CliRunner().invoke(main, ["run", str(job), "--no-progress"]).exit_code == 0
    assert "not read: " in caplog.text and "a folder of PDFs" in caplog.text and "a symlink to nothing" in caplog.text


def test_validate_accepts_a_watch_job_and_still_refuses_an_empty_input(tmp_path, tiny_vlm_dir):
    """inputs: [] is a job tqpipe watch feeds (README): validate says so and
    exits 0; an input that matches nothing is still an error."""
    job = tmp_path / "watch.yaml"
    job.write_text(f"name: w\ninputs: []\nmodel: {{path: '{tiny_vlm_dir}'}}\n"
                   "tasks: [{name: t, prompt: p}]\noutput: out.jsonl\n")
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 0 and "documents: none listed (inputs: []): a job for tqpipe watch" in r.output, r.output
    (tmp_path / "empty").mkdir()
    job.write_text(job.read_text().replace("inputs: []", "inputs: [empty/]"))
    r = CliRunner().invoke(main, ["validate", str(job)])
    assert r.exit_code == 2 and "matches no PDF or image files" in r.output


@pytest.mark.parametrize("value, says", [("bogus", "TQ_KERNELS='bogus': choose one of auto, gpu, reference"),
                                          ("gpu", "TQ_KERNELS=gpu, but this MLX build has neither Metal nor CUDA")])
def test_a_bad_kernel_setting_stops_the_run_and_blames_no_document(tmp_path, tiny_vlm_dir, monkeypatch, value, says):
    from turboquant.attention import device

    if value == "gpu" and device.backend() is not None:
        pytest.skip("this machine has a GPU backend: TQ_KERNELS=gpu is valid")
    job = make_job(tmp_path, tiny_vlm_dir)
    monkeypatch.setenv("TQ_KERNELS", value)
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 4 and says in r.output, r.output
    assert not (tmp_path / "out" / "results.jsonl").exists() or not (tmp_path / "out" / "results.jsonl").read_bytes()
    monkeypatch.delenv("TQ_KERNELS")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output  # nothing was recorded as failed: a plain rerun does it all


def test_a_model_that_does_not_exist_is_exit_2_wherever_it_is_named(tmp_path, tiny_vlm_dir):
    """One rule (schema.model_ref): the job file, --model on run and on ask
    all refuse a missing folder or an unknown built-in before any run."""
    job = make_job(tmp_path, tiny_vlm_dir, docs=1)
    missing = str(tmp_path / "no-such-model")
    for args in (["run", str(job), "--model", missing], ["ask", str(tmp_path / "docs" / "doc0.pdf"),
                                                         "--prompt", "x", "--model", missing]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "does not exist" in r.output, (args, r.output)
    assert not (tmp_path / "out").exists()  # no lock taken, nothing written
    job.write_text(job.read_text().replace(str(tiny_vlm_dir), "builtin:nonsense"))
    for cmd in ("validate", "run"):
        r = CliRunner().invoke(main, [cmd, str(job)])
        assert r.exit_code == 2 and "unknown built-in model 'builtin:nonsense'" in r.output, (cmd, r.output)


def test_a_text_model_under_images_always_is_refused_before_anything_runs(tmp_path, tiny_vlm_dir):
    """validate, run and --dry-run agree (exit 2, the fix named) instead of
    OK / per-document errors / exit 4 after the model loaded."""
    job = make_job(tmp_path, tiny_vlm_dir, docs=1, extra="context: {images: always}\n")
    job.write_text(job.read_text().replace(f"model: {{path: '{tiny_vlm_dir}'}}", "model: {}"))
    for args in (["validate", str(job)], ["run", str(job)], ["run", str(job), "--dry-run"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "is text-only" in r.output and "context.images to auto or ocr" in r.output, (
            args, r.output)
    assert not (tmp_path / "out").exists()


def test_lock_held_exits_3(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir)
    out = tmp_path / "out" / "results.jsonl"
    with JobLock(out):
        r = CliRunner().invoke(main, ["run", str(job)])
    assert r.exit_code == 3 and "locked" in r.output


def test_dry_run_prints_per_document(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir)
    r = CliRunner().invoke(main, ["run", str(job), "--dry-run", "--pages", "1-2"])
    assert r.exit_code == 0, r.output
    assert "docs/doc0.pdf: pages=2/3 images=0 tokens=" in r.output and "fits=yes" in r.output
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_samples_command(tmp_path):
    r = CliRunner().invoke(main, ["samples", str(tmp_path / "s")])
    assert r.exit_code == 0
    assert (tmp_path / "s" / "report.pdf").is_file() and (tmp_path / "s" / "imageset").is_dir()


def test_watch_processes_a_dropped_file_once(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir, docs=1)  # load_job insists the job's own inputs match something
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    make_text_pdf(inbox / "new.pdf", ["Dropped into the inbox. The code word is beta."])
    args = ["watch", str(inbox), "--job", str(job), "--settle", "0", "--poll", "0.05", "--max-polls", "4"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    recs = lines(tmp_path / "out" / "results.jsonl")
    assert sorted(r_["task"] for r_ in recs) == ["t0", "t1"] and recs[0]["source"].endswith("inbox/new.pdf")
    r = CliRunner().invoke(main, args)  # a restarted watcher does not redo it
    assert r.exit_code == 0 and len(lines(tmp_path / "out" / "results.jsonl")) == 2


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_every_record_exactly_once(tmp_path, tiny_vlm_dir):
    docs, tasks = 4, 3
    job = make_job(tmp_path, tiny_vlm_dir, docs=docs, tasks=tasks, max_tokens=16)
    out = tmp_path / "out" / "results.jsonl"
    env = {**os.environ, "TQPIPE_PROGRESS": "off", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(job)]
    kills = 0
    for kill_after in (1, 4):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            n = out.read_bytes().count(b"\n") if out.exists() else 0
            if n >= kill_after:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.005)
        proc.wait()
    n_before = out.read_bytes().count(b"\n")
    assert kills == 2 and n_before < docs * tasks  # really killed mid-run
    done = subprocess.run(cmd, env=env, capture_output=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    recs = lines(out)  # every line is valid JSON
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == docs * tasks
    assert {(r["doc_id"], r["task"]) for r in recs} == {(f"docs/doc{i}.pdf", f"t{j}") for i in range(docs) for j in range(tasks)}


def test_pages_option_is_part_of_status_keys(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir, docs=1, tasks=1, max_tokens=2)
    assert CliRunner().invoke(main, ["run", str(job), "--pages", "1", "--no-progress"]).exit_code == 0
    assert "done 1, failed 0, pending 0" in CliRunner().invoke(main, ["status", str(job), "--pages", "1"]).output
    assert "done 0, failed 0, pending 1" in CliRunner().invoke(main, ["status", str(job)]).output
