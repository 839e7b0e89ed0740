import hetdp


def test_every_public_name_imports_and_all_is_sorted():
    for name in hetdp.__all__:
        assert getattr(hetdp, name) is not None, name
    assert hetdp.__all__ == sorted(hetdp.__all__)
