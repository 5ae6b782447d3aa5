"""Smoke runs of the model-level benchmarks on tiny configs.

They check that the numbers the benchmarks print come from real
measurements: memory figures from a fresh process per cache that match the
cache's known size, quality metrics that are exactly 1.0 / 0.0 when a config
is compared with itself and move when the cache really quantizes.
"""

import math
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from benchmarks import memory, needle, quality

TINY_MEMORY = dict(memory.KV_HEAVY_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=128)


# ------------------------------------------------------------------ memory
@pytest.mark.slow
def test_memory_workers_measure_their_own_process():
    opts = dict(tokens=600, chunk=256, decode=4, model_args=TINY_MEMORY)
    full = memory.measure_in_subprocess("fp16", **opts)
    tq = memory.measure_in_subprocess("turboquant", **opts)
    # The float32 cache grows in 256-token steps: 600 document + 4 task + 3
    # decode tokens sit in 768 slots, keys and values, 2 layers x 2 heads x 64.
    assert full["kv_bytes"] == 768 * 2 * 2 * 64 * 4 * 2
    assert full["generated"] == tq["generated"] == 4
    for r in (full, tq):
        # a process high-water mark holds at least the weights and the cache at once
        assert r["peak_bytes"] >= r["weights_bytes"] + r["kv_bytes"]
        assert r["maxrss_bytes"] >= r["loaded_maxrss_bytes"] > 0
    assert full["weights_bytes"] == tq["weights_bytes"]
    assert tq["kv_bytes"] < full["kv_bytes"] / 2
    cmp = memory.compare(full, tq)
    assert cmp["ratio_peak"] == pytest.approx(
        (full["peak_bytes"] - tq["peak_bytes"]) / (full["kv_bytes"] - tq["kv_bytes"])
    )


def test_memory_compare_formulas():
    full = {"kv_bytes": 600, "peak_bytes": 1000, "maxrss_bytes": 2000, "loaded_active_bytes": 100}
    tq = {"kv_bytes": 100, "peak_bytes": 300, "maxrss_bytes": 1600}
    cmp = memory.compare(full, tq)
    assert cmp["ratio_peak"] == pytest.approx(700 / 500)
    assert cmp["ratio_maxrss"] == pytest.approx(400 / 500)
    assert cmp["kv_compression"] == pytest.approx(6.0)
    # fp16 baseline: cache 300 B; estimate peak 1000 - 300, lower bound 100 + 900 / 2
    assert cmp["fp16_ratio_peak_estimate"] == pytest.approx((700 - 300) / 200)
    assert cmp["fp16_ratio_peak_lower_bound"] == pytest.approx((550 - 300) / 200)
    with pytest.raises(ValueError, match="no KV saving"):
        memory.compare(full, dict(tq, kv_bytes=600))


