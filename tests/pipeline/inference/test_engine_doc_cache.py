"""Engine + document-cache store: a hit skips the prefill and answers exactly as a fresh one."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from pipeline.inference.doc_cache import DocCacheStore, DocKey
from pipeline.inference.engine import Engine
from pipeline.inference.prompt import DocumentPrompt
from pipeline.schema.job import CacheSpec, TaskSpec
from test_engine import FakeTokenizer, Loaded  # noqa: E402  (the engine tests' stand-ins)

VOCAB = 96
TASKS = [TaskSpec(name="a", prompt="x", max_tokens=6), TaskSpec(name="bb", prompt="y", max_tokens=5)]


def tiny_llama(seed: int = 0, **overrides) -> Loaded:
    mx.random.seed(seed)
    args = llama.ModelArgs(**{
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "tie_word_embeddings": False, **overrides,
    })
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return Loaded(model=model, tokenizer=FakeTokenizer())


def make_prompt(n_doc: int) -> DocumentPrompt:
    return DocumentPrompt(
        prefix_ids=[(7 * i + 3) % (VOCAB - 2) + 2 for i in range(n_doc)],
        task_ids={t.name: [(11 * j + len(t.name)) % (VOCAB - 2) + 2 for j in range(4 + len(t.name))] for t in TASKS},
        page_offsets={1: 0}, included_pages=[1], skipped_pages=[],
    )


def key_for(prompt: DocumentPrompt, spec: CacheSpec) -> DocKey:
    return DocKey(content_hash="sha256:d0c", pages=None, model={"name": "test:tiny-llama"},
                  cache=spec.model_dump(mode="json"), context={"images": "auto"})


SPECS = [
    CacheSpec(kv_quant_scheme="turboquant", kv_bits=3.5, window=16, prefill_chunk=32),
    CacheSpec(kv_quant_scheme="turboquant", kv_bits=2.5, window=0, prefill_chunk=40),
    CacheSpec(kv_quant_scheme="fp16", prefill_chunk=32),
    CacheSpec(kv_quant_scheme="affine", kv_bits=8, prefill_chunk=32),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kv_quant_scheme}-{s.kv_bits}")
def test_hit_skips_the_prefill_and_matches_a_fresh_prefill(tmp_path, spec):
    loaded, prompt = tiny_llama(), make_prompt(150)
    key = key_for(prompt, spec)
    fresh = Engine(loaded, spec).process(prompt, TASKS)  # no store at all

    first = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    stored = first.process(prompt, TASKS, key=key)
    assert first.prefill_count == 1 and first.cache_loads == 0
    assert stored[0].cache["doc_cache"]["hit"] is False and stored[0].cache["doc_cache"]["saved"] is True

    second = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    forwarded_before = second.tokens_forwarded
    cached = second.process(prompt, TASKS, key=key)
    assert second.prefill_count == 0 and second.cache_loads == 1
    assert second.tokens_forwarded - forwarded_before < len(prompt.prefix_ids)  # only task tokens
    for f, s, c in zip(fresh, stored, cached):
        assert f.token_ids == s.token_ids == c.token_ids and len(c.token_ids) > 0
        assert c.cache["doc_cache"]["hit"] is True and c.cache["doc_cache"]["load_s"] >= 0
        assert c.timing["prefill_s"] == 0.0
        if spec.kv_quant_scheme == "turboquant":  # counts used bytes: the same tokens, the same bytes
            assert c.cache["nbytes_after_prefill"] == f.cache["nbytes_after_prefill"]
        else:  # counts allocated bytes: a loaded cache has no spare capacity yet
            assert 0 < c.cache["nbytes_after_prefill"] <= f.cache["nbytes_after_prefill"]


def test_no_key_means_no_store_use(tmp_path):
    spec = SPECS[0]
    engine = Engine(tiny_llama(), spec, store=DocCacheStore(tmp_path))
    (res,) = engine.process(make_prompt(60), TASKS[:1])
    assert "doc_cache" not in res.cache and list(tmp_path.iterdir()) == []


def test_a_cache_of_other_layer_types_is_a_miss(tmp_path, caplog):
    prompt = make_prompt(80)
    tq, fp16 = SPECS[0], SPECS[2]
    key = key_for(prompt, tq)
    Engine(tiny_llama(), fp16, store=DocCacheStore(tmp_path)).process(prompt, TASKS[:1], key=key)  # wrong content
    engine = Engine(tiny_llama(), tq, store=DocCacheStore(tmp_path))
    engine.process(prompt, TASKS[:1], key=key)
    assert engine.cache_loads == 0 and engine.prefill_count == 1
    assert "not the ones this model and cache spec build" in caplog.text
    again = Engine(tiny_llama(), tq, store=DocCacheStore(tmp_path))  # the bad entry was replaced
    again.process(prompt, TASKS[:1], key=key)
    assert again.cache_loads == 1 and again.prefill_count == 0


def test_an_entry_saved_in_an_older_cache_format_is_a_miss_and_replaced(tmp_path, monkeypatch, caplog):
    """A document cache written by a tqpipe whose TurboQuant layers meant
    something else (turboquant.cache.FORMAT) is prefilled afresh, never misread."""
    import turboquant.cache as tq_cache

    prompt, spec = make_prompt(80), SPECS[0]
    key = key_for(prompt, spec)
    fresh = Engine(tiny_llama(), spec).process(prompt, TASKS[:1])
    monkeypatch.setattr(tq_cache, "FORMAT", "tqcache-4")
    Engine(tiny_llama(), spec, store=DocCacheStore(tmp_path)).process(prompt, TASKS[:1], key=key)
    monkeypatch.undo()
    engine = Engine(tiny_llama(), spec, store=DocCacheStore(tmp_path))
    got = engine.process(prompt, TASKS[:1], key=key)
    assert engine.cache_loads == 0 and engine.prefill_count == 1
    assert "tqcache-4" in caplog.text and got[0].token_ids == fresh[0].token_ids
    again = Engine(tiny_llama(), spec, store=DocCacheStore(tmp_path))  # the old entry was replaced
    again.process(prompt, TASKS[:1], key=key)
    assert again.cache_loads == 1 and again.prefill_count == 0


def test_tasks_after_a_hit_extend_the_loaded_cache_without_touching_the_file(tmp_path):
    spec, prompt = SPECS[0], make_prompt(200)
    key = key_for(prompt, spec)
    store = DocCacheStore(tmp_path)
    Engine(tiny_llama(), spec, store=store).process(prompt, TASKS[:1], key=key)
    before = store.path_for(key).read_bytes()
    engine = Engine(tiny_llama(), spec, store=store)
    a = engine.process(prompt, TASKS, key=key)
    b = engine.process(prompt, TASKS, key=key)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and engine.cache_loads == 2
    assert store.path_for(key).read_bytes() == before


@pytest.mark.parametrize("spec", [
    CacheSpec(kv_quant_scheme="turboquant", kv_bits=3.5, window=16, prefill_chunk=32),
    CacheSpec(kv_quant_scheme="fp16", prefill_chunk=32),  # mlx-vlm's KVCache
    CacheSpec(kv_quant_scheme="affine", kv_bits=4, prefill_chunk=32),  # mlx-vlm's QuantizedKVCache
], ids=["turboquant", "fp16", "affine"])
def test_vlm_with_page_images_and_mrope_positions_loads_exactly(tmp_path, tiny_vlm_model, spec):
    """Page images are merged during the prefill only; a loaded cache must also
    bring back the multimodal position offset (pos_delta) the tasks continue
    from, and mlx-vlm's own caches their meta_state."""
    from PIL import Image

    from pipeline.inference.prompt import PromptBuilder
    from pipeline.inputs.discover import DocumentRef
    from pipeline.inputs.document import Document, Page
    from pipeline.schema.job import ContextSpec

    pages = [
        Page(1, "Harbor report. Revenue grew by 12 percent in the third quarter.", None, False),
        Page(2, "", Image.new("RGB", (56, 84), (180, 40, 40)), True),
        Page(3, "Total dredging cost 1250 EUR, approved by Ada Lovelace.", None, False),
    ]
    doc = Document(ref=DocumentRef(source=tmp_path / "d.pdf", kind="pdf", doc_id="d.pdf"),
                   content_hash="sha256:0", page_count=3, pages=pages)
    loaded = tiny_vlm_model
    prompt = PromptBuilder(loaded.tokenizer, processor=loaded.processor, kind="vlm").build(doc, ContextSpec(), TASKS)
    assert prompt.n_images == 1
    first = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    key = first.document_key("sha256:0", ContextSpec(), reads_images=True)
    fresh = first.process(prompt, TASKS, key=key)
    again = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    cached = again.process(prompt, TASKS, key=key)
    assert again.cache_loads == 1 and again.prefill_count == 0
    assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
    (entry,) = DocCacheStore(tmp_path).entries()
    assert entry.info["pos_delta"] not in (None, 0) and entry.info["pos_ndim"] == 3


