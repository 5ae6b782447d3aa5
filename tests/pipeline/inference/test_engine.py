"""Engine: one chunked prefill per document, every task reuses it (counted, not assumed)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from pipeline.inference.engine import Engine
from pipeline.inference.prompt import DocumentPrompt
from pipeline.schema.job import CacheSpec, TaskSpec

VOCAB = 96


class Counting(nn.Module):
    """Wraps a layer and counts the token positions it sees."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.positions = 0
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        self.positions += x.shape[1]
        return self.inner(x)

    def as_linear(self, x):
        return self.inner.as_linear(x)


class FakeTokenizer:
    eos_token_ids = {1}

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


@dataclass
class Loaded:
    model: object
    tokenizer: object
    kind: str = "text"
    name: str = "test:tiny-llama"
    processor: object = None
    config: dict = None


def tiny_llama(seed: int = 0, **overrides) -> Loaded:
    mx.random.seed(seed)
    args = llama.ModelArgs(**{
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "tie_word_embeddings": False, **overrides,
    })
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    model.model.embed_tokens = Counting(model.model.embed_tokens)
    model.lm_head = Counting(model.lm_head)
    return Loaded(model=model, tokenizer=FakeTokenizer())


def make_prompt(n_doc: int, tasks) -> DocumentPrompt:
    doc = [(7 * i + 3) % (VOCAB - 2) + 2 for i in range(n_doc)]  # no EOS inside
    return DocumentPrompt(
        prefix_ids=doc,
        task_ids={t.name: [(11 * j + len(t.name)) % (VOCAB - 2) + 2 for j in range(4 + len(t.name))] for t in tasks},
        page_offsets={1: 0},
        included_pages=[1],
        skipped_pages=[],
    )


TASKS = [
    TaskSpec(name="a", prompt="x", max_tokens=6),
    TaskSpec(name="bb", prompt="y", max_tokens=5),
    TaskSpec(name="ccc", prompt="z", max_tokens=7),
]


def test_three_tasks_prefill_document_once_and_match_fresh_prefill():
    loaded = tiny_llama()
    embed, head = loaded.model.model.embed_tokens, loaded.model.lm_head
    spec = CacheSpec(kv_quant_scheme="fp16", prefill_chunk=16)
    prompt = make_prompt(70, TASKS)
    engine = Engine(loaded, spec, batch_tasks=False)  # one task at a time (batched: test_batched_*)
    results = engine.process(prompt, TASKS)

    assert engine.prefill_count == 1
    # Every token the embedding saw: the document once, plus each task's suffix and fed-back tokens.
    fed_back = engine.decode_forwards
    # the asynchronous loop feeds back every kept token but the last, plus at
    # most one step queued before an EOS was seen
    kept = sum(len(r.token_ids) - (r.finish_reason == "length") for r in results)
    assert kept <= fed_back <= kept + sum(r.finish_reason == "stop" for r in results)
    task_tokens = sum(len(prompt.task_ids[t.name]) for t in TASKS)
    assert embed.positions == 70 + task_tokens + fed_back
    # Chunked: 70 tokens in chunks of 16 -> 5 backbone calls for the document.
    doc_calls = embed.calls - len(TASKS) - fed_back
    assert doc_calls == 5
    # The LM head never saw a document position: one row per decode step only.
    assert head.positions == head.calls == len(TASKS) + fed_back

    for task, res in zip(TASKS, results):
        fresh = Engine(loaded, spec)
        (alone,) = fresh.process(make_prompt(70, [task]), [task])
        assert res.token_ids == alone.token_ids, task.name
        assert res.tokens == {"document": 70, "task_prompt": len(prompt.task_ids[task.name]), "generated": len(res.token_ids)}
        assert res.cache["scheme"] == "fp16" and res.cache["nbytes_after_prefill"] > 0
        assert res.timing["prefill_s"] >= 0 and res.timing["decode_s"] >= 0


def test_chunk_size_does_not_change_greedy_output():
    loaded = tiny_llama(seed=1)
    prompt = make_prompt(50, TASKS[:1])
    a = Engine(loaded, CacheSpec(kv_quant_scheme="fp16", prefill_chunk=7)).process(prompt, TASKS[:1])
    b = Engine(loaded, CacheSpec(kv_quant_scheme="fp16", prefill_chunk=512)).process(prompt, TASKS[:1])
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) > 0


