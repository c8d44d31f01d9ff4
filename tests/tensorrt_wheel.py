"""The real TensorRT 11.4 Python bindings, for API conformance tests on machines without TensorRT.

`wheel_folder()` downloads ``tensorrt-cu13-bindings==11.4.0.106`` (1.3 MB, no dependencies) once
into the test cache (``$LLMC_TEST_CACHE``, default ``~/.cache/llmc-tests``) and extracts it. Its
``tensorrt.so`` cannot be loaded without libnvinfer, but it is the 11.4 Python API:

- `api_names()`: every identifier among its strings (pybind's class, method, property, enum-member
  and argument names and every docstring): a name that is not among them does not exist.
- `tensorrt_api()`: which class has which members, which enum which values, and the argument
  names pybind was given for a method, read from the bindings' own registration code
  (`objdump -d`, cached beside the wheel). pybind registers each member by calling
  ``class_<X>::def…`` or ``add_class_method`` with the member's name, in the order of the binding
  source: a class is opened by its ``type_record`` (or ``class_`` constructor) naming it, its
  members follow. For a method registered inline, its ``py::arg`` names are those loaded through
  another register than the name its sibling lookup is given, kept when they are as many as its
  signature's arguments (a method registered through a template instance has its arguments'
  names loaded among its neighbours': left unknown). Identical template instances are folded by the linker, so a member whose name is not in
  its instance is given to the class being bound at that point. The map holds a few argument
  names as members of the class they were registered in; it is not known to miss a member llmc,
  Polygraphy or the wheel's plugin package use (the tests use all three through it).
- `StubTensorRT`: a ``tensorrt`` module standing in for the compiled core. ``trt.X.Y`` and
  ``obj.Y`` must be a member of that very class (or its bases, as the map gives them), enum
  values must be values of their enum, keywords must be argument names the bindings give that
  method, and attributes set on TensorRT's objects must be theirs (pybind objects take no
  others). Its package path is the wheel's, so ``import tensorrt.plugin`` loads the wheel's real
  pure-Python plugin package, registration-time validation included.
- The stand-in's core (`_core`): the objects of the build and run paths behave as TensorRT
  documents them, each method checked against the map (tests/compiler/test_tensorrt_api.py):
  the ONNX parser reads the graph's inputs, outputs and nodes (and refuses a plugin node whose
  creator is not registered: "Plugin not found"); the builder refuses dynamic inputs without a
  profile, profiles whose min ≤ opt ≤ max fails, and equally named input dimensions whose ranges
  do not overlap (NVIDIA's sampleNamedDimensions: "checking that in the optimization profile these
  dimensions have overlapping intervals and that at runtime they have the same value"), logs its
  errors to the builder's logger, and serializes a JSON description of what it built; the engine
  reports that description's tensors and profile; an execution context refuses shapes outside
  the profile (``set_input_shape`` returns False), runs only with every input shape and address
  set and equally named dimensions equal, reads and writes tensors at their addresses in the
  engine's types, and computes outputs with the test's ``StubTensorRT.execute``. Its ``profiler``
  takes only an ``IProfiler`` (pybind's argument check), whose Python subclass must have called
  ``IProfiler.__init__``; each layer of the engine is reported to it with an equal share of the
  step's measured time, during ``execute_async_v3`` while ``enqueue_emits_profile`` is True (the
  default), else at ``report_to_profiler()``; a subclass without ``report_layer_time``, or one
  that raises, is reported on stderr and the run goes on, as the bindings' trampoline does.

Import as ``from tensorrt_wheel import ...`` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import ast
import collections
import ctypes
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shared_cache import cache_dir, locked

PACKAGE = "tensorrt-cu13-bindings==11.4.0.106"
VERSION = "11.4.0.106"
_FINAL_IDENTIFIER = re.compile(rb"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*$")


def wheel_folder() -> Path:
    """The extracted wheel's ``tensorrt_bindings`` folder; RuntimeError when it cannot be
    downloaded (the registry unreachable), for callers to skip with the reason."""
    folder = cache_dir() / "tensorrt-bindings-11.4"
    with locked(folder):
        if not (folder / "tensorrt_bindings" / "tensorrt.so").is_file():
            _download(folder)
    return folder / "tensorrt_bindings"


def _download(folder: Path) -> None:
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
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staged, folder)  # complete or absent, never half-written


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


# --- The API map, from the bindings' registration code --------------------------------------------

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_LEA = re.compile(r"\slea\s+(\w+),\[rip\+0x[0-9a-f]+\]\s+# ([0-9a-f]+)")
_CALL = re.compile(r"\scall\s+[0-9a-f]+ <([^>+]+)>$")
# class_<X> / enum_<X> of a namespaced X, or of a class local to a binding function ("IZ…E13DefaultLogger").
_OWNER = re.compile(r"_ZN8pybind11(6class_|5enum_)I(?:N(?:8nvinfer1|12nvonnxparser|8tensorrt)(?:5v_1_0)?|Z.*?E)(?=\d)")
_CONDUIT = "_pybind11_conduit_v1_"
_TYPE_RECORD = "_ZN8pybind116detail11type_recordC1Ev"
_ADD_METHOD = "_ZN8pybind116detail16add_class_methodERNS_6objectEPKcRKNS_12cpp_functionE"
_MODULE_DEF = "_ZN8pybind117module_3def"
_SET_ATTR = "accessor_policies8str_attrEEaS"
_EXPORT_VALUES = "enum_base13export_valuesEv"
_ENUM_VALUE = "_ZN8pybind116detail9enum_base5valueE"  # an enum value registered inline
_GETATTR = "_ZN8pybind117getattrE"  # a method's sibling lookup, by its name
_API_FORMAT = 7  # bump when the extraction changes: the cache is keyed by it


@dataclass
class Api:
    """TensorRT 11.4's Python classes and enums as the bindings register them."""

    classes: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    enums: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    bases: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))
    args: dict[tuple[str, str], list[list[str]]] = field(default_factory=lambda: collections.defaultdict(list))
    module: set[str] = field(default_factory=set)
    # Enums with more values registered than names found (a name the compiler kept in a register
    # from an earlier enum): their other values are checked against the bindings' strings only.
    incomplete: set[str] = field(default_factory=set)
    # How many times each method was registered (its overloads): `args` holds them all when as many.
    overloads: collections.Counter = field(default_factory=collections.Counter)

    def arguments(self, owner: str, name: str) -> list[list[str]] | None:
        """Every overload's argument names, or None when the map could not read them all."""
        lists = self.args.get((owner, name), [])
        return lists if lists and len(lists) == self.overloads[(owner, name)] else None

    def members(self, name: str) -> set[str]:
        """A class's members with its bases', or an enum's values."""
        found, seen, todo = set(self.enums.get(name, ())), set(), [name]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                found |= self.classes.get(current, set())
                todo += self.bases.get(current, ())
        return found

    def to_json(self) -> str:
        return json.dumps({"classes": {k: sorted(v) for k, v in self.classes.items()},
                           "enums": {k: sorted(v) for k, v in self.enums.items()},
                           "bases": {k: sorted(v) for k, v in self.bases.items()},
                           "args": [[c, m, lists] for (c, m), lists in self.args.items()],
                           "module": sorted(self.module), "incomplete": sorted(self.incomplete),
                           "overloads": [[c, m, n] for (c, m), n in self.overloads.items()]})

    @classmethod
    def from_json(cls, text: str) -> "Api":
        data = json.loads(text)
        api = cls()
        api.classes.update({k: set(v) for k, v in data["classes"].items()})
        api.enums.update({k: set(v) for k, v in data["enums"].items()})
        api.bases.update({k: set(v) for k, v in data["bases"].items()})
        api.args.update({(c, m): lists for c, m, lists in data["args"]})
        api.module = set(data["module"])
        api.incomplete = set(data["incomplete"])
        api.overloads.update({(c, m): n for c, m, n in data["overloads"]})
        return api


