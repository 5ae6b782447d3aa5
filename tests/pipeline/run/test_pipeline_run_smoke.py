"""benchmarks.pipeline_run on a tiny input: its job files load, its rows read
real record fields, its ratios and table say what the rows say, and the
child-process plumbing returns the child's exit code and its own max RSS."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from benchmarks import pipeline_run
from pipeline.cli import main
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_long_pdf


def _job(tmp_path: Path, scheme: str, model: Path | None = None) -> Path:
    text = pipeline_run.job_yaml(scheme, kv_bits=3.5, context_tokens=256, chunk=64, task_tokens=2, page=2)
    if model is not None:  # the tiny VLM instead of the built-in SmolLM2: seconds, not minutes
        text += f"model: {{path: '{model}'}}\n"
    job = tmp_path / f"job-{scheme}.yaml"
    job.write_text(text)
    return job


def test_job_files_differ_only_in_the_cache(tmp_path):
    (tmp_path / "docs").mkdir()
    make_long_pdf(tmp_path / "docs" / "long.pdf", 3)
    fp, tq = (load_job(_job(tmp_path, s)).spec for s in pipeline_run.SCHEMES)
    assert (fp.cache.kv_quant_scheme, tq.cache.kv_quant_scheme, tq.cache.kv_bits) == ("fp16", "turboquant", 3.5)
    assert fp.cache.prefill_chunk == tq.cache.prefill_chunk == 64
    assert fp.context == tq.context and fp.context.overflow == "truncate" and fp.context.max_tokens == 256
    assert fp.tasks == tq.tasks and fp.tasks[0].max_tokens == 2 and fp.model.path is None


def test_rows_ratios_and_table_from_real_records(tmp_path, tiny_vlm_dir):
    (tmp_path / "docs").mkdir()
    make_long_pdf(tmp_path / "docs" / "long.pdf", 3)  # ~1,300 tokens: truncated to 256
    rows = {}
    for scheme in pipeline_run.SCHEMES:
        r = CliRunner().invoke(main, ["run", str(_job(tmp_path, scheme, tiny_vlm_dir)), "--no-progress"])
        assert r.exit_code == 0, r.output
        (rec,) = [orjson.loads(x) for x in (tmp_path / f"results-{scheme}.jsonl").read_bytes().splitlines()]
        rows[scheme] = pipeline_run.row_from_record(scheme, rec, child_rss=100 * 2**20, wall_s=1.0)
    fp, tq = rows["fp16"], rows["turboquant"]
    assert fp["pages"] == 3 and fp["tokens_dropped"] > 0 and 1 <= fp["pages_in_context"] < 3
    assert fp["prefill_tokens"] == tq["prefill_tokens"] <= 256
    assert fp["ingest_pages_s"] == pytest.approx(3 / fp["ingest_s"])
    assert fp["prefill_tok_s"] > 0 and fp["mx_peak_bytes"] >= fp["kv_bytes"] > tq["kv_bytes"] > 0
    ratio = pipeline_run.ratios(rows)
    assert ratio["kv_bytes"] == pytest.approx(tq["kv_bytes"] / fp["kv_bytes"]) and ratio["kv_bytes"] < 1
    assert ratio["max_rss_bytes"] == 1.0
    table = pipeline_run.format_table(rows, ratio).splitlines()
    assert len(table) == 4 and "prefill tok/s" in table[0] and "(f32 on CPU)" in table[1]
    assert table[2].split()[:2] == ["turboquant", "3.5b"]
    assert table[3].split()[0] == "TQ/fp16" and f"{ratio['kv_bytes']:.3f}x" in table[3]


def test_error_record_is_refused():
    with pytest.raises(RuntimeError, match="fp16: the run recorded an error"):
        pipeline_run.row_from_record("fp16", {"status": "error", "error": {"message": "boom"}}, 1, 1.0)


def test_run_cli_reports_the_childs_exit_code_and_rss(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("name: x\n")  # exits 2 after importing the CLI
    code, rss, wall = pipeline_run.run_cli(job, tmp_path / "log.txt")
    assert code == 2 and "bad.yaml" in (tmp_path / "log.txt").read_text()
    assert rss > 20 * 2**20 and wall > 0  # a Python interpreter with the pipeline imported
