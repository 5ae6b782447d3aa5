"""KV figures: records state the fp16 bytes for the same tokens, and the formulas match measurements."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner
from fixtures_models import *  # noqa: F403

from pipeline.cli import main
from pipeline.inference.kv_size import KVGeometry, cache_nbytes_formula, describe
from pipeline.inputs.job_file import load_job
from pipeline.models.load import read_config

from pipeline.inputs.samples import make_text_pdf


def _run(tmp_path, model, scheme: str, bits: float) -> tuple[dict, object]:
    (tmp_path / "docs").mkdir()
    make_text_pdf(tmp_path / "docs" / "d.pdf", [f"Page {p}. The code word is alpha{p}." * 3 for p in range(1, 4)])
    job = tmp_path / "job.yaml"
    job.write_text(f"name: kv\ninputs: [docs/]\nmodel: {{path: '{model}'}}\n"
                   f"cache: {{kv_quant_scheme: {scheme}, kv_bits: {bits}, prefill_chunk: 64}}\n"
                   "tasks: [{name: t, prompt: 'Code word?', max_tokens: 2}]\noutput: out.jsonl\n")
    r = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert r.exit_code == 0, r.output
    (rec,) = [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    return rec, load_job(job).spec.cache


def test_geometry_from_config_and_fp16_bytes():
    g = KVGeometry.from_config({"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                "hidden_size": 576})
    assert g == KVGeometry(30, 3, 64, 64)
    assert g.fp16_nbytes(275) == 275 * 30 * 3 * 128 * 2  # 6.0 MiB: what the 12.1 MiB doubled
    assert KVGeometry.from_config({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 2,
                                                   "head_dim": 8}}) == KVGeometry(2, 2, 8, 8)
    assert KVGeometry.from_config({}) is None


@pytest.mark.parametrize("scheme", ["turboquant", "fp16", "affine"])
def test_records_carry_fp16_bytes_and_the_formula_matches_them(tmp_path, tiny_vlm_dir, scheme):
    bits = {"turboquant": 3.5, "fp16": 16, "affine": 4}[scheme]
    rec, spec = _run(tmp_path, tiny_vlm_dir, scheme, bits)
    cache, n = rec["cache"], rec["tokens"]["document"]
    geom = KVGeometry.from_config(read_config(tiny_vlm_dir))
    assert cache["tokens"] == n > 64 and cache["fp16_nbytes"] == geom.fp16_nbytes(n)
    assert cache["vs_fp16"] == pytest.approx(cache["nbytes_after_prefill"] / cache["fp16_nbytes"], abs=1e-4)
    assert cache["fp16_nbytes_end_of_task"] == geom.fp16_nbytes(cache["tokens_end_of_task"])
    predicted = cache_nbytes_formula(geom, spec, n, exact_bytes=4)  # float32 on CPU
    if scheme == "turboquant":  # counts the bytes holding tokens
        assert cache["nbytes_after_prefill"] == predicted
    else:  # mlx-lm's caches grow in steps of 256 tokens; their nbytes includes that slack
        assert predicted <= cache["nbytes_after_prefill"] <= predicted * (n + 256) / n
    if scheme == "turboquant":
        assert cache["exact_tokens"] == min(n, spec.window)  # settled before the first task
        assert "still exact" in describe(cache) and "fp16" in describe(cache)
        dry = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--dry-run"])
        mib = lambda b: f"{b / 2**20:.1f}MiB"  # noqa: E731
        assert f"kv={mib(predicted)} (turboquant; fp16 {mib(cache['fp16_nbytes'])}," in dry.output, dry.output
