"""``tqpipe run --dry-run``: ingest and tokenize every document, load no weights, write nothing.

Answers "what would this job do?" per document: pages read, images, prompt
tokens, and whether the document fits the context limit (or what truncation
would drop), with the same page selection and prompt builder as a real run.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pipeline.errors import ContextOverflowError, IngestError, RunError, TqpipeError
from pipeline.inference.kv_size import KVGeometry, cache_nbytes_formula
from pipeline.inference.prompt import PromptBuilder, effective_context
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.ingest import ingest
from pipeline.schema.job import Job
from pipeline.schema.paths import shown


class Tokenizers:
    """Tokenizer (and processor, for VLMs) without weights, for ``--dry-run``."""

    def __init__(self, job: Job):
        self.job = job
        self._builders: dict[bool, PromptBuilder] = {}

    def get(self, images: bool) -> PromptBuilder:
        """The prompt builder for a document with (or without) page images, as :class:`Engines` would pick."""
        path = self.job.spec.model.path
        slot = bool(images) if path is None else False
        if slot not in self._builders:
            self._builders[slot] = tokenizer_only(path, slot)
        return self._builders[slot]


def tokenizer_only(path: str | None, images: bool) -> PromptBuilder:
    """A prompt builder from the model folder's tokenizer (and processor) files, no weights."""
    import importlib

    from pipeline.models.load import (builtin_text_model_dir, builtin_vlm_dir, is_vlm_config, read_config,
                                      require_mlx_vlm, resolve_model_dir)

    model_dir = (builtin_vlm_dir() if images else builtin_text_model_dir()) if path is None else resolve_model_dir(path)
    config = read_config(model_dir)
    if is_vlm_config(config):
        require_mlx_vlm(f"model {path!r}")
        importlib.import_module(f"mlx_vlm.models.{config['model_type'].replace('-', '_')}")  # registers its processor
        from mlx_vlm.utils import load_processor

        processor = load_processor(model_dir, add_detokenizer=False)
        builder = PromptBuilder(getattr(processor, "tokenizer", processor), processor=processor, kind="vlm")
    else:
        from transformers import AutoTokenizer

        builder = PromptBuilder(AutoTokenizer.from_pretrained(str(model_dir)), kind="text")
    builder.model_config = config  # for the model's own context limit
    return builder


def dry_run_document(tokenizers: Tokenizers, job: Job, ref: DocumentRef) -> dict:
    """Ingest and tokenize one document; say whether it fits the context limit."""
    row: dict = {"doc_id": shown(ref.doc_id), "source": shown(ref.source)}
    try:
        doc = ingest(ref, job.spec.context)
    except (IngestError, OSError) as e:
        return {**row, "error": str(e)}
    row.update(pages=len(doc.pages), page_count=doc.page_count, skipped_pages=len(doc.skipped_pages),
               images=sum(p.image is not None for p in doc.pages))
    if doc.pages_clipped:
        row["clipped"] = True
    try:
        builder = tokenizers.get(doc.needs_images)
        context = effective_context(job.spec.context, getattr(builder, "model_config", None))
        prompt = builder.build(doc, context, job.spec.tasks)
    except ContextOverflowError as e:
        return {**row, "fits": False, "error": str(e)}
    except RunError:
        raise  # the model (its tokenizer) cannot be loaded: one line for the run, exit 4
    except TqpipeError as e:
        return {**row, "error": str(e)}
    trunc = prompt.truncation
    row.update(tokens=prompt.n_tokens + trunc.get("tokens_dropped", 0), fits=not trunc["truncated"])
    geom = KVGeometry.from_config(getattr(builder, "model_config", None))
    if geom is not None:  # what the cache will hold for the prompt actually prefilled
        row["kv"] = {"scheme": job.spec.cache.kv_quant_scheme,
                     "nbytes": cache_nbytes_formula(geom, job.spec.cache, prompt.n_tokens, exact_bytes=_exact_bytes()),
                     "fp16_nbytes": geom.fp16_nbytes(prompt.n_tokens)}
    if trunc["truncated"]:
        row["truncate"] = {k: trunc[k] for k in ("tokens_dropped", "pages_dropped", "partial_page")}
    return row


def dry_run(job: Job, refs: Sequence[DocumentRef], echo: Callable[[str], None]) -> list[str]:
    """Echo one line per document; return the doc ids that failed (a fit
    problem under ``overflow: error`` is reported, not counted as failed)."""
    tokenizers = Tokenizers(job)
    failed = []
    for ref in refs:
        row = dry_run_document(tokenizers, job, ref)
        echo(dry_line(row))
        if "error" in row and row.get("fits") is not False:
            failed.append(ref.doc_id)
    return failed


def dry_line(row: dict) -> str:
    """One line per document for ``--dry-run``."""
    if "pages" not in row:
        return f"{row['doc_id']}: ERROR {row['error']}"
    head = f"{row['doc_id']}: pages={row['pages']}/{row['page_count']} images={row['images']}"
    if "tokens" not in row:
        return f"{head} fits=no ({row['error']})" if row.get("fits") is False else f"{head} ERROR {row['error']}"
    line = f"{head} tokens={row['tokens']}"
    if "kv" in row:
        kv = row["kv"]
        line += (f" kv={kv['nbytes'] / 2**20:.1f}MiB ({kv['scheme']}; fp16 {kv['fp16_nbytes'] / 2**20:.1f}MiB,"
                 f" {kv['nbytes'] / max(kv['fp16_nbytes'], 1):.2f}x)")
    line += f" fits={'yes' if row['fits'] else 'no'}"
    if "truncate" in row:
        t = row["truncate"]
        line += f" (truncate would drop {t['tokens_dropped']} tokens, pages {page_ranges(t['pages_dropped'])})"
    if row.get("clipped"):
        line += " (pages clipped to the document)"
    return line


def _exact_bytes() -> int:
    """Bytes per exact-window element: float32 on the CPU path (the model runs in
    float32 there, see :func:`pipeline.models.load.prepare_for_device`), else fp16."""
    import mlx.core as mx

    return 4 if mx.default_device() == mx.cpu else 2


def page_ranges(pages: Sequence[int], *, limit: int = 8) -> str:
    """``[20, 21, ..., 2000]`` as ``20-2000``: one short line even for a 2,000-page document;
    past ``limit`` runs the rest is counted, not listed."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    if len(runs) > limit:
        text += f",... ({sum(b - a + 1 for a, b in runs[limit:])} more)"
    return text or "none"
