"""Where the one-launch decode step's time goes, threadgroup by threadgroup.

Nsight Compute gives averages: at 512k tokens it sees the SMs active for
~89% of the kernel's elapsed time, but not where the rest goes.  This
script builds ``tq_decode_tc8_fused`` with ``TQ_TIMELINE`` (see
metal/tq_decode_tc8.inc): thread 0 of every threadgroup stamps the device's
nanosecond clock at entry, when the tables are in shared memory, when each
warp leaves its tile loop, when its partial is written and (the last
threadgroup of a kv head) when the merge is done.  From those stamps, per
launch:

* ramp: how long after the first threadgroup the last one started;
* prologue: entry -> tables ready (table copy + query rotation);
* loop: tables ready -> every warp of the threadgroup done, min / median /
  max over the packed threadgroups, and the spread of warp finish times
  inside one threadgroup;
* finish: when the packed threadgroups wrote their partials (quantiles
  from the first entry), and the tail from the last one to the end of the
  last merge;
* slot use: threadgroup-busy time over (resident slots x span), the figure
  ncu's "SM active" approximates;
* with ``--chain N``: the gap between one launch's end and the next one's
  first threadgroup, N dependent launches in one evaluation (as a model's
  layers call it).
* with ``--pipelined T``: T tokens of ``--chain`` dependent launches each,
  submitted with ``mx.async_eval`` as mlx-lm's generation loop does (the
  host waits for token t only after submitting t+1), so the figures
  include the boundaries between CUDA graphs and between tokens that a
  synchronous chain of 8 does not see: span and gap over every launch, the
  gaps at token boundaries, and the device time per launch (first entry
  to last end over all launches) against the host's wall time per launch.

  python3 benchmarks/tg_timeline.py --tokens 512k --chain 8
  python3 benchmarks/tg_timeline.py --tokens 512k --chain 32 --pipelined 16
  TQ_TC8_BLOCKS=528 python3 benchmarks/tg_timeline.py --tokens 512k

Only on NVIDIA GPUs (the stamps are PTX special registers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_attention as g  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from turboquant import kernels as K  # noqa: E402


def timeline_step(n: int, seed: int = 0):
    """``launch(x) -> (stamps, out)``: the fused step over a random 512k-style
    cache with the timeline compiled in, and the launch's slot count."""
    c = g.tq_cache(n, 3.5, seed)
    wk = g.window_keys()
    q = mx.random.normal((1, g.HQ, 1, g.D)).astype(mx.float16)
    plan = K._step_plan(q, wk, wk, c, g.SCALE)
    if plan is None:
        raise SystemExit("the one-launch step does not apply here (no CUDA GPU?)")
    D, R, BH, kb, vb = plan.dims
    cfg = K._tc8_config(D, R, BH, n, kb, vb, True, plan.env)
    ws, slots = cfg["WS"], cfg["SLOTS"]
    ntg = slots * BH
    prelude = f"\n#define TQ_TIMELINE {ws}\n" + cfg["PRELUDE"]
    m0 = mx.zeros((1,), mx.float32)
    ktab, vtab = plan.tables
    meta_values = (n, c.keys_packed.shape[2], cfg["TOKS"], g.HKV, slots, R, 0, 0, cfg["OFF_PO"],
                   cfg["OFF_PM"], cfg["OFF_PL"], wk.shape[2], plan.scale_bits, 0, 0, 0)
    meta = K._meta(*meta_values)
    # one counter set, reused as the step's ring reuses its sets: the launches
    # here are chained (each one's query is the last one's output), so the
    # ordering input is that query
    cnt = mx.zeros((K.TC8_COUNTER_WORDS * BH,), mx.uint32)
    mx.eval(cnt)
    ins = [q, c.keys_packed, c.keys_norms, c.values_packed, c.values_norms, ktab, vtab, meta,
           wk, wk, plan.signs, plan.vsigns, m0, m0, cnt, q]
    kernel = K._kernel_for("tq_decode_tc8_fused", prelude, ins, [mx.float32, q.dtype])

    def launch(x):
        ins[0] = ins[-1] = x
        if os.environ.get("TL_FRESH_META") == "1":  # a new meta array per launch, as the step builds one
            ins[7] = K._meta(*meta_values)
        w, out = kernel(inputs=list(ins), template=cfg["TEMPLATE"], grid=(cfg["GRID_X"], g.HKV, 1),
                        threadgroup=(cfg["NW"] * 32, 1, 1), output_shapes=[(ws + 16 * ntg,), q.shape],
                        output_dtypes=[mx.float32, q.dtype])
        return w[ws:], out

    return launch, q, slots, cfg


