from setuptools import find_packages, setup

setup(
    name="lion-fairseq",
    version="0.1.0",
    description="LION (bidirectional linear attention: trains like a Transformer, infers like an RNN) for fairseq",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # preprocess/ (python -m preprocess.text, .glue, .lra) is installed too, so that it runs from any folder
    packages=find_packages(include=["lion_fairseq", "lion_fairseq.*", "preprocess"]),
    # torch is the user's own (CPU wheel here, their CUDA build on a cluster), and fairseq comes from
    # ve-fairseq installed with --no-deps on Python 3.11 (its metadata pulls torchaudio): neither is
    # named here, so installing this package never replaces them. See README "Install".
    install_requires=["numpy", "sentencepiece"],
    extras_require={
        # flash-linear-attention's kernels alone: `flash-linear-attention` adds its models and transformers,
        # and fla-core[cuda] would name torch; Triton comes with the CUDA builds of torch
        "fla": ["fla-core>=0.6.0"],
        "demo": ["tensorboard", "matplotlib"],
        "test": ["pytest", "pytest-xdist", "hypothesis"],
    },
    # the console command lives outside the package, so that it prints the folder without importing fairseq
    py_modules=["lion_fairseq_user_dir"],
    entry_points={"console_scripts": ["lion-fairseq-user-dir = lion_fairseq_user_dir:main"]},
)
