"""Dataset readers and the download path (on small archives made here, served from file:// URLs)."""

import gzip
import hashlib
import io
import json
import tarfile

import pytest

from flax_transformer.training import data

SHARED = data.find_data_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared/data is not present beside the repo")


@needs_shared
def test_imdb_from_the_shared_copy():
    train = data.read_imdb(SHARED, "train")
    assert len(train) == 25_000 and sum(label for _, label in train) == 12_500
    positives = [text for text, label in train if label == 1]
    assert positives[0].startswith("Bromwell High is a cartoon comedy.")  # train/pos/0_9.txt
    assert len(data.read_imdb(SHARED, "test")) == 25_000


@needs_shared
def test_rt_polarity_and_text():
    rows = data.read_rt_polarity(SHARED)
    assert len(rows) == 10_662 and sum(label for _, label in rows) == 5_331
    assert len(data.read_text(SHARED / "tinyshakespeare" / "input.txt")) == 1_115_394


def test_acl_imdb_folders_and_csv(tmp_path):
    for split in ("train", "test"):
        for name, label in (("pos", 1), ("neg", 0)):
            folder = tmp_path / "aclImdb" / split / name
            folder.mkdir(parents=True)
            for i in (10, 2):
                (folder / f"{i}_{7 if label else 2}.txt").write_text(f"{name} review {i}")
    rows = data.read_imdb(tmp_path, "train")
    assert rows == [("neg review 2", 0), ("neg review 10", 0), ("pos review 2", 1), ("pos review 10", 1)]
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "test.csv").write_text('text,label\n"great, really",positive\nawful,0\n')
    assert data.read_imdb(csv_dir, "test") == [("great, really", 1), ("awful", 0)]
    (csv_dir / "train.csv").write_text("review,sentiment\nx,1\n")
    with pytest.raises(ValueError, match="needs 'text' and 'label' columns"):
        data.read_imdb(csv_dir, "train")
    with pytest.raises(FileNotFoundError, match="no IMDB train data"):
        data.read_imdb(tmp_path / "csv" / "nothing", "train")


def _archive(tmp_path, members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in members.items():
            payload = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    path = tmp_path / "aclImdb_v1.tar.gz"
    path.write_bytes(buffer.getvalue())
    return path, hashlib.sha256(buffer.getvalue()).hexdigest()


def test_download_checks_the_checksum_and_unpacks(tmp_path):
    members = {f"aclImdb/{s}/{n}/0_{r}.txt": f"{s} {n}" for s in ("train", "test") for n, r in (("pos", 9), ("neg", 1))}
    archive, digest = _archive(tmp_path, members)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        data.download(archive.as_uri(), cache, sha256="0" * 64, progress=False)
    assert list(cache.iterdir()) == []  # nothing half-written is left
    assert data.download_imdb(cache, url=archive.as_uri(), sha256=digest) == cache
    assert data.read_imdb(cache, "test") == [("test neg", 0), ("test pos", 1)]
    assert data.imdb(cache, "train") == [("train neg", 0), ("train pos", 1)]
    archive.unlink()  # cached: a second call does not download again
    assert data.download_imdb(cache, url=archive.as_uri(), sha256=digest) == cache


def test_unsafe_archives_are_refused(tmp_path):
    archive, _ = _archive(tmp_path, {"../escape.txt": "x"})
    with pytest.raises(ValueError, match="unsafe member"):
        data.extract_tar(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_packed_jsonl_layout(tmp_path):
    folder = tmp_path / "imdb"
    folder.mkdir()
    for label, name in ((0, "neg"), (1, "pos")):
        with gzip.open(folder / f"train-{name}-00-of-01.jsonl.gz", "wt") as f:
            f.write(json.dumps({"id": 0, "rating": 9 if label else 1, "label": label, "text": name}) + "\n")
    assert data.read_imdb(tmp_path, "train") == [("neg", 0), ("pos", 1)]


def test_rt_polarity_and_shakespeare_downloads(tmp_path, monkeypatch):
    """Without a data folder, the original archives are fetched into the cache (file:// URLs here)."""
    monkeypatch.setattr(data, "REPO_ROOT", tmp_path / "nowhere" / "repo")  # no ../shared/data beside it
    assert data.find_data_dir() is None
    members = {f"rt-polaritydata/rt-polarity.{name}": "".join(f"{name} snippet {i}\n" for i in range(5331))
               for name in ("neg", "pos")}
    archive, _ = _archive(tmp_path, members)
    cache = tmp_path / "cache"
    rows = data.rt_polarity(cache_dir=cache, url=archive.as_uri())
    assert len(rows) == 10_662 and rows[0] == ("neg snippet 0", 0) and rows[-1] == ("pos snippet 5330", 1)
    (tmp_path / "short").mkdir()
    short, _ = _archive(tmp_path / "short", {"rt-polaritydata/rt-polarity.neg": "a\n",
                                             "rt-polaritydata/rt-polarity.pos": "b\n"})
    with pytest.raises(ValueError, match="10,662"):
        data.rt_polarity(cache_dir=tmp_path / "cache2", url=short.as_uri())

    text = tmp_path / "input.txt"
    text.write_text("not Shakespeare\n")
    with pytest.raises(ValueError, match="wrong length"):
        data.tinyshakespeare(cache_dir=tmp_path / "cache3", url=text.as_uri())
    assert not (tmp_path / "cache3" / "tinyshakespeare" / "input.txt").exists()  # discarded
