"""tqpipe with the document-cache store: a rerun with one more task loads, `ask`, `cache ls|rm|prune`."""

from __future__ import annotations

from pathlib import Path

import orjson
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inputs.samples import make_text_pdf


def make_job(tmp_path: Path, model: Path, tasks: int) -> Path:
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for i in range(2):
        make_text_pdf(d / f"doc{i}.pdf", [f"Document {i}, page {p}. The code word is alpha{i}{p}." for p in range(1, 4)])
    task_lines = "".join(f"  - {{name: t{j}, prompt: 'Question {j}?', max_tokens: 3}}\n" for j in range(tasks))
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: cli\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
        "cache: {kv_quant_scheme: turboquant, kv_bits: 3.5, prefill_chunk: 64}\n"
        f"tasks:\n{task_lines}output: out/results.jsonl\ncache_store: {{path: store, max_gb: 1}}\n"
    )
    return job


def records(job: Path) -> list[dict]:
    return [orjson.loads(line) for line in (job.parent / "out/results.jsonl").read_bytes().splitlines()]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_added_task_loads_the_stored_caches_then_ask_and_cache_commands(tmp_path, tiny_vlm_dir):
    job = make_job(tmp_path, tiny_vlm_dir, tasks=1)
    assert invoke("run", str(job), "--no-progress").exit_code == 0
    first = records(job)
    assert [r["cache"]["doc_cache"]["hit"] for r in first] == [False, False]
    assert all(r["cache"]["doc_cache"]["saved"] and r["timing"]["prefill_s"] > 0 for r in first)

    ls = invoke("cache", "ls", "--job", str(job), "--json")
    rows = [orjson.loads(line) for line in ls.stdout.splitlines()]
    assert ls.exit_code == 0 and len(rows) == 2 and all(r["error"] is None and r["tokens"] > 0 for r in rows)
    assert {Path(r["source"]).name for r in rows} == {"doc0.pdf", "doc1.pdf"}

    make_job(tmp_path, tiny_vlm_dir, tasks=2)  # one more task
    assert invoke("run", str(job), "--no-progress").exit_code == 0
    added = records(job)[2:]
    assert [r["task"] for r in added] == ["t1", "t1"]
    assert all(r["cache"]["doc_cache"]["hit"] and r["timing"]["prefill_s"] == 0.0 for r in added)
    assert all(r["cache"]["doc_cache"]["load_s"] >= 0 for r in added)

    doc0 = next(r for r in added if r["doc_id"] == "docs/doc0.pdf")
    r = invoke("ask", str(tmp_path / "docs/doc0.pdf"), "--prompt", "Question 1?", "--max-tokens", "3",
               "--job", str(job), "--json")
    asked = orjson.loads(r.stdout.splitlines()[0])
    assert r.exit_code == 0 and asked["cache"]["doc_cache"]["hit"] is True
    assert asked["output"] == doc0["output"] and asked["content_hash"] == doc0["content_hash"]
    assert len(records(job)) == 4  # ask writes no record

    rm = invoke("cache", "rm", rows[0]["entry"][:10], "--job", str(job))
    assert rm.exit_code == 0 and len(list((tmp_path / "store").glob("*.safetensors"))) == 1
    assert invoke("cache", "rm", "--job", str(job)).exit_code == 2  # nothing named
    again = invoke("cache", "rm", rows[0]["entry"][:10], "zzzz", "--job", str(job))
    assert again.exit_code == 2 and f"no entry matches: {rows[0]['entry'][:10]}, zzzz" in again.stderr
    typo = invoke("cache", "ls", "--path", str(tmp_path / "stroe"))
    assert typo.exit_code == 2 and "--path: " in typo.stderr and "is not a folder" in typo.stderr
    assert invoke("cache", "prune", "--max-gb", "0", "--path", str(tmp_path / "store")).exit_code == 0
    assert list((tmp_path / "store").glob("*.safetensors")) == []


