"""Long Range Arena: the orderings, the two-scan attention, the generators, the converters of every
release layout, and each ``lra_*`` task training a few updates through fairseq-train on a tiny sample
written in its real layout (TSV, aclImdb folders, CIFAR-10 pickles, Pathfinder PNG folders)."""
import json
import os
import pickle
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch

import lion_fairseq  # noqa: F401  (registers tasks, models and criterions, as --user-dir does)
from conftest import ROOT, USER_DIR, build_model, fairseq_cli
from lion_fairseq.lra import listops, pathfinder
from lion_fairseq.lra.ordering import ORDERS, col_snake, inverse, ordering, row_snake
from lion_fairseq.modules.lion_attention import LionAttention
from lion_fairseq.modules.two_scan_attention import LionTwoScanAttention
from preprocess import lra as prep
from reference import reference_mask
import warm_python

FORMS = ("parallel", "chunk", "recurrent")


# ---- orderings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("height,width", [(1, 1), (1, 5), (4, 1), (2, 3), (5, 4), (32, 32)])
@pytest.mark.parametrize("name", ORDERS)
def test_orderings_are_permutations_whose_inverse_restores(name, height, width):
    perm = ordering(name, height, width)
    assert sorted(perm.tolist()) == list(range(height * width))
    x = torch.randn(3, height * width, 2)
    assert torch.equal(x[:, perm][:, inverse(perm)], x)
    assert torch.equal(inverse(perm)[perm], torch.arange(height * width))


@pytest.mark.parametrize("height,width", [(2, 3), (5, 4), (7, 7)])
def test_snakes_step_to_a_neighbouring_pixel_every_time(height, width):
    for perm in (row_snake(height, width), col_snake(height, width)):
        r, c = perm // width, perm % width
        assert ((r[1:] - r[:-1]).abs() + (c[1:] - c[:-1]).abs()).eq(1).all()


def test_snake_orders_on_a_small_grid():
    # 0 1 2
    # 3 4 5
    assert row_snake(2, 3).tolist() == [0, 1, 2, 5, 4, 3]
    assert col_snake(2, 3).tolist() == [0, 3, 4, 1, 2, 5]
    with pytest.raises(ValueError, match="ordering"):
        ordering("spiral", 2, 2)


# ---- two-scan attention -----------------------------------------------------------------------------------

def _two_scan(variant: str, form: str = "parallel", height: int = 3, width: int = 4, seed: int = 0,
              **kw) -> LionTwoScanAttention:
    torch.manual_seed(seed)
    m = LionTwoScanAttention(8, 2, variant, height=height, width=width, form=form, chunk_size=5, **kw).double()
    with torch.no_grad():  # different gates per scan, and strong enough decay to matter
        if variant == "d":
            m.gate_logit.copy_(torch.tensor([2.0, -1.0]))
            m.col_gate_logit.copy_(torch.tensor([-0.5, 0.5]))
    return m


def _dense_two_scan(m: LionTwoScanAttention, x: torch.Tensor, pad=None) -> torch.Tensor:
    """The definition: average the two scans' masks in grid coordinates, then normalised attention."""
    q, k, v = (m._heads(p(x)) for p in (m.q_proj, m.k_proj, m.v_proj))
    q, k = m.phi(q), m.phi(k)
    B, H, T, _ = q.shape
    masks = []
    for scan in range(2):
        perm = m.perms[scan]
        fwd, bwd = m._directional_gates(m._scan_log_gates(x[perm], scan))
        ones = torch.zeros(B, H, T, dtype=torch.float64)
        # the gates are float32 by design; their products are taken in float64, as the parallel form does
        f = (fwd.double().expand(B, H, T) if fwd is not None else ones).exp()
        b = (bwd.double().expand(B, H, T) if bwd is not None else ones).exp()
        inv = m.inverses[scan]
        masks.append(reference_mask(f, b, causal=False)[..., inv, :][..., :, inv])  # scan -> grid coordinates
    A = (q @ k.transpose(-1, -2)) * (masks[0] + masks[1]) / 2
    if pad is not None:
        A = A.masked_fill(pad[:, None, None, :], 0.0)
    y = (A @ v) / (A.sum(-1, keepdim=True) + m.eps)
    return m._output(y, x)


@pytest.mark.parametrize("variant", ["lit", "d", "s"])
def test_two_scan_is_the_average_of_two_snake_masks_in_every_form(variant):
    x = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 9:] = True  # padding works too (images have none, but the module must not mix it in)
    m = _two_scan(variant)
    want = _dense_two_scan(m, x, pad)
    grads = {}
    for form in FORMS:
        m.form = form
        y = m(x, key_padding_mask=pad)
        torch.testing.assert_close(y, want, rtol=1e-9, atol=1e-10, msg=f"{variant} {form}")
        grads[form] = torch.autograd.grad(y.square().sum(), [x] + list(m.parameters()))
    for form in ("chunk", "recurrent"):
        for g, g_ref in zip(grads[form], grads["parallel"]):
            torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-10)
    if variant == "s":  # the column scan's own gate is trained
        assert grads["parallel"][-2].abs().sum() > 0  # col_gate_proj.weight


