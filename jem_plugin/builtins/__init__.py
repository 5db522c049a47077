"""Built-in plugins: OOD scores, SGLD initial distributions, loss terms and PGD negatives (DAT).

Each module here is an ordinary pluggy plugin, registered by :mod:`jem_plugin.plugins` through
the same hooks a third-party plugin implements (the built-in adapters live in the top-level
``adapters/`` package, installed as ``jem_adapters``). The core never imports these modules; it
finds what they register by name through the hooks.
"""
