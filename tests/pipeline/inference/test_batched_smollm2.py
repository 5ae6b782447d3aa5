"""Batched tasks on the built-in SmolLM2 model: greedy tokens equal to one task at a time."""

from __future__ import annotations

import pytest

from fixtures_models import *  # noqa: F401,F403
from pipeline.inference.prompt import DocumentPrompt
from pipeline.inference.engine import Engine
from pipeline.schema.job import CacheSpec, TaskSpec

DOC = " ".join(
    f"Section {i}. The harbor authority recorded {100 + 7 * i} ships in month {i % 12 + 1}; "
    f"the dredging budget was {1000 + 37 * i} euros and inspector number {i} approved it."
    for i in range(1, 25)
)
QUESTIONS = {
    "summary": "Summarize the document in one sentence.",
    "ships": "How many ships were recorded in section 3?",
    "budget": "What was the dredging budget in section 10?",
    "title": "Give the document a short title.",
}


def _prompt(tok) -> DocumentPrompt:
    doc = tok.encode(f"<|im_start|>user\nDocument:\n{DOC}\n")
    tasks = {k: tok.encode(f"\nQuestion: {q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
             for k, q in QUESTIONS.items()}
    return DocumentPrompt(prefix_ids=doc, task_ids=tasks, page_offsets={1: 0}, included_pages=[1], skipped_pages=[])


@pytest.mark.parametrize("scheme", ["turboquant"])  # fp16 and affine: test_batched.py (tiny model)
def test_four_tasks_batched_equal_one_at_a_time(smollm2_model, scheme):
    tasks = [TaskSpec(name=k, prompt=q, max_tokens=16) for k, q in QUESTIONS.items()]
    spec = CacheSpec(kv_quant_scheme=scheme, kv_bits=3.5, prefill_chunk=256)
    prompt = _prompt(smollm2_model.tokenizer)
    assert len(prompt.prefix_ids) > 600  # past the 128-token window: packed history in play
    batched_engine = Engine(smollm2_model, spec)
    batched = batched_engine.process(prompt, tasks)
    alone = Engine(smollm2_model, spec, batch_tasks=False).process(prompt, tasks)
    assert batched_engine.decode_forwards <= max(len(r.token_ids) for r in batched)
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids, (b.task, b.text, a.text)
        assert b.finish_reason == a.finish_reason
