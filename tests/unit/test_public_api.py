import warnings

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
