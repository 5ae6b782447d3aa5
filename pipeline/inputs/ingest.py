"""Find the documents a job names and read each into pages of text and images.

Discovery (:func:`discover`) is cheap and touches no file contents, so the
runner can list work and compute :func:`content_hash` to skip finished
documents before paying for :func:`ingest`.

Ingestion reads PDFs with pymupdf: the text of every selected page, plus a
rendered image for pages that look scanned (``images: auto``), for every page
(``always``) or for none (``never``).  An image set (a folder or glob of
images) becomes ONE multi-page document, one image per page, natural order.

Failures are isolated at two levels.  A document that cannot be read at all
(zero bytes, not a PDF, encrypted, 0 pages, page range out of bounds) raises
:class:`IngestError` naming the file, and the runner records it and goes on.
A single page that fails is retried ``page_retries`` times, then skipped and
listed in ``Document.skipped_pages``; only when the skipped fraction exceeds
``max_failed_page_fraction`` does the whole document fail.

MuPDF repairs what it can and reports the rest as warnings rather than
exceptions: a page whose content stream is garbage comes back as an empty
page.  So a page counts as failed when MuPDF reported problems while reading
it AND it yielded no text; a page with problems but some text is kept, with
a note, since partial text beats none.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pipeline.errors import IngestError, JobFileError, PageRangeError
from pipeline.schema.job import ContextSpec, ImageSetInput, Job
from pipeline.schema.pages import select_pages

if TYPE_CHECKING:
    import PIL.Image

PDF_SUFFIXES = frozenset({".pdf"})
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".gif"})

#: A page with fewer stripped characters than this counts as "almost no text";
#: scanned pages often carry a stray OCR'd page number or header.
SCANNED_MAX_CHARS = 25

# MuPDF keeps one process-wide warning buffer and pymupdf is not thread-safe:
# one PDF is read at a time per process, so each page's warnings belong to it.
_MUPDF_LOCK = threading.RLock()


@dataclass(frozen=True)
class DocumentRef:
    source: Path  # the PDF, the image folder, or (glob image sets) the absolute pattern
    kind: Literal["pdf", "images"]
    doc_id: str  # stable and readable: source relative to the job's folder
    members: tuple[Path, ...] = ()  # image sets: the image files, in page order


@dataclass
class Page:
    number: int  # 1-based, in the original document
    text: str
    image: "PIL.Image.Image | None"
    scanned: bool


@dataclass
class Document:
    ref: DocumentRef
    content_hash: str
    page_count: int  # pages in the file, before selection
    pages: list[Page]  # selected pages that were read successfully
    skipped_pages: list[dict] = field(default_factory=list)  # {"page": n, "error": "..."}
    notes: list[str] = field(default_factory=list)

    def text(self, markers: bool = True) -> str:
        """All page texts, each after a ``[Page N]`` marker (numbers from the original file)."""
        if not markers:
            return "\n\n".join(p.text.strip() for p in self.pages)
        return "\n\n".join(f"[Page {p.number}]\n{p.text.strip()}" for p in self.pages)


# -- discovery --------------------------------------------------------------


def natural_key(path: str | Path) -> tuple:
    """Sort key that orders ``page2`` before ``page10`` (case-insensitive)."""
    return tuple(int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", str(path)))


def discover(job: Job) -> list[DocumentRef]:
    """All documents of ``job``, in input order then natural order, without duplicates."""
    seen: set[tuple] = set()
    refs: list[DocumentRef] = []
    for item in job.spec.inputs:
        for ref in expand_input(job, item):
            key = (ref.kind, ref.source, ref.members)
            if key not in seen:
                seen.add(key)
                refs.append(ref)
    return refs


def expand_input(job: Job, item: str | ImageSetInput) -> list[DocumentRef]:
    """The documents one ``inputs:`` entry names (possibly none).

    A string is a file, a folder or a glob.  A folder yields its PDFs, each
    direct sub-folder that holds images as one image set, and its own loose
    images (if any) as one image set.  ``{images: ...}`` is always exactly one
    image set.  Unsupported explicit files raise :class:`JobFileError`.
    """
    if isinstance(item, ImageSetInput):
        target = job.resolve(item.images)
        if _is_glob(item.images) and not target.exists():  # "scan[1]" may be a real name
            files = _images(Path(p) for p in glob.glob(str(target), recursive=True))
            return [_image_set(job, target, files)] if files else []
        if target.is_dir():
            files = _images(target.iterdir())
            return [_image_set(job, target, files)] if files else []
        if not target.exists():
            return []
        raise JobFileError(job.path, None, f"{item.images!r} is not a folder or a glob of images")
    target = job.resolve(item)
    if _is_glob(item) and not target.exists():
        matches = sorted((Path(p) for p in glob.glob(str(target), recursive=True)), key=natural_key)
        return [ref for m in matches for ref in _refs_for_path(job, m, explicit=False)]
    if not target.exists():
        return []
    return _refs_for_path(job, target, explicit=True)


def _refs_for_path(job: Job, path: Path, *, explicit: bool) -> list[DocumentRef]:
    suffix = path.suffix.lower()
    if path.is_dir():
        children = sorted(path.iterdir(), key=natural_key)
        refs = [_pdf(job, c) for c in children if _visible(c) and c.is_file() and c.suffix.lower() in PDF_SUFFIXES]
        loose = _images(children)
        if loose:
            refs.append(_image_set(job, path, loose))
        for sub in children:
            if _visible(sub) and sub.is_dir() and (files := _images(sub.iterdir())):
                refs.append(_image_set(job, sub, files))
        return refs
    if suffix in PDF_SUFFIXES:
        return [_pdf(job, path)]
    if suffix in IMAGE_SUFFIXES:
        return [_image_set(job, path, (path,))]
    if explicit:
        raise JobFileError(
            job.path, None, f"{str(path)!r} is neither a PDF nor an image ({', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return []  # a glob may sweep up unrelated files


def _images(paths) -> tuple[Path, ...]:
    found = (p for p in paths if _visible(p) and p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    return tuple(sorted(found, key=natural_key))


def _visible(p: Path) -> bool:
    """Hidden files are editor locks, macOS ``._`` forks or half-copied temp files, not documents."""
    return not p.name.startswith(".")


def _is_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _doc_id(job: Job, path: Path) -> str:
    return Path(os.path.relpath(path, job.base_dir)).as_posix()


def _pdf(job: Job, path: Path) -> DocumentRef:
    path = Path(os.path.abspath(path))  # not resolve(): a symlink keeps its readable name
    return DocumentRef(source=path, kind="pdf", doc_id=_doc_id(job, path))


def _image_set(job: Job, source: Path, files: tuple[Path, ...]) -> DocumentRef:
    source = Path(os.path.abspath(source))
    members = tuple(Path(os.path.abspath(f)) for f in files)
    return DocumentRef(source=source, kind="images", doc_id=_doc_id(job, source), members=members)


# -- hashing ----------------------------------------------------------------


def content_hash(ref: DocumentRef) -> str:
    """``sha256:<hex>`` of the file bytes (image sets: of each member's name, size and bytes).

    Streams in 1 MiB blocks, so it is cheap next to ingestion and safe on
    huge files.  Raises :class:`IngestError` if a file cannot be read.
    """
    h = hashlib.sha256()
    files = ref.members if ref.kind == "images" else (ref.source,)
    for f in files:
        try:
            if ref.kind == "images":
                h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
        except OSError as e:
            raise IngestError(f, f"cannot read file: {e.strerror or e}") from None
    return "sha256:" + h.hexdigest()


# -- ingestion --------------------------------------------------------------


def ingest(ref: DocumentRef, context: ContextSpec, *, pages: str | None = None) -> Document:
    """Read ``ref`` into a :class:`Document`; ``pages`` overrides ``context.pages``.

    Raises :class:`IngestError` naming the file when the document as a whole
    cannot be used.
    """
    spec = pages if pages is not None else context.pages
    digest = content_hash(ref)
    if ref.kind == "pdf":
        return _ingest_pdf(ref, context, spec, digest)
    return _ingest_images(ref, context, spec, digest)


def _ingest_pdf(ref: DocumentRef, context: ContextSpec, spec: str | None, digest: str) -> Document:
    if ref.source.stat().st_size == 0:
        raise IngestError(ref.source, "zero-byte file (still being copied?)")
    with _MUPDF_LOCK:
        return _read_pdf(ref, context, spec, digest)


def _read_pdf(ref: DocumentRef, context: ContextSpec, spec: str | None, digest: str) -> Document:
    import pymupdf

    path = ref.source
    try:
        pdf = pymupdf.open(path, filetype="pdf")
    except Exception as e:  # pymupdf raises FileDataError, RuntimeError, ...
        raise IngestError(path, f"not a readable PDF (corrupt or not a PDF): {e}") from None
    with pdf:
        if pdf.needs_pass:
            raise IngestError(path, "encrypted PDF: a password is required to read it")
        count = pdf.page_count
        if count == 0:
            raise IngestError(path, "empty PDF: it has 0 pages")
        numbers = _select(spec, count, ref)
        doc = Document(ref=ref, content_hash=digest, page_count=count, pages=[])
        for n in numbers:
            page = _with_retries(lambda: _read_pdf_page(pdf, n, context), n, context, doc)
            if page is not None:
                doc.pages.append(page)
    _check_failures(doc, len(numbers), context)
    return doc


def _read_pdf_page(pdf, number: int, context: ContextSpec) -> tuple[Page, list[str]]:
    """One page: text, scanned flag, and an image if the job wants one.

    Returns the page and notes; raises when MuPDF could not load the page's
    content (see module docstring).
    """
    import pymupdf
    from PIL import Image

    notes: list[str] = []
    with _MUPDF_LOCK:
        pymupdf.TOOLS.mupdf_warnings(reset=True)
        page = pdf.load_page(number - 1)
        text = page.get_text()
        stripped = len(text.strip())
        scanned = stripped == 0 or (stripped < SCANNED_MAX_CHARS and bool(page.get_images(full=False)))
        image = None
        if context.images == "always" or (context.images == "auto" and scanned):
            pix = page.get_pixmap(dpi=context.dpi, alpha=False)
            image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        problems = pymupdf.TOOLS.mupdf_warnings(reset=True).strip()
    if problems:
        summary = "; ".join(dict.fromkeys(p for p in problems.splitlines() if not p.startswith("...")))
        if stripped == 0:
            raise RuntimeError(f"MuPDF could not read the page content: {summary}")
        notes.append(f"page {number}: MuPDF reported problems, text may be incomplete: {summary}")
    if scanned and image is None:
        notes.append(f"page {number}: looks scanned (no text layer) but images: never, so it is empty")
    return Page(number=number, text=text, image=image, scanned=scanned), notes


def _ingest_images(ref: DocumentRef, context: ContextSpec, spec: str | None, digest: str) -> Document:
    if context.images == "never":
        raise IngestError(ref.source, "an image set has no text, but the job says context.images: never")
    if not ref.members:
        raise IngestError(ref.source, "image set holds no images")
    numbers = _select(spec, len(ref.members), ref)
    doc = Document(ref=ref, content_hash=digest, page_count=len(ref.members), pages=[])
    for n in numbers:
        page = _with_retries(lambda: _read_image(ref.members[n - 1], n), n, context, doc)
        if page is not None:
            doc.pages.append(page)
    _check_failures(doc, len(numbers), context)
    return doc


def _read_image(path: Path, number: int) -> tuple[Page, list[str]]:
    from PIL import Image

    with Image.open(path) as im:
        im.load()  # decode now, so a truncated file fails here and not in the model
        image = im.convert("RGB")
    return Page(number=number, text="", image=image, scanned=True), []


def _select(spec: str | None, count: int, ref: DocumentRef) -> list[int]:
    try:
        return select_pages(spec, count, document=ref.source)
    except PageRangeError as e:
        raise IngestError(ref.source, f"pages {spec!r}: {e.problem}") from None


def _with_retries(read, number: int, context: ContextSpec, doc: Document) -> Page | None:
    """Run ``read`` up to 1 + page_retries times; on final failure record the page as skipped."""
    error = None
    for _ in range(1 + context.page_retries):
        try:
            page, notes = read()
        except Exception as e:  # any failure of one page must not take down the document
            error = f"{type(e).__name__}: {e}"
            continue
        doc.notes.extend(notes)
        return page
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
        )
