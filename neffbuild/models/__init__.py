"""Graph definitions, one package per architecture (each named once, in neffbuild/registry.py)."""