def test_two_scan_differs_from_one_scan_only_through_the_masks():
    """lit has no decay: both masks are all ones, so it equals ordinary LION-LIT attention; LION-D's
    decays make the snake masks differ from each other and from row-major."""
    x = torch.randn(12, 2, 8, dtype=torch.float64)
    two = _two_scan("lit")
    one = LionAttention(8, 2, "lit", form="parallel").double()
    one.load_state_dict(two.state_dict())
    torch.testing.assert_close(two(x), one(x), rtol=1e-9, atol=1e-10)
    two_d = _two_scan("d")
    one_d = LionAttention(8, 2, "d", form="parallel").double()
    one_d.load_state_dict({k: v for k, v in two_d.state_dict().items() if not k.startswith("col_")})
    assert (two_d(x) - one_d(x)).abs().max() > 1e-3


def test_two_scan_refuses_a_sequence_of_the_wrong_size():
    with pytest.raises(ValueError, match="3x4 grid"):
        _two_scan("s")(torch.randn(11, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="two-scan attention is bidirectional"):  # else it ran bidirectional
        _two_scan("s", causal=True)


# ---- generators -----------------------------------------------------------------------------------------

def test_listops_values_and_release_format():
    tree = ("[MAX", [2, 9, ("[MIN", [4, 7]), 0])
    assert listops.evaluate(tree) == 9
    assert listops.tokens(tree) == "[MAX 2 9 [MIN 4 7 ] 0 ]".split()
    assert listops.to_release_string(("[MAX", [2, 9])) == "( ( ( [MAX 2 ) 9 ) ] )"
    assert listops.tokens_of(listops.to_release_string(tree)) == listops.tokens(tree)
    assert listops.evaluate(("[SM", [7, 8, 9])) == 4
    assert listops.evaluate(("[MED", [1, 9, 4, 6])) == 5  # int(median) = int(5.0)
    assert listops.evaluate(("[MED", [1, 2])) == 1  # int(1.5)
    rows = listops.generate(30, random.Random(0), min_length=50, max_length=120)
    assert len({s for s, _ in rows}) == 30
    for s, value in rows:
        assert 50 <= len(listops.tokens_of(s)) <= 120 and 0 <= value <= 9
        assert s.count("(") == s.count(")")


def test_listops_generator_stops_on_settings_that_make_no_more_expressions(tmp_path, monkeypatch, capsys):
    """It looped forever, printing nothing: at depth 2 no expression reaches 20 tokens, and only 410 distinct
    ones of at most 4 tokens exist with two arguments."""
    monkeypatch.setattr(listops, "MAX_MISSES", 20000)
    with pytest.raises(ValueError, match=r"no new expression of 20 to 40 tokens in 20,000 draws \(--max-depth 2, "
                                         r"--max-args 10, --op-prob 0.25; 0 of 5 made\).*Raise --max-depth"):
        listops.generate(5, random.Random(0), min_length=20, max_length=40, max_depth=2)
    with pytest.raises(SystemExit):
        listops.main(["--output-dir", str(tmp_path), "--num-train", "500", "--min-length", "1", "--max-length", "4",
                      "--max-depth", "2", "--max-args", "2"])
    assert "error: train: no new expression of 1 to 4 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        listops.main(["--output-dir", str(tmp_path), "--min-length", "100", "--max-length", "50"])
    assert "error: --min-length 100 is above --max-length 50" in capsys.readouterr().err


def test_listops_generator_keeps_an_expression_out_of_a_second_split(tmp_path):
    """Short expressions repeat often: each split still holds only expressions the others do not (else the
    test accuracy would count memorised training items)."""
    listops.main(["--output-dir", str(tmp_path), "--num-train", "40", "--num-valid", "40", "--num-test", "40",
                  "--min-length", "3", "--max-length", "4", "--max-args", "2", "--seed", "0"])
    splits = [{line.split("\t")[0] for line in (tmp_path / f"basic_{split}.tsv").read_text().split("\n")[1:] if line}
              for split in ("train", "val", "test")]
    assert [len(s) for s in splits] == [40, 40, 40]
    assert not (splits[0] & splits[1] or splits[0] & splits[2] or splits[1] & splits[2])


def test_generators_have_a_help(capsys):
    for module in (listops, pathfinder):
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--help"])
        assert exit_info.value.code == 0 and "--output-dir" in capsys.readouterr().out


def test_pathfinder_generator_writes_the_release_layout(tmp_path, capsys):
    written = pathfinder.write_release(tmp_path, 6, size=32, per_folder=4, seed=1)
    lines = (tmp_path / "curv_contour_length_14" / "metadata" / "1.npy").read_text().split("\n")
    assert lines[0].split()[:2] == ["imgs/1", "sample_4.png"]
    index = prep.pathfinder_index(tmp_path / "curv_contour_length_14")
    assert [(p, label) for p, label in index] == written
    # another difficulty than the folder holds: the message names the one it does
    assert prep.main(["pathfinder", "--input-dir", str(tmp_path), "--difficulty", "curv_baseline", "--destdir",
                      str(tmp_path / "bin")]) == 1
    assert "holds curv_contour_length_14: pass --difficulty curv_contour_length_14" in capsys.readouterr().err
    img = np.asarray(__import__("PIL.Image", fromlist=["Image"]).open(written[0][0]))
    assert img.shape == (32, 32) and img.max() == 255 and (img == 0).mean() > 0.5


def test_pathfinder_markers_end_one_curve_when_connected_and_two_otherwise(monkeypatch):
    """The label is the picture: 1 puts the two markers on the two ends of one curve, 0 on ends of two
    different curves (each drawn); every image is otherwise alike, so a wrong negative would be unlearnable."""
    curves, markers = [], []
    draw_curve, draw_marker = pathfinder._curve, pathfinder._draw_marker
    monkeypatch.setattr(pathfinder, "_curve", lambda *a: curves.append(draw_curve(*a)) or curves[-1])
    monkeypatch.setattr(pathfinder, "_draw_marker", lambda img, p, *a: markers.append(p) or draw_marker(img, p, *a))
    rng = np.random.default_rng(0)
    for connected in (True, False, True, False):
        curves.clear(), markers.clear()
        img, label = pathfinder.sample(rng, 32, connected)
        assert label == int(connected) and len(markers) == 2 and not np.array_equal(*markers)
        ended = [[i for i, c in enumerate(curves) if any(np.array_equal(m, end) for end in (c[0], c[-1]))]
                 for m in markers]
        assert all(len(on) == 1 for on in ended), ended  # each marker ends exactly one curve
        assert (ended[0] == ended[1]) == connected
        assert all(img[tuple(np.round(m).astype(int))] == 255 for m in markers)


# ---- converters and tasks, through fairseq-train ----------------------------------------------------------

COMMON = ["--user-dir", USER_DIR, "--cpu", "--num-workers", "0", "--seed", "1", "--criterion", "lion_classification",
          "--optimizer", "adam", "--lr", "0.003", "--log-format", "json", "--log-interval", "1",
          "--no-progress-bar", "--no-epoch-checkpoints", "--best-checkpoint-metric", "accuracy",
          "--maximize-best-checkpoint-metric"]


def _records(out: str, tag: str) -> List[Dict]:
    return [json.loads(m.group(1)) for m in re.finditer(rf"\| {tag} \| (\{{.*\}})", out)]


def _train(data: Path, save: Path, task: str, *extra: str, updates: int = 3, batch: int = 4) -> str:
    proc = fairseq_cli("train", str(data), *COMMON, "--task", task, "--save-dir", str(save),
                       "--max-update", str(updates), "--batch-size", str(batch), *extra)
    out = proc.stdout + proc.stderr
    inner = _records(out, "train_inner")
    assert len(inner) == updates
    for r in inner:
        assert np.isfinite(float(r["loss"])) and 0 <= float(r["accuracy"]) <= 100
    assert (save / "checkpoint_last.pt").is_file()
    return out


def _preprocess(*argv: str) -> Path:
    assert prep.main(list(argv)) == 0
    return Path(argv[argv.index("--destdir") + 1])


def _valid_count(out: str) -> int:
    return int(_records(out, "valid")[-1]["valid_examples"])


def test_listops_generated_tsv_to_training(tmp_path):
    listops.main(["--output-dir", str(tmp_path / "tsv"), "--num-train", "12", "--num-valid", "5", "--num-test", "3",
                  "--min-length", "20", "--max-length", "200", "--seed", "3"])
    assert (tmp_path / "tsv" / "basic_val.tsv").read_text().startswith("Source\tTarget\n")
    data = _preprocess("listops", "--input-dir", str(tmp_path / "tsv"), "--destdir", str(tmp_path / "bin"))
    meta = json.loads((data / "lra.json").read_text())
    assert meta["splits"]["valid"]["items"] == 5 and meta["splits"]["train"]["longest"] <= 200
    # through the recipe, which runs fairseq-train and then fairseq-validate on the test split
    env = warm_python.on_path(dict(os.environ, ARCH="lion_s_lra_tiny", MAX_UPDATE="3", BATCH_SIZE="4",
                                   VALIDATE_INTERVAL="3", LOG_INTERVAL="1",
                                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"))
    proc = subprocess.run(["bash", str(ROOT / "user_dir_examples" / "lra" / "train.sh"), "listops", str(data),
                           str(tmp_path / "ck"), "--lion-form", "recurrent", "--cpu", "--num-workers", "0"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert len(_records(out, "train_inner")) == 3
    assert _valid_count(out) == 5  # every valid example counted (fairseq's batching would drop some)
    test = _records(out, "test")[-1]
    assert int(test["test_examples"]) == 3 and 0 <= float(test["test_accuracy"]) <= 100
    # a hub class given the classifier says what does load it (it pointed to fairseq's generic hub, which
    # cannot classify), and that way gives the class logits
    from fairseq import checkpoint_utils

    from lion_fairseq import LionRobertaModel

    with pytest.raises(TypeError, match="holds a LionLRAModel .*an LRA classifier: fairseq-validate"):
        LionRobertaModel.from_pretrained(str(tmp_path / "ck"), "checkpoint_best.pt", str(data))
    (model,), _ = checkpoint_utils.load_model_ensemble([str(tmp_path / "ck" / "checkpoint_best.pt")])
    tokens = torch.randint(4, 10, (2, 30))
    assert model.eval()(tokens, torch.tensor([30, 30])).shape == (2, 10)


def test_text_imdb_folder_to_training(tmp_path):
    rng = random.Random(0)
    for split, n in (("train", 6), ("test", 3)):
        for label in ("pos", "neg"):
            folder = tmp_path / "aclImdb" / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                words = [label] + rng.choices(["great", "awful", "film", "plot", "é"], k=rng.randint(5, 60))
                (folder / f"{i}_7.txt").write_text(" ".join(words), encoding="utf-8")
    data = _preprocess("text", "--imdb-dir", str(tmp_path / "aclImdb"), "--destdir", str(tmp_path / "bin"),
                       "--max-length", "100")
    from fairseq.data import data_utils
    ds = data_utils.load_indexed_dataset(str(data / "input0" / "train"), None)
    assert len(ds) == 12 and max(ds.sizes) <= 100
    labels = data_utils.load_indexed_dataset(str(data / "label" / "train"), None)
    assert sorted((int(labels[i][0]), bytes((ds[i] - 4).tolist())[:3]) for i in range(12)) == \
        [(0, b"neg")] * 6 + [(1, b"pos")] * 6  # aclImdb's pos reviews are class 1
    # the aclImdb folder given as --input-dir, as every other kind takes its release folder: the same binaries
    again = _preprocess("text", "--input-dir", str(tmp_path / "aclImdb"), "--destdir", str(tmp_path / "again"),
                        "--max-length", "100")
    assert (again / "input0" / "train.bin").read_bytes() == (data / "input0" / "train.bin").read_bytes()
    out = _train(data, tmp_path / "ck", "lra_text", "--arch", "lion_d_lra_tiny")
    assert _valid_count(out) == 6


def test_retrieval_tsv_pairs_to_training(tmp_path):
    folder = tmp_path / "tsv_data"
    folder.mkdir()
    rng = random.Random(1)
    for split, n in (("train", 8), ("eval", 4), ("test", 4)):
        rows = [f"{rng.choice(['0', '1.0'])}\tid{i}a\tid{i}b\t{'x' * rng.randint(3, 70)}\t{'paper ' * rng.randint(1, 9)}"
                for i in range(n)]
        (folder / f"new_aan_pairs.{split}.tsv").write_text("\n".join(rows) + "\n")
    data = _preprocess("retrieval", "--input-dir", str(folder), "--destdir", str(tmp_path / "bin"))
    from fairseq.data import data_utils

    first = (folder / "new_aan_pairs.train.tsv").read_text().split("\n")[0].split("\t")
    for side, text in (("input0", first[3]), ("input1", first[4])):  # the two texts, not their ids
        ds = data_utils.load_indexed_dataset(str(data / side / "train"), None)
        assert bytes((ds[0] - 4).tolist()).decode() == text, side
    out = _train(data, tmp_path / "ck", "lra_retrieval", "--arch", "lion_s_lra_tiny", "--lion-form", "chunk",
                 "--lion-chunk-size", "16")
    assert _valid_count(out) == 4

    docs = [data_utils.load_indexed_dataset(str(data / side / "valid"), None) for side in ("input0", "input1")]
    read = sum(int(ds.sizes.sum()) for ds in docs)  # the datasets alive: their sizes are a view of a memory map
    assert int(float(_records(out, "valid")[-1]["valid_ntokens"])) == read  # both documents of each pair
    # logged as fairseq logs its numbers (a string in the json log), not as the tensor the sum is
    assert all(isinstance(r["ntokens"], str) for r in _records(out, "train_inner"))
    assert isinstance(_records(out, "valid")[-1]["valid_ntokens"], str)

    # the shared encoder sees each document alone: a document's vector does not depend on its partner
    # or on the padding its batch-mate forces
    from fairseq import checkpoint_utils
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(tmp_path / "ck" / "checkpoint_last.pt")])
    model = models[0].eval()
    assert model.classifier[0].in_features == 4 * model.cfg.encoder_embed_dim
    short = torch.tensor([[10, 11, 12, 13]])
    batch = torch.tensor([[10, 11, 12, 13, 1, 1, 1], [20, 21, 22, 23, 24, 25, 26]])
    with torch.no_grad():
        torch.testing.assert_close(model.encode(batch)[0], model.encode(short)[0], rtol=1e-5, atol=1e-6)
        assert model(batch, src_tokens_1=batch.flip(0)).shape == (2, 2)
    # a pair is as long as its longer document, which decides its length bucket and --max-tokens budget
    task.load_dataset("valid")
    assert (docs[1].sizes > docs[0].sizes).any()  # the second document is the longer one in some pairs
    pairs = task.datasets["valid"]
    assert [pairs.num_tokens(i) for i in range(len(pairs))] == np.maximum(docs[0].sizes, docs[1].sizes).tolist()


def _cifar(folder: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"batch_label": name.encode(), b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, n).tolist(), b"filenames": [b"x.png"] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)


def test_cifar_grayscale_tokens():
    data = np.zeros((1, 3072), dtype=np.uint8)
    data[0, 0] = 255  # pixel 0 pure red
    data[0, 1024 + 1] = 255  # pixel 1 pure green
    data[0, 2048 + 2] = 255  # pixel 2 pure blue
    gray = prep.cifar_tokens(data, rgb=False)[0] - 4
    assert gray[:4].tolist() == [76, 150, 29, 0]  # round(255 * (0.299, 0.587, 0.114))
    assert (prep.cifar_tokens(data, rgb=True)[0, :6] - 4).tolist() == [255, 0, 0, 0, 255, 0]


def test_image_cifar_pickles_to_training_with_two_snakes(tmp_path):
    _cifar(tmp_path / "cifar-10-batches-py", 2, seed=0)
    data = _preprocess("image", "--input-dir", str(tmp_path / "cifar-10-batches-py"), "--destdir",
                       str(tmp_path / "bin"), "--valid-size", "3")
    meta = json.loads((data / "lra.json").read_text())
    assert meta["image_size"] == 32 and [meta["splits"][s]["items"] for s in ("train", "valid", "test")] == [7, 3, 2]
    out = _train(data, tmp_path / "ck", "lra_image", "--arch", "lion_s_lra_tiny", "--lion-order", "two_snake",
                 "--lion-form", "chunk", "--encoder-layers", "1")
    assert _valid_count(out) == 3

    # the trained two-scan model gives the same logits in every form (switched on the checkpoint)
    from fairseq import checkpoint_utils
    from lion_fairseq.modules.two_scan_attention import LionTwoScanAttention as TwoScan
    logits = {}
    for form in FORMS:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(tmp_path / "ck" / "checkpoint_last.pt")], arg_overrides={"lion_form": form})
        model = models[0].eval()
        assert all(isinstance(layer.self_attn, TwoScan) and layer.self_attn.form == form
                   for layer in model.encoder.layers)
        task.load_dataset("valid")
        tokens = torch.stack([task.datasets["valid"][i]["net_input.src_tokens"] for i in range(2)])
        with torch.no_grad():
            logits[form] = model(tokens)
    for form in ("chunk", "recurrent"):
        torch.testing.assert_close(logits[form], logits["parallel"], rtol=1e-4, atol=1e-5)


