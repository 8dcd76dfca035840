"""Loading a job config: bounded YAML, dot overrides, interpolation, validation, error messages.

    YAML ──OmegaConf (${...}, ${mul:a,b})──> dict ──pydantic──> MasterConfig
       ^ overrides: section.key=value (an existing key) or +section.key=value (a new one)

Guarantees: a bad value fails here, before any service starts, with a message that names the
field. Hostile text cannot exhaust a service: a config is at most MAX_CONFIG_BYTES, nests at most
MAX_CONFIG_DEPTH levels and expands (YAML aliases counted each time they are used) to at most
MAX_CONFIG_NODES values, every integer in it (extra keys and `policy.model` included) is within
±2^53 and every field's integer has its own bound; `parse_config_text` parses off the event loop
within CONFIG_PARSE_SECONDS.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from dockyard.config.master import MasterConfig
from dockyard.config.section import ConfigError

MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_NODES = 20_000
MAX_CONFIG_INT = 1 << 53  # beyond it JSON readers and Lua lose precision
CONFIG_PARSE_SECONDS = 10.0


def _mul(*factors: Any) -> int | float:
    return math.prod(factors)


if not OmegaConf.has_resolver("mul"):
    OmegaConf.register_resolver("mul", _mul)


def _known_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        annotation = field.annotation
        for candidate in getattr(annotation, "__args__", (annotation,)):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                paths |= _known_paths(candidate, f"{path}.")
    return paths


def closest_key(key: str) -> str | None:
    """The config key most like `key` (a typo's likely intent), or None when none is close."""
    known = _known_paths(MasterConfig)
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not match and "." in key:  # a typo in the section: match on the last part under any section
        leaf = key.rsplit(".", 1)[1]
        match = [p for p in difflib.get_close_matches(leaf, [p.rsplit(".", 1)[-1] for p in known], n=1) if p]
        match = [p for p in known if p.rsplit(".", 1)[-1] == match[0]][:1] if match else []
    return match[0] if match else None


def _did_you_mean(key: str) -> str:
    guess = closest_key(key)
    return f" (did you mean {guess}?)" if guess else ""


def _apply_overrides(cfg: Any, overrides: list[str]) -> tuple[Any, list[str]]:
    """The config with the overrides merged in, and the keys added on purpose (`+key=value`)."""
    known = _known_paths(MasterConfig)
    dotlist, added = [], []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, value = item.partition("=")
        add = key.startswith("+")
        key = key.lstrip("+")
        exists = OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None
        if not add and not exists and key not in known:
            raise ConfigError(
                f"override {key!r}: no such key in the config{_did_you_mean(key)}; write +{key}={value} to add it"
            )
        if add:
            added.append(key)
        dotlist.append(f"{key}={value}")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist)), added


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}" if field else message)
    return "invalid job config:\n  " + "\n  ".join(lines)


def parse_config(data: dict[str, Any]) -> MasterConfig:
    try:
        return MasterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def _check_shape(data: Any, origin: str) -> None:
    """Refuse a parsed document that nests too deep, expands too far, refers to itself or holds a huge integer.

    Sizes are memoised by object: an alias shares its anchor's object, so a
    billion-laughs tree is measured in time linear in its text.
    """
    sizes: dict[int, int | None] = {}  # None: being measured (a cycle if met again)

    def size(node: Any, path: str, depth: int) -> int:
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_CONFIG_INT:
            raise ConfigError(f"{origin}: {path or 'the document'}: integer {str(node)[:40]} is beyond ±2^53")
        if not isinstance(node, (dict, list)):
            return 1
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{origin}: {path}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        if id(node) in sizes:
            if sizes[id(node)] is None:
                raise ConfigError(f"{origin}: {path}: a YAML alias refers to a node that contains it")
            return sizes[id(node)]
        sizes[id(node)] = None
        items = node.items() if isinstance(node, dict) else enumerate(node)
        total = 1
        for key, child in items:
            total += size(child, f"{path}.{key}" if path else str(key), depth + 1)
            if total > MAX_CONFIG_NODES:
                raise ConfigError(f"{origin}: expands to more than {MAX_CONFIG_NODES} values (YAML aliases included)")
        sizes[id(node)] = total
        return total

    size(data, "", 0)


