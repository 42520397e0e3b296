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


@pytest.fixture(scope="session")
def tiny_recipe():
    from neffbuild import recipe

    return recipe.load(TINY)


@pytest.fixture(scope="session")
def tiny_cfg(tiny_recipe):
    return tiny_recipe.model.config


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_cfg):
    """A random GptOssForCausalLM saved by transformers (safetensors), non-degenerate weights."""
    import torch
    import transformers

    from neffbuild.models.gpt_oss.weights import random_state_dict

    folder = tmp_path_factory.mktemp("hf_tiny")
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**tiny_cfg.to_hf_dict()))
    missing, unexpected = model.load_state_dict(random_state_dict(tiny_cfg, seed=0), strict=True)
    assert not missing and not unexpected
    model.save_pretrained(folder)
    return folder
