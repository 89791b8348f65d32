"""The optional C extension of the timer's hot path (everything else is in pyproject.toml).

``optional=True``: where no C compiler or Python headers are present the build goes on without
it and the timer uses its Python hot path (gpuscope/timing/hot.py). The extension links nothing
from CUDA, so CPU-only machines build and test it too.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gpuscope.timing._hotpath", ["exporter/gpuscope/timing/_hotpath.c"],
                             extra_compile_args=["-O2"], optional=True)])
