"""The preprocess pipeline: raw text -> sentencepiece -> fairseq binaries, and the GLUE layout.

One user-like subprocess run builds a small corpus shared by the module; other runs call ``main``
in-process (fairseq imported once). Bad inputs must give a clear message, a non-zero exit and no
``--destdir`` (nor a leftover staging folder).
"""
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, corpus_lines

sentencepiece = pytest.importorskip("sentencepiece")
if str(ROOT) not in sys.path:  # `pytest tests` from elsewhere: make the preprocess package importable
    sys.path.insert(0, str(ROOT))

from preprocess import glue as glue_cli  # noqa: E402
from preprocess import text as text_cli  # noqa: E402

N_A, N_B = 300, 200  # lines in the two input files
VOCAB = 400


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m preprocess.<module> ...`` as a user runs it, from a folder outside the checkout: the
    installed package's (setup.py installs preprocess/ with lion_fairseq), not the checkout's by chance."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", f"preprocess.{module}", *args], cwd=tempfile.gettempdir(),
                          env=dict(env, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=300)


def leftovers(parent: Path):
    """Staging folders a run left behind (there must be none)."""
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw")
    lines = corpus_lines(N_A + N_B + 120)
    (root / "a.txt").write_text("\n".join(lines[:N_A]) + "\n", encoding="utf-8")
    # CRLF endings and a BOM, as files from other systems have: neither may reach the data.
    (root / "b.txt").write_bytes(("\ufeff" + "\r\n".join(lines[N_A:N_A + N_B]) + "\r\n").encode("utf-8"))
    (root / "v.txt").write_text("\n".join(lines[N_A + N_B:N_A + N_B + 70]) + "\n", encoding="utf-8")
    (root / "t.txt").write_text("\n".join(lines[N_A + N_B + 70:]) + "\n", encoding="utf-8")
    return root, lines


@pytest.fixture(scope="module")
def text_bin(corpus):
    root, _ = corpus
    out = root / "bin"
    proc = run_module("text", "--input", str(root / "a.txt"), str(root / "b.txt"), "--destdir", str(out),
                      "--vocab-size", str(VOCAB), "--model-type", "unigram", "--character-coverage", "1.0",
                      "--valid-ratio", "0.1", "--test-ratio", "0.05", "--workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def load_split(path: Path, dictionary):
    from fairseq.data import data_utils

    ds = data_utils.load_indexed_dataset(str(path), dictionary)
    assert ds is not None, f"no dataset at {path}"
    return ds


def test_text_layout_and_splits(corpus, text_bin):
    from fairseq.data import Dictionary

    root, lines = corpus
    names = {p.name for p in text_bin.iterdir()}
    for split in ("train", "valid", "test"):
        assert {f"{split}.bin", f"{split}.idx"} <= names
    assert {"dict.txt", "sentencepiece.bpe.model", "preprocess.json"} <= names
    assert "_work" not in names and leftovers(root) == []
    d = Dictionary.load(str(text_bin / "dict.txt"))
    sizes = {s: len(load_split(text_bin / s, d)) for s in ("train", "valid", "test")}
    total = N_A + N_B
    assert sizes == {"train": total - 50 - 25, "valid": 50, "test": 25}  # contiguous tail split
    manifest = json.loads((text_bin / "preprocess.json").read_text())
    assert manifest["splits"]["test"]["source"] == f"input lines {total - 24}-{total} of {total}"


def test_round_trip_and_ids_line_up(corpus, text_bin):
    from fairseq.data import Dictionary

    _, lines = corpus
    sp = sentencepiece.SentencePieceProcessor(model_file=str(text_bin / "sentencepiece.bpe.model"))
    d = Dictionary.load(str(text_bin / "dict.txt"))
    assert sp.get_piece_size() == VOCAB == len(d)
    # Same id, same piece, for every id, specials included.
    assert [d[i] for i in range(len(d))] == [sp.id_to_piece(i) for i in range(VOCAB)]
    assert (d.bos(), d.pad(), d.eos(), d.unk()) == (sp.bos_id(), sp.pad_id(), sp.eos_id(), sp.unk_id())
    expected = {"train": lines[:425], "valid": lines[425:475], "test": lines[475:500]}
    for split, originals in expected.items():
        ds = load_split(text_bin / split, d)
        assert len(ds) == len(originals)
        for i, line in enumerate(originals):
            ids = ds[i].tolist()
            assert ids[-1] == d.eos()
            assert ids[:-1] == sp.encode(line)  # fairseq's ids are the spm ids
            assert sp.decode(ids[:-1]) == line  # no BOM, no '\r', nothing lost


def test_explicit_valid_test_files_reuse_model(corpus, text_bin, tmp_path, capsys):
    from fairseq.data import Dictionary

    root, lines = corpus
    out = tmp_path / "again"
    # each split's option repeated: its files are concatenated, as after one option
    rc = text_cli.main(["--input", str(root / "a.txt"), "--train", str(root / "b.txt"), "--valid",
                        str(root / "v.txt"), "--valid", str(root / "t.txt"), "--test", str(root / "t.txt"),
                        "--spm-model", str(text_bin / "sentencepiece.bpe.model"), "--destdir", str(out)])
    assert rc == 0, capsys.readouterr().err
    words = lambda p: [line.split()[0] for line in p.read_text(encoding="utf-8").splitlines()]  # noqa: E731
    assert words(out / "dict.txt") == words(text_bin / "dict.txt")  # same model, same ids
    d = Dictionary.load(str(out / "dict.txt"))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "sentencepiece.bpe.model"))
    assert len(load_split(out / "train", d)) == N_A + N_B  # the whole input: nothing held out
    valid, test = load_split(out / "valid", d), load_split(out / "test", d)
    assert len(valid) == 70 + len(test) and len(test) == len(lines) - N_A - N_B - 70
    assert sp.decode(valid[3].tolist()[:-1]) == lines[N_A + N_B + 3]
    assert sp.decode(valid[-1].tolist()[:-1]) == lines[-1]
    assert sp.decode(test[-1].tolist()[:-1]) == lines[-1]
    # a validation file that is also trained on: refused (it was kept, and scored the training text)
    rc = text_cli.main(["--input", str(root / "a.txt"), "--valid", str(root / "a.txt"), "--destdir",
                        str(tmp_path / "inside")])
    assert rc == 1 and f"--valid {root / 'a.txt'} is also an --input file" in capsys.readouterr().err
    assert not (tmp_path / "inside").exists()


