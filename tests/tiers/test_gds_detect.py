"""GDS detection against stand-in kvikio packages laid out as each kvikio release is: 24.x
(``kvikio.defaults.compat_mode()``, the submodule imported with the package), 25.x
(``is_compat_mode_preferred()``), and 26.x, whose package no longer imports ``kvikio.defaults``
(on a real H200 this read ``AttributeError: module 'kvikio' has no attribute 'defaults'`` and
turned GDS off)."""

from __future__ import annotations

import sys

import pytest

from tiers import gds
from tiers.gpu import GPUInfo

LAYOUTS = {
    "24.x": ("from kvikio import defaults\n", "def compat_mode():\n    return {compat}\n"),
    "25.x": ("from kvikio import defaults\n", "def is_compat_mode_preferred():\n    return {compat}\n"),
    "26.x": ("", "def is_compat_mode_preferred():\n    return {compat}\n"),
}


@pytest.fixture
def fake_kvikio(tmp_path, monkeypatch):
    def make(layout: str, compat: bool):
        init, defaults = LAYOUTS[layout]
        pkg = tmp_path / layout / "kvikio"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(init)
        (pkg / "defaults.py").write_text(defaults.format(compat=compat))
        monkeypatch.syspath_prepend(str(pkg.parent))
        for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(gds, "gpu_info", lambda: GPUInfo(True, 1, True, True, ""))
        gds.gds_info.cache_clear()
    yield make
    gds.gds_info.cache_clear()
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        del sys.modules[name]              # the stand-ins; monkeypatch then puts back what was there


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("compat", [True, False])
def test_every_kvikio_layout_is_read(fake_kvikio, layout, compat):
    fake_kvikio(layout, compat)
    assert gds.gds_info() == gds.GDSInfo(True, "compat" if compat else "gds", "")


def test_unreadable_settings_turn_gds_off_with_the_reason(fake_kvikio, tmp_path):
    fake_kvikio("26.x", True)
    (tmp_path / "26.x" / "kvikio" / "defaults.py").write_text("raise RuntimeError('no cuFile driver')\n")
    info = gds.gds_info()
    assert not info.available and "no cuFile driver" in info.reason
