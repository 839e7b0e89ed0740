"""The emulated hosts' plan: names Linux accepts, one address per host, a token bucket on every limited link."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp.errors import ConfigError
from hetdp.hosts.topology import (
    INTERFACE,
    Names,
    Site,
    Topology,
    address,
    build_commands,
    fill_placeholders,
    links_to_remove,
    owner_of,
    parse_site,
)

sites = st.lists(st.builds(Site, hosts=st.integers(1, 5),
                           rate_mbit=st.none() | st.floats(1, 10_000),
                           uplink_rate_mbit=st.none() | st.floats(1, 10_000)), min_size=1, max_size=4)


def created(commands: list[list[str]]) -> list[str]:
    """The interfaces and namespaces the commands add."""
    return [command[3] for command in commands if "add" in command[:3]]


@given(sites, st.integers(0, 10**7 - 1))
def test_every_name_fits_linux_and_is_known_by_its_owner(site_list, owner):
    topology, names = Topology(sites=tuple(site_list)), Names(owner)
    made = created(build_commands(topology, names))
    assert len(made) == len(set(made))
    assert all(len(name) <= 15 and owner_of(name) == owner for name in made)
    # what teardown deletes covers every interface made in the root namespace (a namespace's own go with it)
    namespaces = {names.namespace(host) for host in range(topology.host_count)}
    peers = {names.uplink(site, "c") for site in range(len(topology.sites))}
    assert set(made) - namespaces - peers == set(links_to_remove(topology, names))


@given(sites)
def test_each_limited_link_gets_a_token_bucket_in_each_direction(site_list):
    topology = Topology(sites=tuple(site_list))
    buckets = [command for command in build_commands(topology, Names(1)) if command[0] == "tc"]
    limited_hosts = sum(site.hosts for site in topology.sites if site.rate_mbit is not None)
    limited_uplinks = sum(site.uplink_rate_mbit is not None for site in topology.sites) if topology.joined else 0
    assert len(buckets) == 2 * (limited_hosts + limited_uplinks)
    assert all("tbf" in command and int(command[command.index("burst") + 1]) >= 16_000 for command in buckets)


def test_hosts_are_numbered_across_sites_and_each_has_its_own_address():
    topology = Topology(sites=(Site(hosts=2), Site(hosts=3, uplink_rate_mbit=50)))
    assert [topology.site_of(host) for host in range(5)] == [0, 0, 1, 1, 1]
    assert [address(host) for host in range(5)] == [f"10.44.0.{k}" for k in range(1, 6)]
    commands = build_commands(topology, Names(7))
    assert ["ip", "link", "set", "hdp7h3", "master", "hdp7s1", "up"] in commands
    assert ["tc", "qdisc", "replace", "dev", "hdp7u1s", "root", "tbf", "rate", "50mbit", "burst", "16000",
            "latency", "100ms"] in commands
    assert ["ip", "-n", "hdp7n4", "addr", "add", "10.44.0.5/24", "dev", INTERFACE] in commands


@pytest.mark.parametrize(("text", "site"), [
    ("2", Site(hosts=2)),
    ("2:100", Site(hosts=2, rate_mbit=100)),
    ("2::50", Site(hosts=2, uplink_rate_mbit=50)),
    ("3:-:10", Site(hosts=3, uplink_rate_mbit=10)),
])
def test_a_site_is_parsed_from_hosts_rate_and_uplink(text, site):
    assert parse_site(text) == site


@pytest.mark.parametrize(("text", "message"), [
    ("x", "a site looks like HOSTS[:RATE_MBIT[:UPLINK_MBIT]]"),
    ("2:1:2:3", "a site looks like"),
    ("0", "a site needs at least one host, got hosts=0"),
    ("2:0", "rate_mbit must be a positive number of Mbit/s"),
    ("2::inf", "uplink_rate_mbit must be a positive number"),
])
def test_a_bad_site_is_one_config_error_naming_it(text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_site(text)


def test_placeholders_give_each_host_its_number_and_the_meeting_address():
    topology = Topology.flat(3)
    command = ["run", "--node-rank", "{node}", "--nnodes", "{nodes}", "{master_addr}:29500", "--bind={addr}"]
    assert fill_placeholders(command, 2, topology) == ["run", "--node-rank", "2", "--nnodes", "3", "10.44.0.1:29500",
                                                       "--bind=10.44.0.3"]
