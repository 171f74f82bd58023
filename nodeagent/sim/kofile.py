"""Write small but valid ELF64 little-endian relocatable kernel modules.

For the simulator and the tests: no compiler at run time. The output carries
what ``nodeagent.host.modfile`` reads and what binutils ``readelf`` and kmod's
``modinfo`` / ``modprobe --dump-modversions`` accept:

- ``.modinfo``: NUL-separated ``key=value`` strings (``name=``, ``depends=``,
  ``srcversion=``, ``vermagic=``, extras);
- ``.note.gnu.build-id``: one GNU note, type 3;
- ``__versions``: 64-byte ``struct modversion_info`` entries (u64 CRC, then the
  NUL-padded name), as on x86_64/aarch64;
- ``__kcrctab``: LE u32 CRCs, one per exported symbol, pointed at by local
  ``__crc_<sym>`` NOTYPE symbols (layout of Linux >= 5.19), or, with
  ``crc_layout="absolute"``, global ``SHN_ABS`` ``__crc_<sym>`` symbols whose
  value is the CRC (older kernels);
- ``__ksymtab_strings``: the exported names (what depmod reads);
- ``.symtab`` / ``.strtab`` / ``.shstrtab``, with an undefined global symbol for
  every ``required_crcs`` name, so ``depmod`` derives ``modules.dep`` from them.
"""

from __future__ import annotations

import gzip
import lzma
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import zstandard

__all__ = ["build_module_bytes", "write_module_file"]

_MACHINES = {"x86_64": 62, "aarch64": 183}

_SHT_PROGBITS = 1
_SHT_SYMTAB = 2
_SHT_STRTAB = 3
_SHT_NOTE = 7
_SHF_ALLOC = 0x2
_SHN_ABS = 0xFFF1
_STB_LOCAL = 0
_STB_GLOBAL = 1
_STT_NOTYPE = 0
_STT_FUNC = 2
_STT_SECTION = 3

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_MODVERSION_NAME_LEN = 56  # MODULE_NAME_LEN on 64-bit, NUL included


class _StrTab:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self.index: dict[str, int] = {"": 0}

    def add(self, s: str) -> int:
        if s not in self.index:
            self.index[s] = len(self.data)
            self.data += s.encode() + b"\0"
        return self.index[s]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _check_crc(sym: str, crc: int) -> int:
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError(f"CRC for {sym!r} out of u32 range: {crc:#x}")
    return crc


