"""Speculative image generation with Janus / Janus-Pro (transformers `JanusForConditionalGeneration`):
`SpeculativeJanusPipeline`.

The model's image mode (`generate(generation_mode="image")`: prompt -> `num_image_tokens` VQ tokens -> image) runs
on the shared decoding engine (`mmspec.decoding`) through `mmspec.models.janus.target.JanusTarget` (mmspec's static KV
cache, CFG rows `[cond; uncond]`), so every training-free method of `mmspec.methods` runs on it:

| `acceptance` | `drafter` | method                                                  | lossless |
|--------------|-----------|---------------------------------------------------------|----------|
| `"none"`     | -         | plain AR sampling (= transformers' `generate`)          | yes      |
| `"jacobi"`   | jacobi    | SJD (Teng et al. 2024); `coupling=True`: SCD re-drafts; `jacobi_tree_width > 1`: SJD-PAC | yes |
| `"exact"`    | jacobi    | speculative sampling of the Jacobi window's drafts      | yes      |
| `"relaxed"`  | jacobi    | LANTERN on Jacobi drafts (VQ codebook neighbourhoods)   | no (TV <= delta per token) |
| `"grouped"`  | jacobi    | GSD grouped acceptance on Jacobi drafts                 | no       |

Draft-model and EAGLE drafting need a drafter trained for the target; none exists for Janus yet.

Prompts go through the processor as transformers' image mode expects: the chat template (a user turn), then
`processor(text=..., generation_mode="image")`, which appends the begin-of-image token; or pass `input_ids` (+
`attention_mask`) made that way. The processor pads left; the target right-aligns every row (positions as for the
unpadded prompt). Guidance, temperature, top-k and top-p are applied in transformers' order (CFG on the raw
generation-head logits first), so plain greedy decoding equals `model.generate(..., generation_mode="image",
do_sample=False)` token for token (`guidance_scale > 1`; transformers' loop fails at `guidance_scale <= 1`, where
this pipeline runs the conditional stream alone). transformers' sampling defaults to `top_k=50` from the generation
config; here `top_k=None` means no top-k.
"""

import logging
from pathlib import Path

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from mmspec.checks import check_device, check_prompts
from mmspec.counting import on_host
from mmspec.memory import check_hf_call_memory
from mmspec.methods import IMAGE_LIMITS
from mmspec.models.janus.target import JanusTarget, special_token_ids
from mmspec.models.loading import quantised_state

from .token_image import OUTPUT_TYPES, Condition, TokenImagePipeline, with_knob_parameters


logger = logging.getLogger(__name__)

__all__ = ["HUB_ALIASES", "OUTPUT_TYPES", "SpeculativeJanusPipeline"]  # OUTPUT_TYPES: `pipelines.token_image`'s
DEFAULT_DTYPE = (
    torch.float32
)  # `from_pretrained(torch_dtype=None)`, whatever the checkpoint stores (see its docstring)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # transformers 5 / older processor layouts

# DeepSeek's own repositories hold the remote-code "multi_modality" format; transformers reads the conversions
HUB_ALIASES = {
    "deepseek-ai/Janus-Pro-1B": "deepseek-community/Janus-Pro-1B",
    "deepseek-ai/Janus-Pro-7B": "deepseek-community/Janus-Pro-7B",
    "deepseek-ai/Janus-1.3B": "deepseek-community/Janus-1.3B",
}


