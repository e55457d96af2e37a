"""The one compiled part: numjson.c, the batching API's reader of posted number lists (factory/serve/numjson.py).

A plain shared library loaded with ctypes, built at install time; optional: where it cannot be built, the
install still succeeds and run-api decodes bodies with msgspec alone. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("factory.serve._numjson", ["factory/serve/numjson.c"], extra_compile_args=["-O2"], optional=True)])
