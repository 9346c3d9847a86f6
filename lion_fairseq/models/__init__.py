"""Importing this package registers every LION model and arch with fairseq (each module registers its
own). fairseq's ``--user-dir`` also imports these files itself, under the same module names, so
nothing registers twice."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
