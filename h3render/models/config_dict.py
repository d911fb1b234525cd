"""Reading a component's `config.json` into its config dataclass (shared by the DiT and both VAEs)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def config_fields(cls: type, data: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The entries of `data` that are fields of dataclass `cls`; lists become tuples (configs are frozen).

    Keys starting with `_` (diffusers' `_class_name`, `_diffusers_version`) are ignored.

    Raises:
        ValueError: a key that is not a field of `cls`, naming `what` (e.g. "video VAE config.json").
    """
    names = {f.name for f in dataclasses.fields(cls)}
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}")
    return {k: _frozen(v) for k, v in data.items()}


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value
