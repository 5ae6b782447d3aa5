"""Ingestion speed: pages/s on a generated N-page text PDF.

    python -m benchmarks.ingest [--pages 300] [--repeat 3] [--dpi 72] [--json]

Measures, on the same file: hashing (what the runner does before deciding to
skip a finished document), ingestion with text only (``images: auto`` on a
text PDF renders nothing) and ingestion with every page rendered
(``images: always``) at ``--dpi``.  Reports the median and best of
``--repeat`` runs, because the CI machine is shared and single runs are noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.inputs.discover import DocumentRef, content_hash
from pipeline.inputs.ingest import ingest
from pipeline.inputs.samples import make_long_pdf
from pipeline.schema.job import ContextSpec


def _time(fn, repeat: int) -> tuple[float, float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), result


def run(pages: int = 300, repeat: int = 3, dpi: int = 72) -> dict:
    import pymupdf

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        path = make_long_pdf(Path(tmp) / "long.pdf", pages=pages)
        generate_s = time.perf_counter() - t
        ref = DocumentRef(source=path, kind="pdf", doc_id=path.name)
        rows = {}
        med, best, _ = _time(lambda: content_hash(ref), repeat)
        rows["hash"] = {"median_s": med, "best_s": best}
        for label, ctx in (
            ("text only (images: auto)", ContextSpec(images="auto")),
            (f"text + page images (images: always, {dpi} dpi)", ContextSpec(images="always", dpi=dpi)),
        ):
            med, best, doc = _time(lambda: ingest(ref, ctx), repeat)
            images = [p.image for p in doc.pages if p.image is not None]
            rows[label] = {
                "median_s": med,
                "best_s": best,
                "pages_per_s": pages / med,
                "chars": sum(len(p.text) for p in doc.pages),
                "images": len(images),
                "image_size": list(images[0].size) if images else None,
            }
            del doc, images
        return {
            "pages": pages,
            "file_bytes": path.stat().st_size,
            "generate_s": generate_s,
            "repeat": repeat,
            "pymupdf": f"PyMuPDF {pymupdf.version[0]}, MuPDF {pymupdf.version[1]}",
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "results": rows,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dpi", type=int, default=72)
    ap.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = ap.parse_args()
    r = run(args.pages, args.repeat, args.dpi)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"{r['pages']}-page text PDF, {r['file_bytes'] / 1e6:.2f} MB (generated in {r['generate_s']:.2f} s), "
          f"{r['pymupdf']}, median/best of {r['repeat']}")
    print()
    print("| step | median ms | best ms | pages/s | chars | images |")
    print("|---|---:|---:|---:|---:|---|")
    for label, row in r["results"].items():
        pps = f"{row['pages_per_s']:.0f}" if "pages_per_s" in row else "-"
        imgs = f"{row['images']} x {row['image_size'][0]}x{row['image_size'][1]}" if row.get("images") else "-"
        chars = f"{row['chars']:,}" if "chars" in row else "-"
        print(f"| {label} | {row['median_s'] * 1e3:.1f} | {row['best_s'] * 1e3:.1f} | {pps} | {chars} | {imgs} |")


if __name__ == "__main__":
    main()
