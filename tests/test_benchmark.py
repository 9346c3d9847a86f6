"""The benchmark compares like with like: the layers it times have the same shape and parameters."""
import pytest

from lion_fairseq.benchmark import encoder as encoder_bench
from lion_fairseq.benchmark import layer as layer_bench


@pytest.mark.parametrize("variant,extra", [("lit", 0), ("d", layer_bench.HEADS),
                                           ("s", layer_bench.WIDTH * layer_bench.HEADS + layer_bench.HEADS)])
def test_layers_have_softmax_layer_parameters_plus_gates(variant, extra):
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    softmax = layer_bench.build_layer("softmax", "chunk", 64)
    lion = layer_bench.build_layer(variant, "chunk", 64)
    assert count(lion) == count(softmax) + extra


def test_layer_measure_runs_every_mode_and_respects_limits():
    r = layer_bench.measure("s", "recurrent", 48, threads=1, chunk_size=16, repeats=1, modes=["fwd", "fwdbwd"])
    assert r["fwd"] > 0 and r["fwdbwd"] > 0
    r = layer_bench.measure("s", "recurrent", layer_bench.LIMITS[("recurrent", "fwdbwd")] + 1, threads=1,
                            chunk_size=16, repeats=1, modes=["fwdbwd"])
    assert r["fwdbwd"] is None  # past the limit: not run


def test_encoder_benchmark_builds_every_model_without_attention_dropout():
    """RoBERTa's attention dropout of 0.1 would push torch's softmax attention onto its L x L path while
    LION runs with none: the encoder benchmark builds both with 0, as the layer benchmark does."""
    roberta, _ = encoder_bench.build("roberta_base", 16, vocab=100, form="chunk", chunk_size=8)
    assert {layer.self_attn.dropout_module.p for layer in roberta.encoder.sentence_encoder.layers} == {0.0}
    lion, _ = encoder_bench.build("lion_s_tiny", 16, vocab=100, form="chunk", chunk_size=8)
    assert lion.args.attention_dropout == 0


def test_operator_benchmark_records_the_chunk_forms_matmuls():
    """The ceiling the operator benchmark measures is the chunk form's own matmuls: recorded from one
    forward+backward, their multiply-adds are exactly what ``chunk_flops`` counts for the form."""
    import torch

    from lion_fairseq.benchmark import operator as op_bench
    from lion_fairseq.ops import lion_attention

    B, H, L, D, C = 1, 2, 64, 8, 16
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, L, D, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, L, D, generator=g).requires_grad_()
    gates = [torch.full((B, H, L), -0.1, requires_grad=True) for _ in range(2)]
    calls = op_bench.record_gemms(lambda: lion_attention(q, k, v, *gates, form="chunk", chunk_size=C).sum().backward())
    replay = op_bench.replay_gemms(calls, repeats=1)
    assert replay["flops"] == op_bench.chunk_flops(B, H, L, D, D, C)["fwdbwd"]
    assert replay["best"] > 0


def test_uptrain_fine_tunes_the_word_order_task_from_the_pretrained_checkpoint(tmp_path):
    """benchmark.uptrain's GLUE step at tiny size. The word-order task: every dev sentence comes from the
    corpus's held-out splits, and its shuffled twin keeps the first and last words and the same words.
    The fine-tune: at lr 0 the classifier it keeps has every tensor of the checkpoint it started from
    (the strict load copied them all) plus a 2-class head, and a dev accuracy in [0, 1] is read from
    fairseq's log."""
    import torch

    from lion_fairseq.benchmark import uptrain
    from lion_fairseq.benchmark.quality import prepare_text

    data = prepare_text(tmp_path)
    task = uptrain.prepare_word_order(tmp_path, data)
    tsv = {split: (tmp_path / "word_order" / f"{split}.tsv").read_text().splitlines() for split in ("train", "dev")}
    rows = {split: [line.split("\t") for line in lines[1:]] for split, lines in tsv.items()}  # [sentence, label]
    train_sentences = {s for s, _ in rows["train"]}
    for (original, label), (shuffled, other) in zip(rows["dev"][::2], rows["dev"][1::2]):
        assert (label, other) == ("original", "shuffled") and original not in train_sentences
        a, b = original.split(), shuffled.split()
        assert a != b and (a[0], a[-1]) == (b[0], b[-1]) and sorted(a) == sorted(b)
    assert len(rows["dev"]) > 200 and len(rows["train"]) > 10 * len(rows["dev"])

    # a masked-LM checkpoint of the benchmark's own train(), as its uptrained ones are
    pretrained = uptrain.train(tmp_path, data, "pretrained", ["--arch", "lion_s_tiny"], 2, seed=1, validate_every=2)
    tuned = uptrain.fine_tune(tmp_path, task, "tuned", ["--arch", "lion_s_tiny", "--lr", "0"],
                              pretrained["checkpoint"], seed=1, updates=2)
    assert 0.0 <= tuned["accuracy"] <= 1.0
    start = torch.load(pretrained["checkpoint"], map_location="cpu", weights_only=True)["model"]
    classifier = torch.load(tuned["checkpoint"], map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(classifier[name], tensor) for name, tensor in start.items())
    assert classifier["classification_heads.sentence_classification_head.out_proj.weight"].shape[0] == 2



