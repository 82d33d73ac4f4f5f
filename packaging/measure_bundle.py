"""Measure the built bundle: ``python packaging/measure_bundle.py [--runs 3]``.

Prints the bundle's size and what takes the space, then start-up figures from ``arbor app
--smoke`` runs offscreen, in a throwaway data dir (platformdirs under ``XDG_DATA_HOME``):

    cold, first start   the bundle's files evicted from the page cache, an empty data dir
                        (so the model is also imported into the store: "model ready")
    cold                evicted again, the data dir from the first start
    warm                the median of ``--runs`` more starts, nothing evicted

"window usable" counts from the process's start (as the kernel recorded it: the bootloader
included) to the window shown, painted and the event loop turning; the model loads on the
worker thread meanwhile and is not part of it. "first token" counts from Send to the first text
in the window. Timings depend on the machine and its load; this is a measurement, not a test.
Needs the bundle (``bash packaging/dev.sh bundle``); Linux (page-cache eviction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bundle_config as cfg  # noqa: E402
from build_bundle import size_report  # noqa: E402


def evict_from_page_cache(root: Path) -> None:
    """Drop the cached pages of every file under ``root`` (no privileges needed)."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def smoke(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARBOR_")}
    env.pop("DISPLAY", None)
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               QT_QPA_PLATFORM="offscreen")
    proc = subprocess.run([str(cfg.executable()), "app", "--smoke"], env=env, capture_output=True,
                          text=True, timeout=900, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"measure: the smoke run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(label: str, report: dict) -> str:
    t = report["timings_s"]
    return (f"{label:20} {t['usable_since_process_start']:8.2f} s {t['model_loaded']:10.2f} s "
            f"{t['first_token_after_send']:10.2f} s   engine ttft {report['reply_stats']['ttft_s']:.2f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="warm starts (the median is shown)")
    args = parser.parse_args(argv)
    bundle = cfg.bundle_dir()
    if not cfg.executable().is_file():
        raise SystemExit("measure: no bundle; build it with `bash packaging/dev.sh bundle`")
    print(size_report(bundle))
    print(f"{'':20} {'window usable':>10} {'model ready':>12} {'first token':>12}")
    with tempfile.TemporaryDirectory(prefix="arbor-measure-") as tmp:
        home = Path(tmp)
        evict_from_page_cache(bundle)
        print(row("cold, first start", smoke(home)))
        evict_from_page_cache(bundle)
        print(row("cold", smoke(home)))
        warm = [smoke(home) for _ in range(args.runs)]
        median = sorted(warm, key=lambda r: r["timings_s"]["usable_since_process_start"])[len(warm) // 2]
        spread = [r["timings_s"]["usable_since_process_start"] for r in warm]
        print(row(f"warm (median of {len(warm)})", median)
              + f"   usable: {min(spread):.2f}-{max(spread):.2f} s, mean {statistics.mean(spread):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