class SpeculativeJanusPipeline(TokenImagePipeline):
    """Speculative image generation for Janus / Janus-Pro (see the module docstring).

    Args:
        model: a transformers `JanusForConditionalGeneration` (eval mode).
        processor: its `JanusProcessor` (tokenizer with the begin-of-image token, chat template, image processor).

    Examples:
        >>> pipe = SpeculativeJanusPipeline.from_pretrained("deepseek-ai/Janus-Pro-1B", torch_dtype=torch.bfloat16,
        ...                                                 device="cuda")
        >>> out = pipe("a red fox in the snow", acceptance="jacobi", generator=torch.Generator("cuda").manual_seed(0))
        >>> out.images[0].save("fox.png"); print(out.stats.step_compression)
    """

    max_images_per_prompt = IMAGE_LIMITS["num_images_per_prompt"]

    def __init__(self, model, processor):
        super().__init__()
        from transformers import JanusForConditionalGeneration

        if not isinstance(model, JanusForConditionalGeneration):
            raise TypeError(f"model must be a JanusForConditionalGeneration, got {type(model).__name__}")
        if processor is None or not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
            raise TypeError(f"processor must be a JanusProcessor, got {type(processor).__name__}")
        grid = model.model.vqmodel.quantize.quant_state_dims
        n = model.model.vision_model.config.num_image_tokens
        if grid[0] * grid[1] != n:
            raise ValueError(f"model: vision_config.num_image_tokens={n} does not fill the VQ's {grid[0]}x{grid[1]} "
                             "token grid (vq_config.num_patches squared)")  # fmt: skip
        special_token_ids(model, processor.tokenizer)  # present, and the generation config agrees with the tokenizer
        self.register_modules(model=model, processor=processor)
        self._neighbours = {}

    @classmethod
    def from_zoo(cls, root=None, name="mnist-janus", **kwargs):
        """The offline zoo's Janus: `<root>/<name>` (default: the shipped zoo's `mnist-janus`, from any working
        directory), a plain transformers folder; `kwargs` as `from_pretrained`."""
        from mmspec.models import DEFAULT_ZOO

        folder = Path(DEFAULT_ZOO if root is None else root) / name
        if not folder.is_dir():
            raise ValueError(f"root: no zoo folder {str(folder)!r}")
        return cls.from_pretrained(str(folder), **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, torch_dtype=None, device=None, **kwargs):
        """Load a Janus checkpoint: a hub id (`"deepseek-ai/Janus-Pro-1B"`, read from its transformers conversion
        `HUB_ALIASES`; needs network access), a local transformers folder (`config.json` of `model_type`
        "janus", weights, processor files), or a folder written by `save_pretrained`. Never runs remote code.

        Loading is strict: every weight the config asks for is present with its shape and none is left over (a
        `num_hidden_layers` smaller or larger than the weights' is an error), the processor files are there
        (`processor_config.json`), the processor has its chat template (`chat_template.jinja`), and the generation
        config's BOS / begin-of-image / pad ids are the tokenizer's (they build the CFG null prompt).

        Args:
            pretrained_model_name_or_path: hub id or folder.
            torch_dtype: weights dtype. Default (None): float32, whatever the checkpoint stores (the zoo's
                `mnist-janus` stores float16), said in an INFO log line. Float32 is what the pipeline's guarantees
                are tested in: an image does not depend on the rest of its batch (ragged prompts, per-image
                generators) and greedy decoding equals transformers' `generate(generation_mode="image")` token for
                token. A reduced precision (`torch.float16`, `torch.bfloat16`; e.g. on a GPU for speed and memory)
                gives up both: CFG amplifies rounding that depends on the padding layout of the batch, so images
                change with what else is in the batch, and greedy tokens may differ from transformers' (which
                guides in the model dtype; mmspec guides in float32). Distributions are float32 either way.
            device: where the model goes (a torch device or its name; checked before anything loads).
            kwargs: passed to transformers' `from_pretrained` (`revision`, `cache_dir`, `local_files_only`, ...);
                for a `save_pretrained` folder also `model=` / `processor=` to use as given.

        Raises:
            ValueError naming the path (and the file): a missing folder, a folder without a Janus config, missing,
            left-over or mis-shaped weights, a missing processor file or chat template, special ids on which the
            generation config and the tokenizer disagree, unreadable files; ValueError naming `device`.
        """
        from mmspec.models.loading import import_index_modules

        device = check_device(device)
        import_index_modules(pretrained_model_name_or_path)
        if kwargs.pop("trust_remote_code", False):
            raise ValueError("trust_remote_code=True is refused: Janus loads through transformers' own classes")
        for part in ("draft_model", "eagle_head"):  # else handed to transformers, which fails on the Janus folder
            if part in kwargs:
                from mmspec.drafters.compat import origin

                value = kwargs[part]
                where = f"{part}={str(value)!r}" if isinstance(value, (str, Path)) else origin(value, part)
                raise ValueError(f"{where}: SpeculativeJanusPipeline takes no draft model or EAGLE head (none is "
                                 "trained for Janus; its speculative methods draft with drafter='jacobi')")  # fmt: skip
        if torch_dtype is not None and not isinstance(torch_dtype, torch.dtype):
            raise TypeError(f"torch_dtype must be a torch.dtype or None, got {torch_dtype!r}")
        name = str(pretrained_model_name_or_path)
        folder = Path(name).expanduser()
        if torch_dtype is None:
            torch_dtype = DEFAULT_DTYPE
            logger.info("%s: torch_dtype not given, loading in float32 (batch-independent images and transformers' "
                        "greedy tokens; a reduced precision gives both up)", name)  # fmt: skip
        if (folder / "model_index.json").is_file():  # a pipeline folder of save_pretrained: its parts, strictly
            model, processor = kwargs.pop("model", None), kwargs.pop("processor", None)
            if model is None or processor is None:
                loaded = cls._load_parts(str(folder / "model"), str(folder / "model"), torch_dtype, kwargs,
                                         processor_source=str(folder / "processor"), local=True)  # fmt: skip
                model = loaded[0] if model is None else model
                processor = loaded[1] if processor is None else processor
            pipe = cls(model, processor)
            return pipe.to(device) if device is not None else pipe
        local = folder.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1
        if local and not folder.is_dir():
            raise ValueError(f"pretrained_model_name_or_path={name!r}: no such folder (nor a hub id 'owner/name')")
        if local and not (folder / "config.json").is_file():
            raise ValueError(f"{name!r}: not a transformers folder (no config.json)")
        source = str(folder) if local else HUB_ALIASES.get(name, name)
        if source != name and not local:
            logger.info("%s is DeepSeek's remote-code format; loading its transformers conversion %s", name, source)
        model, processor = cls._load_parts(name, source, torch_dtype, kwargs, local=local)
        pipe = cls(model, processor)
        return pipe.to(device) if device is not None else pipe

    @staticmethod
    def _load_parts(name, source, torch_dtype, kwargs, processor_source=None, local=False):
        """`(model, processor)` from `source` (the processor from `processor_source`, default `source`); every
        failure a ValueError naming `name` (and the file at fault)."""
        from transformers import AutoConfig, GenerationConfig, JanusForConditionalGeneration, JanusProcessor

        processor_source = source if processor_source is None else processor_source
        if local and not any((Path(processor_source) / f).is_file() for f in PROCESSOR_FILES):
            raise ValueError(f"{processor_source!r}: no {PROCESSOR_FILES[0]} (the JanusProcessor's image processor "
                             "and num_image_tokens); write it with processor.save_pretrained(folder)")  # fmt: skip
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=False, **kwargs)
        except Exception as err:  # unreadable / invalid JSON, unknown model types, network errors for hub ids
            where = name if source == name else f"{name} (its transformers conversion {source})"
            raise ValueError(f"{where!r}: cannot read a Janus config ({type(err).__name__}: {err})") from err
        if config.model_type != "janus":
            raise ValueError(f"{name!r}: model_type={config.model_type!r}, not a transformers Janus checkpoint "
                             "(model_type 'janus'; DeepSeek's 'multi_modality' repositories have transformers "
                             f"conversions: {sorted(HUB_ALIASES.values())})")  # fmt: skip
        try:
            state = quantised_state(source, name) if Path(source).is_dir() else None  # int4 / int8 storage (the zoo)
            model, info = JanusForConditionalGeneration.from_pretrained(
                None if state is not None else source, config=config, state_dict=state, dtype=torch_dtype,
                output_loading_info=True, trust_remote_code=False, **kwargs,
            )  # fmt: skip
            if state is not None and (Path(source) / "generation_config.json").is_file():  # not read without a path
                model.generation_config = GenerationConfig.from_pretrained(source)
            processor = JanusProcessor.from_pretrained(processor_source, trust_remote_code=False, **kwargs)
        except Exception as err:  # truncated / corrupt files surface as many types (safetensors, json, OSError)
            raise ValueError(
                f"{name!r}: cannot load the Janus model / processor ({type(err).__name__}: {err})"
            ) from err
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:  # e.g. config.json's num_hidden_layers smaller (unexpected) or larger (missing) than the weights'
            detail = "; ".join(f"{k}: {len(v)}, {sorted(map(str, v))[:5]}" for k, v in bad.items())
            raise ValueError(f"{name!r}: the weights do not fit config.json ({detail})")
        if not getattr(processor, "chat_template", None):
            raise ValueError(f"{processor_source!r}: the processor has no chat template (chat_template.jinja): every "
                             "prompt would be encoded without the chat turn the model was trained on")  # fmt: skip
        try:
            special_token_ids(model, processor.tokenizer)
        except ValueError as err:
            raise ValueError(f"{name!r}: generation_config.json and the tokenizer: {err}") from err
        return model.eval(), processor

    # ------------------------------------------------------------------ inputs
    @property
    def num_image_tokens(self) -> int:
        return int(self.model.model.vision_model.config.num_image_tokens)

    num_tokens = num_image_tokens

    def call_device(self):
        return self.model.device

    def special_ids(self) -> dict[str, int]:
        """BOS / BOI / pad ids: the generation config's (as transformers), else the processor's tokenizer's."""
        return special_token_ids(self.model, self.processor.tokenizer)

    def prepare(self, condition, num_images_per_prompt, device):
        return Condition(*self.encode_prompt(**condition, num_images_per_prompt=num_images_per_prompt))

    def encode_prompt(self, prompt, input_ids, attention_mask, num_images_per_prompt):
        """`(input_ids [B, L], attention_mask [B, L])` of the call (each prompt repeated `num_images_per_prompt`
        times): `prompt` through the chat template (a user turn) and `processor(..., generation_mode="image")`, or
        `input_ids` / `attention_mask` as given (checked)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            if attention_mask is not None:
                raise ValueError("attention_mask goes with input_ids, not with prompt")
            tokenizer = self.processor.tokenizer
            prompts = check_prompts(prompt, reserved=getattr(tokenizer, "all_special_tokens", ()))
            if not getattr(self.processor, "chat_template", None):
                raise ValueError("prompt: the processor has no chat template, so prompts cannot be encoded as the "
                                 "model expects (set processor.chat_template, or pass input_ids)")  # fmt: skip
            prompts = [self.processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": p}]}], add_generation_prompt=True,
                tokenize=False) for p in prompts]  # fmt: skip
            with on_host():  # the processor's tensors are host memory until the target's prefill moves them
                enc = self.processor(text=list(prompts), generation_mode="image", padding=True, return_tensors="pt")
            input_ids, attention_mask = enc["input_ids"], enc.get("attention_mask")
        else:
            input_ids, attention_mask = self.check_ids(input_ids, attention_mask)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return (input_ids.repeat_interleave(num_images_per_prompt, 0),
                attention_mask.repeat_interleave(num_images_per_prompt, 0))  # fmt: skip

    def check_ids(self, input_ids, attention_mask):
        """`input_ids [B, L]` integer ids in the text vocabulary; `attention_mask` None or a 0/1 tensor."""
        if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            got = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [batch, length], got {got}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        vocab = self.model.config.get_text_config().vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids must be token ids in [0, {vocab}), got [{int(input_ids.min())}, "
                             f"{int(input_ids.max())}]")  # fmt: skip
        if attention_mask is not None:
            if not torch.is_tensor(attention_mask):
                raise TypeError(f"attention_mask must be a tensor or None, got {type(attention_mask).__name__}")
            if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
                raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
            # shape and rows without a token: `right_align` (the target's prefill, before any forward)
            attention_mask = attention_mask.long()
        if attention_mask is None or attention_mask.shape == input_ids.shape:
            self.check_boi(input_ids, attention_mask)
        return input_ids.long(), attention_mask

    def check_boi(self, input_ids, attention_mask):
        """Every row's last token (the last one its mask keeps) must be the begin-of-image token, as the
        processor's image mode ends a prompt: without it the model would not be asked for an image."""
        boi = self.special_ids()["boi_token_id"]
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        position = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = torch.where(keep, position, -1).amax(1)  # -1: a row without tokens (refused by `right_align`)
        for row, index in enumerate(last.tolist()):
            if index >= 0 and int(input_ids[row, index]) != boi:
                raise ValueError(f"input_ids: row {row} ends with token {int(input_ids[row, index])}, not the "
                                 f"begin-of-image token {boi}; make image-mode prompts with "
                                 "processor(text=..., generation_mode='image'), which appends it")  # fmt: skip

    def check_context(self, attention_mask, scratch):
        """Refuse prompts that leave no room for the image in the model's context (`max_position_embeddings`): the
        positions fed are the prompt's and the image tokens' but the last (drafts never run past the last image
        token); the `scratch` slots of a round's drafts are cache slots, not positions."""
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        longest = int(attention_mask.sum(1).max())
        if context is not None and longest + self.num_image_tokens - 1 > context:
            raise ValueError(f"prompt is {longest} tokens long: with {self.num_image_tokens} image tokens it does not "
                             f"fit the model's context of {context} positions")  # fmt: skip

    def codebook(self):
        """The VQ codebook `[V, D]`, L2-normalised as the VQ decodes it (float32)."""
        return F.normalize(self.model.model.vqmodel.quantize.embedding.weight.detach().float(), dim=-1)

    def make_target(self, guidance):
        return JanusTarget(self.model, guidance, self.special_ids())

    def check_call(self, target, cond, method, guidance, draft, scratch, num_images_per_prompt, device):
        """The prompts fit the context (`check_context`) and the call the memory budget (`mmspec.memory`)."""
        self.check_context(cond.mask, scratch)
        check_hf_call_memory(target, draft, batch=cond.batch, prompt_tokens=cond.inputs.shape[1],
                             num_tokens=self.num_tokens, acceptance=method.acceptance, drafter=method.drafter,
                             knobs=method, device=device, num_images_per_prompt=num_images_per_prompt,
                             codebook_dim=self.model.model.vqmodel.quantize.embedding.weight.shape[-1])  # fmt: skip

    def prefill(self, target, cond, scratch, draft):
        return target.prefill(cond.inputs, cond.mask, self.num_tokens, scratch=scratch)

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    @with_knob_parameters
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        guidance_scale: float = 5.0,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool = True,
        num_images_per_prompt: int = 1,
        acceptance: str = "jacobi",
        drafter: str | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("tokens",),
        time_phases: bool = False,
        **knobs,
    ):
        """Generate images for `prompt` (or ready `input_ids`).

        Args:
            prompt: a prompt or a list (one image each, times `num_images_per_prompt`).
            input_ids, attention_mask: instead of `prompt`: image-mode prompts as the processor makes them (chat
                template applied, begin-of-image token last; any-side padding, `attention_mask` 1 = token).
            guidance_scale: CFG scale (default 5, as transformers); 1 runs the conditional stream alone.
            temperature, top_k, top_p, do_sample: sampling knobs after CFG (`do_sample=False` = greedy).
            num_images_per_prompt: images per prompt.
            acceptance: `"none"` | `"exact"` | `"relaxed"` | `"grouped"` | `"jacobi"` (module docstring).
            drafter: `"jacobi"` (the default for every speculative acceptance); `"model"` / `"eagle"` need trained
                components that Janus has not got yet.
            num_draft_tokens, tree_nodes, tree_depth, tree_top_k: draft-model / EAGLE knobs (checked; unused by
                Jacobi).
            relaxation_top_k, relaxation_delta, relaxation_lambda: LANTERN (neighbourhoods of the L2-normalised
                VQ codebook).
            group_size, group_prob_threshold, group_dist_threshold: GSD.
            jacobi_window, jacobi_init, coupling: SJD window, fresh-token init, SCD coupling.
            jacobi_tree_width, jacobi_tree_depth: SJD-PAC (Kang et al., CVPR'26): `jacobi_tree_width > 1` proposes the
                window as a tree (`width` siblings drawn without replacement from the cached distributions at the
                first `depth - 1` positions, then a chain); lossless.
            resample: `"optimal"` or `"released"` residuals of the relaxed rules.
            generator: one `torch.Generator` on the model's device, or one per image.
            output_type: `"pil"` | `"np"` (NHWC in [0, 1]) | `"pt"` (NCHW in [0, 1]) | `"tokens"` (`[B, N]`).
            return_dict: a `SpeculativeImageOutput` (else `(images, stats)`).
            callback_on_step_end: `fn(pipe, round, generated_tokens, callback_kwargs)` after every round
                (`"tokens"`: the `[B, N]` grid, -1 = not yet; `"trace"`); read-only.
            time_phases: also time the draft and verify phases.

        Returns:
            `SpeculativeImageOutput(images, stats, trace)` or `(images, stats)`.
        """
        return self.generate(
            dict(prompt=prompt, input_ids=input_ids, attention_mask=attention_mask), guidance_scale=guidance_scale,
            temperature=temperature, top_k=top_k, top_p=top_p, do_sample=do_sample,
            num_images_per_prompt=num_images_per_prompt, acceptance=acceptance, drafter=drafter, knobs=knobs,
            generator=generator, output_type=output_type, return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs, time_phases=time_phases,
        )  # fmt: skip

    # ------------------------------------------------------------------ output
    def postprocess(self, tokens, output_type):
        """Token grids `[B, N]` -> images: the VQ decodes (`decode_image_tokens`), then the processor's
        normalisation is undone (`pixel * image_std + image_mean`, per channel) and the image rescaled to 8 bits, as
        the processor's `postprocess` does (which only handles 3 channels; the zoo's MNIST model has 1)."""
        if output_type == "tokens":
            return tokens
        pixels = self.model.decode_image_tokens(tokens).permute(0, 3, 1, 2).float().cpu()  # [B, C, H, W]
        if not torch.isfinite(pixels).all():
            raise ValueError("model: the VQ decoder produced non-finite pixels")
        ip = self.processor.image_processor
        if ip.do_normalize:
            mean = torch.as_tensor(ip.image_mean, dtype=torch.float32).reshape(-1, 1, 1)  # [C or 1, 1, 1]
            std = torch.as_tensor(ip.image_std, dtype=torch.float32).reshape(-1, 1, 1)
            pixels = pixels * std + mean
        array = (pixels * 255).clamp(0, 255).to(torch.uint8).numpy()  # [B, C, H, W], 8 bits as the processor
        if output_type == "pil":
            hwc = array.transpose(0, 2, 3, 1)
            return [PIL.Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image) for image in hwc]
        array = array.astype(np.float32) / 255.0
        return torch.from_numpy(array) if output_type == "pt" else array.transpose(0, 2, 3, 1)
