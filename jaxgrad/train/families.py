"""The families ``jaxgrad train`` knows: name -> the module that provides ``CLI_SCHEMA`` (its ``[model]`` and
``[data]`` keys), ``CLI_TRAIN_DEFAULTS``, ``CLI_FIXED`` (keys that may not change on ``--resume``),
``CLI_OUTPUTS`` (extra files it writes into the run directory), ``needs_x64(cfg)`` and
``cli_task(cfg, out, say) -> (Task, finish)``; optionally ``CLI_KEYS_ADDED`` (``{section: {key: value}}``: keys
added to the schema after runs were saved without them, with the value that keeps such a run's behaviour on
``--resume``).
"""

from __future__ import annotations

import importlib

from jaxgrad.train.errors import ConfigError

FAMILIES = {"kan": "jaxgrad.kan.task", "cnn": "jaxgrad.cnn.task", "lora": "jaxgrad.lora.task"}


def family_module(name: str):
    if name not in FAMILIES:
        raise ConfigError(f"unknown family {name!r} (known: {', '.join(FAMILIES)})")
    return importlib.import_module(FAMILIES[name])
