"""engine/numba_cache.py: a cached kernel compiles again when a file it compiles in changes
(Numba's own key holds only the kernel's file), and every cached kernel of the engine is so
keyed."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numba
import pytest

from engine import numba_cache
from engine.numba_cache import cached_njit, compiled_sources, source_digest

REPO = Path(__file__).resolve().parents[2]

# a package whose kernel compiles in an njit helper of another file (imported as a module, by a
# relative import) and a constant of a third (which does not import numba); a fourth file is
# imported by the constants' file only
_PACKAGE = {
    "__init__.py": "",
    "helper.py": """
        import numba

        @numba.njit
        def value():
            return 1
    """,
    "consts.py": """
        from kpkg import unrelated

        OFFSET = 10
    """,
    "unrelated.py": "NOTE = 'a'\n",
    "kernel.py": """
        from engine.numba_cache import cached_njit
        from kpkg.consts import OFFSET

        from . import helper

        @cached_njit
        def kernel():
            return helper.value() + OFFSET
    """,
}

_RUN = """
from kpkg.kernel import kernel
print(kernel(), sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
"""


def _write(folder: Path, name: str, text: str):
    (folder / "kpkg" / name).write_text(textwrap.dedent(text))


def _run(folder: Path) -> tuple[int, int, int]:
    """(the kernel's value, its cache hits, its cache misses) in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = f"{folder}{os.pathsep}{REPO}"
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # an edit within a second must not load an old .pyc
    done = subprocess.run(
        [sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    value, hits, misses = done.stdout.split()
    return int(value), int(hits), int(misses)


def test_a_kernel_compiles_again_when_a_file_it_compiles_in_changes(tmp_path):
    (tmp_path / "kpkg").mkdir()
    for name, text in _PACKAGE.items():
        _write(tmp_path, name, text)
    assert _run(tmp_path) == (11, 0, 1)  # compiled and stored
    # a file the constants' module imports, which does not import numba: not followed
    _write(tmp_path, "unrelated.py", "NOTE = 'b'\n")
    assert _run(tmp_path) == (11, 1, 0)  # loaded from the cache
    _write(tmp_path, "helper.py", _PACKAGE["helper.py"].replace("return 1", "return 2"))
    assert _run(tmp_path) == (12, 0, 1)  # Numba alone loads 11, the old helper's code
    _write(tmp_path, "consts.py", _PACKAGE["consts.py"].replace("10", "20"))
    assert _run(tmp_path) == (22, 0, 1)
    assert _run(tmp_path) == (22, 1, 0)


_ENGINE_KERNELS = (
    "engine.cpu.bits",
    "engine.cpu.decode_attention",
    "engine.cpu.hadamard",
    "engine.cpu.kv_gather",
    "engine.cpu.quant_write",
    "engine.cpu.team",
    "engine.sampling_cpu",
)


@pytest.mark.parametrize("name", _ENGINE_KERNELS)
def test_engine_kernels_cached_on_disk_are_keyed_on_what_they_compile_in(name):
    module = importlib.import_module(name)
    kernels = [
        k
        for k in vars(module).values()
        if isinstance(k, numba.core.registry.CPUDispatcher)
        and k.py_func.__module__ == name
        and not isinstance(k._cache, numba.core.caching.NullCache)
    ]
    assert kernels, f"{name} has no kernel cached on disk"
    for kernel in kernels:
        stamp = kernel._cache._cache_file._source_stamp
        assert isinstance(stamp, tuple) and stamp[1] == source_digest(name), kernel


def test_the_decode_kernel_is_keyed_on_the_intrinsics_and_the_layout():
    files = {
        p.relative_to(REPO).as_posix() for p in compiled_sources("engine.cpu.decode_attention")
    }
    assert {
        "engine/cpu/decode_attention.py",
        "engine/cpu/simd.py",
        "engine/cpu/bits.py",
        "engine/cpu/hadamard.py",
        "engine/cache/quant.py",
    } <= files
    assert "engine/generator.py" not in files


def test_a_function_numba_cannot_cache_still_compiles():
    scope: dict = {}
    exec(compile("def f(x):\n    return x + 1\n", "<string>", "exec"), scope)
    assert cached_njit(scope["f"])(1) == 2
    assert cached_njit(fastmath=True)(scope["f"])(2.0) == 3.0


def test_a_numba_whose_cache_index_moved_compiles_uncached(monkeypatch, caplog):
    """Where a Numba release keeps its cache index under other names, the kernel is not
    cached on disk (it could not be keyed on its sources) rather than failing the import."""

    class MovedIndex:  # numba, but its cached kernels lack ``_cache._cache_file``
        def __getattr__(self, name):
            return getattr(numba, name)

        @staticmethod
        def njit(**options):
            if options.pop("cache", False):
                return lambda fn: types.SimpleNamespace(py_func=fn, _cache=object())
            return numba.njit(**options)

    monkeypatch.setattr(numba_cache, "numba", MovedIndex())
    kernel = cached_njit(fastmath=True)(_plus_one)
    assert kernel(1.0) == 2.0
    assert isinstance(kernel._cache, numba.core.caching.NullCache)
    assert "compiles in each process" in caplog.text


def _plus_one(x):
    return x + 1


@pytest.mark.parametrize(
    ("statement", "module", "package", "named"),
    [
        ("from . import x", "a.b.c", False, "a.b"),
        ("from . import x", "a.b", True, "a.b"),  # a package's __init__: its own level
        ("from .y import x", "a.b", True, "a.b.y"),
        ("from .. import x", "a.b.c", False, "a"),
        ("from ..y import x", "a.b.c", False, "a.y"),
        ("from a.q import x", "a.b", False, "a.q"),
    ],
)
def test_relative_imports_name_their_module(statement, module, package, named):
    node = ast.parse(statement).body[0]
    assert numba_cache._absolute(node, module, package) == named
