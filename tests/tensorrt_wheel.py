"""The real TensorRT 11.4 Python bindings, for API conformance tests on machines without TensorRT.

`wheel_folder()` downloads ``tensorrt-cu13-bindings==11.4.0.106`` (1.3 MB, no dependencies) once
into the test cache (``$LLMC_TEST_CACHE``, default ``~/.cache/llmc-tests``) and extracts it. Its
``tensorrt.so`` cannot be loaded here (no libnvinfer), but its strings are the 11.4 Python API:
pybind's class, method, property, enum-member and argument names and every docstring.

- `api_names()`: every identifier in those strings. A name llmc uses that is not among them does
  not exist in TensorRT 11.4.
- `StubTensorRT`: a ``tensorrt`` module standing in for the compiled core only. Any attribute it
  is asked for (on the module, a class, an instance) must be one of `api_names()`, or it raises
  AttributeError as the real module would; classes can be subclassed, instantiated and called.
  Its package path is the wheel's, so ``import tensorrt.plugin`` loads the wheel's real
  pure-Python plugin package, registration-time validation included.

Import as ``from tensorrt_wheel import ...`` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

from smollm2 import cache_dir

PACKAGE = "tensorrt-cu13-bindings==11.4.0.106"
VERSION = "11.4.0.106"
_FINAL_IDENTIFIER = re.compile(rb"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*$")


def wheel_folder() -> Path:
    """The extracted wheel's ``tensorrt_bindings`` folder; RuntimeError when it cannot be
    downloaded (the registry unreachable), for callers to skip with the reason."""
    folder = cache_dir() / "tensorrt-bindings-11.4"
    if (folder / "tensorrt_bindings" / "tensorrt.so").is_file():
        return folder / "tensorrt_bindings"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".trt-") as scratch:
        # Any Python's wheel holds the same API; this one is published for CPython 3.11.
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
                                 "--only-binary=:all:", "--python-version", "3.11",
                                 "--platform", "manylinux_2_28_x86_64", "-d", scratch],
                                capture_output=True, text=True)
        wheels = list(Path(scratch).glob("tensorrt_cu13_bindings-*.whl"))
        if result.returncode or not wheels:
            raise RuntimeError(f"cannot download {PACKAGE}: {result.stderr.strip().splitlines()[-1:]}")
        staged = Path(scratch) / "x"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(staged)
        if not folder.exists():  # another test process may have made it meanwhile
            os.replace(staged, folder)
    return folder / "tensorrt_bindings"


def api_names(folder: Path) -> frozenset[str]:
    """The names the wheel's tensorrt.so gives Python: the identifier each of its NUL-terminated
    strings ends with (pybind's class, method, property, enum-member and py::arg names; C++
    symbols left out), with its suffixes, since the linker stores a string that ends another one
    once: "register_creator" inside "deregister_creator", "IPluginV3" inside "nvinfer1::IPluginV3"."""
    names = set()
    for string in (folder / "tensorrt.so").read_bytes().split(b"\0"):
        match = _FINAL_IDENTIFIER.search(string)
        if match and not string.startswith(b"_Z"):
            text = match.group().decode()
            names.update(text[i:] for i in range(len(text)) if text[i].isalpha() or text[i] == "_")
    return frozenset(names)


class StubTensorRT(types.ModuleType):
    """A ``tensorrt`` module whose every name is checked against the 11.4 bindings (see the
    module docstring). `used` collects the qualified names that were asked for."""

    def __init__(self, folder: Path):
        super().__init__("tensorrt")
        self.__path__ = [str(folder)]  # tensorrt.plugin: the wheel's own package
        self.__version__ = VERSION
        self.names = api_names(folder)
        self.used: set[str] = set()
        self.registered: list[tuple] = []  # (creator, namespace) given to the plugin registry
        self.overrides: dict[str, object] = {}  # qualified name → what it returns instead of a stub
        self._classes: dict[str, type] = {}

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.member(name, name)

    def member(self, qualified: str, name: str) -> type:
        if name not in self.names:
            raise AttributeError(f"TensorRT 11.4 has no {qualified}")
        self.used.add(qualified)
        if qualified in self.overrides:
            return self.overrides[qualified]
        if qualified not in self._classes:
            self._classes[qualified] = _stub_class(self, qualified)
        return self._classes[qualified]

    def check_keywords(self, qualified: str, keywords: dict) -> None:
        unknown = [k for k in keywords if k not in self.names]
        if unknown:
            raise TypeError(f"TensorRT 11.4's {qualified} takes no keyword {unknown[0]}")


class _StubMeta(type):
    """One metaclass for every stub class, so that a class may derive from several of them."""

    def __getattr__(cls, name):
        if name == "__members__":  # a pybind enum's members: none that polygraphy need list
            return {}
        if name.startswith("__") or name.startswith("_stub"):
            raise AttributeError(name)
        return cls._stub_module.member(f"{cls._stub_name}.{name}", name)

    def __int__(cls):
        return 0

    __index__ = __int__

    def __lt__(cls, other):  # a value TensorRT would return (DLA core -1, sizes): compares as unset
        return False

    __le__ = __gt__ = __ge__ = __lt__


class _Stub(metaclass=_StubMeta):
    """An instance of a stub class: what a TensorRT call returned."""

    _stub_module: StubTensorRT
    _stub_name: str

    def __init__(self, *args, **kwargs):
        type(self)._stub_module.check_keywords(type(self)._stub_name, kwargs)
        if type(self)._stub_name == "get_plugin_registry().register_creator":
            type(self)._stub_module.registered.append(args)

    def __getattr__(self, name):
        if name.startswith("__") or name.startswith("_stub"):
            raise AttributeError(name)
        return type(self)._stub_module.member(f"{type(self)._stub_name}().{name}", name)

    def __call__(self, *args, **kwargs):
        type(self)._stub_module.check_keywords(type(self)._stub_name, kwargs)
        return self

    def __bytes__(self):
        return b""

    def __iter__(self):  # a network without layers
        return iter(())

    def __enter__(self):  # serialized buffers are context managers
        return self

    def __exit__(self, *exc):
        return False

    def __int__(self):
        return 0

    __index__ = __int__


def _stub_class(module: StubTensorRT, qualified: str) -> type:
    """A class standing for one TensorRT name: a class, an enum member, a method or a value."""
    return _StubMeta(qualified.rsplit(".", 1)[-1], (_Stub,), {"_stub_module": module, "_stub_name": qualified})
