"""Needle retrieval through compressed KV caches (SmolLM2-135M-Instruct).

    python -m benchmarks.needle [--tokens 1500] [--depths 0.1,0.5,0.9]
        [--chunk 256] [--window 128] [--continuation 32] [--json]

Each prompt is a generated document (varied filler sentences) with one
"needle" fact placed at a known depth and a question about it at the end,
rendered with the model's chat template.  Every cache configuration reads
the same prompt the way the pipeline does -- prefill in chunks of
``--chunk`` tokens, so quantization really happens *during* prefill and
later chunks attend to already-compressed history -- and is then measured
two ways:

* teacher-forced over the fp16 greedy continuation (``--continuation``
  tokens, one decode step per token, each step going through the cache):
  top-1 next-token agreement with fp16 and mean KL(fp16 || config) of the
  next-token distributions;
* needle retrieval: greedy decoding of the answer, correct when it contains
  the needle's value.

Configurations: the model's own cache (float32 on CPU, where the model runs
in float32; labelled fp16 as the pipeline's scheme name), mlx-lm's affine
``QuantizedKVCache`` at 4/8 bits, mlx-vlm's ``TurboQuantKVCache`` (the peer)
and ours at 2.5/3/3.5/4 bits, ours both with the exact window the pipeline
uses (``--window``) and with ``window=0`` (the codec alone).  The fp16
reference is computed once per prompt; everything runs in one process on
the same token ids.

mlx-vlm's cache has a ``bits`` attribute, which mlx-lm's attention would send
to its affine kernel; for the peer rows the llama module's attention is
routed to ``mlx_vlm.models.base.scaled_dot_product_attention`` (its own
dispatcher), inside this benchmark only.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import turboquant  # noqa: F401  (fast CPU BLAS before mlx.core)
import mlx.core as mx

from benchmarks.quality import CacheConfig  # one place builds the caches

# ----------------------------------------------------------------- prompts
_NAMES = ["Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun",
          "Kofi", "Lena", "Marek", "Nia", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
_VERBS = ["repaired", "painted", "measured", "photographed", "carried", "inspected", "described",
          "cleaned", "sketched", "moved", "catalogued", "weighed", "polished", "labelled"]
_ADJS = ["old", "narrow", "green", "heavy", "quiet", "wooden", "bright", "dusty", "tall",
         "curved", "silver", "broken", "shallow", "crowded"]
_NOUNS = ["bridge", "lantern", "boat", "fence", "window", "staircase", "garden", "map", "bell",
          "cart", "mill", "tower", "well", "market stall"]
_PLACES = ["harbour", "north gate", "river bend", "orchard", "old school", "train depot",
           "lighthouse", "village square", "forest edge", "salt flats"]
_TIMES = ["at dawn", "before lunch", "in the evening", "after the storm", "on market day",
          "during the festival", "in late autumn", "at noon", "on a foggy morning"]
_EXTRAS = [
    "Nobody in the village remembered who had built it.",
    "The work took longer than anyone expected.",
    "A small crowd gathered to watch.",
    "The weather stayed calm the whole time.",
    "It was noted in the parish records.",
    "Children followed along, asking questions.",
    "The council thanked everyone in a short letter.",
    "Later that week the rain returned.",
]
_COLORS = ["amber", "cobalt", "crimson", "ivory", "jade", "violet", "copper", "scarlet"]


def _filler_sentence(rng: random.Random) -> str:
    s = (f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} "
         f"{rng.choice(_NOUNS)} near the {rng.choice(_PLACES)} {rng.choice(_TIMES)}.")
    return s + (" " + rng.choice(_EXTRAS) if rng.random() < 0.3 else "")


@dataclass
class NeedlePrompt:
    """One generated prompt: token ids, the needle's value and where it sits."""

    ids: list[int]
    answer: str
    depth: float


