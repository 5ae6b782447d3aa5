"""``tqpipe report``: one self-contained HTML page per job run.

What olmocr's viewer gives for a run, as a single file that opens anywhere
(no server, no network, no external script or font): the job's counts, a
plot of KV-cache bytes against context length for fp16 and the job's cache,
and per document its pages, tokens, truncation, warnings, timings and every
task's answer.

The plot draws the size formulas of :mod:`pipeline.inference.kv_size` for
the model's geometry (stored in each record's ``cache``) as lines, and the
measured bytes of each record as points on them, so a user sees both what
was measured and how the saving grows with length (below ~2 x the exact
window TurboQuant holds more than fp16; far beyond it, about kv_bits/16).
"""

from __future__ import annotations

import html
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import orjson

from pipeline.inference.kv_size import KVGeometry, cache_nbytes_formula
from pipeline.output.atomic import write_whole
from pipeline.output.export import records_for_export

_W, _H, _PAD = 760, 340, 56  # plot size and margin, px
_DASHED = 'stroke-dasharray="5 4"'
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#1d232a;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px} .muted{color:#66707a}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:14px 0} .card{border:1px solid #dde2e6;border-radius:8px;padding:8px 14px}
.card b{display:block;font-size:20px} .ok{color:#16794a} .bad{color:#b42318} .warn{color:#9a6700}
table{border-collapse:collapse;width:100%;font-size:13px} th,td{border-bottom:1px solid #e6e9ec;padding:5px 8px;text-align:left;vertical-align:top}
th{background:#f5f7f8;font-weight:600} td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{white-space:pre-wrap;margin:4px 0;font-size:12px;background:#f7f8f9;padding:6px;border-radius:4px;max-height:240px;overflow:auto}
svg text{font:11px system-ui,sans-serif;fill:#40474f} .legend span{margin-right:16px}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"


def warnings_of(rec: dict) -> list[str]:
    """Everything a reader should notice about one record, as short phrases: the
    record's warning codes (with their detail) first, then softer signs."""
    ctx, pages = rec.get("context") or {}, rec.get("pages") or {}
    detail = {
        "truncated": f"truncated: {ctx.get('tokens_dropped', '?')} tokens dropped",
        "pages_skipped": f"pages skipped: {pages.get('skipped')}",
        "random_weights": "random_weights: the model's answers are noise",
        "json_repaired": f"json_repaired: {(rec.get('json') or {}).get('repaired', '')}",
        "missing_fields": "missing fields: " + ", ".join(rec.get("missing_fields") or []),
        "answer_truncated": "answer hit max_tokens",
    }
    codes = list(rec.get("warnings") or [])
    out = [detail.get(c, c) for c in codes]
    if ctx.get("truncated") and "truncated" not in codes:
        out.append(detail["truncated"])
    if pages.get("skipped") and "pages_skipped" not in codes:
        out.append(detail["pages_skipped"])
    out += [str(n) for n in ctx.get("notes") or []]
    if rec.get("missing_fields") and "missing_fields" not in codes:  # records written before the code
        out.append(detail["missing_fields"])
    if rec.get("finish_reason") == "length" and "answer_truncated" not in codes:
        out.append(detail["answer_truncated"])
    cit = rec.get("citations") or {}
    if cit.get("unknown"):
        out.append(f"cites pages not in the context: {cit['unknown']}")
    return list(dict.fromkeys(out))


def _exact_bytes(rec: dict, geom: KVGeometry, spec: Any) -> int:
    """Bytes per exact-window element the run used (4 on the CPU path, else 2), read off the measurement."""
    measured = rec["cache"]["nbytes_after_prefill"]
    n = rec["cache"]["tokens"]
    return min((2, 4), key=lambda b: abs(cache_nbytes_formula(geom, spec, n, exact_bytes=b) - measured))


def plot_svg(records: list[dict]) -> str:
    """KV MiB against context tokens: fp16 and the job's cache (formula lines, measured points)."""
    pts = [r for r in records if r.get("status") == "ok" and (r.get("cache") or {}).get("geometry")
           and r["cache"].get("tokens")]
    if not pts:
        return '<p class="muted">No KV measurements in these records (they predate the KV figures).</p>'
    first = pts[0]["cache"]
    geom = KVGeometry(**first["geometry"])
    spec = SimpleNamespace(kv_quant_scheme=first["scheme"], kv_bits=first.get("kv_bits") or 16,
                           key_bits=first.get("key_bits"), value_bits=first.get("value_bits"),
                           window=first.get("window") or 0, prefill_chunk=first["prefill_chunk"])
    same = [r for r in pts if r["cache"]["geometry"] == first["geometry"]]
    exact = _exact_bytes(same[0], geom, spec)
    # far enough right to show the long-document regime the cache is for
    x_max = max(max(r["cache"]["tokens"] for r in same) * 1.25, spec.window * 16, 2048)
    xs = sorted({int(x_max * i / 96) for i in range(97)} | {k * spec.prefill_chunk + d for k in range(int(x_max // spec.prefill_chunk) + 1) for d in (0, 1)})
    xs = [x for x in xs if x <= x_max]
    fp16 = [geom.fp16_nbytes(x) for x in xs]
    ours = [cache_nbytes_formula(geom, spec, x, exact_bytes=exact) for x in xs]
    ours_pre = [cache_nbytes_formula(geom, spec, x, exact_bytes=exact) for x in xs]
    measured = [(r["cache"]["tokens"], r["cache"]["nbytes_after_prefill"]) for r in same]
    y_max = max(max(fp16), max(ours), max(ours_pre), max(b for _, b in measured)) * 1.08

    def px(x: float, y: float) -> str:
        return f"{_PAD + x / x_max * (_W - 2 * _PAD):.1f},{_H - _PAD + 10 - y / y_max * (_H - 2 * _PAD):.1f}"

    def line(ys: list[int], color: str, dash: str = "") -> str:
        d = " ".join(px(x, y) for x, y in zip(xs, ys))
        return f'<polyline fill="none" stroke="{color}" stroke-width="2" {dash} points="{d}"/>'

    grid = []
    for i in range(6):
        y = y_max * i / 5
        grid.append(f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{px(0, y).split(",")[1]}" y2="{px(0, y).split(",")[1]}" '
                    f'stroke="#eceff1"/><text x="{_PAD - 6}" y="{px(0, y).split(",")[1]}" text-anchor="end" '
                    f'dy="4">{y / 2**20:.1f}</text>')
        x = x_max * i / 5
        gx = px(x, 0).split(",")[0]
        grid.append(f'<text x="{gx}" y="{_H - _PAD + 28}" text-anchor="middle">{int(x):,}</text>')
    dots = "".join(
        f'<circle class="measured" cx="{px(t, b).split(",")[0]}" cy="{px(t, b).split(",")[1]}" r="4.5" fill="#d9480f">'
        f'<title>{t} tokens: {_mib(b)} measured</title></circle>'
        for t, b in measured
    )
    dots += "".join(
        f'<rect class="fp16-same" x="{float(px(t, geom.fp16_nbytes(t)).split(",")[0]) - 3.5:.1f}" '
        f'y="{float(px(t, geom.fp16_nbytes(t)).split(",")[1]) - 3.5:.1f}" width="7" height="7" fill="#1c7ed6">'
        f'<title>{t} tokens: fp16 would hold {_mib(geom.fp16_nbytes(t))}</title></rect>'
        for t, _ in measured
    )
    bits = f" {spec.kv_bits:g} bits" if spec.kv_quant_scheme != "fp16" else ""
    dtype = "float32 on CPU" if exact == 4 else "fp16"
    rest = len(pts) - len(same)
    other = (f"<span>{rest} record{'s' if rest > 1 else ''} of another model not plotted</span>"
             if rest else "")
    return (
        f'<svg id="kv-plot" width="{_W}" height="{_H + 20}" viewBox="0 0 {_W} {_H + 20}" role="img" '
        f'aria-label="KV cache bytes against context length">'
        f'{"".join(grid)}'
        f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{_H - _PAD + 10}" y2="{_H - _PAD + 10}" stroke="#9aa3ab"/>'
        f'<line x1="{_PAD}" x2="{_PAD}" y1="{_PAD - 20}" y2="{_H - _PAD + 10}" stroke="#9aa3ab"/>'
        f'{line(fp16, "#1c7ed6")}{line(ours, "#d9480f")}{line(ours_pre, "#d9480f", _DASHED)}'
        f'{dots}'
        f'<text x="{_W / 2}" y="{_H + 14}" text-anchor="middle">context length (tokens)</text>'
        f'<text x="14" y="{_H / 2}" transform="rotate(-90 14 {_H / 2})" text-anchor="middle">KV cache (MiB)</text>'
        f'</svg><div class="legend muted"><span style="color:#1c7ed6">━ fp16 (formula; ■ same tokens as each document)</span>'
        f'<span style="color:#d9480f">━ {_e(spec.kv_quant_scheme)}{bits}, settled (formula)</span>'
        f'<span style="color:#d9480f">┅ right after prefill (formula) ● measured</span>'
        f'<span>exact window: {spec.window} tokens in {dtype}; {geom.layers} layers × {geom.kv_heads} KV heads × '
        f'{geom.k_dim}+{geom.v_dim} dims ({_e(same[0].get("model"))})</span>{other}</div>'
    )


def _doc_rows(records: list[dict]) -> str:
    rows = []
    for rec in records:
        ok = rec.get("status") == "ok"
        tok, tim, ctx, pages = (rec.get(k) or {} for k in ("tokens", "timing", "context", "pages"))
        cache = rec.get("cache") or {}
        answer = rec.get("parsed") if rec.get("parsed") is not None else rec.get("output")
        if isinstance(answer, (dict, list)):
            answer = orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode()
        if not ok:
            err = rec.get("error") or {}
            answer = f"{err.get('type', '')} ({err.get('stage', '?')}): {err.get('message', '')}"
        warns = warnings_of(rec)
        kv = (f"{_mib(cache.get('nbytes_after_prefill'))}<br><span class=muted>fp16 {_mib(cache.get('fp16_nbytes'))}"
              f"</span>" if cache.get("fp16_nbytes") else _mib(cache.get("nbytes_after_prefill")))
        rows.append(
            f'<tr class="doc"><td>{_e(rec.get("doc_id"))}<br><span class=muted>{_e(rec.get("task"))}'
            f'</span></td><td class="{"ok" if ok else "bad"}">{_e(rec.get("status"))}</td>'
            f'<td class=num>{len(pages.get("included") or [])}/{_e(ctx.get("page_count", ""))}</td>'
            f'<td class=num>{_e(tok.get("document", ""))}<br><span class=muted>+{_e(tok.get("generated", ""))}</span></td>'
            f'<td>{"yes" if ctx.get("truncated") else "no"}</td><td class=num>{kv}</td>'
            f'<td class=num>{_e(tim.get("ingest_s", ""))}<br>{_e(tim.get("prefill_s", ""))}<br>{_e(tim.get("decode_s", ""))}</td>'
            f'<td class=warn>{"<br>".join(_e(w) for w in warns)}</td><td><pre>{_e(answer)}</pre></td></tr>'
        )
    return "".join(rows)


def render_report(records: list[dict], *, job_name: str, results: Path) -> str:
    """The whole page as one HTML string (inline CSS and SVG; a few lines of inline script)."""
    ok = sum(r.get("status") == "ok" for r in records)
    docs = len({r.get("doc_id") for r in records})
    warned = sum(bool(warnings_of(r)) for r in records)
    models = sorted({str(r.get("model")) for r in records if r.get("model")})
    cards = "".join(
        f'<div class="card"><b class="{cls}">{n}</b>{label}</div>'
        for n, label, cls in ((docs, "documents", ""), (ok, "answers ok", "ok"),
                              (len(records) - ok, "failed", "bad" if len(records) - ok else ""),
                              (warned, "with warnings", "warn" if warned else ""))
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>tqpipe report: {_e(job_name)}</title><style>{_CSS}</style></head>
<body data-records="{len(records)}">
<h1>tqpipe report: {_e(job_name)}</h1>
<div class="muted">{_e(results)} · model {_e(", ".join(models) or "?")}</div>
<div class="cards">{cards}</div>
<h2>KV cache against context length</h2>
{plot_svg(records)}
<h2>Documents</h2>
<table id="docs"><thead><tr><th>document / task</th><th>status</th><th>pages</th><th>tokens<br>+answer</th>
<th>truncated</th><th>KV cache</th><th>ingest / prefill / decode s</th><th>warnings</th><th>answer</th></tr></thead>
<tbody>{_doc_rows(records)}</tbody></table>
<script>
// Marks the page as rendered once the table and the plot are in the DOM (headless checks read it).
document.body.dataset.rendered = String(document.querySelectorAll("#docs tbody tr").length);
</script>
</body></html>
"""


def write_report(results: Path, out: Path, *, job_name: str, current: Callable[[str], bool] | None = None,
                 task_order: Sequence[str] = ()) -> int:
    """Write the report for ``results`` (the ``current`` keys) to ``out``;
    return the number of records shown."""
    records = records_for_export(results, current, task_order)
    out.parent.mkdir(parents=True, exist_ok=True)
    page = render_report(records, job_name=job_name, results=results)
    write_whole(out, lambda path: path.write_text(page, encoding="utf-8"))
    return len(records)
