"""Smoke run of benchmarks.document_cache: four real `tqpipe run`s, numbers from their records."""

import json

import pytest

from benchmarks import document_cache


@pytest.mark.slow
def test_tiny_run_reports_a_hit_identical_answers_and_file_bytes(tmp_path, tiny_vlm_dir, capsys):
    result = document_cache.main(["--tiny", "--model", str(tiny_vlm_dir), "--keep", str(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["identical"] == result["identical"]
    assert result["cache_hit"] is True and result["rerun_prefill_s"] == 0.0 and result["identical"] is True
    assert result["repeatable"] is True  # the CPU decodes reproducibly: the control agrees
    for key in ("prefill_s", "load_s", "ttft_fresh_s", "ttft_cached_s", "bytes_on_disk"):
        assert result[key] > 0, key
    entry = next((tmp_path / "store").glob("*.safetensors"))
    assert result["bytes_on_disk"] == entry.stat().st_size
    assert 1.0 <= result["bytes_on_disk"] / result["bytes_in_memory"] < 1.05  # the used bytes plus a header