def test_image_rgb_pixels_are_three_tokens_of_a_row_in_the_grid(tmp_path):
    """``--rgb`` puts a pixel's R, G and B side by side in its row: the task's grid is 32 x 96 tokens, which
    the snake orderings walk whole (on a 32 x 32 grid they would refuse the 3072 tokens)."""
    _cifar(tmp_path / "cifar-10-batches-py", 1, seed=0)
    data = _preprocess("image", "--input-dir", str(tmp_path / "cifar-10-batches-py"), "--destdir",
                       str(tmp_path / "bin"), "--valid-size", "1", "--rgb")
    task, model = build_model(data, "lra_image", "--arch", "lion_s_lra_tiny", "--lion-order", "row_snake",
                              "--encoder-layers", "1")
    assert task.image_size == (32, 96)
    task.load_dataset("valid")
    tokens = task.datasets["valid"][0]["net_input.src_tokens"][None]
    assert tokens.shape == (1, 3072)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(tokens)).all()


def test_two_snake_takes_every_layer_under_layerdrop_and_says_lit_gains_nothing(tmp_path, caplog):
    """With --encoder-layerdrop the two-scan attention went into the layers that fairseq's LayerDropModuleList
    happened to yield at build time (train mode), and the checkpoint then fit no model. LION-LIT has no decay,
    so its two scans' masks are both all ones: two_snake is row_major at twice the cost, which fairseq-train
    says (a run started so still resumes)."""
    import logging

    from lion_fairseq.modules.two_scan_attention import LionTwoScanAttention

    _cifar(tmp_path / "cifar-10-batches-py", 1, seed=0)
    data = _preprocess("image", "--input-dir", str(tmp_path / "cifar-10-batches-py"), "--destdir",
                       str(tmp_path / "bin"), "--valid-size", "1")
    _, model = build_model(data, "lra_image", "--arch", "lion_d_lra_tiny", "--lion-order", "two_snake",
                           "--encoder-layers", "4", "--encoder-layerdrop", "0.99")
    assert all(isinstance(model.encoder.layers[i].self_attn, LionTwoScanAttention) for i in range(4))
    with caplog.at_level(logging.WARNING, logger="lion_fairseq.models.lion_lra"):
        build_model(data, "lra_image", "--arch", "lion_lit_lra_tiny", "--lion-order", "two_snake")
    assert "LION-LIT has no decay: both masks are all ones" in caplog.text


