"""Speculative decoding for transformers VLMs (LLaVA family) and causal LMs: `SpeculativeVLMPipeline`.

One Diffusers-style pipeline over the shared decoding engine (`mmspec.decoding.decode`): the target runs on mmspec's
static KV cache through `mmspec.models.hf.target.HFTarget` (vision tower + projector once, at prefill), a drafter proposes,
`mmspec.verify` accepts, one loop.

| `acceptance` | `drafter`          | method                                                         | lossless |
|--------------|--------------------|----------------------------------------------------------------|----------|
| `"none"`     | -                  | plain decoding (the baseline)                                   | -        |
| `"exact"`    | `"eagle"`/`"model"` | speculative sampling (Leviathan et al. 2023; EAGLE-2 trees)    | yes      |
| `"greedy"`   | `"eagle"`/`"model"` | `"exact"` under greedy decoding: drafts kept while they equal the target's argmax | yes |

Drafters: `"model"` (a small causal LM / LLaVA sharing the tokenizer drafts a chain of `num_draft_tokens`, or with
`tree_top_k > 1` an EAGLE-2 dynamic tree; `mmspec.drafters.text_model`) and `"eagle"` (an EAGLE head: a sampled chain
of `tree_depth` tokens with `tree_top_k=1`, or an EAGLE-2 dynamic tree of `tree_nodes` nodes;
`mmspec.drafters.eagle`). The `eagle_head` is one of:

| `eagle_head`                          | zoo folder (`from_zoo(eagle=...)`) | what the head reads at the image                     | draft-side image tokens |
|---------------------------------------|------------------------------------|------------------------------------------------------|-------------------------|
| `TextEagleHead` (EAGLE)               | `<name>-eagle` (`"eagle"`)          | the target's hidden states at every image token       | all of them             |
| `Eagle3Head` (EAGLE-3)                | `<name>-eagle3`                     | the target's low / middle / high hidden states at every image token, and its placeholder embedding or image features (`image_inputs`) | all of them |
| `VisionEagleHead`, policy `"vispec"`  | `<name>-vispec`                     | learned-query adaptor over the projected image features: a few tokens at the end of the image span + a global vector (ViSpec) | the queries - 1 |
| `VisionEagleHead`, policy `"specvlm"` | `<name>-specvlm`                    | one compressor per input (prune / pool / conv / resampler / text-only), picked by a question-conditioned gate (SpecVLM) | the chosen compressor's |
| `VisionEagleHead`, policy `"msd"`     | `<name>-msd`                        | the raw projected image features at the image tokens (MSD's decoupled drafting) | all of them |

A vision-aware head (`mmspec.drafters.vision_eagle`) gets the decoder's merged input embeddings and the image mask
from the target's own prefill (the vision tower still runs once) and keeps the target's position for every token
it keeps. `stats.extra` reports `draft_image_tokens` (mean over the answers; `draft_image_tokens_per_answer`) for
every drafter and, with SpecVLM's gate, `gate_choice` (the compressor chosen, per answer).

Batches are ragged: prompts of different lengths are right-aligned into the static cache (no left padding; positions
stay those of an unpadded prompt), every row accepts its own number of drafts per round and stops at its own EOS;
finished rows leave the batch. transformers' assisted generation is batch-1 only.
"""

import logging
import numbers
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from mmspec.checks import check_prompts
from mmspec.counting import on_host
from mmspec.decoding import DecodeTrace, Guidance, SequenceState, decode
from mmspec.drafters.compat import check_vlm_draft_model, check_vlm_eagle_head
from mmspec.drafters.eagle import EagleDrafter
from mmspec.drafters.lengths import make_draft_length
from mmspec.drafters.text_model import TextModelDrafter
from mmspec.memory import check_hf_call_memory
from mmspec.methods import EAGLE_HEADS, KNOBS, VLM_LIMITS, acceptance_names, resolve_drafter, resolve_method
from mmspec.models import DEFAULT_ZOO
from mmspec.models.hf.image_layout import processor_image_layout
from mmspec.models.hf.inputs import has_vision, image_token_mask
from mmspec.models.hf.target import HFTarget, right_align
from mmspec.random import check_generator
from mmspec.sampling import SamplingParams, sample
from mmspec.stats import SpecStats
from mmspec.verify import Exact

