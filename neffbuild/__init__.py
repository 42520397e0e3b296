"""neffbuild: ahead-of-time compile-and-bundle toolchain for LLM decode graphs."""

__version__ = "0.1.0"
