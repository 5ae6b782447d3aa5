"""Sampling filters and the repetition penalty: mlx-lm's rules, per row, opt-in."""

from __future__ import annotations

import mlx.core as mx
import pytest
from pydantic import ValidationError

from pipeline.inference.decode import Row, decode_rows
from pipeline.inference.engine import Engine
from pipeline.schema.job import TaskSpec
from test_batched import SPECS
from test_engine import make_prompt, tiny_llama

V = 8


def fixed_step(logits: list[float]):
    """A model that always gives the same logits, whatever was generated."""
    row = mx.array(logits, dtype=mx.float32)
    return lambda y: mx.broadcast_to(row, (y.shape[0], V))


def decode(task: TaskSpec, logits: list[float], seed: int = 0) -> list[int]:
    row = Row.for_task(task, seed)
    first = mx.array([logits], dtype=mx.float32)
    decode_rows([row], first, fixed_step(logits), eos_ids=set())
    return row.tokens


def test_greedy_answer_repeats_without_a_penalty_and_moves_on_with_one():
    logits = [0.0, 5.0, 4.0, 3.0, -1.0, -2.0, -3.0, -4.0]
    plain = TaskSpec(name="t", prompt="p", max_tokens=6)
    assert decode(plain, logits) == [1] * 6
    # mlx-lm's rule: each token seen in the window once, however often: 5 / 1.3 = 3.85
    # loses to 4 once, then beats 4 / 1.3 and 3 for good
    assert decode(TaskSpec(name="t", prompt="p", max_tokens=6, repetition_penalty=1.3), logits) == [1, 2, 1, 1, 1, 1]
    assert decode(TaskSpec(name="t", prompt="p", max_tokens=6, repetition_penalty=2.0), logits) == [1, 2, 3, 1, 1, 1]
    # a window of 1 token forgets all but the last: two tokens alternate
    short = TaskSpec(name="t", prompt="p", max_tokens=6, repetition_penalty=1.3, repetition_context_size=1)
    assert decode(short, logits) == [1, 2, 1, 2, 1, 2]


def test_negative_logits_are_multiplied_so_a_penalty_always_lowers_them():
    logits = [-1.0, -1.2, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]
    task = TaskSpec(name="t", prompt="p", max_tokens=2, repetition_penalty=1.5)
    assert decode(task, logits) == [0, 1]  # -1 x 1.5 = -1.5 < -1.2


def test_filters_narrow_the_draw_to_the_likeliest_tokens():
    logits = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]  # nearly flat: a plain draw wanders
    plain = TaskSpec(name="t", prompt="p", max_tokens=12, temperature=1.0)
    wide = {t for s in range(4) for t in decode(plain, logits, s)}
    assert len(wide) > 4
    for keep in ({"top_k": 1}, {"top_p": 0.1}, {"min_p": 0.99}):
        task = TaskSpec(name="t", prompt="p", max_tokens=12, temperature=1.0, **keep)
        assert decode(task, logits, seed=1) == [0] * 12, keep
    two = TaskSpec(name="t", prompt="p", max_tokens=40, temperature=1.0, top_k=2)
    assert set(decode(two, logits, seed=2)) == {0, 1}


def test_options_are_checked_and_stay_out_of_old_config_hashes():
    for bad in ({"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):  # greedy: nothing to filter
        with pytest.raises(ValidationError, match="temperature > 0"):
            TaskSpec(name="t", prompt="p", **bad)
    with pytest.raises(ValidationError, match="only meaningful with repetition_penalty"):
        TaskSpec(name="t", prompt="p", repetition_context_size=8)
    with pytest.raises(ValidationError):
        TaskSpec(name="t", prompt="p", temperature=1.0, top_p=1.5)
    plain = TaskSpec(name="t", prompt="p").hash_fields()
    assert set(plain) == {"name", "prompt", "max_tokens", "temperature", "format", "fields"}  # as before the options
    assert TaskSpec(name="t", prompt="p", repetition_penalty=1.1).hash_fields()["repetition_penalty"] == 1.1


def test_a_penalized_row_decodes_in_a_batch_as_it_would_alone():
    loaded = tiny_llama()
    tasks = [TaskSpec(name="a", prompt="x", max_tokens=9, repetition_penalty=1.5),
             TaskSpec(name="bb", prompt="y", max_tokens=7),
             TaskSpec(name="ccc", prompt="z", max_tokens=8, temperature=0.8, top_k=3, repetition_penalty=1.2)]
    prompt = make_prompt(50, tasks)
    batched = Engine(loaded, SPECS["turboquant"], seed=3).process(prompt, tasks)
    alone = Engine(loaded, SPECS["turboquant"], seed=3, batch_tasks=False).process(prompt, tasks)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    unpenalized = tasks[0].model_copy(update={"repetition_penalty": None})
    plain = Engine(loaded, SPECS["turboquant"], seed=3).process(prompt, [unpenalized])
    assert not plain[0].constrained and not batched[0].constrained  # a penalty is not a JSON constraint
    assert len(set(batched[0].token_ids)) >= len(set(plain[0].token_ids))
