"""All tasks of a document as one batch of rows: same tokens as one at a time, fewer passes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from pipeline.inference.engine import Engine
from pipeline.schema.job import CacheSpec, TaskSpec
from test_engine import TASKS, make_prompt, tiny_llama

SPECS = {
    "turboquant": CacheSpec(kv_quant_scheme="turboquant", kv_bits=3, window=8, prefill_chunk=16),
    "fp16": CacheSpec(kv_quant_scheme="fp16", prefill_chunk=16),
    "affine": CacheSpec(kv_quant_scheme="affine", kv_bits=4, prefill_chunk=16),
}


@pytest.mark.parametrize("scheme", list(SPECS))
def test_batched_rows_match_tasks_one_at_a_time(scheme):
    # head_dim 64 (= the affine group size), 2 query heads per kv head
    loaded = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    head = loaded.model.lm_head
    prompt = make_prompt(64, TASKS)
    engine = Engine(loaded, SPECS[scheme])
    calls0 = head.calls
    batched = engine.process(prompt, TASKS)
    # one forward for all suffixes, then one per step for all live rows
    assert head.calls - calls0 == 1 + engine.decode_forwards
    assert engine.decode_forwards <= max(len(r.token_ids) for r in batched)
    alone = Engine(loaded, SPECS[scheme], batch_tasks=False)
    sequential = alone.process(prompt, TASKS)
    assert alone.decode_forwards >= sum(len(r.token_ids) for r in sequential) - len(TASKS)
    for b, s in zip(batched, sequential):
        assert (b.task, b.token_ids, b.finish_reason, b.tokens) == (s.task, s.token_ids, s.finish_reason, s.tokens)


def test_rows_stop_on_their_own_and_the_document_is_not_written():
    loaded = tiny_llama()
    tasks = [TaskSpec(name="a", prompt="x", max_tokens=1), TaskSpec(name="bb", prompt="y", max_tokens=9),
             TaskSpec(name="ccc", prompt="z", max_tokens=2), TaskSpec(name="dddd", prompt="w", max_tokens=4)]
    prompt = make_prompt(40, tasks)
    engine = Engine(loaded, SPECS["turboquant"])
    state = engine.prefill(prompt, reserve=32)
    engine.settle(state)  # the last prefill chunk's excess leaves the window once, before any task
    assert all(c.window_len == c.window for c in engine.cache)
    before = [(c.offset, c.packed_len, c.window_keys) for c in engine.cache]
    ids = [prompt.task_ids[t.name] for t in tasks]
    assert engine.can_batch(state)
    results = engine.run_batch(state, tasks, ids)
    assert [len(r.token_ids) for r in results] == [1, 9, 2, 4]  # tiny model: no EOS in these
    assert [r.finish_reason for r in results] == ["length"] * 4
    assert engine.decode_forwards == 8  # the longest row, not the sum
    assert [(c.offset, c.packed_len, c.window_keys) for c in engine.cache] == before
    assert results[1].cache["nbytes_end_of_task"] > results[1].cache["nbytes_after_prefill"]


def test_eos_row_stops_without_stalling_the_others():
    loaded = tiny_llama()
    prompt = make_prompt(40, TASKS)
    first = Engine(loaded, SPECS["fp16"], batch_tasks=False).process(prompt, TASKS[:1])[0]
    loaded.tokenizer.eos_token_ids = {first.token_ids[2]}  # row 0 stops at its third token
    try:
        engine = Engine(loaded, SPECS["fp16"])
        results = engine.process(prompt, TASKS)
        alone = Engine(loaded, SPECS["fp16"], batch_tasks=False).process(prompt, TASKS)
    finally:
        loaded.tokenizer.eos_token_ids = {1}
    assert results[0].finish_reason == "stop" and results[0].token_ids == first.token_ids[:2]
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]


def test_sampled_rows_draw_as_they_would_alone():
    loaded = tiny_llama()
    tasks = [TaskSpec(name="a", prompt="x", max_tokens=6, temperature=0.9),
             TaskSpec(name="bb", prompt="y", max_tokens=5), TaskSpec(name="ccc", prompt="z", max_tokens=7, temperature=1.3)]
    prompt = make_prompt(50, tasks)
    batched = Engine(loaded, SPECS["turboquant"], seed=3).process(prompt, tasks)
    alone = Engine(loaded, SPECS["turboquant"], seed=3, batch_tasks=False).process(prompt, tasks)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


def test_vlm_and_single_task_run_one_at_a_time():
    loaded = tiny_llama()
    engine = Engine(loaded, SPECS["fp16"])
    state = engine.prefill(make_prompt(20, TASKS), reserve=16)
    assert engine.can_batch(state)
    loaded.kind = "vlm"
    try:
        assert not engine.can_batch(state)
    finally:
        loaded.kind = "text"
