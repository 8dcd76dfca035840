"""Redis URLs with passwords: one place that reads the password, masks it, and explains a refusal.

    DOCKYARD_<SVC>_REDIS_URL            redis://[user[:password]@]host:port/db  (rediss:// for TLS)
    DOCKYARD_<SVC>_REDIS_PASSWORD       the password, kept out of the URL, or
    DOCKYARD_<SVC>_REDIS_PASSWORD_FILE  a file holding it (a mounted secret); surrounding whitespace dropped

Guarantees: a password is given in at most one of the three places (two are
refused, as is a missing or empty file); `mask_url` never returns a password;
`RedisAuthError` names the URL masked and says which variables to set, never
the password. Any service with a Redis setting uses these helpers, so every
service masks and refuses alike.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

MASK = "***"


class RedisConfigError(RuntimeError):
    """A Redis setting is unusable. Not a ValueError: pydantic would echo the input (the password)."""


class RedisAuthError(RuntimeError):
    """Redis refused to authenticate: a wrong, missing or unexpected password."""


def url_password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def _replace_password(url: str, password: str | None) -> str:
    """`url` with its password replaced by `password` (None: dropped, the user kept); `url` if it has none."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    userinfo = f"{user}:{password}@" if password is not None else (f"{user}@" if user else "")
    netloc = userinfo + host + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def mask_url(url: str) -> str:
    """`url` with its password replaced by ***, e.g. redis://:***@redis:6379/0."""
    try:
        return _replace_password(url, MASK)
    except ValueError:
        return "<unparsable redis url>"


def without_password(url: str) -> str:
    """`url` with no password in it (its user, if any, kept): what may be shown to clients."""
    return _replace_password(url, None)


def mask_secret(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` replaced by ***."""
    return text.replace(secret, MASK) if secret else text


def read_password(url: str, password: str, password_file: str, variable: str) -> str | None:
    """The password to send besides the URL, or None (none, or it is inside the URL).

    `variable` is the settings' name for the password, e.g. DOCKYARD_BUFFER_REDIS_PASSWORD;
    its file variant is `variable` + _FILE.
    """
    given = [name for name, value in ((variable, password), (f"{variable}_FILE", password_file)) if value]
    if url_password(url):
        given.append(variable.removesuffix("_PASSWORD") + "_URL (its password)")
    if len(given) > 1:
        raise RedisConfigError(f"give the Redis password in one place only, not in {' and '.join(given)}")
    if password_file:
        path = Path(password_file)
        try:
            value = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise RedisConfigError(f"{variable}_FILE={path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RedisConfigError(f"{variable}_FILE={path}: cannot read it ({type(exc).__name__})") from None
        if not value:
            raise RedisConfigError(f"{variable}_FILE={path}: the file is empty")
        return value
    return password or None


def explain_auth_failure(url: str, password: str | None, variable: str, error: Exception) -> RedisAuthError:
    """A RedisAuthError for redis-py's AuthenticationError, masked and saying what to set."""
    has_password = password is not None or url_password(url) is not None
    reason = mask_secret(mask_secret(str(error), password), url_password(url))
    if not has_password:
        hint = (
            f"it requires a password: set {variable} or {variable}_FILE, or put it in the URL (redis://:PASSWORD@host)"
        )
    elif "no password is set" in reason or "without any password configured" in reason:
        hint = f"it has no password configured: unset {variable}(_FILE) and the URL's password"
    else:
        hint = "it refused the password (wrong password, or the user is disabled)"
    return RedisAuthError(f"Redis at {mask_url(url)}: {hint}; Redis said: {reason}")
