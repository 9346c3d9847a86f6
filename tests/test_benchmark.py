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
    assert r["fwd"] > 0 and r["fwdbwd"] > 0 and r["peak_mib"] >= 0
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