def test_cache_is_rewound_to_document_length_after_each_task():
    loaded = tiny_llama()
    engine = Engine(loaded, CacheSpec(kv_quant_scheme="fp16", prefill_chunk=32))
    prompt = make_prompt(40, TASKS)
    offsets = []
    for _ in engine.iter_process(prompt, TASKS):
        offsets.append(engine.cache[0].offset)
    assert offsets == [40, 40, 40]


def test_eos_stops_generation():
    loaded = tiny_llama()
    engine = Engine(loaded, CacheSpec(kv_quant_scheme="fp16"))
    prompt = make_prompt(20, TASKS[:1])
    (first,) = engine.process(prompt, TASKS[:1])
    engine.eos_ids = {first.token_ids[0]}  # the first greedy token now ends the answer
    (again,) = engine.process(prompt, TASKS[:1])
    assert again.token_ids == [] and again.finish_reason == "stop"
    assert first.finish_reason == "length" and len(first.token_ids) == TASKS[0].max_tokens


def test_temperature_sampling_is_seeded():
    loaded = tiny_llama()
    task = TaskSpec(name="hot", prompt="x", max_tokens=8, temperature=1.5)
    prompt = make_prompt(20, [task])
    a = Engine(loaded, CacheSpec(kv_quant_scheme="fp16"), seed=3).process(prompt, [task])[0]
    b = Engine(loaded, CacheSpec(kv_quant_scheme="fp16"), seed=3).process(prompt, [task])[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


@pytest.mark.parametrize("n_doc", [5, 64])  # shorter than the window (no means yet) and longer
def test_turboquant_cache_reused_across_tasks_matches_fresh_prefill(n_doc):
    loaded = tiny_llama()
    spec = CacheSpec(kv_quant_scheme="turboquant", kv_bits=3, window=8, prefill_chunk=16)
    engine = Engine(loaded, spec)
    prompt = make_prompt(n_doc, TASKS)
    results = engine.process(prompt, TASKS)
    assert engine.prefill_count == 1
    for task, res in zip(TASKS, results):
        (alone,) = Engine(loaded, spec).process(make_prompt(n_doc, [task]), [task])
        assert res.token_ids == alone.token_ids, task.name
        assert res.cache["scheme"] == "turboquant" and res.cache["kv_bits"] == 3
    if n_doc == 64:
        fp16 = Engine(loaded, CacheSpec(kv_quant_scheme="fp16")).process(prompt, TASKS[:1])[0]
        assert 0 < results[0].cache["nbytes_after_prefill"] < fp16.cache["nbytes_after_prefill"]


# -- the real tiny VLM: image features and multimodal RoPE positions ------------

from fixtures_models import *  # noqa: E402,F403


def _vlm_prompt(tiny_vlm_model):
    from PIL import Image

    from pipeline.inference.prompt import PromptBuilder
    from pipeline.inputs.discover import DocumentRef
    from pipeline.inputs.document import Document, Page
    from pipeline.schema.job import ContextSpec

    pages = [
        Page(1, "Harbor report. Revenue grew by 12 percent in the third quarter.", None, False),
        Page(2, "", Image.new("RGB", (56, 84), (180, 40, 40)), True),
        Page(3, "Total dredging cost 1250 EUR, approved by Ada Lovelace.", None, False),
        Page(4, "", Image.new("RGB", (112, 56), (20, 90, 200)), True),
        Page(5, "Appendix: tide tables for June.", None, False),
    ]
    doc = Document(ref=DocumentRef(source=__import__("pathlib").Path("/d.pdf"), kind="pdf", doc_id="d.pdf"),
                   content_hash="sha256:0", page_count=5, pages=pages)
    loaded = tiny_vlm_model
    builder = PromptBuilder(loaded.tokenizer, processor=loaded.processor, kind="vlm")
    return builder.build(doc, ContextSpec(), TASKS)


def test_vlm_chunked_prefill_matches_mlx_vlm_full_forward(tiny_vlm_model):
    """Our chunked backbone prefill + task suffix + one decode step give the same
    logits as mlx-vlm's own single forward pass over the whole prompt."""
    loaded = tiny_vlm_model
    prompt = _vlm_prompt(loaded)
    assert prompt.n_images == 2
    task = TASKS[0]
    # chunks of 4 tokens: shorter than an image's token run, so chunks must stretch around images
    assert any(e - s > 4 for s, e, _ in prompt.image_spans)
    engine = Engine(loaded, CacheSpec(kv_quant_scheme="fp16", prefill_chunk=4))
    state = engine.prefill(prompt)
    suffix = prompt.task_ids[task.name]
    ids = mx.array(suffix, dtype=mx.int32)[None]
    ours = engine._forward(ids, None, engine._positions(state, len(suffix)), logits=True)
    tok = int(mx.argmax(ours, axis=-1).item())
    ours2 = engine._forward(mx.array([[tok]], dtype=mx.int32), None, engine._positions(state, 1), logits=True)

    model = loaded.model
    inputs = dict(prompt.image_inputs)
    pixel_values = inputs.pop("pixel_values")
    full = mx.array(prompt.prefix_ids + suffix + [tok], dtype=mx.int32)[None]
    model.language_model._position_ids = model.language_model._rope_deltas = None
    ref = model(full, pixel_values, **inputs)
    ref = getattr(ref, "logits", ref)
    assert mx.allclose(ours, ref[:, -2, :], atol=1e-4, rtol=1e-4)
    assert mx.allclose(ours2, ref[:, -1, :], atol=1e-4, rtol=1e-4)
    # the mRoPE positions of an image differ from plain offsets: a nonzero delta is exercised
    assert state.pos_delta is not None and state.pos_delta != 0


def test_vlm_three_tasks_one_prefill(tiny_vlm_model):
    prompt = _vlm_prompt(tiny_vlm_model)
    spec = CacheSpec(kv_quant_scheme="turboquant", kv_bits=3.5, window=16, prefill_chunk=32)
    engine = Engine(tiny_vlm_model, spec)
    results = engine.process(prompt, TASKS)
    assert engine.prefill_count == 1
    for task, res in zip(TASKS, results):
        solo = Engine(tiny_vlm_model, spec).process(prompt, [task])[0]
        assert res.token_ids == solo.token_ids


def test_chunks_never_split_a_page_image():
    from pipeline.inference.engine import _chunks

    spans = [(5, 12, {"img": 1}), (20, 22, {"img": 2})]
    chunks = list(_chunks(30, 8, spans))
    assert [(s, e) for s, e, _ in chunks] == [(0, 12), (12, 20), (20, 28), (28, 30)]
    assert [x for _, _, x in chunks] == [[{"img": 1}], [], [{"img": 2}], []]


def test_affine_baseline_also_reuses_one_prefill():
    loaded = tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64 = group size
    spec = CacheSpec(kv_quant_scheme="affine", kv_bits=8, prefill_chunk=16)
    prompt = make_prompt(48, TASKS)
    engine = Engine(loaded, spec)
    results = engine.process(prompt, TASKS)
    assert engine.prefill_count == 1 and results[0].cache["scheme"] == "affine"
    for task, res in zip(TASKS, results):
        assert res.token_ids == Engine(loaded, spec).process(make_prompt(48, [task]), [task])[0].token_ids


def test_chunked_prefill_bounds_peak_memory():
    """Scores and hidden states exist for one chunk at a time, and the LM head
    never runs on document tokens: peak memory of a 2k-token prefill with
    64-token chunks is far below the one-step prefill's."""
    loaded = tiny_llama(vocab_size=4096)
    prompt = make_prompt(2048, TASKS[:1])

    def peak(chunk: int) -> int:
        engine = Engine(loaded, CacheSpec(kv_quant_scheme="fp16", prefill_chunk=chunk))
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        engine.prefill(prompt)
        cache_bytes = engine.cache_nbytes()
        engine.cache = None
        return mx.get_peak_memory() - base, cache_bytes

    chunked, cache_bytes = peak(64)
    one_step, _ = peak(2048)
    scores_one_step = 4 * 2048 * 2048 * 4  # heads x L x L float32
    assert one_step > scores_one_step  # the one-step prefill really materialises all scores
    assert chunked < cache_bytes + scores_one_step / 8
    assert chunked < one_step / 4


def test_job_quantizer_reaches_the_cache():
    """``cache.quantizer: tcq`` in a job builds trellis-coded caches (and the
    default builds the scalar ones the GPU kernels read)."""
    from pipeline.inference.engine import _make_cache
    from turboquant.trellis import TrellisCodec

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64)
    model = llama.Model(args)
    from turboquant.codec import TurboQuantCodec

    for quantizer, codec_type in (("tcq", TrellisCodec), ("scalar", TurboQuantCodec)):
        caches = _make_cache(model, CacheSpec(quantizer=quantizer))
        x = mx.random.normal((1, 2, 300, 16))
        caches[0].update_and_fetch(x, x)
        caches[0].update_and_fetch(x[:, :, :1], x[:, :, :1])
        assert caches[0].quantizer == quantizer
        assert type(caches[0].key_codec) is codec_type


