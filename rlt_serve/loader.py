"""Checkpoint I/O for local Hugging Face-format model directories.

Everything reads from disk only (nothing is downloaded). Errors name the file and, where it
matters, the tensor key, because a broken checkpoint is otherwise a long hunt through shards.
Tensors are read one at a time through `safe_open`, so loading a model holds one copy of its
weights, not a file's worth plus a module's worth.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class CheckpointError(ValueError):
    """A model directory whose weights cannot be read as asked."""


@contextmanager
def _open(path: str) -> Iterator[Any]:
    """`safe_open` whose failures (truncated header, bad JSON, I/O) name the file."""
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    with handle as f:
        yield f


def _read(f: Any, path: str, key: str) -> torch.Tensor:
    try:
        return f.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read tensor {key!r} ({e})") from e


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from e


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """Map every tensor key to the absolute path of the file that holds it.

    A single `model.safetensors` wins over an index, as in transformers' loader.
    """
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: model directory not found")
    single = os.path.abspath(os.path.join(model_dir, SINGLE_FILE))
    if os.path.isfile(single):
        with _open(single) as f:
            return {key: single for key in f.keys()}
    index = os.path.abspath(os.path.join(model_dir, INDEX_FILE))
    if not os.path.isfile(index):
        raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: missing or empty 'weight_map'")
    files: dict[str, str] = {}
    for key, shard in weight_map.items():
        path = os.path.abspath(os.path.join(model_dir, str(shard)))
        if not os.path.isfile(path):
            raise CheckpointError(f"{index}: shard {shard!r} (holding {key!r}) not found at {path}")
        files[key] = path
    return files


def _where(files: dict[str, str], model_dir: str) -> str:
    shards = sorted({os.path.basename(p) for p in files.values()})
    return f"{os.path.abspath(model_dir)} ({', '.join(shards) or 'no files'})"


def _by_file(keys: Iterable[str], files: dict[str, str], model_dir: str) -> dict[str, list[str]]:
    """Group keys by shard so each file is opened once; unknown keys fail before any read."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        if key not in files:
            raise CheckpointError(f"tensor {key!r} not found in checkpoint {_where(files, model_dir)}")
        grouped.setdefault(files[key], []).append(key)
    return grouped


def load_state_dict(
    model_dir: str,
    keys: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read `keys` (default: all) from the checkpoint; floating tensors are cast to `dtype`."""
    files = checkpoint_files(model_dir)
    wanted = list(files) if keys is None else list(keys)
    out: dict[str, torch.Tensor] = {}
    for path, names in _by_file(wanted, files, model_dir).items():
        with _open(path) as f:
            present = set(f.keys())
            for key in names:
                if key not in present:
                    raise CheckpointError(f"{path}: tensor {key!r} not found (the index says it is here)")
                t = _read(f, path, key)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[key] = t.to(device)
    return {key: out[key] for key in wanted}


def _alias_groups(module: torch.nn.Module) -> dict[str, list[str]]:
    """state_dict name -> every name sharing its tensor (tied weights), so one stored copy fills all."""
    by_id: dict[int, list[str]] = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(name)
    for name, t in module.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def load_into_module(
    module: torch.nn.Module, model_dir: str, dtype: torch.dtype, device: str | torch.device
) -> list[str]:
    """Fill every state_dict entry of `module` from the checkpoint by name; return unused keys.

    Works on a module built on the `meta` device: tensors are assigned, not copied into
    preallocated storage. Shapes are checked from the file header before any data is read.
    """
    expected = module.state_dict()
    files = checkpoint_files(model_dir)
    aliases = _alias_groups(module)
    source: dict[str, str] = {}  # module name -> checkpoint key that fills it
    for name in expected:
        found = [n for n in aliases.get(name, [name]) if n in files]
        if not found:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {_where(files, model_dir)}")
        source[name] = found[0]

    users: dict[str, list[str]] = {}  # checkpoint key -> module names it fills
    for name, key in source.items():
        users.setdefault(key, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, keys in _by_file(sorted(users), files, model_dir).items():
        with _open(path) as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{path}: tensor {key!r} not found (the index says it is here)")
                got = list(f.get_slice(key).get_shape())
                for name in users[key]:
                    want = list(expected[name].shape)
                    if got != want:
                        raise CheckpointError(
                            f"{path}: tensor {key!r} has shape {got}, the model expects {want} for {name!r}"
                        )
                t = _read(f, path, key)
                t = t.to(device=device, dtype=dtype if t.is_floating_point() else expected[users[key][0]].dtype)
                for name in users[key]:
                    state[name] = t
    module.load_state_dict(state, strict=True, assign=True)
    return sorted(set(files) - set(users))


def save_checkpoint(
    model_dir: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None
) -> None:
    """Write tensors as `model.safetensors`, or as HF-style shards plus an index when they
    exceed `max_shard_bytes`. Earlier weight files in `model_dir` are removed so the directory
    never holds two disagreeing checkpoints."""
    os.makedirs(model_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(name):
            os.remove(os.path.join(model_dir, name))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(model_dir, SINGLE_FILE), metadata=meta)
        return
    n = len(shards)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, os.path.join(model_dir, name), metadata=meta)
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(model_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def load_generation_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's generation defaults (`generation_config.json`), or {} when it has none."""
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
