"""`capture_decoder_inputs`: the decoder's merged input embeddings, recorded during the model's own forward."""

import torch
from vlm_fixtures import images, tiny_llava, tiny_lm, tiny_processor

from mmspec.models.hf.inputs import capture_decoder_inputs, image_token_mask


def test_llava_capture_holds_projected_image_features_at_image_tokens_and_embeddings_elsewhere():
    model, processor = tiny_llava(), tiny_processor()
    enc = processor(images=images(2), text=["<image> a b", "<image> c"], return_tensors="pt", padding=True)
    with capture_decoder_inputs(model) as seen:
        model.model(**enc)
    mask = image_token_mask(model, enc["input_ids"])
    from vlm_fixtures import IMAGE_TOKENS

    assert int(mask.sum()) == 2 * IMAGE_TOKENS
    feats = model.model.get_image_features(pixel_values=enc["pixel_values"]).pooler_output
    feats = torch.cat(list(feats))
    torch.testing.assert_close(seen["inputs_embeds"][mask], feats)
    words = model.get_input_embeddings()(enc["input_ids"])
    torch.testing.assert_close(seen["inputs_embeds"][~mask], words[~mask])


def test_causal_lm_capture_is_the_token_embeddings_and_the_mask_is_empty():
    model = tiny_lm()
    ids = torch.tensor([[1, 5, 7, 9]])
    with capture_decoder_inputs(model) as seen:
        model.model(input_ids=ids)
    torch.testing.assert_close(seen["inputs_embeds"], model.get_input_embeddings()(ids))
    assert not image_token_mask(model, ids).any()
    model.model(input_ids=ids)  # the hook is gone after the block
    assert len(model.model._forward_pre_hooks) == 0
