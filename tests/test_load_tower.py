"""The vision tower loaded alone (what an encoder worker of issue 58 runs): for every family, the same embeddings as
the whole model's tower, and no weight of the language model held."""

from __future__ import annotations

import pytest
import torch
from conftest import random_image
from test_families import PARITY_FAMILIES

from fovea.models.loader import load_model, load_tower
from fovea.multimodal.patchify import patchify
from fovea.multimodal.prompt import PromptProcessor


@pytest.mark.parametrize("family", ["qwen2.5-vl", *PARITY_FAMILIES])
def test_the_tower_alone_gives_the_whole_models_embeddings(family, family_dirs, tiny_dirs):
    model_dir = tiny_dirs["tiny-3b"] if family == "qwen2.5-vl" else family_dirs[family]
    whole, _ = load_model(model_dir, dtype="float32")
    tower, config = load_tower(model_dir, dtype="float32")
    assert config == whole.config
    theirs = {name: param for name, param in whole.named_parameters() if name.startswith("visual.")}
    mine = dict(tower.named_parameters())
    assert mine.keys() == {name.removeprefix("visual.") for name in theirs}  # the tower's, nothing else
    assert all(torch.equal(mine[name.removeprefix("visual.")], param) for name, param in theirs.items())
    image = PromptProcessor(model_dir, config).image_processor(random_image(150, 100, seed=2))
    patches = patchify(torch.from_numpy(image.pixels), config.image)
    with torch.no_grad():
        assert torch.equal(tower(patches, [image.grid_thw]), whole.visual(patches, [image.grid_thw]))
