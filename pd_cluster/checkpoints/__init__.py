"""Tiny, deterministic Hugging Face checkpoints the project writes itself (tests, presets, benchmarks).

``maker`` builds a model of any supported family, ``presets`` names the shipped ones, ``writer``
saves a checkpoint atomically, ``corpus`` is the built-in text, ``maker_cli`` is ``pd-cluster make-model``.
"""
