"""Turn one ingested document into prompt tokens: a shared prefix plus one suffix per task.

Every task of a document asks a different question about the SAME text, so
the document should be read (prefilled) once.  That only works if the tokens
of the document do not depend on the task.  We therefore render the model's
own chat template ONCE with a unique placeholder where the task text goes and
split the rendered string there:

    prefix = template head + document pages   (prefilled once, cached)
    suffix = task text + template tail        (end of user turn, assistant header)

Each page is preceded by a private sentinel while rendering; splitting at the
sentinels gives one segment per page, tokenized separately and concatenated.
That yields the exact token offset where every page starts (so answers can be
traced to pages) and lets truncation drop whole trailing pages without
re-tokenizing the document.  The segment tokens ARE the prompt: nothing is
re-tokenized as a whole, so offsets can't drift.

For vision-language models a page with an image contributes an image item in
the chat message; its segment goes through the model's processor, which
expands the image placeholder into the right number of image tokens and
returns the pixel inputs.  Per-segment processor outputs are concatenated in
page order, matching the order of image tokens in the prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from pipeline.errors import ContextOverflowError, TqpipeError

PAGE_SENTINEL = "\ue000{}\ue001"
TASK_PLACEHOLDER = "\ue002task\ue003"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_PRIVATE = re.compile("[\ue000-\ue003]")
_FALLBACK_TEMPLATE = "User: {content}\nAssistant:"


class ImagesNeedVLMError(TqpipeError):
    """A document's pages are images but the model can only read text."""


@dataclass
class DocumentPrompt:
    """Everything the engine needs to run all tasks of one document.

    ``prefix_ids`` are prefilled once; ``task_ids[name]`` are appended per task.
    ``image_spans`` lists, per page with an image, the token range of that
    page in ``prefix_ids`` and the processor's pixel inputs for it, so the
    engine can run the vision tower one prefill chunk at a time.
    """

    prefix_ids: list[int]
    task_ids: dict[str, list[int]]
    page_offsets: dict[int, int]
    included_pages: list[int]
    skipped_pages: list[dict]
    image_spans: list[tuple[int, int, dict]] = field(default_factory=list)
    truncation: dict = field(default_factory=lambda: {"truncated": False})
    page_via: dict[int, str] = field(default_factory=dict)  # included page -> "text" | "ocr" | "image"

    @property
    def n_tokens(self) -> int:
        return len(self.prefix_ids)

    @property
    def n_images(self) -> int:
        return len(self.image_spans)

    @property
    def image_inputs(self) -> dict[str, Any]:
        """All pages' pixel inputs concatenated in token order (for a whole-prompt forward)."""
        return concat_image_inputs([extra for _, _, extra in self.image_spans])

    def stored_fields(self) -> dict:
        """What a stored document cache keeps of this prompt besides its token
        ids, so a later run can use the cache without reading the document:
        the record's ``pages`` field plus the token count, image token ranges
        and truncation (JSON data; :meth:`from_stored` is the inverse)."""
        return {**self.pages_record(), "tokens": len(self.prefix_ids),
                "image_spans": [[s, e] for s, e, _ in self.image_spans], "truncation": dict(self.truncation)}

    @classmethod
    def from_stored(cls, prefix_ids: list[int], fields: dict, task_ids: dict[str, list[int]]) -> "DocumentPrompt":
        """The prompt of a stored document cache: its token ids and
        :meth:`stored_fields`, with this run's task suffixes.  Image spans keep
        their token ranges, not their pixels: the cache already holds them."""
        if fields.get("tokens") != len(prefix_ids):
            raise ValueError(f"stored prompt lists {fields.get('tokens')} tokens, the cache holds {len(prefix_ids)}")
        return cls(
            prefix_ids=list(prefix_ids),
            task_ids=task_ids,
            page_offsets={int(p): int(o) for p, o in fields["token_offsets"].items()},
            included_pages=[int(p) for p in fields["included"]],
            skipped_pages=list(fields["skipped"]),
            image_spans=[(int(s), int(e), {}) for s, e in fields["image_spans"]],
            truncation=dict(fields["truncation"]),
            page_via={int(p): v for p, v in fields["via"].items()},
        )

    def pages_record(self) -> dict:
        """The ``pages`` field of a result record: what went in and where."""
        return {
            "included": self.included_pages,
            "skipped": self.skipped_pages,
            "token_offsets": {str(p): o for p, o in self.page_offsets.items()},
            "via": {str(p): v for p, v in self.page_via.items()},
        }


def _via(page: Any, has_image_tokens: bool) -> str:
    """How a page went in: its image, its OCR'd text, or its text layer."""
    if has_image_tokens:
        return "image"
    return "ocr" if getattr(page, "via", "text") == "ocr" else "text"


