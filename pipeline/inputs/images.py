"""Image sets: one document of many images, one page per image, no text layer.

Each image goes to the model as an image, or as its OCR'd text when the
route says ``ocr`` (a text-only model, or ``images: ocr``).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import IngestError
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document, Page, ScannedRoute, read_pages
from pipeline.inputs.ocr import ocr_image
from pipeline.schema.job import ContextSpec


def read_image_set(ref: DocumentRef, context: ContextSpec, digest: str, route: ScannedRoute = "image") -> Document:
    """Read the selected images of an image set, one page each, in member order."""
    if route == "none":
        raise IngestError(ref.source, "an image set has no text, but the job says context.images: never")
    if not ref.members:
        raise IngestError(ref.source, "image set holds no images")
    return read_pages(ref, digest, len(ref.members), context, lambda n: _read_image(ref.members[n - 1], n, route))


def _read_image(path: Path, number: int, route: ScannedRoute) -> tuple[Page, list[str]]:
    from PIL import Image

    with Image.open(path) as im:
        im.load()  # decode now, so a truncated file fails here and not in the model
        image = im.convert("RGB")
    if route == "ocr":
        text = ocr_image(image)
        notes = [] if text else [f"page {number}: OCR found no text on {path.name}"]
        return Page(number=number, text=text, image=None, scanned=True, via="ocr"), notes
    return Page(number=number, text="", image=image, scanned=True, via="image"), []
