"""Thin adapters that bring ``hetdp.DDP`` into the trainers that own their loop: PyTorch Lightning
(``lightning``), Hugging Face Accelerate (``accelerate``) and transformers' ``Trainer`` (``transformers``).

Each is an optional extra (``pip install 'hetdp[lightning]'``, ...); the core never imports them.
"""