def _safe_yaml(text: str, origin: str) -> Any:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{origin}: {size} bytes; a job config is at most {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{origin}: nested too deep to parse") from None
    _check_shape(data, origin)
    return data


# A plain reference inside an interpolation: ${a.b}, ${.sibling}, ${a[0]} (resolver calls ${f:...} hold them).
_REFERENCE = re.compile(r"\$\{([^${}:]+)\}")


def _check_interpolations(raw: Any, origin: str) -> None:
    """Refuse interpolations that would expand past MAX_CONFIG_BYTES (`b: ${a}${a}`, `c: ${b}${b}`, ...):
    each value's expanded length is bounded from its references' without expanding anything."""
    leaves: dict[tuple[str, ...], Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
        if items is None:
            leaves[path] = node
            return
        for key, child in items:
            walk(child, (*path, str(key)))

    walk(raw, ())
    sizes: dict[tuple[str, ...], int] = {}

    def target(path: tuple[str, ...], ref: str) -> tuple[str, ...]:
        ref = ref.strip().replace("[", ".").replace("]", "")
        dots = len(ref) - len(ref.lstrip("."))
        parts = tuple(p for p in ref.lstrip(".").split(".") if p)
        return (*path[: len(path) - dots], *parts) if dots else parts

    def size(path: tuple[str, ...], seen: frozenset) -> int:
        if path in sizes:
            return sizes[path]
        value = leaves.get(path)
        total = len(str(value))
        if isinstance(value, str) and path not in seen:
            total += sum(size(target(path, ref), seen | {path}) for ref in _REFERENCE.findall(value))
        sizes[path] = min(total, MAX_CONFIG_BYTES + 1)
        return sizes[path]

    for path in leaves:
        if size(path, frozenset()) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{origin}: {'.'.join(path)}: interpolations expand past {MAX_CONFIG_BYTES} bytes")


async def parse_config_text(text: str, *, origin: str = "<config>") -> MasterConfig:
    """`load_config_text` in a worker thread, so the event loop keeps serving; ConfigError past CONFIG_PARSE_SECONDS."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(load_config_text, text, origin=origin), CONFIG_PARSE_SECONDS)
    except TimeoutError:
        raise ConfigError(f"{origin}: not parsed within {CONFIG_PARSE_SECONDS:g} s") from None


def load_config_text(
    text: str, overrides: list[str] | None = None, *, origin: str = "<config>", strict: bool = False
) -> MasterConfig:
    """Parse YAML text (within the bounds above), apply overrides, resolve interpolations, validate.

    strict: a key no section defines is a ConfigError naming the closest valid key, unless an
    override added it on purpose (`+section.key=value`); the CLI loads this way, services do not
    (a config that reached them was checked where it was written, and extra keys are kept)."""
    try:
        cfg = OmegaConf.create(_safe_yaml(text, origin) or {})
        cfg, added = _apply_overrides(cfg, overrides or [])
        _check_interpolations(OmegaConf.to_container(cfg, resolve=False), origin)
        data = OmegaConf.to_container(cfg, resolve=True)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: a job config is a mapping of sections")
    config = parse_config(data)
    if strict:
        # An added key makes its unknown section (or itself) deliberate: +loger.x=1 reports `loger`.
        typos = [k for k in config.unknown_keys() if not any(f"{a}.".startswith(f"{k}.") for a in added)]
        if typos:
            raise ConfigError(
                f"{origin}: unknown config key(s):\n  "
                + "\n  ".join(f"{key}{_did_you_mean(key)}" for key in typos)
                + "\n(a key dockyard does not define is added on purpose with the override +section.key=value)"
            )
    return config


def load_config(path: str | Path, overrides: list[str] | None = None, *, strict: bool = False) -> MasterConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    return load_config_text(path.read_text(), overrides, origin=str(path), strict=strict)
