"""The one compiled part: ``moeswarm.model._f16c``, F16 / BF16 matrix products from the stored bytes
(moeswarm/model/_f16c.c).  Everything else is in pyproject.toml.  ``optional``: where it does not compile (no C
compiler), the install still succeeds and the engine computes F16 weights through float32 copies, as before."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("moeswarm.model._f16c", ["moeswarm/model/_f16c.c"], extra_compile_args=["-O3"],
                             optional=True)])
