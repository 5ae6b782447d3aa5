"""Greedy agreement with the fp16 cache on the built-in SmolLM2-135M (a real
trained model; head_dim 64, 3 KV heads), through mlx-lm's generate_step.

    python -m benchmarks.tq_greedy_agreement [--tokens 32] [--configs tq4,tq3.5,tq2.5,affine4]

Prompt: the tiny VLM's built-in corpus three times (~1.6k tokens) plus a
question, in the chat template; prefill in chunks of 256.  Prints, per
question and cache, how many leading greedy tokens equal the fp16 cache's.
Slow on a shared 2-core CPU (minutes per question).
"""

from __future__ import annotations

import argparse

import pipeline  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm.generate import generate_step

from pipeline.models.builtin_vlm import CORPUS
from pipeline.models.load import load_model
from turboquant import make_prompt_cache

QUESTIONS = (
    "What is the capital of France?",
    "What is the invoice number and who issued it?",
    "Summarize the results section in one sentence.",
    "Which page mentions the budget?",
)
CONFIGS = {
    "tq4": dict(kv_bits=4),
    "tq3.5": dict(kv_bits=3.5),
    "tq2.5": dict(kv_bits=2.5),
    "tq4-w16": dict(kv_bits=4, window=16),
    "affine4": dict(kv_bits=4, kv_quant_scheme="affine"),
    "affine8": dict(kv_bits=8, kv_quant_scheme="affine"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--configs", default="tq4,tq3.5,tq2.5,affine4")
    args = ap.parse_args()
    lm = load_model(None)
    model, tok = lm.model, lm.tokenizer
    totals: dict[str, int] = {}
    for qi, question in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": f"Read this document:\n{CORPUS * 3}\nQuestion: {question}"}]
        prompt = mx.array(tok.apply_chat_template(msgs, add_generation_prompt=True))

        def greedy(**kw) -> list[int]:
            cache = make_prompt_cache(model, **kw)
            steps = generate_step(prompt, model, prompt_cache=cache, max_tokens=args.tokens, prefill_step_size=256)
            return [int(t) for t, _ in steps]

        ref = greedy(kv_quant_scheme="fp16")
        line = [f"q{qi} ({prompt.size} tokens)"]
        for name in args.configs.split(","):
            out = greedy(**CONFIGS[name])
            agree = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref))
            totals[name] = totals.get(name, 0) + agree
            line.append(f"{name}:{agree}")
        print(" ".join(line), "| fp16:", repr(tok.decode(ref))[:70], flush=True)
    n = len(QUESTIONS) * args.tokens
    print("total leading agreement:", ", ".join(f"{k} {v}/{n}" for k, v in totals.items()))


if __name__ == "__main__":
    main()
