import copy
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"

os.environ.setdefault("NEFFBUILD_CACHE_DIR", str(ROOT / ".ci-cache"))


@pytest.fixture
def tiny_raw():
    return copy.deepcopy(yaml.safe_load(TINY.read_text()))