def test_hydra_model_name_of_an_arch_keeps_its_dropout(tmp_path):
    """fairseq-hydra-train merges the dataclass defaults before the arch function runs (SPEC section 7):
    ``model: {_name: lion_s_lra_image}`` gets the image arch's dropout, as ``--arch`` does, and the
    model's own name the base 0.1."""
    from fairseq import tasks
    from fairseq_cli.hydra_train import add_defaults
    from omegaconf import OmegaConf

    _cifar(tmp_path / "cifar-10-batches-py", 2, seed=0)
    data = _preprocess("image", "--input-dir", str(tmp_path / "cifar-10-batches-py"), "--destdir",
                       str(tmp_path / "bin"), "--valid-size", "3")
    for arch, dropout in (("lion_s_lra_image", 0.3), ("lion_d_lra_pathfinder", 0.2), ("lion_lit_lra_tiny", 0.1),
                          ("lion_lra", 0.1)):
        cfg = OmegaConf.create({"task": {"_name": "lra_image", "data": str(data)}, "model": {"_name": arch}})
        add_defaults(cfg)
        model = tasks.setup_task(cfg.task).build_model(cfg.model)
        assert (model.encoder.dropout_module.p, model.classifier[2].p) == (dropout, dropout), arch


def test_pathfinder_png_folders_to_training_in_snake_order(tmp_path):
    # the generator's and the preprocessing's default difficulties are the same folder
    pathfinder.write_release(tmp_path / "pathfinder32", 20, size=32, seed=2)
    data = _preprocess("pathfinder", "--input-dir", str(tmp_path / "pathfinder32"), "--destdir", str(tmp_path / "bin"))
    meta = json.loads((data / "lra.json").read_text())
    assert meta["max_length"] == 1024 and [meta["splits"][s]["items"] for s in ("train", "valid", "test")] == [16, 2, 2]
    out = _train(data, tmp_path / "ck", "lra_pathfinder", "--arch", "lion_d_lra_tiny", "--lion-order", "row_snake")
    assert _valid_count(out) == 2
    # the order is what the weights were trained with: resumed in another, the run stops naming it
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", str(data), *COMMON, "--task", "lra_pathfinder",
                           "--save-dir", str(tmp_path / "ck"), "--max-update", "6", "--batch-size", "4", "--arch",
                           "lion_d_lra_tiny", "--lion-order", "col_snake"], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--lion-order row_snake -> --lion-order col_snake" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(ValueError, match="Path-X"):  # 32px data is not Path-X
        from lion_fairseq.tasks.lra import LRAPathXConfig, LRAPathXTask
        LRAPathXTask.setup_task(LRAPathXConfig(data=str(data), seed=1))


