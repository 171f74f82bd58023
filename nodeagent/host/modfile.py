"""Read what the agent needs from a kernel module file, offline.

A hand-written ELF reader (``struct`` only) for ``.ko``, ``.ko.xz``, ``.ko.zst``
and ``.ko.gz`` files: the ``.modinfo`` keys (name, srcversion, vermagic,
depends), the GNU build-id note, the symbol CRCs the module needs
(``__versions``) and the CRCs it exports (``__crc_<sym>`` symbols, both the
``__kcrctab`` layout of Linux >= 5.19 and the older absolute-symbol layout).

``parse_module_bytes`` is a pure function of its input, so callers may cache
its result keyed by (path, mtime, size). Any malformed input raises
``ModuleFileError`` with one line naming the file; never ``IndexError`` or
``struct.error``.

Only ELF64 little-endian (x86_64, aarch64, ...) is supported; ELF32 and
big-endian objects raise ``ModuleFileError``.
"""

from __future__ import annotations

import gzip
import io
import lzma
import os
import stat
import struct
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import IO, Protocol, cast

from nodeagent.core.names import normalize_module_name
from nodeagent.errors import NodeagentError

__all__ = [
    "MAX_MODULE_SIZE",
    "ModuleFile",
    "ModuleFileError",
    "decompress_module",
    "module_image_fd",
    "module_name_from_path",
    "parse_build_id_note",
    "parse_module_bytes",
    "read_module_fd",
    "read_module_file",
]

# Upper bound on a module's (decompressed) size: nvidia.ko is ~100 MiB with
# debug info; anything beyond that is garbage or a decompression bomb.
MAX_MODULE_SIZE = 256 << 20

_ELF_MAGIC = b"\x7fELF"
_XZ_MAGIC = b"\xfd7zXZ\x00"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_GZIP_MAGIC = b"\x1f\x8b"
_COMPRESSED_SUFFIXES = (".xz", ".zst", ".gz")

_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_ET_REL = 1

_SHT_SYMTAB = 2
_SHT_NOTE = 7
_SHT_NOBITS = 8
_SHT_SYMTAB_SHNDX = 18

_SHN_UNDEF = 0
_SHN_LORESERVE = 0xFF00
_SHN_ABS = 0xFFF1
_SHN_XINDEX = 0xFFFF

_NT_GNU_BUILD_ID = 3

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr, 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr, 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym, 24 bytes
_NHDR = struct.Struct("<III")  # Elf64_Nhdr (namesz, descsz, type)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# struct modversion_info on 64-bit: unsigned long crc; char name[64 - 8].
_MODVERSION_SIZE = 64
_CRC_MASK = 0xFFFFFFFF


class ModuleFileError(NodeagentError):
    """A module file that cannot be read or parsed (one line, names the file)."""


@dataclass(frozen=True)
class ModuleFile:
    """What one kernel module file says about itself."""

    path: str
    name: str
    srcversion: str | None
    vermagic: str | None
    depends: tuple[str, ...]
    build_id: str | None
    required_crcs: Mapping[str, int] = field(hash=False)
    exported_crcs: Mapping[str, int] = field(hash=False)


@dataclass(frozen=True)
class _Section:
    index: int
    name: str
    type: int
    offset: int
    size: int
    link: int
    entsize: int

    @property
    def has_data(self) -> bool:
        return self.type != _SHT_NOBITS


def _one_line(text: str) -> str:
    return " ".join(text.split())


def module_name_from_path(path: str | os.PathLike[str]) -> str:
    """``/x/nvidia-peermem.ko.xz`` -> ``nvidia_peermem`` (as modprobe spells it)."""
    base = os.path.basename(os.fspath(path))
    for suffix in _COMPRESSED_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    if base.endswith(".ko"):
        base = base[:-3]
    return normalize_module_name(base)