# ----------------------------------------------------------------- quality
class CharTokenizer:
    """One token per character (codes < 128), with a minimal chat template."""

    eos_token_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 128 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def tiny_lm():
    from mlx_lm.models import llama

    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=128, tie_word_embeddings=True))
    # x2 weights: greedy output then depends on the context (at the default
    # init scale the tiny model repeats one token whatever it reads)
    model.update(tree_map(lambda w: 2 * w, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def test_needle_prompt_places_the_fact_at_its_depth():
    tok = CharTokenizer()
    for depth in (0.1, 0.9):
        p = needle.make_needle_prompt(tok, 1200, depth, seed=5)
        text = tok.decode(p.ids)
        assert len(p.ids) >= 1200
        assert text.endswith("Answer with the number only.<assistant>")
        pos = text.index(f"vault is {p.answer}.")
        assert abs(pos / len(text) - depth) < 0.1
    assert needle.make_needle_prompt(tok, 500, 0.5, seed=1).ids == needle.make_needle_prompt(tok, 500, 0.5, seed=1).ids


def test_compare_is_exact_for_identical_and_matches_hand_kl():
    a = mx.log(mx.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    assert needle.compare(a, a) == (1.0, 0.0)
    b = mx.log(mx.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    top1, kl = needle.compare(a, b)
    assert top1 == 0.5
    assert kl == pytest.approx((0.5 * math.log(2) + 0.25 * math.log(0.5)) / 2, rel=1e-5)


def test_evaluate_fp16_against_itself_and_quantized(tiny_lm):
    tok = CharTokenizer()
    prompts = [needle.make_needle_prompt(tok, 300, d, seed=i) for i, d in enumerate((0.2, 0.8))]
    configs = [
        needle.CacheConfig("fp16", "fp16"),
        needle.CacheConfig("fp16 again", "fp16"),
        needle.CacheConfig("ours, window covers all", "turboquant", 4, 4096),
        needle.CacheConfig("ours 2.5, window 0", "turboquant", 2.5, 0),
        needle.CacheConfig("mlx-vlm 2.5", "mlx-vlm", 2.5),
        needle.CacheConfig("affine 4", "affine", 4),
    ]
    res = {r.label: r for r in needle.evaluate(tiny_lm, tok, prompts, configs, chunk=64,
                                                answer_tokens=4, continuation=6)}
    ref, again = res["fp16"], res["fp16 again"]
    assert (ref.top1, ref.kl) == (1.0, 0.0)
    assert (again.top1, again.kl, again.answers) == (1.0, 0.0, ref.answers)
    # nothing quantized: only float rounding between two attention implementations
    assert res["ours, window covers all"].top1 == 1.0
    assert res["ours, window covers all"].kl < 1e-5
    for label in ("ours 2.5, window 0", "mlx-vlm 2.5", "affine 4"):
        r = res[label]
        assert 1e-6 < r.kl < 10 and 0.0 <= r.top1 <= 1.0, label
        assert 0 < r.kv_bytes < ref.kv_bytes, label
    # same widths, same token count: ours at window 0 holds what mlx-vlm holds
    # (+ centring means, the last token and the attention sinks exact: float32
    # keys and values of 2 layers x 1 kv head x 64 dims each), not its reserved capacity
    from turboquant.policy import SINK_TOKENS

    ours, peer = res["ours 2.5, window 0"].kv_bytes, res["mlx-vlm 2.5"].kv_bytes
    assert abs(ours - SINK_TOKENS * 2 * 64 * 2 * 4 - peer) / peer < 0.1
    assert "|" in needle.format_table(list(res.values()))


def test_evaluate_requires_fp16_reference_first(tiny_lm):
    with pytest.raises(ValueError, match="first config must be the fp16 reference"):
        needle.evaluate(tiny_lm, CharTokenizer(), [], [needle.CacheConfig("x", "affine", 4)])


@pytest.mark.parametrize("config", [needle.CacheConfig("ours", "turboquant", 2.5, 16),
                                    needle.CacheConfig("peer", "mlx-vlm", 2.5)])
def test_greedy_answer_after_teacher_forcing_matches_a_fresh_greedy_run(tiny_lm, config):
    """The answer run_prompt reports (resumed after rewinding the teacher-forced
    pass where they part) is what plain greedy decoding of a fresh prefill gives."""
    tok = CharTokenizer()
    prompt = needle.make_needle_prompt(tok, 200, 0.5, seed=2)
    cache = config.build(tiny_lm)
    fresh, _ = needle.greedy(tiny_lm, cache, needle.prefill(tiny_lm, cache, prompt.ids, 64), 12, set())
    # a reference that parts from this config's greedy path at token 3
    forced = fresh[:3] + [(fresh[3] + 1) % 128] + fresh[4:]
    run, _ = needle.run_prompt(tiny_lm, tok, config, prompt, forced, chunk=64, answer_tokens=12,
                                continuation=12, eos=set())
    assert run.answer_text == tok.decode(fresh)
    assert run.logprobs.shape == (12, 128)


@pytest.mark.parametrize("config", [needle.CacheConfig("ours", "turboquant", 3, 16),
                                    needle.CacheConfig("peer", "mlx-vlm", 3),
                                    needle.CacheConfig("affine", "affine", 4)])
def test_rewind_gives_back_the_prefilled_cache(tiny_lm, config):
    tok = CharTokenizer()
    prompt = needle.make_needle_prompt(tok, 200, 0.5, seed=4)
    cache = config.build(tiny_lm)
    needle.prefill(tiny_lm, cache, prompt.ids, 64)
    snap = needle._snapshot(cache)
    for t in range(40, 60):  # pushes our window's tokens into packed storage
        needle.step(tiny_lm, cache, t)
    needle._rewind(cache, snap)
    fresh = config.build(tiny_lm)
    needle.prefill(tiny_lm, fresh, prompt.ids, 64)
    assert mx.allclose(needle.step(tiny_lm, cache, 7), needle.step(tiny_lm, fresh, 7), atol=1e-5)


def test_default_configs_put_fp16_first_and_filter_schemes():
    full = needle.default_configs(128)
    assert full[0].scheme == "fp16"
    assert len(full) == 1 + 2 + 4 * 3
    some = needle.default_configs(64, [3.5], ["mlx-vlm", "turboquant"])
    assert [(c.scheme, c.bits, c.window) for c in some] == [
        ("fp16", None, None), ("mlx-vlm", 3.5, None), ("turboquant", 3.5, 64), ("turboquant", 3.5, 0)]


# ------------------------------------------------------------------ GPU attention timing


def test_chained_timing_feeds_each_output_to_the_next_call():
    """``chain ms`` must time dependent calls (a model's layers), not a batch
    that the GPU may run side by side: each call gets the previous output."""
    from benchmarks import gpu_attention

    seen = []

    def step(x, c):
        seen.append(x)
        return x + c

    t = gpu_attention.timeit_chain(step, mx.array(0.0), [mx.array(1.0), mx.array(2.0)], batch=4, repeats=2)
    assert t > 0 and len(seen) == 3 * 4  # warm-up + 2 timed chains of 4 calls
    assert [float(x) for x in seen[:4]] == [0.0, 1.0, 3.0, 4.0]


def test_generation_timing_chains_layers_and_tokens():
    """The generation-loop timing must chain every call, across tokens too
    (token t + 1 starts from token t's output, as a model's next token does),
    cycling through the caches layer by layer."""
    from benchmarks import gpu_attention

    seen = []

    def step(x, c):
        seen.append((float(x), float(c)))
        return x + c

    stats = {}
    t = gpu_attention.timeit_generation(step, mx.array(0.0), [mx.array(1.0), mx.array(2.0)],
                                        layers=3, tokens=2, warm=1, stats=stats)
    assert t > 0 and len(seen) == (1 + 2) * 3  # warm-up token + 2 timed tokens, 3 layers each
    assert 0 < stats["host"] <= t  # building and submitting is part of the loop's time
    assert [c for _, c in seen] == [1.0, 2.0, 1.0] * 3
    xs = [x for x, _ in seen]
    assert xs == [0.0, 1.0, 3.0, 4.0, 5.0, 7.0, 8.0, 9.0, 11.0]


def test_synthetic_cache_runs_through_the_attention_entry_point():
    """The benchmark's stand-in cache answers everything ``turboquant_attention``
    asks of a cache (on CPU the reference route reads it): a missing member
    would only show on the lent GPU."""
    from benchmarks import gpu_attention

    c = gpu_attention.tq_cache(64, 3.5)
    q = mx.random.normal((1, 4 * gpu_attention.HKV, 1, gpu_attention.D)).astype(mx.float16)
    out = gpu_attention.whole_step(gpu_attention.window_keys())(q, c)
    mx.eval(out)
    assert out.shape == q.shape and bool(mx.all(mx.isfinite(out)))


# ------------------------------------------------------------ quality on real text
def test_real_text_passages_come_from_the_stdlib_reference_manual():
    tok = CharTokenizer()
    texts = quality.passages(tok, 2, 3000)
    assert [len(t) for t in texts] == [3000, 3000] and texts[0] != texts[1]
    from pydoc_data.topics import topics

    assert tok.decode(texts[0]) == "".join(chr(ord(c) % 128) for c in topics[quality.TOPICS[0]][:3000])


def test_quality_scores_float32_against_itself_and_quantized(tiny_lm):
    """float32 is exactly itself (KL 0, top-1 1, perplexity change 0) and
    its bytes are the float32 K/V of the tokens held; a window covering all
    tokens quantizes nothing; window 0 really quantizes, in fewer bytes."""
    tok = CharTokenizer()
    ids = mx.array(quality.passages(tok, 2, 300 + 12), dtype=mx.int32)
    configs = [
        quality.CacheConfig("float32", "fp16"),
        quality.CacheConfig("float32 again", "fp16"),
        quality.CacheConfig("ours, window covers all", "turboquant", 3.5, 4096),
        quality.CacheConfig("ours 2.5, window 0", "turboquant", 2.5, 0),
        quality.CacheConfig("ours 2.5 tcq, window 0", "turboquant", 2.5, 0, "tcq"),
        quality.CacheConfig("mlx-vlm 2.5", "mlx-vlm", 2.5),
        quality.CacheConfig("affine 2", "affine", 2),
    ]
    res = {r.label: r for r in quality.evaluate(tiny_lm, ids, 300, configs, chunk=64)}
    ref = res["float32"]
    assert (ref.kl, ref.top1, ref.ppl_change) == (0.0, 1.0, 0.0) and len(ref.ppl) == 2
    assert ref.ppl_change_interval == [0.0, 0.0] and ref.kl_interval == [0.0, 0.0]
    again = res["float32 again"]
    assert (again.kl, again.top1, again.ppl) == (0.0, 1.0, ref.ppl)
    # 2 layers x 1 kv head x 64 dims x (K + V) x 4 bytes per token held
    assert ref.bytes_per_token == 2 * 1 * 64 * 2 * 4
    assert res["ours, window covers all"].kl < 1e-5
    for label in ("ours 2.5, window 0", "ours 2.5 tcq, window 0", "mlx-vlm 2.5", "affine 2"):
        r = res[label]
        assert 1e-6 < r.kl < 10 and 0.0 <= r.top1 <= 1.0, label
        assert r.kl_interval[0] <= r.kl <= r.kl_interval[1] and r.kl_interval[0] < r.kl_interval[1], label
        assert 0 < r.bytes_per_token < ref.bytes_per_token / 4, label
    assert "|" in quality.format_table(list(res.values()))
    with pytest.raises(ValueError, match="first config must be the float32 reference"):
        quality.evaluate(tiny_lm, ids, 300, configs[2:])


def test_quality_rows_by_key_mean_are_caches_as_each_machine_makes_them(tiny_lm):
    """``--key-mean`` rows: the default centres keys on the pre-RoPE mean
    turned per token (CPU), ``blocks`` on its average per block of packed
    tokens (what GPU caches are), ``constant`` on one mean (no rotary); all
    really quantize and the JSON rows say which they are."""
    configs = quality.default_configs(64, [3.5], ["turboquant"], ["scalar"], ["turned", "blocks", "constant"])
    assert [(c.label, c.window, c.key_mean) for c in configs[1:]] == [
        ("tqpipe 3.5 scalar, window 0", 0, "turned"), ("tqpipe 3.5 scalar, window 0, block key mean", 0, "blocks"),
        ("tqpipe 3.5 scalar, window 0, constant key mean", 0, "constant"),
        ("tqpipe 3.5 scalar, window 64", 64, "turned"), ("tqpipe 3.5 scalar, window 64, block key mean", 64, "blocks"),
        ("tqpipe 3.5 scalar, window 64, constant key mean", 64, "constant")]
    configs = configs[:4]  # float32 and the window-0 rows
    assert all(c.key_mean == "turned" for c in quality.default_configs(128, [3.5])[1:] if c.scheme == "turboquant")
    ids = mx.array(quality.passages(CharTokenizer(), 2, 300 + 12), dtype=mx.int32)
    turned, blocks, constant = (c.build(tiny_lm) for c in configs[1:])
    ref = quality.float_prefill(tiny_lm, ids[:, :300], 64)
    for caches in (turned, blocks, constant):
        quality.fill(caches, ref, 64)
    assert all(c.rotary is not None and c.key_mean_pre is not None and not c.mean_blocks for c in turned)
    assert all(c.rotary is not None and c.key_mean_pre is not None and c.mean_blocks for c in blocks)
    assert all(c.rotary is None and c.key_mean_pre is None and c.key_mean is not None for c in constant)
    res = {r.label: r for r in quality.evaluate(tiny_lm, ids, 300, configs, chunk=64)}
    a, b, c = (res[f"tqpipe 3.5 scalar, window 0{x}"] for x in ("", ", block key mean", ", constant key mean"))
    assert (a.key_mean, b.key_mean, c.key_mean, res["float32"].key_mean) == ("turned", "blocks", "constant", "")
    assert all(1e-6 < r.kl < 10 for r in (a, b, c)) and len({a.kl, b.kl, c.kl}) == 3


def test_replayed_teacher_forcing_reads_what_decode_steps_read(tiny_lm):
    """One replayed forward scores the tokens as one decode step each would:
    the caches end in the same state (offsets, packed and exact tokens,
    bytes, the packed codes themselves) and the log-probs agree, for caches
    that quantize every token they get and for ours with the exact window
    off and on (window 8 packs in batches of 4 during the scored tokens)."""
    ids = mx.array(quality.passages(CharTokenizer(), 2, 300 + 24), dtype=mx.int32)
    history = quality.float_prefill(tiny_lm, ids[:, :300], 64)
    targets = ids[:, 300:]
    configs = [quality.CacheConfig("float32", "fp16"), quality.CacheConfig("affine 4", "affine", 4),
               quality.CacheConfig("ours, window 0", "turboquant", 3.5, 0),
               quality.CacheConfig("ours, window 8", "turboquant", 3.5, 8),
               quality.CacheConfig("ours tcq, window 0", "turboquant", 2.5, 0, "tcq"),
               quality.CacheConfig("ours, window 8, constant mean", "turboquant", 3.5, 8, "scalar", "constant"),
               quality.CacheConfig("ours, window 0, block mean", "turboquant", 3.5, 0, "scalar", "blocks"),
               quality.CacheConfig("mlx-vlm 3.5", "mlx-vlm", 3.5)]
    for config in configs:
        runs = []
        for score_fn in (quality.teacher_forced_stepwise, quality.teacher_forced):
            caches = config.build(tiny_lm)
            quality.fill(caches, history, 64)
            runs.append((score_fn(tiny_lm, caches, history.first, targets), caches))
        (lp_steps, steps), (lp_replay, replay) = runs
        assert lp_replay.shape == lp_steps.shape == (2, 24, 128)
        assert mx.allclose(lp_replay, lp_steps, atol=1e-3).item(), config.label
        assert quality.kv_bytes(replay) == quality.kv_bytes(steps), config.label
        assert [c.offset for c in replay] == [c.offset for c in steps] == [323, 323]
        if config.scheme == "turboquant":
            assert [(c.packed_len, c.window_len) for c in replay] == [(c.packed_len, c.window_len) for c in steps]
            # the first layer's keys do not depend on attention: same codes bit for bit
            a, b = replay[0], steps[0]
            assert mx.array_equal(a.keys_packed[:, :, :a.packed_len], b.keys_packed[:, :, :b.packed_len]).item()
    # window 0 packs all but the newest token; window 8 keeps 9-12 exact (it packs 4 at a time)
    w0, w8 = (c.build(tiny_lm) for c in configs[2:4])
    for caches in (w0, w8):
        quality.fill(caches, history, 64)
        quality.teacher_forced(tiny_lm, caches, history.first, targets)
    assert w0[0].window_len - w0[0].sink_len == 1 and 8 < w8[0].window_len - w8[0].sink_len <= 12


@pytest.mark.slow
def test_quality_rows_in_workers_do_not_depend_on_the_worker_count(tmp_path):
    """Spawned workers (one OpenBLAS thread each) load the model from its
    path and give the same rows, in config order, whether 1 or 2 score them."""
    import sys
    from dataclasses import asdict
    from pathlib import Path

    from pipeline.models.load import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from build_model import build

    model_dir = str(build(tmp_path / "m", "tiny", dtype="float32", tokenizer_vocab=600))
    ids = quality.passages(load_model(model_dir).tokenizer, 2, 200 + 8)
    configs = [quality.CacheConfig("float32", "fp16"),
               quality.CacheConfig("ours 2.5, window 0", "turboquant", 2.5, 0),
               quality.CacheConfig("affine 4", "affine", 4)]
    runs = [quality.evaluate_in_workers(model_dir, ids, 200, configs, workers=n, chunk=64) for n in (1, 2)]
    for results in runs:
        assert [r.label for r in results] == [c.label for c in configs]
        assert (results[0].kl, results[0].top1) == (0.0, 1.0) and results[1].kl > 1e-6

    def rows(results):
        return [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in results]

    assert rows(runs[0]) == rows(runs[1])
    seeded = quality.evaluate_in_workers(model_dir, ids, 200, configs, workers=2, chunk=64, seeds=2)
    assert [r.seeds for r in seeded] == [1, 2, 1] and seeded[2].kl == runs[0][2].kl
    assert seeded[1].ppl_change_per_seed[0] == runs[0][1].ppl_change
    assert seeded[1].ppl_change_per_seed[0] != seeded[1].ppl_change_per_seed[1]
    with pytest.raises(ValueError, match="first config must be the float32 reference"):
        quality.evaluate_in_workers(model_dir, ids, 200, configs[1:], workers=1)
    from concurrent.futures.process import BrokenProcessPool

    with pytest.raises(BrokenProcessPool):  # a model that does not load: an error, not a pool restarting it
        quality.evaluate_in_workers(str(tmp_path / "no-model"), ids, 200, configs, workers=1)


def test_quality_default_configs_cover_widths_windows_quantizers():
    full = quality.default_configs(128)
    assert full[0].scheme == "fp16"
    assert len(full) == 1 + 4 * (1 + 2 * 2) + 2
    assert {(c.window, c.quantizer) for c in full if c.scheme == "turboquant"} == {
        (0, "scalar"), (128, "scalar"), (0, "tcq"), (128, "tcq")}
    assert [c.bits for c in full if c.scheme == "affine"] == [4, 2]



def test_quality_intervals_are_a_paired_block_bootstrap():
    """Equal caches get a zero-width interval; a constant per-position change
    c gives exactly e^c - 1; on noisy terms the interval holds the point
    estimate and narrows about as 1/sqrt(positions); draws are reproducible."""
    np = pytest.importorskip("numpy")
    zero = np.zeros((3, 256))
    assert quality.intervals(zero, zero) == ([0.0, 0.0], [0.0, 0.0])
    ppl, kl = quality.intervals(np.full((2, 64), 0.05), np.full((2, 64), 0.02))
    assert ppl == pytest.approx([np.expm1(0.05)] * 2) and kl == pytest.approx([0.02, 0.02])
    rng = np.random.default_rng(1)
    widths = []
    for T in (256, 4096):
        d = rng.normal(0.03, 0.5, size=(3, T))
        k = rng.exponential(0.02, size=(3, T))
        (lo, hi), (klo, khi) = quality.intervals(d, k)
        point = np.mean(np.expm1(d.mean(axis=1)))
        assert lo < point < hi and klo < k.mean() < khi
        widths.append(hi - lo)
        assert quality.intervals(d, k) == ([lo, hi], [klo, khi])
    assert 2.5 < widths[0] / widths[1] < 6.5  # sqrt(16) = 4


def test_quality_seeds_average_each_rotating_cache_position_by_position(tiny_lm):
    """``seeds=2``: a rotating cache's row is its seed-0 and seed-1 runs
    averaged per position (KL and top-1 their mean, perplexity their
    geometric mean, per-seed changes kept); a cache with no rotation runs once."""
    np = pytest.importorskip("numpy")
    ids = mx.array(quality.passages(CharTokenizer(), 2, 300 + 12), dtype=mx.int32)
    ours = quality.CacheConfig("ours 2.5, window 0", "turboquant", 2.5, 0)
    peer = quality.CacheConfig("mlx-vlm 2.5", "mlx-vlm", 2.5)
    affine = quality.CacheConfig("affine 2", "affine", 2)
    base = [quality.CacheConfig("float32", "fp16")]
    assert [len(g) for g in quality.seeded([ours, peer, affine], 3)] == [3, 3, 1]
    assert [c.seed for c in quality.seeded([replace(ours, seed=5)], 2)[0]] == [5, 6]  # from the config's own seed
    avg = {r.label: r for r in quality.evaluate(tiny_lm, ids, 300, base + [ours, peer, affine], chunk=64, seeds=2)}
    one = [{r.label: r for r in quality.evaluate(tiny_lm, ids, 300, base + [replace(c, seed=s) for c in (ours, peer)],
                                                 chunk=64)} for s in (0, 1)]
    for label in (ours.label, peer.label):
        a, r0, r1 = avg[label], one[0][label], one[1][label]
        assert a.seeds == 2 and a.ppl_change_per_seed == pytest.approx([r0.ppl_change, r1.ppl_change])
        assert r0.kl != r1.kl and a.kl == pytest.approx((r0.kl + r1.kl) / 2)
        assert a.top1 == pytest.approx((r0.top1 + r1.top1) / 2)
        assert a.ppl == pytest.approx(list(np.sqrt(np.array(r0.ppl) * np.array(r1.ppl))))
    assert avg[affine.label].seeds == 1 and avg[affine.label].ppl_change_per_seed == [avg[affine.label].ppl_change]


def test_quality_help_renders(capsys):
    """argparse formats help strings with %: a bare percent sign there breaks --help."""
    with pytest.raises(SystemExit) as e:
        quality.main(["--help"])
    assert e.value.code == 0 and "--seeds" in capsys.readouterr().out