def test_pathx_128px_trains_with_two_snakes(tmp_path):
    pathfinder.write_release(tmp_path / "pathfinder128", 10, size=128, seed=3, difficulty="curv_baseline")
    data = _preprocess("pathfinder", "--input-dir", str(tmp_path / "pathfinder128"), "--difficulty", "curv_baseline",
                       "--destdir", str(tmp_path / "bin"))
    out = _train(data, tmp_path / "ck", "lra_pathx", "--arch", "lion_s_lra_tiny", "--lion-order", "two_snake",
                 "--encoder-layers", "1", "--lion-chunk-size", "128", updates=2, batch=2)
    assert _valid_count(out) == 1


# ---- errors -----------------------------------------------------------------------------------------------

def test_tsv_lines_end_at_newlines_only_and_bad_rows_are_named(tmp_path, capsys):
    """A review's stray carriage return stays in it (a CSV reader ended the row there, shifting every later
    line number), a trailing blank line is skipped, a byte-order mark does not hide ListOps' header, and
    what cannot become an item is named by file and line."""
    from fairseq.data import data_utils

    for split in ("train", "dev", "test"):
        (tmp_path / f"{split}.tsv").write_bytes(b"label\ttext\n1\tgood\rfilm\n0\tbad\tone\n\n")
    data = _preprocess("text", "--input-dir", str(tmp_path), "--destdir", str(tmp_path / "bin"))
    ds = data_utils.load_indexed_dataset(str(data / "input0" / "train"), None)
    assert len(ds) == 2 and (ds[0] - 4).tolist() == list(b"good\rfilm")
    assert (ds[1] - 4).tolist() == list(b"bad\tone")  # a tab inside the text is the text's

    (tmp_path / "dev.tsv").write_text("label\ttext\n1\tfine\n0\t\n")
    assert prep.main(["text", "--input-dir", str(tmp_path), "--destdir", str(tmp_path / "empty")]) == 1
    assert f"{tmp_path / 'dev.tsv'}:3: the text: empty" in capsys.readouterr().err
    (tmp_path / "dev.tsv").write_text("label\ttext\n")
    assert prep.main(["text", "--input-dir", str(tmp_path), "--destdir", str(tmp_path / "none")]) == 1
    assert f"{tmp_path / 'dev.tsv'}: no data rows" in capsys.readouterr().err
    assert prep.main(["text", "--input-dir", str(tmp_path), "--destdir", str(tmp_path / "x"),
                      "--max-length", "0"]) == 1
    assert "--max-length must be at least 1, got 0" in capsys.readouterr().err

    listops_dir = tmp_path / "listops"
    listops_dir.mkdir()
    for split in ("train", "val", "test"):
        (listops_dir / f"basic_{split}.tsv").write_text("\ufeffSource\tTarget\n( [MAX 1 2 ] )\t2\n", encoding="utf-8")
    data = _preprocess("listops", "--input-dir", str(listops_dir), "--destdir", str(tmp_path / "listops_bin"))
    assert json.loads((data / "lra.json").read_text())["splits"]["train"]["items"] == 1
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_errors_name_the_file_line_or_option(tmp_path, capsys):
    bad = tmp_path / "tsv"
    bad.mkdir()
    for split in ("train", "val", "test"):
        (bad / f"basic_{split}.tsv").write_text("Source\tTarget\n( [MAX 1 2 ] )\t2\n( [MAX 1 ] )\t12\n")
    assert prep.main(["listops", "--input-dir", str(bad), "--destdir", str(tmp_path / "out")]) == 1
    assert "basic_train.tsv:3: label '12'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    for label in ("nan", "inf"):  # a traceback (int of nan, of inf) before
        (bad / "basic_train.tsv").write_text(f"Source\tTarget\n( [MAX 1 ] )\t{label}\n")
        assert prep.main(["listops", "--input-dir", str(bad), "--destdir", str(tmp_path / "out")]) == 1
        assert f"basic_train.tsv:2: label '{label}' is not a class index in 0..9" in capsys.readouterr().err
    # a training batch's label out of range (only the test batch's was checked: a -1 was written as 65535),
    # and a Pathfinder image that is not square (it was said to differ from itself)
    _cifar(tmp_path / "cifar", 3, seed=0)
    with open(tmp_path / "cifar" / "data_batch_2", "rb") as f:
        batch = pickle.load(f)
    batch[b"labels"][1] = -1
    with open(tmp_path / "cifar" / "data_batch_2", "wb") as f:
        pickle.dump(batch, f)
    assert prep.main(["image", "--input-dir", str(tmp_path / "cifar"), "--destdir", str(tmp_path / "img")]) == 1
    assert f"{tmp_path / 'cifar' / 'data_batch_2'}: label -1 is not a CIFAR-10 class" in capsys.readouterr().err
    from PIL import Image

    pathfinder.write_release(tmp_path / "pf", 4, size=16, seed=0)
    for png in (tmp_path / "pf").rglob("*.png"):
        Image.open(png).crop((0, 0, 16, 8)).save(png)
    assert prep.main(["pathfinder", "--input-dir", str(tmp_path / "pf"), "--destdir", str(tmp_path / "p")]) == 1
    assert "image is 16x8: Pathfinder images are square" in capsys.readouterr().err
    # an option of another kind (it was ignored: --max-length 100 on Pathfinder wrote 1024-token items)
    with pytest.raises(SystemExit):
        prep.main(["pathfinder", "--input-dir", str(tmp_path / "pf"), "--destdir", str(tmp_path / "p"),
                   "--max-length", "100"])
    assert "--max-length applies to listops, text, retrieval, not to pathfinder" in capsys.readouterr().err

    listops.main(["--output-dir", str(tmp_path / "ok"), "--num-train", "2", "--num-valid", "1", "--num-test", "1",
                  "--min-length", "5", "--max-length", "30"])
    data = _preprocess("listops", "--input-dir", str(tmp_path / "ok"), "--destdir", str(tmp_path / "bin"))
    from argparse import Namespace

    from fairseq.models import ARCH_CONFIG_REGISTRY
    from lion_fairseq.models.lion_lra import LionLRAModel
    from lion_fairseq.tasks.lra import LRAImageConfig, LRAImageTask, LRAListOpsConfig, LRAListOpsTask
    with pytest.raises(ValueError, match="holds LRA 'listops' data"):
        LRAImageTask.setup_task(LRAImageConfig(data=str(data), seed=1))
    task = LRAListOpsTask.setup_task(LRAListOpsConfig(data=str(data), seed=1))
    args = Namespace(lion_order="two_snake")
    ARCH_CONFIG_REGISTRY["lion_s_lra_tiny"](args)
    with pytest.raises(ValueError, match="needs a 2-D task"):
        LionLRAModel.build_model(args, task)
    # another model, or fairseq's default criterion (which trained on the class logits without a word)
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match=r"--arch lion_s_tiny: the lra_\* tasks train a LION sequence classifier"):
        task.build_model(OmegaConf.create({"_name": "lion_s_tiny"}))
    with pytest.raises(ValueError, match=r"--criterion cross_entropy: the lra_\* tasks train and validate with "
                                         r"--criterion lion_classification"):
        task.build_criterion(OmegaConf.create({"_name": "cross_entropy"}))


