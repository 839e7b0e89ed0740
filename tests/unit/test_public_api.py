import warnings

import pytest

import hetdp


def test_every_public_name_is_hetdp_s_own_documented_definition_and_all_is_sorted():
    for name in hetdp.__all__:
        value = getattr(hetdp, name)
        assert value.__module__.startswith("hetdp."), name  # not a name hetdp merely passes on
        assert (value.__doc__ or "").strip(), name  # the reference renders its docstring
        assert name == value.__name__ or name in ALIASES, name
    assert hetdp.__all__ == sorted(hetdp.__all__)


ALIASES = {"DDP"}
"""Public names that are another public name's second name (``hetdp.DDP`` is ``hetdp.DistributedDataParallel``)."""


def test_public_names_import_without_a_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in hetdp.__all__:
            getattr(hetdp, name)


@pytest.mark.parametrize("name", sorted(hetdp._DEPRECATED))
def test_a_name_that_left_the_public_api_still_works_and_names_its_replacement(name):
    module, replacement = hetdp._DEPRECATED[name]
    assert name not in hetdp.__all__
    with pytest.warns(DeprecationWarning, match=f"hetdp.{name} is deprecated.*use "):
        value = getattr(hetdp, name)
    assert value is getattr(__import__(module, fromlist=[name]), name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        hetdp.Nothing  # noqa: B018
