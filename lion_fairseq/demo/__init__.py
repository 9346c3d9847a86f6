"""The demo (the README's main command): ``python -m lion_fairseq.demo``.

From raw text to trained LION models on a CPU in a few minutes, with no download: the English text of
``pydoc_data.topics`` (or ``--corpus`` files) -> sentencepiece + fairseq binaries (``preprocess.text``)
-> ``fairseq-train`` of a tiny LION-S masked LM and a tiny LION-S causal LM (with
``--tensorboard-logdir``) -> validation loss of each in every ``--lion-form`` (``fairseq-validate`` /
``fairseq-eval-lm`` with ``--model-overrides``) -> a filled ``<mask>`` through the hub interface and a
continuation decoded recurrently -> a loss-curve PNG beside the tensorboard logs.

Every fairseq step runs as the console command a user would type, and is printed before it runs.
"""