def test_task_options_cut_refuse_and_keep_the_order(tmp_path):
    """``--max-positions`` below the data's length cuts every example to it; a label equal to
    ``--num-classes`` (classes are 0 to N-1) is refused, not trained on; ``--no-shuffle`` keeps the file's
    order among examples of one length."""
    from lion_fairseq.tasks.lra import LRAListOpsConfig, LRAListOpsTask

    tsv = tmp_path / "tsv"
    tsv.mkdir()
    for split in ("train", "val", "test"):
        (tsv / f"basic_{split}.tsv").write_text("Source\tTarget\n( [SM 1 2 3 4 5 6 7 8 ] )\t6\n"
                                                "( [MAX 1 3 ] )\t3\n")
    data = str(_preprocess("listops", "--input-dir", str(tsv), "--destdir", str(tmp_path / "bin")))
    def lengths(**cfg):
        task = LRAListOpsTask.setup_task(LRAListOpsConfig(data=data, seed=1, num_classes=7, **cfg))
        task.load_dataset("train")
        ds = task.dataset("train")
        return sorted(ds[i]["net_input.src_tokens"].numel() for i in range(2)), max(ds.size(i) for i in range(2))

    (short, long), _ = lengths()
    assert short < 8 < long
    assert lengths(max_positions=8) == ([short, 8], 8)
    # --no-shuffle: examples of one length in the file's order, whatever the seed
    for split in ("train", "val", "test"):
        (tsv / f"basic_{split}.tsv").write_text("Source\tTarget\n" + "".join(f"( [MAX {d} 1 ] )\t{d}\n"
                                                                            for d in range(1, 7)))
    data = str(_preprocess("listops", "--input-dir", str(tsv), "--destdir", str(tmp_path / "same_length")))
    for seed in (1, 2, 3):
        task = LRAListOpsTask.setup_task(LRAListOpsConfig(data=data, seed=seed, no_shuffle=True))
        task.load_dataset("train")
        assert list(task.dataset("train").ordered_indices()) == list(range(6)), seed
    task = LRAListOpsTask.setup_task(LRAListOpsConfig(data=data, seed=1, num_classes=6))
    with pytest.raises(ValueError, match="label 6 with --num-classes 6"):
        task.load_dataset("train")


