"""The ``jaxgrad train`` configuration: a TOML file, ``--set section.key=value`` overrides, a typed schema.

A configuration has the sections ``[train]`` (:class:`~jaxgrad.train.config.TrainConfig`'s fields), ``[model]``
and ``[data]`` (the family's schema, e.g. :data:`jaxgrad.kan.task.CLI_SCHEMA`). Every key is typed by the schema;
an unknown section or key, a value of the wrong type or outside its choices, a missing or malformed file raise
:class:`~jaxgrad.train.errors.ConfigError` with one line naming the file or option and the key. TOML has no null:
an optional key (``int?``) is unset by leaving it out, or with ``--set key=none``.

``--set`` values are parsed as TOML values (``--set train.lr=3e-4``, ``--set model.widths=[2,5,1]``); a bare word
that is not a TOML value is a string (``--set model.backend=pallas``). A key without a section (``--set lr=1e-3``)
is accepted when exactly one section has it.
"""

from __future__ import annotations

import pathlib
import tomllib
from typing import Any

from jaxgrad.train.config import TrainConfig, train_config_fields
from jaxgrad.train.errors import ConfigError

# kind: "int", "float", "bool", "str", "ints", "strs", or alternatives joined by "|" ("strs|str": a list of strings
# or one string); a trailing "?" allows None (unset)
Spec = tuple  # (kind, default) or (kind, default, choices)

_TRAIN_KINDS = {"steps": "int", "optimizer": "str", "lr": "float?", "schedule": "str", "warmup_steps": "int",
                "weight_decay": "float", "momentum": "float", "lbfgs_memory": "int", "linesearch": "str",
                "lbfgs_warmup_steps": "int", "lbfgs_warmup_lr": "float?",
                "accumulate": "int", "clip_norm": "float?", "nan_policy": "str", "max_consecutive_skips": "int",
                "grad_path": "str", "seed": "int",
                "param_dtype": "str?", "compute_dtype": "str?", "output_dtype": "str?", "devices": "int?",
                "checkpoint_every": "int", "keep": "int", "log_every": "int", "eval_every": "int",
                "print_every": "int"}

# [train] keys that define the optimiser state's structure or the data order: fixed on --resume
TRAIN_FIXED = ("seed", "accumulate", "optimizer", "schedule", "warmup_steps", "clip_norm", "lbfgs_memory",
               "linesearch", "lbfgs_warmup_steps", "param_dtype")


def train_schema() -> dict[str, Spec]:
    return {k: (_TRAIN_KINDS[k], v) for k, v in train_config_fields().items()}


_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
          "ints": "a list of integers", "strs": "a list of strings"}
_OK = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
       "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
       "ints": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
       "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}


def _type_name(kind: str) -> str:
    name = " or ".join(_NAMES[b] for b in kind.rstrip("?").split("|"))
    return name + (" (or none)" if kind.endswith("?") else "")


def check_value(where: str, key: str, spec: Spec, value: Any) -> Any:
    """``value`` converted to the schema's kind, or a ConfigError naming ``where`` and ``key``."""
    kind = spec[0]
    if value is None:
        if kind.endswith("?"):
            return None
        raise ConfigError(f"{where}: '{key}' must be {_type_name(kind)}, got none")
    base = kind.rstrip("?")
    if not any(_OK[b](value) for b in base.split("|")):
        raise ConfigError(f"{where}: '{key}' must be {_type_name(kind)}, got {value!r}")
    if base == "float":
        value = float(value)
    if len(spec) > 2 and value not in spec[2]:
        raise ConfigError(f"{where}: '{key}' must be one of {list(spec[2])}, got {value!r}")
    return value


def defaults(schema: dict[str, dict[str, Spec]]) -> dict[str, dict]:
    return {sec: {k: spec[1] for k, spec in keys.items()} for sec, keys in schema.items()}