def tensorrt_api(folder: Path) -> Api:
    """The API map of the wheel in `folder` (see the module docstring); RuntimeError without
    objdump, for callers to skip with the reason."""
    cache = folder.parent / f"api-map-{_API_FORMAT}.json"
    with locked(cache):
        if cache.is_file():
            return Api.from_json(cache.read_text())
        if shutil.which("objdump") is None:
            raise RuntimeError("objdump (binutils) is not installed: the TensorRT API map reads the bindings' code")
        api = _extract(_disassemble(folder / "tensorrt.so"))
        _python_additions(api, (folder / "__init__.py").read_text())
        staged = cache.with_suffix(f".{os.getpid()}")
        staged.write_text(api.to_json())
        os.replace(staged, cache)
    return api


def _disassemble(so: Path) -> dict[str, list[tuple[str, str]]]:
    """Each function's string loads and calls, in order: ("s", string), ("a", a string loaded into
    rax, as py::arg names are) or ("c", called symbol)."""
    data = so.read_bytes()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        _, kind, _, address, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        if kind == 1 and address:  # PROGBITS, loaded
            sections.append((address, offset, size))

    def string_at(target: int) -> str | None:
        for address, offset, size in sections:
            if address <= target < address + size:
                start = target - address + offset
                return data[start:data.find(b"\0", start)].decode("latin1")
        return None

    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-M", "intel", str(so)], capture_output=True,
                          text=True, check=True).stdout
    functions: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = functions.setdefault(match.group(1), [])
        elif current is not None and (match := _LEA.search(line)):
            string = string_at(int(match.group(2), 16))
            if string is not None:
                current.append(("a" if match.group(1) == "rax" else "s", string))
        elif current is not None and (match := _CALL.search(line)):
            current.append(("c", match.group(1)))
    return functions


def _named(string: str) -> bool:
    """Whether a string is a name pybind gives Python (not one of pybind's own attributes)."""
    return bool(_IDENT.match(string)) and not string.startswith(("pybind11_", "_pybind11_"))


def _owner(symbol: str) -> tuple[str, list[str], str] | None:
    """("class" or "enum", the C++ nested names of X, the rest) of a class_<X>/enum_<X> symbol."""
    match = _OWNER.match(symbol)
    if not match:
        return None
    names, i = [], match.end()
    while i < len(symbol) and symbol[i].isdigit():
        digits = re.match(r"\d+", symbol[i:]).group()
        i += len(digits)
        names.append(symbol[i:i + int(digits)])
        i += int(digits)
    return ("class" if match.group(1) == "6class_" else "enum"), names, symbol[i + 1:]


