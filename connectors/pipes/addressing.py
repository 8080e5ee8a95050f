"""Which local address a KV endpoint binds and advertises, chosen on the node itself.

A cluster config never names one address for every node: it may name an interface (``eth1``)
or a network (``10.0.0.0/16``) to pick the fast network on multi-homed nodes, and each node
applies that rule to its own interfaces. With neither, the node's own address as the cluster
knows it (Ray's node IP) is used, so whatever reaches the node for Ray reaches its KV endpoint.
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Callable

AddressTable = dict[str, list[str]]  # interface name -> its IPv4/IPv6 addresses


def local_addresses() -> AddressTable:
    """Every interface of this node with its IP addresses (link-local IPv6 left out)."""
    import psutil

    table: AddressTable = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%", 1)[0] for a in addrs
               if a.family in (socket.AF_INET, socket.AF_INET6)]
        table[name] = [ip for ip in ips if not ipaddress.ip_address(ip).is_link_local]
    return table


def select_address(*, host: str | None = None, interface: str | None = None,
                   cidr: str | None = None, default: str | None = None,
                   addresses: Callable[[], AddressTable] = local_addresses) -> str:
    """The address to bind, by the first rule given: ``interface``, ``cidr``, ``host``, then
    ``default`` (the caller's node IP), then the address of this host's default route.

    ValueError names the rule and what this node has, so a launch error is actionable.
    """
    if interface:
        table = addresses()
        if interface not in table:
            raise ValueError(f"kv_transfer.interface: no interface {interface!r} on "
                             f"{socket.gethostname()} (has: {_describe(table)})")
        v4 = [ip for ip in table[interface] if ":" not in ip]
        if not (v4 or table[interface]):
            raise ValueError(f"kv_transfer.interface: {interface!r} on {socket.gethostname()} "
                             f"has no IP address")
        return (v4 or table[interface])[0]
    if cidr:
        try:
            network = parse_cidr(cidr)
        except ValueError as e:
            raise ValueError(f"kv_transfer.cidr: {e}") from None
        table = addresses()
        for ips in table.values():
            for ip in ips:
                if ipaddress.ip_address(ip) in network:
                    return ip
        raise ValueError(f"kv_transfer.cidr: no address of {socket.gethostname()} is in "
                         f"{cidr} (has: {_describe(table)})")
    if host:
        return host
    return default or route_address()


def parse_cidr(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError as e:
        raise ValueError(str(e)) from None


def route_address() -> str:
    """This host's address on its default route (a UDP connect sends no packet), or loopback
    when it has none (a single machine with no network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: a route lookup only, nothing is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _describe(table: AddressTable) -> str:
    return ", ".join(f"{name}={'/'.join(ips) or '-'}" for name, ips in sorted(table.items()))
