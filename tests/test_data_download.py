"""Checksummed downloads against a local HTTP server: success and reuse, corrupt file, interrupted transfer."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import threading
from pathlib import Path

import pytest

from configs import common
from transformer_jax.data import sources
from transformer_jax.errors import DataError


class Server:
    """Serves `files` (path -> bytes) on 127.0.0.1; `truncate` paths send half the body, then close."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.truncate: set[str] = set()
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in server.truncate:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def fake_multi30k() -> tuple[dict[str, bytes], dict[str, str], dict[str, str]]:
    """Gzip files named like the upstream ones, their digests, and the text each should decompress to."""
    files, digests, texts = {}, {}, {}
    for split, stem in sources.MULTI30K_SPLITS.items():
        for lang in ("en", "de"):
            text = "".join(f"{split} {lang} sentence {i} \u00e4\u2028x\n" for i in range(50))
            body = gzip.compress(text.encode("utf-8"), mtime=0)
            files[f"/{stem}.{lang}.gz"] = body
            digests[f"{stem}.{lang}.gz"] = hashlib.sha256(body).hexdigest()
            texts[f"{split}.{lang}"] = text
    return files, digests, texts


@pytest.fixture
def server():
    files, digests, texts = fake_multi30k()
    s = Server(files)
    s.digests, s.texts = digests, texts
    yield s
    s.close()


@pytest.fixture
def fake_digests(server, monkeypatch):
    monkeypatch.setattr(sources, "MULTI30K_SHA256", server.digests)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.is_file())


def test_fetch_then_reuse_without_requests(server, fake_digests, tmp_path):
    folder = sources.fetch_multi30k(tmp_path, base_url=server.url)
    assert len(server.requests) == 6
    for name, text in server.texts.items():
        assert (folder / name).read_text(encoding="utf-8") == text
    pairs, skipped = sources.read_text_split(folder, "valid", "de", "en")
    assert (
        skipped == 0
        and len(pairs) == 50
        and pairs[3] == ("valid de sentence 3 \u00e4\u2028x", "valid en sentence 3 \u00e4\u2028x")
    )
    sources.fetch_multi30k(tmp_path, base_url=server.url)
    assert len(server.requests) == 6, "the second call must reuse the cache"
    assert not [n for n in leftovers(tmp_path) if n.endswith(".part")]


def test_checksum_mismatch_names_file_and_digests_and_keeps_nothing(server, fake_digests, tmp_path):
    good = server.digests["val.de.gz"]
    server.files["/val.de.gz"] = gzip.compress(b"tampered\n", mtime=0)
    bad = hashlib.sha256(server.files["/val.de.gz"]).hexdigest()
    with pytest.raises(DataError) as e:
        sources.fetch_multi30k(tmp_path, base_url=server.url)
    message = str(e.value)
    assert "val.de.gz" in message and good in message and bad in message
    assert "valid.de" not in leftovers(tmp_path) and "val.de.gz" not in leftovers(tmp_path)
    assert not [n for n in leftovers(tmp_path) if n.endswith(".part")]


def test_interrupted_download_leaves_no_partial_file(server, tmp_path):
    body = server.files["/train.en.gz"]
    server.truncate.add("/train.en.gz")
    dest = tmp_path / "train.en.gz"
    with pytest.raises(DataError, match="interrupted"):
        sources.download(server.url + "train.en.gz", dest, hashlib.sha256(body).hexdigest())
    assert leftovers(tmp_path) == []
    # Once the server behaves, the same call succeeds.
    server.truncate.clear()
    sources.download(server.url + "train.en.gz", dest, hashlib.sha256(body).hexdigest())
    assert dest.read_bytes() == body and leftovers(tmp_path) == ["train.en.gz"]


def test_http_error_and_unreachable_host_are_clear(server, tmp_path):
    with pytest.raises(DataError, match="HTTP 404"):
        sources.download(server.url + "missing.gz", tmp_path / "missing.gz", "0" * 64)
    with pytest.raises(DataError, match="cannot download"):
        sources.download("http://127.0.0.1:9/x.gz", tmp_path / "x.gz", "0" * 64, timeout=5)
    assert leftovers(tmp_path) == []


def test_multi30k_source_prefers_shared_copy(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "multi30k").mkdir(parents=True)
    for split in sources.MULTI30K_SPLITS:
        for lang in ("en", "de"):
            (shared / "multi30k" / f"{split}.{lang}").write_text(f"{split} {lang}\n", encoding="utf-8")
    monkeypatch.setenv(sources.DATA_ENV, str(shared))

    def no_network(*args, **kwargs):
        raise AssertionError("must not download when the shared copy exists")

    monkeypatch.setattr(sources, "download", no_network)
    config = common.data_config()
    config.source, config.cache_dir = "multi30k", str(tmp_path / "cache")
    assert sources.load_split(config, "test") == [("test en", "test de")]


@pytest.mark.parametrize("local", ["unset", "without multi30k"])
def test_multi30k_source_without_a_local_copy_downloads_into_the_cache(tmp_path, monkeypatch, local):
    if local == "unset":
        monkeypatch.delenv(sources.DATA_ENV, raising=False)
    else:
        (tmp_path / "corpora").mkdir()
        monkeypatch.setenv(sources.DATA_ENV, str(tmp_path / "corpora"))
    fetched = []

    def fetch(cache, **kwargs):
        fetched.append(Path(cache))
        folder = Path(cache) / "multi30k"
        folder.mkdir(parents=True)
        for lang in ("en", "de"):
            (folder / f"test.{lang}").write_text(f"downloaded {lang}\n", encoding="utf-8")
        return folder

    monkeypatch.setattr(sources, "fetch_multi30k", fetch)
    config = common.data_config()
    config.source, config.cache_dir = "multi30k", str(tmp_path / "cache")
    assert sources.load_split(config, "test") == [("downloaded en", "downloaded de")]
    assert fetched == [tmp_path / "cache"]
