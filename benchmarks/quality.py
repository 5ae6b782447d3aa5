"""Quality of compressed KV caches on real text (SmolLM2-135M-Instruct, CPU).

    python -m benchmarks.quality [--json] [--quick] [--workers N] [--passages 3] [--prefill 2048]
        [--tokens 256] [--chunk 256] [--window 128] [--bits 2.5,3,3.5,4] [--key-mean turned,constant]

Text: the longest topics of the Python reference manual shipped with the
standard library (``pydoc_data.topics``: the data model, compound
statements, the standard type hierarchy), so every machine with Python has
the same passages.  Each passage is ``--prefill`` tokens of history
followed by ``--tokens`` tokens that are scored.

Method, per passage (all passages run as one batch):

1. the float32 model prefills the history once, in ``--chunk``-token
   chunks, into its own cache;
2. each configuration's caches are filled with that history's keys and
   values, chunk by chunk through ``update_and_fetch`` (so the compressed
   caches quantize, calibrate and flush exactly as in a chunked prefill);
3. the scored tokens are teacher-forced, each read as its decode step
   would read the cache: the compressed history and every earlier scored
   token as the cache holds it (quantized once it leaves the exact
   window).  All of them in one forward (``DecodeReplay`` gives each row
   what its step reads); ``--stepwise`` runs the steps one at a time,
   ~10x slower, for the same rows within float order.

Reported against the float32 cache: perplexity of the scored tokens (per
passage and its change), mean KL(float32 || config) of the next-token
distributions, top-1 agreement, and the bytes the cache holds per token at
the end (packed codes, scales, exact tokens and calibration, all layers).
The perplexity change and the KL come with 95% intervals from a paired
block bootstrap over the scored positions (:func:`intervals`): how much
the figure would move on other text of the same kind, which is what says
whether a row really is above or below a goal.
History from the float32 prefill keeps one prefill per passage for all
configurations; it leaves out the compounding of quantized attention during
prefill (at 3.5 bits without the exact window that added about 1% of
perplexity on one passage when measured both ways).

Rows run in ``--workers`` spawned processes side by side (each repeats the
float32 reference run), with OpenBLAS on one thread each: the table is then
the same for any worker count and any number of cores.

Configurations: float32; tqpipe at each width with the exact window off
(``window=0``) and at ``--window``, with the scalar (Lloyd-Max) and
trellis (``tcq``) quantizers; mlx-vlm's ``TurboQuantKVCache`` at the same
widths; mlx-lm's affine ``QuantizedKVCache`` at 4 and 2 bits (group 64).
tqpipe's caches centre keys as they would on this CPU: on the pre-RoPE mean
turned to each position.  ``--key-mean blocks`` adds (or, alone, runs) rows
whose keys are centred as caches on a GPU centre them: on that mean averaged
over each block of 32 packed tokens, on each layer's top ``MEAN_PAIRS``
rotary pairs (the kernels add one score term per block back): the quality
GPU users get.  ``constant``: one constant key mean, as GPU caches had
before the kernels took the block term.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core)
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from turboquant.rotary import MEAN_PAIRS

TOPICS = ("specialnames", "compound", "types", "formatstrings")  # pydoc_data.topics keys, longest first


def passages(tokenizer: Any, count: int, n_tokens: int) -> list[list[int]]:
    """The first ``n_tokens`` tokens of ``count`` reference-manual topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions split the stdlib docs out
        raise SystemExit(f"benchmarks.quality: needs the stdlib's pydoc_data.topics ({exc})") from exc
    if count > len(TOPICS):
        raise SystemExit(f"benchmarks.quality: at most {len(TOPICS)} passages")
    out = []
    for name in TOPICS[:count]:
        ids = list(tokenizer.encode(topics[name]))
        if len(ids) < n_tokens:
            raise SystemExit(f"benchmarks.quality: topic {name!r} has {len(ids)} tokens, need {n_tokens}")
        out.append(ids[:n_tokens])
    return out


