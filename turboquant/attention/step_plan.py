"""The fused decode step (route FUSED_STEP): one launch per layer and step.

``tq_decode_tc8_fused`` does the whole step -- query rotation, packed
history, exact window, merge, centring terms, inverse rotation -- instead of
~20 MLX ops around a split-K kernel, which at 8k-128k tokens cost more than
the attention itself.  What stays fixed while a cache decodes (the kernel
object with its launch constants compiled in, pair tables, rotation signs,
the ring of split-counter sets) is a :class:`StepPlan`, built once from
``route.choose`` and found again by the call's static shape: the decisions
behind a step cost more Python time than the step takes on the GPU at
short contexts.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from functools import lru_cache
from typing import Optional

import mlx.core as mx

from . import device, table
from ..rotary import MEAN_BLOCK, MEAN_PAIRS
from .compose import block_mean, value_rotation
from .pair_tables import centroids, f32, kernel_tables
from .params import float_bits, meta, tc8_head
from .route import Route, choose, describe
from .sources import kernel_for

_NO_MEAN: list = []


@lru_cache(maxsize=256)
def _pairs_array(pairs: tuple) -> mx.array:
    """The fused step's pair list (int32), one array per distinct tuple."""
    return mx.array(pairs, mx.int32)


def _mean_or_zero(m: Optional[mx.array]):
    """(array, present): a cache mean as float32, or a 1-element stand-in."""
    if m is not None:
        return f32(m), 1
    if not _NO_MEAN:
        _NO_MEAN.append(mx.zeros((1,), mx.float32))
    return _NO_MEAN[0], 0


