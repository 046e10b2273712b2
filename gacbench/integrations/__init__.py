"""Adapters that put gacbench's hooks into other training frameworks. Each submodule imports its framework
when imported itself (``gacbench.integrations.trl`` needs ``trl``'s ``transformers``); nothing here is
imported by ``import gacbench``."""
