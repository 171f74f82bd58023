"""Holders-first removal order, checked against the dependency shape of the real storage chain."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.core.modgraph import RemovalBlocked, holders_closure, pulled_in, removal_order
from tests.snapshots import loaded

# As seen on Debian 6.1 under QEMU: `rmmod rdma_cm` -> "in use by: rpcrdma ib_srpt
# nvme_rdma nvmet_rdma ib_isert"; ib_core held by nearly everything above it.
CHAIN = {
    "ib_core": (
        "ib_cm",
        "iw_cm",
        "rdma_cm",
        "ib_uverbs",
        "rpcrdma",
        "nvme_rdma",
        "nvmet_rdma",
        "ib_isert",
        "ib_srpt",
        "rdma_rxe",
    ),
    "ib_cm": ("rdma_cm", "ib_srpt"),
    "iw_cm": ("rdma_cm",),
    "rdma_cm": ("rpcrdma", "ib_srpt", "nvme_rdma", "nvmet_rdma", "ib_isert"),
    "ib_uverbs": ("rdma_rxe",),
    "rdma_rxe": (),
    "sunrpc": ("rpcrdma",),
    "rpcrdma": (),
    "nvme_fabrics": ("nvme_rdma",),
    "nvme_core": ("nvme_fabrics", "nvme_rdma"),
    "nvme_rdma": (),
    "nvmet": ("nvmet_rdma",),
    "nvmet_rdma": (),
    "iscsi_target_mod": ("ib_isert",),
    "target_core_mod": ("iscsi_target_mod", "ib_isert", "ib_srpt"),
    "ib_isert": (),
    "ib_srpt": (),
}


def graph(edges: dict[str, tuple[str, ...]]):
    return {name: loaded(name, None, holders=h) for name, h in edges.items()}


def test_storage_chain_comes_out_holders_first() -> None:
    mods = graph(CHAIN)
    order = removal_order(mods, CHAIN)
    pos = {n: i for i, n in enumerate(order)}
    for name, holders in CHAIN.items():
        for h in holders:
            assert pos[h] < pos[name], f"{h} must go before {name}"
    assert order[-1] == "ib_core"
    assert sorted(order) == sorted(CHAIN)


def test_removal_refuses_when_held_from_outside() -> None:
    mods = graph(CHAIN)
    with pytest.raises(RemovalBlocked) as exc:
        removal_order(mods, ["rdma_cm", "iw_cm"])
    assert str(exc.value) == (
        "rdma_cm is held by ib_isert, ib_srpt, nvme_rdma, nvmet_rdma, rpcrdma (not being removed)"
    )


def test_holders_closure_finds_everything_above() -> None:
    mods = graph(CHAIN)
    assert holders_closure(mods, ["rdma_cm"]) == {
        "rdma_cm",
        "rpcrdma",
        "ib_srpt",
        "nvme_rdma",
        "nvmet_rdma",
        "ib_isert",
    }
    assert holders_closure(mods, ["not_loaded"]) == set()


def test_pulled_in_is_what_was_not_there_before() -> None:
    mods = graph(CHAIN)
    before = ["sunrpc", "nvme_core"]
    assert pulled_in(before, mods, ["rpcrdma"]) == set(CHAIN) - {"sunrpc", "nvme_core"}


@given(st.data())
def test_property_any_dag_yields_a_valid_order(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 12))
    names = [f"m{i}" for i in range(n)]
    # holders only from higher indices: a DAG, as the kernel guarantees
    edges = {
        names[i]: tuple(data.draw(st.sets(st.sampled_from(names[i + 1 :]))) if i + 1 < n else ())
        for i in range(n)
    }
    order = removal_order(graph(edges), names)
    pos = {m: i for i, m in enumerate(order)}
    assert all(pos[h] < pos[m] for m, hs in edges.items() for h in hs)