# ------------------------------------------------------------ configurations
@dataclass(frozen=True)
class CacheConfig:
    """A named way to build the per-layer caches for one run."""

    label: str
    scheme: str  # "fp16" | "affine" | "turboquant" | "mlx-vlm"
    bits: float | None = None
    window: int | None = None
    quantizer: str = "scalar"  # turboquant only
    key_mean: str = "turned"  # turboquant only: "turned" (CPU), "blocks" (GPU), "constant" (no RoPE term)
    seed: int = 0  # the random rotation's (turboquant, mlx-vlm)

    @property
    def seeded(self) -> bool:
        """Whether the cache draws a random rotation (so ``--seeds`` repeats it)."""
        return self.scheme in ("turboquant", "mlx-vlm")

    def build(self, model: Any) -> list:
        from turboquant import make_prompt_cache

        if self.scheme == "fp16":
            return make_prompt_cache(model, kv_quant_scheme="fp16")
        if self.scheme == "affine":
            return make_prompt_cache(model, kv_bits=self.bits, kv_quant_scheme="affine")
        if self.scheme == "turboquant":
            caches = make_prompt_cache(model, kv_bits=self.bits, window=self.window, quantizer=self.quantizer,
                                       seed=self.seed)
            for c in caches:  # whatever this machine would choose: the row's key centring
                c.mean_blocks = self.key_mean == "blocks"
                c.mean_pairs = MEAN_PAIRS if c.mean_blocks else 0
                if self.key_mean == "constant":
                    c.rotary = None
            return caches
        if self.scheme == "mlx-vlm":
            from mlx_vlm.turboquant import TurboQuantKVCache as PeerCache

            route_benchmark_attention()
            return [PeerCache(bits=self.bits, seed=self.seed) for _ in model.layers]
        raise ValueError(f"benchmarks.quality: unknown scheme {self.scheme!r}")


SCHEMES = ("fp16", "affine", "mlx-vlm", "turboquant")
QUANTIZERS = ("scalar", "tcq")
KEY_MEANS = ("turned", "blocks", "constant")
KEY_MEAN_LABELS = {"turned": "", "blocks": ", block key mean", "constant": ", constant key mean"}


def default_configs(window: int, bits: Sequence[float] = (2.5, 3, 3.5, 4),
                    schemes: Sequence[str] = SCHEMES,
                    quantizers: Sequence[str] = QUANTIZERS,
                    key_means: Sequence[str] = KEY_MEANS[:1]) -> list[CacheConfig]:
    """float32 first, then per width: mlx-vlm, ours (each quantizer, window 0
    and ``window``, each key mean); mlx-lm affine at 4 and 2 bits last."""
    configs = [CacheConfig("float32", "fp16")]
    for b in bits:
        if "mlx-vlm" in schemes:
            configs.append(CacheConfig(f"mlx-vlm TurboQuant {b:g}", "mlx-vlm", b))
        if "turboquant" in schemes:
            for q in quantizers:
                for w in dict.fromkeys((0, window)):  # --window 0: once
                    for km in key_means:
                        label = f"tqpipe {b:g} {q}, window {w}" + KEY_MEAN_LABELS[km]
                        configs.append(CacheConfig(label, "turboquant", b, w, q, km))
    if "affine" in schemes:
        configs += [CacheConfig(f"mlx-lm affine {b}-bit", "affine", b) for b in (4, 2)]
    return configs


