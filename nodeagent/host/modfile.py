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
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from nodeagent.core.names import normalize_module_name
from nodeagent.errors import NodeagentError

__all__ = [
    "MAX_MODULE_SIZE",
    "ModuleFile",
    "ModuleFileError",
    "decompress_module",
    "module_name_from_path",
    "parse_build_id_note",
    "parse_module_bytes",
    "read_module_file",
]

# Upper bound on a module's (decompressed) size: nvidia.ko is ~100 MiB with
# debug info; anything far beyond that is garbage or a decompression bomb.
MAX_MODULE_SIZE = 1 << 30

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

    def __init__(self, data: bytes, path: str) -> None:
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
        return self.data[sec.offset : sec.offset + sec.size]

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


def parse_module_bytes(data: bytes, path: str) -> ModuleFile:
    """Parse an uncompressed ELF kernel module image; ``path`` is only for naming."""
    try:
        elf = _Elf(bytes(data), path)
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


def _read_limited(stream: _Readable, path: str) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_MODULE_SIZE:
            raise ModuleFileError(f"{path}: decompressed size exceeds {MAX_MODULE_SIZE} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _zstd(data: bytes, path: str) -> bytes:
    import zstandard  # only when a .ko.zst is met: `nodeagent check` imports it lazily

    try:
        dctx = zstandard.ZstdDecompressor()
        with dctx.stream_reader(io.BytesIO(data), read_across_frames=True) as zr:
            return _read_limited(zr, path)
    except zstandard.ZstdError as exc:
        raise ModuleFileError(_one_line(f"{path}: cannot decompress: {exc}")) from exc


def decompress_module(data: bytes, path: str) -> bytes:
    """Return the ELF image inside ``data`` (xz, zstd, gzip or already plain)."""
    try:
        if data.startswith(_XZ_MAGIC):
            with lzma.LZMAFile(io.BytesIO(data)) as xzf:
                return _read_limited(xzf, path)
        if data.startswith(_ZSTD_MAGIC):
            return _zstd(data, path)
        if data.startswith(_GZIP_MAGIC):
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as gzf:
                return _read_limited(gzf, path)
    except ModuleFileError:
        raise
    except (lzma.LZMAError, zlib.error, EOFError, OSError) as exc:
        raise ModuleFileError(_one_line(f"{path}: cannot decompress: {exc}")) from exc
    for suffix in _COMPRESSED_SUFFIXES:
        if path.endswith(suffix) and not data.startswith(_ELF_MAGIC):
            raise ModuleFileError(f"{path}: not {suffix[1:]} data (bad magic)")
    return data


def read_module_file(path: str | os.PathLike[str]) -> ModuleFile:
    """Read, decompress (by magic; the suffix only names the format) and parse."""
    spath = os.fspath(path)
    try:
        with open(spath, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MODULE_SIZE:
                raise ModuleFileError(f"{spath}: file size {size} exceeds {MAX_MODULE_SIZE} bytes")
            # In chunks: read(MAX_MODULE_SIZE + 1) allocates 1 GiB up front
            # (MemoryError on a 1 GiB guest).
            data = _read_limited(f, spath)
    except OSError as exc:
        raise ModuleFileError(_one_line(f"{spath}: cannot read: {exc.strerror or exc}")) from exc
    return parse_module_bytes(decompress_module(data, spath), spath)
