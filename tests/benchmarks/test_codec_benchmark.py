"""The benchmark runs end to end at tiny sizes and its numbers make sense."""

import json

import pytest

from benchmarks import codec as bench

WIDTHS = ["2", "2.5", "3", "3.5", "4"]


@pytest.fixture(scope="module")
def result():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench.main(["--json", "--tokens", "256", "--contexts", "256", "--reps", "1",
                    "--queries", "8", "--mse-vectors", "1024"])
    lines = buf.getvalue().strip().splitlines()
    return lines, json.loads(lines[-1])


def test_json_last_line_has_required_fields(result):
    lines, r = result
    assert any("Decode attention" in line for line in lines)
    for w in WIDTHS:
        row = r["widths"][w]
        for key in ("bytes_per_token", "reduction_vs_fp16", "mse", "mse_lloyd_max",
                    "attn_cosine", "decode_ratio_vs_fp16"):
            assert isinstance(row[key], float), (w, key)
        assert row["decode_ratio_vs_fp16"] > 0


def test_bytes_match_layout_and_peer(result):
    _, r = result
    st = r["storage_bytes_per_token_per_kv_head"]
    assert st["ours3.5"] == 116 and st["ours2.5"] == 84
    assert r["widths"]["3.5"]["bytes_per_token"] == 116 * 8
    assert abs(r["widths"]["3.5"]["reduction_vs_fp16"] - 0.7734) < 1e-3
    assert abs(r["widths"]["2.5"]["reduction_vs_fp16"] - 0.8359) < 1e-3
    for w in WIDTHS:
        assert st[f"peer{w}"] == st[f"ours{w}"]
    assert st["affine4"] == 144 and st["affine8"] == 272


def test_mse_near_lloyd_max_above_bound(result):
    _, r = result
    for b, row in r["unit_mse"].items():
        assert row["lower_bound"] < row["lsq"] < 1.05 * row["lloyd_max"], b


def test_quality_ordering(result):
    _, r = result
    for kind in ("gaussian", "outlier"):
        q = r["attention_one_minus_cos"][kind]
        assert q["ours2"] > q["ours3"] > q["ours4"] > q["affine8"] > 0
        assert q["fp16"] < 1e-5
    out = r["attention_one_minus_cos"]["outlier"]
    for w in WIDTHS:
        # centring removes the per-channel offsets the codec would pay for
        assert out[f"ours{w}"] < 0.8 * out[f"codec_only{w}"]
        # the shipped cache + attention agree with the reconstruction they encode
        assert abs(out[f"system_nowindow{w}"] - out[f"ours{w}"]) < 0.3 * out[f"ours{w}"]
        # the peer's quality is measured on exactly what its attention computes
        assert abs(out[f"peer_direct_vs_recon{w}"]) < 1e-4
    assert out["ours_swapped2.5"] > 0 and out["ours_swapped3.5"] > 0


def test_quick_config_is_small():
    cfg = bench.Config(**bench.QUICK)
    assert cfg.quality_tokens <= 1024 and max(cfg.contexts) <= 4096


def test_make_data_outlier_has_structure():
    import mlx.core as mx

    q, k, v = bench.make_data("outlier", 256, 1, 0)
    mean_norm = float(mx.linalg.norm(k.mean(axis=2), axis=-1).mean())
    spread = float(mx.sqrt(((k - k.mean(axis=2, keepdims=True)) ** 2).sum(-1).mean()))
    assert mean_norm > spread  # offsets dominate, as in real keys
    with pytest.raises(ValueError, match="unknown kind"):
        bench.make_data("nope", 8, 1, 0)


def test_tcq_rows_same_bytes_and_lower_error(result):
    _, r = result
    st = r["storage_bytes_per_token_per_kv_head"]
    for w in WIDTHS:
        assert st[f"tcq{w}"] == st[f"ours{w}"]
        t = r["widths"][w]["tcq"]
        for key in ("mse", "attn_cosine", "attn_cosine_outlier", "error_ratio_vs_peer",
                    "decode_ratio_vs_fp16"):
            assert isinstance(t[key], float), (w, key)
    for b in ("2", "3", "4"):
        row = r["unit_mse"][b]
        assert row["tcq"] < 0.85 * row["lsq"], b


def test_decode_only_reports_ratios_for_both_quantizers(capsys):
    """``--decode-only`` re-measures just the decode timing (after a decoder
    change) with the same function and data as the full run."""
    from benchmarks import codec as bench

    res = bench.main(["--decode-only", "--contexts", "256", "--reps", "1", "--no-peer"])
    row = res["decode_s"]["256"]
    for name in ("fp16", "fp32", "ours3.5", "tcq3.5", "tcq4"):
        assert row[name] > 0, name
    assert "x fp16" in capsys.readouterr().out
