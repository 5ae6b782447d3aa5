"""The GPU-scale benchmarks' CPU modes: fixed names and keys, numbers from real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import engine_batch, pipeline_gpu, whole_model
import yaml

from pipeline.schema.job import JobSpec

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"context", "cache", "decode_tok_s", "generate_step_tok_s", "ttft_s", "kv_bytes", "peak_bytes"}


def test_whole_model_tiny(tmp_path):
    out = tmp_path / "wm.json"
    whole_model.main(["--tiny", "--json", str(out), "--caches", "bf16,turboquant-3.5,affine-4"])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["context"], r["cache"]) for r in rows] == [
        (c, k) for c in whole_model.TINY_CONTEXTS for k in ("bf16", "turboquant-3.5", "affine-4")]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["fits"]
        assert r["decode_tok_s"] > 0 and r["generate_step_tok_s"] > 0 and r["peak_bytes"] >= r["kv_bytes"] > 0
        assert (r["ttft_s"] is not None) == (r["context"] <= 512)  # real prefill only up to --ttft-max
    big = {r["cache"]: r["kv_bytes"] for r in rows if r["context"] == 1536}
    assert big["turboquant-3.5"] < big["bf16"] / 3  # the synthetic fill really quantized
    assert set(res["max_context"]) == {"bf16", "turboquant-3.5", "affine-4"}


def test_whole_model_constant_mean_rows_keep_one_key_mean(monkeypatch):
    """A ``/constant-mean`` row's caches get no RoPE angles (no block term),
    the plain row's do; the name is refused on a cache that is not ours."""
    import turboquant.prompt_cache as pc

    seen = []
    real = pc._layer_rotaries
    monkeypatch.setattr(whole_model, "measure_row",
                        lambda *a, **k: seen.append((a[3], pc._layer_rotaries is real)) or {"kv_bytes": 1})
    monkeypatch.setattr(whole_model, "bytes_per_token", lambda *a, **k: 1.0)
    whole_model.main(["--tiny", "--contexts", "512", "--caches", "turboquant-3.5,turboquant-3.5/constant-mean"])
    assert seen == [("turboquant-3.5", True), ("turboquant-3.5/constant-mean", False)]
    assert pc._layer_rotaries is real
    with pytest.raises(SystemExit):
        whole_model.main(["--tiny", "--caches", "bf16/constant-mean"])


def test_engine_batch_cpu():
    res = engine_batch.main(["--json", "--shape", "tiny", "--context", "600", "--tokens", "6"])
    for k in ("tasks", "forward_passes_batched", "forward_passes_sequential", "seconds_batched",
              "seconds_sequential", "identical", "agreement"):
        assert k in res
    assert res["tasks"] == 4 and res["identical"] and res["agreement"] == 1.0
    assert res["forward_passes_batched"] == 1 + max(res["generated"]) - 1 == 6  # the longest task, not the sum
    assert res["forward_passes_sequential"] == 4 * 6
    assert res["max_logit_diff"] < 1e-3


def test_pipeline_gpu_plumbing_runs_tqpipe_on_a_tiny_model(tmp_path):
    out = tmp_path / "pg.json"
    pipeline_gpu.main(["--tiny", "--json", str(out), "--pages", "3", "--caches", "turboquant-3.5",
                       "--work", str(tmp_path / "work")])
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["cache"] == "turboquant-3.5" and row["pages"] == 3 and row["tasks"] == 4 and row["batched"]
    assert row["doc_wall_s"] > 0 and row["prefill_tok_s"] > 0 and row["mx_peak_bytes"] > row["kv_bytes"] > 0
    assert res["processes"]["turboquant-3.5"]["max_rss_bytes"] > 0


def test_long_pdf_job_is_the_benchmarks_job():
    # schema only: its model folder and PDFs are built on the GPU machine (see the job's comment)
    spec = JobSpec.model_validate(yaml.safe_load((REPO / "jobs" / "long_pdfs.yaml").read_text()))
    assert spec.context.max_tokens >= 131072 and spec.cache.kv_quant_scheme == "turboquant"
    assert [(t.name, t.prompt, t.max_tokens) for t in spec.tasks] == pipeline_gpu.TASKS


def test_built_model_answers_in_its_tokenizers_ids(tmp_path):
    # ids past the trained tokenizer decode to nothing; their output rows are zero so greedy picks real tokens
    import sys

    import mlx.core as mx
    from mlx_lm import load

    sys.path.insert(0, str(REPO / "scripts"))
    from build_model import build

    out = build(tmp_path / "m", "tiny", dtype="float32", tokenizer_vocab=600)
    from pipeline.models.load import has_random_weights

    assert has_random_weights(out)  # so every record of a job on it carries random_weights
    weights = mx.load(str(next(out.glob("model-*.safetensors"))))
    head = weights["lm_head.weight"]
    assert mx.all(head[600:] == 0).item() and mx.any(head[:600] != 0).item()
    model, tok = load(str(out))
    logits = model(mx.array([tok.encode("This is page 3 of 10. The code word")]))[0, -1]
    assert int(mx.argmax(logits).item()) < 600