class _Elf:
    """Bounds-checked view of an ELF64 LE image; every failure is ModuleFileError."""

    def __init__(self, data: bytes | bytearray, path: str) -> None:
        self.data = data
        self.path = path
        self.sections: list[_Section] = []
        self.by_name: dict[str, _Section] = {}
        self._parse_header()

    def fail(self, what: str) -> ModuleFileError:
        return ModuleFileError(_one_line(f"{self.path}: {what}"))

    def _unpack(self, st: struct.Struct, off: int, what: str) -> tuple[int, ...]:
        if off < 0 or off + st.size > len(self.data):
            raise self.fail(f"truncated ELF file: {what} at offset {off} is past the end")
        return st.unpack_from(self.data, off)

    def _parse_header(self) -> None:
        data = self.data
        if len(data) < 4 or data[:4] != _ELF_MAGIC:
            raise self.fail("not an ELF file (bad magic)")
        if len(data) < _EHDR.size:
            raise self.fail(f"truncated ELF header ({len(data)} bytes)")
        (ident, e_type, _mach, _ver, _entry, _phoff, e_shoff, _flags, _ehsize, _phentsize,
         _phnum, e_shentsize, e_shnum, e_shstrndx) = _EHDR.unpack_from(data, 0)  # fmt: skip
        if ident[4] != _ELFCLASS64:
            raise self.fail(f"unsupported ELF class {ident[4]} (only ELF64 is supported)")
        if ident[5] != _ELFDATA2LSB:
            raise self.fail(f"unsupported ELF data encoding {ident[5]} (only little-endian)")
        if e_type != _ET_REL:
            raise self.fail(f"ELF type {e_type} is not a relocatable object (kernel module)")
        if e_shoff == 0:
            raise self.fail("ELF file has no section header table")
        if e_shentsize != _SHDR.size:
            raise self.fail(f"unexpected ELF section header size {e_shentsize}")
        first = self._unpack(_SHDR, e_shoff, "section header 0")
        shnum = e_shnum if e_shnum != 0 else first[5]  # extended numbering: sh_size
        shstrndx = e_shstrndx if e_shstrndx != _SHN_XINDEX else first[6]  # sh_link
        if shnum <= 0 or e_shoff + shnum * _SHDR.size > len(data):
            raise self.fail(
                f"truncated ELF file: {shnum} section headers at offset {e_shoff} "
                f"do not fit in {len(data)} bytes"
            )
        raw: list[tuple[int, ...]] = [
            _SHDR.unpack_from(data, e_shoff + i * _SHDR.size) for i in range(shnum)
        ]
        if not 0 < shstrndx < shnum:
            raise self.fail(f"bad section name string table index {shstrndx}")
        shstr = raw[shstrndx]
        shstr_sec = _Section(shstrndx, "", shstr[1], shstr[4], shstr[5], 0, 0)
        shstrtab = self.section_data(shstr_sec, ".shstrtab")
        for i, shdr in enumerate(raw):
            sh_name, sh_type, _f, _a, sh_offset, sh_size, sh_link, _i, _al, sh_entsize = shdr
            name = _cstring(shstrtab, sh_name) if i else ""
            if name is None:
                raise self.fail(f"section {i} has a bad name offset {sh_name}")
            sec = _Section(i, name, sh_type, sh_offset, sh_size, sh_link, sh_entsize)
            self.sections.append(sec)
            self.by_name.setdefault(name, sec)
        for sec in self.sections:
            if sec.index and sec.has_data:
                self.section_data(sec)  # validates every section's bounds once

    def section_data(self, sec: _Section, label: str | None = None) -> bytes:
        if not sec.has_data:
            return b""
        if sec.offset + sec.size > len(self.data):
            raise self.fail(
                f"truncated ELF file: section {label or sec.name or sec.index} "
                f"(offset {sec.offset}, size {sec.size}) is past the end ({len(self.data)} bytes)"
            )
        return bytes(self.data[sec.offset : sec.offset + sec.size])

    def section(self, index: int, what: str) -> _Section:
        if not 0 <= index < len(self.sections):
            raise self.fail(f"{what} refers to section {index}, which does not exist")
        return self.sections[index]


def _cstring(buf: bytes, off: int) -> str | None:
    if off < 0 or off >= len(buf):
        return None
    end = buf.find(b"\0", off)
    if end < 0:
        return None
    return buf[off:end].decode("utf-8", errors="replace")


def _parse_modinfo(elf: _Elf) -> dict[str, str]:
    info: dict[str, str] = {}
    sec = elf.by_name.get(".modinfo")
    if sec is None:
        return info
    for item in elf.section_data(sec).split(b"\0"):
        if not item:
            continue
        key, sep, value = item.decode("utf-8", errors="replace").partition("=")
        if sep:
            info.setdefault(key, value)  # first wins, like modinfo -F
    return info


