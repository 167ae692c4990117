"""The methods `blockdraft bench` runs side by side, as `--methods` names them:
`name[@keep][+lookup|-lookup][+treeN][+q8][:block][/dtype]` (bench.py says what each method is)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BlockdraftError

METHODS = ("dflash", "ar", "hf", "hf-pld", "hf-assisted", "oracle", "vllm", "vllm-dflash",  # vllm: peer_vllm.py
           "llamacpp", "llamacpp-dflash")  # llamacpp: peer_llamacpp.py
PEERS = ("vllm", "llamacpp")  # other engines' methods start with these (run in their own processes)
PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
EXACT_PEERS = ("vllm",)  # peers computing with our weights and precision: a text of theirs that differs is a mismatch
TREE_BUDGET = 32  # `+tree` without N: trees of up to 32 nodes
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8")  # a drafter's (int8: its weights, precision.draft_precision)


@dataclass(frozen=True)
class MethodSpec:
    """One entry of `--methods`: `name[@keep][+treeN][:block][/dtype]`."""

    name: str  # one of METHODS
    keep: float | None = None  # oracle only: probability each proposal is kept
    block_size: int | None = None  # dflash / oracle only: a fixed block for this method
    lookup: bool = False  # prompt-lookup proposals too: dflash's default (`dflash-lookup`: off), `ar+lookup`
    tree_budget: int | None = None  # `+treeN`: verify a token tree of N nodes instead of a chain (tree.py)
    draft_dtype: str | None = None  # `/int8`: this method's own copy of the drafter, in that dtype (--draft-dtype's)
    q8: bool = False  # `+q8`: a GGUF target's activations quantized to int8 (ops/int8_activations.py)


def parse_method(method: str, default_keep: float = 0.9) -> MethodSpec:
    """`oracle@0.9:16` -> MethodSpec("oracle", 0.9, 16), `dflash` -> MethodSpec("dflash",
    lookup=True) (the engine's default), `dflash-lookup` -> the drafter alone, `ar+lookup` -> plain
    decoding plus prompt lookup, `dflash/int8` -> the drafter in its own dtype (`--draft-dtype`'s
    names), `ar+q8` -> plain decoding with the target's activations in int8; a BlockdraftError for
    anything unknown."""
    head, block, tree, draft_dtype = method, None, None, None
    q8 = "+q8" in head
    head = head.replace("+q8", "", 1)
    if "/" in head:
        head, draft_dtype = head.split("/", 1)
        if draft_dtype not in DRAFT_DTYPES:
            raise BlockdraftError(f"{method!r}: the drafter's dtype after '/' must be one of {list(DRAFT_DTYPES)}")
    if ":" in head:
        head, tail = head.split(":", 1)
        if not tail.isdigit() or int(tail) < 1:
            raise BlockdraftError(f"{method!r}: the block size after ':' must be a positive integer")
        block = int(tail)
    if "+tree" in head:
        head, n = head.split("+tree", 1)
        n = n or str(TREE_BUDGET)
        if not n.isdigit() or not 1 <= int(n) <= 256:
            raise BlockdraftError(f"{method!r}: '+treeN' needs a node budget N in [1, 256]")
        tree = int(n)
    lookup = None  # the method's default: on for dflash (as the engine ships), off for the rest
    for suffix, value in (("+lookup", True), ("-lookup", False)):
        if head.endswith(suffix):
            head, lookup = head.removesuffix(suffix), value
            break
    name, keep = head, None
    if "@" in head:
        name, k = head.split("@", 1)
        if name != "oracle":
            raise BlockdraftError(f"{method!r}: only oracle takes a keep probability ('oracle@K')")
        try:
            keep = float(k)
        except ValueError:
            keep = -1.0
        if not 0 <= keep <= 1:
            raise BlockdraftError(f"{method!r}: the keep probability after '@' must be in [0, 1]")
    if name not in METHODS:
        raise BlockdraftError(f"unknown method {method!r}; choose from {list(METHODS)}, oracle@K, or NAME:BLOCK")
    if block is not None and name not in ("dflash", "oracle", "vllm-dflash", "llamacpp-dflash"):
        raise BlockdraftError(f"{method!r}: only dflash, oracle, vllm-dflash and llamacpp-dflash take a block size (':B')")
    if lookup is not None and name not in ("dflash", "ar"):
        raise BlockdraftError(f"{method!r}: only dflash and ar take '+lookup' / '-lookup'")
    if tree is not None and name not in ("dflash", "oracle"):
        raise BlockdraftError(f"{method!r}: only dflash and oracle take '+treeN'")
    if draft_dtype is not None and name not in ("dflash", "oracle"):
        raise BlockdraftError(f"{method!r}: only dflash and oracle take a drafter dtype ('/DTYPE')")
    if q8 and name not in ("dflash", "ar"):  # (an oracle's greedy continuations are the exact mode's)
        raise BlockdraftError(f"{method!r}: only dflash and ar take '+q8' (int8 activations)")
    if name == "oracle" and keep is None:
        keep = default_keep
    return MethodSpec(name, keep, block, name == "dflash" if lookup is None else lookup, tree, draft_dtype, q8)


def check_methods(methods) -> tuple[str, ...]:
    """Each method parses (`parse_method`) and appears once; a BlockdraftError otherwise."""
    for m in methods:
        parse_method(m)
    if not methods or len(set(methods)) != len(methods):
        raise BlockdraftError(f"give each method once (got {list(methods)})")
    return tuple(methods)


def peer_of(name: str) -> str | None:
    """Which other engine runs a method (`vllm`, `llamacpp`), or None for ours and transformers'."""
    return next((p for p in PEERS if name == p or name.startswith(p + "-")), None)


def check_peer_greedy(peer: str, temperature: float) -> None:
    """Other engines' methods run greedy only: they draw other random numbers than ours."""
    if temperature != 0:
        raise BlockdraftError(f"the {peer} methods run greedy only (--temperature 0): {PEER_NAMES[peer]} "
                              "samples other random numbers")
