"""The old name of ``bundle/paths.py`` ("layout" now means only the KV and parallel layouts), kept
while branches written against it merge."""

from neffbuild.bundle.paths import *  # noqa: F403
