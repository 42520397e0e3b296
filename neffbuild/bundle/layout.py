"""Bundle layout constants. They live in ``neffbuild.runtime.layout`` so the thin reader can
use them without importing the build side; this module re-exports them for the writer."""

from neffbuild.runtime.layout import *  # noqa: F403
from neffbuild.runtime.layout import __doc__ as _spec  # noqa: F401