from .captured import CapturedForwards
from .packed import PackedLinears


logger = logging.getLogger(__name__)

ACCEPTANCES = acceptance_names("vlm")  # ("none", "exact", "greedy"): the registry's entries for the VLM
OUTPUT_TYPES = ("text", "ids")


@dataclass
class SpeculativeVLMOutput(BaseOutput):
    """Output of `SpeculativeVLMPipeline`.

    Attributes:
        text: the decoded answers (`output_type="text"`; special tokens skipped), else None.
        sequences: `[B, N]` generated token ids, -1 after a row's EOS (the EOS itself is kept).
        stats: `mmspec.stats.SpecStats` (prefill time apart from decoding; `extra`: `decode_s`, `tokens_per_s`).
        trace: `mmspec.decoding.DecodeTrace`: per output token, the round and whether it was a drafted-and-accepted
            token, a resampled correction or a bonus token.
    """

    text: list[str] | None
    sequences: torch.Tensor
    stats: SpecStats
    trace: DecodeTrace | None = None


class SpeculativeVLMPipeline(PackedLinears, CapturedForwards, DiffusionPipeline):
    """Speculative decoding for a transformers VLM / causal LM (see the module docstring).

    Args:
        model: the target, `LlavaForConditionalGeneration` or a `*ForCausalLM` (Llama-style decoder).
        processor: its processor (LLaVA: a `LlavaProcessor`; a causal LM: its tokenizer); chat templates come from it.
        draft_model: optional smaller model sharing the tokenizer, for `drafter="model"` (a LLaVA draft also gets
            the image).
        eagle_head: optional EAGLE head trained on `model`, for `drafter="eagle"`: a
            `mmspec.models.hf.eagle.TextEagleHead`, an EAGLE-3 `mmspec.models.hf.eagle3.Eagle3Head` (the target
            then returns the inputs of its `aux_layers`) or a vision-aware
            `mmspec.drafters.vision_eagle.VisionEagleHead` (ViSpec / SpecVLM / MSD; module docstring).

    Examples:
        >>> pipe = SpeculativeVLMPipeline.from_zoo("assets")
        >>> out = pipe(images=[image], prompt="Describe the image.", max_new_tokens=96, acceptance="greedy")
        >>> print(out.text[0], out.stats.mean_accepted_length)
    """

    _optional_components = ["draft_model", "eagle_head"]

    def __init__(self, model, processor, draft_model=None, eagle_head=None):
        super().__init__()
        # drafters made for another model are refused here, naming their folder (`mmspec.drafters.compat`)
        if draft_model is not None:
            check_vlm_draft_model(draft_model, model)
        if eagle_head is not None:
            check_vlm_eagle_head(eagle_head, model)
        self.register_modules(model=model, processor=processor, draft_model=draft_model, eagle_head=eagle_head)

    @classmethod
    def from_zoo(cls, root=None, name="mnist-vlm", drafters=True, eagle="eagle", **kwargs):
        """The offline zoo: `<root>/<name>` (SmolLM2-135M-Instruct + the trained vision tower, `mmspec.models.hf.zoo`)
        and, when present and `drafters`, `<root>/<name>-draft` and the EAGLE head folder `eagle` picks: one of
        `EAGLE_HEADS` (`"eagle"`, the default: `<name>-eagle`; `"vispec"` / `"specvlm"` / `"msd"`: `<name>-<kind>`) or
        a folder name under `root`. A head asked for by name must exist (ValueError naming it); the default one is
        loaded when present."""
        root = DEFAULT_ZOO if root is None else root  # the shipped zoo, from any working directory
        from pathlib import Path

        from mmspec.models.hf.draft import load_vlm_draft
        from mmspec.models.hf.zoo import load_vlm

        if not isinstance(eagle, str) or not eagle.strip():
            raise ValueError(f"eagle must be one of {EAGLE_HEADS} or a head folder name under root, got {eagle!r}")
        head_folder = Path(root) / (f"{name}-{eagle}" if eagle in EAGLE_HEADS else eagle)
        if drafters and eagle != "eagle" and not (head_folder / "config.json").is_file():
            raise ValueError(f"eagle={eagle!r}: {str(head_folder)!r} is not a model folder (no config.json)")
        model, processor = load_vlm(Path(root) / name)
        parts = {}
        if drafters and (Path(root) / f"{name}-draft").is_dir():
            parts["draft_model"] = load_vlm_draft(Path(root) / f"{name}-draft", target=model)
        if drafters and head_folder.is_dir():
            from mmspec.models import load

            parts["eagle_head"] = load(head_folder, dtype=model.dtype)  # strict, errors name it
            if model.device.type == "cpu":  # as the target (`load_vlm`): cheap multi-node tree forwards
                from mmspec.models.layout import input_major_linears

                input_major_linears(parts["eagle_head"])
        parts.update(kwargs)
        return cls(model, processor, **parts)

    @classmethod
    def from_folders(cls, target, eagle_head=None, draft=None, **kwargs):
        """Your own VLM: `target` a VLM folder (a transformers one, e.g. Qwen2.5-VL saved by `save_pretrained`, or a
        zoo one: `mmspec.models.hf.vlm_folder.load_target_vlm`), `eagle_head` a head folder trained for it (EAGLE,
        EAGLE-3 or vision-aware; `mmspec.models.load`, strict) and `draft` a `vlm-draft` folder for it
        (`load_vlm_draft`); each optional but the target. Errors name the folder."""
        from mmspec.models import load
        from mmspec.models.hf.draft import load_vlm_draft
        from mmspec.models.hf.vlm_folder import load_target_vlm

        model, processor = load_target_vlm(target)
        parts = {}
        if eagle_head is not None:
            parts["eagle_head"] = load(eagle_head, dtype=model.dtype)
        if draft is not None:
            parts["draft_model"] = load_vlm_draft(draft, target=model)
        return cls(model, processor, **parts, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """`DiffusionPipeline.from_pretrained`, but a local pipeline folder's model components (`model`,
        `draft_model`, `eagle_head`) load strictly through `mmspec.models.load`: every weight present with its
        config's shape, none unexpected, else a ValueError naming the folder and the key (transformers and
        diffusers would leave missing weights randomly initialised with only a warning). Components passed as
        keywords are used as given."""
        from mmspec.models.loading import import_index_modules

        import_index_modules(pretrained_model_name_or_path)
        from pathlib import Path

        folder = Path(pretrained_model_name_or_path)
        if (folder / "model_index.json").is_file():
            from mmspec.models import load

            dtype = kwargs.get("torch_dtype")
            for name in ("model", "draft_model", "eagle_head"):
                if name not in kwargs and (folder / name / "config.json").is_file():
                    kwargs[name] = load(folder / name, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    # ------------------------------------------------------------------ inputs
    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def eos_token_ids(self):
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = self.tokenizer.eos_token_id if eos is None else eos
        return None if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def check_inputs(self, acceptance, drafter, max_new_tokens, do_sample, output_type, callback_on_step_end):
        """Validate the method and I/O arguments; returns `(rule acceptance, drafter name)`."""
        if not isinstance(acceptance, str) or acceptance not in ACCEPTANCES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCES}, got {acceptance!r}")
        if acceptance == "greedy" and do_sample:
            raise ValueError('acceptance="greedy" verifies greedy decoding; use do_sample=False (or "exact")')
        loaded = {name for name in ("draft_model", "eagle_head") if getattr(self, name, None) is not None}
        if drafter == "jacobi":
            raise ValueError('drafter="jacobi" is for image models; the VLM pipeline runs "model" or "eagle"')
        rule = "none" if acceptance == "none" else "exact"
        drafter = resolve_drafter(acceptance, drafter, loaded, "vlm")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r} ({type(max_new_tokens).__name__})")
        if not 1 <= max_new_tokens <= VLM_LIMITS["max_new_tokens"]:
            raise ValueError(f"max_new_tokens must be in [1, {VLM_LIMITS['max_new_tokens']}], got {max_new_tokens}")
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
        if not isinstance(output_type, str) or output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(f"callback_on_step_end must be callable, got {type(callback_on_step_end).__name__}")
        return rule, drafter

    @staticmethod
    def check_draft_knobs(acceptance, drafter, num_draft_tokens, tree_nodes, tree_depth, tree_top_k, draft_vocab,
                          draft_confidence, return_dict, **length_knobs):  # fmt: skip
        """The drafting knobs, resolved once by the registry (`mmspec.methods.resolve_method`: types, `>= 1`, the
        upper bounds of `VLM_LIMITS`, each costing memory and time linearly, the draft-length policy and its knobs,
        and the defaults); `draft_vocab` integer ids. Returns the `MethodSettings`."""
        knobs = resolve_method(acceptance, drafter, None, "vlm", num_draft_tokens=num_draft_tokens,
                               tree_nodes=tree_nodes, tree_depth=tree_depth, tree_top_k=tree_top_k,
                               draft_confidence=draft_confidence, **length_knobs)  # fmt: skip
        if draft_vocab is not None and (
            not isinstance(draft_vocab, (torch.Tensor, list, tuple, np.ndarray))
            or torch.as_tensor(draft_vocab).is_floating_point()
            or torch.as_tensor(draft_vocab).dtype == torch.bool
        ):
            raise TypeError(
                f"draft_vocab must be a 1-D tensor / list of int token ids, got {type(draft_vocab).__name__}"
            )
        if not isinstance(return_dict, bool):
            raise TypeError(f"return_dict must be a bool, got {return_dict!r}")
        return knobs

    def check_context(self, lengths, max_new_tokens):
        """Refuse a prompt longer than the target's context (`max_position_embeddings`), or one that leaves less
        room than `max_new_tokens`."""
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if context is None:
            return
        longest = max(lengths) if isinstance(lengths, (list, tuple)) else int(lengths.max())
        if longest > context:
            raise ValueError(
                f"prompt is {longest} tokens long (chat template and image tokens included), longer than the "
                f"model's context of {context} tokens (max_position_embeddings)"
            )
        if longest + max_new_tokens > context:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} does not fit: the prompt is {longest} tokens and the model's "
                f"context {context} (max_position_embeddings); use max_new_tokens <= {context - longest}"
            )

    @staticmethod
    def check_images(images):
        """A PIL image / array / tensor, or a non-empty list of them (None: text-only)."""
        if images is None:
            return None
        if not isinstance(images, (list, tuple)):
            images = [images]
        if not images:
            raise ValueError("images must be an image or a non-empty list of images (or None), got an empty list")
        for i, image in enumerate(images):
            if not isinstance(image, (PIL.Image.Image, np.ndarray, torch.Tensor)):
                raise TypeError(
                    f"images[{i}] must be a PIL.Image, numpy array or tensor, got {type(image).__name__} "
                    "(open image files with PIL.Image.open first)"
                )
        return list(images)

    def conversations(self, images, prompt, messages):
        """`(conversations, images)`: one chat per batch item (`prompt` str/list -> a user turn with the image first;
        `messages`: one conversation or a list of them, in the processor's chat format)."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        images = self.check_images(images)
        if prompt is not None:
            prompts = check_prompts(prompt)  # shared with the Janus pipeline (mmspec.checks)
            if images is not None and len(images) != len(prompts):
                raise ValueError(f"got {len(images)} images for {len(prompts)} prompts (one image per prompt)")
            has_image = images is not None
            chats = []
            for p in prompts:
                content = [{"type": "image"}, {"type": "text", "text": p}] if has_image else p
                chats.append([{"role": "user", "content": content}])
            return chats, images
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (list of {'role', 'content'} dicts) or a list of them")
        chats = [messages] if isinstance(messages[0], dict) else list(messages)
        for chat in chats:
            if not isinstance(chat, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in chat):
                raise TypeError("every conversation in messages must be a list of {'role', 'content'} dicts")
        marked = sum(isinstance(m.get("content"), (list, tuple)) and
                     sum(isinstance(c, dict) and c.get("type") == "image" for c in m["content"])
                     for chat in chats for m in chat)  # fmt: skip
        if images is not None and marked != len(images):
            raise ValueError(f"got {len(images)} images for {marked} {{'type': 'image'}} items in messages (one each)")
        return chats, images

    def encode(self, images, prompt, messages, device):
        """Chat template + processor -> right-padded `input_ids [B, L]`, `lengths [B]`, extra model inputs."""
        ids, lengths, extra = self.encode_host(images, prompt, messages)
        return ids.to(device), lengths.to(device), self.move_inputs(extra, device)

    def move_inputs(self, extra, device):
        """The processor's extra model inputs (`pixel_values`, ...) on `device`, pixels in the model's dtype."""
        extra = {k: v.to(device) for k, v in extra.items()}
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(self.model.dtype)
        return extra

    def encode_host(self, images, prompt, messages):
        """`encode` on the host: the tokenizer's / processor's tensors before they move to the device (host memory:
        what is read here costs an accelerator nothing, `mmspec.counting.on_host`)."""
        with on_host():
            return self._encode_host(images, prompt, messages)

    def _encode_host(self, images, prompt, messages):
        chats, images = self.conversations(images, prompt, messages)
        is_vlm = hasattr(self.processor, "image_processor")
        if images is not None and not is_vlm:
            raise ValueError("images were given but the model has no image processor (a text-only LM)")
        if getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None):
            texts = [self.processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        else:
            texts = [" ".join(m["content"] if isinstance(m["content"], str) else "" for m in c) for c in chats]
        if is_vlm:
            enc = self.processor(images=images, text=texts, return_tensors="pt", padding=True)
        else:
            enc = self.tokenizer(texts, return_tensors="pt", padding=True)
        ids, lengths = right_align(enc["input_ids"], enc.get("attention_mask"), self.tokenizer.pad_token_id or 0)
        return ids, lengths, {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        images=None,
        prompt: str | list[str] | None = None,
        messages: list | None = None,
        max_new_tokens: int = 64,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        acceptance: str = "exact",
        drafter: str | None = None,
        num_draft_tokens: int | None = KNOBS["num_draft_tokens"].default,
        tree_nodes: int = KNOBS["tree_nodes"].default,
        tree_depth: int | None = KNOBS["tree_depth"].default,
        tree_top_k: int = KNOBS["tree_top_k"].default,
        draft_vocab: torch.Tensor | None = None,
        draft_confidence: float | None = KNOBS["draft_confidence"].default,
        draft_length: str = KNOBS["draft_length"].default,
        draft_step_cost: float | None = KNOBS["draft_step_cost"].default,
        verify_token_cost: float | None = KNOBS["verify_token_cost"].default,
        verify_costs: tuple | None = KNOBS["verify_costs"].default,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "text",
        return_dict: bool = True,
        callback_on_step_end=None,
        time_phases: bool = False,
    ):
        """Answer `prompt` / `messages` about `images`.

        Args:
            images: a PIL image / array, or one per prompt (LLaVA); None for text-only prompts.
            prompt: a user message or a list (one answer each); or `messages`: a conversation or a list of them in
                the processor's chat format (`{"type": "image"}` content items mark the image).
            max_new_tokens: tokens to generate per answer (fewer where it emits EOS).
            do_sample, temperature, top_k, top_p: sampling knobs, applied identically to target and draft
                distributions (`do_sample=False`, the default, is greedy decoding).
            acceptance: `"none"` | `"exact"` | `"greedy"` (module docstring).
            drafter: `"model"` | `"eagle"`; default: the EAGLE head if loaded, else the draft model.
            num_draft_tokens: the draft model's chain length K (`"model"` chains; None: the registry's 4).
            tree_nodes: the nodes of an EAGLE-2 tree (`tree_top_k > 1`, either drafter; default 24).
            tree_depth, tree_top_k: `tree_top_k > 1`: an EAGLE-2 dynamic tree (`tree_depth` levels, `tree_top_k`
                children per node, best `tree_nodes` kept) for either drafter; `tree_top_k=1`: the draft model drafts
                a chain of `num_draft_tokens`, the EAGLE head a chain of `tree_depth` tokens; `tree_depth` default 5.
            draft_vocab: `drafter="model"` only, optional 1-D ids: the draft LM scores only these tokens (FR-Spec;
                e.g. `pipe.eagle_head.draft_vocab`, the 2,048 most frequent answer tokens): at batch 1 its output
                head is most of a draft step's weight traffic. Verification is unchanged (lossless).
            draft_confidence: chains only (`tree_top_k=1`), optional in (0, 1): a row stops drafting after a token
                the drafter was less sure of (raw probability) -- transformers' `assistant_confidence_threshold`;
                lossless (the stop depends on the draft alone). Given with `draft_length="fixed"`: the
                `"confidence"` policy.
            draft_length: chains only: how many tokens each row drafts per round, within [1, K_max] (K_max: the
                draft model's `num_draft_tokens`, the EAGLE chain's `tree_depth`): `"fixed"` (K_max every round),
                `"heuristic"` (transformers' schedule: +2 after a row's fully accepted round, -1 otherwise),
                `"confidence"` (stop below `draft_confidence`, default 0.4) or `"cost"` (per row, the K maximising
                expected tokens per unit of cost; `docs/methods.md`). Lossless in every case.
            draft_step_cost, verify_token_cost: `draft_length="cost"`: a draft forward's cost and each further
                verified token's, in one-token target forwards (registry defaults per drafter).
            verify_costs: `draft_length="cost"`: the measured cost of a verification forward by width instead of
                `verify_token_cost`'s line (`c(1) = 1, c(2), ...`; `mmspec bench vlm` measures it).
            generator: one `torch.Generator` or a list with one per answer (then an answer does not depend on what
                else is in its batch).
            output_type: `"text"` (decoded answers and ids) | `"ids"` (ids only).
            return_dict: return a `SpeculativeVLMOutput` (else `(text or ids, stats)`).
            callback_on_step_end: `fn(pipe, round, generated_tokens, {"tokens": [B, N]})` after every round (the
                token grid, -1 = not generated; read-only).
            time_phases: also time the loop's draft and verify phases (`stats.time_draft_s` / `time_verify_s`; on
                CUDA a sync at each phase boundary, so leave it off when timing end to end there).

        Returns:
            `SpeculativeVLMOutput(text, sequences, stats, trace)` or a tuple.
        """
        # 1. check inputs, resolve the method
        rule_name, drafter = self.check_inputs(acceptance, drafter, max_new_tokens, do_sample, output_type,
                                               callback_on_step_end)  # fmt: skip
        knobs = self.check_draft_knobs(acceptance, drafter, num_draft_tokens, tree_nodes, tree_depth, tree_top_k,
                                       draft_vocab, draft_confidence, return_dict, draft_length=draft_length,
                                       draft_step_cost=draft_step_cost, verify_token_cost=verify_token_cost,
                                       verify_costs=verify_costs)  # fmt: skip
        if not isinstance(time_phases, bool):
            raise TypeError(f"time_phases must be a bool, got {time_phases!r}")
        guidance = Guidance(SamplingParams(1.0, temperature, top_k, top_p, do_sample))
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if guidance.sampling.top_k is not None and guidance.sampling.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab}), got {top_k}")
        if draft_vocab is not None and drafter != "model":
            raise ValueError('draft_vocab restricts the draft LM (drafter="model"); the EAGLE head has its own')

        # 2. prepare: chat template + processor, generators, target and drafter
        device = self._execution_device
        # the prompt's bookkeeping comes from the host copies (no device read)
        host_ids, host_lengths, host_inputs = self.encode_host(images, prompt, messages)
        with on_host():
            prompt_lengths = host_lengths.tolist()
        input_ids, lengths = host_ids.to(device), host_lengths.to(device)
        model_inputs = self.move_inputs(host_inputs, device)
        batch = input_ids.shape[0]
        check_generator(generator, batch, device)
        self.check_context(prompt_lengths, max_new_tokens)
        # an EAGLE-3 head reads the target's aux hidden states (the inputs of its `aux_layers`), recorded in the
        # target's own forwards; every other drafter its final-norm hidden states
        aux_layers = getattr(self.eagle_head.config, "aux_layers", None) if drafter == "eagle" else None
        target = HFTarget(self.model, guidance, hidden_layers=aux_layers)
        with on_host():  # image tokens per prompt (and, for a vision-aware head, each image's), from the host copy
            host_prompt = (prompt_lengths, (image_token_mask(self.model, host_ids).sum(1)).tolist())
            layout = self.image_layout(host_ids, host_inputs) if drafter == "eagle" else None
        draft = self.make_drafter(drafter, guidance, knobs, input_ids, lengths, model_inputs, draft_vocab,
                                  host_prompt=host_prompt, image_layout=layout)  # fmt: skip
        check_hf_call_memory(target, draft, batch=batch, prompt_tokens=input_ids.shape[1], num_tokens=max_new_tokens,
                             acceptance=rule_name, drafter=drafter, knobs=knobs, device=device,
                             settings={"max_new_tokens": max_new_tokens},
                             draft_model=self.draft_model if drafter == "model" else None)  # fmt: skip
        self.attach_compiler(target, draft)
        stats = SpecStats(batch, 0 if draft is None else draft.max_width, time_phases=time_phases)

        # 3. prefill: prompt + image features of every row; the first token comes from the target alone
        with stats.timer("total", device), stats.timer("prefill", device):
            first = target.prefill(input_ids, lengths, max_new_tokens, scratch=1 + (draft.max_width if draft else 0),
                                   return_hidden=draft is not None and draft.needs_hidden,
                                   return_vision=getattr(draft, "needs_vision", False), **model_inputs)  # fmt: skip
            state = SequenceState(sample(first.p_target[:, 0], generator), max_new_tokens,
                                  eos_token_id=self.eos_token_ids(), generator=generator)  # fmt: skip
            if draft is not None:
                draft.prefill(state, first)
        stats.record_prefill(1)
        stats.extra.update(self.draft_image_stats(draft, host_ids, host_lengths))

        # 4. decode: draft -> verify -> commit rounds until every row hit EOS or max_new_tokens
        callback = None
        if callback_on_step_end is not None:

            def callback(state, round_index):
                callback_on_step_end(self, round_index, int(state.num_generated().sum()), {"tokens": state.full()})

        with stats.timer("total", device), self.progress_bar(total=batch * max_new_tokens) as progress:
            decode(target, draft, Exact(), state, guidance, stats, progress=progress, callback=callback)
            progress.update(progress.total - progress.n)  # rows that stopped at EOS are done too
        stats.draft_forwards = getattr(draft, "draft_forwards", 0)

        # 5. postprocess
        sequences = state.full()
        stats.finalize()
        decode_s = stats.time_total_s - stats.time_prefill_s
        stats.extra.update(decode_s=decode_s, tokens_per_s=sum(stats.generated_tokens) / max(decode_s, 1e-9))
        text = None
        if output_type == "text":
            text = [self.tokenizer.decode([t for t in row if t >= 0], skip_special_tokens=True)
                    for row in sequences.tolist()]  # fmt: skip
        if not return_dict:
            return (text if output_type == "text" else sequences), stats
        return SpeculativeVLMOutput(text=text, sequences=sequences, stats=stats, trace=state.full_trace())

    def draft_image_stats(self, draft, input_ids, lengths):
        """`stats.extra` entries about what the drafter reads of the image: `draft_image_tokens` (mean over the
        answers), `draft_image_tokens_per_answer` and, with SpecVLM's gate, `gate_choice` (one name per answer).
        A draft LM reads every image token of the prompt when it has a vision tower (none otherwise); an EAGLE head
        reports its own count (`EagleDrafter.draft_image_tokens`)."""
        if draft is None:
            return {}
        if isinstance(draft, TextModelDrafter):  # from the prompt's host copies (`input_ids`, `lengths` on the host)
            with on_host():
                valid = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] < lengths[:, None]
                per_answer = (image_token_mask(self.draft_model, input_ids) & valid).sum(1).tolist()
        else:
            per_answer = draft.draft_image_tokens
        if per_answer is None:
            return {}
        per_answer = [int(n) for n in (per_answer if isinstance(per_answer, list) else per_answer.tolist())]
        extra = {"draft_image_tokens": sum(per_answer) / len(per_answer), "draft_image_tokens_per_answer": per_answer}
        if getattr(draft, "gate_choice", None) is not None:
            extra["gate_choice"] = list(draft.gate_choice)
        return extra

    def image_layout(self, input_ids, model_inputs):
        """Each prompt's images by their token counts (`mmspec.models.hf.image_layout.ImageLayout`) for a target
        whose images differ in size, from the processor's host outputs (`input_ids`, `model_inputs`); None for a
        fixed-size target or a head that reads no image (its policy then splits by `tokens_per_image`). Qwen-VL: from
        `image_grid_thw` (lengths and grids); any-resolution LLaVA: the processor's count per image
        (`_get_num_multimodal_tokens` over `image_sizes`), else each run of image tokens is one image."""
        reads_images = callable(getattr(self.eagle_head, "prefill_prompt", None))
        return processor_image_layout(self.model, self.processor, input_ids, model_inputs) if reads_images else None

    def make_drafter(self, drafter, guidance, knobs, input_ids, lengths, model_inputs, draft_vocab=None,
                     host_prompt=None, image_layout=None):  # fmt: skip
        """The engine drafter for the resolved `drafter` name (None: plain decoding), a chain with its draft-length
        policy (`knobs.draft_length`). `host_prompt`: the prompt lengths and image tokens per row as host lists;
        `image_layout`: each prompt's images by length where they differ in size (`EagleDrafter`)."""
        if drafter is None:
            return None
        if drafter == "model":
            draft = HFTarget(self.draft_model, guidance, source="draft", vocab=draft_vocab)
            vision = model_inputs if has_vision(self.draft_model) else {}
            size = knobs.tree_nodes if knobs.tree else knobs.num_draft_tokens  # tree nodes / chain length
            length = None if knobs.tree else make_draft_length(knobs, size)
            return TextModelDrafter(draft, size, input_ids, lengths, top_k=knobs.tree_top_k, depth=knobs.tree_depth,
                                    length=length, **vision)  # fmt: skip
        length = None if knobs.tree else make_draft_length(knobs, knobs.tree_depth)
        return EagleDrafter(self.eagle_head, self.model, guidance, depth=knobs.tree_depth, top_k=knobs.tree_top_k,
                            total=knobs.tree_nodes, host_prompt=host_prompt, length=length,
                            image_layout=image_layout)  # fmt: skip
