"""The optional native extension (engines/native/talker_frame.c: one talker frame per call on a CPU).

Everything else is declared in pyproject.toml. ``optional=True``: without a C compiler ``pip install``
still succeeds and the talker runs on ONNX Runtime as before (engines/native/__init__.py says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "engines.native._talker_frame", ["engines/native/talker_frame.c"],
    # no contraction of a * b + c into one FMA the source does not ask for: every instruction set
    # (AVX-512 VNNI, AVX2, scalar) then rounds the same way (the file's header)
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"],
    optional=True)])
