"""The compiled parts, each optional (where one cannot be built the install still succeeds and its Python path runs):

- numjson.c, the batching API's reader of posted number lists (factory/serve/numjson.py): a plain shared library
  loaded with ctypes;
- group_arrays.c, a datagen group's token/mask/logprob arrays (factory/group_columns.py): a CPython extension.

Both are built at install time, nothing at run time. Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("factory.serve._numjson", ["factory/serve/numjson.c"], extra_compile_args=["-O2"], optional=True),
    Extension("factory._group_arrays", ["factory/group_arrays.c"], extra_compile_args=["-O2"], optional=True),
])