def make_needle_prompt(tokenizer: Any, n_tokens: int, depth: float, seed: int = 0) -> NeedlePrompt:
    """A chat prompt of about ``n_tokens`` tokens with a needle at ``depth`` (0..1).

    The filler is grown sentence by sentence until the rendered prompt
    reaches ``n_tokens``; the needle sentence is inserted at the sentence
    boundary closest to ``depth`` of the filler.
    """
    rng = random.Random(seed)
    color = rng.choice(_COLORS)
    answer = str(rng.randint(1000, 9999))
    needle = f"The access code for the {color} vault is {answer}."
    question = f"What is the access code for the {color} vault? Answer with the number only."

    def render(sentences: list[str]) -> list[int]:
        k = round(depth * len(sentences))
        doc = " ".join(sentences[:k] + [needle] + sentences[k:])
        messages = [{"role": "user", "content": f"{doc}\n\n{question}"}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    sentences: list[str] = []
    ids = render(sentences)
    while len(ids) < n_tokens:
        # ~20 tokens a sentence: add in batches, then re-render to measure
        need = max(1, (n_tokens - len(ids)) // 24)
        sentences += [_filler_sentence(rng) for _ in range(need)]
        ids = render(sentences)
    return NeedlePrompt(ids=ids, answer=answer, depth=depth)


# ------------------------------------------------------------ configurations
SCHEMES = ("fp16", "affine", "mlx-vlm", "turboquant")


def default_configs(window: int, bits: Sequence[float] = (2.5, 3, 3.5, 4),
                    schemes: Sequence[str] = SCHEMES) -> list[CacheConfig]:
    """The fp16 reference first, then the schemes asked for (ours twice: ``window`` and 0)."""
    configs = [CacheConfig("fp16 (float32 on CPU)", "fp16")]
    if "affine" in schemes:
        configs += [CacheConfig("mlx affine 8-bit", "affine", 8), CacheConfig("mlx affine 4-bit", "affine", 4)]
    for b in bits:
        if "mlx-vlm" in schemes:
            configs.append(CacheConfig(f"mlx-vlm TurboQuant {b:g}", "mlx-vlm", b))
        if "turboquant" in schemes:
            configs.append(CacheConfig(f"ours {b:g} (window {window})", "turboquant", b, window))
            configs.append(CacheConfig(f"ours {b:g} (window 0)", "turboquant", b, 0))
    return configs


# ----------------------------------------------------------------- running


def prefill(model: Any, cache: list, ids: Sequence[int], chunk: int) -> mx.array:
    """Chunked prefill; returns the last position's logits (float32, [vocab]).

    Non-final chunks go through the backbone only (no LM head), as in
    ``pipeline.inference.engine``.
    """
    if not ids:
        raise ValueError("benchmarks.needle.prefill: empty prompt")
    x = mx.array(list(ids), dtype=mx.int32)[None]
    n = x.shape[1]
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        if end < n:
            model.model(x[:, start:end], cache=cache)
            mx.eval([c.state for c in cache])
        else:
            h = model.model(x[:, start:end], cache=cache)
            logits = model.lm_head(h[:, -1:]) if hasattr(model, "lm_head") else (
                model.model.embed_tokens.as_linear(h[:, -1:]))
    return logits[0, -1].astype(mx.float32)


def step(model: Any, cache: list, token: int) -> mx.array:
    return model(mx.array([[token]], dtype=mx.int32), cache=cache)[0, -1].astype(mx.float32)


def _kv_bytes(cache: list) -> int:
    """Bytes holding the cached tokens: ours' ``used_nbytes`` (its reserved
    capacity is not data), mlx-vlm's ``nbytes`` (already just the tokens held),
    mlx-lm's allocated ``nbytes`` (256-token steps)."""
    return int(sum(getattr(c, "used_nbytes", None) or c.nbytes for c in cache))


def _snapshot(cache: list) -> tuple[int, list]:
    return cache[0].offset, [c.checkpoint() if hasattr(c, "checkpoint") else None for c in cache]


def _rewind(cache: list, snap: tuple[int, list]) -> None:
    """Back to the snapshot: our cache restores its checkpoint, others trim."""
    offset, saved = snap
    for c, s in zip(cache, saved):
        if s is None:
            c.trim(c.offset - offset)
        else:
            c.restore(s)


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def greedy(model: Any, cache: list, first_logits: mx.array, n: int, eos: set[int],
           forced: Sequence[int] = ()) -> tuple[list[int], mx.array]:
    """Greedy decoding of up to ``n`` tokens, the EOS token included when it comes.

    The first ``len(forced)`` tokens are fed instead of chosen (to resume a
    run at a given point).  Returns the tokens and the log-probabilities
    [len(tokens), vocab] each of them was chosen from.
    """
    out: list[int] = []
    rows = []
    logits = first_logits
    while len(out) < n:
        rows.append(_logprobs(logits))
        tok = forced[len(out)] if len(out) < len(forced) else int(mx.argmax(logits).item())
        out.append(tok)
        if tok in eos or len(out) == n:
            break
        logits = step(model, cache, tok)
        mx.eval(logits)
    return out, mx.stack(rows)


def teacher_forced(model: Any, cache: list, first_logits: mx.array, target: Sequence[int]) -> mx.array:
    """Log-probabilities [len(target), vocab]: row i predicts ``target[i]`` after
    the prompt and ``target[:i]`` (each fed through the cache, one decode step each)."""
    rows = [_logprobs(first_logits)]
    for tok in target[:-1]:
        rows.append(_logprobs(step(model, cache, tok)))
        mx.eval(rows[-1])
    return mx.stack(rows)


@dataclass
class PromptRun:
    logprobs: mx.array  # [T, vocab], teacher-forced over the reference continuation
    answer_text: str
    kv_bytes: int
    seconds: float


def run_prompt(model: Any, tokenizer: Any, config: CacheConfig, prompt: NeedlePrompt,
               reference: Sequence[int] | None, *, chunk: int, answer_tokens: int,
               continuation: int, eos: set[int]) -> tuple[PromptRun, list[int]]:
    """One prefill, then the teacher-forced pass and the config's greedy answer.

    ``reference=None`` (the fp16 run): greedy-decode ``continuation`` tokens
    (EOS included); they are the reference, returned for the other configs.
    Otherwise teacher-force ``reference``; while the config's own argmax
    agrees with it, its greedy output *is* the reference, so a separate
    greedy run (rewind to the prompt, replay the agreeing prefix, decode) is
    only needed when they part before the answer is complete.
    """
    t0 = time.perf_counter()
    cache = config.build(model)
    for c in cache:  # as the engine does: our cache sized once, no geometric over-allocation
        if hasattr(c, "reserve"):
            c.reserve(len(prompt.ids) + max(continuation, answer_tokens))
    first = prefill(model, cache, prompt.ids, chunk)
    mx.eval(first)
    if reference is None:
        reference, logprobs = greedy(model, cache, first, max(continuation, answer_tokens), eos)
        answer = reference[:answer_tokens]
        kv_bytes = _kv_bytes(cache)
    else:
        snap = _snapshot(cache)
        logprobs = teacher_forced(model, cache, first, reference)
        kv_bytes = _kv_bytes(cache)
        pred = mx.argmax(logprobs, axis=-1).tolist()
        agree = next((i for i, (a, b) in enumerate(zip(pred, reference)) if a != b), len(reference))
        answer = list(reference[:answer_tokens])
        if agree < min(answer_tokens, len(reference)):
            _rewind(cache, snap)
            answer, _ = greedy(model, cache, first, answer_tokens, eos, forced=reference[:agree])
    mx.eval(logprobs)
    text = tokenizer.decode([t for t in answer if t not in eos])
    return PromptRun(logprobs, text, kv_bytes, time.perf_counter() - t0), list(reference)


def compare(ref: mx.array, other: mx.array) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || other)) over the rows of two log-prob tables."""
    top1 = mx.mean(mx.argmax(ref, axis=-1) == mx.argmax(other, axis=-1)).item()
    kl = mx.sum(mx.exp(ref) * (ref - other), axis=-1)
    return float(top1), float(mx.mean(mx.maximum(kl, 0.0)).item())


@dataclass
class ConfigResult:
    label: str
    scheme: str
    bits: float | None
    window: int | None
    top1: float = 0.0
    kl: float = 0.0
    needle: float = 0.0
    kv_bytes: float = 0.0
    positions: int = 0  # next-token distributions compared, all prompts
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)


def evaluate(model: Any, tokenizer: Any, prompts: Sequence[NeedlePrompt], configs: Sequence[CacheConfig],
             *, chunk: int = 256, answer_tokens: int = 20, continuation: int = 32,
             log: Callable[[str], None] = lambda s: None) -> list[ConfigResult]:
    """All configs on all prompts; ``configs[0]`` must be the fp16 reference."""
    if configs[0].scheme != "fp16":
        raise ValueError("benchmarks.needle.evaluate: the first config must be the fp16 reference")
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    refs: list[tuple[mx.array, list[int]]] = []
    results = []
    for config in configs:
        res = ConfigResult(config.label, config.scheme, config.bits, config.window)
        for i, prompt in enumerate(prompts):
            reference = refs[i][1] if i < len(refs) else None
            run, tokens = run_prompt(model, tokenizer, config, prompt, reference, chunk=chunk,
                                     answer_tokens=answer_tokens, continuation=continuation, eos=eos)
            if len(refs) < len(prompts):
                refs.append((run.logprobs, tokens))
            top1, kl = compare(refs[i][0], run.logprobs)
            res.top1 += top1 / len(prompts)
            res.kl += kl / len(prompts)
            res.needle += (prompt.answer in run.answer_text) / len(prompts)
            res.kv_bytes += run.kv_bytes / len(prompts)
            res.positions += run.logprobs.shape[0]
            res.seconds += run.seconds
            res.answers.append(run.answer_text.strip())
            mx.clear_cache()
        log(f"{res.label:28s} top1 {res.top1:.4f}  KL {res.kl:.5f}  needle {res.needle:.2f}  "
            f"({res.seconds:.0f} s)  answers {res.answers}")
        results.append(res)
    return results


# --------------------------------------------------------------------- CLI
def format_table(results: Sequence[ConfigResult]) -> str:
    peer = {r.bits: r.kl for r in results if r.scheme == "mlx-vlm"}
    lines = ["| cache | top-1 agreement | mean KL | KL / mlx-vlm TQ | needle acc. | KV bytes | positions |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rel = f"{r.kl / peer[r.bits]:.2f}x" if r.scheme == "turboquant" and peer.get(r.bits) else ""
        lines.append(f"| {r.label} | {100 * r.top1:.2f}% | {r.kl:.5f} | {rel} | "
                     f"{100 * r.needle:.0f}% | {r.kv_bytes / 1e6:.2f} MB | {r.positions} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.needle", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1500, help="prompt length in tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths, one prompt each")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    p.add_argument("--window", type=int, default=128, help="our exact window (also run with 0)")
    p.add_argument("--bits", default="2.5,3,3.5,4")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="which caches besides fp16")
    p.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (needle, filler)")
    p.add_argument("--continuation", type=int, default=32,
                   help="fp16 greedy tokens to teacher-force (fewer when it stops at EOS)")
    p.add_argument("--answer-tokens", type=int, default=20)
    p.add_argument("--json", action="store_true", help="also print one JSON line")
    a = p.parse_args(argv)
    schemes = a.schemes.split(",")
    unknown = set(schemes) - set(SCHEMES)
    if unknown:
        p.error(f"--schemes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SCHEMES)}")

    from pipeline.models.load import load_model

    t0 = time.perf_counter()
    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    depths = [float(d) for d in a.depths.split(",")]
    prompts = [make_needle_prompt(tokenizer, a.tokens, d, seed=a.seed + i) for i, d in enumerate(depths)]
    configs = default_configs(a.window, [float(b) for b in a.bits.split(",")], schemes)
    print(f"model: {loaded.name} (float32 on CPU); prompts: {[len(q.ids) for q in prompts]} tokens, "
          f"needle depths {depths}; prefill chunk {a.chunk}; teacher-forced {a.continuation} tokens",
          flush=True)
    results = evaluate(model, tokenizer, prompts, configs, chunk=a.chunk, answer_tokens=a.answer_tokens,
                       continuation=a.continuation, log=lambda s: print(s, flush=True))
    print()
    print(format_table(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s on {platform.machine()} CPU")
    if a.json:
        print(json.dumps({"prompt_tokens": [len(q.ids) for q in prompts], "depths": depths, "seed": a.seed,
                          "chunk": a.chunk, "window": a.window, "continuation": a.continuation,
                          "results": [r.__dict__ for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
