"""Run all tasks of one document over ONE prefill of its (compressed) KV cache.

The expensive part of a long document is reading it: prefill costs
O(tokens) forward work and fills the cache.  Every task then only adds its
own short suffix (the question) and decodes.  So the engine

1. builds a fresh per-layer cache (TurboQuant, fp16 or affine) and reserves
   room for the whole document, so the packed storage never regrows;
2. prefills the document prefix in chunks of ``cache.prefill_chunk`` tokens
   through the model's *backbone* (no LM head), so no step holds more than
   one chunk of keys, values, attention scores or hidden states and no
   full-vocabulary logits are ever computed for document tokens; the cache
   is evaluated and MLX's buffer cache cleared after every chunk;
3. decodes all tasks of the document as ONE batch of rows (``run_batch``):
   each task's suffix is appended per row (left-padded to the longest), and
   every step reads the document cache once for all rows while each row
   keeps its own small tail (``turboquant.shared_prefix``); rows stop at EOS
   or their ``max_tokens`` without holding up the others.  Where rows cannot
   share the document (a VLM, multimodal RoPE, a cache the shared attention
   does not read) the tasks run one at a time (``run_task``): append the
   task tokens, decode, then trim the cache back to the document so the next
   task sees it exactly as prefilled (caches that cannot trim are restored
   from a snapshot).  Either way the decode loop is asynchronous
   (``pipeline.decode``) and logits exist for the last position only.

Document caches: with a store (``pipeline.inference.doc_cache``) and a key,
the engine first looks the document up; a hit loads the prefilled cache and
goes straight to the tasks (no forward pass over the document), a miss
prefills and stores the cache before the first task, so a crash in a task
still leaves it for the rerun.  A loaded cache is the saved one bit for bit,
so its answers equal a fresh prefill's.

Exactness of the rewind for TurboQuant: while a task runs the cache holds
its window (``hold``: task tokens stay exact, nothing is flushed, the same
view a batch row gets).  Restoring rather than trimming keeps that exact
even for caches whose window moved before.  After prefill we therefore keep
references to the cache's small mutable parts (window arrays, packed length,
centring means; MLX arrays are immutable values, the cache replaces them
rather than writing into them) and put them back after the trim.  Packed
storage below the document's packed length is never written by a task, so
every task sees bit-for-bit the cache a fresh prefill would give.

VLMs: page images are merged into the input embeddings by the model's own
``get_input_embeddings`` (vision tower + image-token scatter), one prefill
chunk at a time with only that chunk's images, so neither the vision tower
nor the embeddings ever see the whole document (chunks stretch to keep a
page's image tokens together).  Models with multimodal RoPE (Qwen2-VL) get
global position ids from ``get_rope_index`` once (integers only), sliced per
chunk and continued after the document with its ``rope_deltas`` offset.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx

from pipeline.errors import TqpipeError
from pipeline.inference import gpu_upload
from pipeline.inference.constrained import json_processor
from pipeline.inference.kv_size import KVGeometry, exact_tokens, figures
from pipeline.inference.decode import Row
from pipeline.inference.decode import decode_rows as _decode
from pipeline.inference.doc_cache import DocCacheStore, DocKey, Hit, document_key, model_identity
from pipeline.inference.prompt import DocumentPrompt, concat_image_inputs
from pipeline.schema.job import TaskSpec

logger = logging.getLogger(__name__)

# Engine.warm_up: its document's tokens beyond the exact window (packed, all
# but the sinks), and its task's tokens (more than 8 query rows even without
# GQA: the tiled kernel runs, not the decode step's)
WARM_UP_PACKED = 256
WARM_UP_SUFFIX = 16


@dataclass
class TaskResult:
    """One task's output plus the numbers that go into its record."""

    task: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    tokens: dict
    timing: dict
    cache: dict
    constrained: bool = False  # decoded through a JSON constraint


@dataclass
class _Prefilled:
    length: int  # document tokens in the cache
    prefill_s: float
    nbytes: int
    pos_delta: int | None  # mRoPE offset to continue positions after the document, None = cache offset
    pos_ndim: int = 2
    exact_tokens: int | None = None  # TurboQuant: tokens still in the exact window after prefill
    snapshot: list | None = field(default=None, repr=False)
    windows: list | None = field(default=None, repr=False)
    settled: bool = False  # TurboQuant windows trimmed to size before the first task (Engine.settle)
    doc_cache: dict | None = None  # the store's part of the record: hit, load_s / save_s, entry


