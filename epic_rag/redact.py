"""Secrets out of text that reaches logs or clients: the password of any URL (a Redis store spec) and the
value of any credential-like option (a store's `secret=` HMAC key, `password=`, `token=`, `api_key=`)."""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s'\"]*):[^@\s'\"]*@", re.IGNORECASE)
_OPTION = re.compile(r"\b(secret|password|passwd|token|api[_-]?key|access[_-]?key)=[^&\s'\"]*", re.IGNORECASE)


def redact(text: object) -> str:
    """str(text) with every 'scheme://user:password@' written 'scheme://user:***@' and every credential
    option 'secret=value' written 'secret=***'."""
    return _OPTION.sub(r"\1=***", _URL_PASSWORD.sub(r"\1:***@", str(text)))
