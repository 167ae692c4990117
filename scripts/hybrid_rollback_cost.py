"""What exact rollback costs on a hybrid (Gated DeltaNet) target on this machine: a random Qwen3.5
with SmolLM2-135M's geometry (hidden 576, 30 layers, 22 of them linear attention) beside the same
model with attention everywhere. First the step profile of each; then greedy decoding with an
oracle drafter (each proposal the target's own token with p=0.7; the real draft forward) at block
8, the kept tokens of a partly accepted block either run in a forward of their own at once
(max_pending 0) or in front of the next forward's own (the default), against plain decoding.

    .venv/bin/python scripts/hybrid_rollback_cost.py
"""

import torch
import transformers as tf

from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.models.draft import DraftModel, build_draft_config
from blockdraft.decoding.oracle import OracleDraft
from blockdraft.lab.profiling import format_profile, profile_step
from blockdraft.models.target import MAX_PENDING, Target

GEOMETRY = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)


def model(hybrid: bool) -> Target:
    kinds = ["linear_attention"] * 3 + ["full_attention"] if hybrid else ["full_attention"] * 4
    torch.manual_seed(0)
    cfg = tf.Qwen3_5TextConfig(**GEOMETRY, layer_types=kinds * 7 + kinds[:2], tie_word_embeddings=True,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return Target(tf.Qwen3_5ForCausalLM(cfg).float().eval(), None, name="hybrid" if hybrid else "attention")


def decode(engine: Engine, prompt: list[int], block: int | None, n: int):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block, stop_token_ids=(), lookup=False, adaptive=False)
    result = engine.generate(prompt, cfg)
    return result.token_ids, (n - 1) / result.stats.decode_seconds, result.stats.tau


if __name__ == "__main__":
    torch.set_num_threads(2)
    context, n, block, rounds = list(range(100, 356)), 48, 8, 3  # a 256-token prompt
    for hybrid in (False, True):
        target = model(hybrid)
        draft = DraftModel(build_draft_config(target.config, num_layers=3, block_size=16, mask_token_id=0)).eval()
        print(f"== {target.name}: {', '.join(sorted(set(target.cache_kinds)))}")
        print(format_profile(profile_step(target, draft, context, blocks=(1, 2, 4, 8, 16), repeats=5)))
        plain = decode(Engine(target), context, None, n)[0]
        rates: dict = {"plain": [], 0: [], MAX_PENDING: []}
        for _ in range(rounds):  # interleaved, so that the machine's drift hits every method alike
            rates["plain"].append(decode(Engine(target), context, None, n)[1])
            for max_pending in (0, MAX_PENDING):
                target.max_pending = max_pending
                oracle = OracleDraft(draft, plain, len(context), 0.7, seed=1)
                tokens, rate, tau = decode(Engine(target, oracle), context, block, n)
                assert tokens == plain
                rates[max_pending].append(rate)
        median = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
        print(f"plain decoding: {median['plain']:.2f} tok/s (median of {rounds}, interleaved)")
        for max_pending in (0, MAX_PENDING):
            print(f"oracle@0.7 block {block}, max_pending {max_pending:>2}: {median[max_pending]:.2f} tok/s, "
                  f"tau {tau:.2f}, {median[max_pending] / median['plain']:.2f}x plain (output identical)")