def test_uptrain_lm_starts_lion_from_a_transformer_lm(tmp_path, monkeypatch):
    """benchmark.uptrain_lm's chain at tiny size, through fairseq-train, python -m lion_fairseq.convert and
    fairseq-eval-lm as a user runs them: a transformer_lm teacher (4 updates), converted to LION-S with its
    tensors as they were, scored at step 0, and uptrained from the teacher with its post-norm structure."""
    import torch

    from lion_fairseq.benchmark import uptrain, uptrain_lm
    from lion_fairseq.benchmark.quality import prepare_text
    from lion_fairseq.demo.commands import python_module, run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the benchmark runs its commands
    data = prepare_text(tmp_path)
    teacher = uptrain.train(tmp_path, data, "teacher", uptrain_lm.TEACHER, 4, seed=1, validate_every=4, what="lm")
    converted = tmp_path / "converted.pt"
    run(python_module("lion_fairseq.convert") + [str(teacher["checkpoint"]), str(converted), "--arch",
                                                  "lion_s_lm_tiny", "--data", str(data)], tmp_path / "convert.log")
    mine = torch.load(converted, map_location="cpu", weights_only=True)["model"]
    taught = torch.load(teacher["checkpoint"], map_location="cpu", weights_only=True)["model"]
    for name in ("decoder.embed_tokens.weight", "decoder.layers.1.self_attn.q_proj.weight", "decoder.layers.1.fc2.bias"):
        assert torch.equal(mine[name], taught[name])
    assert 0 < uptrain_lm.valid_loss(tmp_path, data, converted, "converted") < 20
    up = uptrain.train(tmp_path, data, "uptrained", ["--arch", "lion_s_lm_tiny", *uptrain_lm.STRUCTURE,
                       "--finetune-from-model", str(teacher["checkpoint"])], 2, seed=1, validate_every=2, what="lm")
    assert up["curve"] and up["checkpoint"].exists()


def test_thread_scaling_table_reports_each_count_its_gain_and_speed_ups():
    """The scaling table (SPEC section 6) puts the main run's thread count first; the gain is the fewest
    threads' time over the most's, each speed-up softmax's time over the layer's on the same count, and a
    layer that did not run shows '-' instead of a figure."""
    from lion_fairseq.benchmark.__main__ import SCALING_CONFIGS, scaling_table

    run = lambda s: {16384: {"fwdbwd": s}}  # noqa: E731
    scaling = {2: {"softmax": run(16.0), "lion_s chunk": run(4.0)},
               1: {"softmax": run(30.0), "lion_s chunk": run(7.5), "lion_d chunk": {16384: {"error": "killed"}}}}
    lines = scaling_table(scaling, [16384])
    assert lines[0].split(" | ")[2:4] == ["fwd+bwd s, 2 threads", "fwd+bwd s, 1 thread"]
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines[2:]}
    assert len(rows) == len(SCALING_CONFIGS)
    assert rows["lion_s chunk"][2:] == ["4.000", "7.500", "1.88x", "4.00x", "4.00x"]
    assert rows["softmax"][2:] == ["16.0", "30.0", "1.88x", "1.00x", "1.00x"]
    assert rows["lion_d chunk"][2:] == ["-", "-", "-", "-", "-"]