class StepPlan:
    """The fixed part of a fused decode step's launch; :meth:`launch` adds
    what moves per step (packed length, window, means, counter set)."""

    __slots__ = ("kernel", "tables", "signs", "vsigns", "dims", "shape", "max_w", "bh", "grid_yz", "tg",
                 "out_shape", "out_dtype", "scale_bits", "means", "per_n", "keep", "counters", "slot",
                 "last", "block_mean", "key_scaled")

    def __init__(self, queries, window_keys, window_values, cache, scale,
                 blocks: int = table.TC8_BLOCKS, warps: Optional[int] = None):
        B, H_q, L, D = queries.shape
        H_kv = window_keys.shape[1]
        R = (H_q // H_kv) * L
        kc, vc = cache.key_codec, cache.value_codec
        self.dims = (D, R, B * H_kv, kc.bits, vc.bits)
        self.shape = (blocks, warps)  # the table's launch shape unless a test or benchmark asks
        cfg = table.tc8_config(D, R, B * H_kv, 1, kc.bits, vc.bits, window=True, blocks=blocks, warps=warps)
        vrot = value_rotation(cache)
        self.tables = kernel_tables(centroids(kc), kc.bits, centroids(vc), vc.bits)
        self.signs, self.vsigns = cache.rotation.signs, vrot.signs
        self.max_w, self.bh = table.fused_max_window(D, R, cfg["NW"]), B * H_kv
        self.grid_yz, self.tg = (H_kv, B), (cfg["NW"] * 32, 1, 1)
        self.out_shape, self.out_dtype = (B, H_q, L, D), queries.dtype
        self.scale_bits = float_bits(scale)
        # a cache centred on a block mean (KB): the kernel computes the key
        # bias from the RoPE block table and the pre-RoPE key mean
        self.block_mean = block_mean(cache)
        self.key_scaled = getattr(cache, "key_scale", None) is not None
        self.means = {}  # mean array (by identity) -> (array, float32 array, present)
        self.per_n = {}  # packed length -> (params head, (grid x, workspace words))
        self.keep = (kc, vc, vrot)  # their ids are part of the plan's key
        # TC8_COUNTER_RING counter sets, zeroed once (each launch leaves its
        # set at zero); last[i]: the output of the latest launch on set i,
        # the next one's ordering input.
        ring, words = table.TC8_COUNTER_RING, table.TC8_COUNTER_WORDS
        self.counters = mx.zeros((ring * words * self.bh,), mx.uint32)
        mx.eval(self.counters)
        self.slot = 0
        self.last = [mx.zeros((1,), queries.dtype)] * ring
        m0 = mx.zeros((1,), mx.float32)  # stand-ins: only the dtypes name the kernel
        probe = [queries, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
                 *self.tables, meta(0), m0, window_keys, window_values, self.signs, self.vsigns, m0, m0,
                 self.counters, self.last[0], meta(0), m0]
        self.kernel = kernel_for("tq_decode_tc8_fused", cfg["PRELUDE"], probe,
                                 [mx.float32, queries.dtype],
                                 cfg["TEMPLATE"] + (("KB", int(self.block_mean)),
                                                    ("TRAD", int(self.block_mean and cache.rotary.traditional)),
                                                    ("KP", MEAN_PAIRS), ("QSC", int(self.key_scaled))))

    def _mean(self, m):
        hit = self.means.get(id(m))
        if hit is None or hit[0] is not m:
            if len(self.means) > 8:
                self.means.clear()
            hit = self.means[id(m)] = (m, *_mean_or_zero(m))
        return hit[1], hit[2]

    def _signs(self, cache) -> mx.array:
        """The query's signs before the FWHT: the rotation's, or per kv head
        times the cache's key scale (fixed once the cache has packed a token,
        so computed once per cache)."""
        if not self.key_scaled:
            return self.signs
        ks = cache.key_scale
        held = getattr(cache, "_scaled_signs", None)
        if held is None or held[0] is not ks:
            held = cache._scaled_signs = (ks, (f32(self.signs) * ks.astype(mx.float32)).reshape(-1))
        return held[1]

    def covers(self, n: int, w: int, cache=None) -> bool:
        """This step's packed and window lengths fit; a block-mean cache also
        needs its turned pairs to fit the compact table (``turned_pairs``)."""
        return n > 0 and 1 <= w <= self.max_w and (not self.block_mean or cache.turned_pairs is not None)

    def launch(self, queries, window_keys, window_values, cache) -> mx.array:
        n = cache.packed_len
        per = self.per_n.get(n)
        if per is None:
            D, R, BH, kb, vb = self.dims
            cfg = table.tc8_config(D, R, BH, n, kb, vb, window=True, blocks=self.shape[0], warps=self.shape[1])
            if len(self.per_n) > 64:
                self.per_n.clear()
            head = tc8_head(n, cache.keys_packed.shape[2], cfg, self.grid_yz[0], R, fused=True)
            per = self.per_n[n] = (head, (cfg["GRID_X"], cfg["WS"]))
        head, (grid_x, ws) = per
        km, has_km = self._mean(getattr(cache, "key_mean", None))
        if self.block_mean:  # the compact table of the layer's turned pairs, and their pre-RoPE mean
            pairs = cache.turned_pairs
            kb = cache.rotary.block_table(cache.sink_len, -(-n // MEAN_BLOCK), pairs)
            kpairs, kmpre = _pairs_array(pairs), cache.key_mean_pre
        else:
            kb = kpairs = kmpre = _mean_or_zero(None)[0]
        vm, has_vm = self._mean(getattr(cache, "value_mean", None))
        slot = self.slot
        self.slot = (slot + 1) % table.TC8_COUNTER_RING
        params = meta(*head, window_keys.shape[2], self.scale_bits, has_km, has_vm,
                      slot * table.TC8_COUNTER_WORDS * self.bh)
        ktab, vtab = self.tables
        out = self.kernel(
            inputs=[queries, cache.keys_packed, cache.keys_norms, cache.values_packed, cache.values_norms,
                    ktab, vtab, params, kb, window_keys, window_values, self._signs(cache), self.vsigns, km, vm,
                    self.counters, self.last[slot], kpairs, kmpre],
            grid=(grid_x, *self.grid_yz), threadgroup=self.tg, output_shapes=[(ws,), self.out_shape],
            output_dtypes=[mx.float32, self.out_dtype],
        )[1]  # no init_value: the kernel writes every element before reading it
        self.last[slot] = out
        return out


PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # rotation -> {key: plan | None}
_NO_PLAN = object()  # not looked up yet (None: looked up, no fused step)


def _plan_key(queries, window_keys, window_values, cache, scale) -> tuple:
    wk, wv = window_keys.shape, window_values.shape
    return (queries.shape, queries.dtype, wk[0], wk[1], wk[3], window_keys.dtype, wv[3],
            window_values.dtype, cache.keys_packed.shape, cache.values_packed.shape,
            cache.keys_norms.dtype, cache.values_norms.dtype, id(cache.key_codec),
            id(cache.value_codec), id(value_rotation(cache)), scale, block_mean(cache),
            getattr(cache, "key_scale", None) is not None, device.on_gpu(),
            os.environ.get("TQ_KERNELS"))


def _build(queries, window_keys, window_values, cache, scale) -> Optional[StepPlan]:
    """A plan where ``choose`` routes this call to the fused step for some
    packed and window length (checked per step by :meth:`StepPlan.covers`)."""
    if block_mean(cache) and cache.rotary.dims != queries.shape[-1]:
        return None  # the kernel's block table covers the whole head (a partial RoPE: tc8 + key-bias kernel)
    call = describe(queries, window_keys, window_values, cache, None, None, None, device.on_gpu())
    call = dataclasses.replace(call, packed=1, window=1)
    if choose(call, device.backend(), device.mode()) is not Route.FUSED_STEP:
        return None
    return StepPlan(queries, window_keys, window_values, cache, scale)


def plan_for(queries, window_keys, window_values, cache, scale) -> Optional[StepPlan]:
    """The cached plan for this step's static shape (built on first use), or None."""
    if cache.keys_packed is None:
        return None
    key = _plan_key(queries, window_keys, window_values, cache, scale)
    try:
        plans = PLANS.get(cache.rotation)
        if plans is None:
            plans = PLANS[cache.rotation] = {}
    except TypeError:  # a rotation without weak references: no caching
        return _build(queries, window_keys, window_values, cache, scale)
    plan = plans.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        if len(plans) > 32:
            plans.clear()
        plan = plans[key] = _build(queries, window_keys, window_values, cache, scale)
    return plan


def fused_step(queries, window_keys, window_values, cache, scale) -> Optional[mx.array]:
    """The decode step in one launch where its plan covers it, else None
    (then the general dispatch runs, and ``choose`` decides the same way)."""
    plan = plan_for(queries, window_keys, window_values, cache, scale)
    if plan is None or not plan.covers(cache.packed_len, window_keys.shape[2], cache):
        return None
    return plan.launch(queries, window_keys, window_values, cache)


def decode_step(queries, window_keys, window_values, cache, scale,
                blocks: int = table.TC8_BLOCKS, warps: Optional[int] = None) -> mx.array:
    """The fused step on a plan of its own (not cached), with another launch
    shape than the table's if asked: for tests and benchmarks.  The caller
    checks that ``choose`` routes the call to FUSED_STEP."""
    plan = StepPlan(queries, window_keys, window_values, cache, scale, blocks, warps)
    if not plan.covers(cache.packed_len, window_keys.shape[2], cache):
        raise ValueError("decode_step: the fused step does not cover this window")
    return plan.launch(queries, window_keys, window_values, cache)
