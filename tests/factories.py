"""Tiny models built in the tests, shared by every test folder (`from factories import tiny_gpt`)."""

import torch

from mmspec.models.llamagen.gpt import LlamaGenGPT


def tiny_gpt(seed=0, *, vocab_size=16, dim=32, n_layer=2, n_head=2, num_classes=4, block_size=16, multiple_of=8,
             std=None, random_norms=False, **config):  # fmt: skip
    """A random LlamaGen GPT in eval mode: weights from `torch.Generator().manual_seed(seed)` (output layer not
    zeroed), `std` the initializer range (None: the model's default), `random_norms` also draws the RMSNorm gains
    (1 + 0.1·N(0, 1), from seed + 100); `config` is any other `LlamaGenGPT` argument."""
    if std is not None:
        config["initializer_range"] = std
    model = LlamaGenGPT(vocab_size=vocab_size, dim=dim, n_layer=n_layer, n_head=n_head, num_classes=num_classes,
                        block_size=block_size, multiple_of=multiple_of, **config)  # fmt: skip
    model.init_weights(generator=torch.Generator().manual_seed(seed), zero_output=False)
    if random_norms:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
