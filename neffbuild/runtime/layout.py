"""The old name of ``runtime/paths.py`` ("layout" now means only the KV and parallel layouts), kept
while branches written against it merge."""

from neffbuild.runtime.paths import *  # noqa: F403
