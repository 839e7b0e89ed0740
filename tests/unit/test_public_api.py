import warnings

import pytest

import hetdp


def test_every_public_name_imports_and_all_is_sorted():
    for name in hetdp.__all__:
        assert getattr(hetdp, name) is not None, name
    assert hetdp.__all__ == sorted(hetdp.__all__)


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
