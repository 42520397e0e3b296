"""Graph definitions, one package per architecture."""

KNOWN_ARCHS = ("gpt_oss",)