def test_ask_without_a_job_stores_then_loads(tmp_path, tiny_vlm_dir, _isolated_doc_caches):
    make_text_pdf(tmp_path / "a.pdf", ["The harbor report. Revenue grew by 12 percent.", "Author: Ada Lovelace."])
    args = ("ask", str(tmp_path / "a.pdf"), "--prompt", "Who wrote it?", "--model", str(tiny_vlm_dir),
            "--max-tokens", "4", "--json")
    one, two = (orjson.loads(invoke(*args).stdout.splitlines()[0]) for _ in range(2))
    assert one["cache"]["doc_cache"]["hit"] is False and two["cache"]["doc_cache"]["hit"] is True
    assert two["cache"]["doc_cache"]["ingest"] == "skipped"
    plain = invoke(*args[:-1])
    assert "cache loaded in" in plain.output and "(document not read)" in plain.output
    assert one["output"] == two["output"] and one["status"] == two["status"] == "ok"
    assert len(list(_isolated_doc_caches.glob("*.safetensors"))) == 1  # the default store


def test_ask_plain_output_and_a_store_that_is_off(tmp_path, tiny_vlm_dir):
    make_text_pdf(tmp_path / "a.pdf", ["Page one."])
    r = invoke("ask", str(tmp_path / "a.pdf"), "--prompt", "Hi?", "--model", str(tiny_vlm_dir), "--max-tokens", "2")
    assert r.exit_code == 0 and "document tokens, prefilled in" in r.output
    # a cut-off answer and the record's other warnings are said, not only kept in --json
    assert "the answer stopped at --max-tokens 2; raise it for the rest" in r.stderr
    assert "warnings: random_weights" in r.stderr
    job = tmp_path / "off.yaml"
    job.write_text("name: off\ninputs: [a.pdf]\ntasks: [{name: a, prompt: p}]\noutput: o.jsonl\ncache_store: {max_gb: 0}\n")
    assert invoke("cache", "ls", "--job", str(job)).exit_code == 2


def test_ask_about_something_that_is_not_one_document_is_a_usage_error(tmp_path, tiny_vlm_dir):
    """Exit 2 (the command line's fault), naming FILE, not a job file that does not exist."""
    for i in range(2):
        make_text_pdf(tmp_path / "two" / f"d{i}.pdf", ["Page."])
    (tmp_path / "empty").mkdir()
    (tmp_path / "note.txt").write_text("not a document")
    for target, message in [("two", "names 2 documents; ask takes one PDF or one image folder"),
                            ("empty", "names 0 documents"), ("note.txt", "is neither a PDF nor an image")]:
        r = invoke("ask", str(tmp_path / target), "--prompt", "Hi?", "--model", str(tiny_vlm_dir))
        assert r.exit_code == 2 and message in r.output, (target, r.output)
        assert "/ask:" not in r.output and str(tmp_path / target) in r.output


def test_cache_ls_tells_apart_two_entries_of_one_document(tmp_path, tiny_vlm_dir):
    """Entries are named <content hash>-<key>: `ls` shows both parts, so two
    caches of one document (another cache setting) have distinct ids, and
    `rm` with the content part removes every cache of that document."""
    job = make_job(tmp_path, tiny_vlm_dir, tasks=1)
    assert invoke("run", str(job), "--no-progress").exit_code == 0
    job.write_text(job.read_text().replace("kv_bits: 3.5", "kv_bits: 2.5"))
    assert invoke("run", str(job), "--no-progress").exit_code == 0
    rows = [orjson.loads(x) for x in invoke("cache", "ls", "--job", str(job), "--json").stdout.splitlines()]
    assert len(rows) == 4 and all(r["reusable"] is True for r in rows)
    shown = [line.split()[0] for line in invoke("cache", "ls", "--job", str(job)).stdout.splitlines()]
    assert len(set(shown)) == 4
    doc0 = {r["entry"].split("-")[0] for r in rows if r["source"].endswith("doc0.pdf")}
    assert len(doc0) == 1
    assert invoke("cache", "rm", doc0.pop(), "--job", str(job)).exit_code == 0
    left = [orjson.loads(x) for x in invoke("cache", "ls", "--job", str(job), "--json").stdout.splitlines()]
    assert len(left) == 2 and all(r["source"].endswith("doc1.pdf") for r in left)
