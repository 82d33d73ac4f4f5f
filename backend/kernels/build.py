"""Build Arbor's native MLX CPU kernels in place: ``python -m backend.kernels.build``.

Compiles ``matvec.cpp`` (the MLX primitives and their nanobind bindings), the kernel
translation units (one per instruction set, selected at run time) and nanobind's own
runtime, then links them against the installed MLX (``mlx/lib/libmlx.so``) into
``backend/kernels/_build/_arbor_kernels<EXT_SUFFIX>``. No CMake: the compiler is driven
directly, objects in parallel, so a build takes well under a minute on two cores (the
nanobind runtime object is cached across rebuilds).

Build-time requirements: a C++20 compiler (g++ >= 10 or clang >= 12) and the
``nanobind`` package in the version MLX was built with (its internals ABI must match, or
``mlx.core.array`` would not be recognised across the two modules); the build checks this
and says which version is needed. Linux x86-64 only: on macOS MLX runs on Metal.

After linking, a subprocess imports the module and compares one product with MLX; only
then is ``build_info.json`` written, which is what ``backend.kernels`` checks before it
loads the module.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "_build"
MODULE_NAME = "_arbor_kernels"
INFO_FILE = BUILD_DIR / "build_info.json"

# (source, extra flags). Kernel TUs get their ISA flags here; the driver in kernels.cpp
# checks CPUID before calling them.
_SOURCES = (
    ("matvec.cpp", ()),
    ("kernels.cpp", ()),
    ("decode_ops.cpp", ()),
    ("decode_math.cpp", ()),
    ("layer_ops.cpp", ()),
    ("gather_ops.cpp", ()),
    ("kernels_generic.cpp", ()),
    ("kernels_avx2.cpp", ("-mavx2", "-mfma", "-mf16c")),
    ("kernels_avx512.cpp", ("-mavx512f", "-mavx2", "-mfma", "-mf16c")),
)
_HEADERS = ("kernels.h", "kernels_impl.h", "kernels_keys.h", "kernels_q4x8.h", "kernels_panels.h", "decode_ops.h",
            "layer_ops.h", "mlx_glue.h", "gather_ops.h")


class BuildError(RuntimeError):
    """The extension could not be built here (reason in the message)."""


def module_path() -> Path:
    return BUILD_DIR / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))


def supported_platform() -> tuple[bool, str]:
    if sys.platform != "linux":
        return False, f"native kernels are built for Linux only (this is {sys.platform})"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return False, f"native kernels need an x86-64 CPU (this is {machine})"
    return True, ""


def source_hash() -> str:
    h = hashlib.sha256()
    for name in [s for s, _ in _SOURCES] + list(_HEADERS) + ["build.py"]:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:16]


def expected_info() -> dict:
    """What build_info.json must say for the built module to match this environment."""
    import mlx.core as mx

    return {
        "mlx": mx.__version__,
        "python": sysconfig.get_config_var("EXT_SUFFIX"),
        "sources": source_hash(),
    }


def _find_compiler() -> str:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    raise BuildError("no C++ compiler found (install g++ or set CXX)")


def _mlx_paths() -> tuple[Path, Path, Path]:
    try:
        import mlx
        import mlx.core as mx
    except Exception as e:  # noqa: BLE001 - any import failure means no MLX here
        raise BuildError(f"mlx is not importable: {e}") from e
    root = Path(mlx.__path__[0])
    include, lib = root / "include", root / "lib"
    if not (include / "mlx" / "backend" / "cpu" / "encoder.h").is_file():
        raise BuildError(f"MLX headers not found under {include}")
    if not (lib / "libmlx.so").is_file():
        raise BuildError(f"libmlx.so not found under {lib}")
    return include, lib, Path(mx.__file__)


def _nanobind_paths(mlx_core_so: Path) -> tuple[str, Path, Path, Path]:
    try:
        import nanobind
    except ImportError as e:
        raise BuildError("the nanobind package is missing (pip install nanobind)") from e
    src = Path(nanobind.source_dir())
    inc = Path(nanobind.include_dir())
    robin = src.parent / "ext" / "robin_map" / "include"
    combined = src / "nb_combined.cpp"
    if not combined.is_file() or not robin.is_dir():
        raise BuildError(f"nanobind {nanobind.__version__} lacks its sources under {src}")
    # Both modules must share nanobind's internals, or mlx.core.array is a foreign type.
    internals = (src / "nb_internals.h").read_text(errors="replace")
    backend_h = inc / "nanobind" / "nb_backend.h"
    m_ver = re.search(r"#\s*define\s+NB_INTERNALS_VERSION\s+(\d+)", internals)
    m_abi = re.search(
        r"#\s*define\s+NB_BACKEND_ABI_MAJOR\s+(\d+)",
        backend_h.read_text(errors="replace") if backend_h.is_file() else "",
    )
    if m_ver:
        key = (f"_a{m_abi.group(1)}" if m_abi else "") + f"_v{m_ver.group(1)}"
        blob = mlx_core_so.read_bytes()
        if re.search(rb"nanobind_[A-Za-z0-9_]*" + re.escape(key.encode()) + rb"(?![0-9])", blob) is None:
            found = re.findall(rb"nanobind_[A-Za-z0-9_]*_v\d+", blob)
            raise BuildError(
                f"nanobind {nanobind.__version__} (internals {key}) does not match the one "
                f"mlx.core was built with ({found[0].decode() if found else 'unknown'}); "
                "install the nanobind version MLX uses"
            )
    return nanobind.__version__, inc, robin, combined


def _run_parallel(jobs: list[tuple[list[str], str]], quiet: bool) -> None:
    """Runs compile commands, os.cpu_count() at a time; raises on the first failure."""
    width = max(1, os.cpu_count() or 1)
    pending = list(jobs)
    running: list[tuple[subprocess.Popen, str]] = []
    errors: list[str] = []
    while pending or running:
        while pending and len(running) < width:
            cmd, label = pending.pop(0)
            if not quiet:
                print(f"  compiling {label}", flush=True)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running.append((proc, label))
        proc, label = running.pop(0)
        out, _ = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"{label} failed:\n{out[-4000:]}")
            pending.clear()
        elif out.strip() and not quiet:
            print(out, end="")
    if errors:
        raise BuildError("\n".join(errors))


_SMOKE = r"""
import importlib.util, sys
import backend  # loads the system BLAS first, as the app does
import mlx.core as mx
spec = importlib.util.spec_from_file_location("backend.kernels._arbor_kernels", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
x = mx.random.normal((2, 3, 40)); w = mx.random.normal((37, 40))
got = mod.matvec(x, w); want = x @ w.T
mx.eval(got, want)
assert got.shape == (2, 3, 37), got.shape
assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), "matvec mismatch"
wq, s, b = mx.quantize(mx.random.normal((20, 64)), group_size=32, bits=4)
xq = mx.random.normal((1, 64))
got = mod.matvec_q(xq, wq, s, b, 32, 4)
want = mx.quantized_matmul(xq, wq, s, b, transpose=True, group_size=32, bits=4)
assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item(), "matvec_q mismatch"
print(mod.isa())
"""


def is_up_to_date() -> bool:
    """True when the built module matches the sources, MLX and Python in use."""
    if not module_path().is_file() or not INFO_FILE.is_file():
        return False
    try:
        have = json.loads(INFO_FILE.read_text())
    except (OSError, ValueError):
        return False
    return all(have.get(k) == v for k, v in expected_info().items())


def build(quiet: bool = False, force: bool = False) -> Path:
    """Builds the extension if it is missing or stale; returns its path. Raises BuildError.

    Concurrent callers (two app instances, parallel test workers) serialise on a lock
    file; the second finds the module up to date.
    """
    ok, why = supported_platform()
    if not ok:
        raise BuildError(why)
    _mlx_paths()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_up_to_date():
            if not quiet:
                print(f"up to date: {module_path()}")
            return module_path()
        return _build_locked(quiet)


def _build_locked(quiet: bool) -> Path:
    include, lib, core_so = _mlx_paths()
    want = expected_info()
    target = module_path()

    cxx = _find_compiler().split()
    nb_version, nb_inc, robin_inc, nb_combined = _nanobind_paths(core_so)
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").is_file():
        raise BuildError(f"Python headers not found ({py_inc}/Python.h); install python3-dev")

    (BUILD_DIR / ".gitignore").write_text("*\n")
    t0 = time.monotonic()

    # MLX builds its bindings in nanobind domain "mlx"; ours must join it to exchange
    # mlx.core.array objects.
    common = ["-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx", "-I", py_inc,
              "-I", str(nb_inc), "-I", str(robin_inc)]
    # nanobind's runtime: compiled once per (nanobind, Python, compiler) and reused.
    nb_flags = common + ["-O2", "-DNB_COMPACT_ASSERTIONS", "-fno-strict-aliasing",
                         "-ffunction-sections", "-fdata-sections"]
    cc_version = subprocess.run(cxx + ["--version"], capture_output=True, text=True).stdout
    nb_key = hashlib.sha256(
        "\0".join([nb_version, py_inc, cc_version, *cxx, *nb_flags]).encode()
    ).hexdigest()[:12]
    nb_obj = BUILD_DIR / f"nanobind-{nb_version}-{nb_key}.o"

    tmp = Path(tempfile.mkdtemp(prefix="obj-", dir=BUILD_DIR))
    try:
        jobs: list[tuple[list[str], str]] = []
        if not nb_obj.is_file():
            nb_tmp = tmp / "nanobind.o"
            jobs.append((cxx + nb_flags + ["-c", str(nb_combined), "-o", str(nb_tmp)],
                         f"nanobind {nb_version} runtime"))
        objs = []
        own = common + ["-O3", "-I", str(include), "-I", str(HERE), "-DNB_COMPACT_ASSERTIONS",
                        "-ffunction-sections", "-fdata-sections"]
        for src, extra in _SOURCES:
            obj = tmp / (Path(src).stem + ".o")
            objs.append(obj)
            jobs.append((cxx + own + list(extra) + ["-c", str(HERE / src), "-o", str(obj)], src))
        # Longest first: nanobind's runtime, then the MLX-heavy matvec.cpp.
        _run_parallel(jobs, quiet)
        if not nb_obj.is_file():
            os.replace(tmp / "nanobind.o", nb_obj)
            for old in BUILD_DIR.glob("nanobind-*.o"):  # other nanobind/Python/compiler builds
                if old != nb_obj:
                    old.unlink(missing_ok=True)

        out_tmp = tmp / target.name
        link = cxx + ["-shared", "-o", str(out_tmp), *map(str, objs), str(nb_obj),
                      "-L", str(lib), "-lmlx", f"-Wl,-rpath,{lib}", "-Wl,--gc-sections",
                      "-Wl,-s", "-pthread"]
        if not quiet:
            print("  linking", flush=True)
        res = subprocess.run(link, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"link failed:\n{res.stdout}{res.stderr}"[-4000:])

        env = dict(os.environ)
        repo = str(HERE.parent.parent)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        smoke = subprocess.run([sys.executable, "-c", _SMOKE, str(out_tmp)], capture_output=True,
                               text=True, env=env, cwd=repo, timeout=300)
        if smoke.returncode != 0:
            raise BuildError(f"the built module failed its check:\n{(smoke.stdout + smoke.stderr)[-4000:]}")
        isa = smoke.stdout.strip().splitlines()[-1] if smoke.stdout.strip() else "?"

        os.replace(out_tmp, target)
        info = dict(want, nanobind=nb_version, isa=isa, compiler=cc_version.splitlines()[0] if cc_version else "")
        INFO_FILE.write_text(json.dumps(info, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"built {target} ({isa}) in {time.monotonic() - t0:.1f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        build(quiet=args.quiet, force=args.force)
    except BuildError as e:
        print(f"arbor kernels: not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
