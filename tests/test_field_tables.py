"""The field tables (core/fields.py): each guard names every policy and memory field once,
and the shared readers refuse each kind of bad value in one line naming the key and value."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest

from nodeagent.core import fields, peermem, sriov, storage
from nodeagent.core.peermem import PeermemGate, PeermemMemory, PeermemPolicy
from nodeagent.core.sriov import PfMemory, SriovGuard, SriovMemory, SriovPolicy, VfRestore
from nodeagent.core.sriov_model import saved_pf_from_json
from nodeagent.core.storage import StorageGuard, StorageMemory, StoragePolicy
from nodeagent.errors import NodeagentError

# -- every field in its table ------------------------------------------------------------

POLICIES: list[
    tuple[str, Callable[[Mapping[str, Any], Any], Any], Any, Sequence[fields.Setting]]
] = [
    ("peermem", peermem.parse_policy, PeermemPolicy(), peermem.POLICY_FIELDS),
    ("storage", storage.parse_policy, StoragePolicy(), storage.POLICY_FIELDS),
    ("sriov", sriov.parse_policy, SriovPolicy(), sriov.POLICY_FIELDS),
]

# A value other than the default for every key (a new row needs one here).
NOT_DEFAULT: dict[str, dict[str, Any]] = {
    "peermem": {
        "enabled": False,
        "mofed": "host",
        "load_params": ["peerdirect_support=0"],
        "retry_base_seconds": 1,
        "retry_max_seconds": 60,
        "rdma_stack": ["mlx5_core", "ib_core"],
        "hold_loads": "fanotify",
        "hold_budget_seconds": 600,
        "hold_roots": ["run/nvidia/driver"],
        "hold_containers": [],
        "hold_scan_seconds": 0.5,
    },
    "storage": {
        "enabled": True,
        "mofed": "none",
        "policy": "unload",
        "modules": ["rpcrdma"],
        "reload": False,
        "hold_file": "run/modprobe.d/hold.conf",
        "pending_markers": ["run/mofed-init"],
        "retry_base_seconds": 1,
        "retry_max_seconds": 60,
    },
    "sriov": {
        "enabled": False,
        "numvfs_owner": "mofed",
        "mofed": "host",
        "mofed_drivers": ["ice"],
        "numvfs_grace_seconds": 1,
        "vf_deadline_seconds": 2,
        "retry_base_seconds": 0.5,
        "retry_max_seconds": 20,
        "poll_seconds": 1,
        "pf_gone_seconds": 60,
        "parallel": 4,
    },
}


def names(dc: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(dc)}


@pytest.mark.parametrize(("guard", "parse", "default", "table"), POLICIES, ids=lambda x: "")
def test_every_policy_field_has_one_row(
    guard: str, parse: Callable[..., Any], default: Any, table: Sequence[fields.Setting]
) -> None:
    keys = [s.key for s in table]
    attrs = [s.attr for s in table]
    assert len(set(keys)) == len(keys) and len(set(attrs)) == len(attrs)
    assert set(attrs) == names(default), f"[{guard}]: a policy field without a row, or a stray row"
    # Each row sets its own field: every key given a non-default value changes every field.
    assert set(NOT_DEFAULT[guard]) == set(keys)
    pol = parse(NOT_DEFAULT[guard], default)
    same = [a for a in attrs if getattr(pol, a) == getattr(default, a)]
    assert same == [], f"[{guard}]: rows that do not set their field: {same}"
    assert parse({}, default) == default


@pytest.mark.parametrize(("guard", "parse", "default", "table"), POLICIES, ids=lambda x: "")
def test_each_policy_row_refuses_a_wrong_value_in_one_line_naming_it(
    guard: str, parse: Callable[..., Any], default: Any, table: Sequence[fields.Setting]
) -> None:
    bad = {"a": 1}  # a TOML table: no field takes one
    for s in table:
        with pytest.raises(NodeagentError) as exc:
            parse({s.key: bad}, default)
        line = str(exc.value)
        assert line.startswith(f"config {guard}.{s.key}: ") and repr(bad) in line, line
        assert "\n" not in line
    with pytest.raises(NodeagentError) as exc:
        parse({"nope": 1}, default)
    assert str(exc.value).startswith(f"config [{guard}] has unknown key 'nope' (known: ")


SAVED_PF = {"pci": "0000:01:00.0", "numvfs": 1, "vfs": []}


def sriov_memory() -> SriovMemory:
    pf = PfMemory(
        saved=saved_pf_from_json(SAVED_PF, "saved"),
        phase="restoring",
        restores=MappingProxyType({0: VfRestore(attempts=1, error="e")}),
    )
    return SriovMemory(MappingProxyType({pf.saved.pci: pf}))


def test_every_memory_field_has_one_row_and_is_saved() -> None:
    doc = SriovGuard().memory_to_json(sriov_memory())
    pf_doc = doc["pfs"]["0000:01:00.0"]
    for table, record, saved in (
        (peermem.MEMORY_FIELDS, PeermemMemory, PeermemGate().memory_to_json(PeermemMemory())),
        (storage.MEMORY_FIELDS, StorageMemory, StorageGuard().memory_to_json(StorageMemory())),
        (sriov.MEMORY_FIELDS, SriovMemory, doc),
        (sriov.PF_FIELDS, PfMemory, pf_doc),
        (sriov.RESTORE_FIELDS, VfRestore, pf_doc["restores"]["0"]),
    ):
        keys = [f.key for f in table]
        assert len(set(keys)) == len(keys)
        assert set(keys) == names(record), f"{record.__name__}: a field without a row"
        assert set(keys) == set(saved), f"{record.__name__}: a row memory_to_json does not write"


def test_memory_round_trips_through_the_tables() -> None:
    mem = PeermemMemory(True, None, 3, 4.5, "x", ("a",))
    assert PeermemGate().memory_from_json(PeermemGate().memory_to_json(mem)) == mem
    smem = StorageMemory(True, True, ("rpcrdma",), True, 2, 1.0, "e")
    assert StorageGuard().memory_from_json(StorageGuard().memory_to_json(smem)) == smem
    doc = json.loads(json.dumps(SriovGuard().memory_to_json(sriov_memory())))
    assert SriovGuard().memory_to_json(SriovGuard().memory_from_json(doc)) == doc


def test_each_memory_row_refuses_a_value_no_field_takes_naming_its_key() -> None:
    bad = [[1]]
    for key in (f.key for f in peermem.MEMORY_FIELDS):
        with pytest.raises(ValueError, match=rf"^peermem memory is malformed: {key} .*\[\[1\]\]"):
            PeermemGate().memory_from_json({key: bad})
    for key in (f.key for f in storage.MEMORY_FIELDS):
        with pytest.raises(ValueError, match=rf"^storage memory is malformed: {key} .*\[\[1\]\]"):
            StorageGuard().memory_from_json({key: bad})
    pf = "0000:01:00.0"
    for table, where in ((sriov.PF_FIELDS, f"{pf}."), (sriov.RESTORE_FIELDS, f"{pf} VF 0: ")):
        for f in table:
            doc = json.loads(json.dumps(SriovGuard().memory_to_json(sriov_memory())))
            record = doc["pfs"][pf] if table is sriov.PF_FIELDS else doc["pfs"][pf]["restores"]["0"]
            record[f.key] = bad
            with pytest.raises(ValueError) as exc:
                SriovGuard().memory_from_json(doc)
            line = str(exc.value)
            assert line.startswith(f"sriov memory: {where}{f.key}") and "\n" not in line, line
            if isinstance(f.kind, fields.Check):
                assert "[[1]]" in line, line


# -- the readers, kind by kind -----------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    seconds: float = 1.0
    count: int = 1
    mode: str = "a"
    on: bool = False
    mods: tuple[str, ...] = ("m",)
    params: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()


KNOBS = (
    fields.Setting("seconds", "seconds", fields.number(0.5, 10)),
    fields.Setting("count", "count", fields.whole(1, 5)),
    fields.Setting("mode", "mode", fields.one_of(("a", "b"))),
    fields.Setting("on", "on", fields.flag),
    fields.Setting("mods", "mods", fields.modules),
    fields.Setting("params", "params", fields.params),
    fields.Setting("roots", "roots", fields.paths),
)


def test_settings_apply_in_order_over_the_current_policy() -> None:
    table = {"seconds": 2, "count": 3, "mode": "b", "on": True, "mods": ["x-y"], "roots": ["a/b"]}
    got = fields.apply_settings("knobs", table, KNOBS, Knobs(params=("p=1",)))
    assert got == Knobs(2.0, 3, "b", True, ("x_y",), ("p=1",), ("a/b",))
    assert isinstance(got.seconds, float)
    # The first bad key in table order is the one named.
    with pytest.raises(NodeagentError, match=r"^config knobs\.seconds: "):
        fields.apply_settings("knobs", {"roots": 1, "seconds": "x"}, KNOBS, Knobs())


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("seconds", "5", "expected a number, got '5'"),
        ("seconds", True, "expected a number, got True"),
        ("seconds", 11, "11 is outside 0.5..10"),
        ("count", 1.5, "expected a whole number, got 1.5"),
        ("count", 0, "0 is outside 1..5"),
        ("mode", "c", "expected 'a' or 'b', got 'c'"),
        ("on", "yes", "expected true or false, got 'yes'"),
        ("mods", [], "expected a non-empty list of module names, got []"),
        ("mods", "m", "expected a non-empty list of module names, got 'm'"),
        ("mods", ["a b"], "invalid kernel module name 'a b'"),
        ("params", "a=1", "expected a list of key=value strings, got 'a=1'"),
        ("params", ["a=$(x)"], "invalid module parameter 'a=$(x)'"),
        ("roots", "a", "expected a list of paths, got 'a'"),
        ("roots", ["/etc"], "'/etc' must be relative to the host root"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key_and_value(
    key: str, value: Any, says: str
) -> None:
    with pytest.raises(NodeagentError) as exc:
        fields.apply_settings("knobs", {key: value}, KNOBS, Knobs())
    line = str(exc.value)
    assert line.startswith(f"config knobs.{key}: ") and says in line and "\n" not in line, line


def test_an_unknown_setting_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(NodeagentError) as exc:
        fields.apply_settings("knobs", {"sconds": 1}, KNOBS, Knobs())
    assert str(exc.value) == (
        "config [knobs] has unknown key 'sconds' "
        "(known: count, mode, mods, on, params, roots, seconds)"
    )


@pytest.mark.parametrize(
    ("kind", "value", "says"),
    [
        (fields.COUNT, "2", "pf.k is '2', not a count"),
        (fields.COUNT, -1, "pf.k is -1, not a count"),
        (fields.COUNT, 1.5, "pf.k is 1.5, not a count"),
        (fields.COUNT, True, "pf.k is True, not a count"),
        (fields.COUNT, 1 << 63, f"pf.k is {1 << 63}, not a count"),
        (fields.COUNT, None, "pf.k is None, not a count"),
        (fields.TIME, "nan", "pf.k is 'nan', not a finite time"),
        (fields.TIME, float("inf"), "pf.k is inf, not a finite time"),
        (fields.TIME, False, "pf.k is False, not a finite time"),
        (fields.optional(fields.TIME), "soon", "pf.k is 'soon', not a finite time"),
        (fields.TEXT, 5, "pf.k is 5, not a string"),
        (fields.BOOL, "yes", "pf.k is not a boolean (got 'yes')"),
        (fields.BOOL, None, "pf.k is not a boolean (got None)"),
        (fields.STRINGS, [1], "pf.k is not a list of strings (got [1])"),
        (fields.STRINGS, "ab", "pf.k is not a list of strings (got 'ab')"),
        (fields.MODULES, ["../x"], "pf.k is not a list of module names (got ['../x'])"),
        (fields.OBJECT, [1], "pf.k is not an object (got [1])"),
        (fields.word(("a", "b")), "c", "pf.k 'c' is not one of a, b"),
        (fields.word(("a", "b")), None, "pf.k None is not one of a, b"),
    ],
)
def test_a_bad_saved_value_is_one_line_naming_the_key_and_value(
    kind: fields.Check, value: Any, says: str
) -> None:
    with pytest.raises(fields.FieldError) as exc:
        fields.read_record({"k": value}, (fields.Saved("k", kind),), "pf.")
    assert isinstance(exc.value, ValueError) and str(exc.value) == says


def test_a_long_saved_value_is_cut_in_the_line() -> None:
    with pytest.raises(fields.FieldError) as exc:
        fields.read_record({"k": "x" * 10_000}, (fields.Saved("k", fields.COUNT),))
    line = str(exc.value)
    assert line.startswith("k is 'xxx") and line.endswith("..., not a count") and len(line) < 110


def test_saved_defaults_nulls_and_unknown_fields() -> None:
    table = (
        fields.Saved("n", fields.COUNT, 0),
        fields.Saved("t", fields.optional(fields.TIME)),
        fields.Saved("why", fields.optional(fields.TEXT, "")),
        fields.Saved("names", fields.STRINGS, []),
        fields.Saved("nested", fields.Custom(lambda v, key: (key, v)), 7),
    )
    assert fields.read_record({}, table, "w.") == {
        "n": 0,
        "t": None,
        "why": "",
        "names": (),
        "nested": ("w.nested", 7),
    }
    got = fields.read_record({"n": 2, "t": 1, "why": None, "names": ["a"], "zz": 1}, table)
    assert got["n"] == 2 and got["t"] == 1.0 and isinstance(got["t"], float)
    assert got["why"] == "" and got["names"] == ("a",)
    # An unknown field is ignored, or refused (the first by name).
    with pytest.raises(fields.FieldError, match=r"^w\.unknown field 'zy'$"):
        fields.read_record({"zz": 1, "zy": 2, "n": 1}, table, "w.", reject_unknown=True)
