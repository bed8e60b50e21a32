"""The demo's upload rules: which names an upload may take, where it may land, and how much uploads may hold.

Safe upload names, placing an upload without replacing a corpus file, the manifest that records which files
of a corpus folder were uploaded, and the documents/bytes quota check. The Library applies them under its lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import unicodedata
from pathlib import Path

from epic_rag.corpus import DOC_SUFFIXES

from .config import DemoConfig

log = logging.getLogger(__name__)

_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")
NAME_MAX_BYTES = 255  # a file name's limit on every common file system, in bytes (not characters)


class QuotaExceeded(ValueError):
    """An upload that would take the uploads past their quota (documents or bytes): nothing is written."""


class NameTaken(ValueError):
    """An upload named like a corpus file: uploads never replace the user's own files; nothing is written."""


# Characters that make a name display as something it is not (review E): explicit bidi marks, embeddings,
# overrides and isolates (U+202E shows "evil\u202etxt.exe" as "evilexe.txt"), and line/paragraph separators.
# Other format characters stay allowed: ZWNJ (U+200C) is part of ordinary Persian words.
_MISLEADING = frozenset("\u061c\u200e\u200f\u2028\u2029") | {chr(c) for c in range(0x202A, 0x202F)}
_MISLEADING |= {chr(c) for c in range(0x2066, 0x206A)}


def private_dir(path: Path) -> Path:
    """`path` as a folder only its owner can list or enter (0700), created with its parents where missing."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid():  # ours but open to others (an older version made it)
        path.chmod(0o700)
    return path


def safe_upload_name(name: object) -> str:
    """The basename an upload is stored under; ValueError for names that could escape the folder.

    Rejects NUL and other control characters (C0, C1), bidi controls and line separators, absolute paths,
    any '..' component and hidden names;
    keeps only the last path component of a relative name ('notes/a.txt' -> 'a.txt')."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("file name is empty")
    if len(name) > 255:
        raise ValueError("file name is longer than 255 characters")
    if any(unicodedata.category(ch) == "Cc" for ch in name):  # C0, DEL and C1
        raise ValueError("file name contains NUL or control characters")
    if any(ch in _MISLEADING for ch in name):
        raise ValueError("file name contains bidirectional or line-separator characters")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ValueError("file name is not valid Unicode text") from None
    if name.startswith(("/", "\\")) or _WINDOWS_DRIVE.match(name):
        raise ValueError("file name must not be an absolute path")
    parts = re.split(r"[/\\]", name)
    if any(p == ".." for p in parts):
        raise ValueError("file name must not contain '..'")
    base = parts[-1].strip()
    if not base or base.startswith("."):
        raise ValueError("file name must be a plain, non-hidden file name")
    if len(base.encode()) > NAME_MAX_BYTES:  # 130 accented letters are 260 bytes: a file system refuses them
        raise ValueError(f"file name is longer than {NAME_MAX_BYTES} bytes in UTF-8")
    if Path(base).suffix.lower() not in DOC_SUFFIXES:
        raise ValueError(
            f"unsupported file type {Path(base).suffix or '(none)'}; supported: {', '.join(sorted(DOC_SUFFIXES))}"
        )
    return base


def is_upload_name(name: str) -> bool:
    try:
        return safe_upload_name(name) == name
    except ValueError:
        return False


def place_upload(tmp: str, path: Path, replaces: bool) -> None:
    """Move the written upload to `path`: over an earlier upload of that name, or where nothing is, never
    over another file (a link fails on an existing name, checked and made in one step)."""
    if replaces:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise NameTaken(
            f"{path.name} is a file of the corpus folder; uploads never replace it (rename the upload)"
        ) from None
    except OSError:  # no hard links on this file system: checked, then moved
        if path.exists():
            raise NameTaken(
                f"{path.name} is a file of the corpus folder; uploads never replace it (rename the upload)"
            ) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def check_quota(uploads: dict[str, int], name: str, size: int, cfg: DemoConfig) -> None:
    """QuotaExceeded when keeping this upload (replacing one of the same name in `uploads`, name -> bytes)
    would exceed the quotas."""
    replaced = uploads.get(name)
    docs = len(uploads) + (replaced is None)
    total = sum(uploads.values()) - (replaced or 0) + size
    if docs > cfg.max_documents:
        raise QuotaExceeded(f"upload quota reached: {cfg.max_documents} documents; delete some first")
    if total > cfg.max_upload_total_bytes:
        raise QuotaExceeded(f"upload quota reached: {cfg.max_upload_total_bytes} bytes; delete some first")


class UploadManifest:
    """Which files of a corpus folder were uploaded (name -> bytes): that is not in the folder, so it is kept
    in the data folder, one manifest per corpus folder, and the quotas survive a restart."""

    def __init__(self, data_dir: Path, corpus_dir: Path) -> None:
        self.data_dir, self.corpus_dir = data_dir, corpus_dir
        tag = hashlib.sha256(str(corpus_dir).encode()).hexdigest()[:16]
        self.path = data_dir / f"uploads-{tag}.json"

    def load(self) -> dict[str, int]:
        """The uploads recorded (name -> bytes); empty where there is none."""
        try:
            raw = json.loads(self.path.read_text())
            uploads = raw["uploads"]
            if not isinstance(uploads, dict):
                raise ValueError("uploads is not an object")
            return {str(k): int(v) for k, v in uploads.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("upload manifest %s unreadable (%s): earlier uploads count as corpus files", self.path, e)
            return {}

    def save(self, uploads: dict[str, int]) -> None:
        """Write the manifest whole or not at all (a temp file, then os.replace), owner-only."""
        private_dir(self.data_dir)
        fd, tmp = tempfile.mkstemp(dir=self.data_dir, prefix=".uploads-", suffix=".part")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"corpus": str(self.corpus_dir), "uploads": uploads}, f, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