def test_long_document_scaling_table_compares_each_dtype_with_roberta_in_the_same_dtype():
    """The long-document scaling rows: tokens/s on each thread count, the gain from the fewest threads to
    the most, and the speed-up against roberta_base in the same dtype and on the same count."""
    run = lambda s: {16384: {"infer_s": s}}  # noqa: E731
    scaling = {2: {"lion_s chunk fp32": run(16.0), "lion_s chunk bf16": run(8.0),
                   "roberta_base fp32": run(64.0), "roberta_base bf16": run(16.0)},
               1: {"lion_s chunk fp32": run(32.0), "lion_s chunk bf16": run(16.0),
                   "roberta_base fp32": run(96.0), "roberta_base bf16": {16384: {"error": "killed"}}}}
    lines = encoder_bench.scaling_table(scaling, [16384])
    rows = {tuple(line.split(" | ")[1:3]): line.strip("| ").split(" | ")[3:] for line in lines[2:]}
    assert rows[("lion_s chunk", "fp32")] == ["1024", "512.0", "2.00x", "4.00x", "3.00x"]
    assert rows[("lion_s chunk", "bf16")] == ["2048", "1024", "2.00x", "2.00x", "-"]
    assert rows[("roberta_base", "bf16")] == ["1024", "-", "-", "1.00x", "-"]


def test_targets_tell_a_miss_from_what_was_not_measured():
    """A run at other lengths (--small, --lengths) measured no L = 8192 or 16384: those targets read 'not
    measured', not 'no'; one that was measured reads 'yes' or 'no' against its bound."""
    from lion_fairseq.benchmark.__main__ import configs, targets

    results = {name: {} for name, _, _ in configs()}
    results["softmax"][16384] = {"fwdbwd": 12.0, "peak_mib": 100.0}
    results["lion_s chunk"][16384] = {"fwdbwd": 3.0, "peak_mib": 30.0}
    results["lion_d chunk"][16384] = {"fwdbwd": 6.0}
    lines = targets(results, {}, None, None)[2:]
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ")[1:] for line in lines}
    assert rows["lion_s chunk layer fwd+bwd at L=16384 at least 3.0x faster than softmax"] == ["4.00x", "yes"]
    assert rows["lion_d chunk layer fwd+bwd at L=16384 at least 3.0x faster than softmax"] == ["2.00x", "no"]
    assert rows["lion_s chunk layer fwd+bwd at L=8192 at least 1.6x faster than softmax"] == ["-x", "not measured"]
    assert rows["lion_s chunk layer inference peak memory at L=16384 at most 25% of softmax's"] == ["30.0%", "no"]
    assert rows["lion_d recurrent layer inference peak memory at L=16384 at most 25% of softmax's"][1] == "not measured"
    assert [v for k, v in rows.items() if "decode" in k] == [["-x", "not measured"]]


@pytest.mark.parametrize("module,argv,option", [("__main__", ["--threads", "0"], "--threads"),
                                                ("operator", ["--lengths", "256", "-1"], "--lengths"),
                                                ("quality", ["lm", "--updates", "0"], "--updates"),
                                                ("quality", ["foo"], "foo"),
                                                ("uptrain", ["--updates", "5"], "--updates")])
def test_a_bad_option_is_a_usage_error_naming_it(module, argv, option, capsys):
    import importlib

    main = importlib.import_module(f"lion_fairseq.benchmark.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and option in capsys.readouterr().err


@pytest.mark.parametrize("module", ["__main__", "decode", "encoder", "operator", "quality", "translation", "uptrain",
                                    "uptrain_lm", "gpu"])
def test_every_benchmark_refuses_a_file_for_its_out_folder(module, tmp_path, capsys):
    """``--out`` naming a file: argparse's usage error naming the option, before any set-up (it was a
    FileExistsError traceback from mkdir, after the set-up, where it came to write)."""
    import importlib

    taken = tmp_path / "results.md"
    taken.write_text("")
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"lion_fairseq.benchmark.{module}").main(["--out", str(taken)])
    assert stopped.value.code == 2
    assert f"argument --out: {taken} is a file: pass a folder for the results" in capsys.readouterr().err
