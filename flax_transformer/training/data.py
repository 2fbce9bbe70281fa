"""Datasets for the notebooks' tasks, read from a data directory (or downloaded once).

    data_dir = find_data_dir(args.data_dir)            # --data-dir, else ../shared/data beside the repo
    train = read_imdb(data_dir, "train")               # [(text, label)], label 1 = positive

Readers accept the layouts users have: the packed IMDB copy in ``../shared/data/imdb``
(gzipped JSON lines, see its README.txt), the original ``aclImdb/{train,test}/{pos,neg}``
folders, or a CSV with ``text`` and ``label`` columns; the sentence-polarity files; a
plain text file. ``download`` fetches an archive into a cache with a progress bar,
checks its SHA-256, writes to a temporary name and renames, and unpacks it safely.

Nothing wrong is read silently: a reader checks that every file it expects is there and
not empty (for the packed IMDB, against ``manifest.tsv.gz`` and ``SHA256SUMS`` when they
are there, else against the shard names ``-NN-of-MM``), and a bad record, a damaged
``.gz`` or a file that is not UTF-8 is a ``DataError`` (a ``ValueError``) of one line
naming the file and the line.
"""

from __future__ import annotations

import csv
import gzip
import http.client
import json
import os
import re
import shutil
import tarfile
import urllib.request
import zlib
from pathlib import Path

from flax_transformer.interop import files

REPO_ROOT = Path(__file__).resolve().parents[2]
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
IMDB_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"


def find_data_dir(data_dir=None) -> Path | None:
    """``data_dir`` if given (it must exist), else ``../shared/data`` beside the repo when present."""
    if data_dir is not None:
        path = Path(data_dir)
        if not path.is_dir():
            if path.exists():
                raise NotADirectoryError(f"--data-dir {path} is a file, not a folder")
            raise FileNotFoundError(f"--data-dir {path} does not exist")
        return path
    shared = REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else None


class DataError(ValueError):
    """A data file is missing, empty, damaged, or holds a bad record: the message names the file (and line)."""


def _label(value) -> int:
    text = str(value).strip().lower()
    if text in ("1", "pos", "positive"):
        return 1
    if text in ("0", "neg", "negative"):
        return 0
    raise ValueError(f"unknown sentiment label {value!r} (expected 0/1, neg/pos, negative/positive)")


_SHARD = re.compile(r"^(train|test)-(neg|pos)-(\d+)-of-(\d+)\.jsonl\.gz$")


def _not_empty(file: Path) -> None:
    if file.stat().st_size == 0:
        raise DataError(f"{file} is empty (0 bytes)")


def _manifest(folder: Path) -> dict[str, int] | None:
    """{shard name: reviews} from the packed copy's ``manifest.tsv.gz`` (None when there is none)."""
    path = folder / "manifest.tsv.gz"
    if not path.exists():
        return None
    counts: dict[str, int] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
            header = f.readline().rstrip("\n").split("\t")
            if "packed_in" not in header:
                raise DataError(f"{path}:1: no 'packed_in' column")
            column = header.index("packed_in")
            for number, line in enumerate(f, 2):
                fields = line.rstrip("\n").split("\t")
                if len(fields) != len(header):
                    raise DataError(f"{path}:{number}: {len(fields)} fields, the header has {len(header)}")
                counts[fields[column]] = counts.get(fields[column], 0) + 1
    except (EOFError, zlib.error, OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path} is damaged: {error}") from None
    return counts


def _checksums(folder: Path) -> dict[str, str]:
    """{file name: SHA-256} from ``SHA256SUMS`` (empty when there is none)."""
    path = folder / "SHA256SUMS"
    if not path.exists():
        return {}
    sums = {}
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            raise DataError(f"{path}:{number}: expected '<sha256>  <file>'")
        sums[parts[1].lstrip("*")] = parts[0].lower()
    return sums


