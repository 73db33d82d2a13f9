"""Numba's on-disk cache for our CPU kernels, keyed on every source file compiled into them.

Numba keys a cached kernel on its own file (a hash of it) and its bytecode. What the kernel
compiles in from other files is frozen into the cached machine code but missing from the key:
the intrinsics of engine/cpu/simd.py, njit helpers of other modules (inlined or called), and
constants such as ``GROUP`` (engine/cache/quant.py). A checkout whose simd.py changed while
decode_attention.py did not went on loading the kernel built on the old intrinsics, with no
sign of it (a stale ``__pycache__``; a fresh clone or install was not affected).

``cached_njit`` adds a digest of those files to the key: the files of the modules the kernel's
module imports from its own top-level package, followed through the modules that themselves
compile code (import numba) and ending at the others (which can lend only constants). A
change to any of them makes the cached entry stale, and Numba compiles the kernel again and
replaces it. Where Numba finds nowhere to write a cache, or keeps its index where this module
does not look (its attributes, not an API), the kernel compiles in each process.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import sys
from pathlib import Path

import numba

logger = logging.getLogger(__name__)


def cached_njit(fn=None, **options):
    """``numba.njit(cache=True, **options)`` whose cache key also holds ``source_digest`` of
    the function's module; ``@cached_njit`` or ``@cached_njit(nogil=True, ...)``."""
    if fn is None:
        return lambda f: cached_njit(f, **options)
    try:
        kernel = numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # Numba's "no locator available": no writable place for a cache
        logger.info("numba cannot cache %s here; compiling it in each process", fn.__name__)
        return numba.njit(**options)(fn)
    try:
        index = kernel._cache._cache_file  # Numba's index of the cached overloads of ``fn``
        # the index keeps entries whose stored stamp equals this one, and stores this one
        index._source_stamp = (index._source_stamp, source_digest(fn.__module__))
    except AttributeError:  # (Numba's own attributes, not an API: 0.68 has them)
        logger.warning(
            "numba %s keeps its cache index elsewhere: %s compiles in each process rather "
            "than load code its cache cannot tell is stale",
            numba.__version__,
            fn.__name__,
        )
        return numba.njit(**options)(fn)
    return kernel


@functools.cache
def source_digest(module: str) -> str:
    """sha256 over ``compiled_sources(module)``: each file's path, then its bytes."""
    digest = hashlib.sha256()
    for path in compiled_sources(module):
        digest.update(str(path).encode() + b"\0")
        digest.update(_source(path))
    return digest.hexdigest()


@functools.cache
def compiled_sources(module: str) -> tuple[Path, ...]:
    """The source files whose contents can end up in ``module``'s compiled kernels, sorted:
    its own, and those of the modules of its top-level package it imports, followed through
    the ones that compile code (``_compiles_with``)."""
    package = module.partition(".")[0]
    seen: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen or (path := _source_file(name)) is None:
            continue
        seen[name] = path
        imports, compiles = _imports_of(path, name)
        if name == module or compiles:
            pending.extend(i for i in imports if i.partition(".")[0] == package)
    return tuple(sorted(seen.values()))


def _source_file(module: str) -> Path | None:
    """The .py file of ``module`` (a top-level module or package already imported, or a
    module inside such a package), found on disk without importing anything (None: no such
    file, e.g. ``from a.b import y`` where y is not a module)."""
    top, _, rest = module.partition(".")
    loaded = sys.modules.get(top)
    if getattr(loaded, "__file__", None) is None:
        return None
    if not rest:
        return Path(loaded.__file__).resolve()
    if not hasattr(loaded, "__path__"):  # a plain module has no modules inside it
        return None
    base = Path(loaded.__file__).resolve().parent.joinpath(*rest.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _source(path: Path) -> bytes:
    """A file's bytes, read once per process for both its imports and the digest."""
    return path.read_bytes()


@functools.cache
def _imports_of(path: Path, module: str) -> tuple[tuple[str, ...], bool]:
    """(the modules the file of ``module`` imports anywhere in it, relative imports resolved,
    with ``a.b.y`` for each ``from a.b import y`` in case y is a module; whether it compiles
    code: ``_compiles_with``)."""
    names = []
    for node in ast.walk(ast.parse(_source(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return tuple(names), any(_compiles_with(name) for name in names)


def _compiles_with(module: str) -> bool:
    """Whether importing ``module`` marks a file that compiles code: numba, llvmlite, or this
    module (whose users may import nothing else of numba's)."""
    return module.partition(".")[0] in ("numba", "llvmlite") or module == __name__


def _absolute(node: ast.ImportFrom, module: str, package: bool) -> str:
    """The module a ``from ... import`` in ``module`` (a package's ``__init__`` if
    ``package``) names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module if package else module.rpartition(".")[0]
    if node.level > 1:
        base = base.rsplit(".", node.level - 1)[0]
    return f"{base}.{node.module}" if node.module else base
