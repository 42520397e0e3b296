"""Command-line interface: one module per command group, errors mapped to exit codes in main.py."""
