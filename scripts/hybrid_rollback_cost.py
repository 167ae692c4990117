"""What exact rollback costs on a hybrid (Gated DeltaNet) target on this machine: the step profile
of a random Qwen3.5 with SmolLM2-135M's geometry (hidden 576, 30 layers, 3 of 4 linear attention)
beside the same model with full attention everywhere. A rollback after a partial acceptance
restores the recurrent state and runs the kept tokens again (cache.py); for attention K/V it is a cut.

    .venv/bin/python scripts/hybrid_rollback_cost.py
"""

import torch
import transformers as tf

from blockdraft.draft import DraftModel, build_draft_config
from blockdraft.profile import format_profile, profile_step, timed
from blockdraft.target import Target

GEOMETRY = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)


def model(hybrid: bool) -> Target:
    kinds = ["linear_attention"] * 3 + ["full_attention"] if hybrid else ["full_attention"] * 4
    torch.manual_seed(0)
    cfg = tf.Qwen3_5TextConfig(**GEOMETRY, layer_types=kinds * 7 + kinds[:2], tie_word_embeddings=True)
    return Target(tf.Qwen3_5ForCausalLM(cfg).float().eval(), None, name="hybrid" if hybrid else "attention")


@torch.inference_mode()
def replay_costs(target: Target, context: list[int], block: int = 16) -> dict:
    """ms of a rollback that keeps k of a block's tokens (the replay grows with k)."""
    cache = target.new_cache()
    target.forward(torch.tensor([context]), cache, logits_at=1)
    n, ids, out = len(context), torch.zeros(1, block, dtype=torch.long), {}
    for keep in (1, 2, 4, 8, block):
        def step(keep=keep):
            snap = target.snapshot(cache)
            target.forward(ids, cache)
            target.rollback(cache, n + keep, snap, ids)
            target.rollback(cache, n, snap)
        forward_only = timed(lambda: (target.forward(ids, cache), target.rollback(cache, n)), target.device, 5)
        out[keep] = round(1e3 * (timed(step, target.device, 5) - forward_only), 2)
    return out


if __name__ == "__main__":
    torch.set_num_threads(2)
    context = list(range(100, 356))  # 256 tokens
    for hybrid in (False, True):
        target = model(hybrid)
        draft = DraftModel(build_draft_config(target.config, num_layers=3, block_size=16, mask_token_id=0)).eval()
        print(f"== {target.name}: {', '.join(sorted(set(target.cache_kinds)))}")
        print(format_profile(profile_step(target, draft, context, blocks=(1, 2, 4, 16), repeats=5)))
        print("rollback ms by tokens kept of 16:", replay_costs(target, context))
