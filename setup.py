"""The optional C parts of the package (everything else is in pyproject.toml).

- ``gpuscope.timing._hotpath``: the timer's hot path, a Python extension.
- ``gpuscope.share._preload``: the preload library of ``gpuscope share``, a plain shared library that
  processes load with LD_PRELOAD (it is never imported; gpuscope/share/preload.py finds it by path).
- ``gpuscope.share._words``: the share controller's reads, writes and futex calls on the ledger, a
  Python extension.
- ``gpuscope.share._turns``: the share controller's hand-overs between slice holders, a Python
  extension.

All are ``optional=True``: where no C compiler is present the build goes on without them (the timer
then uses its Python hot path; ``gpuscope share`` says the library is missing; the ledger uses
ctypes; the controller hands over from Python). None links
anything from CUDA, so CPU-only machines build and test them too.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("gpuscope.timing._hotpath", ["src/gpuscope/timing/_hotpath.c"],
              extra_compile_args=["-O2"], optional=True),
    Extension("gpuscope.share._preload", ["src/gpuscope/share/_preload.c", "src/gpuscope/share/_memory.c"],
              depends=["src/gpuscope/share/_wake_bits.h", "src/gpuscope/share/_ledger.h",
                       "src/gpuscope/share/_preload.h"],
              extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall"],
              extra_link_args=["-ldl", "-lpthread"],
              optional=True),
    Extension("gpuscope.share._words", ["src/gpuscope/share/_words.c"],
              extra_compile_args=["-O2", "-Wall"], optional=True),
    Extension("gpuscope.share._turns", ["src/gpuscope/share/_turns.c"],
              depends=["src/gpuscope/share/_wake_bits.h"],
              extra_compile_args=["-O2", "-Wall"], optional=True),
])
