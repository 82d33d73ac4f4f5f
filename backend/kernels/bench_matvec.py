"""Benchmark: decode-time x @ w.T through MLX (BLAS sgemv) vs Arbor's native kernel.

    python -m backend.kernels.bench_matvec [--reps 10] [--quick] [--threads N]

Prints weight-streaming GB/s and microseconds per product for the shapes of a 135M
Llama (hidden 576, intermediate 1536, vocab 49152), then a 30-layer decode chain of
those products (float32, bfloat16 and 4-bit weights), in ms per token. Each product set is larger than
the last-level cache, so the figures are memory-bound like real decode. MLX and kernel
runs alternate and the best of the rounds is kept, which evens out noise from other
processes sharing the machine.
"""

from __future__ import annotations

import argparse
import time

import backend  # noqa: F401  (loads the system BLAS before mlx.core)
import mlx.core as mx

from backend import kernels

SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (1536, 576), (49152, 576)]


def _timeit(fn, reps: int) -> float:
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t) / reps


def _best(fns: dict, reps: int, rounds: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            best[k] = min(best[k], _timeit(f, reps))
    return best


def bench_shapes(reps: int, rounds: int, budget_mb: int) -> None:
    print(f"{'shape (N x K)':>16} {'MLX GB/s':>9} {'kernel GB/s':>12} {'MLX us':>9} {'kernel us':>10} {'speedup':>8}")
    for n, k in SHAPES:
        per = n * k * 4
        copies = max(1, min(30, (budget_mb << 20) // per))
        ws = [mx.random.normal((n, k)) * 0.02 for _ in range(copies)]
        x = mx.random.normal((1, k))
        mx.eval(ws, x)
        fns = {
            "mlx": lambda: [x @ w.T for w in ws],
            "kernel": lambda: [kernels.matvec(x, w) for w in ws],
        }
        t = _best(fns, reps, rounds)
        gb = {key: per * copies / v / 1e9 for key, v in t.items()}
        us = {key: v / copies * 1e6 for key, v in t.items()}
        print(f"{n:>8} x {k:<5} {gb['mlx']:9.1f} {gb['kernel']:12.1f} {us['mlx']:9.1f} {us['kernel']:10.1f} "
              f"{t['mlx'] / t['kernel']:7.2f}x")


def _chain_weights(layers: int):
    def mk(*s):
        return mx.random.normal(s) * 0.02

    ws = {name: [mk(*shape) for _ in range(layers)] for name, shape in (
        ("q", (576, 576)), ("k", (192, 576)), ("v", (192, 576)), ("o", (576, 576)),
        ("g", (1536, 576)), ("u", (1536, 576)), ("d", (576, 1536)))}
    ws["E"] = mk(49152, 576)
    mx.eval(list(ws.values()))
    return ws


def _chain(ws, mm, layers: int):
    def step(x):
        for i in range(layers):
            h = mm(x, ws["q"][i]) + 0
            mm(x, ws["k"][i]), mm(x, ws["v"][i])
            x = x + mm(h, ws["o"][i])
            x = x + mm(mx.sigmoid(mm(x, ws["g"][i])) * mm(x, ws["u"][i]), ws["d"][i])
        return mm(x, ws["E"])

    return step


def bench_chain(reps: int, rounds: int, layers: int = 30) -> None:
    ws = _chain_weights(layers)
    nbytes = sum(a.nbytes for v in ws.values() for a in (v if isinstance(v, list) else [v]))
    x0 = mx.random.normal((1, 1, 576))
    mx.eval(x0)
    plain = _chain(ws, lambda x, w: x @ w.T, layers)
    native = _chain(ws, kernels.matvec, layers)
    a, b = plain(x0), native(x0)
    err = mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-30)
    t = _best({"mlx": lambda: plain(x0), "kernel": lambda: native(x0)}, reps, rounds)
    print(f"\n{layers}-layer float32 chain ({7 * layers + 1} products, {nbytes / 1e6:.0f} MB), max rel. diff {err:.1e}")
    for key, v in t.items():
        print(f"  {key:>6}: {v * 1e3:6.1f} ms/token  {nbytes / v / 1e9:5.1f} GB/s  ({1 / v:.1f} tok/s)")
    print(f"  speedup {t['mlx'] / t['kernel']:.2f}x")

    # bfloat16 weights (exact for checkpoints stored in bf16): half the bytes to stream.
    hb = {k: ([w.astype(mx.bfloat16) for w in v] if isinstance(v, list) else v.astype(mx.bfloat16))
          for k, v in ws.items()}
    mx.eval(list(hb.values()))
    plain_h = _chain(hb, lambda x, w: x @ w.T, layers)
    native_h = _chain(hb, kernels.matvec, layers)
    a, b = plain_h(x0), native_h(x0)
    err = mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-30)
    t = _best({"mlx": lambda: plain_h(x0), "kernel": lambda: native_h(x0)}, reps, rounds)
    print(f"\n{layers}-layer chain, bfloat16 weights ({nbytes / 2e6:.0f} MB), max rel. diff {err:.1e}")
    for key, v in t.items():
        print(f"  {key:>6}: {v * 1e3:6.1f} ms/token  {nbytes / 2 / v / 1e9:5.1f} GB/s  ({1 / v:.1f} tok/s)")
    print(f"  speedup {t['mlx'] / t['kernel']:.2f}x")
    del hb

    # The same chain with 4-bit weights (group 64), MLX quantized_matmul vs matvec_q.
    q = {k: [mx.quantize(w, group_size=64, bits=4) for w in (v if isinstance(v, list) else [v])]
         for k, v in ws.items()}
    del ws
    q = {k: (v if k != "E" else v[0]) for k, v in q.items()}
    mx.eval(q)
    qbytes = sum(sum(p.nbytes for p in t3) for v in q.values() for t3 in (v if isinstance(v, list) else [v]))

    def qmm(x, t3):
        return mx.quantized_matmul(x, *t3, transpose=True, group_size=64, bits=4)

    def qk(x, t3):
        return kernels.matvec_q(x, *t3, group_size=64, bits=4)

    plain_q, native_q = _chain(q, qmm, layers), _chain(q, qk, layers)
    a, b = plain_q(x0), native_q(x0)
    err = mx.abs(a - b).max().item() / max(mx.abs(a).max().item(), 1e-30)
    t = _best({"mlx": lambda: plain_q(x0), "kernel": lambda: native_q(x0)}, reps, rounds)
    print(f"\n{layers}-layer 4-bit (g64) chain ({qbytes / 1e6:.0f} MB), max rel. diff {err:.1e}")
    for key, v in t.items():
        print(f"  {key:>6}: {v * 1e3:6.1f} ms/token  ({1 / v:.1f} tok/s)")
    print(f"  speedup {t['mlx'] / t['kernel']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-mb", type=int, default=160, help="weights per shape set (beyond L3)")
    ap.add_argument("--threads", type=int, default=0, help="cap kernel threads (0: all cores)")
    ap.add_argument("--skip-chain", action="store_true")
    args = ap.parse_args()
    if not kernels.available() and not kernels.ensure_built(quiet=False):
        raise SystemExit(f"native kernels unavailable: {kernels.unavailable_reason()}")
    kernels.set_num_threads(args.threads)
    print(f"kernel isa: {kernels.isa()}, BLAS: {backend.blas.active_blas}")
    bench_shapes(args.reps, args.rounds, args.budget_mb)
    if not args.skip_chain:
        bench_chain(args.reps, args.rounds)


if __name__ == "__main__":
    main()