def route_benchmark_attention() -> None:
    """Route the benchmark's own cache kinds in the llama module's attention
    (after ``turboquant.install()``, so our caches keep their route), inside
    the benchmarks only; idempotent.

    * mlx-vlm's ``TurboQuantKVCache`` has a ``bits`` attribute, which mlx-lm's
      attention would send to its affine kernel: it goes to mlx-vlm's own
      dispatcher;
    * a :class:`DecodeReplay` layer goes to our attention route with the
      per-row mask its ``update_and_fetch`` built.
    """
    import mlx_lm.models.llama as llama_mod

    from turboquant.attention import turboquant_attention

    turboquant.install()
    current = llama_mod.scaled_dot_product_attention
    if getattr(current, "_benchmark_route", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, QueryRecorder):
            cache.record(queries)
        if isinstance(cache, DecodeReplay):
            return turboquant_attention(queries, keys, values, cache.cache, scale, cache.mask, sinks)
        if type(cache).__module__.startswith("mlx_vlm."):
            from mlx_vlm.models import base as vlm_base

            return vlm_base.scaled_dot_product_attention(
                queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
            )
        return current(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._benchmark_route = True
    llama_mod.scaled_dot_product_attention = scaled_dot_product_attention


# ------------------------------------------------- teacher forcing, replayed
class DecodeReplay:
    """One layer's TurboQuant cache reading ``L`` teacher-forced tokens as
    ``L`` decode steps would, in one forward.

    Why: scoring 256 tokens one decode step at a time is 256 forwards of the
    whole model, most of this benchmark's time; one forward of all of them
    costs about one.  A causal forward reads the same history as the steps
    where a cache quantizes every token it receives (float32, mlx-lm's affine
    cache, mlx-vlm's TurboQuant: a step's query reads its own and every
    earlier token as the cache holds them).  Ours keeps the newest tokens
    exact and packs them in batches, so the tokens a step reads packed depend
    on the step: ``update_and_fetch`` walks the L steps' boundaries with the
    cache's own rule (``flush_count``), appends the tokens, packs what the
    last step would have packed (so the cache ends as after the steps, bytes
    included) and returns the sinks and every exact token any row reads; the
    attention (``route_benchmark_attention``) then gives row ``t`` the packed
    history below step ``t``'s boundary and the exact tokens from there to
    ``t``, through our attention route.  Each row reads the same tokens
    packed and exact as its step; only the float order of the attention's
    blocks differs, which can flip a later token's code near a cell boundary
    (bit-identical on the test model; the figures are in docs/benchmarks.md).
    """

    def __init__(self, cache: Any):
        self.cache = cache
        self.mask: mx.array | None = None

    @property
    def offset(self) -> int:
        return self.cache.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None  # the rows' mask comes from update_and_fetch

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        from turboquant.cache import flush_count

        c = self.cache
        if c.hold or c.offset < c.sinks or c.window_keys is None:
            raise ValueError("DecodeReplay: needs a filled cache (past its sinks) that is not held")
        s, start, L = c.sink_len, c.offset, keys.shape[2]
        exact, packed, bounds = c.window_len - s, c.packed_len, []
        for _ in range(L):  # each step packs, then appends its token
            n = flush_count(exact, c.window, c.flush_batch)
            packed, exact = packed + n, exact - n + 1
            bounds.append(s + packed)
        first = s + c.packed_len  # the first exact token after the sinks, now
        wk = mx.concatenate([c.window_keys, keys], axis=2)  # sinks, then positions first..start+L-1
        wv = mx.concatenate([c.window_values, values], axis=2)
        c.update_and_fetch(keys, values)
        c.settle(window=start + L - bounds[-1])
        b = mx.array(bounds)[:, None]
        rows = mx.arange(start, start + L)[:, None]
        exact_pos = mx.arange(first, start + L)[None]
        self.mask = mx.concatenate([
            mx.ones((L, s), mx.bool_),
            mx.arange(s, s + c.packed_len)[None] < b,
            (exact_pos >= b) & (exact_pos <= rows),
        ], axis=1)
        return wk, wv


# ----------------------------------------------------------------- running
def _logits(model: Any, h: mx.array) -> mx.array:
    if hasattr(model, "lm_head"):
        return model.lm_head(h)
    return model.model.embed_tokens.as_linear(h)


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class QueryRecorder(KVCache):
    """mlx-lm's float cache that also keeps each chunk's per-channel query
    energy per kv head (what our caches calibrate their key scale on)."""

    def __init__(self):
        super().__init__()
        self.query_energy: list[tuple[mx.array, int]] = []

    def record(self, queries: mx.array) -> None:
        B, _, _, D = queries.shape
        q = queries.astype(mx.float32).reshape(B, self.keys.shape[1], -1, D)
        self.query_energy.append(((q * q).sum(axis=2), q.shape[2]))


@dataclass
class History:
    """The float32 prefill of a batch of passages: per-layer keys/values
    [B, H, P, D] and the log-probabilities of the first scored token [B, V]."""

    keys: list[mx.array]
    values: list[mx.array]
    first: mx.array
    cache: list  # the float32 caches themselves (the reference run continues from them)

    def query_energy(self, layer: int, chunk: int) -> tuple[mx.array, int]:
        return self.cache[layer].query_energy[chunk]


def float_prefill(model: Any, ids: mx.array, chunk: int) -> History:
    """Prefill ``ids`` [B, P] through the model's own (float32) cache in chunks."""
    route_benchmark_attention()
    cache = [QueryRecorder() for _ in model.layers]
    n = ids.shape[1]
    for start in range(0, n, chunk):
        h = model.model(ids[:, start:start + chunk], cache=cache)
        mx.eval(h, [c.state for c in cache])
    first = _logprobs(_logits(model, h[:, -1]))
    keys = [c.state[0][:, :, :n] for c in cache]
    values = [c.state[1][:, :, :n] for c in cache]
    mx.eval(first, keys, values)
    return History(keys, values, first, cache)


def fill(caches: list, history: History, chunk: int) -> None:
    """Give each layer's cache the float32 history, ``chunk`` tokens at a time."""
    n = history.keys[0].shape[2]
    for c in caches:
        if hasattr(c, "reserve"):
            c.reserve(n + 1024)
    for i, start in enumerate(range(0, n, chunk)):
        for layer, (c, k, v) in enumerate(zip(caches, history.keys, history.values)):
            c.update_and_fetch(k[:, :, start:start + chunk], v[:, :, start:start + chunk])
            if hasattr(c, "add_query_energy"):  # what the chunk's attention would have observed
                c.add_query_energy(*history.query_energy(layer, i))
        mx.eval([[a for a in c.state if isinstance(a, mx.array)] for c in caches])


def teacher_forced(model: Any, caches: list, first: mx.array, targets: mx.array) -> mx.array:
    """Log-probabilities [B, T, V]: row t predicts ``targets[:, t]`` after the
    history and ``targets[:, :t]``, each read as T decode steps through the
    caches would read them, in one forward (:class:`DecodeReplay`)."""
    from turboquant.cache import TurboQuantKVCache

    route_benchmark_attention()
    layers = [DecodeReplay(c) if isinstance(c, TurboQuantKVCache) else c for c in caches]
    lp = _logprobs(model(targets[:, :-1], cache=layers))
    return mx.concatenate([first[:, None], lp], axis=1)


def teacher_forced_stepwise(model: Any, caches: list, first: mx.array, targets: mx.array) -> mx.array:
    """:func:`teacher_forced` as T decode steps of one token each (``--stepwise``:
    what the replay reproduces, ~10x slower)."""
    rows = [first]
    for t in range(targets.shape[1] - 1):
        rows.append(_logprobs(model(targets[:, t:t + 1], cache=caches)[:, -1]))
        mx.eval(rows[-1])
    return mx.stack(rows, axis=1)


def kv_bytes(caches: list) -> int:
    """Bytes holding the cached tokens, not reserved capacity: ours'
    ``used_nbytes``, mlx-vlm's ``nbytes`` (just the tokens held), and for
    mlx-lm's caches (allocated in 256-token steps) the per-token bytes of
    their key/value arrays times the tokens held."""
    from mlx.utils import tree_flatten

    from turboquant.cache import TurboQuantKVCache

    total = 0
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            total += c.used_nbytes
        elif type(c).__module__.startswith("mlx_vlm."):
            total += c.nbytes
        else:
            arrays = [a for _, a in tree_flatten((c.keys, c.values))]
            total += sum(a.nbytes // a.shape[2] for a in arrays) * c.offset
    return int(total)


def bytes_per_token(caches: list, ids_shape: tuple) -> float:
    """The caches' bytes per token held at the end of a run over ``ids_shape``
    [B, history + scored] (the last scored token is never written)."""
    return kv_bytes(caches) / (ids_shape[0] * (ids_shape[1] - 1))


@dataclass
class Result:
    label: str
    scheme: str
    bits: float | None
    window: int | None
    quantizer: str
    ppl: list[float] = field(default_factory=list)  # per passage
    ppl_change: float = 0.0  # mean over passages of ppl / float32 ppl - 1
    kl: float = 0.0  # mean KL(float32 || config) over all scored positions
    ppl_change_interval: list[float] = field(default_factory=lambda: [0.0, 0.0])  # BOOT_LEVEL, paired (intervals)
    kl_interval: list[float] = field(default_factory=lambda: [0.0, 0.0])
    seeds: int = 1  # rotation seeds the row is averaged over (--seeds)
    ppl_change_per_seed: list[float] = field(default_factory=list)
    top1: float = 0.0
    bytes_per_token: float = 0.0  # all layers, keys + values
    seconds: float = 0.0
    key_mean: str = ""  # turboquant: "turned" (as on the CPU), "blocks" (as on GPUs) or "constant"


def mean_ppl_change(nll_change_means: np.ndarray) -> np.ndarray:
    """The table's perplexity change from each passage's mean NLL change
    [..., B]: the mean over passages of ppl / float32 ppl - 1 (also what a
    bootstrap draw reports, :func:`intervals`)."""
    return np.expm1(nll_change_means).mean(axis=-1)


@dataclass
class Scores:
    """One configuration's per-position terms against float32's, [B, T] each
    (NumPy): what the row's figures, its intervals and a seed average come from."""

    nll: np.ndarray  # the config's negative log-likelihood of each scored token
    nll_change: np.ndarray  # minus float32's
    kl: np.ndarray  # KL(float32 || config) of the next-token distributions
    top1: np.ndarray  # 1 where both rank the same token first

    @property
    def ppl(self) -> list[float]:
        return np.exp(self.nll.mean(axis=1)).tolist()

    @property
    def ppl_change(self) -> float:
        return float(mean_ppl_change(self.nll_change.mean(axis=1)))

    @classmethod
    def mean(cls, runs: Sequence["Scores"]) -> "Scores":
        """The average over rotation seeds, position by position (the
        perplexity of the mean log-likelihood: a geometric mean over seeds)."""
        return cls(*(np.mean([getattr(r, f) for r in runs], axis=0) for f in ("nll", "nll_change", "kl", "top1")))


def score(ref: mx.array, other: mx.array, targets: mx.array) -> Scores:
    """The per-position terms of [B, T, V] log-probs ``other`` against ``ref``."""
    nll = -mx.take_along_axis(other, targets[..., None], axis=-1)[..., 0]
    nll_ref = -mx.take_along_axis(ref, targets[..., None], axis=-1)[..., 0]
    kl = mx.maximum(mx.sum(mx.exp(ref) * (ref - other), axis=-1), 0.0)
    top1 = mx.argmax(ref, axis=-1) == mx.argmax(other, axis=-1)
    return Scores(*(np.asarray(x.astype(mx.float32), np.float64) for x in (nll, nll - nll_ref, kl, top1)))


# Intervals: a paired block bootstrap over the scored positions.  Paired:
# every draw takes the same positions from float32 and the cache, so what
# varies is which text was scored, not two independent samples.  Blocks:
# neighbouring tokens' losses are correlated (a hard sentence is hard for
# several tokens), so positions are drawn BOOT_BLOCK at a time (fewer where
# a passage has under 4 blocks), each passage from its own blocks.  A fixed
# seed keeps a table reproducible.
BOOT_BLOCK = 16
BOOT_DRAWS = 2000
BOOT_LEVEL = 0.95


def intervals(nll_change: np.ndarray, kl: np.ndarray, seed: int = 0) -> tuple[list[float], list[float]]:
    """``BOOT_LEVEL`` intervals of (perplexity change, mean KL), each [low, high],
    from the per-position terms [B, T] of :class:`Scores` (the perplexity
    change as the table gives it: the mean over passages of ppl ratio - 1)."""
    B, T = nll_change.shape
    size = max(1, min(BOOT_BLOCK, T // 4))  # short samples (--quick) still draw from 4 blocks
    nb = T // size
    blocks = lambda x: x[:, : nb * size].reshape(B, nb, size).mean(axis=2)  # noqa: E731
    d, k = blocks(nll_change), blocks(kl)
    pick = np.random.default_rng(seed).integers(0, nb, size=(BOOT_DRAWS, B, nb))
    rows = np.arange(B)[None, :, None]
    ppl = mean_ppl_change(d[rows, pick].mean(axis=2))
    kls = k[rows, pick].mean(axis=(1, 2))
    q = [(1 - BOOT_LEVEL) / 2, (1 + BOOT_LEVEL) / 2]
    return np.quantile(ppl, q).tolist(), np.quantile(kls, q).tolist()


@dataclass
class Reference:
    """The float32 run every configuration is scored against."""

    history: History
    targets: mx.array  # [B, T] scored tokens
    logprobs: mx.array  # [B, T, V]
    run: "Run"


@dataclass
class Run:
    """One configuration at one rotation seed: what a worker sends back."""

    config: CacheConfig
    scores: Scores
    bytes_per_token: float  # all layers, keys + values
    seconds: float


def summarize(runs: Sequence[Run]) -> Result:
    """One table row from a configuration's runs (one per seed)."""
    c, sc = runs[0].config, Scores.mean([r.scores for r in runs])
    ppl_iv, kl_iv = intervals(sc.nll_change, sc.kl)
    return Result(c.label, c.scheme, c.bits, c.window, c.quantizer if c.scheme == "turboquant" else "",
                  sc.ppl, sc.ppl_change, float(sc.kl.mean()), ppl_iv, kl_iv, len(runs),
                  [r.scores.ppl_change for r in runs], float(sc.top1.mean()),
                  sum(r.bytes_per_token for r in runs) / len(runs), sum(r.seconds for r in runs),
                  c.key_mean if c.scheme == "turboquant" else "")


def check_reference(config: CacheConfig) -> None:
    if config.scheme != "fp16":
        raise ValueError("benchmarks.quality.evaluate: the first config must be the float32 reference")


def scorer(stepwise: bool):
    """The teacher-forcing function: replayed (default) or one decode step at a time."""
    return teacher_forced_stepwise if stepwise else teacher_forced


def reference_run(model: Any, ids: mx.array, n_prefill: int, config: CacheConfig, chunk: int = 256,
                  stepwise: bool = False) -> Reference:
    """The float32 prefill of ``ids[:, :n_prefill]`` and its teacher-forced log-probs."""
    check_reference(config)
    history = float_prefill(model, ids[:, :n_prefill], chunk)
    targets = ids[:, n_prefill:]
    t0 = time.perf_counter()
    lp = scorer(stepwise)(model, history.cache, history.first, targets)
    run = Run(config, score(lp, lp, targets), bytes_per_token(history.cache, ids.shape),
              time.perf_counter() - t0)
    return Reference(history, targets, lp, run)


def run_config(model: Any, ref: Reference, config: CacheConfig, chunk: int = 256,
               stepwise: bool = False) -> Run:
    """One configuration (at its seed): its caches filled with the float32 history, then scored."""
    t0 = time.perf_counter()
    caches = config.build(model)
    fill(caches, ref.history, chunk)
    lp = scorer(stepwise)(model, caches, ref.history.first, ref.targets)
    B, T = ref.targets.shape
    run = Run(config, score(ref.logprobs, lp, ref.targets),
              bytes_per_token(caches, (B, ref.history.keys[0].shape[2] + T)), time.perf_counter() - t0)
    del caches, lp
    mx.clear_cache()
    return run


def seeded(configs: Sequence[CacheConfig], seeds: int) -> list[list[CacheConfig]]:
    """Each config at rotation seeds ``c.seed`` .. ``c.seed + seeds - 1`` (once
    where it draws no rotation)."""
    return [[replace(c, seed=c.seed + k) for k in range(seeds if c.seeded else 1)] for c in configs]


def _change(r: Result) -> str:
    lo, hi = r.ppl_change_interval
    return f"{100 * r.ppl_change:+.2f}% ({100 * lo:+.1f}, {100 * hi:+.1f})"


def _kl(r: Result) -> str:
    lo, hi = r.kl_interval
    return f"{r.kl:.4f} ({lo:.4f}, {hi:.4f})"


def log_line(r: Result) -> str:
    per_seed = f"  per seed {' / '.join(f'{100 * c:+.2f}%' for c in r.ppl_change_per_seed)}" if r.seeds > 1 else ""
    return (f"{r.label:34s} ppl {' / '.join(f'{p:.3f}' for p in r.ppl)} {_change(r)}  "
            f"KL {_kl(r)}  top-1 {100 * r.top1:.1f}%  {r.bytes_per_token:,.0f} B/token  ({r.seconds:.0f} s){per_seed}")


def evaluate(model: Any, ids: mx.array, n_prefill: int, configs: Sequence[CacheConfig], *,
             chunk: int = 256, stepwise: bool = False, seeds: int = 1, log=lambda s: None) -> list[Result]:
    """Every config on the passages ``ids`` [B, n_prefill + T] in this process
    (each rotating one averaged over ``seeds`` seeds); ``configs[0]`` is float32."""
    ref = reference_run(model, ids, n_prefill, configs[0], chunk, stepwise)
    results = [summarize([ref.run])]
    log(log_line(results[-1]))
    for group in seeded(configs[1:], seeds):
        results.append(summarize([run_config(model, ref, c, chunk, stepwise) for c in group]))
        log(log_line(results[-1]))
    return results


# --------------------------------------------------------------- in workers
# Rows are independent, so worker processes score them side by side.  Each
# worker runs OpenBLAS on one thread: the float sums then come out in the
# same order whatever the worker count or the machine's cores, so the table
# does not depend on them (it moves by ~0.5 perplexity points between 1 and
# 2 BLAS threads: docs/results/quality_threads_cpu.txt).
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1"}
_WORKER: dict = {}


def _worker_init(model_ref: str | None, ids: list[list[int]], n_prefill: int, reference: CacheConfig,
                 chunk: int, stepwise: bool) -> None:
    from pipeline.models.load import load_model

    model = load_model(model_ref).model
    arr = mx.array(ids, dtype=mx.int32)
    _WORKER.update(model=model, chunk=chunk, stepwise=stepwise,
                   ref=reference_run(model, arr, n_prefill, reference, chunk, stepwise))


def _worker_row(config: CacheConfig | None) -> Run:
    if config is None:
        return _WORKER["ref"].run
    return run_config(_WORKER["model"], _WORKER["ref"], config, _WORKER["chunk"], _WORKER["stepwise"])


def evaluate_in_workers(model_ref: str | None, ids: list[list[int]], n_prefill: int,
                        configs: Sequence[CacheConfig], *, workers: int, chunk: int = 256,
                        stepwise: bool = False, seeds: int = 1, log=lambda s: None) -> list[Result]:
    """:func:`evaluate` in ``workers`` spawned processes, each taking one run (a
    config at one seed) at a time and loading ``model_ref`` (a path, or None
    for the built-in model); results in ``configs`` order.  A
    worker that cannot start (a model that does not load) fails the run with
    ``BrokenProcessPool`` instead of being started again and again."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    check_reference(configs[0])
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)  # workers start (on demand) with the environment of that moment
    try:
        with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_worker_init,
                                 initargs=(model_ref, ids, n_prefill, configs[0], chunk, stepwise)) as pool:
            groups = [[None], *seeded(configs[1:], seeds)]
            runs = iter(pool.map(_worker_row, [c for g in groups for c in g]))
            results = []
            for g in groups:  # in order, each row as soon as its last run is in
                results.append(summarize([next(runs) for _ in g]))
                log(log_line(results[-1]))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


# --------------------------------------------------------------------- CLI
def format_table(results: Sequence[Result]) -> str:
    peer = {r.bits: r.kl for r in results if r.scheme == "mlx-vlm"}
    lines = ["| cache | bytes/token | perplexity | vs float32 (95%) | mean KL (95%) | KL / mlx-vlm | top-1 |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        rel = f"{r.kl / peer[r.bits]:.2f}x" if r.scheme == "turboquant" and peer.get(r.bits) else ""
        lines.append(f"| {r.label} | {r.bytes_per_token:,.0f} | {' / '.join(f'{p:.2f}' for p in r.ppl)} | "
                     f"{_change(r)} | {_kl(r)} | {rel} | {100 * r.top1:.1f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--passages", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2048, help="history tokens per passage")
    p.add_argument("--tokens", type=int, default=256, help="scored (teacher-forced) tokens per passage")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    p.add_argument("--window", type=int, default=128, help="our exact window (also run with 0)")
    p.add_argument("--bits", default="2.5,3,3.5,4")
    p.add_argument("--schemes", default=",".join(SCHEMES[1:]), help="which caches besides float32")
    p.add_argument("--quantizers", default=",".join(QUANTIZERS))
    p.add_argument("--key-mean", default=KEY_MEANS[0],
                   help="tqpipe's key centring, comma-separated: turned (as on the CPU), blocks (as on GPUs), "
                        "constant (one mean, no RoPE term)")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes scoring rows side by side (default: CPU cores, at most 4)")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke: 1 passage, 512 + 32 tokens, 3.5 bits, scalar, affine 4 and 2")
    p.add_argument("--seeds", type=int, default=1,
                   help="average each rotating cache (ours, mlx-vlm) over this many rotation seeds "
                        "(0, 1, ...): at one seed, 3.5-bit perplexity moved between +1.4%% and +3.8%% by seed alone")
    p.add_argument("--stepwise", action="store_true",
                   help="score one decode step at a time through the caches (what the default "
                        "replays in one forward; ~10x slower)")
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    a = p.parse_args(argv)
    if a.quick:
        a.passages, a.prefill, a.tokens, a.bits, a.quantizers = 1, 512, 32, "3.5", "scalar"
    if a.seeds < 1:
        p.error("--seeds: at least 1")
    schemes, quantizers, key_means = a.schemes.split(","), a.quantizers.split(","), a.key_mean.split(",")
    if set(schemes) - set(SCHEMES[1:]) or set(quantizers) - set(QUANTIZERS) or set(key_means) - set(KEY_MEANS):
        p.error(f"--schemes from {', '.join(SCHEMES[1:])}; --quantizers from {', '.join(QUANTIZERS)}; "
                f"--key-mean from {', '.join(KEY_MEANS)}")

    from pipeline.models.load import load_model

    t0 = time.perf_counter()
    loaded = load_model(None)  # also prepares the built-in model once, before the workers load it
    ids = passages(loaded.tokenizer, a.passages, a.prefill + a.tokens)
    name = loaded.name
    del loaded
    configs = default_configs(a.window, [float(b) for b in a.bits.split(",")], schemes, quantizers, key_means)
    print(f"model: {name} (float32 on CPU); {a.passages} passages of pydoc_data.topics "
          f"{list(TOPICS[:a.passages])}: {a.prefill} history + {a.tokens} scored tokens each; "
          f"prefill chunk {a.chunk}; {a.seeds} rotation seed(s); "
          f"scored {'one decode step at a time' if a.stepwise else 'in one replayed forward'}; "
          f"{a.workers} worker process(es), OpenBLAS on 1 thread each", flush=True)
    results = evaluate_in_workers(None, ids, a.prefill, configs, workers=a.workers, chunk=a.chunk,
                                  stepwise=a.stepwise, seeds=a.seeds, log=lambda s: print(s, flush=True))
    print()
    print(format_table(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s on {platform.machine()} CPU")
    if a.json:
        print(json.dumps({"topics": list(TOPICS[:a.passages]), "prefill": a.prefill, "tokens": a.tokens,
                          "chunk": a.chunk, "window": a.window, "stepwise": a.stepwise, "seeds": a.seeds,
                          "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
