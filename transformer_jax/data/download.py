"""Checksummed downloads into a cache directory: nothing unverified or partial is ever left under the final name.

A download streams into a temporary file next to its destination while hashing, checks the SHA-256 digest, and
only then renames the file into place (an atomic rename on one file system). Any failure removes the temporary
file, so a later run either finds a complete, verified file or downloads again.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import http.client
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from absl import logging

from transformer_jax.errors import DataError

CHUNK_BYTES = 1 << 16


@contextlib.contextmanager
def atomic_write(dest: Path):
    """Yields a temporary path next to `dest`; renames it onto `dest` only if the block finishes without error."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def download(url: str, dest: Path, sha256: str, *, timeout: float = 60.0) -> Path:
    """Downloads `url` to `dest` unless `dest` exists; the file appears only once its SHA-256 equals `sha256`."""
    dest = Path(dest)
    if dest.exists():
        return dest
    logging.info("downloading %s to %s", url, dest)
    with atomic_write(dest) as tmp:
        digest = hashlib.sha256()
        received = 0
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                expected = response.headers.get("Content-Length")
                while chunk := response.read(CHUNK_BYTES):
                    f.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
        except (http.client.IncompleteRead, ConnectionError) as e:
            raise DataError(f"download of {url} was interrupted after {received} bytes ({e}); nothing was kept") from e
        except urllib.error.HTTPError as e:
            raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise DataError(
                f"cannot download {url}: {getattr(e, 'reason', e)}. Without internet access, put the files in place "
                "by hand or point the config at local files (data.source=text, data.text_dir=...)"
            ) from e
        # A server that closes early without an error still sent fewer bytes than it announced.
        if expected is not None and received != int(expected):
            raise DataError(f"download of {url} was interrupted after {received} of {expected} bytes; nothing was kept")
        if digest.hexdigest() != sha256:
            raise DataError(
                f"checksum mismatch for {dest.name} from {url}: expected sha256 {sha256}, got {digest.hexdigest()}; "
                "the file was not kept (a changed upstream file or a corrupted transfer)"
            )
    return dest


def gunzip(src: Path, dest: Path) -> Path:
    """Decompresses the gzip file `src` into `dest` atomically; returns `dest`."""
    with atomic_write(dest) as tmp:
        try:
            with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, CHUNK_BYTES)
        except (OSError, EOFError) as e:
            raise DataError(f"cannot decompress {src}: {e}") from e
    return dest
