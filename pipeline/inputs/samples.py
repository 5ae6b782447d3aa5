"""Deterministic sample documents for demos, tests and benchmarks.

``tqpipe samples DIR`` (and the example jobs in ``jobs/``) need documents
whose facts are known, so an extraction or QA answer can be checked against
:data:`SAMPLE_FACTS`.  Everything is generated, nothing is downloaded, and
the same call writes byte-identical files (fixed metadata, no random PDF
/ID), so content hashes, and therefore checkpoints, are stable across runs.

Also here: damaged files for error-path tests (:func:`make_broken_page_pdf`,
:func:`make_encrypted_pdf`, :func:`make_corrupt_pdf`) and
:func:`make_long_pdf` for the ingestion benchmark.
"""

from __future__ import annotations

import random
from pathlib import Path

_A4 = (595, 842)
_MARGIN = 60
_FIXED_META = {
    "creationDate": "D:20240101000000Z",
    "modDate": "D:20240101000000Z",
    "producer": "tqpipe samples",
    "creator": "tqpipe samples",
}

#: The facts each sample states, keyed by file name (the ``extract`` job's fields).
SAMPLE_FACTS: dict[str, dict[str, str]] = {
    "report.pdf": {
        "title": "Annual Report 2023: Harbor Lights Foundation",
        "author": "Maria Okafor",
        "date": "2024-02-15",
        "total": "$482,310.75",
    },
    "invoice.pdf": {
        "title": "Invoice INV-2024-0042",
        "author": "Brightline Tools Ltd.",
        "date": "2024-03-08",
        "total": "EUR 1,932.40",
    },
    "minutes.pdf": {
        "title": "Minutes of the Riverside Library Board Meeting",
        "author": "Tomas Lindqvist",
        "date": "2024-05-21",
        "total": "$12,500",
    },
    "scanned.pdf": {
        "title": "Delivery Note DN-7781",
        "author": "Northwind Freight",
        "date": "2024-06-03",
        "total": "37 parcels",
    },
}

_PAGES: dict[str, list[str]] = {
    "report.pdf": [
        "Annual Report 2023: Harbor Lights Foundation\n\nPrepared by Maria Okafor, Executive Director\n"
        "Date: 2024-02-15\n\nThis report covers the foundation's work from January to December 2023: "
        "the coastal literacy programme, the night-shelter network and the volunteer boat service.",
        "Programmes\n\nThe coastal literacy programme reached 1,240 children in 14 villages. The night-shelter "
        "network opened a fourth shelter in Port Evra in September. The volunteer boat service completed "
        "312 medical transport trips, 41 more than in 2022.",
        "Finances\n\nDonations: $301,200.00\nGrants: $151,110.75\nEvents: $30,000.00\n\n"
        "Total income: $482,310.75\n\nProgramme spending was 87% of total expenses; administration 9%; "
        "fundraising 4%.",
        "Outlook\n\nIn 2024 the foundation plans a fifth shelter and a second boat. The board meets quarterly; "
        "questions go to Maria Okafor at the Port Evra office.",
    ],
    "invoice.pdf": [
        "Invoice INV-2024-0042\n\nFrom: Brightline Tools Ltd., 8 Mill Lane, Leeds\nTo: Harbor Lights Foundation\n"
        "Invoice date: 2024-03-08\nDue date: 2024-04-07\n\n"
        "Item                         Qty   Unit price   Amount\n"
        "Cordless drill DX-20           4     EUR 189.00   EUR 756.00\n"
        "Safety helmet, orange         12      EUR 24.50   EUR 294.00",
        "Invoice INV-2024-0042 (continued)\n\n"
        "Ladder, aluminium 3 m          2     EUR 215.00   EUR 430.00\n"
        "Work gloves (pair)            40       EUR 7.81   EUR 312.40\n"
        "Delivery                       1     EUR 140.00   EUR 140.00\n\n"
        "Total due: EUR 1,932.40\n\nPayment by bank transfer within 30 days.",
    ],
    "minutes.pdf": [
        "Minutes of the Riverside Library Board Meeting\n\nDate: 2024-05-21, 18:00\nLocation: Reading Room B\n"
        "Chair: Eleanor Vance\nMinutes taken by: Tomas Lindqvist\n\n"
        "Present: Eleanor Vance, Tomas Lindqvist, Priya Nair, Samuel Ortiz, Hana Kobayashi.\nApologies: David Reyes.",
        "Decisions\n\n1. The board approved a renovation budget of $12,500 for the children's corner.\n"
        "2. Opening hours on Saturdays extend to 17:00 from 1 July.\n"
        "3. The book sale in October will support the renovation.",
        "Action items\n\n- Priya Nair collects three quotes from contractors by 2024-06-15.\n"
        "- Samuel Ortiz updates the website with the new opening hours.\n\n"
        "The next meeting is on 2024-06-18 at 18:00. The meeting closed at 19:40.",
    ],
    "scanned.pdf": [
        "Delivery Note DN-7781\n\nCarrier: Northwind Freight\nDate: 2024-06-03\n"
        "Consignee: Riverside Library\n\nParcels delivered: 37\nSigned: H. Kobayashi",
        "Delivery Note DN-7781, page 2\n\nCondition on arrival: 35 parcels intact, 2 parcels with dented corners.\n"
        "No items missing.",
    ],
}

IMAGESET_PAGES = {
    "page1.png": "Field notebook, sheet 1 of 3\n\nTide gauge reading at 06:00: 2.4 m",
    "page2.png": "Field notebook, sheet 2 of 3\n\nTide gauge reading at 12:00: 0.9 m",
    "page10.png": "Field notebook, sheet 3 of 3\n\nTide gauge reading at 18:00: 2.7 m",
}


