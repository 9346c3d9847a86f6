"""``--checkpoint-activations`` and ``--offload-activations`` (fairseq's ``transformer_lm`` and ``transformer``
options) on LION's archs: each layer recomputes its forward in the backward, and the step is the one
without them, dropout masks and autocast included."""
import functools

import pytest
import torch

import lion_fairseq  # noqa: F401  (registers the models in this process)
from conftest import build_model

MODELS = {"masked_lm": ("lion_s_tiny", "lion_lit_tiny"), "language_modeling": ("lion_d_lm_tiny", "lion_s_lm_tiny"),
          "translation": ("lion_s_transformer_tiny",)}
CASES = [(task, arch) for task, archs in MODELS.items() for arch in archs]


def data_dir(tmp_path, task):
    words = "".join(f"w{i} 1\n" for i in range(60))
    for name in (["dict.src.txt", "dict.tgt.txt"] if task == "translation" else ["dict.txt"]):
        (tmp_path / name).write_text(words)
    return tmp_path


def step(tmp_path, task, arch, *flags, autocast=False):
    """(loss, gradients, model) of one training forward+backward of a freshly built model (the same
    weights and dropout masks for every call)."""
    args = ["--arch", arch, "--dropout", "0.3", "--cpu", *flags]
    args += ["-s", "src", "-t", "tgt", "--attention-dropout", "0.1"] if task == "translation" \
        else ["--tokens-per-sample", "48"]
    torch.manual_seed(0)
    _, model = build_model(data_dir(tmp_path, task), task, *args)
    model.train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 64, (3, 40), generator=g)
    tokens[0, :7] = 1  # a left-padded row: the padding mask goes through the recomputation too
    inputs = (tokens, torch.full((3,), 40), torch.randint(4, 64, (3, 20), generator=g)) if task == "translation" \
        else (tokens,)
    torch.manual_seed(2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*inputs)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


def layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith(("EncoderLayer", "DecoderLayer"))]


@pytest.mark.parametrize("task,arch", CASES)
@pytest.mark.parametrize("flag", ["--checkpoint-activations", "--offload-activations"])
def test_recomputed_step_equals_the_kept_one(tmp_path, task, arch, flag):
    loss, grads, plain = step(tmp_path, task, arch)
    loss_r, grads_r, model = step(tmp_path, task, arch, flag)
    assert all(isinstance(m.forward, functools.partial) for m in layers(model)) and layers(model)
    assert not any(isinstance(m.forward, functools.partial) for m in layers(plain))
    # the same parameter names: a checkpoint trained with the flag loads without it, and back
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys() and len(grads) > 10
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name


def test_recomputation_replays_autocast(tmp_path):
    """Under ``--amp`` (autocast) the backward recomputes each layer in the forward's precision: fairseq's
    own wrapper recomputes outside autocast, which gives other gradients."""
    loss, grads, _ = step(tmp_path, "language_modeling", "lion_s_lm_tiny", autocast=True)
    loss_r, grads_r, _ = step(tmp_path, "language_modeling", "lion_s_lm_tiny", "--checkpoint-activations",
                              autocast=True)
    full, grads_full, _ = step(tmp_path, "language_modeling", "lion_s_lm_tiny")
    assert torch.equal(loss, loss_r)
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name
    # the check has teeth: autocast changes the gradients
    assert any(not torch.equal(grads[n], grads_full[n]) for n in grads)


def test_decoding_with_checkpointed_layers_is_unchanged(tmp_path):
    """Inference keeps nothing to recompute: a checkpointed LM's incremental decoding gives the logits of
    the same model without the flag."""
    logits = []
    for flags in ([], ["--checkpoint-activations"]):
        torch.manual_seed(0)
        _, model = build_model(data_dir(tmp_path, "language_modeling"), "language_modeling", "--arch",
                               "lion_s_lm_tiny", "--tokens-per-sample", "48", *flags)
        model.eval()
        tokens = torch.randint(4, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        state, steps = {}, []
        with torch.no_grad():
            for t in range(1, tokens.shape[1] + 1):
                steps.append(model(tokens[:, :t], incremental_state=state)[0][:, -1])
        logits.append(torch.stack(steps, 1))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
