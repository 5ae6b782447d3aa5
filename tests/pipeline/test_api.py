"""The documented Python API: the README example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fixtures_models import *  # noqa: F403

import pipeline
from pipeline.inputs.samples import make_text_pdf
from pipeline.schema.overrides import OverrideError

REPO = Path(__file__).resolve().parents[2]


def test_import_pipeline_stays_light():
    import subprocess
    import sys

    code = "import sys, pipeline; print('mlx.core' in sys.modules, 'pipeline.api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == ["False", "False"]
    assert set(pipeline.__all__) == {"Job", "RunSummary", "ask_files", "load_job", "read_results", "run_job"}
    with pytest.raises(AttributeError):
        pipeline.nothing_here  # noqa: B018


def test_load_run_read_and_ask(tmp_path, tiny_vlm_dir, monkeypatch):
    from pipeline import ask_files, load_job, read_results, run_job

    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["Invoice from ACME. Total 12 EUR."])
    (tmp_path / "job.yaml").write_text("name: api\ninputs: [docs/]\n"
                                       "tasks: [{name: s, prompt: 'Summarize.', max_tokens: 8}]\noutput: out.jsonl\n")
    job = load_job(tmp_path / "job.yaml", model=str(tiny_vlm_dir), kv_bits=4, max_tokens=2)
    assert job.spec.cache.kv_bits == 4 and job.spec.tasks[0].max_tokens == 2
    summary = run_job(job)
    assert (summary.done, summary.failed, summary.exit_code) == (1, 0, 0)
    (rec,) = read_results(job)
    assert rec["status"] == "ok" and rec["cache"]["kv_bits"] == 4
    assert run_job(job).skipped == 1  # exactly-once, as from the CLI
    other = load_job(tmp_path / "job.yaml", model=str(tiny_vlm_dir), kv_bits=3.5, max_tokens=2)
    assert run_job(other).done == 1
    (rec,) = read_results(other)  # the file holds both configs; each job reads its own
    assert rec["cache"]["kv_bits"] == 3.5 and [r["cache"]["kv_bits"] for r in read_results(job)] == [4]
    with pytest.raises(OverrideError, match="--kv-bits"):
        load_job(tmp_path / "job.yaml", kv_bits=3.3)
    with pytest.raises(OverrideError, match="load_job: engine is not a job override; they are fields, format"):
        load_job(tmp_path / "job.yaml", engine="ray")  # was a bare TypeError from the dataclass
    monkeypatch.chdir(tmp_path)
    records = ask_files(["docs/a.pdf"], "Who issued it?", fields=["issuer"], model=str(tiny_vlm_dir))
    assert [(r["doc_id"], r["task"], r["json"]["decoding"]) for r in records] == [("docs/a.pdf", "prompt", "constrained")]
    assert not list(tmp_path.rglob("oneoff*"))  # no output given: nothing left behind


def test_readme_api_example_names_real_functions():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    for name in re.findall(r"from pipeline import ([\w, ]+)", block)[0].split(","):
        assert hasattr(pipeline, name.strip()), name
