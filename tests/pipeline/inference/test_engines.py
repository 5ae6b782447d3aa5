"""Engines: a job's engine, loaded once, warmed up before its first document on a GPU only."""

from __future__ import annotations

import mlx.core as mx
import pytest

from pipeline.inference.engine import Engine
from pipeline.inference.engines import Engines
from pipeline.inputs.job_file import load_job
from pipeline.inputs.samples import make_text_pdf
from test_engine import tiny_llama


@pytest.fixture
def job(tmp_path):
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "a.pdf", ["One page."])
    path = tmp_path / "job.yaml"
    path.write_text("name: t\ninputs: [docs/]\ncache: {kv_quant_scheme: turboquant}\n"
                    "tasks:\n  - {name: a, prompt: 'Say.', max_tokens: 3}\noutput: out/results.jsonl\n")
    return load_job(path)


@pytest.mark.parametrize("device, warmed", [(mx.gpu, 1), (mx.cpu, 0)])
def test_a_new_engine_is_warmed_up_once_on_a_gpu_only(job, monkeypatch, device, warmed):
    warm_ups = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: warm_ups.append(self))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device))
    engines = Engines(job, loader=lambda path, needs_images: tiny_llama())
    first = engines.get(False)
    assert engines.get(False) is first and engines.loads == 1
    assert warm_ups == [first] * warmed
