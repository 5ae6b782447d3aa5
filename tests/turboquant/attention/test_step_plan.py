"""The fused decode step's plan (turboquant/attention/step_plan.py), on a recording stand-in for CUDA."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from packed_fixtures import RecordingKernel, codec_quantize, cuda_stand_in, filled_cache

from turboquant.attention import launchers, step_plan, table, turboquant_attention
from turboquant.attention.params import float_bits
from turboquant.rotation import HadamardRotation


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA backend whose kernels record their launches (no GPU needed)."""
    made, log = {}, []

    def cuda_kernel(name, **kw):
        return made.setdefault(name, RecordingKernel(name, log, kw.get("source", "")))

    with cuda_stand_in(monkeypatch, cuda_kernel):
        monkeypatch.setattr(launchers, "quantize_any", codec_quantize)  # no GPU to append with
        yield made, log


def test_walsh_hadamard_rotations_are_recognised():
    assert HadamardRotation(128, 3).is_walsh_hadamard and HadamardRotation(64, 0).is_walsh_hadamard
    assert not HadamardRotation(96, 0).is_walsh_hadamard  # 12-based: not butterflies
    assert not HadamardRotation(80, 0).is_walsh_hadamard
    assert not HadamardRotation(48, 0).is_walsh_hadamard  # random orthogonal


def test_decode_step_plan(fake_cuda, monkeypatch):
    """A decode step's launch comes from a plan built once per shape; each
    step still passes its own packed length, window length, means and
    split-counter set."""
    monkeypatch.delenv("TQ_KERNELS", raising=False)
    cache = filled_cache(3.5, 128, 2, 300)  # window 16: flushes every few steps
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.float16)
    seen = []
    for _ in range(12):
        k = mx.random.normal((1, 2, 1, 128)).astype(mx.float16)
        wk, wv = cache.update_and_fetch(k, k)
        out = turboquant_attention(q, wk, wv, cache, 0.1, None)
        assert out.shape == q.shape and out.dtype == mx.float16
        seen.append((cache.packed_len, wk.shape[2], table.tc8_config(128, 4, 2, cache.packed_len, 4, 3, window=True)))
    made, log = fake_cuda
    (fused,) = [k for name, k in made.items() if name.startswith("tq_decode_tc8_fused")]
    assert len(fused.calls) == 12 and len(step_plan.PLANS[cache.rotation]) == 1
    assert len({n for n, _, _ in seen}) > 1 and len({w for _, w, _ in seen}) > 1  # both moved
    ring, words = table.TC8_COUNTER_RING, table.TC8_COUNTER_WORDS * 2  # 2 kv heads
    plan = next(iter(step_plan.PLANS[cache.rotation].values()))
    assert plan.counters.shape == (ring * words,) and not np.asarray(plan.counters).any()
    for i, (call, (n, w, cfg)) in enumerate(zip(fused.calls, seen)):
        meta = np.asarray(call["inputs"][7])
        assert meta[0] == n and meta[11] == w and meta[2] == cfg["TOKS"] and meta[4] == cfg["SLOTS"]
        assert meta[12] == float_bits(0.1) and meta[13] == meta[14] == 1
        assert meta[6] == meta[7] == 0 and list(meta[8:11]) == [cfg["OFF_PO"], cfg["OFF_PM"], cfg["OFF_PL"]]
        # the launch shape's constants are compiled into the body, not passed per call
        assert "template" not in call and call["grid"] == (cfg["GRID_X"], 2, 1)
        assert fused.source.startswith("".join(f"constexpr int {k} = {v};\n" for k, v in cfg["TEMPLATE"] + (("KB", 0), ("TRAD", 0), ("KP", 16), ("QSC", 0))))
        assert call["output_shapes"] == [(cfg["WS"],), (1, 8, 1, 128)]
        assert call["inputs"][8].shape == (1,)  # no key bias: a constant key mean (KB = 0)
        assert call["inputs"][9] is not None and call["inputs"][13].dtype == mx.float32
        # the counter sets in turn, no zero-filled array per launch; a launch
        # is ordered after the last one on its set (their output its input)
        assert call["inputs"][15] is plan.counters and meta[15] == (i % ring) * words
        dep = call["inputs"][16]
        if i >= ring:
            assert dep is fused.results[i - ring][1]
        else:
            assert dep.shape == (1,) and dep.dtype == mx.float16
    # a new key mean is passed on at once
    cache.key_mean = cache.key_mean * 2
    turboquant_attention(q, wk, wv, cache, 0.1, None)
    assert np.allclose(np.asarray(fused.calls[-1]["inputs"][13]), np.asarray(cache.key_mean.astype(mx.float32)))
    # another launch shape on request: another kernel (its constants), same step
    step_plan.decode_step(q, wk, wv, cache, 0.1, warps=4)  # the table's is 8
    name, call = log[-1]
    assert name.startswith("tq_decode_tc8_fused") and name != fused.name
    assert "constexpr int NW = 4;\n" in made[name].source and call["threadgroup"] == (128, 1, 1)
    # what the fused step does not take falls through to the general path
    big = mx.zeros((1, 2, 4000, 128), mx.float16)
    assert step_plan.fused_step(q, big, big, cache, 0.1) is None
    with pytest.raises(ValueError, match="does not cover"):
        step_plan.decode_step(q, big, big, cache, 0.1)
    plans = len(step_plan.PLANS[cache.rotation])
    monkeypatch.setenv("TQ_KERNELS", "reference")
    assert step_plan.fused_step(q, wk, wv, cache, 0.1) is None
    assert len(step_plan.PLANS[cache.rotation]) == plans + 1  # the setting is part of the plan's key
    # float32 queries: another kernel (its own name), same launch shape
    monkeypatch.delenv("TQ_KERNELS")
    turboquant_attention(q.astype(mx.float32), wk, wv, cache, 0.1, None)
    name, call = log[-1]
    assert name.startswith("tq_decode_tc8_fused") and name not in (fused.name, log[-2][0])
    assert call["output_shapes"][1] == (1, 8, 1, 128) and call["output_dtypes"][1] == mx.float32