def _packed_shards(folder: Path, split: str) -> list[Path]:
    """The split's shards, all of them: those manifest.tsv.gz lists (else every -NN-of-MM of both labels)."""
    present = {p.name: p for p in folder.glob(f"{split}-*.jsonl.gz")}
    for name in present:
        if not _SHARD.match(name):
            raise DataError(f"{folder / name}: not a shard name ({split}-{{neg,pos}}-NN-of-MM.jsonl.gz)")
    manifest = _manifest(folder)
    if manifest is not None:
        expected = sorted(name for name in manifest if name.startswith(f"{split}-"))
        if not expected:
            raise DataError(f"{folder / 'manifest.tsv.gz'} lists no {split} shard")
        for name in sorted(present):
            if name not in manifest:
                raise DataError(f"{folder / name} is not listed in {folder / 'manifest.tsv.gz'}")
    else:
        expected = []
        for label in ("neg", "pos"):
            shards = {name: _SHARD.match(name) for name in present if _SHARD.match(name).group(2) == label}
            if not shards:
                raise DataError(f"{folder}: no {split}-{label}-*.jsonl.gz shard (IMDB has both labels)")
            totals = {int(m.group(4)) for m in shards.values()}
            if len(totals) != 1:
                raise DataError(f"{folder}: the {split}-{label} shards disagree on their count ({sorted(totals)})")
            total = totals.pop()
            have = {int(m.group(3)) for m in shards.values()}
            lost = sorted(set(range(total)) - have)
            if lost or len(have) != len(shards) or max(have) >= total:
                raise DataError(f"{folder}: the {split}-{label} shards are not 00 to {total - 1:02d} of {total:02d}: "
                                f"{len(lost)} missing ({', '.join(f'{i:02d}' for i in lost[:5])}), or extra ones")
            expected += sorted(shards)
    missing = [name for name in expected if name not in present]
    if missing:
        raise DataError(f"{folder / missing[0]} is missing ({len(missing)} of the {len(expected)} {split} shards are)")
    for name in expected:
        _not_empty(folder / name)
    return [folder / name for name in sorted(expected)]  # neg files sort before pos files


