"""LoRA adapters on disk: what the config names, what an adapters folder holds, their ranks
and sizes. Pure file reads, no event loop: the config, the footprint estimate and the request
path's discovery all use it.

An adapter is a PEFT folder: ``adapter_config.json`` (its rank ``r``, with ``rank_pattern``
overriding it per module) and the weights (``adapter_model.safetensors``, or ``.bin``). vLLM
loads one at run time from its path (``POST /v1/load_lora_adapter``); the proxy only reads
these two things to size the engine (``--max-lora-rank``) and its memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .names import carriable

#: The ranks vLLM accepts for ``--max-lora-rank`` (vLLM 0.33 ``config/lora.py``
#: ``MaxLoRARanks``); an adapter's rank is rounded up to the next one.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's default ``--max-lora-rank``: used when no adapter's rank is known at load.
DEFAULT_RANK = 16
#: Adapters one engine keeps registered when ``max_adapters`` is not set (and no ``max_loras``).
DEFAULT_MAX_ADAPTERS = 4
#: What marks a folder as an adapter.
ADAPTER_CONFIG = "adapter_config.json"
#: Files that hold an adapter's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
#: An adapters folder with more entries than this is listed only this far (``/v1/models``).
LIST_LIMIT = 1000
MIB = 1024 * 1024


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter of a model: the name clients send as ``model``, the path vLLM loads it from
    (absolute for a local folder, else a Hugging Face repo id), its other names, and whether
    it was configured or found in ``adapters_dir``."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    discovered: bool = False


def is_local(path: str) -> bool:
    """A local folder (an absolute, home or relative path, or one that exists), as vLLM's
    ``get_adapter_absolute_path`` tells them from a hub repo id."""
    return path.startswith(("/", "~", ".")) or os.path.exists(path)


def local_path(path: str) -> str:
    """`path` made absolute when it is a local folder (vLLM resolves relative paths against
    its own working directory, not the proxy's); a hub repo id as it is."""
    return str(Path(path).expanduser().resolve()) if is_local(path) else path


def rank_of(path: str) -> int | None:
    """The adapter's largest rank (``r`` and every ``rank_pattern`` value, as vLLM checks it
    against ``--max-lora-rank``); None when its ``adapter_config.json`` cannot be read."""
    try:
        data = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    ranks = [data.get("r")]
    pattern = data.get("rank_pattern")
    if isinstance(pattern, dict):
        ranks += list(pattern.values())
    found = [int(r) for r in ranks if isinstance(r, int | float) and not isinstance(r, bool)]
    return max(found) if found else None


def vllm_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for ``--max-lora-rank`` that holds `rank`."""
    for allowed in VLLM_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_RANKS[-1]})")


def size_bytes(path: str) -> int:
    """The adapter's weight files on disk (0 when not a readable local folder)."""
    try:
        with os.scandir(path) as entries:
            return sum(
                e.stat().st_size
                for e in entries
                if e.name.endswith(WEIGHT_SUFFIXES) and e.is_file()
            )
    except OSError:
        return 0


def valid_folder_name(name: str) -> bool:
    """Whether a requested name can be a folder directly inside an adapters folder (no path
    separators, no hidden or parent entries): a client's ``model`` never walks the disk. A name
    HAProxy could not carry (names.py: ``;``, blanks, ``#``...) is no adapter either."""
    return (
        0 < len(name) <= 255
        and carriable(name)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not name.startswith(".")
    )


def find_in(folder: str, name: str) -> AdapterSpec | None:
    """The adapter called `name` in `folder` (a sub-folder with ``adapter_config.json``). A
    symbolic link is followed only to a folder inside `folder`, and the engine is given the
    folder it leads to (a link changed later changes nothing already checked)."""
    if not valid_folder_name(name):
        return None
    path = os.path.join(folder, name)
    try:
        if os.path.islink(path):
            root = os.path.join(os.path.realpath(folder), "")
            path = os.path.realpath(path)
            if not path.startswith(root):
                return None
        if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            return None
    except (OSError, ValueError):  # (a name that is no file name: a lone surrogate)
        return None
    return AdapterSpec(name, path, discovered=True)


def list_folder(folder: str, limit: int = LIST_LIMIT) -> list[AdapterSpec]:
    """Every adapter in `folder` (sorted by name, at most `limit`); empty when unreadable.
    Only sub-folders and links are looked into: other entries (files) cost no system call
    (their type comes with the listing). Blocks on the disk: call it in a thread."""
    try:
        with os.scandir(folder) as entries:
            names = sorted(
                e.name for e in entries if e.is_symlink() or e.is_dir(follow_symlinks=False)
            )
    except OSError:
        return []
    found = []
    for name in names:
        spec = find_in(folder, name)
        if spec is not None:
            found.append(spec)
            if len(found) >= limit:
                break
    return found


def largest_rank(adapters: list[AdapterSpec]) -> int | None:
    """The largest known rank among `adapters` (None: none known)."""
    ranks = [r for r in (rank_of(a.path) for a in adapters) if r is not None]
    return max(ranks) if ranks else None


def largest_sizes_mb(adapters: list[AdapterSpec], count: int) -> int:
    """The `count` largest adapters' weight files together, in MiB."""
    sizes = sorted((size_bytes(a.path) for a in adapters), reverse=True)[:count]
    return math.ceil(sum(sizes) / MIB)


def slots_mb(
    arch: dict[str, Any], slots: int, rank: int, tp: int = 1, dtype_bytes: float = 2
) -> int:
    """GPU memory vLLM preallocates for `slots` adapters of rank `rank` (``--max-loras`` x
    ``--max-lora-rank``) on each of `tp` devices, for a Llama-shaped decoder: every layer's
    q, k, v, o, gate, up and down projections get an A (rank x in) and a B (out x rank) per
    slot, so per layer and rank ``9 h + 2 kv + 3 i`` elements (h: hidden size, kv: key/value
    width, i: MLP width). An estimate: other architectures wrap other modules."""
    layers = int(arch.get("num_hidden_layers") or 0)
    hidden = int(arch.get("hidden_size") or 0)
    heads = int(arch.get("num_attention_heads") or 1)
    kv_heads = int(arch.get("num_key_value_heads") or heads)
    head_dim = int(arch.get("head_dim") or (hidden // heads if heads else 0))
    inner = int(arch.get("intermediate_size") or 4 * hidden)
    per_rank = 9 * hidden + 2 * kv_heads * head_dim + 3 * inner
    return math.ceil(slots * rank * layers * per_rank * dtype_bytes / max(tp, 1) / MIB)
