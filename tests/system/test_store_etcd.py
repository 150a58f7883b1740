"""The store contract (kits.store_contract) on a real etcd server, skipped when etcd is not
installed."""

from __future__ import annotations

import pytest

from shoal.coordinator.etcd_store import EtcdStore, EtcdTarget

from kits.etcdserver import etcd_server  # noqa: F401 - the fixture
from kits.store_contract import *  # noqa: F401,F403 - the contract's tests, run on make_store


@pytest.fixture
def make_store(etcd_server):  # noqa: F811 - the fixture imported above
    target = EtcdTarget.parse(etcd_server.url())
    opened = []

    def make():
        s = EtcdStore(target)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
