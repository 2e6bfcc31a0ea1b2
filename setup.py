"""Builds swarm's CPU kernels (swarm/kernels/fma*.c) once, at install, into the extension
``swarm.kernels._fma``: a plain shared library that swarm loads with ctypes. Everything else about the
package lives in pyproject.toml.

The extension is optional: where no C compiler exists (or the platform is neither x86-64 nor aarch64),
``pip install`` still succeeds and a stage falls back to building the kernels at run time, or to the
slower ``rows`` mode, saying why (``swarm stage --check``).
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("swarm_kernel_build", HERE / "swarm" / "kernels" / "build.py")
kbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kbuild)


class BuildKernels(build_ext):
    """build_ext for a ctypes library: no Python module init, and the digest of the sources compiled in."""

    def get_export_symbols(self, ext):  # not a Python module: nothing named PyInit_ to export
        return []

    def build_extension(self, ext):
        ext.extra_compile_args = [*kbuild.FLAGS, kbuild.define_digest(HERE / "swarm" / "kernels")]
        super().build_extension(ext)


setup(
    ext_modules=[Extension(
        kbuild.EXTENSION,
        sources=[f"swarm/kernels/{name}" for name in kbuild.C_SOURCES],
        depends=[f"swarm/kernels/{name}" for name in kbuild.HEADERS],
        libraries=["m"],
        optional=True,
    )],
    cmdclass={"build_ext": BuildKernels},
)
