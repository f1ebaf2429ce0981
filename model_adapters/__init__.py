"""Model families, one file each (see docs/adding-a-model.md).

Each module declares a ``toolkit.adapters.Family`` subclass decorated with
``toolkit.adapters.register``. ``toolkit.adapters.registry`` imports every module of this package
on its first lookup, so adding a family is adding one file. Nothing here is imported by the core.
"""
