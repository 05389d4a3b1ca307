"""Tiny models built in the tests, shared by every test folder (`from factories import tiny_gpt`)."""

import hashlib

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


def near_copy(model, scale=0.05, seed=1):
    """A copy of `model` with every weight moved by `scale`·N(0, 1) (from `seed`): a draft that mostly agrees."""
    import copy

    near = copy.deepcopy(model)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return near


def tiny_vq(codebook_size=16, ch_mult=(1, 2, 2), seed=0):
    """A random LlamaGen VQ (1 channel, `len(ch_mult) - 1` downsamplings) in eval mode, the same in every process:
    torch's default initialisation drawn from the global RNG seeded with `seed` inside `fork_rng` (the caller's
    RNG state is left as it was). GSD groups by the codebook, so an unseeded VQ made its runs vary by process."""
    from mmspec.models.llamagen.vq import LlamaGenVQ

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaGenVQ(codebook_size=codebook_size, codebook_embed_dim=4, ch=8, ch_mult=ch_mult, z_channels=8,
                          in_channels=1, num_res_blocks=1, norm_num_groups=4).eval()  # fmt: skip


def random_forest(rows, m, generator):
    """Parents `[rows, m]` of a random topologically ordered forest (`parents[r, i]` uniform in `[-1, i)`, -1: the
    committed prefix), drawn from `generator`."""
    parents = torch.empty(rows, m, dtype=torch.long)
    for r in range(rows):
        for i in range(m):
            parents[r, i] = int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
    return parents


def root_path(parents_row, i):
    """Node indices from the root down to node `i` (inclusive) in one row of a forest's parents."""
    out = []
    while i >= 0:
        out.append(i)
        i = int(parents_row[i])
    return out[::-1]


def parse_flags(add_arguments, *argv):
    """`(parser, args)`: a fresh parser given a task's `add_arguments`, parsing `argv`."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser, parser.parse_args(list(argv))


def assert_same_checkpoints(resumed_folder, straight_folder, step):
    """The `checkpoint.pt` of a resumed run and of an uninterrupted one: both at `step`, bit-identical weights."""
    from mmspec.train.common import load_checkpoint

    resumed = load_checkpoint(resumed_folder / "checkpoint.pt")
    straight = load_checkpoint(straight_folder / "checkpoint.pt")
    assert resumed["step"] == straight["step"] == step
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def usage_error_line(main, argv, owner, loader, capsys, monkeypatch):
    """Run `main(argv)` with `owner.loader` replaced by a function that fails the test (no model may load): it must
    exit 2 (a usage error); returns the last line of stderr."""
    import pytest

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the flags were checked")

    monkeypatch.setattr(owner, loader, no_load)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def chisquare_pvalue(counts, probs, n):
    """p-value of the chi-square test of `counts [V]` (n draws) against `probs [V]`, the cells expected below 5
    pooled into one."""
    from scipy.stats import chisquare

    expected = probs * n
    big = expected >= 5  # pool the rare cells into one
    obs, exp = counts[big].double(), expected[big]
    if (~big).any():
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


def assert_first_tokens_follow(sequences, law2, law3, n, what=""):
    """Columns 1 and 2 of `sequences [n, >=3]` (-1: the row had ended, counted in the last cell) follow `law2` /
    `law3` (chi-square p-value above 1e-3)."""
    v = law2.shape[0]
    for column, law in ((1, law2), (2, law3)):
        tokens = sequences[:, column]
        counts = torch.bincount(torch.where(tokens < 0, v - 1, tokens), minlength=v)  # -1: the row had ended
        assert chisquare_pvalue(counts, law, n) > 1e-3, f"{what}token {column + 1} does not follow the target law"


def resumed_after_kill(run, monkeypatch):
    """`run()` (a training run) killed right after its first checkpoint (`mmspec.train.common.save_checkpoint`
    raises once it has written it), then run again, resuming: returns the second run's result."""
    from mmspec.train import common

    class Killed(Exception):
        pass

    save = common.save_checkpoint

    def killed_after_first(path, state):
        save(path, state)
        raise Killed

    monkeypatch.setattr(common, "save_checkpoint", killed_after_first)
    try:
        run()
        raise AssertionError("the run wrote no checkpoint before it ended")
    except Killed:
        pass
    finally:
        monkeypatch.setattr(common, "save_checkpoint", save)
    return run()


def digest(*parts) -> str:
    """sha256 of `parts`: tensors (dtype, shape and bytes), dicts / lists / tuples of them, other values by `repr`.
    The key of the tests' per-process caches of computed references (a model enters by its `state_dict()`)."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, torch.Tensor):
            h.update(f"tensor {x.dtype} {tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(f"dict {len(x)}".encode())
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__} {len(x)}".encode())
            for item in x:
                feed(item)
        else:
            h.update(repr(x).encode())

    for part in parts:
        feed(part)
    return h.hexdigest()


def assert_decoded_alike(got, want):
    """Two image calls decoded alike: tokens, accepted tokens, rounds and trace (a captured call against eager)."""
    assert torch.equal(got.images, want.images)
    assert (got.stats.accepted_tokens, got.stats.rounds) == (want.stats.accepted_tokens, want.stats.rounds)
    assert torch.equal(got.trace.origin, want.trace.origin) and torch.equal(got.trace.round, want.trace.round)


def tiny_gpt_with_head(vocab_size=16, grid=4):
    """The captured-round tests' tiny LlamaGen target (seed 0, 4 classes) and an EAGLE head on it (seed 2)."""
    from mmspec.models.llamagen.eagle import EagleHead

    target = tiny_gpt(0, vocab_size=vocab_size, num_classes=4, block_size=grid**2, std=0.3)
    head = EagleHead.from_target(target, initializer_range=0.3).init_weights(torch.Generator().manual_seed(2)).eval()
    return target, head
