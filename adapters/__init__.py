"""Built-in adapter plugins for jem-plugin (installed as ``jem_adapters``).

Each module is a pluggy plugin implementing ``jem_adapter``; they are registered by
:mod:`jem_plugin.plugins` exactly like third-party plugins.
"""