def _iter_notes(raw: bytes, what: str) -> list[tuple[bytes, int, bytes]]:
    """Split an SHT_NOTE blob into (name, type, desc); ModuleFileError if malformed."""
    notes: list[tuple[bytes, int, bytes]] = []
    off = 0
    while off < len(raw):
        if len(raw) - off < _NHDR.size:
            if not raw[off:].strip(b"\0"):
                break  # trailing alignment padding
            raise ModuleFileError(_one_line(f"{what}: truncated ELF note header at offset {off}"))
        namesz, descsz, ntype = _NHDR.unpack_from(raw, off)
        name_off = off + _NHDR.size
        desc_off = name_off + ((namesz + 3) & ~3)
        end = desc_off + ((descsz + 3) & ~3)
        if desc_off + descsz > len(raw):
            raise ModuleFileError(
                _one_line(
                    f"{what}: truncated ELF note (namesz {namesz}, descsz {descsz}) "
                    f"in {len(raw)} bytes"
                )
            )
        notes.append((raw[name_off : name_off + namesz], ntype, raw[desc_off : desc_off + descsz]))
        off = end
    return notes


def _is_gnu(name: bytes) -> bool:
    return name in (b"GNU\0", b"GNU")


def parse_build_id_note(raw: bytes, what: str) -> str:
    """Lowercase hex of the GNU build-id in a raw ELF note blob.

    ``raw`` is what ``/sys/module/<m>/notes/.note.gnu.build-id`` holds (or a
    ``.note.gnu.build-id`` section): namesz, descsz, type 3, ``GNU\\0``, desc.
    """
    for name, ntype, desc in _iter_notes(bytes(raw), what):
        if _is_gnu(name) and ntype == _NT_GNU_BUILD_ID:
            if not desc:
                raise ModuleFileError(_one_line(f"{what}: empty GNU build-id note"))
            return desc.hex()
    raise ModuleFileError(_one_line(f"{what}: no GNU build-id note in {len(raw)} bytes"))


def _parse_build_id(elf: _Elf) -> str | None:
    preferred = elf.by_name.get(".note.gnu.build-id")
    candidates = [] if preferred is None else [preferred]
    candidates += [s for s in elf.sections if s.type == _SHT_NOTE and s is not preferred]
    for sec in candidates:
        what = f"{elf.path}: section {sec.name or sec.index}"
        for name, ntype, desc in _iter_notes(elf.section_data(sec), what):
            if _is_gnu(name) and ntype == _NT_GNU_BUILD_ID and desc:
                return desc.hex()
    return None


def _parse_versions(elf: _Elf) -> dict[str, int]:
    crcs: dict[str, int] = {}
    sec = elf.by_name.get("__versions")
    if sec is not None:
        data = elf.section_data(sec)
        if len(data) % _MODVERSION_SIZE:
            raise elf.fail(
                f"__versions size {len(data)} is not a multiple of {_MODVERSION_SIZE} "
                "(not a 64-bit module?)"
            )
        for off in range(0, len(data), _MODVERSION_SIZE):
            (crc,) = _U64.unpack_from(data, off)
            raw_name = data[off + 8 : off + _MODVERSION_SIZE].split(b"\0", 1)[0]
            if raw_name:
                crcs[raw_name.decode("utf-8", errors="replace")] = crc & _CRC_MASK
    # CONFIG_EXTENDED_MODVERSIONS (Linux >= 6.14): parallel u32 CRCs and names.
    ext_crcs = elf.by_name.get("__version_ext_crcs")
    ext_names = elf.by_name.get("__version_ext_names")
    if ext_crcs is not None and ext_names is not None:
        crc_data = elf.section_data(ext_crcs)
        names = [n for n in elf.section_data(ext_names).split(b"\0") if n]
        if len(crc_data) != 4 * len(names):
            raise elf.fail(f"__version_ext_crcs holds {len(crc_data)} bytes for {len(names)} names")
        for i, raw_name in enumerate(names):
            (crc,) = _U32.unpack_from(crc_data, 4 * i)
            crcs.setdefault(raw_name.decode("utf-8", errors="replace"), crc)
    return crcs


