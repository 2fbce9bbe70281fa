"""Training runs under faults (issue 12, items 7-12 and 18): every mistake is refused before the
run directory exists, or cleans up after itself; checkpoints are checksummed; a run directory
is locked; logs hold each step once; data readers name the bad file and line.

Most checks run the library in-process on a tiny model (``fit`` on a 1-block CTransformer) or
stop before any training; three start subprocesses (a real lock held by another process, the
exit status of a flag error, a real write limit with RLIMIT_FSIZE during the first checkpoint).
"""

import dataclasses
import fcntl
import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_transformer.training import data, loop, run_checkpoints, rundir, seq2seq
from flax_transformer.training.errors import RunError
from flax_transformer.training.loop import fit
from flax_transformer.training.optim import OptimConfig
from flax_transformer.training.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def standard_promotion():
    """optax mixes a Python float with its int32 step count, which the suite's strict promotion refuses."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def _main(module, argv):
    """An entry point's exit status (a flag error exits as argparse's do: ``SystemExit``)."""
    from importlib import import_module

    try:
        return import_module(f"train.{module}").main([str(a) for a in argv])
    except SystemExit as exit:
        return exit.code


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------- a tiny run, in-process


VOCAB = 4096  # a token table of 128 KiB: orbax stores it in a data file of its own, not inline in its index


class Batches:
    def batch(self, step):
        rng = np.random.default_rng(step)
        ids = rng.integers(0, 20, (4, 8)).astype(np.int32)
        return {"ids": ids, "labels": (ids[:, 0] % 2).astype(np.int32)}

    def position(self, step):
        return {"step": step}


def _loss(m, batch):
    logp = m(batch["ids"])
    loss = -jnp.take_along_axis(logp, batch["labels"][:, None], axis=1).mean()
    return loss, {"count": jnp.float32(4)}


def _tiny_fit(run_dir, *, steps=10, resume=False):
    """10 steps, a checkpoint every 5, an evaluation every 5 and at the end, a log line every 5."""
    from flax_transformer.models.former import CTransformer

    model = CTransformer(8, 2, 1, 8, VOCAB, 2, rngs=nnx.Rngs(params=0, dropout=1))
    evaluate = loop.batch_evaluator(_loss, lambda: [Batches().batch(10**6)])
    return fit(model, OptimConfig(lr=1e-2), _loss, Batches(), run_dir=run_dir, steps=steps, run_config={"x": 1},
               evaluate=evaluate, eval_every=5, checkpoint_every=5, log_every=5, resume=resume, progress=False,
               tensorboard=False)


def _params(result):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(result.model, nnx.Param)))[0]}


def _raw_restore(checkpoint: Path):
    """What orbax alone gives back from a checkpoint's ``state`` (None if it refuses to read it)."""
    import orbax.checkpoint as ocp

    try:
        with ocp.PyTreeCheckpointer() as reader:
            metadata = reader.metadata(checkpoint / "state").item_metadata.tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
            tree = reader.restore(checkpoint / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    except Exception:
        return None
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _flip_bytes_silently(checkpoint: Path) -> None:
    """Flip 16 bytes inside the largest orbax data file of ``checkpoint`` (compressed with zstd, which keeps
    no checksum), at the first of a few offsets where orbax still reads the checkpoint, wrongly."""
    victim = max((p for p in checkpoint.rglob("*") if p.is_file() and p.parent.name == "d"),
                 key=lambda p: p.stat().st_size)
    good, before = victim.read_bytes(), _raw_restore(checkpoint)
    for fraction in (0.5, 0.3, 0.7, 0.4, 0.6, 0.2, 0.8):
        raw = bytearray(good)
        at = int(len(raw) * fraction)
        raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
        victim.write_bytes(bytes(raw))
        after = _raw_restore(checkpoint)
        if after is not None and any(not np.array_equal(before[k], after[k]) for k in before):
            return  # orbax restores it without a word, and an array is wrong
    raise AssertionError("no offset gave a silent corruption")


# ------------------------------------------------------------------------- 8: checksums


@pytest.mark.slow(reason="test_a_run_killed_before_its_first_checkpoint_can_be_resumed, "
                  "test_a_full_disk_during_the_first_checkpoint_is_one_line_and_leaves_nothing (a run's checkpoints when "
                  "things break)")
def test_a_corrupted_checkpoint_is_named_and_resume_falls_back_to_the_one_before(tmp_path, capsys):
    whole = _tiny_fit(tmp_path / "whole")
    create_run_dir(tmp_path / "run", {"x": 1})
    _tiny_fit(tmp_path / "run")
    assert run_checkpoints.Checkpoints(tmp_path / "run").steps() == [5, 10]
    _flip_bytes_silently(tmp_path / "run" / "checkpoints" / "10")

    checkpoints = run_checkpoints.Checkpoints(tmp_path / "run")
    from flax_transformer.models.former import CTransformer

    with pytest.raises(RunError, match=r"checkpoints/10 is corrupt: .* of its arrays \(\['model'\]"):
        checkpoints.restore_model(CTransformer(8, 2, 1, 8, VOCAB, 2, rngs=nnx.Rngs(0)))
    checkpoints.close()

    resumed = _tiny_fit(tmp_path / "run", resume=True)
    err = capsys.readouterr().err
    assert "checkpoints/10 is corrupt" in err and "resuming from the previous checkpoint, step 5" in err
    assert (tmp_path / "run" / "broken-checkpoints" / "10").is_dir()  # kept, out of the way
    assert run_checkpoints.Checkpoints(tmp_path / "run").steps() == [5, 10]  # step 10 written again, intact
    a, b = _params(whole), _params(resumed)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # no NaN, no garbage: the real run


# ------------------------------------------------------------------------- 10: each step once in the log


@pytest.mark.slow(reason="test_a_run_killed_before_its_first_checkpoint_can_be_resumed (a run resumed)")
def test_resuming_a_finished_run_logs_each_step_once(tmp_path):
    create_run_dir(tmp_path, {"x": 1})
    _tiny_fit(tmp_path)  # as if killed after the final checkpoint (and after its final evaluation line)
    first = rundir.read_metrics(tmp_path)
    _tiny_fit(tmp_path, resume=True)
    again = rundir.read_metrics(tmp_path)
    keys = [(r["step"], r["split"]) for r in again]
    assert len(keys) == len(set(keys)), keys
    assert keys == [(r["step"], r["split"]) for r in first] == [(5, "train"), (5, "eval"), (10, "train"), (10, "eval")]

    # a line torn by a kill -9 mid-write does not stop the next resume, and is dropped
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "split": "te')
    _tiny_fit(tmp_path, resume=True)
    assert [(r["step"], r["split"]) for r in rundir.read_metrics(tmp_path)] == keys

    # the test line a classify run appends after training: once, however often the end is reached
    for accuracy in (0.5, 0.6):
        rundir.append_metrics(tmp_path, 10, "test", {"accuracy": accuracy})
    tests = [r for r in rundir.read_metrics(tmp_path) if r["split"] == "test"]
    assert [r["accuracy"] for r in tests] == [0.6]


# ------------------------------------------------------------------------- 7: nothing half-made


def test_a_run_killed_before_its_first_checkpoint_can_be_resumed(tmp_path, capsys):
    create_run_dir(tmp_path, {"x": 1})  # run.json and nothing else: killed before the first save
    result = _tiny_fit(tmp_path, resume=True)
    assert result.step == 10 and "starting it from step 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--lr", "-1"], "--lr must be above 0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--seed", "-1"], "--seed must be at least 0"),
    (["--mesh", "data=-2,fsdp=-1"], "expected data=N,fsdp=M"),
])
def test_bad_flags_are_refused_before_the_run_directory_exists(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert _main("seq2seq", ["--preset", "tiny", "--out", out, "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_what_a_run_needs_is_checked_before_its_folder_is_made(tmp_path, capsys):
    out = tmp_path / "run"
    short = tmp_path / "short.txt"
    short.write_text("ROMEO: too short for a window\n")
    assert _main("lm", ["--preset", "tiny", "--out", out, "--text", short, "--no-progress"]) == 2
    assert "less than one window" in capsys.readouterr().err
    assert not out.exists()

    text = tmp_path / "text.txt"
    text.write_text("ROMEO: but soft, what light through yonder window breaks?\n" * 50)
    assert _main("lm", ["--preset", "tiny", "--out", out, "--text", text, "--prompt", "QX", "--no-progress"]) == 2
    assert "--prompt 'QX' has characters the text does not have" in capsys.readouterr().err  # not after training
    assert not out.exists()

    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"keep me")
    assert _main("seq2seq", ["--preset", "tiny", "--out", out, "--steps", 1, "--export-torch", existing,
                             "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--export-torch" in err and "--overwrite replaces it" in err and "overwrite=True" not in err
    assert not out.exists() and existing.read_bytes() == b"keep me"
    assert _main("seq2seq", ["--preset", "tiny", "--out", out, "--steps", 1, "--no-progress",
                             "--export-torch", tmp_path / "no" / "such" / "folder.safetensors"]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()

    with pytest.raises(ValueError, match="--max-digits must be at least 1 and at most 1,024, got 10000"):
        seq2seq.Seq2SeqConfig.tiny(max_digits=10000)  # item 12: refused, not an XLA out-of-memory traceback
    assert _main("seq2seq", ["--preset", "tiny", "--out", out, "--max-digits", 10000, "--no-progress"]) == 2
    with pytest.raises(ValueError, match="one training step needs about .* GiB of memory"):
        seq2seq.train_and_evaluate(seq2seq.Seq2SeqConfig.tiny(max_digits=1024, batch_size=60000), out)
    assert not out.exists()

    with pytest.raises(ValueError, match="--steps must be int, got '10'"):  # a hand-edited run.json
        seq2seq.Seq2SeqConfig.tiny(steps="10")


def test_the_output_folder_is_checked_first(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, message in ((a_file, "is a file, not a folder"), (a_file / "run", "is a file, not a folder"),
                         (Path(os.fsdecode(bytes(tmp_path) + b"/r\xff")), "is not a UTF-8 file name")):
        assert _main("seq2seq", ["--preset", "tiny", "--out", out, "--steps", 1, "--no-progress"]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    if not os.access("/proc/sys", os.W_OK):  # a folder nobody may write into, even root
        assert _main("seq2seq", ["--preset", "tiny", "--out", "/proc/sys/run", "--steps", 1, "--no-progress"]) == 2
        assert "cannot write into /proc/sys" in capsys.readouterr().err


def test_predict_refuses_text_that_is_not_utf8(tmp_path, capsys):
    create_run_dir(tmp_path / "run", {"task": "classify"})
    assert _main("classify", ["--predict", "great \udcff film", "--checkpoint", tmp_path / "run"]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8" in err and "Traceback" not in err


# ------------------------------------------------------------------------- 9: one process per run directory


def test_a_run_directory_in_use_is_refused(tmp_path, capsys):
    """Another process (here: one that holds the lock as a run does) owns the folder: a --resume, a new
    run into it, and fit itself are refused, and change nothing; once that process is killed the lock is free."""
    run, new = tmp_path / "run", tmp_path / "new"
    create_run_dir(run, {"task": "seq2seq", **dataclasses.asdict(seq2seq.Seq2SeqConfig.tiny())})
    new.mkdir()  # a new run into it has started, and has not written its run.json yet
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        for path in ({str(run / '.lock')!r}, {str(new / '.lock')!r}):
            fcntl.flock(os.open(path, os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _listing(run)
        assert _main("seq2seq", ["--preset", "tiny", "--out", run, "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "is in use by another process" in err and "Traceback" not in err
        assert _listing(run) == before
        with pytest.raises(RunError, match="in use by another process"):  # fit itself takes the lock too
            _tiny_fit(run)
        assert _main("seq2seq", ["--preset", "tiny", "--out", new, "--no-progress"]) == 2  # a second new run
        assert "is in use by another process" in capsys.readouterr().err
        assert sorted(p.name for p in new.iterdir()) == [".lock"]
    finally:
        holder.kill()  # kill -9: the kernel drops its lock, no stale lock is left
        holder.wait()
    with rundir.lock_run_dir(new):
        with rundir.lock_run_dir(new):  # re-entrant within a process
            fd = os.open(new / ".lock", os.O_RDWR)
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # but held against everyone else
            os.close(fd)


# ------------------------------------------------------------------------- 18: exit status, tracebacks


def test_flag_errors_exit_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "train.seq2seq", "--preset", "tiny", "--out", tmp_path / "run",
                             "--coordinator", "127.0.0.1:1234"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --coordinator, --num-processes and --process-id go together; missing --num-processes --process-id"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow(reason="test_writers' full-disk cases (the same atomic writes), test_run_faults' corrupted-checkpoint test")
def test_a_full_disk_during_the_first_checkpoint_is_one_line_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses the checkpoint's larger writes (EFBIG), as a full disk does (ENOSPC)."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, resource, sys
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # the tests' shared cache would hit the size limit too
        from train.seq2seq import main
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))
        sys.exit(main(["--preset", "tiny", "--steps", "10", "--out", {str(out)!r}, "--no-progress"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if not line.startswith("seq2seq: ")]
    assert len(lines) == 1 and lines[0].startswith("error: could not write checkpoint 10"), result.stderr[-3000:]
    assert "File too large" in lines[0] and "Event loop is closed" not in result.stderr
    assert not out.exists()  # a new run that failed before its first checkpoint leaves nothing behind


# ------------------------------------------------------------------------- 11: data readers


def _shard(path: Path, records: list, raw: bytes | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = raw if raw is not None else "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(payload))


def _packed(root: Path, total: int = 2) -> Path:
    for label, name in ((0, "neg"), (1, "pos")):
        for i in range(total):
            _shard(root / "imdb" / f"train-{name}-{i:02d}-of-{total:02d}.jsonl.gz",
                   [{"id": j, "label": label, "text": f"{name} {i} {j}"} for j in range(3)])
    return root


def _manifest(root: Path):
    lines = ["original_path\tgit_blob_sha1\tbytes\tpacked_in"]
    for shard in sorted((root / "imdb").glob("train-*.jsonl.gz")):
        lines += [f"train/x/{j}_1.txt\t0\t1\t{shard.name}" for j in range(3)]
    (root / "imdb" / "manifest.tsv.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


@pytest.mark.parametrize("manifest", [False, True])
def test_an_empty_missing_or_damaged_imdb_shard_is_refused(tmp_path, manifest):
    root = _packed(tmp_path)
    if manifest:
        _manifest(root)
    assert len(data.read_imdb(root, "train")) == 12
    shard = root / "imdb" / "train-pos-01-of-02.jsonl.gz"
    good = shard.read_bytes()
    cases = [
        (lambda: shard.write_bytes(b""), "train-pos-01-of-02.jsonl.gz is empty"),
        (lambda: shard.write_bytes(gzip.compress(b"")), "train-pos-01-of-02.jsonl.gz is empty"),
        (lambda: shard.write_bytes(good[:len(good) // 2]), "train-pos-01-of-02.jsonl.gz is damaged"),
        (lambda: shard.unlink(), "01" if not manifest else "train-pos-01-of-02.jsonl.gz is missing"),
        (lambda: _shard(shard, [{"id": 0, "label": 1, "text": "a"}, {"id": 1, "label": 1}]),
         "train-pos-01-of-02.jsonl.gz:2: a record needs a 'text' string"),
        (lambda: _shard(shard, [], raw=b'{"id": 0, "label": 1, "text": "a"}\n{"id": 1, "lab'),
         "train-pos-01-of-02.jsonl.gz:2: not a JSON record"),
        (lambda: _shard(shard, [], raw=b'{"id": 0, "label": 1, "text": "caf\xe9"}\n'),
         "train-pos-01-of-02.jsonl.gz:1: not UTF-8"),
        (lambda: _shard(shard, [{"id": 0, "label": "x", "text": "a"}]), ":1: 'label' must be an integer"),
    ]
    for damage, message in cases:
        damage()
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            data.read_imdb(root, "train")
        shard.write_bytes(good)
    if manifest:  # a shard holding fewer reviews than the manifest lists
        _shard(shard, [{"id": 0, "label": 1, "text": "a"}])
        with pytest.raises(ValueError, match="holds 1 reviews; manifest.tsv.gz lists 3"):
            data.read_imdb(root, "train")


def test_the_other_readers_name_the_bad_file(tmp_path):
    folder = tmp_path / "aclImdb" / "train"
    for name in ("pos", "neg"):
        (folder / name).mkdir(parents=True)
        (folder / name / "0_7.txt").write_text(f"{name} review")
    assert len(data.read_imdb(tmp_path, "train")) == 2
    (folder / "pos" / "0_7.txt").unlink()
    with pytest.raises(ValueError, match="pos holds no reviews"):  # not half the data
        data.read_imdb(tmp_path, "train")
    (folder / "pos" / "0_7.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"0_7.txt is empty"):
        data.read_imdb(tmp_path, "train")
    (folder / "pos" / "0_7.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"0_7.txt: not UTF-8"):
        data.read_imdb(tmp_path, "train")
    (folder / "pos" / "0_7.txt").write_text("fine")
    (folder / "pos" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt: not a review file name"):
        data.read_imdb(tmp_path, "train")

    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "train.csv").write_text("text,label\ngood,1\nshort\n")
    with pytest.raises(ValueError, match=r"train.csv:3: the row has fewer fields"):
        data.read_imdb(csv_dir, "train")
    (csv_dir / "train.csv").write_text("text,label\ngood,maybe\n")
    with pytest.raises(ValueError, match=r"train.csv:2: unknown sentiment label 'maybe'"):
        data.read_imdb(csv_dir, "train")
    (csv_dir / "train.csv").write_text("")
    with pytest.raises(ValueError, match=r"train.csv is empty"):
        data.read_imdb(csv_dir, "train")

    rt = tmp_path / "rt" / "rt-polarity"
    rt.mkdir(parents=True)
    (rt / "rt-polarity.neg").write_text("bad\n")
    (rt / "rt-polarity.pos").write_text("\n")
    with pytest.raises(ValueError, match=r"rt-polarity.pos is empty"):
        data.read_rt_polarity(tmp_path / "rt")

    text = tmp_path / "input.txt"
    text.write_bytes(b"line one\nline \xff two\n")
    with pytest.raises(ValueError, match=r"input.txt:2: not UTF-8"):
        data.read_text(text)


def test_downloads_use_recognisable_temporary_names(tmp_path, monkeypatch):
    """An interrupted download leaves ``.<name>.ft-tmp-<pid>-…``, which the next download removes."""
    source = tmp_path / "file.bin"
    source.write_bytes(b"payload")
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cache / f".file.bin.ft-tmp-{dead.pid}-abcd"
    stale.write_bytes(b"half")
    assert data.download(source.as_uri(), cache, progress=False).read_bytes() == b"payload"
    assert sorted(p.name for p in cache.iterdir()) == ["file.bin"]

    class Response:
        headers = {}

        def read(self, n):
            raise ConnectionResetError("reset by peer")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url: Response())
    with pytest.raises(OSError, match="broke off"):  # one clear line, not an http.client traceback
        data.download("http://example.invalid/other.bin", cache, progress=False)
    assert sorted(p.name for p in cache.iterdir()) == ["file.bin"]
