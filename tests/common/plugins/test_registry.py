import pytest

from fleetrl.common.plugins.registry import Registry, RegistryError


def test_register_lookup_and_errors():
    reg: Registry = Registry("widget", config_key="section.widget")

    @reg.register("alpha", "a")
    def alpha():
        return 1

    assert reg["alpha"] is alpha and reg["a"] is alpha and "alpha" in reg and len(reg) == 2
    with pytest.raises(RegistryError, match="widget 'alpha' is already registered"):
        reg.register("alpha")(lambda: 2)
    with pytest.raises(RegistryError) as e:
        reg["alpah"]
    assert str(e.value) == "section.widget: unknown widget 'alpah' (did you mean 'alpha'?); valid names: a, alpha"
    assert reg.names() == ["a", "alpha"]