def load_file(path: str | pathlib.Path) -> dict:
    p = pathlib.Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory; expected a TOML config file")
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ConfigError(f"{p}: cannot be read ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:  # TOML is UTF-8; tomllib would let the decode error escape
        line = data[:err.start].count(b"\n") + 1
        raise ConfigError(f"{p}: not valid TOML (not UTF-8: byte 0x{data[err.start]:02x} on line {line}; a TOML "
                          f"file must be UTF-8 encoded)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{p}: not valid TOML ({err})") from None


def apply_table(cfg: dict, table: dict, schema: dict, where: str) -> None:
    """Merge a parsed TOML table into ``cfg`` (checked against ``schema``)."""
    for sec, body in table.items():
        if sec not in schema:
            raise ConfigError(f"{where}: unknown section [{sec}] (known: {', '.join(f'[{s}]' for s in schema)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: '{sec}' must be a [{sec}] table, got {body!r}")
        for key, value in body.items():
            if key not in schema[sec]:
                raise ConfigError(f"{where}: unknown key '{sec}.{key}' (known in [{sec}]: "
                                  f"{', '.join(schema[sec])})")
            cfg[sec][key] = check_value(where, f"{sec}.{key}", schema[sec][key], value)


def _parse_value(text: str):
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(cfg: dict, assignment: str, schema: dict) -> tuple[str, str]:
    """Apply one ``--set key=value``; returns the resolved ``(section, key)``."""
    where = f"--set {assignment}"
    if "=" not in assignment:
        raise ConfigError(f"{where}: expected key=value, e.g. train.lr=1e-3")
    key, text = (s.strip() for s in assignment.split("=", 1))
    if "." in key:
        sec, name = key.split(".", 1)
        if sec not in schema or name not in schema[sec]:
            raise ConfigError(f"{where}: unknown key '{key}'")
    else:
        owners = [s for s in schema if key in schema[s]]
        if len(owners) != 1:
            raise ConfigError(f"{where}: " + (f"unknown key '{key}'" if not owners else
                                              f"'{key}' is in {', '.join(f'[{s}]' for s in owners)}; write "
                                              f"{owners[0]}.{key}"))
        sec, name = owners[0], key
    cfg[sec][name] = check_value(where, f"{sec}.{name}", schema[sec][name], _parse_value(text))
    return sec, name


def resolve(schema: dict, config_file: str | None, overrides: list[str], base: dict | None = None,
            set_keys: list[str] | None = None) -> dict:
    """Defaults (or ``base``, a saved run's config) <- the file <- the ``--set`` overrides. ``set_keys``: a list
    that receives ``"section.key"`` of every override (in order)."""
    cfg = {sec: dict(v) for sec, v in (base or defaults(schema)).items()}
    if config_file is not None:
        apply_table(cfg, load_file(config_file), schema, str(config_file))
    for a in overrides:
        sec, name = apply_override(cfg, a, schema)
        if set_keys is not None:
            set_keys.append(f"{sec}.{name}")
    return cfg


def resolve_resume(schema: dict, saved: dict, earlier_sets: list[str], config_file: str | None,
                   overrides: list[str]) -> tuple[dict, list[str], list[str]]:
    """``--resume``: the run's saved configuration <- the file <- the ``--set`` overrides.

    ``earlier_sets``: the keys (``"section.key"``) set with ``--set`` by the commands that started and resumed the
    run. Such a key keeps its saved value against the file, as it did against the file in the command that set it
    (the same file passed again restores nothing the user overrode); a file value that differs is reported in a
    note, and ``--set`` changes it. Keys added to the schema since the run was saved take their defaults.
    Returns ``(cfg, set_keys, notes)``: ``set_keys`` is ``earlier_sets`` plus this command's, for the run file.
    """
    cfg = defaults(schema)
    apply_table(cfg, saved, schema, "the run's saved configuration (run.json)")
    earlier = list(dict.fromkeys(earlier_sets))
    notes = []
    if config_file is not None:
        table = load_file(config_file)
        from_file = {sec: dict(v) for sec, v in cfg.items()}
        apply_table(from_file, table, schema, str(config_file))
        for sec, body in table.items():
            for key in body:
                name, value, kept = f"{sec}.{key}", from_file[sec][key], cfg[sec][key]
                if name in earlier and value != kept:
                    notes.append((name, f"note: {config_file} has {name} = {value!r}, but the run was given --set "
                                        f"{name}={kept!r}, which is kept (--set outranks the file); change it with "
                                        f"--set"))
                else:
                    cfg[sec][key] = value
    sets: list[str] = []
    cfg = resolve(schema, None, overrides, base=cfg, set_keys=sets)
    return cfg, list(dict.fromkeys(earlier + sets)), [msg for name, msg in notes if name not in sets]


def changed_keys(old: dict, new: dict) -> list[str]:
    """``section.key: old -> new`` for every key whose value differs."""
    return [f"{sec}.{k}: {old.get(sec, {}).get(k)!r} -> {v!r}" for sec, body in new.items() for k, v in body.items()
            if old.get(sec, {}).get(k) != v]


def train_config(cfg: dict, where: str = "[train]") -> TrainConfig:
    try:
        return TrainConfig(**cfg["train"])
    except ValueError as err:
        raise ConfigError(f"{where}: {str(err).replace(chr(39), chr(39) + 'train.', 1).replace('train config: ', '')}") \
            from None


def changed_fixed_keys(saved: dict, new: dict, fixed: dict[str, tuple[str, ...] | str]) -> list[str]:
    """``section.key: old -> new`` for every fixed key that differs (``fixed[sec]`` = keys, or ``"*"``: all)."""
    out = []
    for sec, keys in fixed.items():
        names = sorted(set(saved.get(sec, {})) | set(new.get(sec, {}))) if keys == "*" else keys
        for k in names:
            a, b = saved.get(sec, {}).get(k), new.get(sec, {}).get(k)
            if a != b:
                out.append(f"{sec}.{k}: {a!r} -> {b!r}")
    return out


def to_toml(cfg: dict) -> str:
    """The resolved configuration as TOML (unset optional keys as comments)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = []
    for sec, body in cfg.items():
        lines.append(f"[{sec}]")
        for k, v in body.items():
            lines.append(f"# {k} unset" if v is None else f"{k} = {val(v)}")
        lines.append("")
    return "\n".join(lines)
