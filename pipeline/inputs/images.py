"""Image sets: one document of many images, one page per image, no text layer."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import IngestError
from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.document import Document, Page, read_pages
from pipeline.schema.job import ContextSpec


def read_image_set(ref: DocumentRef, context: ContextSpec, digest: str) -> Document:
    """Read the selected images of an image set, one page each, in member order."""
    if context.images == "never":
        raise IngestError(ref.source, "an image set has no text, but the job says context.images: never")
    if not ref.members:
        raise IngestError(ref.source, "image set holds no images")
    return read_pages(ref, digest, len(ref.members), context, lambda n: _read_image(ref.members[n - 1], n))


def _read_image(path: Path, number: int) -> tuple[Page, list[str]]:
    from PIL import Image

    with Image.open(path) as im:
        im.load()  # decode now, so a truncated file fails here and not in the model
        image = im.convert("RGB")
    return Page(number=number, text="", image=image, scanned=True), []
