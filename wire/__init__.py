"""Shared pieces of gpumgr: the manager ⇄ agent wire protocol, units, errors and defaults."""
