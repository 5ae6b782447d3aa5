"""Launch shapes (turboquant/attention/table.py): every token covered, workspaces laid out."""

from __future__ import annotations

import pytest

from turboquant.attention import table


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 1000, 131072])
def test_simt_config_covers_all_tokens(d, rows, n):
    cfg = table.simt_config(d, rows, 8, n)
    assert cfg is not None
    dpt, nw = cfg["DPT"], cfg["NW"]
    tpt = d // dpt
    assert d % dpt == 0 and 32 % tpt == 0  # lanes per token divide the warp
    assert rows * dpt <= 128  # registers: queries + accumulators
    assert nw * rows * d * 4 <= table.SIMT_SMEM_BYTES  # threadgroup memory of the merge
    step = cfg["U"] * nw * (32 // tpt)
    assert cfg["TOKS"] % step == 0
    assert (cfg["S"] - 1) * cfg["TOKS"] < n <= cfg["S"] * cfg["TOKS"]


def test_simt_config_rejects_uncovered_shapes():
    assert table.simt_config(80, 4, 8, 100) is None  # 80/16 lanes per token
    assert table.simt_config(512, 1, 8, 100) is None


@pytest.mark.parametrize("n", [1, 1000, 32768, 131072, 262144, 1 << 20])
@pytest.mark.parametrize("rows", [4, 9, 40])
def test_tc_config_covers_all_tokens(n, rows):
    cfg = table.tc_config(128, rows, 8, n)
    assert cfg["TOKS"] % (16 * cfg["NW"]) == 0  # whole 16-token tiles per warp
    assert (cfg["S"] - 1) * cfg["TOKS"] < n <= cfg["S"] * cfg["TOKS"]
    assert cfg["RT"] == -(-rows // 16) and cfg["GL"] == min(rows, 16)
    if n >= 1 << 20:
        assert 8 * table.tc_config(128, 4, 8, n, blocks=792)["S"] >= 792  # another shape on request


@pytest.mark.parametrize("n", [1, 1000, 32768, 262144, 1 << 20])
@pytest.mark.parametrize("b_hkv,rows", [(8, 4), (2, 8), (3, 1)])
def test_tc8_config_covers_all_tokens_and_lays_out_the_workspace(n, b_hkv, rows):
    cfg = table.tc8_config(128, rows, b_hkv, n)
    assert cfg["TOKS"] % (16 * cfg["NW"]) == 0
    assert (cfg["S"] - 1) * cfg["TOKS"] < n <= cfg["S"] * cfg["TOKS"]
    # counters | out | lse | po | pm | pl, disjoint and in order, 16-byte aligned starts
    S, d = cfg["S"], 128
    spans = [(0, table.TC8_COUNTER_WORDS * b_hkv), (cfg["OFF_OUT"], b_hkv * rows * d),
             (cfg["OFF_LSE"], b_hkv * rows), (cfg["OFF_PO"], b_hkv * S * rows * d),
             (cfg["OFF_PM"], b_hkv * S * rows), (cfg["OFF_PL"], b_hkv * S * rows)]
    for (a, na), (b, _) in zip(spans, spans[1:]):
        assert a + na <= b
    assert spans[-1][0] + spans[-1][1] == cfg["WS"]
    assert cfg["OFF_OUT"] % 4 == 0 and cfg["OFF_PO"] % 4 == 0
    assert cfg["GRID_X"] == cfg["SLOTS"] * cfg["NW"] * 32


@pytest.mark.parametrize("n", [1, 1000, 262144])
@pytest.mark.parametrize("b_hkv,rows", [(8, 4), (3, 1), (5, 4), (7, 1), (2, 8), (24, 4)])  # 5, 7: splits round down
def test_tc8_fused_workspace_has_a_window_slot(n, b_hkv, rows):
    plain = table.tc8_config(128, rows, b_hkv, n)
    cfg = table.tc8_config(128, rows, b_hkv, n, window=True)
    assert cfg["S"] <= plain["S"] and cfg["TOKS"] >= plain["TOKS"]
    assert (cfg["S"] - 1) * cfg["TOKS"] < n <= cfg["S"] * cfg["TOKS"]
    assert cfg["SLOTS"] == cfg["S"] + 1 and plain["SLOTS"] == plain["S"]
    if n >= 262144:  # packed (+ window) threadgroups: one wave of the launch
        assert table.TC8_BLOCKS - 4 * b_hkv <= b_hkv * cfg["SLOTS"] <= table.TC8_BLOCKS
        assert b_hkv * plain["SLOTS"] <= table.TC8_BLOCKS
    d, slots = 128, cfg["SLOTS"]
    # counters | po | pm | pl (the output is its own array): disjoint, in order
    spans = [(0, table.TC8_COUNTER_WORDS * b_hkv), (cfg["OFF_PO"], b_hkv * slots * rows * d),
             (cfg["OFF_PM"], b_hkv * slots * rows), (cfg["OFF_PL"], b_hkv * slots * rows)]
    for (a, na), (b, _) in zip(spans, spans[1:]):
        assert a + na <= b
    assert spans[-1][0] + spans[-1][1] == cfg["WS"] and cfg["OFF_PO"] % 4 == 0


def test_tc8_runs_capped_at_every_width():
    """Every width runs 8 warps under the cap of 2 resident threadgroups
    (128 registers), 3-bit values too (measured faster than uncapped 4 warps)."""
    for kb, vb in ((3, 4), (4, 3), (3, 2), (4, 4)):
        cfg = table.tc8_config(128, 4, 8, 4096, kb, vb)
        assert cfg["NW"] == table.TC8_WARPS and cfg["MINB"] == 2
        assert "__launch_bounds__(256, 2)" in cfg["PRELUDE"]


def test_fused_window_fits_the_reduction_area():
    for d, rows in ((128, 4), (64, 8), (128, 1)):
        w = table.fused_max_window(d, rows)
        nw = table.TC8_WARPS
        assert rows * (d + w) + 24 <= nw * 8 * (d + 2) < rows * (d + w + 1) + 24
