"""kernel_lib.models.data: the standard-library corpus, the BPE tokenizer and its cache, the encoded corpus, the
split and the batches, and the errors for bad arguments.

Everything runs on a subset of 20 standard-library files, a vocabulary of 512 and a temporary cache directory
(training takes well under a second). Measured on the 2-core CPU machine for the whole standard library of
CPython 3.11 (734 files, 12.1 MB): training the default 32,768-token tokenizer about 3 s, encoding the corpus
(2.9M tokens) about 4 s, loading either from the cache about 0.3 s."""

import pytest
import torch

from kernel_lib.models.data import (
    EOT,
    batches,
    encode_corpus,
    fixed_batch,
    stdlib_files,
    train_tokenizer,
    train_val_split,
)

VOCAB = 512


@pytest.fixture(scope="module")
def files():
    every = stdlib_files()
    return every[:: len(every) // 20][:20]  # 20 files spread over the library, not 20 from one package


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_lib_cache")


@pytest.fixture(scope="module")
def tokenizer(files, cache_dir):
    return train_tokenizer(VOCAB, files=files, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def tokens(tokenizer, files, cache_dir):
    return encode_corpus(tokenizer, files=files, cache_dir=cache_dir)


def test_stdlib_files_are_the_library_without_tests():
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    names = {f.as_posix() for f in files}
    assert any(n.endswith("/os.py") for n in names) and any(n.endswith("/json/decoder.py") for n in names)
    for f in files:
        assert not {"test", "tests", "idle_test", "site-packages"} & set(f.parts), f


def test_stdlib_files_of_a_tree(tmp_path):
    kept = ["a.py", "pkg/b.py", "pkg/testing.py"]  # testing.py: only directories named test/tests are dropped
    dropped = ["test/c.py", "pkg/tests/d.py", "idlelib/idle_test/e.py", "site-packages/f.py", "pkg/notes.txt"]
    for name in kept + dropped:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert stdlib_files(tmp_path) == sorted(tmp_path / n for n in kept)
    with pytest.raises(FileNotFoundError, match="no .py files"):
        stdlib_files(tmp_path / "idlelib")  # only a test suite below it: nothing to train on


def test_tokenizer_vocabulary_and_round_trip(tokenizer, files):
    assert tokenizer.get_vocab_size() == VOCAB
    assert tokenizer.token_to_id(EOT) == 0 and tokenizer.id_to_token(1) is not None
    text = files[0].read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text  # byte-level: lossless
    assert len(ids) < 0.6 * len(text.encode())  # merges learned: fewer tokens than bytes
    odd = "ünïcödé \N{SNOWMAN} \t\r\n  tabs"  # characters never seen in training still encode, as bytes
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd


def test_tokenizer_cache_is_loaded_not_retrained(files, cache_dir, tokenizer):
    (path,) = cache_dir.glob(f"tokenizer-{VOCAB}-*.json")
    other = train_tokenizer(300, files=files[:3], path=cache_dir / "other.json")  # a different tokenizer
    path.write_text(other.to_str())  # planted in the cache: a reload returns it, a retrain would not
    try:
        assert train_tokenizer(VOCAB, files=files, cache_dir=cache_dir).get_vocab_size() == 300
    finally:
        path.write_text(tokenizer.to_str())
    assert (cache_dir / "other.json").is_file()  # an explicit path is where the JSON goes
    assert not list(cache_dir.glob("tokenizer-300-*.json"))


def test_tokenizer_reads_invalid_utf8(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"x = '\xff\xfe'\n" * 50 + b"def f():\n    return 1\n" * 50)  # not UTF-8: replaced, no error
    tok = train_tokenizer(300, files=[bad], cache_dir=tmp_path)
    assert tok.decode(tok.encode("def f():").ids) == "def f():"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"vocab_size": 256}, ValueError, "vocab_size must be at least 257"),  # the bytes alone, no room for EOT
        ({"vocab_size": "512"}, ValueError, "vocab_size must be at least"),  # a string
        ({"min_frequency": 0}, ValueError, "min_frequency must be a positive"),
        ({"files": []}, ValueError, "files is empty"),
        ({"files": ["/nonexistent/x.py"]}, FileNotFoundError, "not found"),
    ],
    ids=str,
)
def test_train_tokenizer_bad_arguments(tmp_path, kwargs, error, words):
    with pytest.raises(error, match=words):
        train_tokenizer(**{"vocab_size": VOCAB, "files": stdlib_files()[:2], "cache_dir": tmp_path, **kwargs})


def test_encode_corpus_joins_documents_and_caches(tokenizer, tokens, files, cache_dir):
    assert tokens.dtype == torch.int32 and tokens.dim() == 1
    assert int((tokens == 0).sum()) == len(files) and tokens[-1] == 0  # one EOT after each document
    ends = (tokens == 0).nonzero().flatten().tolist()
    first = tokenizer.decode(tokens[: ends[0]].tolist())
    assert first == files[0].read_text(encoding="utf-8", errors="replace")
    (path,) = cache_dir.glob("corpus-*.npy")
    path.unlink()  # gone: the next call encodes again and writes it back
    again = encode_corpus(tokenizer, files=files, cache_dir=cache_dir)
    assert torch.equal(again, tokens) and path.is_file()
    assert torch.equal(encode_corpus(tokenizer, files=files, cache_dir=cache_dir), tokens)  # from the cache


def test_train_val_split(tokens):
    train, val = train_val_split(tokens, 0.1)
    assert len(val) == round(0.1 * len(tokens)) and torch.equal(torch.cat([train, val]), tokens)
    for fraction in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            train_val_split(tokens, fraction)
    with pytest.raises(ValueError, match="empty split"):
        train_val_split(tokens[:10], 0.01)  # 0.1 token held out: rounds to none


def test_batches_are_shifted_windows(tokens):
    B, T = 4, 32
    idx, targets = next(batches(tokens, B, T, torch.Generator().manual_seed(0)))
    assert idx.shape == targets.shape == (B, T) and idx.dtype == targets.dtype == torch.int64
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    windows = tokens.long().unfold(0, T + 1, 1)  # (N - T, T + 1): every window of the corpus
    for row in range(B):
        full = torch.cat([idx[row], targets[row, -1:]])
        assert (windows == full).all(dim=1).any(), f"row {row} is not a window of the corpus"


def test_batches_are_deterministic_under_a_seed(tokens):
    def draw(seed, n=3):
        it = batches(tokens, 2, 16, torch.Generator().manual_seed(seed))
        return [next(it) for _ in range(n)]

    same, again, other = draw(1), draw(1), draw(2)
    for (a, b), (c, d) in zip(same, again, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not all(torch.equal(a, c) for (a, _), (c, _) in zip(same, other, strict=True))
    assert not torch.equal(same[0][0], same[1][0])  # successive batches differ
    x, y = fixed_batch(tokens, 2, 16, seed=5)
    x2, y2 = fixed_batch(tokens, 2, 16, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.arange(10), 2, 10), "needs at least 11 tokens"),  # inputs and shifted targets need T + 1
        ((torch.arange(10), 0, 4), "batch_size must be a positive"),
        ((torch.arange(10), 2, 0), "seq_len must be a positive"),
        ((torch.arange(10).view(2, 5), 2, 4), "tokens must be a 1-D"),
        ((torch.arange(10.0), 2, 4), "tokens must be int32 or int64"),  # float ids
    ],
    ids=str,
)
def test_batches_bad_arguments(args, words):
    with pytest.raises(ValueError, match=words):
        batches(*args)  # at the call, not at the first next()
    with pytest.raises(ValueError, match=words):
        fixed_batch(*args)
