"""Where the host time of the decode step's kernel call goes (GPU needed).

  python3 benchmarks/kernel_call_cost.py [--tokens 32k]
  python3 benchmarks/kernel_call_cost.py --tree DIR [--tokens 32k]

Default: graph build per call (no evaluation) of fp16 SDPA, the whole
decode step, its plan lookup, and the step's ``cuda_kernel`` call in
variants -- as the plan launches it (launch-shape constants compiled into
the body), with those constants passed as MLX template arguments instead,
with a kernel object of the same name but a 5-character source, and a
copy kernel with 2 and 16 inputs.  The short-source object runs the same
compiled module (MLX finds a custom kernel's module by its name, and the
real one has run first); it is built here only to time a call whose source
costs nothing to assemble, and its output is checked against the real one.

``--tree DIR``: import ``turboquant`` from DIR (e.g. an older commit's
``git archive REV turboquant metal | tar -x -C DIR``) and print the whole
step's graph build and the generation loop at 32k and 512k tokens: an A/B
of the dispatcher between trees, one process per tree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="32k")
    ap.add_argument("--tree", default="", help="import turboquant from this directory (A/B mode)")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    sys.path.insert(0, args.tree or str(here.parent))
    import turboquant  # noqa: F401  (the chosen tree's, before gpu_attention puts the repo first)
    from turboquant import kernels as K

    sys.path.insert(1, str(here))
    import gpu_attention as ga
    import host_cost
    import mlx.core as mx

    def per_call(fn):
        return host_cost.per_call(fn, 4000, warm=300, repeats=7)

    print(f"turboquant from {Path(K.__file__).parent}")
    n = ga.parse_len(args.tokens)
    q = mx.random.normal((1, ga.HQ, 1, ga.D)).astype(mx.float16)
    wk = ga.window_keys()
    c = ga.tq_cache(n, 3.5)
    step = ga.whole_step(wk)
    mx.eval(step(q, c))
    build = per_call(lambda: step(q, c))
    if args.tree:
        print(f"graph build per call, whole step at {n} tokens: {build:.2f} us")
        ga.bench_generation([ga.parse_len("32k"), ga.parse_len("512k")], {})
        return 0

    plan = K._step_plan(q, wk, wk, c, ga.SCALE)
    kern = plan.kernel
    cap = {}

    def capture(**kw):
        cap.update(kw)
        return kern(**kw)

    plan.kernel = capture
    plan.launchers.clear()
    mx.eval(step(q, c))
    plan.kernel = kern
    plan.launchers.clear()
    D, R, BH, kb, vb = plan.dims
    cfg = K._tc8_config(D, R, BH, n, kb, vb, True, K._tc8_env())
    name, consts = "tq_decode_tc8_fused", tuple(cfg["TEMPLATE"])
    tag = K.dtype_tag(cap["inputs"], cap["output_dtypes"])
    assert K._kernel(name, "cuda", cfg["PRELUDE"], tag, consts) is kern
    templated = K._kernel(name, "cuda", cfg["PRELUDE"], tag)  # the same body, constants as template arguments
    header, body = K.mlx_source(name, "cuda", cfg["PRELUDE"], consts)
    mlx_name = K.mlx_kernel_name(name, header, body, tag)
    inputs, outputs = K._SIGNATURES[name]
    short = mx.fast.cuda_kernel(name=mlx_name, input_names=inputs, output_names=outputs, source="/*x*/")
    ref = kern(**cap)[1]
    mx.eval(ref)
    for other, kw in ((templated, dict(cap, template=cfg["TEMPLATE"])), (short, cap)):
        out = other(**kw)[1]
        mx.eval(out)  # one at a time: the launches share the plan's split counters
        assert mx.allclose(out, ref, rtol=1e-2, atol=1e-3).item(), "a variant ran another kernel"
    kv = ga.fp16_cache(n)
    rows = {
        "fp16 sdpa": per_call(lambda: mx.fast.scaled_dot_product_attention(q, *kv, scale=ga.SCALE)),
        "whole step": build,
        "plan lookup": per_call(lambda: K._step_plan(q, wk, wk, c, ga.SCALE)),
        "kernel call as the plan makes it": per_call(lambda: kern(**cap)),
        "kernel call, constants as template args": per_call(lambda: templated(**cap, template=cfg["TEMPLATE"])),
        "kernel call, same module, 5-char source": per_call(lambda: short(**cap)),
    }
    for k in (2, 16):
        copy = ga._copy_kernel(k)
        xs = [mx.zeros((4096,))] + [mx.zeros((8,), mx.uint32) for _ in range(k - 1)]
        kw = dict(inputs=xs, grid=(4096, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(4096,)],
                  output_dtypes=[mx.float32])
        mx.eval(copy(**kw)[0])
        rows[f"copy kernel call, {k} inputs"] = per_call(lambda copy=copy, kw=kw: copy(**kw))
    print(f"kernel source as handed to MLX: {len(header) + len(body)} chars; constants {list(consts)}")
    print(f"== graph build per call, {n} tokens, no evaluation (us, best of 7 x 4000)")
    for k, t in rows.items():
        print(f"  {k:<42} {t:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
