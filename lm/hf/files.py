"""Reading a Hugging Face model directory: config.json and the safetensors weights (one file or shards)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from lm.errors import UserError


def read_config(directory: str) -> dict:
    """config.json of a model directory, as a dict."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{directory} has no config.json; give a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e.msg})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object; give a Hugging Face model directory")
    return config


def read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors (or of the shards an index names), without a "transformer." prefix."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise UserError(f"{directory} has no {name}; lm reads weights in safetensors format only (never pickled .bin files)")
        try:
            tensors.update(load_file(path))
        except (SafetensorError, TypeError, ValueError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
    return {k.removeprefix("transformer."): v for k, v in tensors.items()}