def task_text(task: Any) -> str:
    """The user-visible task instruction, with the JSON contract for extract tasks."""
    text = task.prompt.strip()
    if getattr(task, "format", "text") == "json":
        keys = ", ".join(task.fields) if getattr(task, "fields", None) else None
        text += (
            f"\nAnswer with one JSON object with the keys: {keys}."
            if keys
            else "\nAnswer with one JSON object."
        )
    return text


class PromptBuilder:
    """Builds ``DocumentPrompt``s with a model's tokenizer (and processor, for VLMs).

    Needs no model weights, so ``--dry-run`` can use it with a tokenizer alone.
    """

    def __init__(self, tokenizer: Any, *, processor: Any = None, kind: Literal["text", "vlm"] = "text"):
        self.tokenizer = tokenizer
        self.processor = processor
        self.kind = kind

    # -- template ---------------------------------------------------------
    def _render(self, items: list[dict]) -> str:
        """Render a one-message chat with the model's template (text or multimodal content)."""
        if self.kind == "vlm":
            content: Any = items
        else:
            content = "".join(i["text"] for i in items)
        messages = [{"role": "user", "content": content}]
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        if getattr(owner, "chat_template", None) is None:
            text = content if isinstance(content, str) else "".join(i.get("text", "") for i in items)
            return _FALLBACK_TEMPLATE.format(content=text)
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str, images: Sequence[Any] = (), *, first: bool = False) -> tuple[list[int], dict]:
        if images:
            from mlx_vlm.utils import prepare_inputs

            inputs = prepare_inputs(self.processor, images=list(images), prompts=[text], add_special_tokens=False, padding=False)
            ids = [int(t) for t in inputs["input_ids"].reshape(-1).tolist()]
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask") and v is not None}
            return ids, extra
        tok = getattr(self.tokenizer, "tokenizer", self.tokenizer) if self.kind == "vlm" else self.tokenizer
        add_special = False
        if first:
            bos = getattr(tok, "bos_token", None)
            add_special = bos is None or not text.startswith(bos)
        return list(tok.encode(text, add_special_tokens=add_special)), {}

    # -- building ---------------------------------------------------------
    def build(self, document: Any, context: Any, tasks: Sequence[Any]) -> DocumentPrompt:
        """Tokenize ``document`` for ``tasks`` under the limits of ``context``.

        Raises ``ContextOverflowError`` when the document does not fit and the
        job says ``overflow: error`` (or when not even the template fits), and
        ``ImagesNeedVLMError`` when a text model would have to read page images.
        """
        source = str(getattr(document.ref, "source", document.ref))
        image_pages = [p.number for p in document.pages if getattr(p, "image", None) is not None]
        if image_pages and self.kind != "vlm":
            blind = [p.number for p in document.pages if p.image is not None and not p.text.strip()]
            if blind or context.images == "always":
                raise ImagesNeedVLMError(
                    f"{source}: pages {_ranges(blind or image_pages)} are images but the model is text-only; "
                    "set model.path to a vision-language model, or set context.images: ocr to read them as text"
                )

        items: list[dict] = []
        for page in document.pages:
            marker = f"[Page {page.number}]\n" if context.page_markers else ""
            items.append({"type": "text", "text": PAGE_SENTINEL.format(page.number) + marker})
            if page.image is not None and self.kind == "vlm":
                items.append({"type": "image"})
            items.append({"type": "text", "text": _PRIVATE.sub("", page.text).strip() + "\n\n"})
        items.append({"type": "text", "text": TASK_PLACEHOLDER})
        rendered = self._render(_merge_text(items))
        if rendered.count(TASK_PLACEHOLDER) != 1:
            raise TqpipeError(f"{source}: the chat template did not keep the task placeholder exactly once")
        prefix, tail = rendered.split(TASK_PLACEHOLDER)

        parts = _SENTINEL_RE.split(prefix)  # [head, n1, seg1, n2, seg2, ...]
        head_ids, _ = self._encode(parts[0], first=True)
        images = {p.number: p.image for p in document.pages if p.image is not None and self.kind == "vlm"}
        segments: list[tuple[int, list[int], dict]] = []
        for number_s, seg in zip(parts[1::2], parts[2::2]):
            n = int(number_s)
            ids, extra = self._encode(seg, [images[n]] if n in images else ())
            segments.append((n, ids, extra))

        task_ids = self._suffixes(tail, tasks)
        return self._assemble(source, document, context, head_ids, segments, task_ids, task_budget(context, tasks, task_ids))

    def _suffixes(self, tail: str, tasks: Sequence[Any]) -> dict[str, list[int]]:
        return {t.name: self._encode(task_text(t) + tail)[0] for t in tasks}

    def task_ids(self, tasks: Sequence[Any]) -> dict[str, list[int]]:
        """The task suffixes without a document: the template rendered around
        the task placeholder alone.  Equal to :meth:`build`'s for templates
        whose closing part does not depend on the message (every common one;
        a stored document cache is reused without reading only where they
        were equal when it was stored)."""
        rendered = self._render([{"type": "text", "text": TASK_PLACEHOLDER}])
        if rendered.count(TASK_PLACEHOLDER) != 1:
            raise TqpipeError("the chat template did not keep the task placeholder exactly once")
        return self._suffixes(rendered.split(TASK_PLACEHOLDER)[1], tasks)

    def _assemble(self, source, document, context, head_ids, segments, task_ids, budget) -> DocumentPrompt:
        total = len(head_ids) + sum(len(ids) for _, ids, _ in segments)
        truncation: dict = {"truncated": False}
        if total > budget:
            need = f"{total} document tokens but only {max(budget, 0)} fit (context.max_tokens={context.max_tokens} minus task prompt and max_tokens)"
            if context.overflow == "error" or len(head_ids) >= budget:
                raise ContextOverflowError(f"{source}: {need}")
            kept, used = [], len(head_ids)
            for n, ids, extra in segments:
                if used + len(ids) > budget:
                    break
                kept.append((n, ids, extra))
                used += len(ids)
            partial = None
            if len(kept) < len(segments) and budget - used > 0:
                n, ids, extra = segments[len(kept)]
                if not extra:  # cut trailing text only on pages without image tokens
                    kept.append((n, ids[: budget - used], extra))
                    partial = n
                    used = budget
            dropped = [n for n, _, _ in segments[len(kept) :]]
            truncation = {
                "truncated": True,
                "tokens_dropped": total - used,
                "pages_dropped": dropped,
                "partial_page": partial,
                "reason": need,
            }
            segments = kept

        by_number = {p.number: p for p in document.pages}
        prefix_ids = list(head_ids)
        offsets: dict[int, int] = {}
        spans: list[tuple[int, int, dict]] = []
        for n, ids, extra in segments:
            offsets[n] = len(prefix_ids)
            prefix_ids.extend(ids)
            if extra:
                spans.append((offsets[n], len(prefix_ids), extra))
        return DocumentPrompt(
            prefix_ids=prefix_ids,
            task_ids=task_ids,
            page_offsets=offsets,
            included_pages=[n for n, _, _ in segments],
            skipped_pages=list(document.skipped_pages),
            image_spans=spans,
            truncation=truncation,
            page_via={n: _via(by_number.get(n), bool(extra)) for n, _, extra in segments},
        )


