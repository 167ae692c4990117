"""The C++ extension (csrc/): built once, ahead of use, and loaded as a plain Python extension.

`make setup` builds it (`python -m blockdraft.ops.extension`) into the blockdraft cache, in a
folder named by a hash of its sources, flags and torch's version, so a changed source or torch
builds anew and an unchanged one is reused. torch's `cpp_extension` compiles it with ninja; the
build runs in a child process whose PATH holds the `ninja` our dependency installs beside this
Python (a venv need not be activated), so this process's environment is never changed. Where
the extension is not built yet (a library install without `make setup`) the first use builds it
the same way, saying so; where it cannot be built (no compiler, another CPU) or run, `load`
returns None with one warning, and the packed layers run oneDNN's kernels instead (packed.py).
BLOCKDRAFT_FEW_ROWS=0 turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from .cpu import cpu_flags

NAME = "blockdraft_few_rows"
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("few_rows.cpp", "rope_cache.cpp", "blocks512.cpp", "q8.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "units.h"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: ATen's parallel_for splits the panels across threads


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockdraft" / "extensions"


def build_dir() -> Path:
    """Where this version of the extension lives: its sources, flags and torch's version hashed."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(" ".join(FLAGS).encode() + torch.__version__.encode() + sys.version.encode())
    return cache_root() / f"{NAME}-{digest.hexdigest()[:16]}"


def built() -> Path | None:
    """The built library, if this version was built."""
    found = sorted(build_dir().glob(f"{NAME}*.so"))
    return found[0] if found else None


def wanted() -> str | None:
    """Why the extension is not for this machine (None: it is)."""
    if os.environ.get("BLOCKDRAFT_FEW_ROWS", "1") == "0":
        return "turned off by BLOCKDRAFT_FEW_ROWS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86 CPU ({platform.machine()})"
    flags = cpu_flags()  # None: no /proc (not Linux): the extension checks the instructions itself
    if flags is not None and not {"avx2", "fma", "f16c"} <= flags:  # f16c: GGUF blocks' fp16 scales
        return "the CPU lacks AVX2, FMA or F16C"
    return None


def build(quiet: bool = False) -> Path:
    """Compile the extension in a child process (about 30 s on 2 cores) into a folder of its own,
    renamed into place whole (a killed build or a concurrent one never leaves a torn library);
    its library's path."""
    out = build_dir()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = dict(os.environ)
    try:
        import ninja  # the build tool torch's cpp_extension runs: our dependency's, on the child's PATH

        env["PATH"] = ninja.BIN_DIR + os.pathsep + env.get("PATH", "")
    except ImportError:
        pass
    code = ("import sys; from torch.utils import cpp_extension as c; "
            f"c.load({NAME!r}, sys.argv[2:], build_directory=sys.argv[1], extra_cflags={FLAGS!r}, "
            "extra_ldflags=['-fopenmp'], verbose=False)")
    if not quiet:
        print("blockdraft: compiling the few-row kernels (once, about 30 s)", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-c", code, str(tmp), *map(str, SOURCES)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not any(tmp.glob(f"{NAME}*.so")):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError("the build failed: " + " | ".join(tail))
    shutil.rmtree(out, ignore_errors=True)  # a library that did not import (`library`), if any
    try:
        os.rename(tmp, out)
    except OSError:  # another process put its build in place first: use that one
        shutil.rmtree(tmp, ignore_errors=True)
    return built()


def library() -> Path:
    """This version's library, built if it is missing or does not import (then built anew once)."""
    lib = built()
    if lib is not None:
        try:
            import_library(lib)
            return lib
        except ImportError:
            pass
    return build()


def import_library(lib: Path):
    """The built library as a Python module (torch imported first: it links against torch's)."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(lib))
    spec = importlib.util.spec_from_file_location(NAME, str(lib), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_loaded: list = []  # [module or None] once tried


def load():
    """The extension's module where it runs here (built if it was not), else None (one warning)."""
    if _loaded:
        return _loaded[0]
    module = None
    if wanted() is None:
        try:
            module = import_library(library())
            if not module.supported():
                module = None
            else:
                module.set_avx512(os.environ.get("BLOCKDRAFT_AVX512", "1") != "0")
        except Exception as err:  # no compiler, a failed build: the other kernels still run
            message = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            warnings.warn(f"blockdraft: the few-row kernels are unavailable ({type(err).__name__}: {message}); "
                          "using oneDNN's")
    _loaded.append(module)
    return module


def main() -> None:  # python -m blockdraft.ops.extension: `make setup`'s build step
    reason = wanted()
    if reason is not None:
        print(f"blockdraft: the few-row kernels are not built here: {reason}; oneDNN's kernels run instead")
        return
    try:
        lib = library()  # imported once: a library that does not is built anew
    except RuntimeError as err:
        print(f"blockdraft: the few-row kernels could not be built ({err}); oneDNN's kernels run instead")
        return
    print(f"blockdraft: the few-row kernels are built: {lib}")


if __name__ == "__main__":
    main()
