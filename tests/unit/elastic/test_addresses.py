"""What a node's processes advertise to other nodes: addresses, never host names."""

from __future__ import annotations

import os

import pytest

from elastic.addresses import GLOO_INTERFACE_ENV, bind_gloo_to, interface_of, url_host
from elastic.in_place.lighthouse import reachable_url


def test_the_lighthouse_is_reached_at_the_address_it_is_bound_to() -> None:
    # torchft advertises the machine's host name, which other nodes may not resolve.
    assert reachable_url("http://vm:39725", "10.78.0.1") == "http://10.78.0.1:39725"
    assert reachable_url("http://etrain-head:8", "fd00::2") == "http://[fd00::2]:8"
    with pytest.raises(ValueError, match="no port"):
        reachable_url("http://vm", "10.78.0.1")


def test_url_hosts_bracket_ipv6_only() -> None:
    assert url_host("127.0.0.1") == "127.0.0.1"
    assert url_host("::1") == "[::1]"


def test_the_interface_holding_an_address_is_found() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here


def test_gloo_is_pointed_at_the_nodes_interface_unless_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert bind_gloo_to("127.0.0.1") == "lo"
    assert GLOO_INTERFACE_ENV in os.environ
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")  # an administrator's choice stays
    assert bind_gloo_to("127.0.0.1") == "eth7"
    monkeypatch.delenv(GLOO_INTERFACE_ENV)
    assert bind_gloo_to("203.0.113.77") is None  # not on this machine: Gloo's own choice
    assert GLOO_INTERFACE_ENV not in os.environ