def _action(rest: str) -> str | None:
    """What a class_<X>::… symbol does: "ctor", "def…", "value", or None."""
    match = re.search(r"E(\d+)(def\w*|value)|EEC2|EC2", rest)
    if not match:
        return None
    if "C2" in match.group(0):
        return "ctor"
    return rest[match.start(2):match.start(2) + int(match.group(1))]


def _arity(strings: list[str]) -> int | None:
    """Arguments (after self) of the last pybind signature among `strings`: "({%}, {str}) -> bool" → 1."""
    signature = next((x for x in reversed(strings) if x.startswith("(") and ") -> " in x), None)
    return None if signature is None else signature.split(") -> ")[0].count("{") - 1


def _declared(strings: list[str]) -> str | None:
    """The Python name a class or enum is created under: the last name before pybind's first
    conduit attribute (its docstring comes between)."""
    end = strings.index(_CONDUIT) if _CONDUIT in strings else len(strings)
    return next((x for x in reversed(strings[:end]) if _named(x)), None)


def _extract(functions: dict[str, list[tuple[str, str]]]) -> Api:
    api = Api()
    strings = {f: [x for kind, x in events if kind != "c"] for f, events in functions.items()}
    inside = {f: [x for x in found if _named(x)] for f, found in strings.items()}
    python = {}  # C++ class or enum name → Python name
    base_symbols = collections.defaultdict(set)
    registered = collections.Counter()  # enum → values registered
    for events in functions.values():
        scope, pending, arguments, expect_name, exported, enum = None, [], set(), False, None, None
        sibling = None  # the name a method's sibling lookup was given
        texts = []  # every string since the last boundary (signatures among them)
        for kind, x in events:
            if kind != "c":
                texts.append(x)
                if not _named(x):
                    continue
                if expect_name:
                    scope, expect_name = x, False
                    api.classes[scope]
                else:
                    pending.append(x)
                    if kind == "a":
                        arguments.add(x)
                continue
            if x == _TYPE_RECORD:
                expect_name, pending, arguments, texts = True, [], set(), []
            elif x.startswith(_GETATTR) and pending:
                # py::arg names are stored through rax; the method's name is loaded into another
                # register for this lookup (and again for its function record).
                sibling = ([n for n in pending if n not in arguments] or pending)[-1]
            elif x == _ADD_METHOD and pending and scope:
                member = sibling if sibling in pending else ([n for n in pending if n not in arguments] or pending)[-1]
                api.classes[scope].add(member)
                api.overloads[(scope, member)] += 1
                _add_args(api, scope, member, set(pending) - {member}, _arity(texts))
                pending, arguments, sibling, texts = [], set(), None, []
            elif x.startswith(_MODULE_DEF):
                api.module.update(inside.get(x, []))
                pending, arguments, texts = [], set(), []
            elif x.startswith(_ENUM_VALUE) and enum:
                registered[enum] += 1
                if pending:
                    api.enums[enum].add(pending[-1])
                pending, arguments, texts = [], set(), []
            elif x.endswith(_EXPORT_VALUES) and exported:
                (api.classes[exported[1]] if exported[1] else api.module).update(api.enums[exported[0]])
            elif _SET_ATTR in x and pending:
                api.module.add(pending[-1])
                if scope:
                    api.classes[scope].add(pending[-1])
                pending, arguments, texts = [], set(), []
            elif (owner := _owner(x)) is not None:
                what, names, rest = owner
                action = _action(rest)
                if what == "enum":
                    if action == "ctor":
                        name = _declared(strings.get(x, [])) or names[-1]
                        python.setdefault(names[-1], name)
                        api.enums[name]
                        enum = name
                        if len(names) > 1:  # nested in a class
                            api.classes[python.get(names[-2], names[-2])].add(name)
                        else:
                            api.module.add(name)
                    elif action == "value":
                        enum = python.get(names[-1], names[-1])
                        registered[enum] += 1
                        if pending:
                            api.enums[enum].add(pending[-1])
                        exported = (enum, python.get(names[-2], names[-2]) if len(names) > 1 else None)
                        pending, arguments, texts = [], set(), []
                    continue
                name = names[-1]
                if action == "ctor":
                    declared = _declared(strings.get(x, []))
                    if declared:
                        scope = declared
                        python.setdefault(name, declared)
                        api.classes[scope]
                    base_symbols[name].add(rest)
                elif action is not None and action.startswith("def"):
                    named = inside.get(x, [])
                    if named:  # the member's name is in the instance: the class is X
                        if name not in python:
                            python[name] = name if name in api.classes or not scope else scope
                        api.classes[python[name]].update(named)
                        if action == "def":
                            api.overloads[(python[name], named[0])] += 1
                        base_symbols[name].add(rest)
                    elif pending and scope:  # a folded instance: trust the class being bound, not X
                        api.classes[scope].add(pending[-1])
                    pending, arguments, texts = [], set(), []
    for name, rests in base_symbols.items():
        for rest in rests:
            pack = rest.split("EE", 1)[0]  # class_<X, Bases…, holder>: the template arguments after X
            for match in re.finditer(r"\d+", pack):
                token = pack[match.end():match.end() + int(match.group())]
                if token in python and token != name and not token.startswith("Py"):
                    api.bases[python.get(name, name)].add(python[token])
    api.module.update(api.classes)
    api.module.update(api.enums)
    api.incomplete = {name for name, count in registered.items() if count > len(api.enums[name])}
    return api


