"""oppo-ds: PPO-based RLHF with pipeline overlap (OPPO) on DeepSpeed.

torch is required but not pinned here: a CPU machine installs torch==2.13.0 first (the
Makefile does), a GPU machine keeps the CUDA torch it has. Every requirement below is
satisfied by either without replacing it.
"""
from setuptools import find_packages, setup

setup(
    name="oppo-ds",
    version="0.1.0",
    description="PPO-based RLHF made faster by pipeline overlap (streaming scoring and "
                "overcommitted rollouts), on DeepSpeed and Megatron-core",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["oppo_ds", "oppo_ds.*"]),
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16",
        "transformers>=4.56",
        "tokenizers",
        "safetensors",
        "pyyaml",
        "tensorboard",
        "tqdm",
        "pyarrow",
        "datasets",
        "numpy",
    ],
    extras_require={
        # the bench plot and the TRL peer are tested too
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "matplotlib", "trl==1.12.0",
                 "megatron-core==0.16.1", "wandb==0.31.0"],
        # the version oppo_ds/megatron/compat.py was checked against (its signature test)
        "megatron": ["megatron-core==0.16.1"],
        # TRL's last release with PPO; the OPPO paper's baseline
        "peer": ["trl==1.12.0"],
        "plot": ["matplotlib"],
        # logging.wandb_project (the test extra pins the version its reader of the run files
        # was checked against; reinit="create_new" came in 0.19.10)
        "wandb": ["wandb>=0.19.10"],
    },
    entry_points={"console_scripts": ["oppo-train = oppo_ds.cli.train:entry",
                                    "oppo-bench = oppo_ds.cli.bench:main",
                                    "oppo-plan = oppo_ds.cli.plan:main"]},
)
