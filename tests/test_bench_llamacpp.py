"""llama.cpp as a peer in `blockdraft bench` (lab/peer_llamacpp.py), against the real
`llama-server` that `make llamacpp-env` builds (cached outside the clone; `make test` builds it
and sets BLOCKDRAFT_REQUIRE_LLAMACPP, so there this test cannot skip)."""

import os

import pytest
import torch

from blockdraft.errors import BlockdraftError
from blockdraft.evaluation import bench
from blockdraft.evaluation.methods import parse_method, peer_of
from blockdraft.lab.peer_llamacpp import LlamaCppPeer, default_build, draft_tokens


def _build():
    server = default_build() / "bin" / "llama-server"
    if not server.is_file():
        if os.environ.get("BLOCKDRAFT_REQUIRE_LLAMACPP"):
            raise AssertionError(f"no llama-server at {server}: `make llamacpp-env` should have built it")
        pytest.skip("llama.cpp is not built here (make llamacpp-env)")
    return default_build()


def test_llamacpp_methods_parse_and_refuse_what_they_cannot_run(tmp_path):
    assert parse_method("llamacpp-dflash:8").block_size == 8 and peer_of("llamacpp-dflash") == "llamacpp"
    assert peer_of("llamacpp") == "llamacpp" and peer_of("dflash") is None
    with pytest.raises(BlockdraftError, match="block size"):
        parse_method("llamacpp:4")
    assert draft_tokens("llamacpp", None, 16) == 0 and draft_tokens("llamacpp-dflash", 8, 16) == 7
    with pytest.raises(BlockdraftError, match="at least 2"):
        draft_tokens("llamacpp-dflash", 1, 16)
    with pytest.raises(BlockdraftError, match="make llamacpp-env"):
        LlamaCppPeer.start(tmp_path / "nowhere", tmp_path / "t.gguf", None, {"llamacpp": 0}, 256, tmp_path / "l.log")
    from conftest import tiny_target

    with pytest.raises(BlockdraftError, match="started llama.cpp peer"):
        bench.run_bench(tiny_target("llama"), None, [[1, 2]], ("ar", "llamacpp"), max_new_tokens=2, progress=False,
                        profile=False)
    with pytest.raises(BlockdraftError, match="greedy only"):
        bench.run_bench(tiny_target("llama"), None, [[1, 2]], ("ar", "llamacpp"), max_new_tokens=2, progress=False,
                        profile=False, temperature=0.5, peer={})


@pytest.mark.slow
def test_llamacpp_rows_join_the_bench_on_the_bundled_gguf(tmp_path):
    """llama.cpp's plain decoding and its draft-dflash with our exported drafter, on the bundled
    GGUF, in the same table as ours: their figures come from llama.cpp's own timings, and how far
    their text agrees with ours is reported (its kernels differ from ours, so it is not called a
    mismatch; on the Q4_1 file its speculative text is not even always its own plain text, its
    batched kernels rounding otherwise: 11 against 9 of HumanEval-40's texts equal ours)."""
    from blockdraft.cli import bundled_drafter
    from blockdraft.lab.peer_llamacpp import drafter_gguf_for_bench
    from blockdraft.models.checkpoint import load_draft
    from blockdraft.models.target import load_target, target_gguf_file

    build = _build()
    torch.set_num_threads(2)
    target = load_target("smollm2-135m", device="cpu")
    draft = load_draft(bundled_drafter("smollm2-135m"))
    prompts = [target.encode_prompt(t, True) for t in ("Write a haiku about the sea.", "What is 12 times 7?")]
    gguf = target_gguf_file("smollm2-135m")
    drafter = drafter_gguf_for_bench(bundled_drafter("smollm2-135m"), gguf, tmp_path)
    peer = LlamaCppPeer.start(build, gguf, drafter, {"llamacpp": 0, "llamacpp-dflash:4": 3}, 512, tmp_path / "l.log")
    try:
        report = bench.run_bench(target, draft, prompts, ("ar", "llamacpp", "llamacpp-dflash:4"), max_new_tokens=24,
                                 progress=False, profile=False, warmup=0,
                                 peer=dict.fromkeys(("llamacpp", "llamacpp-dflash:4"), peer))
    finally:
        peer.close()
    assert all(s.proc.poll() is not None for s in peer.servers.values())
    m = report["methods"]
    assert m["llamacpp"]["tokens"] > 0 and m["llamacpp"]["decode_tok_s"] > 0 and m["llamacpp"]["tau"] == 1.0
    assert m["llamacpp-dflash:4"]["tau"] > 1.0  # it accepted some of our drafter's tokens
    assert {"identical", "mean_common_prefix"} <= m["llamacpp"]["agreement"].keys()
    assert not report["mismatches"]  # llama.cpp's rows are compared by agreement, not as mismatches
    assert "same text as ar on" in bench.format_table(report)
