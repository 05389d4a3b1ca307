"""A word-level tokenizer and a transformers `JanusProcessor` for the MNIST prompts of `mmspec.train.captions`.

The tokenizer (`tokenizers` WordLevel, whitespace + punctuation pre-tokenizer, wrapped as `PreTrainedTokenizerFast`)
knows every word of every prompt the caption templates can render (all templates x digits as numerals and words x
thickness x slant, plus "an"), the chat roles and the special tokens Janus needs:

    <bos> <eos> <pad> <unk>   BOS (added in front of every text), end, padding (also the CFG "unconditional"
                              token: `generate(generation_mode="image")` replaces every prompt token but BOS and BOI
                              by it), unknown word
    <|User|> <|Assistant|>    chat roles
    <image_placeholder> <begin_of_image> <end_of_image>
                              the tokenizer's `image_token`, `boi_token`, `eoi_token` (what `JanusProcessor` reads)

Chat template (one user turn; `add_generation_prompt=True` appends the assistant role), e.g.
`<|User|>: a handwritten 7\\n\\n<|Assistant|>:`; in image mode the processor appends `<begin_of_image>`, so the
model input of "a handwritten 7" is `<bos> <|User|> : a handwritten 7 <|Assistant|> : <begin_of_image>`.

Examples:
    >>> processor = build_janus_processor(num_image_tokens=64)
    >>> text = processor.apply_chat_template([{"role": "user", "content": "a thick 3"}], add_generation_prompt=True)
    >>> processor(text=[text], generation_mode="image")["input_ids"]
"""

import itertools


BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
USER, ASSISTANT = "<|User|>", "<|Assistant|>"
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<image_placeholder>", "<begin_of_image>", "<end_of_image>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, USER, ASSISTANT, IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|User|>: ' }}{% else %}{{ '<|Assistant|>: ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|Assistant|>:' }}{% endif %}"
)


def _pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Whitespace()  # words and runs of punctuation: "right-leaning" -> right, -, leaning


def prompt_words(templates=None) -> list[str]:
    """Every word (pre-tokenizer piece) of every prompt `templates` (default: the caption templates) can render, plus
    the chat template's ":", in first-seen order."""
    from mmspec.data.captions import TEMPLATES, render_prompt

    pre = _pre_tokenizer()
    words = {":": None}
    for template, digit, numeral, thick, slant in itertools.product(
        templates or TEMPLATES, range(10), (True, False), range(3), range(3)
    ):
        for piece, _ in pre.pre_tokenize_str(render_prompt(template, digit, numeral, thick, slant)):
            words.setdefault(piece, None)
    return list(words)


def build_janus_tokenizer(templates=None):
    """The word-level `PreTrainedTokenizerFast` (module docstring), special tokens first (`<pad>` = 0)."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for word in prompt_words(templates):
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = _pre_tokenizer()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=64,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "boi_token": BOI_TOKEN, "eoi_token": EOI_TOKEN},
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [USER, ASSISTANT]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor(image_size: int = 32, channels: int = 1):
    """`JanusImageProcessor` for `channels`-channel `image_size` px images in [-1, 1] (mean 0.5, std 0.5)."""
    import transformers

    try:  # the torchvision backend when installed, else the PIL one (same outputs)
        import torchvision  # noqa: F401

        cls = transformers.JanusImageProcessor
    except ImportError:
        cls = transformers.JanusImageProcessorPil
    return cls(
        size={"height": image_size, "width": image_size},
        min_size=1,
        image_mean=[0.5] * channels,
        image_std=[0.5] * channels,
        do_convert_rgb=channels == 3,
    )


def build_janus_processor(num_image_tokens: int = 64, image_size: int = 32, channels: int = 1, templates=None):
    """`JanusProcessor` = `build_janus_tokenizer` + `build_image_processor` + the chat template."""
    from transformers import JanusProcessor

    tokenizer = build_janus_tokenizer(templates)
    return JanusProcessor(
        image_processor=build_image_processor(image_size, channels),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        num_image_tokens=num_image_tokens,
    )


def image_prompts(processor, prompts: list[str]) -> list[str]:
    """The chat-formatted texts of `prompts` (one user turn + the assistant prompt), ready for
    `processor(text=..., generation_mode="image")`."""
    return [
        processor.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts
    ]