def _parse_exported_crcs(elf: _Elf) -> dict[str, int]:
    symtab = next((s for s in elf.sections if s.type == _SHT_SYMTAB), None)
    if symtab is None:
        return {}
    if symtab.entsize not in (0, _SYM.size):
        raise elf.fail(f"unexpected symbol table entry size {symtab.entsize}")
    syms = elf.section_data(symtab)
    strtab = elf.section_data(elf.section(symtab.link, "the symbol table's string table"))
    shndx_sec = next(
        (s for s in elf.sections if s.type == _SHT_SYMTAB_SHNDX and s.link == symtab.index),
        None,
    )
    shndx_data = elf.section_data(shndx_sec) if shndx_sec is not None else b""
    crcs: dict[str, int] = {}
    whole = len(syms) - len(syms) % _SYM.size
    for i, sym in enumerate(_SYM.iter_unpack(syms[:whole])):
        st_name, _info, _other, st_shndx, st_value, _size = sym
        if not strtab.startswith(b"__crc_", st_name):
            continue  # the common case, without decoding the name
        name = _cstring(strtab, st_name)
        if name is None or not name.startswith("__crc_") or len(name) == 6:
            continue
        symbol = name[6:]
        if st_shndx == _SHN_ABS:
            crcs[symbol] = st_value & _CRC_MASK  # old layout: the value is the CRC
            continue
        if st_shndx == _SHN_XINDEX:
            if 4 * i + 4 > len(shndx_data):
                raise elf.fail(f"symbol {name} has an extended section index that is missing")
            (st_shndx,) = _U32.unpack_from(shndx_data, 4 * i)
        elif st_shndx == _SHN_UNDEF or st_shndx >= _SHN_LORESERVE:
            continue  # undefined (a weak reference) or another special index
        # new layout (and CONFIG_MODULE_REL_CRCS): an offset into __kcrctab
        sec = elf.section(st_shndx, f"symbol {name}")
        size = sec.size if sec.has_data else 0  # bounds checked when the headers were read
        if st_value + 4 > size:
            raise elf.fail(
                f"symbol {name} points at offset {st_value} past the end of "
                f"section {sec.name or sec.index} ({size} bytes)"
            )
        (crcs[symbol],) = _U32.unpack_from(elf.data, sec.offset + st_value)
    return crcs


def parse_module_bytes(data: bytes | bytearray, path: str) -> ModuleFile:
    """Parse an uncompressed ELF kernel module image; ``path`` is only for naming."""
    try:
        elf = _Elf(data if isinstance(data, bytes | bytearray) else bytes(data), path)
        info = _parse_modinfo(elf)
        build_id = _parse_build_id(elf)
        required = _parse_versions(elf)
        exported = _parse_exported_crcs(elf)
    except ModuleFileError:
        raise
    except (struct.error, IndexError, ValueError, OverflowError) as exc:  # defence in depth
        raise ModuleFileError(_one_line(f"{path}: malformed ELF file: {exc}")) from exc
    name = info.get("name") or module_name_from_path(path)
    depends = tuple(normalize_module_name(d.strip()) for d in info.get("depends", "").split(","))
    return ModuleFile(
        path=path,
        name=normalize_module_name(name),
        srcversion=info.get("srcversion") or None,
        vermagic=info.get("vermagic") or None,
        depends=tuple(d for d in depends if d),
        build_id=build_id,
        required_crcs=MappingProxyType(required),
        exported_crcs=MappingProxyType(exported),
    )


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


# An ELF module ends with its section header table; a signed one has its
# signature (well under this) after that.
_TRAILER_SLACK = 64 * 1024


def _declared_size(head: bytes) -> int | None:
    """Where an ELF64 LE image says it ends (end of its section headers), from its header."""
    if len(head) < _EHDR.size or head[:4] != _ELF_MAGIC or head[4] != _ELFCLASS64:
        return None
    fields = _EHDR.unpack_from(head, 0)
    e_shoff, e_shentsize, e_shnum = fields[6], fields[11], fields[12]
    if e_shnum == 0:  # extended numbering: the count is in section header 0
        return None
    return int(e_shoff) + int(e_shentsize) * int(e_shnum)


def _read_bounded(stream: _Readable, path: str, cap: int, what: str) -> bytearray:
    """Read ``stream`` to its end into one buffer, refusing more than the image can be.

    The bound is ``cap``, and once the first bytes are in, what the ELF header
    declares (plus a signature's worth): a decompression bomb is refused after
    the first chunk (not ELF) or at the size its own header claims, so the
    peak memory is the size of a real module, never ``cap`` of garbage.
    """
    out = bytearray()
    limit = cap
    checked = False
    while True:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        out += chunk
        if not checked and len(out) >= _EHDR.size:
            checked = True
            if out[:4] != _ELF_MAGIC:
                raise ModuleFileError(f"{path}: {what} is not an ELF file (bad magic)")
            declared = _declared_size(bytes(out[: _EHDR.size]))
            if declared is not None:
                if declared > cap:
                    raise ModuleFileError(
                        f"{path}: image exceeds {cap} bytes (its ELF header declares {declared})"
                    )
                limit = min(cap, declared + _TRAILER_SLACK)
        if len(out) > limit:
            raise ModuleFileError(f"{path}: {what} exceeds {limit} bytes (cap {cap})")
    return out  # a bytearray: no second copy of the image