def _packed_records(file: Path, expected: int | None) -> list[tuple[str, int]]:
    rows, number = [], 0
    try:
        with gzip.open(file, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as error:
                    raise DataError(f"{file}:{number}: not UTF-8 ({error.reason} at byte {error.start})") from None
                except ValueError as error:
                    raise DataError(f"{file}:{number}: not a JSON record ({error})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f"{file}:{number}: a record needs a 'text' string (and a 'label')")
                label = record.get("label")
                if isinstance(label, bool) or not isinstance(label, int):
                    raise DataError(f"{file}:{number}: 'label' must be an integer, got {label!r}")
                rows.append((record["text"], label))
    except (EOFError, zlib.error, gzip.BadGzipFile) as error:
        raise DataError(f"{file} is damaged after line {number} ({error})") from None
    if not rows:
        raise DataError(f"{file} is empty: it holds no reviews")
    if expected is not None and len(rows) != expected:
        raise DataError(f"{file} holds {len(rows)} reviews; manifest.tsv.gz lists {expected}")
    return rows


def _read_review(path: Path) -> str:
    data = path.read_bytes()
    if not data:
        raise DataError(f"{path} is empty (0 bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None


def _review_id(path: Path) -> int:
    match = re.fullmatch(r"(\d+)_\d+", path.stem)
    if match is None:
        raise DataError(f"{path}: not a review file name (<id>_<rating>.txt)")
    return int(match.group(1))


def _read_csv(file: Path) -> list[tuple[str, int]]:
    _not_empty(file)
    rows = []
    try:
        with open(file, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or not {"text", "label"} <= set(reader.fieldnames):
                raise ValueError(f"{file} needs 'text' and 'label' columns, has {reader.fieldnames}")
            for row in reader:
                where = f"{file}:{reader.line_num}"
                if not isinstance(row["text"], str) or row["label"] is None:
                    raise DataError(f"{where}: the row has fewer fields than the header")
                try:
                    rows.append((row["text"], _label(row["label"])))
                except ValueError as error:
                    raise DataError(f"{where}: {error}") from None
    except UnicodeDecodeError as error:
        raise DataError(f"{file}: not UTF-8 ({error.reason}), after line {len(rows) + 1}") from None
    except csv.Error as error:
        raise DataError(f"{file}: {error}") from None
    if not rows:
        raise DataError(f"{file} is empty: it holds no rows")
    return rows


def read_imdb(data_dir, split: str) -> list[tuple[str, int]]:
    """IMDB reviews of ``split`` ("train" or "test") as (text, label), negatives first, each sorted by id.

    Looks for, in order: ``imdb/{split}-{neg,pos}-*.jsonl.gz``; ``aclImdb/{split}/{neg,pos}/*.txt``;
    ``imdb/{split}.csv`` or ``{split}.csv`` with ``text`` and ``label`` columns. Every file is
    checked: a missing shard, an empty file, a damaged ``.gz``, a bad record is a ``DataError``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(data_dir)
    folder = root / "imdb"
    if folder.is_dir() and list(folder.glob(f"{split}-*.jsonl.gz")):
        counts, sums = _manifest(folder) or {}, _checksums(folder)
        rows = []
        for file in _packed_shards(folder, split):
            rows.extend(_packed_records(file, counts.get(file.name)))
            if file.name in sums and files.sha256_file(file) != sums[file.name]:  # what the checks above cannot see
                raise DataError(f"{file} is damaged: its SHA-256 differs from {folder / 'SHA256SUMS'}")
        return rows
    for folder in (root / "aclImdb" / split, root / split):
        if (folder / "pos").is_dir() and (folder / "neg").is_dir():
            rows = []
            for label, name in ((0, "neg"), (1, "pos")):
                paths = sorted((folder / name).glob("*.txt"), key=_review_id)
                if not paths:
                    raise DataError(f"{folder / name} holds no reviews (*.txt)")
                rows.extend((_read_review(p), label) for p in paths)
            return rows
    for file in (root / "imdb" / f"{split}.csv", root / f"{split}.csv"):
        if file.is_file():
            return _read_csv(file)
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
        lines = [(line.strip(), label) for line in text.splitlines() if line.strip()]
        if not lines:
            raise DataError(f"{file} is empty: no snippets")
        rows.extend(lines)
    return rows


def read_text(path) -> str:
    """A whole text file (e.g. tinyshakespeare/input.txt), which must be UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such text file: {path}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start})") from None


# -------------------------------------------------------------------- download


class DownloadError(OSError):
    """The source could not be fetched (no network, refused, not found)."""


def download(url: str, cache_dir, *, sha256: str | None = None, progress: bool = True) -> Path:
    """Fetch ``url`` into ``cache_dir`` once (a progress bar while it runs); returns the file.

    The file is written under a temporary name (``files.write_file``: recognisable, and
    removed by the next download when an interrupted one left it) and renamed only after
    the checksum (if given) matches, so an interrupted or corrupted download leaves
    nothing to be mistaken for the real file.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / url.rstrip("/").rsplit("/", 1)[-1]
    if target.is_file() and (sha256 is None or files.sha256_file(target) == sha256):
        return target

    def fetch(tmp: Path):
        try:
            response = urllib.request.urlopen(url)
        except OSError as error:  # URLError, no network, refused...
            raise DownloadError(f"could not download {url} ({getattr(error, 'reason', error)}); without internet "
                                "access, pass --data-dir with a copy of the data") from None
        from tqdm import tqdm

        with open(tmp, "wb") as out, response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=target.name, disable=not progress) as bar:
                try:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        out.write(chunk)
                        bar.update(len(chunk))
                except (http.client.HTTPException, ConnectionError, TimeoutError) as error:
                    raise DownloadError(f"the download of {url} broke off ({error}); try again") from None
        if sha256 is not None and files.sha256_file(tmp) != sha256:
            raise ValueError(f"{url}: SHA-256 mismatch (expected {sha256}); the download was discarded")

    return files.write_file(target, fetch, overwrite=True)


def extract_tar(archive, dest) -> Path:
    """Unpack a .tar(.gz) into ``dest``, refusing members that would land outside it.

    Members are unpacked into a temporary folder (``.extract.ft-tmp-<pid>-…``, removed after,
    and by the next extraction if this one was killed), then moved into ``dest`` one top-level
    item at a time."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    marker = dest / "extract"
    files.remove_stale(marker)
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                where = (dest / member.name).resolve()
                outside = root not in where.parents and where != root
                if outside or member.issym() or member.islnk():
                    raise ValueError(f"{archive}: refusing unsafe member {member.name!r}")
            tmp = files.temp_name(marker)
            tmp.mkdir()
            try:
                tar.extractall(tmp, filter="data")
                for item in tmp.iterdir():
                    if not (dest / item.name).exists():
                        os.replace(item, dest / item.name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (tarfile.TarError, EOFError, zlib.error) as error:
        raise DataError(f"{archive} is damaged ({error}); delete it to download it again") from None
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
    try:
        length = len(read_text(path))
    except DataError:
        length = None
    if length != 1_115_394:
        path.unlink()
        raise ValueError(f"{url} did not give Tiny Shakespeare (wrong length); the download was discarded")
    return path
