"""nodeagent.host.modfile against gcc-built modules, the pure writer, and broken input."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent.host import modfile
from nodeagent.host.modfile import (
    ModuleFile,
    ModuleFileError,
    parse_build_id_note,
    parse_module_bytes,
    read_module_file,
)
from nodeagent.sim.kofile import build_module_bytes, write_module_file
from tests.kobuild import build_gcc_module

VERMAGIC = "6.1.0-18-amd64 SMP preempt mod_unload modversions "
SRCVERSION = "0123456789ABCDEF0123456"
BUILD_ID = bytes.fromhex("46ed634d5e263667383934c0d4ff52fa3954489d")
REQUIRED = {"ib_register_peer_memory_client": 0x368A11CB, "ib_core_thing": 0x8D5FEB7B}
EXPORTED = {"fake_register_peer_client": 0x368A11CB, "high_bit": 0xFFFFFFFF, "zero": 0}


def _kwargs() -> dict[str, object]:
    return {
        "srcversion": SRCVERSION,
        "vermagic": VERMAGIC,
        "depends": ("ib_core", "ib-uverbs"),
        "build_id": BUILD_ID,
        "required_crcs": REQUIRED,
        "exported_crcs": EXPORTED,
    }


def _sample(**kw: object) -> bytes:
    return build_module_bytes("fake-peermem", **{**_kwargs(), **kw})  # type: ignore[arg-type]


SAMPLE = _sample()


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed (apt-get install -y kmod binutils)")


# ------------------------------------------------------------ pure writer


@pytest.mark.parametrize("layout", ["kcrctab", "absolute"])
def test_writer_output_round_trips(layout: str) -> None:
    data = _sample(crc_layout=layout)
    mf = parse_module_bytes(data, "/x/fake-peermem.ko")
    assert mf == ModuleFile(
        path="/x/fake-peermem.ko",
        name="fake_peermem",
        srcversion=SRCVERSION,
        vermagic=VERMAGIC,
        depends=("ib_core", "ib_uverbs"),
        build_id=BUILD_ID.hex(),
        required_crcs=REQUIRED,
        exported_crcs=EXPORTED,
    )
    assert parse_module_bytes(data, "/x/fake-peermem.ko") == mf
    hash(mf)  # usable as a cache value/key


def test_writer_minimal_module_has_no_optional_facts() -> None:
    mf = parse_module_bytes(build_module_bytes("plain"), "plain.ko")
    assert (mf.name, mf.srcversion, mf.vermagic, mf.depends, mf.build_id) == (
        "plain",
        None,
        None,
        (),
        None,
    )
    assert dict(mf.required_crcs) == {} and dict(mf.exported_crcs) == {}


def test_name_falls_back_to_file_name() -> None:
    data = build_module_bytes("")  # "name=" with no value
    assert parse_module_bytes(data, "/lib/modules/x/nvidia-peermem.ko.xz").name == "nvidia_peermem"
    assert parse_module_bytes(data, "mlx5-core.ko").name == "mlx5_core"


def test_aarch64_module_is_read() -> None:
    data = build_module_bytes("a64", exported_crcs={"s": 7}, machine="aarch64")
    assert struct.unpack_from("<H", data, 18)[0] == 183
    assert dict(parse_module_bytes(data, "a64.ko").exported_crcs) == {"s": 7}


@pytest.mark.parametrize("layout", ["kcrctab", "absolute"])
def test_writer_output_accepted_by_readelf(tmp_path: Path, layout: str) -> None:
    _need("readelf")
    path = tmp_path / "fake-peermem.ko"
    path.write_bytes(_sample(crc_layout=layout))
    res = _run("readelf", "-W", "-S", "-s", "-n", str(path))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert f"Build ID: {BUILD_ID.hex()}" in res.stdout
    assert re.search(r"\s__versions\s+PROGBITS", res.stdout)
    assert ("__kcrctab" in res.stdout) == (layout == "kcrctab")
    for sym in EXPORTED:
        assert re.search(rf"\s__crc_{sym}$", res.stdout, re.M)


@pytest.mark.parametrize("compress", [None, "xz", "zst"])
def test_writer_output_accepted_by_modinfo(tmp_path: Path, compress: str | None) -> None:
    _need("modinfo")
    path = write_module_file(tmp_path / "fake-peermem.ko", compress, **_kwargs())  # type: ignore[arg-type]
    assert path.name == "fake-peermem.ko" + (f".{compress}" if compress else "")
    res = _run("modinfo", str(path))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    fields = dict(re.findall(r"^(\w+):\s*(.*?)\s*$", res.stdout, re.M))
    assert fields["name"] == "fake_peermem"
    assert fields["srcversion"] == SRCVERSION
    assert fields["depends"] == "ib_core,ib-uverbs"
    _need("modprobe")
    dump = _run("modprobe", "--dump-modversions", str(path))
    assert dump.returncode == 0, dump.stderr
    assert {
        name: int(crc, 16) for crc, name in (ln.split() for ln in dump.stdout.splitlines())
    } == (REQUIRED)


# ------------------------------------------------------------ compression


@pytest.mark.parametrize("compress", ["xz", "zst", "gz"])
def test_compressed_variants_equal_plain(tmp_path: Path, compress: str) -> None:
    plain = read_module_file(write_module_file(tmp_path / "m.ko", **_kwargs()))  # type: ignore[arg-type]
    path = write_module_file(tmp_path / "m.ko", compress, **_kwargs())  # type: ignore[arg-type]
    mf = read_module_file(path)
    assert mf.path == str(path)
    assert mf == ModuleFile(**{**plain.__dict__, "path": str(path)})


@pytest.mark.parametrize(
    ("tool", "suffix", "argv"),
    [
        ("xz", ".xz", ["xz", "--check=crc32", "--lzma2=dict=1MiB", "-c"]),
        ("zstd", ".zst", ["zstd", "-q", "-T0", "-c"]),
        ("gzip", ".gz", ["gzip", "-n", "-c"]),
    ],
)
def test_cli_compressed_files(tmp_path: Path, tool: str, suffix: str, argv: list[str]) -> None:
    _need(tool)
    src = tmp_path / "m.ko"
    src.write_bytes(SAMPLE)
    out = tmp_path / f"m.ko{suffix}"
    with out.open("wb") as f:
        subprocess.run([*argv, str(src)], stdout=f, check=True)
    assert read_module_file(out).exported_crcs == parse_module_bytes(SAMPLE, "x").exported_crcs


def test_zstd_stream_without_content_size_and_two_frames(tmp_path: Path) -> None:
    half = len(SAMPLE) // 2
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    frames = b""
    for part in (SAMPLE[:half], SAMPLE[half:]):
        obj = cctx.compressobj()
        frames += obj.compress(part) + obj.flush()
    path = tmp_path / "m.ko.zst"
    path.write_bytes(frames)
    assert read_module_file(path).build_id == BUILD_ID.hex()


def test_decompressed_size_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modfile, "MAX_MODULE_SIZE", 256)
    for compress in ("xz", "zst", "gz"):
        path = write_module_file(tmp_path / "m.ko", compress, **_kwargs())
        assert path.stat().st_size < len(SAMPLE)
        with pytest.raises(ModuleFileError, match="exceeds 256 bytes"):
            read_module_file(path)


def test_suffix_without_matching_data(tmp_path: Path) -> None:
    path = tmp_path / "m.ko.xz"
    path.write_bytes(b"this is not xz data at all")
    with pytest.raises(ModuleFileError, match=r"m\.ko\.xz: not xz data"):
        read_module_file(path)
    # an uncompressed module under a compressed name is still read (magic wins)
    path.write_bytes(SAMPLE)
    assert read_module_file(path).name == "fake_peermem"


# ------------------------------------------------------------ gcc-built fixtures


@pytest.fixture(scope="module")
def gcc_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gcc_module(
        tmp_path_factory.mktemp("gcc"),
        "gcc-mod.ko",
        modinfo={
            "license": "GPL",
            "name": "gcc_mod",
            "srcversion": SRCVERSION,
            "depends": "ib_core,ib_uverbs",
            "vermagic": VERMAGIC,
        },
        required_crcs=REQUIRED,
        kcrctab_crcs={"exported_new": 0xDEADBEEF, "exported_new2": 0x00000001},
        absolute_crcs={"exported_old": 0x12345678, "exported_old_high": 0xFEDCBA98},
    )


def test_gcc_module_fields(gcc_module: Path) -> None:
    mf = read_module_file(gcc_module)
    assert mf.name == "gcc_mod"
    assert mf.srcversion == SRCVERSION
    assert mf.vermagic == VERMAGIC
    assert mf.depends == ("ib_core", "ib_uverbs")
    assert dict(mf.required_crcs) == REQUIRED
    assert dict(mf.exported_crcs) == {
        "exported_new": 0xDEADBEEF,
        "exported_new2": 0x00000001,
        "exported_old": 0x12345678,
        "exported_old_high": 0xFEDCBA98,
    }
    assert mf.build_id is not None and re.fullmatch(r"[0-9a-f]{40}", mf.build_id)


def test_gcc_module_cross_checked_with_readelf(gcc_module: Path) -> None:
    _need("readelf")
    mf = read_module_file(gcc_module)
    notes = _run("readelf", "-n", str(gcc_module)).stdout
    assert f"Build ID: {mf.build_id}" in notes
    syms = _run("readelf", "-W", "-s", str(gcc_module)).stdout
    # the absolute layout: readelf shows the CRC as the symbol value
    abs_value = re.search(
        r"([0-9a-f]{16})\s+0\s+NOTYPE\s+GLOBAL\s+\w+\s+ABS\s+__crc_exported_old$", syms, re.M
    )
    assert abs_value is not None and int(abs_value.group(1), 16) == mf.exported_crcs["exported_old"]
    # the kcrctab layout: the value is an offset into __kcrctab
    new = re.search(
        r"([0-9a-f]{16})\s+0\s+NOTYPE\s+LOCAL\s+\w+\s+(\d+)\s+__crc_exported_new$", syms, re.M
    )
    assert new is not None
    sections = _run("readelf", "-W", "-S", str(gcc_module)).stdout
    assert re.search(rf"\[\s*{new.group(2)}\]\s+__kcrctab\s", sections)


def test_gcc_module_cross_checked_with_modinfo(gcc_module: Path) -> None:
    _need("modinfo")
    mf = read_module_file(gcc_module)
    for field, value in (
        ("name", mf.name),
        ("srcversion", mf.srcversion),
        ("vermagic", mf.vermagic),
    ):
        res = _run("modinfo", "-F", field, str(gcc_module))
        assert res.returncode == 0 and res.stdout.rstrip("\n") == value, (field, res)
    depends = _run("modinfo", "-F", "depends", str(gcc_module)).stdout.strip()
    assert tuple(depends.split(",")) == mf.depends
    _need("modprobe")
    dump = _run("modprobe", "--dump-modversions", str(gcc_module)).stdout
    assert {n: int(c, 16) for c, n in (ln.split() for ln in dump.splitlines())} == dict(
        mf.required_crcs
    )


def test_gcc_module_without_build_id_or_name(tmp_path: Path) -> None:
    path = build_gcc_module(
        tmp_path, "no-name.ko", modinfo={"license": "GPL", "depends": ""}, build_id=False
    )
    mf = read_module_file(path)
    assert (mf.name, mf.build_id, mf.depends) == ("no_name", None, ())


def test_gcc_extended_modversions(tmp_path: Path) -> None:
    path = build_gcc_module(
        tmp_path,
        "ext.ko",
        modinfo={"name": "ext"},
        required_crcs={"short_one": 1},
        ext_required_crcs={"a_rust_symbol_" + "x" * 80: 0xCAFEF00D, "short_one": 1},
    )
    assert dict(read_module_file(path).required_crcs) == {
        "short_one": 1,
        "a_rust_symbol_" + "x" * 80: 0xCAFEF00D,
    }


# ------------------------------------------------------------ build-id notes


def _note(name: bytes, ntype: int, desc: bytes) -> bytes:
    def pad(b: bytes) -> bytes:
        return b + b"\0" * (-len(b) % 4)

    return struct.pack("<III", len(name), len(desc), ntype) + pad(name) + pad(desc)


def test_build_id_note_as_in_sysfs() -> None:
    raw = _note(b"GNU\0", 3, BUILD_ID)
    assert len(raw) == 36
    assert (
        parse_build_id_note(raw, "/sys/module/ib_core/notes/.note.gnu.build-id") == BUILD_ID.hex()
    )
    # another note first, trailing padding after: still found
    raw2 = _note(b"Linux\0", 6, b"\x01\x02") + raw + b"\0\0\0\0"
    assert parse_build_id_note(raw2, "x") == BUILD_ID.hex()


def test_build_id_note_matches_ko_section() -> None:
    off = SAMPLE.find(b"GNU\0") - 12  # the note header precedes the owner name
    raw = SAMPLE[off : off + 36]
    assert parse_build_id_note(raw, "sysfs") == parse_module_bytes(SAMPLE, "x").build_id


@pytest.mark.parametrize("cut", range(36))
def test_build_id_note_truncated(cut: int) -> None:
    raw = _note(b"GNU\0", 3, BUILD_ID)[:cut]
    with pytest.raises(
        ModuleFileError, match=r"^/sys/module/m/notes/\.note\.gnu\.build-id: "
    ) as ei:
        parse_build_id_note(raw, "/sys/module/m/notes/.note.gnu.build-id")
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "raw",
    [
        _note(b"GNU\0", 1, BUILD_ID),  # NT_GNU_ABI_TAG, not a build id
        _note(b"GNX\0", 3, BUILD_ID),
        _note(b"GNU\0", 3, b""),
        struct.pack("<III", 4, 0xFFFFFFFF, 3) + b"GNU\0" + BUILD_ID,
        b"\xff" * 40,
    ],
)
def test_build_id_note_garbage(raw: bytes) -> None:
    with pytest.raises(ModuleFileError, match=r"^what: "):
        parse_build_id_note(raw, "what")


# ------------------------------------------------------------ broken input


def _outcome(data: bytes, path: str = "/m/broken.ko") -> ModuleFile | ModuleFileError:
    try:
        return parse_module_bytes(data, path)
    except ModuleFileError as exc:
        msg = str(exc)
        assert "\n" not in msg and msg.startswith(path), msg
        return exc


def test_every_truncation_of_a_module_is_an_error() -> None:
    # section headers sit at the end: any cut loses them
    for cut in range(len(SAMPLE)):
        assert isinstance(_outcome(SAMPLE[:cut]), ModuleFileError), cut


@pytest.mark.parametrize("compress", ["xz", "zst", "gz"])
def test_truncated_compressed_files(tmp_path: Path, compress: str) -> None:
    path = write_module_file(tmp_path / "m.ko", compress, **_kwargs())  # type: ignore[arg-type]
    whole = path.read_bytes()
    cut_path = tmp_path / f"cut.ko.{compress}"
    for cut in range(len(whole)):
        cut_path.write_bytes(whole[:cut])
        with pytest.raises(ModuleFileError) as ei:
            read_module_file(cut_path)
        assert "\n" not in str(ei.value) and str(cut_path) in str(ei.value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(0, 255)), max_size=8))
def test_byte_flips_never_raise_anything_else(flips: list[tuple[int, int]]) -> None:
    data = bytearray(SAMPLE)
    for pos, value in flips:
        data[pos] = value
    _outcome(bytes(data))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_after_elf_header_prefix(tail: bytes) -> None:
    _outcome(SAMPLE[:64] + tail)
    _outcome(tail)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ((4, 1), "ELF class 1"),
        ((5, 2), "little-endian"),
        ((16, 2), "not a relocatable object"),
    ],
)
def test_unsupported_elf_kinds(patch: tuple[int, int], message: str) -> None:
    data = bytearray(SAMPLE)
    data[patch[0]] = patch[1]
    with pytest.raises(ModuleFileError, match=message):
        parse_module_bytes(bytes(data), "m.ko")


def test_crc_symbol_pointing_past_kcrctab() -> None:
    mf = parse_module_bytes(SAMPLE, "m.ko")
    assert mf.exported_crcs["high_bit"] == 0xFFFFFFFF
    # find __crc_zero (offset 8 in __kcrctab) and move it past the section end
    data = bytearray(SAMPLE)
    shoff, shnum = struct.unpack_from("<Q", data, 40)[0], struct.unpack_from("<H", data, 60)[0]
    for i in range(shnum):
        sh = struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i)
        if sh[1] == 2:  # SHT_SYMTAB
            for j in range(sh[5] // 24):
                off = sh[4] + 24 * j
                if struct.unpack_from("<Q", data, off + 8)[0] == 8 and data[off + 4] == 0:
                    struct.pack_into("<Q", data, off + 8, 4096)
    with pytest.raises(ModuleFileError, match="past the end of section __kcrctab"):
        parse_module_bytes(bytes(data), "m.ko")


def test_unreadable_paths(tmp_path: Path) -> None:
    with pytest.raises(ModuleFileError, match=r"missing\.ko: cannot read"):
        read_module_file(tmp_path / "missing.ko")
    with pytest.raises(ModuleFileError, match="cannot read"):
        read_module_file(tmp_path)
    empty = tmp_path / "empty.ko"
    empty.write_bytes(b"")
    with pytest.raises(ModuleFileError, match=r"empty\.ko: not an ELF file"):
        read_module_file(empty)