def _signed32(d):
    """A difference of two stamps (the device clock's low 32 bits, which wrap
    every 4.3 s) as the signed number of ns it stands for; ints or arrays."""
    return (d + (1 << 31)) % (1 << 32) - (1 << 31)


def summarize(stamps: np.ndarray, slots: int, nw: int, resident: int) -> dict:
    """One launch's figures from its [threadgroups, 16] stamp table (us)."""
    tl = stamps.reshape(-1, 16).astype(np.int64)
    # unwrap each stamp against the first threadgroup's entry (column 0 is
    # the SM, and 0 is "not stamped")
    t = tl[:, 1:]
    base = tl[0, 1]
    tl[:, 1:] = np.where(t != 0, _signed32(t - base) + base, 0)
    t0 = tl[:, 1].min()
    rel = lambda a: (a - t0) / 1e3  # noqa: E731  (ns -> us from the first entry)
    sidx = np.arange(tl.shape[0]) % slots
    packed = tl[sidx != slots - 1]
    last = tl[tl[:, 5] != 0]
    end = rel(last[:, 5]).max()
    loop = (packed[:, 3] - packed[:, 2]) / 1e3
    warp_end = packed[:, 8:8 + nw]
    spread = (warp_end.max(1) - warp_end.min(1)) / 1e3
    fin = rel(packed[:, 4])
    busy = ((tl[:, 4] - tl[:, 1]) / 1e3).sum() + ((last[:, 5] - last[:, 4]) / 1e3).sum()
    return {
        "span": end, "ramp": rel(tl[:, 1]).max(),
        "prologue": float(np.median((packed[:, 2] - packed[:, 1]) / 1e3)),
        "loop_min": loop.min(), "loop_med": float(np.median(loop)), "loop_max": loop.max(),
        "warp_spread_med": float(np.median(spread)), "warp_spread_max": spread.max(),
        "fin_q10": float(np.quantile(fin, 0.1)), "fin_med": float(np.median(fin)), "fin_max": fin.max(),
        "tail": end - fin.max(), "window_end": rel(tl[sidx == slots - 1][:, 4]).max(),
        "slot_use": busy / (resident * end),
        "sms": len(np.unique(tl[:, 0])), "first": t0, "end_abs": t0 + end * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512k")
    ap.add_argument("--chain", type=int, default=8, help="dependent launches per evaluation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pipelined", type=int, default=0,
                    help="tokens of --chain launches, pipelined with mx.async_eval (0 = off)")
    ap.add_argument("--save", default="", help="write the raw stamps ([evals, launches, threadgroups, 16]) to this .npy")
    args = ap.parse_args()
    n = g.parse_len(args.tokens)
    launch, q, slots, cfg = timeline_step(n)
    nw = cfg["NW"]
    sms = 132
    resident = sms * max(1, 16 // nw)  # 16 warps per SM at the 128-register cap
    print(f"tq_decode_tc8_fused timeline, {n} tokens, {slots - 1} splits + window per kv head, "
          f"{slots * g.HKV} threadgroups of {nw} warps, {cfg['TOKS']} tokens per split, "
          f"{'dynamic 32-token chunks' if dict(cfg['TEMPLATE'])['DYN'] else 'static splits'}")
    if args.pipelined:
        return pipelined(launch, q, slots, nw, resident, args.pipelined, args.chain)
    rows, raw = [], []
    for rep in range(args.repeats + 1):
        x, outs = q, []
        for _ in range(args.chain):
            st, x = launch(x)
            outs.append(st)
        h0 = time.time_ns()
        mx.eval(outs, x)
        mx.synchronize()
        h1 = time.time_ns()
        if rep == 0:
            continue  # compile and warm-up
        stamps = [np.asarray(st).view(np.uint32) for st in outs]
        sums = [summarize(st, slots, nw, resident) for st in stamps]
        # the device clock usually follows the host's (the driver syncs it):
        # then these say how long the evaluation ran before the first launch
        # started and after the last one ended (low 32 bits, signed)
        wrap = lambda d: _signed32(int(d)) / 1e3  # noqa: E731
        print(f"  eval {rep}: host {(h1 - h0) / 1e3:.1f} us; eval start -> first launch "
              f"{wrap(sums[0]['first'] - (h0 & 0xFFFFFFFF)):.1f} us, last launch end -> sync return "
              f"{wrap((h1 & 0xFFFFFFFF) - sums[-1]['end_abs']):.1f} us (if the clocks agree)")
        raw.append(np.stack(stamps))
        prev_end = None
        for i, s in enumerate(sums):
            s["gap"] = _signed32(int(s["first"] - prev_end)) / 1e3 if prev_end is not None else float("nan")
            prev_end = s["end_abs"]
            s["call"] = i
            rows.append(s)
    keys = ["span", "gap", "ramp", "prologue", "loop_min", "loop_med", "loop_max", "warp_spread_med",
            "warp_spread_max", "fin_q10", "fin_med", "fin_max", "tail", "window_end", "slot_use"]
    print("per launch (us from the launch's first threadgroup; slot_use: busy / (resident slots x span)):")
    print("  call " + " ".join(f"{k:>9}" for k in keys))
    for s in rows:
        print(f"  {s['call']:>4} " + " ".join(f"{s[k]:>9.2f}" if k != "slot_use" else f"{s[k]:>9.3f}"
                                             for k in keys))
    med = {k: float(np.nanmedian([s[k] for s in rows])) for k in keys}
    print("  med  " + " ".join(f"{med[k]:>9.2f}" if k != "slot_use" else f"{med[k]:>9.3f}" for k in keys))
    print(f"  SMs used: {rows[-1]['sms']}")
    if args.save:
        np.save(args.save, np.stack(raw).reshape(len(raw), args.chain, -1, 16))
    return 0


def pipelined(launch, q, slots: int, nw: int, resident: int, tokens: int, layers: int) -> int:
    """The generation loop's timeline: where the device time per launch goes
    when tokens are pipelined (see the module docstring)."""
    def token(x):
        outs = []
        for _ in range(layers):
            st, x = launch(x)
            outs.append(st)
        return outs, x

    outs, x = token(q)  # compile and warm-up
    mx.eval(outs, x)
    mx.synchronize()
    stamps, prev = [], None
    t0 = time.perf_counter()
    for _ in range(tokens):
        outs, x = token(x)
        mx.async_eval(outs, x)
        if prev is not None:
            mx.eval(prev)  # the host's wait for the token before
        prev = x
        stamps.append(outs)
    mx.eval(stamps, x)
    mx.synchronize()
    wall = (time.perf_counter() - t0) / (tokens * layers) * 1e6
    sums = [summarize(np.asarray(st).view(np.uint32), slots, nw, resident) for outs in stamps for st in outs]
    span = np.array([s["span"] for s in sums])
    gaps = np.array([_signed32(int(b["first"] - a["end_abs"])) / 1e3 for a, b in zip(sums, sums[1:])])
    at_token = gaps[layers - 1::layers]  # the gap before each token's first launch
    inside = np.delete(gaps, np.arange(layers - 1, len(gaps), layers))
    device = (span.sum() + gaps.sum()) / len(sums)
    stats = lambda a: f"median {np.median(a):.2f}  p90 {np.quantile(a, 0.9):.2f}  max {a.max():.2f}"  # noqa: E731
    print(f"pipelined: {tokens} tokens x {layers} dependent launches, mx.async_eval per token")
    print(f"  span per launch (us):           {stats(span)}  mean {span.mean():.2f}")
    print(f"  gap inside a token (us):        {stats(inside)}  mean {inside.mean():.2f}")
    print(f"  gap before a token (us):        {stats(at_token)}  mean {at_token.mean():.2f}")
    print(f"  device time per launch: {device:.2f} us (first entry to last end / launches); "
          f"host wall time per launch: {wall:.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
