"""Secrets out of text that reaches logs or clients: the password of any URL (a Redis store spec)."""

from __future__ import annotations

import re

_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s'\"]*):[^@\s'\"]*@", re.IGNORECASE)


def redact(text: object) -> str:
    """str(text) with every 'scheme://user:password@' written 'scheme://user:***@'."""
    return _URL_PASSWORD.sub(r"\1:***@", str(text))
