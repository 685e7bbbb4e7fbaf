"""Builds the optional native kernels: ``pof_connector.pages._pagesum`` (fused copy + page checksum)
and ``pof_connector._prefix_runs`` (decoding a locality-index lookup's reply).

Everything else is declared in pyproject.toml. Both extensions are ``optional``: where no C
compiler is available the install still succeeds and pof uses its numpy fallbacks (slower, same
results; ``pof_connector.pages.page_sum.NATIVE`` and ``pof_connector.index.record_runs.NATIVE`` say which
ones run).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pof_connector.pages._pagesum",
            ["pof_connector/pages/_pagesum.c"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
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