def test_time_before_the_first_task_is_counted_in_prefill_or_load(tmp_path, monkeypatch):
    """A task's time to first token is ``prefill_s`` (or the store's
    ``load_s``) + ``task_prefill_s``: the settle before the first task (the
    document's tail quantized) counts as prefill, and the reserve and
    evaluation that put a loaded cache in place count as its load."""
    import time

    from turboquant.cache import TurboQuantKVCache

    spec = SPECS[0]
    loaded, prompt = tiny_llama(), make_prompt(150)
    key = key_for(prompt, spec)
    real_settle, real_reserve = TurboQuantKVCache.settle, TurboQuantKVCache.reserve

    def slow_settle(self):
        time.sleep(0.25)  # well above this prefill's own time
        return real_settle(self)

    monkeypatch.setattr(TurboQuantKVCache, "settle", slow_settle)
    engine = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    state = engine.prepare(prompt, reserve=64, key=key)  # prefilled, settled and stored
    assert state.settled and state.prefill_s >= 2 * 0.25  # two layers
    first = engine.run_task(state, TASKS[0], prompt.task_ids["a"])
    assert first.timing["prefill_s"] == round(state.prefill_s, 4)

    def slow_reserve(self, n):
        time.sleep(0.05)
        return real_reserve(self, n)

    monkeypatch.setattr(TurboQuantKVCache, "reserve", slow_reserve)
    again = Engine(loaded, spec, store=DocCacheStore(tmp_path))
    hit_state = again.load_cached(prompt, key, reserve=64)
    assert hit_state.settled and hit_state.prefill_s == 0.0
    assert hit_state.doc_cache["load_s"] >= 2 * 0.05
    result = again.run_task(hit_state, TASKS[0], prompt.task_ids["a"])
    assert result.timing["prefill_s"] == 0.0 and result.token_ids == first.token_ids
