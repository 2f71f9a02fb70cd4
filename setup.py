"""seeupo-jax: SeeUPO (arXiv 2602.06554) in JAX/Flax."""

import setuptools

setuptools.setup(
  name="seeupo-jax",
  version="0.1.0",
  description=(
    "JAX/Flax implementation of SeeUPO, a critic-free RL algorithm with "
    "convergence guarantees for multi-turn LLM agents"
  ),
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  python_requires=">=3.11",
  packages=setuptools.find_packages(include=["seeupo_jax", "seeupo_jax.*"]),
  include_package_data=True,
  package_data={"seeupo_jax.assets": ["*.txt"]},
  install_requires=[
    "jax>=0.7,<0.13",
    "flax>=0.11,<0.13",
    "optax>=0.2.4,<0.3",
    "orbax-checkpoint>=0.11,<0.13",
    "chex>=0.1.89,<0.2",
    "absl-py>=2.1,<3",
    "ml-collections>=1.0,<2",
    "numpy>=1.26,<3",
    "ml_dtypes>=0.4",
    "transformers>=4.45,<6",
    "tokenizers>=0.20,<1",
    "safetensors>=0.4,<1",
    "jinja2>=3.1,<4",
    "matplotlib>=3.8,<4",
    "tensorboardX>=2.6,<3",
    "tqdm>=4.66,<5",
    "httpx>=0.27,<1",
  ],
  extras_require={
    "test": [
      "pytest>=8,<10",
      "pytest-xdist>=3.5,<4",
      "hypothesis>=6.100,<7",
      "nbmake>=1.5,<2",
      "ipykernel>=6.29,<8",
      "ruff==0.17.6",
    ],
    "gpu": ["jax[cuda12]>=0.7,<0.13"],
    # libtpu: the TPU compiler, so benchmarks/aot_compile.py compiles for TPU slices on any host
    "tpu-compile": ["jax[tpu]>=0.7,<0.13"],
    # torch's side of the parity tests: transformers' Qwen, and PEFT loading our LoRA adapters
    "parity": ["torch==2.13.0", "peft==0.21.2"],
  },
)