def test_warm_up_runs_the_kernel_routes_of_a_cached_document_and_leaves_no_trace(monkeypatch):
    """A document loaded from the store runs its task's prefill over packed
    history, then decode steps: on a GPU the warm-up must run those routes
    (here chosen as CUDA would), and change nothing a document sees."""
    import dataclasses

    import turboquant.prompt_cache
    from turboquant.attention import dispatch, route

    # caches as a GPU makes them (keys centred on a block mean, which the kernels add back)
    monkeypatch.setattr(turboquant.prompt_cache, "block_mean_wanted", lambda *a: True)
    loaded = tiny_llama(hidden_size=256, intermediate_size=256)  # head dim 64, as the CUDA kernels take
    calls = []
    real = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda call, *a: calls.append(call) or real(call, *a))
    engine = Engine(loaded, CacheSpec(kv_quant_scheme="turboquant", window=16), batch_tasks=False)
    engine.warm_up()
    on_cuda = {route.choose(dataclasses.replace(c, on_gpu=True), "cuda", "auto") for c in calls}
    assert {route.Route.TC, route.Route.FUSED_STEP} <= on_cuda  # both read packed history
    assert (engine.prefill_count, engine.tokens_forwarded, engine.decode_forwards) == (0, 0, 0)
    assert engine.cache is None


