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


def new_directory(out_dir: str) -> None:
    """Make out_dir for an export, refusing a file or a directory with anything in it: a half-overwritten
    model directory is worse than none."""
    if os.path.isfile(out_dir):
        raise UserError(f"{out_dir} is a file; give the path of a new directory to export into")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} already exists and is not empty; give a new directory, or remove that one first")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror or e}") from None
