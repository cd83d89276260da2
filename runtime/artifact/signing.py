"""This installation's signing key: how a runtime knows that compiled code in an artifact was built here.

Compiled pieces and kernel modules are code. A runtime runs them only when this installation
built them, or when the user says to trust them (`--trust-compiled`). "Built here" is an
HMAC-SHA256 of the bundle's document (which lists every bundle file's SHA-256) under a key that
never enters an artifact:

1. `key_path()`: `$HGC_HOME/signing.key`, else `$XDG_CONFIG_HOME/hgc/signing.key`, else
   `~/.config/hgc/signing.key`.
2. `signing_key(create=True)` (a build): the key, made on first use from 32 random bytes, in a
   file only its owner may read or write (0600). A key file others may read is refused: anyone
   who reads it can sign code this runtime would then run.
3. `sign(payload, key)` gives {"hmac_sha256", "key_id"}; `verify(payload, signature, key)` checks it
   in constant time. `key_id` (a hash of the key) lets a refusal say whether the bundle was made
   by another key, without revealing either.

What it does not do: decide what to load (runtime/artifact/bundle.py) or hash files (the loader does).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

__all__ = ["SigningKeyError", "key_path", "signing_key", "sign", "verify", "key_id"]


class SigningKeyError(RuntimeError):
    pass


def key_path() -> Path:
    if os.environ.get("HGC_HOME"):
        return Path(os.environ["HGC_HOME"]) / "signing.key"
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config / "hgc" / "signing.key"


def signing_key(create: bool = False) -> bytes | None:
    """This installation's key; None when it has none (and `create` is False)."""
    path = key_path()
    if not path.exists():
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another build made it first: use theirs
            return signing_key(create=False)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SigningKeyError(f"{path}: the signing key may be read or written by others (mode "
                              f"{stat.S_IMODE(mode):o}); `chmod 600 {path}`, then rebuild the bundles it signed")
    key = path.read_bytes()
    if len(key) < 32:
        raise SigningKeyError(f"{path}: the signing key is {len(key)} bytes (expected 32); delete it and rebuild")
    return key


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"hgc signing key id\0" + key).hexdigest()[:16]


def sign(payload: bytes, key: bytes) -> dict:
    return {"hmac_sha256": hmac.new(key, payload, hashlib.sha256).hexdigest(), "key_id": key_id(key)}


def verify(payload: bytes, signature, key: bytes) -> bool:
    if not isinstance(signature, dict) or not isinstance(signature.get("hmac_sha256"), str):
        return False
    return hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).hexdigest(), signature["hmac_sha256"])