def write_samples(dir: str | Path = "samples") -> list[Path]:
    """Write the sample set into ``dir``; return the document paths (PDFs, then the image folder).

    ``dir`` gets ``report.pdf``, ``invoice.pdf``, ``minutes.pdf`` (text PDFs),
    ``scanned.pdf`` (image-only pages) and ``imageset/`` (three PNGs whose
    names need natural sorting: page1, page2, page10).
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("report.pdf", "invoice.pdf", "minutes.pdf"):
        written.append(make_text_pdf(out / name, _PAGES[name], title=SAMPLE_FACTS[name]["title"]))
    written.append(make_scanned_pdf(out / "scanned.pdf", _PAGES["scanned.pdf"]))
    written.append(make_image_set(out / "imageset", IMAGESET_PAGES))
    return written


def make_text_pdf(path: str | Path, pages: list[str], *, title: str = "", fontsize: float = 11) -> Path:
    """A PDF with one page per string, as real selectable text."""
    import pymupdf

    doc = pymupdf.open()
    for text in pages:
        _text_page(doc, text, fontsize)
    return _save(doc, path, title)


def make_scanned_pdf(path: str | Path, pages: list[str], *, dpi: int = 100) -> Path:
    """A PDF whose pages are only pictures of text (no text layer), like a scan."""
    import pymupdf

    doc = pymupdf.open()
    for text in pages:
        pix = _render_text(text, dpi)
        page = doc.new_page(width=_A4[0], height=_A4[1])
        page.insert_image(page.rect, pixmap=pix)
    return _save(doc, path, "")


def make_image_set(folder: str | Path, pages: dict[str, str], *, dpi: int = 72) -> Path:
    """A folder of PNG page images (file name -> page text)."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        pix = _render_text(text, dpi)
        Image.frombytes("RGB", (pix.width, pix.height), pix.samples).save(folder / name, optimize=False)
    return folder


def make_long_pdf(path: str | Path, pages: int = 300, *, seed: int = 0) -> Path:
    """A ``pages``-page text PDF of ~2,000 characters per page, for benchmarks.

    Each page says ``This is page N of M`` and a code word, so long-context
    retrieval can be checked too (:func:`long_pdf_code_word`).
    """
    rng = random.Random(seed)
    words = _WORDS.split()
    texts = []
    for n in range(1, pages + 1):
        body = " ".join(rng.choice(words) for _ in range(300))
        texts.append(
            f"This is page {n} of {pages}. The code word for page {n} is {long_pdf_code_word(n, seed)}.\n\n{body}"
        )
    return make_text_pdf(path, texts, title=f"Long sample ({pages} pages)", fontsize=9)


def long_pdf_code_word(page: int, seed: int = 0) -> str:
    """The code word :func:`make_long_pdf` writes on ``page``."""
    words = _WORDS.split()
    return random.Random(f"{seed}:{page}").choice(words) + str(page * 7 % 97)


# -- damaged documents (error-path tests and demos) ---------------------------


def make_broken_page_pdf(path: str | Path, pages: int = 5, broken: tuple[int, ...] = (3,)) -> Path:
    """A valid ``pages``-page text PDF whose ``broken`` pages (1-based) have a
    content stream that does not decompress: MuPDF opens the file but cannot
    read those pages."""
    import pymupdf

    tmp = make_text_pdf(path, [f"Page {n}: intact text of page {n}." for n in range(1, pages + 1)])
    doc = pymupdf.open(tmp)
    for n in broken:
        xref = doc[n - 1].get_contents()[0]
        doc.update_stream(xref, b"x\x9c\x00\x01 this is not deflate data", compress=False)
        doc.xref_set_key(xref, "Filter", "/FlateDecode")
    doc.save(tmp, incremental=True, encryption=pymupdf.PDF_ENCRYPT_KEEP)
    doc.close()
    return tmp


def make_encrypted_pdf(path: str | Path, password: str = "secret") -> Path:
    """A text PDF that needs a user password to open."""
    import pymupdf

    doc = pymupdf.open()
    _text_page(doc, "Confidential.", 11)
    path = Path(path)
    doc.save(path, encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw=password, owner_pw=password + "-owner")
    return path


def make_corrupt_pdf(path: str | Path) -> Path:
    """A file named .pdf that holds no PDF structure at all."""
    path = Path(path)
    path.write_bytes(b"%PDF-1.7\n" + bytes(range(256)) * 8)
    return path


# -- helpers ----------------------------------------------------------------


def _text_page(doc, text: str, fontsize: float):
    import pymupdf

    page = doc.new_page(width=_A4[0], height=_A4[1])
    rect = pymupdf.Rect(_MARGIN, _MARGIN, _A4[0] - _MARGIN, _A4[1] - _MARGIN)
    if page.insert_textbox(rect, text, fontsize=fontsize, fontname="cour" if "  " in text else "helv") < 0:
        raise ValueError(f"sample text does not fit one page: {text[:40]!r}...")
    return page


def _render_text(text: str, dpi: int):
    import pymupdf

    tmp = pymupdf.open()
    page = _text_page(tmp, text, 14)
    return page.get_pixmap(dpi=dpi, alpha=False)


def _save(doc, path: str | Path, title: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc.set_metadata({**_FIXED_META, "title": title})
    doc.save(path, garbage=3, deflate=True, no_new_id=True)
    doc.close()
    return path


_WORDS = """
harbor lantern river meadow copper signal ledger orchard granite willow beacon
compass timber quarry falcon cedar harvest voyage summit canyon thistle marble
ember glacier mosaic pennant quiver saddle tundra velvet wharf yarrow zephyr
anchor bramble cobalt delta estuary fjord garnet heron indigo juniper kestrel
the of and to in a is that for on with as by at from was were be this which
"""
