from setuptools import find_packages, setup

setup(
    name="distlm",
    version="0.1.0",
    description="Distributed training of masked and causal language models on PyTorch",
    packages=find_packages(include=["distlm", "distlm.*"]),
    package_data={"distlm.plan": ["profiles/*.toml"]},
    python_requires=">=3.11",  # tomllib
    # torch>=2.6 rather than a pin: Neuron's torch-xla stacks pin their own torch
    # (torch-xla 2.9 needs torch 2.9). CPU installs pin torch==2.13.0 on the command
    # line (see README), because an unpinned torch resolves to a multi-GB CUDA build.
    install_requires=["torch>=2.6", "numpy", "safetensors", "tqdm"],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "mpi": ["mpi4py>=3.1"],
        "bench": ["matplotlib"],
        "hf": ["transformers>=4.40", "tokenizers"],
        # python -m distlm.prepare --input *.parquet
        "data": ["pyarrow"],
        # --tensorboard-logdir, --wandb-project, --mlflow-tracking-uri; distlm.report uses [bench]'s matplotlib.
        "trackers": ["tensorboard", "wandb", "mlflow-skinny"],
        # Tests only: tests/test_examples.py loads examples/parallelcluster/*.yaml through
        # aws-parallelcluster's own schema. It brings the AWS CDK (about 100 packages, 160 MB).
        "cluster": ["aws-parallelcluster>=3.16"],
        "docs": ["mkdocs-material>=9"],
    },
    # One command per `python -m distlm.*` tool, as fairseq has fairseq-train, fairseq-preprocess, ...
    entry_points={"console_scripts": [
        "distlm-train=distlm.train:run",
        "distlm-run=distlm.run:main",
        "distlm-export=distlm.export.cli:main",
        "distlm-prepare=distlm.prepare:main",
        "distlm-doctor=distlm.doctor.cli:run",
        "distlm-plan=distlm.plan.__main__:main",
        "distlm-bench=distlm.bench.__main__:run",
        "distlm-parity=distlm.parity.__main__:main",
        "distlm-report=distlm.report:main",
    ]},
)
