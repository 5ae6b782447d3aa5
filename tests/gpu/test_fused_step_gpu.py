"""The fused decode step on an NVIDIA GPU against the split-K route and the reference path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from packed_fixtures import filled_cache, rel

from turboquant.attention import Route, choose, device, step_plan, table, turboquant_attention
from turboquant.attention.compose import split_k_attention
from turboquant.attention.reference import reference_attention
from turboquant.attention.route import describe

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(device.backend() != "cuda", reason="the fused step is CUDA only")]


def routed(q, wk, wv, cache) -> Route:
    return choose(describe(q, wk, wv, cache, None, None, None, True), device.backend(), "gpu")


@pytest.mark.parametrize("kv_bits", [2, 2.5, 3, 3.5, 4])
@pytest.mark.parametrize("d,h_kv,g,L", [(128, 2, 4, 1), (64, 2, 1, 1), (128, 1, 8, 1), (128, 2, 2, 2)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fused_decode_step_matches_the_split_k_route(monkeypatch, kv_bits, d, h_kv, g, L, dtype):
    """One launch (rotations, packed history, window, merge, means) gives
    what the tc8 kernel + ~20 ops give, and what the reference path gives."""
    dt = getattr(mx, dtype)
    cache = filled_cache(kv_bits, d, h_kv, 700)
    k = mx.random.normal((1, h_kv, L, d)) + 0.5
    wk, wv = cache.update_and_fetch(k.astype(dt), (k * 0.5).astype(dt))
    q = (mx.random.normal((1, h_kv * g, L, d)) * 2.0).astype(dt)
    scale = d**-0.5
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    assert routed(q, wk, wv, cache) is Route.FUSED_STEP
    fused = step_plan.decode_step(q, wk, wv, cache, scale)
    assert fused.dtype == dt and fused.shape == q.shape
    ops = split_k_attention(q, wk, wv, cache, scale, None, Route.TC8)
    ref = reference_attention(q, wk, wv, cache, scale, None)
    tol = {"float16": 6e-3, "bfloat16": 1.2e-2, "float32": 6e-3}[dtype]
    assert rel(fused, ops) < tol and rel(fused, ref) < tol
    # without centring terms (means None: only the kernel routes take that)
    # and with a long window (~300 tokens) whose scores dominate
    cache.key_mean = cache.value_mean = None
    wk2 = (mx.random.normal((1, h_kv, 300, d)) * 3.0).astype(dt)
    if routed(q, wk2, wk2, cache) is Route.FUSED_STEP:
        fused = step_plan.decode_step(q, wk2, wk2 * 0.5, cache, scale)
        ops = split_k_attention(q, wk2, wk2 * 0.5, cache, scale, None, Route.TC8)
        assert rel(fused, ops) < tol


def test_fused_decode_step_dtypes_in_one_process(monkeypatch):
    """float16, then float32, then bfloat16 queries and windows with the same
    launch shape: each must run a kernel built for its own types (MLX finds
    compiled kernels by name; the name carries the dtypes)."""
    cache = filled_cache(3.5, 128, 2, 700)
    k = mx.random.normal((1, 2, 1, 128)) + 0.5
    wk, wv = cache.update_and_fetch(k, k * 0.5)
    q = mx.random.normal((1, 8, 1, 128)) * 2.0
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    for dt in (mx.float16, mx.float32, mx.bfloat16, mx.float16):
        args = (q.astype(dt), wk.astype(dt), wv.astype(dt), cache, 128**-0.5)
        fused = turboquant_attention(*args, None)
        ops = split_k_attention(*args, None, Route.TC8)
        assert fused.dtype == dt and rel(fused, ops) < (1.2e-2 if dt == mx.bfloat16 else 6e-3)


@pytest.mark.parametrize("blocks", [2, 64, 264])
@pytest.mark.parametrize("nw", [4, 8])
def test_fused_decode_step_long_history(monkeypatch, blocks, nw):
    """20,000 packed tokens: one packed split (+ the window's), 8 and ~33;
    4 and 8 warps per threadgroup (with one threadgroup, its warps draw
    every chunk but their first from the counter)."""
    d, h_kv, g = 128, 2, 4
    cache = filled_cache(3.5, d, h_kv, 20000, window=128)
    k = mx.random.normal((1, h_kv, 1, d)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    q = mx.random.normal((1, h_kv * g, 1, d)).astype(mx.float16)
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    out = step_plan.decode_step(q, wk, wv, cache, d**-0.5, blocks=blocks, warps=nw)
    assert rel(out, reference_attention(q, wk, wv, cache, d**-0.5, None)) < 6e-3
    out = turboquant_attention(q, wk, wv, cache, d**-0.5, None)  # the public entry, the table's shape
    assert rel(out, reference_attention(q, wk, wv, cache, d**-0.5, None)) < 6e-3


def test_fused_steps_evaluated_together_share_counter_sets_safely(monkeypatch):
    """20 independent decode steps of one plan in one evaluation, 5 times:
    more than the plan's counter sets, so steps i and i + TC8_COUNTER_RING
    share a set (MLX must order them: the later one takes the earlier one's
    output as an input) while up to TC8_COUNTER_RING others may run beside
    them.  Every output must match the reference, and every set must be
    back at zero afterwards."""
    d, h_kv, g = 128, 2, 4
    cache = filled_cache(3.5, d, h_kv, 20000, window=128)
    k = mx.random.normal((1, h_kv, 1, d)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    qs = [mx.random.normal((1, h_kv * g, 1, d)).astype(mx.float16) for _ in range(20)]
    refs = [reference_attention(q, wk, wv, cache, d**-0.5, None) for q in qs]
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    assert len(qs) > 2 * table.TC8_COUNTER_RING
    for _ in range(5):
        outs = [turboquant_attention(q, wk, wv, cache, d**-0.5, None) for q in qs]
        mx.eval(outs)  # one evaluation: the launches may run side by side
        assert max(rel(o, r) for o, r in zip(outs, refs)) < 6e-3
    plan = step_plan.plan_for(qs[0], wk, wv, cache, d**-0.5)
    assert plan is not None and not np.asarray(plan.counters).any()


def test_fused_merge_of_more_splits_than_shared_memory_weighs_at_once(monkeypatch):
    """Head dim 64 at 2 bits with 4 warps: 313 splits over 40,000 tokens, more
    than the fused step's shared memory weighs at once (197)."""
    d, n = 64, 40000
    assert table.tc8_config(d, 4, 1, n, 2, 2, window=True, blocks=1056, warps=4)["S"] == 313
    cache = filled_cache(2, d, 1, n, window=128)
    k = mx.random.normal((1, 1, 1, d)).astype(mx.float16)
    wk, wv = cache.update_and_fetch(k, k)
    q = mx.random.normal((1, 4, 1, d)).astype(mx.float16)
    monkeypatch.setenv("TQ_KERNELS", "gpu")
    out = step_plan.decode_step(q, wk, wv, cache, d**-0.5, blocks=1056, warps=4)
    assert rel(out, reference_attention(q, wk, wv, cache, d**-0.5, None)) < 6e-3
