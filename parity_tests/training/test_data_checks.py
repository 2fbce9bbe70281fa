"""The data readers refuse what they must: blank lines are not snippets, a packed IMDB shard that
differs from its checksum and archives with links are refused.

Each test kills a realistic bug (a mutant) that a mutation probe of issue 22 planted and the rest of the
suite let through; the mutant is named in the test's comment or docstring.
"""

import pytest


def _write_packed_imdb(root, n_train, n_test):
    """A packed IMDB (imdb/{split}-{neg,pos}-00-of-01.jsonl.gz) whose every review is a distinct text."""
    import gzip
    import json

    (root / "imdb").mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        for label, name in ((0, "neg"), (1, "pos")):
            with gzip.open(root / "imdb" / f"{split}-{name}-00-of-01.jsonl.gz", "wt") as f:
                for i in range(n // 2):
                    f.write(json.dumps({"id": i, "label": label, "text": f"{split} {name} review {i}"}) + "\n")
    return root


def test_blank_lines_are_not_snippets(tmp_path):
    from flax_transformer.training import data

    (tmp_path / "rt-polarity").mkdir()
    for name in ("neg", "pos"):
        (tmp_path / "rt-polarity" / f"rt-polarity.{name}").write_text(f"{name} one\n\n  \n{name} two \n")
    assert data.read_rt_polarity(tmp_path) == [("neg one", 0), ("neg two", 0), ("pos one", 1), ("pos two", 1)]


def test_a_packed_imdb_shard_that_differs_from_its_checksum_is_refused(tmp_path):
    import gzip
    import hashlib

    from flax_transformer.training import data

    _write_packed_imdb(tmp_path, 4, 4)
    folder = tmp_path / "imdb"
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.jsonl.gz"))}
    (folder / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    assert len(data.read_imdb(tmp_path, "train")) == 4
    shard = folder / "train-pos-00-of-01.jsonl.gz"  # rewritten: valid gzip and JSON, other reviews
    with gzip.open(shard, "wt") as f:
        f.write('{"id": 0, "label": 1, "text": "something else"}\n{"id": 1, "label": 1, "text": "and more"}\n')
    with pytest.raises(data.DataError, match="SHA-256"):
        data.read_imdb(tmp_path, "train")


def test_archives_with_links_are_refused(tmp_path):
    import io
    import tarfile

    from flax_transformer.training import data

    for kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        archive = tmp_path / f"links-{kind!r}.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            payload = b"review"
            info = tarfile.TarInfo("aclImdb/train/pos/0_9.txt")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
            link = tarfile.TarInfo("aclImdb/train/pos/1_9.txt")
            link.type, link.linkname = kind, "aclImdb/train/pos/0_9.txt" if kind == tarfile.LNKTYPE else "/etc/passwd"
            tar.addfile(link)
        out = tmp_path / f"out-{kind!r}"
        with pytest.raises(ValueError, match="unsafe member"):
            data.extract_tar(archive, out)
        assert not (out / "aclImdb").exists()
