"""Builds pyx/ Cython modules into the `fastbroker` package; metadata is in pyproject.toml."""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

PYX_ROOT = Path("pyx")


def cython_extensions() -> list[Extension]:
    """One extension per pyx/<package>/<name>.pyx, named <package>.<name>."""
    extensions = []
    for pyx in sorted(PYX_ROOT.glob("fastbroker/*.pyx")):
        module = ".".join(pyx.relative_to(PYX_ROOT).with_suffix("").parts)
        extensions.append(Extension(module, [str(pyx)]))
    return extensions


setup(
    ext_modules=cythonize(
        cython_extensions(),
        # pyx/ is the include root so `cimport fastbroker._connection` finds the .pxd files.
        include_path=[str(PYX_ROOT)],
        # Generated C goes under build/ (ignored by git), not next to the sources.
        build_dir="build/cython",
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "embedsignature": True,
        },
    ),
)
