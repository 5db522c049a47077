"""Plugin manager: built-ins registered like plugins, run-time registration, entry points, disabling."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import jem_plugin as jem
from jem_plugin import plugins


@pytest.fixture
def fresh_manager(monkeypatch):
    """A new plugin manager for the test, so entry points are read again."""
    monkeypatch.setattr(plugins, "_pm", None)
    yield
    plugins._pm = None


def test_builtins_are_registered_as_plugins():
    rows = {r["name"]: r for r in jem.list_plugins()}
    for name in (
        "jem_adapters.generic",
        "jem_adapters.timm_adapter",
        "jem_adapters.torchvision_adapter",
        "jem_adapters.huggingface",
    ):
        assert rows[name]["builtin"] and "jem_adapter" in rows[name]["hooks"]


class OverrideAdapter:
    """A third-party plugin that claims every nn.Linear, before the generic adapter."""

    @jem.hookimpl
    def jem_adapter(self, model, options):
        if isinstance(model, torch.nn.Linear):
            return jem.Adapter("mine", jem.InputDomain.from_range(0, 1), num_classes=model.out_features)
        return None


def test_register_overrides_adapter_choice():
    plugin = OverrideAdapter()
    jem.register(plugin, name="override-test")
    try:
        jm = jem.wrap(torch.nn.Linear(4, 3))
        assert jm.adapter.name == "mine" and jm.domain.low == (0.0,)
        assert any(r["name"] == "override-test" for r in jem.list_plugins())
    finally:
        jem.unregister(name="override-test")
    assert jem.wrap(torch.nn.Linear(4, 3)).adapter.name == "generic"


def _fake_distribution(tmp_path, monkeypatch):
    """Install a throwaway distribution on sys.path exposing a `jem` entry point."""
    (tmp_path / "fake_jem_plugin.py").write_text(
        textwrap.dedent("""
        import torch
        import jem_plugin as jem

        @jem.hookimpl
        def jem_adapter(model, options):
            if isinstance(model, torch.nn.Linear):
                return jem.Adapter("from-entry-point", num_classes=model.out_features)
    """)
    )
    info = tmp_path / "fake_jem_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-jem-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[jem]\nfake = fake_jem_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_jem_plugin", raising=False)


def test_entry_point_plugin_is_loaded_and_listed(tmp_path, monkeypatch, fresh_manager):
    _fake_distribution(tmp_path, monkeypatch)
    monkeypatch.delenv(plugins.DISABLE_ENV, raising=False)
    assert jem.wrap(torch.nn.Linear(4, 3)).adapter.name == "from-entry-point"
    row = next(r for r in jem.list_plugins() if r["name"] == "fake")
    assert row["hooks"] == ["jem_adapter"] and not row["builtin"] and row["version"] == "0.3"


@pytest.mark.parametrize("value", ["1", "fake", "other,fake"])
def test_env_var_disables_external_plugins(tmp_path, monkeypatch, fresh_manager, value):
    _fake_distribution(tmp_path, monkeypatch)
    monkeypatch.setenv(plugins.DISABLE_ENV, value)
    assert jem.wrap(torch.nn.Linear(4, 3)).adapter.name == "generic"
    assert all(r["name"] != "fake" for r in jem.list_plugins())


def test_collect_later_registration_wins():
    class Scores:
        @jem.hookimpl
        def jem_register_ood_scores(self, register):
            register("test-only-score", lambda jm, x: x.sum(), description="x")

    jem.register(Scores(), name="scores-test")
    try:
        entries = plugins.collect("jem_register_ood_scores")
        assert entries["test-only-score"]["description"] == "x"
        with pytest.raises(jem.UnknownNameError, match="available: .*test-only-score"):
            plugins.lookup("jem_register_ood_scores", "nope", "OOD score")
    finally:
        jem.unregister(name="scores-test")


def test_collect_goes_through_pluggy_no_argument_hooks_load_and_later_plugins_override_builtins():
    calls = []

    class NoArguments:  # legal pluggy: an implementation may take fewer arguments than the spec
        @jem.hookimpl
        def jem_register_ood_scores(self):
            calls.append("called")

    def mine(jm, x):
        return torch.full((x.shape[0],), 7.0)

    class Override:
        @jem.hookimpl
        def jem_register_ood_scores(self, register):
            register("logpx", mine, needs_grad=False, description="replaced")

    builtin = plugins.lookup("jem_register_ood_scores", "logpx", "OOD score")["item"]
    jem.register(NoArguments(), name="no-args-test")
    jem.register(Override(), name="override-logpx-test")
    try:
        assert plugins.lookup("jem_register_ood_scores", "logpx", "OOD score")["item"] is mine
        assert calls == ["called"]
        jm = jem.wrap(torch.nn.Linear(3, 2), input_size=(3,))
        assert jem.ood.score(jm, torch.zeros(4, 3), "logpx", progress=False).tolist() == [7.0] * 4
        assert "msp" in jem.ood.available_scores()  # the other built-ins are still there
    finally:
        jem.unregister(name="override-logpx-test")
        jem.unregister(name="no-args-test")
    assert plugins.lookup("jem_register_ood_scores", "logpx", "OOD score")["item"] is builtin
