"""A drafter for a hybrid (Gated DeltaNet) target, end to end through the CLI: `blockdraft data`
(the target's own responses), `train`, `tau`, then lossless decoding with what was trained. A
hybrid target's taps are what its drafters learn from, so this path must work for Qwen3.5."""

import json

import torch

from blockdraft.models.checkpoint import load_draft
from blockdraft.cli import main
from blockdraft.decoding.engine import Engine, GenerationConfig
from blockdraft.models.target import load_target

from families import tiny_model

CHARS = "abcdefghijklmnopqrstuvwxyz .,?!\n"


def save_with_tokenizer(model, directory):
    """A tiny model plus a character tokenizer with a ChatML template, as a local HF directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=specials[:2])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    model.config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def test_data_train_tau_and_decode_on_a_tiny_qwen35(tmp_path):
    save_with_tokenizer(tiny_model("qwen3.5"), tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    words = ["hello there", "what is this?", "tell me more", "a cat sat", "why not", "go on, please", "yes or no",
             "count to ten"]
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    target = str(tmp_path / "target")
    assert main(["data", "--out", str(tmp_path / "data"), "--source", str(prompts), "--target", target,
                 "--max-new-tokens", "24", "--heldout-percent", "0"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "data" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(words) and all(sum(r["loss_mask"]) > 0 for r in rows)
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--target", target,
                 "--num-layers", "1", "--block-size", "4", "--anchors", "2", "--batch-size", "4", "--max-steps", "4",
                 "--eval-every", "0", "--save-every", "2"]) == 0
    drafter = tmp_path / "run" / "drafter"  # the exported drafter, in the z-lab format
    assert main(["tau", "--target", target, "--draft", str(drafter), "--dataset", str(prompts), "--limit", "3",
                 "--max-new-tokens", "16", "--references", str(tmp_path / "refs.json"), "--json",
                 str(tmp_path / "tau.json"), "--device", "cpu"]) == 0
    (report,) = json.loads((tmp_path / "tau.json").read_text())["drafters"].values()
    assert report["tau"] >= 1.0 and report["steps"] > 0
    tgt = load_target(target, device="cpu")
    draft = load_draft(drafter)
    prompt = tgt.encode_prompt("hello there", chat=True)
    cfg = GenerationConfig(max_new_tokens=24, stop_token_ids=(), lookup=False, block_size=4)
    with torch.inference_mode():
        assert Engine(tgt, draft).generate(prompt, cfg).token_ids == Engine(tgt).generate(prompt, cfg).token_ids