def test_a_warm_up_with_a_document_store_prepares_the_upload_slots(tmp_path, monkeypatch):
    """A store's first load would otherwise pay the staging buffers' pinning
    inside a document's time to first token."""
    from pipeline.inference import gpu_upload
    from pipeline.inference.doc_cache import DocCacheStore

    calls = []
    monkeypatch.setattr(gpu_upload, "prepare", lambda: calls.append(1) or True)
    Engine(tiny_llama(), CacheSpec(kv_quant_scheme="turboquant")).warm_up()
    assert calls == []  # no store: nothing to prepare
    Engine(tiny_llama(), CacheSpec(kv_quant_scheme="turboquant"), store=DocCacheStore(tmp_path)).warm_up()
    assert calls == [1]


def test_a_warm_up_that_fails_is_a_warning(monkeypatch, caplog):
    engine = Engine(tiny_llama(), CacheSpec(kv_quant_scheme="turboquant"))

    def fail(*a, **k):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(engine, "_forward", fail)
    engine.warm_up()
    assert "engine warm-up skipped (RuntimeError: no kernel)" in caplog.text
    assert engine.cache is None and engine.prefill_count == 0


def test_a_token_id_outside_the_vocabulary_is_an_error_not_a_crash():
    """MLX's embedding gather does not check bounds (a CPU process dies on it):
    a document whose ids do not fit the model is refused before any forward."""
    from pipeline.errors import TqpipeError

    loaded = tiny_llama()
    loaded.model.model.embed_tokens = loaded.model.model.embed_tokens.inner  # unwrap the counter
    engine = Engine(loaded, CacheSpec(kv_quant_scheme="turboquant"))
    assert engine.vocab_size == VOCAB
    prompt = make_prompt(40, TASKS[:1])
    prompt.prefix_ids[7] = VOCAB
    with pytest.raises(TqpipeError, match=f"token id {VOCAB} is outside the model's {VOCAB}-token vocabulary"):
        engine.process(prompt, TASKS[:1])
    assert engine.tokens_forwarded == 0
    prompt.prefix_ids[7] = VOCAB - 1
    prompt.task_ids[TASKS[0].name][-1] = VOCAB + 5  # a task's ids too
    with pytest.raises(TqpipeError, match=f"token id {VOCAB + 5}"):
        engine.process(prompt, TASKS[:1])
    prompt.task_ids[TASKS[0].name][-1] = 2
    assert engine.process(prompt, TASKS[:1])[0].token_ids
