from setuptools import find_packages, setup

setup(
    name="redknot",
    version="0.1.0",
    description="Head-aware KV-cache management for SGLang: head-segmented KV pool, fused "
    "varlen attention, and position-independent segment reuse.",
    packages=find_packages(include=["redknot", "redknot.*"]),
    # calibrated profiles served by default (redknot.headmap.shipped): links into configs/heads
    package_data={"redknot": ["profiles/*.json", "costmodel/records/*.json"]},
    python_requires=">=3.11",
    install_requires=["sglang==0.5.17"],
    extras_require={"test": ["pytest", "gguf", "accelerate"]},
    entry_points={
        "sglang.srt.plugins": ["redknot = redknot.integration.plugin:register"],
        "console_scripts": [
            "redknot = redknot.cli:main",
            "redknot-profile = redknot.profiler.cli:main",
        ],
    },
)
