"""Builds the optional native kernels: ``pof_connector._pagesum`` (fused copy + page checksum) and
``pof_connector._prefix_runs`` (decoding a locality-index lookup's reply).

Everything else is declared in pyproject.toml. Both extensions are ``optional``: where no C
compiler is available the install still succeeds and pof uses its numpy fallbacks (slower, same
results; ``pof_connector.page_sum.NATIVE`` and ``pof_connector.index.record_runs.NATIVE`` say which
ones run). ``_pagesum`` is built with OpenMP where the compiler has it (its many-page copy then
runs on the engine's OpenMP threads), and without it (one thread) where it does not.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError

OPENMP = ["-fopenmp"]


class BuildExt(build_ext):
    """Retries an extension without OpenMP when the compiler or linker refuses ``-fopenmp``."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError):
            if not set(OPENMP) & set(ext.extra_compile_args):
                raise
            self.announce(f"{ext.name}: building without OpenMP", level=3)
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a not in OPENMP]
            ext.extra_link_args = [a for a in ext.extra_link_args if a not in OPENMP]
            super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "pof_connector._pagesum",
            ["pof_connector/_pagesum.c"],
            extra_compile_args=["-O3", *OPENMP],
            extra_link_args=OPENMP,
            optional=True,
        ),
        Extension(
            "pof_connector._prefix_runs",
            ["pof_connector/_prefix_runs.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
