"""Naming a synchronization: the names the drop-in and ``hetdp run --sync`` take, and one ConfigError for the rest."""

import pytest

from hetdp import Allreduce, ConfigError, LocalAveraging, Partial
from hetdp.sync.policy import sync_policy


@pytest.mark.parametrize(
    ("spec", "policy"),
    [
        ("allreduce", Allreduce()),
        ("solo", Partial(mode="solo")),
        ("majority", Partial(mode="majority")),
        ("quorum:3", Partial(mode="quorum", quorum=3)),
        ("local", LocalAveraging()),
        ("local:4", LocalAveraging(every=4)),
    ],
)
def test_a_name_gives_its_policy(spec, policy):
    assert sync_policy(spec) == policy


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("never", "sync must be allreduce, solo, majority, quorum:K"),
        ("solo:2", "sync must be allreduce"),
        ("quorum", "expected quorum:K with K a positive integer"),
        ("quorum:0", "expected quorum:K"),
        ("local:x", "expected local:K"),
        (3, "sync must be a name or hetdp.Allreduce"),
    ],
)
def test_a_bad_name_is_one_config_error_saying_what_would_be_right(spec, message):
    with pytest.raises(ConfigError, match=message):
        sync_policy(spec)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [({"every": -1}, "every must be an integer"), ({"every": 1.5}, "every must be an integer"),
     ({"mode": "eager"}, "mode must be one of"), ({"mode": "quorum"}, "quorum")],
)
def test_bad_partial_settings_are_config_errors(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Partial(**settings)