def write_tsv(path: Path, header, rows):
    body = ["\t".join(header)] if header else []
    path.write_text("\n".join(body + ["\t".join(r) for r in rows]) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def glue_tsvs(corpus):
    root, lines = corpus
    labels = ["entailment", "not_entailment"]
    train = [(str(i), lines[i], lines[i + 100], labels[i % 3 == 0]) for i in range(60)]
    dev = [(str(i), lines[200 + i], lines[250 + i], labels[i % 2]) for i in range(20)]
    test = [(str(i), lines[300 + i], lines[350 + i]) for i in range(12)]
    write_tsv(root / "train.tsv", ["index", "sentence1", "sentence2", "label"], train)
    write_tsv(root / "dev.tsv", ["index", "sentence1", "sentence2", "label"], dev)
    write_tsv(root / "test.tsv", ["index", "sentence1", "sentence2"], test)  # GLUE test: no labels
    return root, train, dev, test


def sentence_prediction_task(data: Path, num_classes: int, regression: bool = False):
    from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

    cfg = SentencePredictionConfig(data=str(data), num_classes=num_classes, max_positions=512,
                                   regression_target=regression, seed=1, no_shuffle=True,
                                   classification_head_name="sentence_classification_head")
    return SentencePredictionTask.setup_task(cfg)


def test_glue_pairs_load_in_sentence_prediction(glue_tsvs, text_bin, tmp_path, capsys):
    root, train, dev, test = glue_tsvs
    out = tmp_path / "rte"
    rc = glue_cli.main(["--train", str(root / "train.tsv"), "--dev", str(root / "dev.tsv"), "--test",
                        str(root / "test.tsv"), "--spm", str(text_bin / "sentencepiece.bpe.model"),
                        "--dict", str(text_bin / "dict.txt"), "--destdir", str(out),
                        "--sentence1-column", "sentence1", "--sentence2-column", "sentence2",
                        "--label-column", "label"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "pass --num-classes 2" in captured.out
    assert (out / "input0" / "dict.txt").read_text() == (text_bin / "dict.txt").read_text()
    assert (out / "label" / "dict.txt").read_text().split() == ["entailment", "40", "not_entailment", "20"]
    assert not (out / "label" / "test.bin").exists() and leftovers(tmp_path) == []
    # the sentencepiece model goes with the data, for the hub (LionRobertaModel.from_pretrained(..., out))
    assert (out / "sentencepiece.bpe.model").read_bytes() == (text_bin / "sentencepiece.bpe.model").read_bytes()

    sp = sentencepiece.SentencePieceProcessor(model_file=str(text_bin / "sentencepiece.bpe.model"))
    task = sentence_prediction_task(out, num_classes=2)
    for split, rows in (("train", train), ("valid", dev), ("test", test)):
        task.load_dataset(split)
        ds = task.dataset(split)
        assert len(ds) == len(rows)
        batch = ds.collater([ds[i] for i in range(len(ds))])  # what training sees (no_shuffle: file order)
        d = task.source_dictionary
        for i, row in enumerate(rows):
            tokens = [t for t in batch["net_input"]["src_tokens"][i].tolist() if t != d.pad()]
            cut = tokens.index(d.eos())  # input0 </s> input1 </s>
            assert sp.decode(tokens[:cut]) == row[1] and sp.decode(tokens[cut + 1:-1]) == row[2]
            assert tokens[-1] == d.eos()
        if split == "test":
            assert "target" not in batch
        else:  # sorted labels: entailment -> class 0, not_entailment -> class 1
            classes = ["entailment", "not_entailment"]
            assert batch["target"].view(-1).tolist() == [classes.index(r[3]) for r in rows]


def test_glue_single_sentence_regression_no_header(corpus, text_bin, tmp_path, capsys):
    root, lines = corpus
    rows = [(f"{i % 5}.{i % 7}", "x", lines[i]) for i in range(30)]
    write_tsv(tmp_path / "train.tsv", None, rows)
    write_tsv(tmp_path / "dev.tsv", None, rows[:8])
    out = tmp_path / "stsb"
    rc = glue_cli.main(["--train", str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"),
                        "--spm", str(text_bin / "sentencepiece.bpe.model"), "--dict",
                        str(text_bin / "dict.txt"), "--destdir", str(out), "--columns", "2,0",
                        "--no-header", "--regression"])
    assert rc == 0, capsys.readouterr().err
    assert not (out / "input1").exists()
    task = sentence_prediction_task(out, num_classes=1, regression=True)
    task.load_dataset("valid")
    ds = task.dataset("valid")
    assert len(ds) == 8
    batch = ds.collater([ds[i] for i in range(len(ds))])
    assert batch["target"].view(-1).tolist() == pytest.approx([float(r[0]) for r in rows[:8]])


def test_glue_label_divisor_scales_regression_labels_and_needs_regression(corpus, text_bin, tmp_path, capsys):
    """STS-B's 0-5 scores divided by 5 as fairseq's RoBERTa recipe does, written without float noise."""
    root, lines = corpus
    rows = [(lines[i], lines[i + 1], label) for i, label in enumerate(["4.2", "0", "5.0", "3.8"] * 4)]
    for split in ("train", "dev"):
        write_tsv(tmp_path / f"{split}.tsv", ("sentence1", "sentence2", "score"), rows)
    common = ["--train", str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"), "--spm",
              str(text_bin / "sentencepiece.bpe.model"), "--dict", str(text_bin / "dict.txt"), "--columns",
              "sentence1,sentence2,score", "--label-divisor", "5"]
    assert glue_cli.main([*common, "--destdir", str(tmp_path / "classes")]) != 0
    assert "--label-divisor divides real-valued labels: it needs --regression" in capsys.readouterr().err
    assert glue_cli.main([*common, "--regression", "--label-divisor", "0", "--destdir", str(tmp_path / "zero")]) != 0
    assert "--label-divisor must be a finite number > 0, got 0.0" in capsys.readouterr().err
    assert glue_cli.main([*common, "--regression", "--destdir", str(tmp_path / "stsb")]) == 0, capsys.readouterr().err
    assert (tmp_path / "stsb" / "label" / "valid.label").read_text().split()[:4] == ["0.84", "0.0", "1.0", "0.76"]


# ---- bad input: clear message, non-zero exit, no destdir that looks complete ---------------------

def _bad_text_inputs(tmp: Path):
    good = tmp / "good.txt"
    good.write_text("\n".join(corpus_lines(40)) + "\n", encoding="utf-8")
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "blank.txt").write_text("\n  \n\n", encoding="utf-8")
    latin = "\n".join(corpus_lines(10)).encode("utf-8").split(b"\n")
    latin[6] += " caf\xe9".encode("latin-1")  # line 7 (1-based): a Latin-1 byte
    (tmp / "latin1.txt").write_bytes(b"\n".join(latin) + b"\n")
    (tmp / "two.txt").write_text("one line\nand another\n", encoding="utf-8")
    (tmp / "corpus.txt.gz").write_bytes(gzip.compress(good.read_bytes()))
    (tmp / "utf16.txt").write_text("one line\nand another\n", encoding="utf-16")
    return good


@pytest.mark.parametrize("case,expected", [
    ("missing", ["--input", "file not found", "nope.txt"]),
    ("empty", ["--input", "empty (0 bytes)", "empty.txt"]),
    ("blank", ["--input", "empty (only 3 blank lines)", "blank.txt"]),
    ("latin1", ["latin1.txt:7:", "not valid UTF-8", "column"]),
    # not text at all: the fix is to unpack or convert, not the Latin-1 hint
    ("gzip", ["corpus.txt.gz: is gzip-compressed; unpack it first"]),
    ("utf16", ["utf16.txt: is UTF-16", "iconv -f utf-16"]),
    ("valid_missing", ["--valid", "file not found", "nope.txt"]),
    # each ratio above 0 holds out a line: two lines leave none for train, which is said, not left out
    ("too_few_lines", ["--input has 2 lines", "1 for valid", "1 for test", "none for train"]),
    ("spm_option_value", ["sentencepiece training failed", "maybe"]),
    ("destdir_under_a_file", ["--destdir: cannot create", "good.txt"]),
])
def test_text_bad_input(tmp_path, case, expected):
    good = _bad_text_inputs(tmp_path)
    out = tmp_path / "out"
    files = {"missing": ["--input", str(tmp_path / "nope.txt")],
             "empty": ["--input", str(tmp_path / "empty.txt")],
             "blank": ["--input", str(good), str(tmp_path / "blank.txt")],
             "latin1": ["--input", str(good), str(tmp_path / "latin1.txt")],
             "gzip": ["--input", str(good), str(tmp_path / "corpus.txt.gz")],
             "utf16": ["--input", str(good), str(tmp_path / "utf16.txt")],
             "valid_missing": ["--input", str(good), "--valid", str(tmp_path / "nope.txt")],
             "too_few_lines": ["--input", str(tmp_path / "two.txt")],
             "spm_option_value": ["--input", str(good), "--spm-option", "byte_fallback=maybe"],
             "destdir_under_a_file": ["--input", str(good)]}[case]
    if case == "destdir_under_a_file":
        out = good / "out"
    proc = run_module("text", *files, "--destdir", str(out), "--vocab-size", "100")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for needle in expected:
        assert needle in last, last
    assert not out.exists() and leftovers(tmp_path) == []


def test_long_lines_and_nel_reach_sentencepiece_and_fairseq_alike(tmp_path, capsys):
    """A paragraph a line may be past sentencepiece's own 4192-byte bound, which left such lines out of its
    training (all of them here: it failed); U+0085, which its normalisation keeps, would make a piece that
    fairseq splits."""
    from fairseq.data import Dictionary

    lines = corpus_lines(1000)
    paragraphs = [" ".join(lines[i:i + 100]) for i in range(0, 400, 10)]
    assert min(len(p.encode()) for p in paragraphs) > 4192
    paragraphs[3] = paragraphs[3].replace(" ", "\x85", 5)
    src = tmp_path / "paragraphs.txt"
    src.write_text("\n".join(paragraphs) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    common = ["--input", str(src), "--destdir", str(out), "--vocab-size", "300", "--valid-ratio", "0.1",
              "--test-ratio", "0"]
    assert text_cli.main(common) == 0, capsys.readouterr().err
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "sentencepiece.bpe.model"))
    dictionary = Dictionary.load(str(out / "dict.txt"))
    train = load_split(out / "train", dictionary)
    assert len(train) == 36
    # fairseq id == sentencepiece id, the NEL read as a space
    assert train[3].tolist() == sp.encode(paragraphs[3].replace("\x85", " ")) + [dictionary.eos()]
    capsys.readouterr()
    # a bound below every line: sentencepiece has nothing to train on, and the message says what to set
    assert text_cli.main(common + ["--force", "--spm-option", "max_sentence_length=1000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: sentencepiece found no line to train on") and "max_sentence_length=N" in err, err


def test_vocab_too_large_says_what_fits(tmp_path, capsys):
    good = _bad_text_inputs(tmp_path)
    out = tmp_path / "out"
    rc = text_cli.main(["--input", str(good), "--destdir", str(out), "--vocab-size", "8000",
                        "--valid-ratio", "0", "--test-ratio", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and err.startswith("error: --vocab-size 8000 is too large"), err
    # sentencepiece got to work (a staging folder existed) but nothing is left behind.
    assert not out.exists() and leftovers(tmp_path) == []
    most = int(err.split("Pass --vocab-size ")[1].split()[0])
    assert 4 < most < 8000
    # The suggestion is right: it fits.
    rc = text_cli.main(["--input", str(good), "--destdir", str(out), "--vocab-size", str(most),
                        "--valid-ratio", "0", "--test-ratio", "0"])
    assert rc == 0, capsys.readouterr().err
    assert len((out / "dict.txt").read_text().splitlines()) == most - 4


@pytest.mark.parametrize("model_type", ["unigram", "char"])  # sentencepiece refuses the first, fits the second
def test_vocab_too_small_says_what_is_needed(tmp_path, capsys, model_type):
    good = _bad_text_inputs(tmp_path)
    out = tmp_path / "out"
    common = ["--input", str(good), "--destdir", str(out), "--valid-ratio", "0", "--test-ratio", "0",
              "--model-type", model_type]
    assert text_cli.main(common + ["--vocab-size", "10"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --vocab-size 10 is too small") and "--character-coverage" in err, err
    assert not out.exists() and leftovers(tmp_path) == []
    need = int(err.split("Pass --vocab-size ")[1].split()[0])
    assert text_cli.main(common + ["--vocab-size", str(need)]) == 0, capsys.readouterr().err
    assert text_cli.main(common + ["--vocab-size", str(need - 1), "--force"]) == 1


def test_failed_rerun_keeps_previous_output(text_bin, corpus, tmp_path, capsys):
    root, _ = corpus
    out = tmp_path / "bin"
    shutil.copytree(text_bin, out)
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    args = ["--input", str(root / "a.txt"), "--destdir", str(out), "--vocab-size", "100000"]
    assert text_cli.main(args) == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err
    assert text_cli.main(args + ["--force"]) == 1  # vocab too large: fails after starting work
    assert "too large" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("case,expected", [
    ("no_column", ["--sentence2-column", "'question'", "train.tsv", "header has"]),
    ("unknown_label", ["dev.tsv:3:", "'maybe'", "never occurs in --train"]),
    ("latin1", ["dev.tsv:2:", "not valid UTF-8"]),
    ("short_row", ["train.tsv:4:", "columns"]),
    ("missing", ["--test", "file not found"]),
    # columns by number on a file without a header (CoLA's): its first row is not silently dropped
    ("headerless", ["train.tsv:1: read as the header", "'not_entailment'", "--no-header"]),
    # real-valued labels read as classes (STS-B without --regression)
    ("real_labels", ["never occurs in --train", "pass --regression"]),
    # ... and an STS-B file without a header, with --regression: its first row is not dropped either
    ("headerless_regression", ["train.tsv:1: read as the header", "--no-header"]),
    ("nan_label", ["train.tsv:3:", "'nan' is not a finite number (--regression)"]),
    # integer classes the training split lacks: no --regression hint
    ("integer_labels", ["dev.tsv:2:", "label '2' never occurs in --train (training labels: 0, 1)"]),
])
def test_glue_bad_input(glue_tsvs, text_bin, tmp_path, capsys, case, expected):
    root, train, dev, _ = glue_tsvs
    header = ["index", "sentence1", "sentence2", "label"]
    write_tsv(tmp_path / "train.tsv", header, train)
    write_tsv(tmp_path / "dev.tsv", header, dev)
    columns = ["--columns", "sentence1,sentence2,label"]
    extra = []
    if case == "no_column":
        columns = ["--sentence1-column", "sentence1", "--sentence2-column", "question",
                   "--label-column", "label"]
    elif case == "unknown_label":
        write_tsv(tmp_path / "dev.tsv", header, [dev[0], (*dev[1][:3], "maybe")])
    elif case == "latin1":
        (tmp_path / "dev.tsv").write_bytes(b"index\tsentence1\tsentence2\tlabel\n0\tna\xefve\tb\tentailment\n")
    elif case == "short_row":
        write_tsv(tmp_path / "train.tsv", header, [train[0], train[1], train[2][:2]])
    elif case == "missing":
        extra = ["--test", str(tmp_path / "nope.tsv")]
    elif case == "headerless":
        (tmp_path / "train.tsv").write_text("".join("\t".join(row) + "\n" for row in train), encoding="utf-8")
        columns = ["--columns", "1,2,3"]
    elif case in ("real_labels", "headerless_regression", "nan_label"):
        scored = [(*row[:3], f"{i / 4:.2f}") for i, row in enumerate(train)]
        write_tsv(tmp_path / "train.tsv", header, scored)
        write_tsv(tmp_path / "dev.tsv", header, [(*row[:3], "0.30") for row in dev])
        if case != "real_labels":
            extra = ["--regression"]
        if case == "headerless_regression":
            (tmp_path / "train.tsv").write_text("".join("\t".join(row) + "\n" for row in scored), encoding="utf-8")
            columns = ["--columns", "1,2,3"]
        elif case == "nan_label":
            write_tsv(tmp_path / "train.tsv", header, [*scored[:1], (*scored[1][:3], "nan"), *scored[2:]])
    elif case == "integer_labels":
        write_tsv(tmp_path / "train.tsv", header, [(*row[:3], str(i % 2)) for i, row in enumerate(train)])
        write_tsv(tmp_path / "dev.tsv", header, [(*row[:3], "2") for row in dev])
    out = tmp_path / "out"
    rc = glue_cli.main(["--train", str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"),
                        *extra,
                        "--spm", str(text_bin / "sentencepiece.bpe.model"), "--dict",
                        str(text_bin / "dict.txt"), "--destdir", str(out), *columns])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and err.startswith("error: "), err
    for needle in expected:
        assert needle in err, err
    assert case != "integer_labels" or "--regression" not in err, err
    assert not out.exists() and leftovers(tmp_path) == []


def test_glue_rejects_dict_of_another_model(glue_tsvs, text_bin, tmp_path, capsys):
    root, *_ = glue_tsvs
    words = (text_bin / "dict.txt").read_text().splitlines()
    (tmp_path / "dict.txt").write_text("\n".join([words[1], words[0], *words[2:]]) + "\n")
    rc = glue_cli.main(["--train", str(root / "train.tsv"), "--dev", str(root / "dev.tsv"), "--spm",
                        str(text_bin / "sentencepiece.bpe.model"), "--dict", str(tmp_path / "dict.txt"),
                        "--destdir", str(tmp_path / "out"), "--columns", "sentence1,label"])
    err = capsys.readouterr().err
    assert rc == 1 and "does not match the sentencepiece model: line 1" in err, err
    assert not (tmp_path / "out").exists()


def test_force_never_replaces_a_folder_that_holds_the_inputs_or_the_current_one(glue_tsvs, text_bin, corpus,
                                                                                 tmp_path, capsys, monkeypatch):
    """--force replaces earlier output, not the pretraining data a GLUE run reads its --spm and --dict from,
    nor the folder of the TSVs or texts, nor the current folder: each of those is refused with the input it
    holds named, and left as it was (before, the pretraining binaries or the TSVs were deleted, exit 0)."""
    root, _, _, _ = glue_tsvs
    pre, raw = tmp_path / "pre", tmp_path / "raw"
    shutil.copytree(text_bin, pre)
    shutil.copytree(root, raw)
    shutil.copy(corpus[0] / "a.txt", raw / "a.txt")
    snapshot = lambda d: sorted((p.name, p.stat().st_size) for p in d.iterdir())  # noqa: E731
    before = snapshot(pre), snapshot(raw)
    glue = ["--train", str(raw / "train.tsv"), "--dev", str(raw / "dev.tsv"), "--spm",
            str(pre / "sentencepiece.bpe.model"), "--dict", str(pre / "dict.txt"), "--columns",
            "sentence1,sentence2,label", "--force"]
    for destdir, option in ((pre, "--spm"), (raw, "--train")):
        assert glue_cli.main(glue + ["--destdir", str(destdir)]) == 1
        err = capsys.readouterr().err
        assert f"holds this run's input ({option}" in err and "another folder" in err, err
    assert text_cli.main(["--input", str(raw / "a.txt"), "--destdir", str(raw), "--force"]) == 1
    assert "holds this run's input (--input" in capsys.readouterr().err
    monkeypatch.chdir(raw)
    assert text_cli.main(["--input", str(corpus[0] / "a.txt"), "--destdir", ".", "--force"]) == 1
    assert "is the current folder" in capsys.readouterr().err
    assert (snapshot(pre), snapshot(raw)) == before and leftovers(tmp_path) == [] and leftovers(raw) == []


def test_class_ids_and_held_out_lines_are_numbered_as_a_reader_expects():
    """Integer GLUE labels take class ids in numeric order (STS-like '10' after '2'), and a held-out share
    rounds (5% of 39 lines is 2, not 1)."""
    assert glue_cli._label_order(["10", "2", "-1", "2"]) == ["-1", "2", "10"]
    assert glue_cli._label_order(["neutral", "entailment"]) == ["entailment", "neutral"]
    assert text_cli._held_out(39, 0.05) == 2 and text_cli._held_out(3, 0.05) == 1 and text_cli._held_out(9, 0) == 0


def test_a_staging_folder_left_by_a_killed_run_is_named_and_kept(corpus, text_bin, tmp_path, capsys, caplog):
    """kill -9 leaves its staging folder; the next run into that --destdir says so, and deletes nothing (the
    folder may be another run's, still going, on a shared file system)."""
    root, _ = corpus
    left = tmp_path / ".bin.partial-x1y2"
    (left / "_work").mkdir(parents=True)
    rc = text_cli.main(["--input", str(root / "a.txt"), "--spm-model", str(text_bin / "sentencepiece.bpe.model"),
                        "--destdir", str(tmp_path / "bin")])
    assert rc == 0 and (tmp_path / "bin" / "dict.txt").is_file() and (left / "_work").is_dir(), capsys.readouterr()
    assert f"{left}: staging folder(s) of another run into {tmp_path / 'bin'}" in caplog.text, caplog.text


def test_a_second_interrupt_during_the_cleanup_leaves_no_staging_folder(tmp_path, monkeypatch):
    """Ctrl-C or kill often comes twice (timeout and a terminal signal the whole process group): one arriving
    while the staging folder was being removed left it half removed, hidden beside --destdir."""
    from preprocess import staging

    real, calls = shutil.rmtree, []

    def interrupted_once(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        with staging.staged_destdir(tmp_path / "bin") as stage:
            (stage / "_work").mkdir()
            (stage / "_work" / "train.raw").write_text("a line\n")
            raise KeyboardInterrupt
    assert len(calls) == 2 and leftovers(tmp_path) == [] and not (tmp_path / "bin").exists()


def test_forked_workers_and_a_second_kill_say_nothing_of_their_own(capfd):
    """fairseq's binariser forks pool workers: the process group's Ctrl-C printed each worker's traceback,
    and its kill each worker's "error: terminated" (and the command's own twice). A worker now just ends (130
    on Ctrl-C, killed by SIGTERM) and the command says it once."""
    import signal
    import time

    from preprocess.errors import run_main

    status = {}

    def forks():
        for sig in (signal.SIGINT, signal.SIGTERM):
            pid = os.fork()
            if pid == 0:  # a worker: it must end here whatever happens, never return into pytest
                try:
                    os.kill(os.getpid(), sig)
                    time.sleep(5)
                finally:
                    os._exit(99)
            status[sig] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert run_main(forks) == 0
    assert status == {signal.SIGINT: 130, signal.SIGTERM: -signal.SIGTERM}
    assert capfd.readouterr().err == ""

    def killed_twice():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            try:  # the group's second kill, during the cleanup
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except SystemExit:
                pass

    with pytest.raises(SystemExit):
        run_main(killed_twice)
    assert capfd.readouterr().err.count("error: terminated") == 1


def test_destdir_through_a_symlink_and_paths_fairseq_cannot_read(corpus, tmp_path, capsys, monkeypatch):
    """A --destdir that is a symlink gets the output in the folder it points to, the link kept (the final
    rename met the link: a traceback after all the work, the finished output left in a hidden folder). A
    path with ':' is refused first (fairseq-train splits its data path there), and a final rename that fails
    (a mount point, say) stops with one line, the previous output in place and nothing left behind."""
    root, _ = corpus
    text = ["--input", str(root / "a.txt"), "--vocab-size", str(VOCAB), "--valid-ratio", "0.1", "--test-ratio", "0.05"]
    target, link = tmp_path / "scratch" / "target", tmp_path / "link"
    target.mkdir(parents=True)
    link.symlink_to(target)
    assert text_cli.main(text + ["--destdir", str(link)]) == 0, capsys.readouterr().err
    assert link.is_symlink() and (target / "dict.txt").is_file() and (target / "train.bin").is_file()
    assert leftovers(tmp_path) == [] and leftovers(target.parent) == []
    assert text_cli.main(text + ["--destdir", str(tmp_path / "a:b")]) == 1
    assert "fairseq-train splits its data path on ':'" in capsys.readouterr().err
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert text_cli.main(text + ["--destdir", str(loop)]) == 1
    assert f"--destdir: {loop} cannot be resolved" in capsys.readouterr().err
    with monkeypatch.context() as m:  # a mount point cannot be renamed over: refused before the work
        m.setattr(os.path, "ismount", lambda p: Path(p) == target)
        assert text_cli.main(text + ["--destdir", str(link), "--force"]) == 1
        assert "is a mount point" in capsys.readouterr().err
    before = sorted(p.name for p in target.iterdir())
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: real_replace(a, b) if ".old-" in str(b) or ".old-" in str(a)
                        else (_ for _ in ()).throw(OSError(16, "Device or resource busy")))
    assert text_cli.main(text + ["--destdir", str(link), "--force"]) == 1
    err = capsys.readouterr().err
    assert "cannot put the output in place" in err and "Device or resource busy" in err and "Traceback" not in err
    assert sorted(p.name for p in target.iterdir()) == before and leftovers(target.parent) == []


def test_previous_output_that_cannot_be_moved_aside_stays_with_nothing_left(corpus, tmp_path, capsys, monkeypatch):
    """The previous output cannot be moved aside (the first of the final renames fails): it stays as it was,
    the run stops with one line, and the empty folder made to hold it is removed with the staging folder."""
    root, _ = corpus
    text = ["--input", str(root / "a.txt"), "--vocab-size", str(VOCAB), "--valid-ratio", "0.1", "--test-ratio", "0.05"]
    out = tmp_path / "bin"
    assert text_cli.main(text + ["--destdir", str(out)]) == 0, capsys.readouterr().err
    before = sorted(p.name for p in out.iterdir())
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(13, "Permission denied"))
                        if ".old-" in str(b) else real_replace(a, b))
    assert text_cli.main(text + ["--destdir", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert "cannot put the output in place" in err and "Permission denied" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == before and leftovers(tmp_path) == []


def test_utf16_of_either_byte_order_and_gzip_are_named(tmp_path):
    """In-process (run_module's subprocess runs the installed package): a UTF-16 file with either BOM, and a
    gzip file, are named as such on line 1, not as a Latin-1 byte."""
    from preprocess.errors import PreprocessError
    from preprocess.inputs import iter_lines

    (tmp_path / "le.txt").write_bytes("\ufeffone line\n".encode("utf-16-le"))
    (tmp_path / "be.txt").write_bytes("\ufeffone line\n".encode("utf-16-be"))
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"one line\nand another\n"))
    for name in ("le.txt", "be.txt"):
        with pytest.raises(PreprocessError, match=rf"{name}: is UTF-16"):
            list(iter_lines(tmp_path / name))
    with pytest.raises(PreprocessError, match=r"c\.txt\.gz: is gzip-compressed"):
        list(iter_lines(tmp_path / "c.txt.gz"))
