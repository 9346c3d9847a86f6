"""Importing this package registers every LION criterion with fairseq (each module registers its own).
fairseq's ``--user-dir`` imports only ``models/`` and ``tasks/`` itself, so the package's
``__init__`` imports this one."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