def task_budget(context: Any, tasks: Sequence[Any], task_ids: dict[str, list[int]]) -> int:
    """Document tokens that fit: ``context.max_tokens`` minus the longest task
    suffix and the largest ``max_tokens`` (every task must fit after the document)."""
    return context.max_tokens - max(t.max_tokens for t in tasks) - max(len(v) for v in task_ids.values())


def _merge_text(items: list[dict]) -> list[dict]:
    """Join adjacent text items: templates render each item, and some add separators."""
    out: list[dict] = []
    for item in items:
        if item["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + item["text"]}
        else:
            out.append(dict(item))
    return out


def concat_image_inputs(extras: Sequence[dict]) -> dict[str, Any]:
    """Concatenate per-page processor outputs (pixel_values, image_grid_thw, ...) along axis 0."""
    if not extras:
        return {}
    import mlx.core as mx

    keys = list(extras[0])
    return {k: mx.concatenate([mx.array(e[k]) for e in extras], axis=0) if len(extras) > 1 else mx.array(extras[0][k])
            for k in keys}


def _ranges(numbers: list[int]) -> str:
    """[1,2,3,7] -> '1-3, 7' for readable error messages."""
    out, start, prev = [], None, None
    for n in sorted(numbers):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}-{prev}" if start != prev else str(start))
            start = prev = n
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else str(start))
    return ", ".join(out)


def model_context_limit(config: dict | None) -> int | None:
    """The model's trained context length (``max_position_embeddings``), if it says."""
    config = config or {}
    limit = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return int(limit) if limit else None


def effective_context(context: Any, config: dict | None) -> Any:
    """``context`` with ``max_tokens`` capped at the model's own limit.

    A job may ask for 32k tokens of a model trained on 8k; past its limit a
    model's positions are out of distribution and answers degrade silently,
    so the cap applies the job's overflow policy at the model's limit instead
    (the record's ``context.model_max_tokens`` says so).
    """
    limit = model_context_limit(config)
    if limit is None or limit >= context.max_tokens:
        return context
    return context.model_copy(update={"max_tokens": limit})
