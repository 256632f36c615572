"""The compiled part of inferlb (everything else is in pyproject.toml): ``ext_proc._wire``, the
decoders of Envoy's request headers and access log (see ext_proc/wire.py). Optional: where it cannot
be compiled (no C compiler or Python headers) the package installs without it and protobuf decodes."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ext_proc._wire", ["ext_proc/_wire.c"], optional=True,
                             extra_compile_args=["-O2", "-std=c11"])])
