"""Bundle path and marker constants. They live in ``neffbuild.runtime.bundle.paths`` so the thin reader can
use them without importing the build side; this module re-exports them for the writer."""

from neffbuild.runtime.bundle.paths import *  # noqa: F403
from neffbuild.runtime.bundle.paths import __doc__ as _spec  # noqa: F401
