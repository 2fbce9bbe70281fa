"""Datasets for the notebooks' tasks, read from a data directory (or downloaded once).

    data_dir = find_data_dir(args.data_dir)            # --data-dir, else ../shared/data beside the repo
    train = read_imdb(data_dir, "train")               # [(text, label)], label 1 = positive

Readers accept the layouts users have: the packed IMDB copy in ``../shared/data/imdb``
(gzipped JSON lines, see its README.txt), the original ``aclImdb/{train,test}/{pos,neg}``
folders, or a CSV with ``text`` and ``label`` columns; the sentence-polarity files; a
plain text file. ``download`` fetches an archive into a cache with a progress bar,
checks its SHA-256, writes to a temporary name and renames, and unpacks it safely.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
IMDB_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"


def find_data_dir(data_dir=None) -> Path | None:
    """``data_dir`` if given (it must exist), else ``../shared/data`` beside the repo when present."""
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"--data-dir {path} does not exist")
        return path
    shared = REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def _label(value) -> int:
    text = str(value).strip().lower()
    if text in ("1", "pos", "positive"):
        return 1
    if text in ("0", "neg", "negative"):
        return 0
    raise ValueError(f"unknown sentiment label {value!r} (expected 0/1, neg/pos, negative/positive)")


def read_imdb(data_dir, split: str) -> list[tuple[str, int]]:
    """IMDB reviews of ``split`` ("train" or "test") as (text, label), negatives first, each sorted by id.

    Looks for, in order: ``imdb/{split}-{neg,pos}-*.jsonl.gz``; ``aclImdb/{split}/{neg,pos}/*.txt``;
    ``imdb/{split}.csv`` or ``{split}.csv`` with ``text`` and ``label`` columns.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir)
    packed = sorted((root / "imdb").glob(f"{split}-*.jsonl.gz")) if (root / "imdb").is_dir() else []
    if packed:
        rows = []
        for file in packed:  # neg files sort before pos files
            with gzip.open(file, "rt", encoding="utf-8") as f:
                rows.extend((record["text"], int(record["label"])) for record in map(json.loads, f))
        return rows
    for folder in (root / "aclImdb" / split, root / split):
        if (folder / "pos").is_dir() and (folder / "neg").is_dir():
            rows = []
            for label, name in ((0, "neg"), (1, "pos")):
                files = sorted((folder / name).glob("*.txt"), key=lambda p: int(p.stem.split("_")[0]))
                rows.extend((p.read_text(encoding="utf-8"), label) for p in files)
            return rows
    for file in (root / "imdb" / f"{split}.csv", root / f"{split}.csv"):
        if file.is_file():
            with open(file, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if not reader.fieldnames or not {"text", "label"} <= set(reader.fieldnames):
                    raise ValueError(f"{file} needs 'text' and 'label' columns, has {reader.fieldnames}")
                return [(row["text"], _label(row["label"])) for row in reader]
    raise FileNotFoundError(f"no IMDB {split} data under {root} (imdb/*.jsonl.gz, aclImdb/{split}/, or {split}.csv)")


def read_rt_polarity(data_dir) -> list[tuple[str, int]]:
    """The 10,662 sentence-polarity snippets as (text, label): negatives, then positives.

    Reads ``rt-polarity/`` (the shared copy) or ``rt-polaritydata/`` (the Cornell archive's folder).
    """
    folder = Path(data_dir) / "rt-polarity"
    if not folder.is_dir() and (Path(data_dir) / "rt-polaritydata").is_dir():
        folder = Path(data_dir) / "rt-polaritydata"
    rows = []
    for label, name in ((0, "rt-polarity.neg"), (1, "rt-polarity.pos")):
        file = folder / name
        if not file.is_file():
            raise FileNotFoundError(f"no {file}")
        data = file.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:  # the Cornell original is Latin-1
            text = data.decode("latin-1")
        rows.extend((line.strip(), label) for line in text.splitlines() if line.strip())
    return rows


def read_text(path) -> str:
    """A whole text file (e.g. tinyshakespeare/input.txt)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    return path.read_text(encoding="utf-8")


# -------------------------------------------------------------------- download


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class DownloadError(OSError):
    """The source could not be fetched (no network, refused, not found)."""


def download(url: str, cache_dir, *, sha256: str | None = None, progress: bool = True) -> Path:
    """Fetch ``url`` into ``cache_dir`` once (a progress bar while it runs); returns the file.

    The file is written under a temporary name and renamed only after the checksum (if
    given) matches, so an interrupted or corrupted download leaves nothing to be mistaken
    for the real file.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / url.rstrip("/").rsplit("/", 1)[-1]
    if target.exists() and (sha256 is None or _sha256(target) == sha256):
        return target
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=cache_dir)
    try:
        try:
            response = urllib.request.urlopen(url)
        except OSError as error:  # URLError, no network, refused...
            raise DownloadError(f"could not download {url} ({getattr(error, 'reason', error)}); without internet "
                                "access, pass --data-dir with a copy of the data") from None
        with os.fdopen(fd, "wb") as out, response:
            total = int(response.headers.get("Content-Length") or 0) or None
            from tqdm import tqdm

            with tqdm(total=total, unit="B", unit_scale=True, desc=target.name, disable=not progress) as bar:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
        if sha256 is not None and _sha256(Path(tmp)) != sha256:
            raise ValueError(f"{url}: SHA-256 mismatch (expected {sha256}); the download was discarded")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def extract_tar(archive, dest) -> Path:
    """Unpack a .tar(.gz) into ``dest``, refusing members that would land outside it."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            where = (dest / member.name).resolve()
            outside = root not in where.parents and where != root
            if outside or member.issym() or member.islnk():
                raise ValueError(f"{archive}: refusing unsafe member {member.name!r}")
        tmp = Path(tempfile.mkdtemp(prefix=".extract.", dir=dest))
        try:
            tar.extractall(tmp, filter="data")
            for item in tmp.iterdir():
                if not (dest / item.name).exists():
                    os.replace(item, dest / item.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def download_imdb(cache_dir, *, url: str = IMDB_URL, sha256: str | None = IMDB_SHA256) -> Path:
    """Download and unpack the original aclImdb archive into ``cache_dir`` once; returns ``cache_dir``."""
    cache = Path(cache_dir)
    if not (cache / "aclImdb").is_dir():
        extract_tar(download(url, cache, sha256=sha256), cache)
    return cache


def imdb(data_dir=None, split: str = "train", *, cache_dir=None) -> list[tuple[str, int]]:
    """IMDB from ``data_dir`` (default ../shared/data), else downloaded once into ``cache_dir``
    (default ~/.cache/flax_transformer)."""
    found = find_data_dir(data_dir)
    if found is None:
        found = download_imdb(cache_dir or Path.home() / ".cache" / "flax_transformer")
    return read_imdb(found, split)


RT_POLARITY_URL = "https://www.cs.cornell.edu/people/pabo/movie-review-data/rt-polaritydata.tar.gz"


def rt_polarity(data_dir=None, *, cache_dir=None, url: str = RT_POLARITY_URL) -> list[tuple[str, int]]:
    """Sentence polarity from ``data_dir`` (default ../shared/data), else Cornell's archive downloaded
    once into ``cache_dir`` (published without a checksum; the 5,331 + 5,331 lines are checked)."""
    found = find_data_dir(data_dir)
    if found is None:
        found = Path(cache_dir or Path.home() / ".cache" / "flax_transformer")
        if not (found / "rt-polaritydata").is_dir():
            extract_tar(download(url, found), found)
    rows = read_rt_polarity(found)
    if found != find_data_dir(data_dir) and len(rows) != 10_662:
        raise ValueError(f"{url} did not give the 10,662 sentence-polarity snippets ({len(rows)} lines)")
    return rows


SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def tinyshakespeare(data_dir=None, *, cache_dir=None, url: str = SHAKESPEARE_URL) -> Path:
    """The path of Tiny Shakespeare's ``input.txt``: ``data_dir/tinyshakespeare/`` (default
    ../shared/data), else downloaded once into ``cache_dir/tinyshakespeare/``. (Karpathy's file
    is published without a checksum; its length, 1,115,394 characters, is checked instead.)"""
    found = find_data_dir(data_dir)
    if found is not None:
        path = found / "tinyshakespeare" / "input.txt"
        if not path.is_file():
            raise FileNotFoundError(f"no {path}")
        return path
    path = download(url, Path(cache_dir or Path.home() / ".cache" / "flax_transformer") / "tinyshakespeare")
    if len(read_text(path)) != 1_115_394:
        path.unlink()
        raise ValueError(f"{url} did not give Tiny Shakespeare (wrong length); the download was discarded")
    return path