def test_general_dispatch_takes_the_other_cuda_routes(fake_cuda, monkeypatch):
    """A window mask or 9+ rows leave the fused step: the split-K kernels run
    with the MLX glue around them (tc8 with its fused reduction, tc + reduce)."""
    cache = filled_cache(3.5, 128, 2, 300)
    k = mx.random.normal((1, 2, 2, 128)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    made, log = fake_cuda
    q = mx.random.normal((1, 8, 2, 128)).astype(mx.float16)  # 8 rows, causal over the window
    turboquant_attention(q, wk, wv, cache, 0.1, "causal")
    assert log[-1][0].startswith("tq_decode_tc8_") and not log[-1][0].startswith("tq_decode_tc8_fused")
    assert log[-1][1]["init_value"] == 0.0  # the split counters start at zero
    q = mx.random.normal((1, 8, 3, 128)).astype(mx.float16)  # 12 rows: 16-row tiles
    turboquant_attention(q, wk, wv, cache, 0.1, "causal")
    assert [n.split("_")[2] for n, _ in log[-2:]] == ["tc", "reduce"]


def test_prompts_of_new_lengths_compile_no_new_kernel(fake_cuda):
    """MLX builds one module per kernel name and template arguments (NVRTC,
    ~0.5 s each).  The row count of a prefill chunk or a task's prompt is a
    kernel parameter, so every task and every document's last chunk, each
    of its own length, runs the kernels the first one built."""
    made, log = fake_cuda
    cache = filled_cache(3.5, 128, 2, 300)
    built = []
    for L in (28, 29, 37):  # 112, 116, 148 rows per kv head: 16-row tiles
        k = mx.random.normal((1, 2, L, 128)).astype(mx.float16)
        wk, wv = cache.update_and_fetch(k, k)
        first = len(log)
        turboquant_attention(mx.random.normal((1, 8, L, 128)).astype(mx.float16), wk, wv, cache, 0.1, "causal")
        calls = log[first:]
        assert [n.split("_")[2] for n, _ in calls] == ["tc", "reduce"]
        metas = [next(a for a in kw["inputs"] if a.dtype == mx.int32) for _, kw in calls]
        assert [m.tolist()[5] for m in metas] == [4 * L, 4 * L]  # rows, as a parameter
        built.append({(n, tuple(kw.get("template") or ())) for n, kw in calls})
    assert built[0] == built[1] == built[2]