def _make_cache(model: Any, spec: Any) -> list:
    """Per-layer caches for ``model`` (the mlx-lm model, or the whole mlx-vlm model)."""
    from turboquant import make_prompt_cache

    opts = {}
    if spec.kv_quant_scheme == "turboquant":
        opts = {"key_bits": spec.key_bits, "value_bits": spec.value_bits, "window": spec.window,
                "quantizer": spec.quantizer}
    return make_prompt_cache(model, kv_bits=spec.kv_bits, kv_quant_scheme=spec.kv_quant_scheme, **opts)


def _param_names(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


class Engine:
    """A loaded model plus the cache policy; ``process`` runs one document.

    ``prefill_count`` and ``tokens_forwarded`` count work actually done, so
    tests (and benchmarks) can check that a document is read once no matter
    how many tasks ask about it; ``cache_loads`` counts document caches
    loaded from ``store`` instead.
    """

    def __init__(self, loaded: Any, cache_spec: Any, *, seed: int = 0, batch_tasks: bool = True,
                 store: DocCacheStore | None = None):
        self.loaded = loaded
        self.cache_spec = cache_spec
        self.seed = seed
        self.store = store
        self.cache_loads = 0
        self._model_identity: dict | None = None
        self.batch_tasks = batch_tasks  # all tasks of a document as one batch where possible
        self.lm = loaded.model.language_model if loaded.kind == "vlm" else loaded.model
        self.backbone = getattr(self.lm, "model", None)
        params = _param_names(self.backbone.__call__) if self.backbone is not None else set()
        self._embeds_kw = next((k for k in ("inputs_embeds", "input_embeddings") if k in params), None)
        self._pos_kw = "position_ids" in params
        head = getattr(self.lm, "lm_head", None)
        if head is not None:
            self._head: Callable | None = head
        elif self.backbone is not None and hasattr(self.backbone, "embed_tokens"):
            self._head = self.backbone.embed_tokens.as_linear
        else:
            self._head = None  # unknown layout: run the full model, slice logits
        self.eos_ids: set[int] = set()
        for attr in ("eos_token_ids", "eos_token_id"):  # a set on mlx-lm's wrapper, an int on HF tokenizers
            value = getattr(loaded.tokenizer, attr, None)
            if value is not None:
                self.eos_ids.update(int(v) for v in (value if isinstance(value, (list, tuple, set)) else [value]))
        emb = getattr(self.backbone, "embed_tokens", None)
        rows = getattr(emb, "num_embeddings", None) or getattr(getattr(emb, "weight", None), "shape", (None,))[0]
        self.vocab_size: int | None = int(rows) if rows else None  # None: an unknown layout, not checked
        self.cache: list | None = None
        self.prefill_count = 0
        self.tokens_forwarded = 0  # rows x positions through the backbone
        self.decode_forwards = 0  # decode steps (one forward for all live rows)

    # -- forward ----------------------------------------------------------
    def _forward(self, ids: mx.array | None, embeds: mx.array | None, positions: mx.array | None, *, logits: bool,
                 cache: list | None = None):
        """One forward step over a chunk; returns last-position logits, or None
        when ``logits`` is False (document chunks: the LM head never runs).
        ``cache`` defaults to the document's (task rows pass theirs)."""
        x = ids if ids is not None else embeds
        self.tokens_forwarded += x.shape[0] * x.shape[1]
        cache = self.cache if cache is None else cache
        if self._head is None:
            out = self.lm(ids, cache=cache)
            out = getattr(out, "logits", out)
            return out[:, -1, :] if logits else None
        kwargs: dict = {"cache": cache}
        if embeds is not None:
            if self._embeds_kw is None:
                raise TqpipeError(f"{type(self.backbone).__name__} takes no input embeddings; cannot merge page images")
            kwargs[self._embeds_kw] = embeds
        if positions is not None and self._pos_kw:
            kwargs["position_ids"] = positions
        h = self.backbone(ids, **kwargs)
        if not logits:
            return None  # the cache holds what matters; h stays an unevaluated graph
        return self._head(h[:, -1:, :])[:, -1, :]

    def _positions(self, state: _Prefilled, n: int) -> mx.array | None:
        if state.pos_delta is None:
            return None
        start = self.cache[0].offset + state.pos_delta
        pos = mx.arange(start, start + n)[None]
        return mx.broadcast_to(pos[None], (3, 1, n)) if state.pos_ndim == 3 else pos

    # -- prefill ----------------------------------------------------------
    def prefill(self, prompt: DocumentPrompt, *, reserve: int = 0, on_tokens: Callable[[int], None] | None = None) -> _Prefilled:
        """Fill a fresh cache with the document prefix, chunk by chunk."""
        t0 = time.perf_counter()
        self.cache = _make_cache(self.loaded.model, self.cache_spec)
        total = len(prompt.prefix_ids)
        for c in self.cache:
            if hasattr(c, "reserve"):
                c.reserve(total + reserve)
        ids = mx.array(prompt.prefix_ids, dtype=mx.int32)[None]
        positions, pos_delta = None, None
        if prompt.image_spans:
            if self.loaded.kind != "vlm":
                raise TqpipeError("document has page images but the model is text-only")
            positions, pos_delta = self._mrope_positions(ids, prompt)
        for start, end, extras in _chunks(total, self.cache_spec.prefill_chunk, prompt.image_spans):
            self._forward(
                ids[:, start:end],
                self._embed_images(ids[:, start:end], extras) if extras else None,
                None if positions is None else positions[..., start:end],
                logits=False,
            )
            mx.eval([c.state for c in self.cache])
            mx.clear_cache()
            if on_tokens is not None:
                on_tokens(end - start)
        pos_ndim = 2 if positions is None else positions.ndim
        self.prefill_count += 1
        return self._prefilled(total, time.perf_counter() - t0, pos_delta, pos_ndim)

    def _prefilled(self, length: int, prefill_s: float, pos_delta: int | None, pos_ndim: int) -> _Prefilled:
        """The document state of the cache now in ``self.cache``, with what a rewind needs."""
        self.allocated_after_prefill = self.cache_allocated()
        state = _Prefilled(length=length, prefill_s=prefill_s, nbytes=self.cache_nbytes(),
                           exact_tokens=exact_tokens(self.cache), pos_delta=pos_delta, pos_ndim=pos_ndim)
        if not all(c.is_trimmable() for c in self.cache):
            state.snapshot = [(_copy_state(c.state), c.meta_state) for c in self.cache]
        else:
            state.windows = [c.checkpoint() if hasattr(c, "checkpoint") else None for c in self.cache]
        return state

    # -- document cache store ---------------------------------------------------
    def document_key(self, content_hash: str, context: Any, *, reads_images: bool) -> DocKey | None:
        """The store key of a document under this model and cache spec (None
        without a store); ``reads_images`` as the document was (or would be) read."""
        if self.store is None:
            return None
        if self._model_identity is None:
            loaded = self.loaded
            self._model_identity = model_identity(loaded.name, loaded.config, loaded.model,
                                                  getattr(loaded, "model_dir", None))
        return document_key(content_hash, context, self._model_identity, self.cache_spec, reads_images=reads_images)

    def load_cached(self, prompt: DocumentPrompt, key: DocKey, *, reserve: int = 0,
                    hit: Hit | None = None) -> _Prefilled | None:
        """The document's stored cache as a prefilled state, or None on a miss.

        ``hit``: the entry already loaded (by a caller that took the prompt
        from it); else it is loaded here and must hold ``prompt``'s tokens.
        The loaded layers must be the classes this model and cache spec
        would build (the key says they are; a mismatch is still a miss).
        """
        if hit is None:
            hit = self.store.load(key, prompt.prefix_ids)
        if hit is None:
            return None
        fresh = _make_cache(self.loaded.model, self.cache_spec)  # also installs the attention hook
        if [type(c) for c in fresh] != [type(c) for c in hit.caches]:
            self.store.discard(key, "its layer caches are not the ones this model and cache spec build")
            return None
        # the load ends with the cache in place on the device: reserved and
        # evaluated (on CUDA the GPU's first touch of the loaded buffers)
        t0 = time.perf_counter()
        self.cache = hit.caches
        total = len(prompt.prefix_ids)
        for c in self.cache:
            if hasattr(c, "reserve"):
                c.reserve(total + reserve)
        mx.eval([c.state for c in self.cache])
        self.cache_loads += 1
        state = self._prefilled(total, 0.0, hit.info.get("pos_delta"), int(hit.info.get("pos_ndim", 2)))
        state.settled = True  # save_cached settles a cache before writing it
        load_s = hit.load_s + time.perf_counter() - t0
        state.doc_cache = {"hit": True, "load_s": round(load_s, 4), "entry": hit.path.stem}
        return state

    def save_cached(self, prompt: DocumentPrompt, key: DocKey, state: _Prefilled, info: dict | None = None) -> None:
        """Store the freshly prefilled cache under ``key`` (errors are logged, never raised).

        Settled first (as every task would settle it), so the entry holds the
        bytes the record reports and a loaded cache's ``settle`` is a no-op."""
        self.settle(state)
        t0 = time.perf_counter()
        meta = {"length": state.length, "pos_delta": state.pos_delta, "pos_ndim": state.pos_ndim,
                "prefill_s": round(state.prefill_s, 4), **(info or {})}
        path = self.store.save(key, self.cache, prompt.prefix_ids, meta)
        state.doc_cache = {"hit": False, "saved": path is not None, "save_s": round(time.perf_counter() - t0, 4),
                           "entry": self.store.path_for(key).stem}

    def prepare(self, prompt: DocumentPrompt, *, reserve: int = 0, key: DocKey | None = None,
                info: dict | None = None, on_tokens: Callable[[int], None] | None = None) -> _Prefilled:
        """The document in the cache: loaded from the store when it holds ``key``,
        else prefilled (and then stored).  ``info`` goes into a new entry's listing."""
        use_store = self.store is not None and key is not None
        if use_store:
            state = self.load_cached(prompt, key, reserve=reserve)
            if state is not None:
                if on_tokens is not None:
                    on_tokens(state.length)
                return state
        state = self.prefill(prompt, reserve=reserve, on_tokens=on_tokens)
        if use_store:
            self.save_cached(prompt, key, state, info)
        return state

    def _mrope_positions(self, ids: mx.array, prompt: DocumentPrompt) -> tuple[mx.array | None, int | None]:
        """Multimodal RoPE position ids for the whole prefix (Qwen2-VL style), or (None, None).

        Only integers [3, 1, L]: cheap to hold for the whole document, and they
        must be global (an image shifts the positions of every later token).
        """
        get = getattr(self.lm, "get_rope_index", None)
        grids = [extra.get("image_grid_thw") for _, _, extra in prompt.image_spans]
        if get is None or any(g is None for g in grids):
            return None, None
        grid = mx.concatenate([mx.array(g) for g in grids], axis=0)
        positions, deltas = get(ids, image_grid_thw=grid)
        return positions, int(mx.array(deltas).reshape(-1)[0].item())

    def _embed_images(self, ids: mx.array, extras: list[dict]) -> mx.array:
        """Input embeddings of one chunk with its pages' image features merged in,
        through the model's own ``get_input_embeddings`` (vision tower + scatter)."""
        inputs = concat_image_inputs(extras)
        pixel_values = inputs.pop("pixel_values", None)
        feats = self.loaded.model.get_input_embeddings(ids, pixel_values, mask=None, **inputs)
        return feats.inputs_embeds

    def cache_nbytes(self) -> int:
        """Bytes the cache holds for its tokens (``used_nbytes`` where a cache
        reserves capacity ahead, else its allocated ``nbytes``)."""
        return int(sum(getattr(c, "used_nbytes", None) or getattr(c, "nbytes", 0) for c in self.cache or []))

    def cache_allocated(self) -> int:
        return int(sum(getattr(c, "nbytes", 0) for c in self.cache or []))

    def _rewind(self, state: _Prefilled) -> None:
        """Put the cache back to exactly the prefilled document."""
        if state.snapshot is None:
            extra = self.cache[0].offset - state.length
            for c, saved in zip(self.cache, state.windows or [None] * len(self.cache)):
                if saved is None:
                    c.trim(extra)
                else:
                    c.restore(saved)  # also undoes flushes out of the exact window
        else:
            for c, (arrays, meta) in zip(self.cache, state.snapshot):
                c.state = _copy_state(arrays)
                c.meta_state = meta

    # -- tasks --------------------------------------------------------------
    def run_task(self, state: _Prefilled, task: Any, task_ids: Sequence[int], *, on_token: Callable[[int], None] | None = None) -> TaskResult:
        """Append the task tokens to the prefilled document, decode, rewind.

        ``format: json`` tasks decode through a per-row logits processor
        (:func:`~pipeline.inference.constrained.json_processor`) called with
        the tokens so far before each sample, so the answer is valid JSON.
        TurboQuant caches ``hold`` while the task runs: its tokens stay exact
        and the packed document is never written (what batched rows see too).
        """
        self.settle(state)
        t0 = time.perf_counter()
        ids = mx.array(list(task_ids), dtype=mx.int32)[None]
        row = Row.for_task(task, self.seed, json_processor(task, self.loaded.tokenizer))
        try:
            for c in self.cache:
                if hasattr(c, "hold"):
                    c.hold = True
            logits = self._forward(ids, None, self._positions(state, ids.shape[1]), logits=True)
            mx.eval(logits)
            t1 = time.perf_counter()

            def step(y: mx.array) -> mx.array:
                return self._forward(y[:, None], None, self._positions(state, 1), logits=True)

            self.decode_forwards += _decode([row], logits, step, self.eos_ids, on_token=on_token)
            nbytes_end = self.cache_nbytes()
        finally:
            self._rewind(state)
        return self._result(state, task, task_ids, row, t1 - t0, row.done_at - t1, nbytes_end)

    def settle(self, state: _Prefilled) -> None:
        """Before the first task: quantize what the last prefill chunk left
        beyond TurboQuant's exact window (tasks ``hold`` the window, so it
        would otherwise stay exact for every task) and re-mark the rewind
        point.  Idempotent; the same tokens a task's first append would flush.

        Its time is part of the prefill (it quantizes the document's tail), so
        the first call adds it to ``state.prefill_s``: a task's time to first
        token is then ``prefill_s + task_prefill_s`` with nothing in between."""
        if state.windows is None or state.settled:
            return
        t0 = time.perf_counter()
        for c in self.cache:
            if hasattr(c, "settle"):
                c.settle()
        mx.eval([c.state for c in self.cache])
        state.windows = [c.checkpoint() if hasattr(c, "checkpoint") else None for c in self.cache]
        state.nbytes = self.cache_nbytes()
        state.exact_tokens = exact_tokens(self.cache)
        state.settled = True
        state.prefill_s += time.perf_counter() - t0

    def _result(self, state: _Prefilled, task: Any, task_ids: Sequence[int], row: Row,
                task_prefill_s: float, decode_s: float, nbytes_end: int, rows: int = 1) -> TaskResult:
        timing = {"prefill_s": round(state.prefill_s, 4), "task_prefill_s": round(task_prefill_s, 4),
                  "decode_s": round(decode_s, 4)}
        if rows > 1:  # decoded side by side: the suffix pass and decode time overlap the other rows'
            timing["batch_rows"] = rows
        return TaskResult(
            task=task.name,
            text=self.loaded.tokenizer.decode(row.tokens),
            token_ids=row.tokens,
            finish_reason=row.finish,
            tokens={"document": state.length, "task_prompt": len(task_ids), "generated": len(row.tokens)},
            timing=timing,
            cache=self.cache_record(state.nbytes, nbytes_end, tokens=state.length,
                                    tokens_end=state.length + len(task_ids) + len(row.tokens),
                                    exact=state.exact_tokens, doc_cache=state.doc_cache),
            constrained=row.processor is not None,
        )

    def can_batch(self, state: _Prefilled) -> bool:
        """Whether this document's tasks can decode as one batch of rows
        (``run_batch``): a text model with plain RoPE positions, every layer's
        cache one the shared-prefix attention reads, and attention routed
        through the models' base function (``turboquant.integration``)."""
        if self.loaded.kind != "text" or state.pos_delta is not None or self.backbone is None:
            return False
        from turboquant.shared_prefix import shareable

        return shareable(self.loaded.model, self.cache)

    def run_batch(self, state: _Prefilled, tasks: Sequence[Any], task_ids: Sequence[Sequence[int]], *,
                  on_token: Callable[[int], None] | None = None) -> list[TaskResult]:
        """All ``tasks`` as one batch of rows over the prefilled document.

        Suffixes are left-padded to the longest, so one forward pass appends
        them all; each decode step then reads the document cache once for
        every row (``turboquant.shared_prefix``).  The document cache is not
        written, so there is nothing to rewind.
        """
        from turboquant.integration import install
        from turboquant.shared_prefix import SharedPrefixCache

        install()
        self.settle(state)
        t0 = time.perf_counter()
        S = max(len(ids) for ids in task_ids)
        pads = [S - len(ids) for ids in task_ids]
        ids = mx.array([[0] * p + list(t) for p, t in zip(pads, task_ids)], dtype=mx.int32)
        rows_cache = [SharedPrefixCache(c, pads) for c in self.cache]
        rows = [Row.for_task(t, self.seed, json_processor(t, self.loaded.tokenizer)) for t in tasks]
        logits = self._forward(ids, None, None, logits=True, cache=rows_cache)
        mx.eval(logits)
        t1 = time.perf_counter()

        def step(y: mx.array) -> mx.array:
            return self._forward(y[:, None], None, None, logits=True, cache=rows_cache)

        def keep(positions: list[int]) -> None:
            for c in rows_cache:
                c.keep(positions)

        self.decode_forwards += _decode(rows, logits, step, self.eos_ids, keep=keep, on_token=on_token)
        nbytes_end = self.cache_nbytes() + sum(c.nbytes for c in rows_cache)
        return [self._result(state, t, ids_, r, t1 - t0, r.done_at - t1, nbytes_end, rows=len(rows))
                for t, ids_, r in zip(tasks, task_ids, rows)]

    def cache_record(self, nbytes_prefill: int, nbytes_end: int | None = None, *, tokens: int | None = None,
                     tokens_end: int | None = None, exact: int | None = None, doc_cache: dict | None = None) -> dict:
        """The record's ``cache`` field: scheme and widths, the bytes held after
        prefill and at the end of the task, each with the fp16 bytes for the
        same tokens (:mod:`pipeline.inference.kv_size`) so the saving is explicit."""
        spec = self.cache_spec
        rec = {
            "scheme": spec.kv_quant_scheme,
            "kv_bits": spec.kv_bits if spec.kv_quant_scheme != "fp16" else None,
            "nbytes_after_prefill": nbytes_prefill,
            "nbytes_allocated": getattr(self, "allocated_after_prefill", None),
            "prefill_chunk": spec.prefill_chunk,
        }
        if spec.kv_quant_scheme == "turboquant":
            rec.update(key_bits=spec.key_bits, value_bits=spec.value_bits, window=spec.window,
                       quantizer=spec.quantizer)
        if nbytes_end is not None:
            rec["nbytes_end_of_task"] = nbytes_end
        geom = KVGeometry.from_config(getattr(self.loaded, "config", None))
        if tokens is not None:
            rec.update(figures(nbytes_prefill, tokens, geom))
            if geom is not None:  # lets a reader (tqpipe report) draw the size formulas for this model
                rec["geometry"] = dataclasses.asdict(geom)
            if exact is not None:
                rec["exact_tokens"] = exact
        if tokens_end is not None and nbytes_end is not None and geom is not None:
            rec["tokens_end_of_task"] = tokens_end
            rec["fp16_nbytes_end_of_task"] = geom.fp16_nbytes(tokens_end)
        if doc_cache is not None:
            rec["doc_cache"] = doc_cache
        return rec

    def iter_process(
        self,
        prompt: DocumentPrompt,
        tasks: Sequence[Any],
        *,
        on_prefill: Callable[[int], None] | None = None,
        on_token: Callable[[int], None] | None = None,
        key: DocKey | None = None,
        info: dict | None = None,
        state: _Prefilled | None = None,
    ) -> Iterator[TaskResult]:
        """Prefill ``prompt`` once (or load it: ``prepare``), then yield each
        task's result in task order: all at once after a batch of rows, else
        each as soon as it is done.  ``state``: the document is already in
        the cache (``load_cached`` with a hit the caller holds)."""
        self._check_vocabulary(prompt, tasks)
        if state is None:
            state = self.prepare(prompt, reserve=reserve_for(prompt, tasks), key=key, info=info,
                                 on_tokens=on_prefill)
        try:
            if self.batch_tasks and len(tasks) > 1 and self.can_batch(state):
                ids = [prompt.task_ids[t.name] for t in tasks]
                yield from self.run_batch(state, tasks, ids, on_token=on_token)
                return
            for task in tasks:
                yield self.run_task(state, task, prompt.task_ids[task.name], on_token=on_token)
        except RuntimeError as e:  # MLX's bare "no kernel" for affine on CUDA: say what it means
            from turboquant.affine import explain_cuda_error

            better = explain_cuda_error(e)
            if better is e:
                raise
            raise better from e
        finally:
            self.cache = None
            mx.clear_cache()

    def _check_vocabulary(self, prompt: DocumentPrompt, tasks: Sequence[Any]) -> None:
        """A token id past the model's embedding rows is an error for this
        document: MLX's gather does not check bounds (on a CPU the process
        crashes, on a GPU the answer is silently noise).  Only a tokenizer
        that does not belong to the model produces one."""
        if self.vocab_size is None:
            return
        top = max([*prompt.prefix_ids, *(i for t in tasks for i in prompt.task_ids[t.name])], default=0)
        if top >= self.vocab_size:
            raise TqpipeError(f"token id {top} is outside the model's {self.vocab_size}-token vocabulary: "
                              "the tokenizer does not match the model")

    def process(self, prompt: DocumentPrompt, tasks: Sequence[Any], *, key: DocKey | None = None) -> list[TaskResult]:
        """All task results of one document (see ``iter_process``)."""
        return list(self.iter_process(prompt, tasks, key=key))

    def warm_up(self) -> None:
        """Run a short made-up document and task through this engine once.

        A process's first document on a GPU pays one-time setup besides its
        own work: cuBLAS handles, MLX's kernel modules, our kernels' cubins
        read from the store and loaded.  A document loaded from the document
        cache has almost no work of its own, so there that setup was most of
        its time to first token (the task's prefill took 0.49 s against
        0.08-0.09 s after a prefill; H100, 8B shape).  Run here, once per
        engine, it is part of starting the engine, as llama.cpp warms a model
        up.  The document has packed history (past the exact window) and the
        task more tokens than a decode step has rows, so the cache's prefill,
        task-prefill and decode-step kernels all run.  Counters and the
        cache are left as they were; a failure is a warning, never an error:
        the warm-up only moves time.
        """
        counters = (self.prefill_count, self.tokens_forwarded, self.decode_forwards)
        n = getattr(self.cache_spec, "window", 0) + WARM_UP_PACKED
        ids = [2 + (7 * i) % 61 for i in range(n + WARM_UP_SUFFIX)]
        task = TaskSpec(name="warm-up", prompt="warm-up", max_tokens=2)
        prompt = DocumentPrompt(prefix_ids=ids[:n], task_ids={task.name: ids[n:]}, page_offsets={1: 0},
                                included_pages=[1], skipped_pages=[])
        try:
            self.process(prompt, [task])
            if self.store is not None:  # the staging buffers a document-cache load reads through
                gpu_upload.prepare()
        except Exception as e:
            logger.warning("engine warm-up skipped (%s: %s); the first document pays the GPU's one-time setup",
                           type(e).__name__, e)
        finally:
            self.cache = None
            self.prefill_count, self.tokens_forwarded, self.decode_forwards = counters


def reserve_for(prompt: DocumentPrompt, tasks: Sequence[Any]) -> int:
    """Tokens a cache needs past the document: the longest task suffix plus its answer."""
    return max(len(prompt.task_ids[t.name]) + t.max_tokens for t in tasks)


def _chunks(total: int, step: int, spans: Sequence[tuple[int, int, dict]]) -> Iterator[tuple[int, int, list[dict]]]:
    """Prefill chunks ``(start, end, image inputs inside)``: ``step`` tokens,
    stretched where needed so no page image is split across two chunks (the
    model merges a whole image's features into one run of image tokens)."""
    start = 0
    while start < total:
        end = min(start + step, total)
        for s, e, _ in spans:
            if s < end < e:
                end = e
        yield start, end, [extra for s, e, extra in spans if start <= s and e <= end]
        start = end


def _copy_state(state: Any) -> Any:
    """New array handles for a cache state, so in-place cache updates can't alter a snapshot."""
    if isinstance(state, (list, tuple)):
        return type(state)(_copy_state(s) for s in state)
    return mx.array(state) if isinstance(state, mx.array) else state
