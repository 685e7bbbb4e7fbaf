"""Builds the optional native kernel ``pof_connector._pagesum`` (fused copy + page checksum).

Everything else is declared in pyproject.toml. The extension is ``optional``: where no C compiler
is available the install still succeeds and pof uses its numpy fallback (slower, same checksums;
``pof_connector.page_sum.NATIVE`` says which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pof_connector._pagesum",
            ["pof_connector/_pagesum.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
