"""blockdraft: lossless DFlash speculative decoding (block-diffusion drafts, one-pass verification).

Heavy modules load on first use, so `import blockdraft` is cheap and has no side effects.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load_target": "target", "Target": "target",
    "DraftModel": "draft", "DraftConfig": "draft", "build_draft_config": "draft",
    "save_draft": "checkpoint", "load_draft": "checkpoint",
    "Engine": "decoding", "GenerationConfig": "decoding", "GenerationResult": "decoding",
    "SamplingParams": "verify", "BlockdraftError": "errors",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
