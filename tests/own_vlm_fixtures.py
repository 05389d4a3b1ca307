"""Your own VLM on disk, as a user has it: a tiny random 4-layer Qwen2.5-VL saved as a transformers folder (weights,
tokenizer, image processor, chat template; no video processor, which needs torchvision) and a `--prompts` JSON Lines
file over PNGs of different sizes (one image; two images; a conversation; a text-only line; one image by absolute
path). Its vision tokens' tied embedding rows are zero, so its greedy answers never hold them (a random model would;
no real VLM writes them in its text)."""

import json

import pytest
import qwen_vl_fixtures
import torch


SIZES = [(16, 24), (24, 16), (32, 32), (16, 16), (24, 24)]


def save_own_vlm(root):
    """`(folder, prompts file, model)` under `root`."""
    model = qwen_vl_fixtures.tiny_qwen_vl("qwen2_5_vl", seed=3, layers=4)
    with torch.no_grad():
        vision = [qwen_vl_fixtures.VOCAB[t] for t in qwen_vl_fixtures.SPECIALS if "vision" in t or "_pad|" in t]
        model.get_input_embeddings().weight[vision] = 0  # tied: their logits are 0, below the best word's
    processor = qwen_vl_fixtures.processor("qwen2_5_vl")
    folder = root / "my-qwen"
    model.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(qwen_vl_fixtures.CHAT)
    (root / "images").mkdir()
    for i, image in enumerate(qwen_vl_fixtures.images(SIZES, seed=4)):
        image.save(root / "images" / f"{i}.png")
    words = " ".join(qwen_vl_fixtures.WORDS[:3])
    lines = [
        {"image": "images/0.png", "prompt": words},
        {"images": ["images/1.png", "images/2.png"], "prompt": "w5 w6"},
        {"image": "images/3.png", "messages": [{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": "w7 w8"}]}]},
        {"prompt": "w9 w10 w11"},
        {"image": str(root / "images" / "4.png"), "prompt": "w12"},
    ]  # fmt: skip
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return folder, prompts, model


def save_drafters(root, model, target_folder):
    """`(head folder, draft folder)` under `root` for the model of `save_own_vlm`: a random EAGLE-3 head of its shape
    (aux layers 0, 2, 3; a 32-word draft vocabulary) and its first 2 layers as a draft LM (a vlm-draft folder: the
    second layer stored)."""
    from mmspec.models.hf.draft import save_draft_delta, truncated_draft
    from mmspec.models.hf.eagle3 import Eagle3Head

    head = Eagle3Head.from_target(model, draft_vocab_size=32, aux_layers=(0, 2, 3)).init_weights()
    head.set_draft_vocab(torch.arange(7, 39))  # word tokens
    head.init_from_target(model)
    head.save_pretrained(root / "head")
    draft = truncated_draft(model, 2)
    trained = [n for n, _ in draft.named_parameters() if "language_model.layers.1." in n]
    save_draft_delta(draft, root / "draft", trained, 2, {"target": str(target_folder)})
    return root / "head", root / "draft"


def usage_error(main, argv, capsys) -> str:
    """`main(argv)` must stop with a usage error (exit 2): returns what it wrote to stderr."""
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    return capsys.readouterr().err