def _decompressor(head: bytes, fileobj: IO[bytes]) -> _Readable | None:
    if head.startswith(_XZ_MAGIC):
        return lzma.LZMAFile(fileobj)
    if head.startswith(_ZSTD_MAGIC):
        import zstandard  # only when a .ko.zst is met: `nodeagent check` imports it lazily

        return zstandard.ZstdDecompressor().stream_reader(fileobj, read_across_frames=True)
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=fileobj)
    return None


def _zstd_errors() -> tuple[type[Exception], ...]:
    """zstandard's error class once it is imported (it is imported only for a .ko.zst)."""
    zstd = sys.modules.get("zstandard")
    return (zstd.ZstdError,) if zstd is not None else ()


def _decompress_stream(head: bytes, fileobj: IO[bytes], path: str, cap: int) -> bytes | bytearray:
    """The ELF image from ``fileobj`` (compressed by magic, or plain), streamed and capped."""
    try:
        reader = _decompressor(head, fileobj)
        if reader is None:
            for suffix in _COMPRESSED_SUFFIXES:
                if path.endswith(suffix) and not head.startswith(_ELF_MAGIC):
                    raise ModuleFileError(f"{path}: not {suffix[1:]} data (bad magic)")
            return _read_bounded(fileobj, path, cap, "file")
        with reader:  # type: ignore[attr-defined]
            return _read_bounded(reader, path, cap, "decompressed data")
    except ModuleFileError:
        raise
    except Exception as exc:
        if not isinstance(exc, (lzma.LZMAError, zlib.error, EOFError, OSError, *_zstd_errors())):
            raise
        raise ModuleFileError(_one_line(f"{path}: cannot decompress: {exc}")) from exc


def decompress_module(data: bytes, path: str) -> bytes | bytearray:
    """Return the ELF image inside ``data`` (xz, zstd, gzip or already plain)."""
    if _decompressor(data[:8], io.BytesIO()) is None:
        for suffix in _COMPRESSED_SUFFIXES:
            if path.endswith(suffix) and not data.startswith(_ELF_MAGIC):
                raise ModuleFileError(f"{path}: not {suffix[1:]} data (bad magic)")
        return data
    return _decompress_stream(data[:8], io.BytesIO(data), path, MAX_MODULE_SIZE)


def read_module_fd(fd: int, path: str, cap: int | None = None) -> ModuleFile:
    """Read (from offset 0), decompress and parse the module open at ``fd`` (not closed).

    ``path`` only names the file in errors. The compressed input is streamed,
    never held whole; the image is bounded as ``_read_bounded`` says.
    """
    return parse_module_bytes(module_image_fd(fd, path, cap), path)


def module_image_fd(fd: int, path: str, cap: int | None = None) -> bytes | bytearray:
    """The uncompressed ELF image of the module open at ``fd`` (read with pread, from 0)."""
    cap = MAX_MODULE_SIZE if cap is None else cap
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModuleFileError(f"{path}: cannot read: not a regular file")
        if st.st_size > cap:
            raise ModuleFileError(f"{path}: file size {st.st_size} exceeds {cap} bytes")
        if st.st_size == 0:
            raise ModuleFileError(f"{path}: not an ELF file (empty)")
        raw = _FdReader(fd)
        head = raw.peek(8)
        return _decompress_stream(head, cast(IO[bytes], io.BufferedReader(raw)), path, cap)
    except OSError as exc:
        raise ModuleFileError(_one_line(f"{path}: cannot read: {exc.strerror or exc}")) from exc


class _FdReader(io.RawIOBase):
    """A positional reader over a borrowed descriptor (pread: the fd's offset is untouched)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        data = os.pread(self.fd, len(b), self.pos)
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def peek(self, n: int) -> bytes:
        return os.pread(self.fd, n, 0)


def read_module_file(path: str | os.PathLike[str]) -> ModuleFile:
    """Read, decompress (by magic; the suffix only names the format) and parse."""
    spath = os.fspath(path)
    try:
        fd = os.open(spath, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ModuleFileError(_one_line(f"{spath}: cannot read: {exc.strerror or exc}")) from exc
    try:
        return read_module_fd(fd, spath)
    finally:
        os.close(fd)
