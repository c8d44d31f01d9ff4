"""The engine file: one self-describing file holding a manifest and named binary sections.

Layout (little-endian)::

    b"LLMCENG\\0" | format version: u32 | manifest length: u64 | manifest SHA-256: 32 bytes
    | manifest (UTF-8 JSON) | sections

Each section starts at a 64-byte aligned offset (relative to the end of the manifest) recorded
in the manifest together with its length and SHA-256, and the header holds the manifest's own
SHA-256, so a truncated or corrupted file is caught on load rather than producing wrong tokens
(a flipped digit of an attention scale is still valid JSON of the right type). The manifest also
records what the engine is: the backend, the model geometry, the dtype, a hash of the source
graph and the build options.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import threading
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmc.errors import LlmcError
from llmc.formats.manifest import FORMAT_VERSION, Manifest, parse_manifest

MAGIC = b"LLMCENG\0"
HEADER = struct.Struct("<8sIQ32s")

# An engine's graphs reference their weights in its own "model.onnx.data" section, which
# onnxruntime maps from the engine file (measured on SmolLM2-135M's 30 segments: sessions built in
# 0.7 s instead of 1.7 s from inline weights, 0.4 GB less resident). The file's name is not known
# when the engine is written, so each reference holds a fixed-width placeholder location and a
# fixed-width offset into the section; `bind_weights` writes the name and absolute offsets over
# them, same widths, so no protobuf length changes and loading needs no onnx.
# The folder a graph serialized in memory (`onnx_io.serialize`) names its external data from.
EXTERNAL_ROOT = os.path.abspath(os.sep)
WEIGHTS_LOCATION = "llmc-engine-weights".ljust(258, "_")  # longer than any file name (255) + 2
OFFSET_DIGITS = 20
_LOCATION_ENTRY = b"\n\x08location\x12\x82\x02" + WEIGHTS_LOCATION.encode()  # StringStringEntryProto
_OFFSET_ENTRY = re.compile(rb"\n\x06offset\x12\x14(\d{20})")
_ALIGN = 64
_CHUNK = 1 << 26
_DIGEST_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRange:
    """External data that stays on disk: `path` from byte `offset` on, `length` bytes or to the
    end (a model's data file, an engine's data section, a tensor's bytes). onnxruntime reads it
    itself, holding the weights once."""

    path: Path
    offset: int = 0
    length: int | None = None


@dataclass(frozen=True)
class EngineFile:
    """An engine loaded from disk: its checked manifest and its sections as bytes-like views (and
    where in the file each starts, for readers that read a section from disk themselves)."""

    path: Path
    manifest: Manifest
    sections: dict[str, memoryview]
    offsets: dict[str, int] = field(default_factory=dict)  # sections' absolute file offsets


Payload = bytes | memoryview | os.PathLike | list[bytes | memoryview | FileRange]


def write_engine(path: str | os.PathLike, manifest: dict[str, Any], sections: dict[str, Payload]) -> None:
    """Write an engine file atomically (temporary file, then rename).

    Args:
        path: destination file.
        manifest: the fields of `Manifest` but `format_version` and `sections`, which are added;
            checked against the schema before anything is written.
        sections: named payloads, e.g. the ONNX model and the tokenizer: bytes-like, the path
            of a file to stream in, or a list of bytes-like and file ranges to stream in one
            after another (a model's weights, from wherever they are, never all in memory).
            Offsets and lengths are 64-bit: sections past 2 or 4 GiB are fine.
    """
    path = Path(path)
    table, offset = [], 0
    for name, data in sections.items():
        offset = _aligned(offset)
        length = _length(data)
        # Digests are filled in as the sections are written; a placeholder of the same width
        # keeps the manifest's size, so the sections' offsets hold.
        table.append({"name": name, "offset": offset, "length": length, "sha256": "0" * 64})
        offset += length
    manifest = {"format_version": FORMAT_VERSION, **manifest, "sections": table}
    parse_manifest(manifest, str(path))  # what this writes, read_engine must accept
    manifest_size = len(json.dumps(manifest, indent=1).encode())

    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, f".{path.name}.")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the engine from other users
        with os.fdopen(fd, "wb") as out:
            start = HEADER.size + manifest_size
            out.seek(start)
            for entry, data in zip(table, sections.values()):
                out.write(b"\0" * (start + entry["offset"] - out.tell()))
                entry["sha256"] = _write_hashing(out, data, entry["length"], entry["name"])
            manifest_bytes = json.dumps(manifest, indent=1).encode()
            assert len(manifest_bytes) == manifest_size
            out.seek(0)
            out.write(HEADER.pack(MAGIC, FORMAT_VERSION, manifest_size, hashlib.sha256(manifest_bytes).digest()))
            out.write(manifest_bytes)
        # No fsync: it cost 5 s of SmolLM2-135M's compile (137 MB/s to disk here), and a file
        # cut short by a crash after the rename fails its length or checksum checks on load.
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_hashing(out, data: Payload, length: int, name: str) -> str:
    """Write a section and return its sha256, each chunk hashed in a second thread while it is
    written (both release the GIL: SmolLM2-135M's 540 MB took 2.3 s hashed, then written)."""
    digest, written = hashlib.sha256(), 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmc-hash") as hasher:
        for chunk in _chunks(data):
            hashed = hasher.submit(digest.update, chunk)
            out.write(chunk)
            written += len(chunk)
            hashed.result()
    if written != length:
        raise LlmcError(f"section {name}: {written} bytes where {length} were measured (a file changed while written)")
    return digest.hexdigest()


def _length(data: Payload) -> int:
    return sum(_part_length(part) for part in _parts(data))


def _part_length(part: bytes | memoryview | FileRange) -> int:
    if not isinstance(part, FileRange):
        return memoryview(part).nbytes
    if part.length is not None:
        return part.length
    return os.stat(part.path).st_size - part.offset


def remove_stale_temporaries(folder: Path, prefix: str) -> None:
    """Delete files or folders named `prefix` + pid + "." … whose process is gone: a killed
    compile cannot clean up after itself, and its full-size temporaries would pile up."""
    for entry in folder.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split(".")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError:
            pass  # another process removed it first, or it is not ours to remove


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _parts(data: Payload) -> list[bytes | memoryview | FileRange]:
    if isinstance(data, (str, os.PathLike)):
        return [FileRange(Path(data))]
    return data if isinstance(data, list) else [data]


def _chunks(data: Payload):
    """The payload in pieces: files are read 64 MiB at a time (through the page cache)."""
    for part in _parts(data):
        if not isinstance(part, FileRange):
            yield part
            continue
        with open(part.path, "rb") as f:
            f.seek(part.offset)
            left = part.length if part.length is not None else os.fstat(f.fileno()).st_size - part.offset
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise LlmcError(f"{part.path}: ends before the {part.length} bytes at {part.offset}")
                left -= len(chunk)
                yield chunk


def bind_weights(graph: bytes | memoryview, data: FileRange) -> bytes:
    """A serialized graph whose weight references (written with `WEIGHTS_LOCATION`) name
    `data`'s file, at offsets shifted by `data.offset`; unchanged when it references none (every
    weight under `onnx_weights.EXTERNAL_MIN_BYTES` stays inline)."""
    graph = bytes(graph)
    references = graph.count(_LOCATION_ENTRY)
    if not references:
        return graph
    name = data.path.name.encode()
    spare = len(WEIGHTS_LOCATION) - len(name)
    if spare < 2:
        raise LlmcError(f"{data.path}: file name longer than {len(WEIGHTS_LOCATION) - 2} bytes")
    # "./" repeated (and one "//" when the spare width is odd) leaves the path unchanged.
    padded = (b"./" * (spare // 2) if spare % 2 == 0 else b".//" + b"./" * ((spare - 3) // 2)) + name
    graph = graph.replace(_LOCATION_ENTRY, _LOCATION_ENTRY[:-len(WEIGHTS_LOCATION)] + padded)
    graph, shifted = _OFFSET_ENTRY.subn(
        lambda m: m[0][:-OFFSET_DIGITS] + b"%020d" % (int(m[1]) + data.offset), graph)
    if shifted != references:
        raise LlmcError(f"{data.path}: corrupted engine file ({references} weight references, "
                        f"{shifted} offsets)")
    return graph


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """An engine's manifest as JSON (checked against the schema), without loading its sections:
    for tools and people; the runtime reads the typed `EngineFile.manifest`."""
    with open(_existing(path), "rb") as f:
        manifest, _ = _read_header(Path(path), f.read(HEADER.size), f)
    return manifest.to_dict()


def read_engine(path: str | os.PathLike, *, verify: bool = True) -> EngineFile:
    """Load an engine file, memory-mapped; checks every section's length and checksum.

    Args:
        path: the engine file.
        verify: compare each section's SHA-256 with the manifest (catches corruption); a caller
            that passes False should call `verify_sections` itself (see `verifying`).
    """
    path = _existing(path)
    with open(path, "rb") as f:
        manifest, data_start = _read_header(path, f.read(HEADER.size), f)
        size = os.fstat(f.fileno()).st_size
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
        sections, offsets = {}, {}
        for entry in manifest.sections:
            begin = data_start + entry.offset
            end = begin + entry.length
            if not 0 <= entry.offset or end > size:
                raise LlmcError(f"{path}: truncated engine file (section '{entry.name}' needs "
                                f"{end} bytes, file has {size})")
            sections[entry.name] = view[begin:end]
            offsets[entry.name] = begin
    engine = EngineFile(path, manifest, sections, offsets)
    if verify:
        verify_sections(engine)
    return engine


def verify_sections(engine: EngineFile) -> None:
    """Compare each section's SHA-256 with the manifest; raises LlmcError naming the first that
    differs."""
    with open(engine.path, "rb") as f:
        for entry in engine.manifest.sections:
            if _file_digest(f, engine.offsets[entry.name], entry.length) != entry.sha256:
                raise LlmcError(f"{engine.path}: corrupted engine file (checksum mismatch in section "
                                f"'{entry.name}')")


class SectionCheck:
    """An engine's section checksums, verified in a thread started here: the graphs and the
    tokenizer first, the weights section ("model.onnx.data") last.

    Start-up waits for the first part only (`graphs_checked`). The weights are hashed while the
    engine serves: on 2 cores their hashing slowed SmolLM2-135M's load from 1.1 to 1.6 s, and an
    8B model's 16 GB would take ~10 s. Until it finishes, tokens may come from corrupted weights;
    once it finds a mismatch, `raise_if_failed` raises it (the runtime fails every later step),
    and `wait` lets a one-shot caller (`llmc run`) report it before showing any output.
    """

    def __init__(self, engine: EngineFile):
        self._engine = engine
        self._error: BaseException | None = None
        self._at_weights = False  # past the graphs: an error now is the weights' (left to the steps)
        self._graphs = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmc-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if hasattr(os, "setpriority"):  # Linux: a thread's own id is a task's; yield the cores to start-up
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
        entries = sorted(self._engine.manifest.sections, key=lambda entry: entry.name == "model.onnx.data")
        try:
            with open(self._engine.path, "rb") as f:
                for entry in entries:
                    if entry.name == "model.onnx.data":
                        self._graphs.set()
                        self._at_weights = True
                    if _file_digest(f, self._engine.offsets[entry.name], entry.length) != entry.sha256:
                        raise LlmcError(f"{self._engine.path}: corrupted engine file (checksum mismatch in "
                                        f"section '{entry.name}')")
        except BaseException as error:  # raised in the callers' threads
            self._error = error
        finally:
            self._graphs.set()

    @contextlib.contextmanager
    def graphs_checked(self):
        """Build from the engine inside this block; on leaving, wait for every section but the
        weights and raise their error, which wins over the block's own (a corrupted graph may
        first fail as a confusing onnxruntime error). The weights' is left to `raise_if_failed`
        and `wait`, however early it is found, so that a build behaves the same on any machine."""
        try:
            yield
        finally:
            self._graphs.wait()
            if not self._at_weights:
                self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise the mismatch found so far, if any (does not wait)."""
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Wait until every section is verified; raise a mismatch."""
        self._thread.join()
        self.raise_if_failed()


def _file_digest(f, begin: int, length: int) -> str:
    """SHA-256 of a file range, read into one small buffer: hashing through the memory map would
    count a large engine's every page in this process's resident memory, and reading 64 MiB
    chunks showed as 64 MiB more of it whenever the thread was between two (the 25M Llama's
    resident memory after load varied from 155 to 255 MiB)."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(max(1, min(_DIGEST_CHUNK, length))))
    f.seek(begin)
    while length > 0:
        read = f.readinto(buffer[:min(len(buffer), length)])
        if not read:
            break
        digest.update(buffer[:read])
        length -= read
    return digest.hexdigest()


def file_sha256(*paths: str | os.PathLike) -> str:
    """SHA-256 of the files' bytes one after the other (an engine file; an ONNX file and its
    external data), read through one small buffer like the sections' check."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_DIGEST_CHUNK))
    for path in paths:
        with open(path, "rb") as f:
            while read := f.readinto(buffer):
                digest.update(buffer[:read])
    return digest.hexdigest()


def _read_header(path: Path, header: bytes, f) -> tuple[Manifest, int]:
    if len(header) < HEADER.size or not header.startswith(MAGIC):
        raise LlmcError(f"{path}: not an llmc engine file (bad magic bytes)")
    _, version, manifest_length, digest = HEADER.unpack(header)
    if version > FORMAT_VERSION:
        raise LlmcError(f"{path}: engine format version {version} is newer than this llmc "
                        f"supports ({FORMAT_VERSION}); rebuild it or upgrade llmc")
    if version < FORMAT_VERSION:
        raise LlmcError(f"{path}: engine format version {version} was written by an older llmc "
                        f"(this one reads {FORMAT_VERSION}); recompile it with `llmc compile`")
    raw = f.read(manifest_length)
    if len(raw) < manifest_length:
        raise LlmcError(f"{path}: truncated engine file (manifest incomplete)")
    if hashlib.sha256(raw).digest() != digest:
        raise LlmcError(f"{path}: corrupted engine file (checksum mismatch in the manifest)")
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise LlmcError(f"{path}: corrupted engine file (manifest is not valid JSON)") from None
    return parse_manifest(manifest, str(path)), HEADER.size + manifest_length


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    return path


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN
