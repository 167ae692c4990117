"""blockdraft: lossless DFlash speculative decoding (block-diffusion drafts, one-pass verification).

Heavy modules load on first use, so `import blockdraft` is cheap and has no side effects.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load_target": "models.target", "Target": "models.target",
    "DraftModel": "models.draft", "DraftConfig": "models.draft", "build_draft_config": "models.draft",
    "save_draft": "models.checkpoint", "load_draft": "models.checkpoint",
    "Engine": "decoding.engine", "GenerationConfig": "decoding.engine", "GenerationResult": "decoding.engine",
    "SamplingParams": "decoding.verify", "BlockdraftError": "errors",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
