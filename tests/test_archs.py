"""The archs users type (SPEC section 4) set the sizes and variant the SPEC gives them: run each arch
function as fairseq does on a command line's Namespace, without building the model."""
import argparse

import pytest
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY

import lion_fairseq  # noqa: F401  (registers the archs)

ENCODER = {"": (12, 768, 3072, 12), "_large": (24, 1024, 4096, 16), "_tiny": (2, 128, 512, 2)}
LM = {"": (6, 512, 2048, 8), "_tiny": (2, 128, 512, 2)}
TRANSLATION = {"": (6, 512, 2048, 8), "_iwslt_de_en": (6, 512, 1024, 4), "_tiny": (2, 128, 256, 2)}
VARIANTS = {"lit": "lit", "d": "d", "retnet": "d", "s": "s"}  # LION-RETNET is LION-D


def arch_args(arch: str) -> dict:
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    return vars(args)


def sizes(args: dict, side: str) -> tuple:
    return tuple(args[f"{side}_{k}"] for k in ("layers", "embed_dim", "ffn_embed_dim", "attention_heads"))


CASES = [(f"lion_{v}{s}", "lion_roberta", "encoder", size, VARIANTS[v])
         for v in ("lit", "d", "s") for s, size in ENCODER.items()]
CASES += [("lion_retnet", "lion_roberta", "encoder", ENCODER[""], "d")]
CASES += [(f"lion_{v}_lm{s}", "lion_lm", "decoder", size, VARIANTS[v])
          for v in ("lit", "d", "s") for s, size in LM.items()]
CASES += [("lion_retnet_lm", "lion_lm", "decoder", LM[""], "d"), ("lion_s_lm_plus", "lion_lm", "decoder", LM[""], "s"),
          ("lion_s_lm_plus_tiny", "lion_lm", "decoder", LM["_tiny"], "s")]
CASES += [(f"lion_{v}_transformer{s}", "lion_transformer", side, size, VARIANTS[v])
          for v in ("lit", "d", "s") for s, size in TRANSLATION.items() for side in ("encoder", "decoder")]


@pytest.mark.parametrize("arch,model,side,size,variant", CASES)
def test_arch_sets_the_specs_sizes_and_variant(arch, model, side, size, variant):
    args = arch_args(arch)
    assert ARCH_MODEL_NAME_REGISTRY[arch] == model
    assert sizes(args, side) == size and args["lion_variant"] == variant


@pytest.mark.parametrize("alias,arch", [("lion_retnet", "lion_d"), ("lion_retnet_lm", "lion_d_lm")])
def test_lion_retnet_is_lion_d(alias, arch):
    assert arch_args(alias) == arch_args(arch)


def test_only_the_plus_archs_pull_the_levers():
    """Every paper-named arch stays the paper's model; lion_s_lm_plus is LION-S with the three levers."""
    plain, plus = arch_args("lion_s_lm"), arch_args("lion_s_lm_plus")
    levers = ("lion_gate_temperature", "lion_output_gate", "lion_short_conv")
    assert all(plain.get(k) in (None, False, 0, 1.0) for k in levers), {k: plain.get(k) for k in levers}
    assert plus["lion_gate_temperature"] > 1 and plus["lion_output_gate"] and plus["lion_short_conv"] > 1
    assert {k: v for k, v in plus.items() if k not in levers} == {k: v for k, v in plain.items() if k not in levers}