def _add_args(api: Api, owner: str, member: str, names: set[str], arity: int | None) -> None:
    """Record an overload's argument names when all were found (a name the compiler reused from
    a register is not loaded again: such an overload is left unknown)."""
    if arity is not None and len(names) == arity:
        api.args[(owner, member)].append(sorted(names))


def _python_additions(api: Api, init_source: str) -> None:
    """What the wheel's __init__.py adds in Python: its functions and ``Class.attr = …``."""
    for node in ast.parse(init_source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            api.module.add(node.name)
        elif isinstance(node, (ast.Assign, ast.If)):
            for target in (t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    api.classes[target.value.id].add(target.attr)  # DataType.itemsize: a property
    api.module.add("__version__")


# --- The stand-in -----------------------------------------------------------------------------------

# The module's DataType aliases (the bindings set them with m.attr; their values per the DataType
# docstrings: "float32 : 32-bit floating point format", …).
DATA_TYPE_ALIASES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "int32": "INT32",
                     "int64": "INT64", "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8", "int4": "INT4", "fp4": "FP4",
                     "e8m0": "E8M0"}
NUMPY_TYPES = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
               "BOOL": np.bool_, "UINT8": np.uint8}


class StubTensorRT(types.ModuleType):
    """A ``tensorrt`` module checked against the 11.4 bindings (see the module docstring).

    Attributes:
        api: the API map.
        names: every identifier of the bindings (`api_names`).
        used: the qualified names that were asked for.
        unmapped: names accepted only because the bindings' strings hold them (module names the
            map does not place, members of what an unfaked call returned).
        registered: (creator, namespace) given to the plugin registry.
        overrides: qualified name ("Name", "Class.member") → what it is instead.
        execute: the engine's computation for a context's step: (engine description, inputs
            by name) → outputs by name, NumPy arrays; None fails the step.
        refuse_layers: layer name → the reason the builder gives when it refuses it.
        fakes: the core's classes (`_core`) by the TensorRT class each stands for.
    """

    def __init__(self, folder: Path):
        super().__init__("tensorrt")
        self.__path__ = [str(folder)]  # tensorrt.plugin: the wheel's own package
        self.__version__ = VERSION
        self.api = tensorrt_api(folder)
        self.names = api_names(folder)
        self.used: set[str] = set()
        self.unmapped: set[str] = set()
        self.registered: list[tuple] = []
        self.overrides: dict[str, object] = {}
        self.execute: Callable[[dict, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
        self.refuse_layers: dict[str, str] = {}
        self._classes: dict[str, type] = {}
        self._values: dict[tuple[str, str], _EnumValue] = {}
        self.overrides.update(_core(self))
        # Constants the bindings read from C++: Dims64's capacity (NvInferRuntimeBase.h,
        # "static constexpr int32_t MAX_DIMS{8}").
        self.overrides["Dims.MAX_DIMS"] = 8

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self.overrides:
            self.used.add(name)
            return self.overrides[name]
        if name in DATA_TYPE_ALIASES:
            return self.value("DataType", DATA_TYPE_ALIASES[name])
        if name in self.api.classes or name in self.api.enums:
            self.used.add(name)
            return self.cls(name)
        if name in self.api.module or name in self.names:
            if name not in self.api.module:
                self.unmapped.add(name)
            self.used.add(name)
            return self.cls(name)
        raise AttributeError(f"TensorRT 11.4 has no {name}")

    def cls(self, name: str) -> type:
        """The stand-in class for the Python class or enum `name`."""
        if name not in self._classes:
            namespace = {"_stub_module": self, "_stub_name": name, "_stub_strict": True}
            if "__enter__" in self.api.members(name):  # the wheel's __init__.py gives these classes `with`
                namespace.update(__enter__=lambda this: this, __exit__=lambda this, *exc: None)
            self._classes[name] = _StubMeta(name, (_Stub,), namespace)
        return self._classes[name]

    def value(self, enum: str, member: str) -> "_EnumValue":
        """The one object standing for enum value `enum.member`."""
        if member not in self.api.enums.get(enum, ()) and (enum not in self.api.incomplete or member not in self.names):
            raise AttributeError(f"TensorRT 11.4's {enum} has no {member}")
        if (enum, member) not in self._values:
            self._values[(enum, member)] = _EnumValue(enum, member, len([e for e in self._values if e[0] == enum]))
        return self._values[(enum, member)]

    def member(self, owner: str, name: str, instance: Any = None):
        """`owner.name` (an instance's when `instance` is given), refused as TensorRT 11.4 would."""
        qualified = f"{owner}.{name}"
        if qualified in self.overrides:
            self.used.add(qualified)
            return self.overrides[qualified]
        mapped = owner in self.api.classes or owner in self.api.enums
        if name not in self.api.members(owner) and (mapped and owner not in self.api.incomplete or name not in self.names):
            raise AttributeError(f"TensorRT 11.4's {owner} has no {name}")
        if name not in self.api.members(owner):
            self.unmapped.add(qualified)
        self.used.add(qualified)
        if owner in self.api.enums and name not in self.api.classes.get(owner, ()):
            return self.value(owner, name)
        if name in self.api.enums:  # a nested enum, e.g. ILogger.Severity
            return self.cls(name)
        if name in self.api.enums.get("Severity", ()) and "Severity" in self.api.members(owner):
            return self.value("Severity", name)  # ILogger.ERROR: the Severity values, exported
        return _Member(self, owner, name, instance)

    def check_call(self, owner: str, name: str, keywords: dict) -> None:
        """Keywords a method call passes must be names the bindings gave its arguments (where the
        map holds every argument name of an overload)."""
        known = {n for names in self.api.arguments(owner, name) or [] for n in names}
        unknown = [k for k in keywords if known and k not in known]
        if unknown:
            raise TypeError(f"TensorRT 11.4's {owner}.{name} takes no keyword {unknown[0]} ({', '.join(sorted(known))})")

    def log(self, logger: Any, message: str, severity: str = "ERROR") -> None:
        """Log as TensorRT's core does: to the ILogger the object was made with."""
        logger.log(self.value("Severity", severity), message)


class _StubMeta(type):
    """One metaclass for every stand-in class, so that a class may derive from several of them."""

    def __getattr__(cls, name):
        module = cls._stub_module
        if name == "__members__" and cls._stub_name in module.api.enums:  # a pybind enum's values by name
            return {value: module.value(cls._stub_name, value) for value in sorted(module.api.enums[cls._stub_name])}
        if name.startswith("__"):
            raise AttributeError(name)
        return module.member(cls._stub_name, name)


class _PybindSubclassed(_StubMeta):
    """A bound class Python code derives from: pybind refuses an instance whose ``__init__`` did not
    call the bound class's (pybind11_meta_call: its holder was never constructed)."""

    def __call__(cls, *args, **kwargs):
        instance = super().__call__(*args, **kwargs)
        if "_stub_initialized" not in instance.__dict__:
            raise TypeError(f"tensorrt.{cls._stub_name}.__init__() must be called when overriding __init__")
        return instance


class _Stub(metaclass=_StubMeta):
    """An instance of a stand-in class: checked attributes, checked keywords."""

    _stub_module: StubTensorRT
    _stub_name: str

    def __init__(self, *args, **kwargs):
        type(self)._stub_module.check_call(type(self)._stub_name, "__init__", kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name.startswith("_stub"):
            raise AttributeError(name)
        return type(self)._stub_module.member(type(self)._stub_name, name, self)

    def __setattr__(self, name, value):
        # pybind objects take only their own attributes; Python subclasses (user code) take any.
        strict = type(self).__dict__.get("_stub_strict", False)
        if strict and not name.startswith("_") and name not in self._stub_module.api.members(type(self)._stub_name):
            raise AttributeError(f"TensorRT 11.4's {type(self)._stub_name} has no attribute {name} to set")
        object.__setattr__(self, name, value)


@dataclass(frozen=True, eq=False)
class _EnumValue:
    """One value of a TensorRT enum: hashable, compared by identity, an int."""

    enum: str
    name: str
    number: int

    def __int__(self):
        return self.number

    __index__ = __int__

    def __repr__(self):
        return f"{self.enum}.{self.name}"


class _Member(int):
    """A member the stand-in has no behaviour for: callable (keywords checked), and a value that
    answers as an unset one (0, empty, False). What it returns is untyped: names asked of it are
    checked against the bindings' strings only and recorded in `unmapped`."""

    def __new__(cls, module: StubTensorRT, owner: str | None, name: str, instance: Any = None):
        member = int.__new__(cls, 0)
        member._module, member._owner, member._name, member._instance = module, owner, name, instance
        return member

    def __call__(self, *args, **kwargs):
        if self._owner is not None:
            self._module.check_call(self._owner, self._name, kwargs)
        return _Member(self._module, None, f"{self._owner}.{self._name}()")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._module.names:
            raise AttributeError(f"TensorRT 11.4 has no {name} (asked of {self._owner}.{self._name})")
        self._module.unmapped.add(f"{self._owner}.{self._name}.{name}")
        return _Member(self._module, None, f"{self._owner}.{self._name}.{name}")

    def __iter__(self):
        return iter(())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- The core: the build and run paths ------------------------------------------------------------

ENGINE_FORMAT = "llmc-stub-engine-1"
_ONNX_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 2: "UINT8",
               17: "FP8", 22: "INT4", 23: "FP4"}


def _core(trt: StubTensorRT) -> dict[str, object]:
    """The stand-in's build and run objects (`StubTensorRT.fakes`); returns the module-level names
    that make them."""

    class Registry(trt.cls("IPluginRegistry")):
        def register_creator(self, creator, plugin_namespace):
            trt.registered.append((creator, plugin_namespace))
            return True

        def get_creator(self, type, version, plugin_namespace):
            return next((c for c, ns in trt.registered if ns == plugin_namespace and getattr(c, "name", None) == type),
                        None)

    registry = Registry()

    class Tensor(trt.cls("ITensor")):
        def __init__(self, name, dtype, shape, dims):
            self._dims = dims
            self.name, self.dtype, self.shape, self.is_shape_tensor = name, dtype, shape, False

        def get_dimension_name(self, index):
            return self._dims[index]

    class Layer(trt.cls("ILayer")):
        def __init__(self, name, op_type):
            self._op_type = op_type
            self.name = name

    class Network(trt.cls("INetworkDefinition")):
        def __init__(self, flags):
            self._flags, self._inputs, self._outputs, self._layers = flags, [], [], []

        num_inputs = property(lambda self: len(self._inputs))
        num_outputs = property(lambda self: len(self._outputs))
        num_layers = property(lambda self: len(self._layers))

        def get_input(self, index):
            return self._inputs[index]

        def get_output(self, index):
            return self._outputs[index]

        def get_layer(self, index):
            return self._layers[index]

        def __len__(self):
            return len(self._layers)

        def __getitem__(self, index):
            return self._layers[index]

    class ParserError(trt.cls("ParserError")):
        def __init__(self, node_name, desc):
            self.node_name, self.desc = node_name, desc

        def __str__(self):
            return f"In node {self.node_name}: {self.desc}"

    class Parser(trt.cls("OnnxParser")):
        def __init__(self, network, logger):
            self._network, self._logger, self._errors = network, logger, []

        num_errors = property(lambda self: len(self._errors))

        def get_error(self, index):
            return self._errors[index]

        def parse_from_file(self, model):
            import onnx

            graph = onnx.load(model, load_external_data=False).graph
            for node in graph.node:
                namespace = next((a.s.decode() for a in node.attribute if a.name == "plugin_namespace"), None)
                if namespace is not None and registry.get_creator(node.op_type, "1", namespace) is None:
                    # onnx-tensorrt's fallback to a plugin: the creator must be registered by then.
                    self._errors.append(ParserError(node.name, f"Plugin not found: {namespace}::{node.op_type}"))
                # onnx-tensorrt's getNodeName: an unnamed node's layer is named for its first output.
                name = node.name or f"node_of_{node.output[0]}"
                self._network._layers.append(Layer(name, node.op_type))
            if self._errors:
                return False
            for values, into in ((graph.input, self._network._inputs), (graph.output, self._network._outputs)):
                for value in values:
                    dims = value.type.tensor_type.shape.dim
                    into.append(Tensor(value.name, trt.value("DataType", _ONNX_TYPES[value.type.tensor_type.elem_type]),
                                       tuple(d.dim_value if d.HasField("dim_value") else -1 for d in dims),
                                       [d.dim_param or None for d in dims]))
            return True

    class Profile(trt.cls("IOptimizationProfile")):
        def __init__(self):
            self._shapes = {}

        def set_shape(self, input, min, opt, max):
            self._shapes[input] = [tuple(min), tuple(opt), tuple(max)]

        def get_shape(self, input):
            return self._shapes.get(input, [])

        def __bool__(self):
            return True

    class HostMemory(bytes, trt.cls("IHostMemory")):
        """Serialized bytes (Polygraphy writes them to files as they are)."""

        def __new__(cls, data: bytes):
            return bytes.__new__(cls, data)

        def __init__(self, data: bytes):
            pass

        nbytes = property(len)

    class TimingCache(trt.cls("ITimingCache")):
        def __init__(self, data=b""):
            self._data = bytes(data)

        def serialize(self):
            return HostMemory(self._data or b"timing cache")

        def combine(self, input_cache, ignore_mismatch):
            return True

    class Config(trt.cls("IBuilderConfig")):
        def __init__(self):
            self._profiles, self._flags, self._pools, self._cache = [], set(), {}, None

        num_optimization_profiles = property(lambda self: len(self._profiles))

        def add_optimization_profile(self, profile):
            self._profiles.append(profile)
            return len(self._profiles) - 1

        def set_flag(self, flag):
            self._flags.add(flag)

        def clear_flag(self, flag):
            self._flags.discard(flag)

        def get_flag(self, flag):
            return flag in self._flags

        def set_memory_pool_limit(self, pool, pool_size):
            self._pools[pool] = pool_size

        def get_memory_pool_limit(self, pool):
            return self._pools.get(pool, 0)

        def create_timing_cache(self, serialized_timing_cache):
            return TimingCache(serialized_timing_cache)

        def set_timing_cache(self, cache, ignore_mismatch):
            self._cache = cache
            return True

        def get_timing_cache(self):
            return self._cache

    class Builder(trt.cls("Builder")):
        def __init__(self, logger):
            self._logger = logger

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def get_plugin_registry(self):
            return registry

        def build_serialized_network(self, network, config):
            problem = _build_problem(network, config, trt.refuse_layers)
            if problem:
                trt.log(self._logger, problem)
                return None
            flags = [name for name in sorted(trt.api.enums["NetworkDefinitionCreationFlag"])
                     if network._flags & (1 << int(trt.value("NetworkDefinitionCreationFlag", name)))]
            description = {
                "format": ENGINE_FORMAT, "creation_flags": flags,
                "builder_flags": sorted(f.name for f in config._flags),
                "hardware_compatibility_level": _text(config.__dict__.get("hardware_compatibility_level")),
                "profile": {name: [list(s) for s in shapes] for name, shapes in config._profiles[0]._shapes.items()}
                if config._profiles else {},
                "inputs": [_described(t) for t in network._inputs], "outputs": [_described(t) for t in network._outputs],
                "layers": [[layer.name, layer._op_type] for layer in network._layers]}
            return HostMemory(json.dumps(description).encode())

    class Profiler(trt.cls("IProfiler"), metaclass=_PybindSubclassed):
        def __init__(self):
            super().__init__()
            self._stub_initialized = True

        def report_layer_time(self, layer_name, ms):
            # The bindings' trampoline finds no Python override; their catch prints what it raised.
            print('[ERROR] Exception caught in report_layer_time(): Tried to call pure virtual function '
                  '"IProfiler::report_layer_time"', file=sys.stderr)

    class Context(trt.cls("IExecutionContext")):
        def __init__(self, engine):
            self._engine, self._shapes, self._addresses = engine, {}, {}
            self._profiler, self._emits, self._unreported = None, True, None

        @property
        def profiler(self):
            return self._profiler

        @profiler.setter
        def profiler(self, profiler):
            if profiler is not None and not isinstance(profiler, Profiler):
                raise TypeError(f"(): incompatible function arguments. The following argument types are supported: "
                                f"(self: tensorrt.IExecutionContext, arg0: tensorrt.IProfiler) -> None; invoked "
                                f"with {type(profiler).__name__}")
            self._profiler = profiler

        @property
        def enqueue_emits_profile(self):
            return self._emits

        @enqueue_emits_profile.setter
        def enqueue_emits_profile(self, emits):
            if not isinstance(emits, bool):
                raise TypeError(f"(): incompatible function arguments: enqueue_emits_profile takes a bool, not "
                                f"{type(emits).__name__}")
            self._emits = emits

        def report_to_profiler(self):
            """The layer times of the last launch, to the profiler; False without one (or no launch)."""
            if self._profiler is None or self._unreported is None:
                return False
            self._report(self._unreported)
            return True

        def _report(self, times):
            for name, ms in times:
                try:
                    self._profiler.report_layer_time(name, ms)
                except Exception as error:  # the bindings catch every exception here
                    print(f"[ERROR] Exception caught in report_layer_time(): {type(error).__name__}: {error}",
                          file=sys.stderr)

        def set_input_shape(self, name, shape):
            shape = tuple(int(d) for d in shape)
            tensor = self._engine._tensors.get(name)
            low, _, high = self._engine._profile.get(name, [None] * 3) if tensor else [None] * 3
            if tensor is None or tensor["mode"] != "INPUT":
                problem = f"{name} is not an input tensor"
            elif len(shape) != len(tensor["shape"]):
                problem = f"{name} has rank {len(tensor['shape'])}, given {list(shape)}"
            elif low is None and any(d not in (-1, size) for d, size in zip(tensor["shape"], shape)):
                problem = f"{name} is static {tensor['shape']}, given {list(shape)}"
            elif low is not None and not all(lo <= d <= hi for lo, d, hi in zip(low, shape, high)):
                problem = f"{name}: {list(shape)} is outside the profile's [{list(low)}, {list(high)}]"
            else:
                self._shapes[name] = shape
                return True
            trt.log(self._engine._logger, f"IExecutionContext::setInputShape: Error Code 3: API Usage Error ({problem})")
            return False

        def set_tensor_address(self, name, memory):
            if name not in self._engine._tensors:
                trt.log(self._engine._logger, f"IExecutionContext::setTensorAddress: Error Code 3: API Usage Error "
                                              f"(no tensor {name})")
                return False
            self._addresses[name] = int(memory)
            return True

        def get_tensor_shape(self, name):
            tensor = self._engine._tensors[name]
            if tensor["mode"] == "INPUT":
                return self._shapes.get(name, tuple(tensor["shape"]))
            sizes = self._named_sizes()
            return tuple(d if d != -1 else sizes.get(n, -1)[0] if n in sizes else -1
                         for d, n in zip(tensor["shape"], tensor["dims"]))

        def execute_async_v3(self, stream_handle):
            problem = self._problem()
            if problem:
                trt.log(self._engine._logger, f"IExecutionContext::enqueueV3: Error Code 7: Internal Error ({problem})")
                return False
            tensors = self._engine._tensors
            start = time.perf_counter()
            inputs = {n: self._array(n, self._shapes[n]) for n, t in tensors.items() if t["mode"] == "INPUT"}
            outputs = trt.execute(self._engine._description, inputs)
            for name, value in outputs.items():
                shape = self.get_tensor_shape(name)  # by dimension names; else what was computed
                self._array(name, np.shape(value) if -1 in shape else shape)[...] = value
            if self._profiler is not None:
                layers = self._engine._description["layers"]
                share = (time.perf_counter() - start) * 1e3 / max(len(layers), 1)
                self._unreported = [(name, share) for name, _ in layers]
                if self._emits:  # enqueue is synchronous then, and reports before it returns
                    self._report(self._unreported)
            return True

        def _named_sizes(self):
            sizes = collections.defaultdict(list)
            for name, shape in self._shapes.items():
                for size, dim in zip(shape, self._engine._tensors[name]["dims"]):
                    if dim:
                        sizes[dim].append(size)
            return sizes

        def _problem(self):
            tensors = self._engine._tensors
            missing = [n for n, t in tensors.items() if t["mode"] == "INPUT" and n not in self._shapes]
            unbound = [n for n in tensors if n not in self._addresses or not self._addresses[n]]
            unequal = {dim: sizes for dim, sizes in self._named_sizes().items() if len(set(sizes)) > 1}
            if missing:
                return f"input shapes not specified: {', '.join(missing)}"
            if unbound:
                return f"no address set for {', '.join(unbound)}"
            if unequal:
                dim, sizes = next(iter(unequal.items()))
                return f"input dimensions named '{dim}' must be equal, got {sorted(set(sizes))}"
            if trt.execute is None:
                return "the stand-in has no computation for this engine"
            return None

        def _array(self, name, shape):
            dtype = NUMPY_TYPES[self._engine._tensors[name]["dtype"]]
            count = int(np.prod(shape))
            buffer = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(self._addresses[name])
            return np.frombuffer(buffer, dtype).reshape(shape)

    class Engine(trt.cls("ICudaEngine")):
        def __init__(self, description, logger):
            self._description, self._logger = description, logger
            self._tensors = {t["name"]: {**t, "mode": "INPUT"} for t in description["inputs"]}
            self._tensors.update({t["name"]: {**t, "mode": "OUTPUT"} for t in description["outputs"]})
            self._profile = {name: [tuple(s) for s in shapes] for name, shapes in description["profile"].items()}

        num_io_tensors = property(lambda self: len(self._tensors))

        def get_tensor_name(self, index):
            return list(self._tensors)[index]

        def get_tensor_mode(self, name):
            return trt.value("TensorIOMode", self._tensors[name]["mode"])

        def get_tensor_dtype(self, name):
            return trt.value("DataType", self._tensors[name]["dtype"])

        def get_tensor_shape(self, name):
            return tuple(self._tensors[name]["shape"])

        def get_tensor_profile_shape(self, name, profile_index):
            return list(self._profile[name]) if profile_index == 0 and name in self._profile else []

        def create_execution_context(self):
            return Context(self)

    class Runtime(trt.cls("Runtime")):
        def __init__(self, logger):
            self._logger = logger

        def deserialize_cuda_engine(self, serialized_engine):
            try:
                description = json.loads(bytes(serialized_engine))
            except ValueError:
                description = None
            if not isinstance(description, dict) or description.get("format") != ENGINE_FORMAT:
                trt.log(self._logger, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (the plan is not "
                                      "an engine of this TensorRT)")
                return None
            return Engine(description, self._logger)

    made = (Registry, Tensor, Layer, Network, ParserError, Profile, HostMemory, TimingCache, Config, Profiler, Context,
            Engine, Builder, Parser, Runtime)
    for cls in made:
        cls._stub_strict = True  # attributes set on them are checked, as on pybind objects
    trt.fakes = {cls._stub_name: cls for cls in made}
    return {"Builder": Builder, "OnnxParser": Parser, "Runtime": Runtime, "IProfiler": Profiler,
            "get_plugin_registry": lambda: registry}


def _text(value: Any) -> str | None:
    return None if value is None else repr(value)


def _described(tensor) -> dict:
    return {"name": tensor.name, "dtype": tensor.dtype.name, "shape": list(tensor.shape), "dims": tensor._dims}


def _build_problem(network, config, refused: dict[str, str]) -> str | None:
    """The error TensorRT's builder would log for this network and config, or None."""
    for layer in network._layers:
        if layer.name in refused:
            return (f"IBuilder::buildSerializedNetwork: Error Code 10: Internal Error (Could not find any implementation "
                    f"for node {layer.name}: {refused[layer.name]}.)")
    dynamic = [t for t in network._inputs if -1 in t.shape]
    if dynamic and not config._profiles:
        return ("IBuilder::buildSerializedNetwork: Error Code 4: API Usage Error (Network has dynamic or shape inputs, "
                "but no optimization profile has been defined.)")
    ranges = collections.defaultdict(list)
    for tensor in network._inputs:
        shapes = config._profiles[0]._shapes.get(tensor.name) if config._profiles else None
        if shapes is None:
            if -1 in tensor.shape:
                return f"Error Code 4: API Usage Error ({tensor.name}: dynamic input is missing dimensions in profile 0.)"
            continue
        low, opt, high = shapes
        for axis, size in enumerate(tensor.shape):
            sizes = (low[axis], opt[axis], high[axis]) if len(low) == len(opt) == len(high) == len(tensor.shape) else None
            if sizes is None or not sizes[0] <= sizes[1] <= sizes[2] or size != -1 and set(sizes) != {size}:
                return (f"Error Code 4: API Usage Error ({tensor.name}: profile {list(low)}, {list(opt)}, {list(high)} "
                        f"does not hold the input's shape {list(tensor.shape)} with min <= opt <= max.)")
            if tensor._dims[axis]:
                ranges[tensor._dims[axis]].append((tensor.name, sizes[0], sizes[2]))
    for dim, spans in ranges.items():
        if max(lo for _, lo, _ in spans) > min(hi for _, _, hi in spans):
            names = ", ".join(f"{name} [{lo}, {hi}]" for name, lo, hi in spans)
            return (f"Error Code 4: API Usage Error (input dimensions named '{dim}' have profile ranges that do not "
                    f"overlap: {names}.)")
    return None