def test_classification_criterion_reports_bits_and_accuracy():
    """lion_classification logs the loss in bits per sequence and the share of argmax hits, in percent, over
    every batch of a validation."""
    import math

    from fairseq import metrics

    from lion_fairseq.criterions.classification import LionClassificationCriterion

    criterion = LionClassificationCriterion(None)
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [1.0, 0.0, 0.5], [0.0, 0.0, 4.0]])
    targets = torch.tensor([0, 1, 2, 0])  # the last two wrong
    logs = []
    for rows in (slice(0, 3), slice(3, 4)):  # two batches
        sample = {"net_input": {"x": logits[rows]}, "target": targets[rows], "ntokens": 10}
        loss, n, log = criterion(lambda x: x, sample)
        assert n == len(targets[rows])
        logs.append(log)
    with metrics.aggregate() as agg:
        criterion.reduce_metrics(logs)
    bits = float(torch.nn.functional.cross_entropy(logits, targets)) / math.log(2)
    assert agg.get_smoothed_values()["loss"] == pytest.approx(bits, abs=1e-3)
    assert agg.get_smoothed_values()["accuracy"] == 50.0 and agg.get_smoothed_values()["examples"] == 4


def test_pathfinder_bad_images_and_splits_are_named(tmp_path, capsys):
    """An unreadable image (corrupt, truncated: PIL's own message names no file), a missing first image, one
    of another size than the first, and a --split that leaves a split empty each stop with one line naming
    the file or the option, not a traceback; nothing is written. A good run ends with its summary line."""
    written = pathfinder.write_release(tmp_path, 20, size=32, per_folder=4, seed=1)
    args = ["pathfinder", "--input-dir", str(tmp_path), "--difficulty", "curv_contour_length_14"]

    def fails(path_or_split, said: str) -> None:
        assert prep.main([*args, "--destdir", str(tmp_path / "bin"), *path_or_split]) == 1
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
        assert not (tmp_path / "bin").exists()

    assert prep.main([*args, "--destdir", str(tmp_path / "ok")]) == 0  # ends saying what it wrote, as the others do
    said = capsys.readouterr().out
    assert f"done: {tmp_path / 'ok'}: pathfinder, train 16 items (longest 1024), valid 2 items" in said
    fails(["--split", "0.98", "0.01", "0.01"], "leaves valid and test no image of the 20")
    first, second = written[0][0], written[1][0]
    second.write_bytes(second.read_bytes()[:60])  # truncated
    fails([], f"{second}: not a readable image")
    second.write_bytes(b"<html>not found</html>")
    fails([], f"{second}: not a readable image")
    PIL_Image = __import__("PIL.Image", fromlist=["Image"])
    PIL_Image.new("L", (16, 16)).save(second)
    fails([], f"{second}: image is 16x16, and the first, {first}, 32x32")
    first.unlink()
    fails([], f"no such image: {first}")