def build_module_bytes(
    name: str,
    *,
    srcversion: str | None = None,
    vermagic: str | None = None,
    depends: Sequence[str] = (),
    build_id: bytes | None = None,
    required_crcs: Mapping[str, int] | None = None,
    exported_crcs: Mapping[str, int] | None = None,
    crc_layout: Literal["kcrctab", "absolute"] = "kcrctab",
    extra_modinfo: Sequence[tuple[str, str]] = (),
    machine: Literal["x86_64", "aarch64"] = "x86_64",
) -> bytes:
    """Return the bytes of a relocatable ELF64 LE kernel module.

    ``name`` goes to ``name=`` with '-' -> '_' (as kbuild's KBUILD_MODNAME).
    ``extra_modinfo`` adds more ``key=value`` strings (``license``, ``alias``...).
    """
    if crc_layout not in ("kcrctab", "absolute"):
        raise ValueError(f"unknown crc_layout {crc_layout!r}")
    if machine not in _MACHINES:
        raise ValueError(f"unknown machine {machine!r}")
    required = dict(required_crcs or {})
    exported = {s: _check_crc(s, c) for s, c in sorted((exported_crcs or {}).items())}

    modinfo = [f"name={name.replace('-', '_')}", f"depends={','.join(depends)}"]
    if srcversion is not None:
        modinfo.append(f"srcversion={srcversion}")
    if vermagic is not None:
        modinfo.append(f"vermagic={vermagic}")
    modinfo += [f"{k}={v}" for k, v in extra_modinfo]

    # (name, type, flags, data, align, entsize)
    sections: list[tuple[str, int, int, bytes, int, int]] = [
        (".text", _SHT_PROGBITS, _SHF_ALLOC | 0x4, b"\xc3" * max(1, len(exported)), 16, 0),
        (
            ".modinfo",
            _SHT_PROGBITS,
            _SHF_ALLOC,
            b"".join(s.encode() + b"\0" for s in modinfo),
            1,
            0,
        ),
    ]
    if build_id is not None:
        if not build_id:
            raise ValueError("build_id must not be empty")
        note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id
        note += b"\0" * (_align(len(note), 4) - len(note))
        sections.append((".note.gnu.build-id", _SHT_NOTE, _SHF_ALLOC, note, 4, 0))
    if required:
        versions = bytearray()
        for sym, crc in required.items():
            raw = sym.encode()
            if not raw or len(raw) >= _MODVERSION_NAME_LEN or b"\0" in raw:
                raise ValueError(f"__versions symbol name {sym!r} does not fit in 55 bytes")
            versions += struct.pack("<Q", _check_crc(sym, crc))
            versions += raw.ljust(_MODVERSION_NAME_LEN, b"\0")
        sections.append(("__versions", _SHT_PROGBITS, _SHF_ALLOC, bytes(versions), 8, 0))
    if exported:
        strings = b"".join(s.encode() + b"\0" for s in exported)
        sections.append(("__ksymtab_strings", _SHT_PROGBITS, _SHF_ALLOC, strings, 1, 0))
    if exported and crc_layout == "kcrctab":
        kcrctab = b"".join(struct.pack("<I", c) for c in exported.values())
        sections.append(("__kcrctab", _SHT_PROGBITS, _SHF_ALLOC, kcrctab, 4, 0))
    sec_index = {sname: i + 1 for i, (sname, *_rest) in enumerate(sections)}

    # Symbols: null, section symbols, local __crc_ (kcrctab layout), then globals.
    strtab = _StrTab()
    locals_: list[bytes] = [_SYM.pack(0, 0, 0, 0, 0, 0)]
    for idx in sec_index.values():
        locals_.append(_SYM.pack(0, (_STB_LOCAL << 4) | _STT_SECTION, 0, idx, 0, 0))
    globals_: list[bytes] = []
    for i, (sym, crc) in enumerate(exported.items()):
        if crc_layout == "kcrctab":
            info = (_STB_LOCAL << 4) | _STT_NOTYPE
            locals_.append(
                _SYM.pack(strtab.add(f"__crc_{sym}"), info, 0, sec_index["__kcrctab"], 4 * i, 0)
            )
        else:
            info = (_STB_GLOBAL << 4) | _STT_NOTYPE
            globals_.append(_SYM.pack(strtab.add(f"__crc_{sym}"), info, 0, _SHN_ABS, crc, 0))
        func = (_STB_GLOBAL << 4) | _STT_FUNC
        globals_.append(_SYM.pack(strtab.add(sym), func, 0, sec_index[".text"], i, 1))
    for sym in required:  # a module references what it needs a CRC for
        if sym not in exported:
            globals_.append(_SYM.pack(strtab.add(sym), _STB_GLOBAL << 4, 0, 0, 0, 0))
    symtab = b"".join(locals_ + globals_)
    first_global = len(locals_)

    shstrtab = _StrTab()
    names = [shstrtab.add(s[0]) for s in sections]
    sym_name, str_name, shstr_name = (shstrtab.add(n) for n in (".symtab", ".strtab", ".shstrtab"))

    out = bytearray(_EHDR.size)
    headers: list[bytes] = [_SHDR.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]

    def place(data: bytes, align: int) -> int:
        out.extend(b"\0" * (_align(len(out), align) - len(out)))
        off = len(out)
        out.extend(data)
        return off

    for (_n, stype, flags, data, align, entsize), name_off in zip(sections, names, strict=True):
        off = place(data, align)
        headers.append(_SHDR.pack(name_off, stype, flags, 0, off, len(data), 0, 0, align, entsize))
    symtab_index = len(headers)
    strtab_index = symtab_index + 1
    off = place(symtab, 8)
    headers.append(
        _SHDR.pack(
            sym_name, _SHT_SYMTAB, 0, 0, off, len(symtab), strtab_index, first_global, 8, _SYM.size
        )
    )
    off = place(bytes(strtab.data), 1)
    headers.append(_SHDR.pack(str_name, _SHT_STRTAB, 0, 0, off, len(strtab.data), 0, 0, 1, 0))
    shstrndx = len(headers)
    shstr_data = bytes(shstrtab.data)
    off = place(shstr_data, 1)
    headers.append(_SHDR.pack(shstr_name, _SHT_STRTAB, 0, 0, off, len(shstr_data), 0, 0, 1, 0))
    shoff = place(b"", 8)
    out.extend(b"".join(headers))

    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8  # ELF64, LE, version 1, SysV
    _EHDR.pack_into(
        out, 0, ident, 1, _MACHINES[machine], 1, 0, 0, shoff, 0, _EHDR.size, 0, 0,
        _SHDR.size, len(headers), shstrndx,
    )  # fmt: skip
    return bytes(out)


_SUFFIX = {"xz": ".xz", "zst": ".zst", "gz": ".gz"}


def write_module_file(
    path: str | os.PathLike[str],
    compress: Literal[None, "xz", "zst", "gz"] = None,
    **kw: Any,
) -> Path:
    """Build a module with ``build_module_bytes(**kw)`` and write it to ``path``.

    ``name`` defaults to the file name (``nvidia-peermem.ko`` -> ``nvidia_peermem``).
    With ``compress``, the matching suffix is appended unless ``path`` already
    ends with it; the path actually written is returned.
    """
    out = Path(path)
    if compress is not None:
        suffix = _SUFFIX.get(compress)
        if suffix is None:
            raise ValueError(f"unknown compression {compress!r}")
        if not out.name.endswith(suffix):
            out = out.with_name(out.name + suffix)
    if "name" not in kw:
        base = out.name
        for suffix in _SUFFIX.values():
            base = base.removesuffix(suffix)
        kw["name"] = base.removesuffix(".ko").replace("-", "_")
    data = build_module_bytes(**kw)
    if compress == "xz":
        # as kmod/kbuild: xz --check=crc32 --lzma2=dict=1MiB
        filters = [{"id": lzma.FILTER_LZMA2, "dict_size": 1 << 20}]
        data = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, filters=filters)
    elif compress == "zst":
        data = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(data)
    elif compress == "gz":
        data = gzip.compress(data, mtime=0)
    out.write_bytes(data)
    return out
