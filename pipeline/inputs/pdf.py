"""PDFs: the text of every selected page, and a rendered image where the job wants one.

Images are rendered for pages that look scanned (``images: auto``), for every
page (``always``) or for none (``never``).  A scanned page whose route is
``ocr`` (:func:`~pipeline.inputs.document.scanned_route`) is rendered at
:data:`~pipeline.inputs.ocr.OCR_DPI` and its OCR'd text replaces the (empty
or stray) text layer.

MuPDF repairs what it can and reports the rest as warnings rather than
exceptions: a page whose content stream is garbage comes back as an empty
page.  So a page counts as failed when MuPDF reported problems while reading
it AND it yielded no text; a page with problems but some text is kept, with
a note, since partial text beats none.
"""

from __future__ import annotations

import threading

from pipeline.errors import IngestError
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document, Page, ScannedRoute, read_pages
from pipeline.inputs.ocr import OCR_DPI, ocr_image
from pipeline.schema.job import ContextSpec
from pipeline.schema.paths import is_text_name

#: A page with fewer stripped characters than this counts as "almost no text";
#: scanned pages often carry a stray OCR'd page number or header.
SCANNED_MAX_CHARS = 25

#: Most pixels a page is rendered at: a poster-sized page (or a malformed
#: MediaBox of hundreds of inches) at OCR resolution would take gigabytes.
#: 25 MP holds an A1 sheet at 150 dpi, about 75 MB as RGB; larger pages are
#: rendered at the resolution that fits, with a note.
MAX_RENDER_PIXELS = 25_000_000

# MuPDF keeps one process-wide warning buffer and pymupdf is not thread-safe:
# one PDF is read at a time per process, so each page's warnings belong to it.
_MUPDF_LOCK = threading.RLock()


def read_pdf(ref: DocumentRef, context: ContextSpec, digest: str, route: ScannedRoute = "image") -> Document:
    """Read the selected pages of a PDF; raises :class:`IngestError` when the file as a whole is unusable.

    ``route`` says what becomes of a scanned page (image, OCR'd text, nothing)."""
    if ref.source.stat().st_size == 0:
        raise IngestError(ref.source, "zero-byte file (still being copied?)")
    with _MUPDF_LOCK:
        return _read_pdf(ref, context, digest, route)


def _read_pdf(ref: DocumentRef, context: ContextSpec, digest: str, route: ScannedRoute) -> Document:
    import pymupdf

    # MuPDF would also print its errors to stderr, unattributed ("MuPDF error:
    # format error: ..." in a watcher's log, no file named); they reach the
    # warnings buffer all the same, and from there the record or the note.
    pymupdf.TOOLS.mupdf_display_errors(False)
    path = ref.source
    try:
        if is_text_name(path):
            pdf = pymupdf.open(path, filetype="pdf")
        else:  # MuPDF takes names as UTF-8 text only: hand it the bytes instead
            pdf = pymupdf.open(stream=path.read_bytes(), filetype="pdf")
    except Exception as e:  # pymupdf raises FileDataError, RuntimeError, ...
        raise IngestError(path, f"not a readable PDF (corrupt or not a PDF): {e}") from None
    with pdf:
        if pdf.needs_pass:
            raise IngestError(path, "encrypted PDF: a password is required to read it")
        count = pdf.page_count
        if count == 0:
            raise IngestError(path, "empty PDF: it has 0 pages")
        return read_pages(ref, digest, count, context, lambda n: _read_pdf_page(pdf, n, context, route))


def _render_dpi(page, dpi: int, number: int, notes: list[str]) -> int:
    """``dpi``, or the highest one at which the page stays within
    :data:`MAX_RENDER_PIXELS` (noted)."""
    inches = (page.rect.width / 72.0) * (page.rect.height / 72.0)
    if inches * dpi * dpi <= MAX_RENDER_PIXELS:
        return dpi
    fitted = max(1, int((MAX_RENDER_PIXELS / inches) ** 0.5))
    notes.append(f"page {number}: {page.rect.width / 72:.0f} x {page.rect.height / 72:.0f} in, "
                 f"rendered at {fitted} dpi instead of {dpi} to stay within {MAX_RENDER_PIXELS // 10**6} MP")
    return fitted


def _read_pdf_page(pdf, number: int, context: ContextSpec, route: ScannedRoute) -> tuple[Page, list[str]]:
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
        image, ocr_input = None, None
        if scanned and route == "ocr":
            pix = page.get_pixmap(dpi=_render_dpi(page, max(context.dpi, OCR_DPI), number, notes), alpha=False)
            ocr_input = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        elif context.images == "always" or (scanned and route == "image"):
            pix = page.get_pixmap(dpi=_render_dpi(page, context.dpi, number, notes), alpha=False)
            image = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
        problems = pymupdf.TOOLS.mupdf_warnings(reset=True).strip()
    incomplete = bool(problems)
    if problems:
        summary = "; ".join(dict.fromkeys(p for p in problems.splitlines() if not p.startswith("...")))
        if stripped == 0:
            raise RuntimeError(f"MuPDF could not read the page content: {summary}")
        notes.append(f"page {number}: MuPDF reported problems, text may be incomplete: {summary}")
    via = "image" if image is not None else "text"
    if ocr_input is not None:
        text, via = ocr_image(ocr_input), "ocr"
        if not text:
            notes.append(f"page {number}: looks scanned and OCR found no text on it")
    elif scanned and image is None:
        notes.append(f"page {number}: looks scanned (no text layer) but images: never, so it is empty")
    return Page(number=number, text=text, image=image, scanned=scanned, via=via, incomplete=incomplete), notes
