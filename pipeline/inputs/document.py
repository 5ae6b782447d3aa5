"""A document as read: its selected pages (text, image), what was skipped, and notes.

Failures are isolated at two levels.  A document that cannot be used at all
raises :class:`IngestError` naming the file, and the runner records it and
goes on.  A single page that fails is retried ``page_retries`` times, then
skipped and listed in ``Document.skipped_pages``; only when the skipped
fraction exceeds ``max_failed_page_fraction`` does the whole document fail.
:func:`read_pages` is that rule, shared by PDFs and image sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from pipeline.errors import IngestError, PageRangeError
from pipeline.inputs.discover import DocumentRef
from pipeline.schema.job import ContextSpec
from pipeline.schema.pages import clip_pages

if TYPE_CHECKING:
    import PIL.Image


@dataclass
class Page:
    """One selected page: its text layer and, where the job wants it, a rendered image."""

    number: int  # 1-based, in the original document
    text: str
    image: "PIL.Image.Image | None"
    scanned: bool
    via: Literal["text", "ocr", "image"] = "text"  # how the page enters the context (recorded per page)
    incomplete: bool = False  # the reader reported damage: the text kept may lack parts of the page

    @property
    def empty(self) -> bool:
        """No text and no image: the page adds nothing to the context."""
        return self.image is None and not self.text.strip()


#: How a page without a text layer enters the context: its image, its OCR'd text, or not at all.
ScannedRoute = Literal["image", "ocr", "none"]


def scanned_route(images: str, model_reads_images: bool) -> ScannedRoute:
    """The one place that decides what becomes of a scanned page or an image-set page.

    ``images: ocr`` always reads the pixels into text; ``never`` leaves the
    page empty; ``auto`` sends the image to a model that reads images (a
    VLM) and OCRs it for a text-only model, so a text model still answers
    from what is printed; ``always`` sends images (a text-only model then
    fails with an error saying so).
    """
    if images == "never":
        return "none"
    if images == "ocr" or (images == "auto" and not model_reads_images):
        return "ocr"
    return "image"


@dataclass
class Document:
    """A read document: the pages that could be read, the ones skipped, and notes for the record."""

    ref: DocumentRef
    content_hash: str
    page_count: int  # pages in the file, before selection
    pages: list[Page]  # selected pages that were read successfully
    skipped_pages: list[dict] = field(default_factory=list)  # {"page": n, "error": "..."}
    notes: list[str] = field(default_factory=list)
    pages_clipped: str | None = None  # what of context.pages lay past the end, if anything
    empty_pages: list[int] = field(default_factory=list)  # read, but no text and no image (blank, OCR found none)
    incomplete_pages: list[int] = field(default_factory=list)  # read with damage reported: text may be partial
    # pages that failed for want of memory or I/O, not for their content: a
    # document failing on them is worth a plain rerun (IngestError.transient)
    transient_skips: int = field(default=0, compare=False)

    def text(self, markers: bool = True) -> str:
        """All page texts, each after a ``[Page N]`` marker (numbers from the original file)."""
        if not markers:
            return "\n\n".join(p.text.strip() for p in self.pages)
        return "\n\n".join(f"[Page {p.number}]\n{p.text.strip()}" for p in self.pages)

    @property
    def needs_images(self) -> bool:
        """True if a page carries an image, so the model must be a VLM."""
        return any(p.image is not None for p in self.pages)

    def stored_fields(self) -> dict:
        """What a record says of the document beyond its prompt (JSON data),
        kept with a stored document cache so a later run can write the same
        records without reading the document (:meth:`from_stored`)."""
        return {"page_count": self.page_count, "skipped_pages": list(self.skipped_pages),
                "notes": list(self.notes), "pages_clipped": self.pages_clipped,
                "empty_pages": list(self.empty_pages), "incomplete_pages": list(self.incomplete_pages)}

    @classmethod
    def from_stored(cls, ref: DocumentRef, content_hash: str, fields: dict) -> "Document":
        """A document known from a stored cache: its record fields, no pages."""
        return cls(ref=ref, content_hash=content_hash, page_count=int(fields["page_count"]), pages=[],
                   skipped_pages=list(fields["skipped_pages"]), notes=list(fields["notes"]),
                   pages_clipped=fields["pages_clipped"], empty_pages=list(fields.get("empty_pages", [])),
                   incomplete_pages=list(fields.get("incomplete_pages", [])))


def read_pages(
    ref: DocumentRef,
    digest: str,
    page_count: int,
    context: ContextSpec,
    read_page: Callable[[int], tuple[Page, list[str]]],
) -> Document:
    """Read the pages ``context.pages`` selects of a ``page_count``-page document.

    ``read_page(n)`` returns page ``n`` (1-based) and its notes, or raises;
    each page gets ``1 + page_retries`` attempts.  A selection reaching past
    the document is clipped (``Document.pages_clipped`` says what; the records
    carry the ``pages_clipped`` warning).  Raises :class:`IngestError` when no
    selected page exists or too many pages failed.
    """
    try:
        numbers, clipped = clip_pages(context.pages, page_count, document=ref.source)
    except PageRangeError as e:
        raise IngestError(ref.source, f"pages {context.pages!r}: {e.problem}") from None
    doc = Document(ref=ref, content_hash=digest, page_count=page_count, pages=[], pages_clipped=clipped)
    for n in numbers:
        page = _with_retries(lambda: read_page(n), n, context, doc)
        if page is not None:
            doc.pages.append(page)
            if page.empty:
                doc.empty_pages.append(n)
            if page.incomplete:
                doc.incomplete_pages.append(n)
    _check_failures(doc, len(numbers), context)
    return doc


def _with_retries(read, number: int, context: ContextSpec, doc: Document) -> Page | None:
    """Run ``read`` up to 1 + page_retries times; on final failure record the page as skipped."""
    error = None
    for _ in range(1 + context.page_retries):
        try:
            page, notes = read()
        except Exception as e:  # any failure of one page must not take down the document
            error = f"{type(e).__name__}: {e}"
            transient = isinstance(e, (MemoryError, OSError))
            continue
        doc.notes.extend(notes)
        return page
    doc.transient_skips += transient
    doc.skipped_pages.append({"page": number, "error": error})
    doc.notes.append(f"page {number}: skipped after {1 + context.page_retries} attempt(s): {error}")
    return None


def _check_failures(doc: Document, selected: int, context: ContextSpec) -> None:
    failed = len(doc.skipped_pages)
    if not doc.pages or failed / selected > context.max_failed_page_fraction:
        listed = ", ".join(str(s["page"]) for s in doc.skipped_pages[:10])
        more = ", ..." if failed > 10 else ""
        raise IngestError(
            doc.ref.source,
            f"{failed} of {selected} selected pages could not be read (pages {listed}{more}; "
            f"limit context.max_failed_page_fraction={context.max_failed_page_fraction:g}); "
            f"first error: {doc.skipped_pages[0]['error']}",
            transient=doc.transient_skips > 0,
        )
