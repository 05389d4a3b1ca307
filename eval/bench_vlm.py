"""`mmspec bench vlm`: speculative VLM decoding side by side with plain decoding and transformers' assisted
generation, in one process, on the same images and prompts (greedy).

Methods (names fixed for the JSON): ``plain`` (mmspec's loop, no drafter), ``hf-plain`` (transformers
``generate``), ``hf-assisted`` (``generate(assistant_model=draft)``, the same draft LM; batch 1 only: transformers
has no batched assisted generation), ``draft-model`` (mmspec, the same draft LM, chain of ``--num-draft-tokens``),
``draft-model-frspec`` (the same draft LM scoring only the EAGLE head's 2,048-token draft vocabulary, FR-Spec: its
output head is most of a draft step's weight traffic), ``draft-model-confident`` (the same draft LM, chains of up to
``--confident-draft-tokens`` that stop after a token it gave a probability below ``--draft-confidence``, like
transformers' assistant), ``draft-model-tree`` (the same draft LM growing an EAGLE-2
tree of ``--model-tree-depth`` levels, ``--model-tree-top-k`` children per node, ``--model-tree-nodes`` nodes) and
``eagle`` (mmspec, the EAGLE head: a chain of ``--tree-depth`` with ``--tree-top-k 1``, else an EAGLE-2 tree of
``--tree-nodes`` nodes); the adaptive draft-length rows (`draft_length=`, chains of at most
``--adaptive-max-tokens``, per-row K): ``draft-model-heuristic`` / ``eagle-heuristic`` (transformers' schedule: +2
after a fully accepted round, -1 otherwise), ``draft-model-cost`` / ``eagle-cost`` (the per-row cost model) and
``draft-model-frspec-cost`` (the cost model on the FR-Spec draft LM; the ``-cost`` rows are priced by the
verification costs measured on this host first, ``verify_costs``, unless ``--cost-model line``),
``draft-model-frspec-batch-cost`` /
``eagle-batch-cost`` (one K for the whole batch, priced at the batch's cost: ``draft_length="batch-cost"``),
``draft-model-frspec-confident`` (the FR-Spec draft LM with the confidence stop at ``draft_confidence``'s default
0.4, transformers' assistant's stop), ``draft-model-calibrated`` / ``draft-model-frspec-calibrated`` /
``eagle-calibrated`` (each row stops inside the round where its expected tokens per unit of cost peak, pricing every
draft by its confidence calibrated online: ``draft_length="calibrated"``, priced by the same table),
``draft-model-frspec-batch-calibrated`` / ``eagle-batch-calibrated`` (that stop decided once for the whole batch:
``draft_length="batch-calibrated"``); the table-priced rows use a table measured at the batch size they run at (in
units of that batch's one-token forward: ``knobs.verify_costs_by_batch_size``); the
vision-aware heads with the same knobs: ``vispec`` (ViSpec's learned-query adaptor),
``specvlm`` (SpecVLM's gated elastic compressor) and ``msd`` (MSD's decoupled drafting), each from its zoo folder
``mnist-vlm-{vispec,specvlm,msd}``, and ``eagle3`` (the EAGLE-3 head of ``mnist-vlm-eagle3``: the target's low /
middle / high hidden states, its own draft-vocabulary output head; the format vLLM and SGLang serve) with the same
knobs (asking for a row whose folder is missing is a usage error before loading).

Workloads (``--workload``): ``templated`` (the default): ``--num-prompts`` held-out canvases (MNIST *test* digits,
``--min-digits`` 4 per canvas by default so the descriptions are long), all asked ``--prompt`` ("Describe the image.",
whose answer the target learned as a fixed template); ``free-form``: ``--num-prompts`` held-out canvases, each with
one held-out free-form prompt (`mmspec.data.vlm_prompts`: detail, story, layout, compare two digits, a two-turn
follow-up; kinds in turn), none of whose templates or canvas digits the drafters were trained on; ``readout``:
``--num-prompts`` held-out 4x4 digit grids (`mmspec.data.grids`: 128x128, 256 image tokens), each with one held-out
readout prompt (rows / columns / list / find, in turn), run on the ``mnist-vlm-readout`` target and its heads
(``mnist-vlm-readout-eagle``, ``-vispec``, ...); every row also reports how well its answers read their grids
(``digit_accuracy``: cells right of the rows / columns / list answers, ``find_accuracy``, ``follows_form``,
``exact``); ``file`` (``--prompts FILE``, your own prompts and images: a JSON Lines file as ``vlm-answers --prompts``
reads it, `mmspec.data.prompt_file`, its first ``--num-prompts`` lines), on the zoo's VLM or, with ``--target
FOLDER``, on your own transformers VLM (`mmspec.models.hf.vlm_folder`) with ``--eagle-head HEAD`` (an EAGLE,
EAGLE-3 or vision-aware head trained for it, run as the ``eagle`` rows): then the rows are ``plain``, ``hf-plain``
and, with a head, ``eagle`` and its adaptive rows. For each batch size of ``--batch-size`` (a comma list), the prompts are
cut into batches and every method runs on each batch in turn (interleaved, so load drift hits all alike), after one
warm-up call per method.
Per method: ``latency_s`` (median per batch, prefill included), ``speedup`` (plain's latency / the method's; with
``--do-sample`` plain's time per generated token / the method's, ``s_per_token``, since sampled answers differ in
length between methods: the same law, other draws),
``prefill_s`` and ``decode_s`` (mmspec methods time the two apart), ``decode_speedup`` (plain's decode time / the
method's; sampled: the ratio of decode ``tokens_per_s``), ``tokens_per_s`` (generated tokens / decode time; transformers methods: / latency), ``tau`` (tokens per
verification round, bonus included) and ``tau_without_bonus`` (accepted drafts per round), ``step_compression``
(tokens per target forward, prefill included; counted with a forward hook for transformers' methods too),
``matches_plain`` (every greedy answer identical to plain's; null under ``--do-sample``, where speculative answers
follow the target's law but are not token-identical to plain's -- the sampled law is proven by the tests' chi-square),
``mean_new_tokens``, ``accept_histogram`` (rounds by accepted drafts, 0..K) and ``acceptance_by_depth`` (the share
of rounds that accepted at least d drafts, d = 1..K; they sum to ``tau_without_bonus`` at one answer),
``draft_image_tokens`` (image tokens the drafter reads per answer, mean: the draft LM and EAGLE
read every image token, a vision-aware head its policy's tokens; null without a drafter) and ``gate_choice`` (SpecVLM:
answers per chosen compressor). ``--do-sample --temperature T``: sampled decoding (acceptance ``exact``; answer ``i``
of the workload draws from its own generator seeded ``--seed + i`` in every method); transformers' rows are greedy
only (``generate`` takes no generator). The JSON records ``workload``
(free-form: ``prompts``, each prompt's kind, template, turns and last user turn, instead of ``prompt``).
"""

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mmspec.cli.args import (
    DEFAULT_ZOO,
    MAX_BATCH,
    MAX_THREADS,
    finite_float,
    int_in_range,
    int_list_in_range,
    names_of,
    sampling_type,
    seed_int,
)
from mmspec.cli.checks import check_device, check_own_vlm, check_packed_linear, check_zoo_folders
from mmspec.data.canvases import MAX_DIGITS, held_out_canvases
from mmspec.methods import EAGLE_HEADS, TABLE_POLICIES, VLM_LIMITS


logger = logging.getLogger(__name__)

METHODS = (
    "plain",
    "hf-plain",
    "hf-assisted",
    "draft-model",
    "draft-model-confident",
    "draft-model-tree",
    "draft-model-frspec",
    "eagle",
    "draft-model-heuristic",
    "draft-model-cost",
    "draft-model-frspec-cost",
    "eagle-heuristic",
    "eagle-cost",
    "draft-model-frspec-batch-cost",
    "eagle-batch-cost",
    "draft-model-frspec-confident",
    "draft-model-calibrated",
    "draft-model-frspec-calibrated",
    "eagle-calibrated",
    "draft-model-frspec-batch-calibrated",
    "eagle-batch-calibrated",
)
# the adaptive rows: (drafter, draft-length policy, FR-Spec vocabulary) -- chains of at most --adaptive-max-tokens
ADAPTIVE = {
    "draft-model-heuristic": ("model", "heuristic", False),
    "draft-model-cost": ("model", "cost", False),
    "draft-model-frspec-cost": ("model", "cost", True),
    "eagle-heuristic": ("eagle", "heuristic", False),
    "eagle-cost": ("eagle", "cost", False),
    "draft-model-frspec-batch-cost": ("model", "batch-cost", True),
    "eagle-batch-cost": ("eagle", "batch-cost", False),
    "draft-model-frspec-confident": ("model", "confidence", True),
    "draft-model-calibrated": ("model", "calibrated", False),
    "draft-model-frspec-calibrated": ("model", "calibrated", True),
    "eagle-calibrated": ("eagle", "calibrated", False),
    "draft-model-frspec-batch-calibrated": ("model", "batch-calibrated", True),
    "eagle-batch-calibrated": ("eagle", "batch-calibrated", False),
}
# the other EAGLE heads, each from its zoo folder and run with the `eagle` row's knobs: eagle3 (mmspec.models.hf.eagle3)
# and the vision-aware ones (mmspec.drafters.vision_eagle: vispec, specvlm, msd)
VISION_METHODS = tuple(name for name in EAGLE_HEADS if name != "eagle")
ALL_METHODS = METHODS + VISION_METHODS
SPECVLM_EXPERTS = ("prune", "pool", "conv", "resampler", "text-only")  # mmspec.compressors.default_experts


MAX_PROMPTS = 10_000  # `--num-prompts`
COST_MODELS = ("table", "line")  # `--cost-model`: how the "cost" rows price a verification (`measure_verify_costs`)
COST_REPEATS = 15  # timed sweeps over the widths (median per width) in `measure_verify_costs`
WORKLOADS = ("templated", "free-form", "readout")
FILE_WORKLOAD = "file"  # `--prompts FILE`: the user's own prompts and images
TEMPLATED_PROMPT = "Describe the image."
# free-form answers are long: cut at 128 tokens; a readout "list" answer is 176 tokens and its end of turn
DEFAULT_MAX_NEW_TOKENS = {"templated": 96, "free-form": 128, "readout": 192, FILE_WORKLOAD: 128}
ZOO_NAMES = {
    "templated": "mnist-vlm",
    "free-form": "mnist-vlm",
    "readout": "mnist-vlm-readout",
    FILE_WORKLOAD: "mnist-vlm",
}  # the target folder (`--prompts` without `--target`: the zoo's VLM)
# the drafter folders (`<target folder><suffix>`) and the rows each serves
DRAFTER_FOLDERS = {"-draft": ("hf-assisted", "draft-model", "draft-model-confident", "draft-model-tree",
                                       "draft-model-frspec", "draft-model-heuristic", "draft-model-cost",
                                       "draft-model-frspec-cost", "draft-model-frspec-batch-cost",
                                       "draft-model-frspec-confident", "draft-model-calibrated",
                                       "draft-model-frspec-calibrated", "draft-model-frspec-batch-calibrated"),
                   "-eagle": ("eagle", "draft-model-frspec", "draft-model-frspec-cost", "eagle-heuristic",
                                       "eagle-cost", "draft-model-frspec-batch-cost", "eagle-batch-cost",
                                       "draft-model-frspec-confident", "draft-model-frspec-calibrated",
                                       "eagle-calibrated", "draft-model-frspec-batch-calibrated",
                                       "eagle-batch-calibrated"),
                   **{f"-{name}": (name,) for name in VISION_METHODS}}  # fmt: skip


def zoo_name(args) -> str:
    """The target's zoo folder name of `args.workload` (`mnist-vlm`, or `mnist-vlm-readout` for the readout grids)."""
    return ZOO_NAMES[workload_of(args)]


def workload_of(args) -> str:
    """The workload: "file" with `--prompts`, else `--workload` (default "templated")."""
    if getattr(args, "prompts", None) is not None:
        return FILE_WORKLOAD
    return getattr(args, "workload", None) or "templated"


def own_vlm(args) -> bool:
    """True when `--target` names your own VLM (the zoo's drafter folders do not apply)."""
    return getattr(args, "target", None) is not None


def _confidence(text):
    """argparse `type` of `--draft-confidence`: a number in (0, 1), as the draft LM's chains take it."""
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}")
    return value


def phase_fields(runs):
    """`--time-phases`: the decoding loop's draft and verify time per round (ms; a round is one verification
    forward: plain's is one decoding step, the prefill apart), summed over the calls; None without the flag or for
    transformers' rows."""
    if runs[0]["draft_s"] is None:
        return {"draft_ms_per_round": None, "verify_ms_per_round": None}
    rounds = sum(x["target_calls"] - 1 for x in runs)  # target_calls counts the prefill
    return {
        "draft_ms_per_round": 1e3 * sum(x["draft_s"] for x in runs) / rounds,
        "verify_ms_per_round": 1e3 * sum(x["verify_s"] for x in runs) / rounds,
    }


def add_arguments(parser):
    nodes, depth, top_k = (int_in_range(1, VLM_LIMITS[k]) for k in ("num_draft_tokens", "tree_depth", "tree_top_k"))
    parser.add_argument("--zoo", default=DEFAULT_ZOO,
                        help="folder with mnist-vlm, mnist-vlm-draft, mnist-vlm-eagle, ... (readout: mnist-vlm-readout, "
                             "mnist-vlm-readout-eagle, ...)")  # fmt: skip
    parser.add_argument("--batch-size", type=int_list_in_range(1, MAX_BATCH), default=[1],
                        help="answers per timed call (comma list; each at most --num-prompts)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int_in_range(1, MAX_PROMPTS), default=8,
                        help="canvases (one answer each)")  # fmt: skip
    parser.add_argument("--workload", choices=WORKLOADS, default=None,
                        help="templated (the default): every canvas asked --prompt; free-form: held-out free-form "
                             "prompts (mmspec.data.vlm_prompts); readout: held-out 4x4 digit grids read out "
                             "(mmspec.data.grids; the mnist-vlm-readout target and its heads)")  # fmt: skip
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="your own prompts and images instead of a --workload: a JSON Lines file "
                             "(mmspec.data.prompt_file, as vlm-answers --prompts reads it)")  # fmt: skip
    parser.add_argument("--target", default=None, metavar="FOLDER",
                        help="your own VLM (a transformers folder; needs --prompts) instead of the zoo's")  # fmt: skip
    parser.add_argument("--eagle-head", default=None, metavar="FOLDER",
                        help="with --target: the EAGLE / EAGLE-3 / vision-aware head trained for it (the eagle rows)")  # fmt: skip
    parser.add_argument("--draft", default=None, metavar="FOLDER",
                        help="with --target: its draft LM (a vlm-draft folder; the draft-model and hf-assisted rows)")  # fmt: skip
    parser.add_argument("--prompt", default=None, help=f"templated workload only (default {TEMPLATED_PROMPT!r})")
    parser.add_argument("--methods", type=names_of(ALL_METHODS), default=None,
                        help=f"comma list of {','.join(ALL_METHODS)} (default: every one the zoo has drafters for; "
                             "transformers' rows greedy only)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int_in_range(1, VLM_LIMITS["max_new_tokens"]), default=None,
                        help="answer length cap (default: 96 templated, 128 free-form)")  # fmt: skip
    parser.add_argument("--num-draft-tokens", type=nodes, default=4, help="draft-model chain length")
    parser.add_argument("--confident-draft-tokens", type=nodes, default=8, help="draft-model-confident K")
    parser.add_argument("--draft-confidence", type=_confidence, default=0.4, help="draft-model-confident stop")
    parser.add_argument("--adaptive-max-tokens", type=nodes, default=8,
                        help="the adaptive rows' K_max (-heuristic / -cost / -confident / -calibrated)")  # fmt: skip
    parser.add_argument("--cost-model", choices=COST_MODELS, default="table",
                        help="the -cost / -calibrated rows' verification price: table (measured here first, at "
                             "widths 1 to --adaptive-max-tokens + 1: verify_costs) or line (the registry's "
                             "verify_token_cost)")  # fmt: skip
    parser.add_argument("--model-tree-depth", type=depth, default=5, help="draft-model-tree depth")
    parser.add_argument("--model-tree-top-k", type=top_k, default=2, help="draft-model-tree children per node")
    parser.add_argument("--model-tree-nodes", type=nodes, default=10, help="draft-model-tree nodes")
    parser.add_argument("--tree-depth", type=depth, default=6, help="EAGLE chain length / tree depth")
    parser.add_argument("--tree-top-k", type=top_k, default=1, help="1: EAGLE chain; > 1: EAGLE-2 tree")
    parser.add_argument("--tree-nodes", type=nodes, default=24, help="EAGLE-2 tree nodes (tree-top-k > 1)")
    parser.add_argument(
        "--do-sample",
        action="store_true",
        help="sampled decoding (acceptance exact; answer i draws from a generator seeded --seed + i)",
    )
    parser.add_argument("--temperature", type=sampling_type("temperature", float), default=1.0,
                        help="sampling temperature (--do-sample; the pipeline's rule: finite, >= 0)")  # fmt: skip
    parser.add_argument("--specvlm-expert", choices=SPECVLM_EXPERTS, default=None,
                        help="ablation: the specvlm row sends every input to this compressor instead of its gate's pick")  # fmt: skip
    parser.add_argument("--time-phases", action="store_true",
                        help="profile: time our rows' draft and verify phases (per-round ms in the JSON; on CUDA "
                             "a sync at every phase boundary)")  # fmt: skip
    parser.add_argument("--seed", type=seed_int, default=0, help="canvas seed (and sampling seed)")
    parser.add_argument("--min-digits", type=int_in_range(1, MAX_DIGITS), default=4,
                        help=f"digits per canvas at least (1-{MAX_DIGITS})")  # fmt: skip
    parser.add_argument("--threads", type=int_in_range(0, MAX_THREADS), default=0,
                        help="torch CPU threads (0: default)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--packed-linear", action="store_true",
                        help="CPU: every row (transformers' too: the same modules) runs its 2-64-row linears on "
                             "oneDNN-packed weights (mmspec.models.packed_linear: a verification near a one-token "
                             "step's cost; plain decoding's kernels unchanged)")  # fmt: skip


def check_args(parser, args):
    """Before any model loads: the zoo has the VLM and the drafters of every method asked for (`--methods` unset:
    the methods whose drafters it has), the prompt is not empty, the batch sizes fit the prompts, the answer fits the
    model's context, and the device exists."""
    from mmspec.models import read_config

    check_packed_linear(parser, args)
    if args.prompts is not None and args.workload is not None:
        parser.error("argument --prompts: not allowed with --workload (the file is the workload)")
    for flag, value in (("--eagle-head", args.eagle_head), ("--draft", args.draft)):
        if value is not None and args.target is None:
            parser.error(f"argument {flag}: only with --target (the zoo's drafters come from --zoo)")
    if args.target is not None and args.prompts is None:
        parser.error("argument --target: needs --prompts FILE (your VLM's prompts and images)")
    workload = workload_of(args)
    if workload != "templated" and args.prompt is not None:
        parser.error(f"argument --prompt: not allowed with --workload {workload} (its prompts are the "
                     "workload's held-out templates); drop --prompt or use --workload templated")  # fmt: skip
    if args.prompts is not None:
        from mmspec.data.prompt_file import read_prompt_file

        try:
            lines = len(read_prompt_file(args.prompts))
        except ValueError as err:
            parser.error(f"argument --prompts: {err}")
        args.num_prompts = min(args.num_prompts, lines)
    if own_vlm(args):
        return check_own_args(parser, args)
    name = zoo_name(args)
    check_zoo_folders(parser, args.zoo, [name])
    if workload == "free-form" and args.min_digits < 2:
        parser.error(f"argument --min-digits: {args.min_digits} is below 2, which --workload free-form needs (its "
                     "compare prompts name two digits of the canvas)")  # fmt: skip
    resolve_workload_defaults(args)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("argument --prompt: is empty")
    missing = {m for suffix, names in DRAFTER_FOLDERS.items() if not (Path(args.zoo) / (name + suffix)).is_dir()
               for m in names}  # fmt: skip
    explicit = args.methods is not None
    if args.temperature != 1.0 and not args.do_sample:
        parser.error("argument --temperature: only used with --do-sample (greedy decoding has no temperature)")
    if args.specvlm_expert is not None and args.methods is not None and "specvlm" not in args.methods:
        parser.error("argument --specvlm-expert: forces the specvlm row's compressor; add specvlm to --methods")
    if args.do_sample and explicit and any(m.startswith("hf-") for m in args.methods):
        parser.error("argument --methods: hf-plain / hf-assisted run greedy only (transformers' generate takes no "
                     "generator); drop them or --do-sample")  # fmt: skip
    if args.methods is None:
        args.methods = [m for m in ALL_METHODS if m not in missing and not (args.do_sample and m.startswith("hf-"))]
    elif missing & set(args.methods):
        folders = sorted(name + f for f, names in DRAFTER_FOLDERS.items() if missing & set(names) & set(args.methods))
        parser.error(f"argument --methods: {','.join(sorted(missing & set(args.methods)))} need(s) the zoo folder(s) "
                     f"{', '.join(str(Path(args.zoo) / f) for f in folders)}, which do not exist")  # fmt: skip
    eagle_config = Path(args.zoo) / f"{name}-eagle" / "config.json"
    frspec_rows = [m for m in args.methods if "frspec" in m]
    if frspec_rows and eagle_config.is_file():
        try:
            vocab = json.loads(eagle_config.read_text()).get("draft_vocab_size", 0)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
            parser.error(f"argument --zoo: {str(eagle_config)!r} is not a JSON object ({err})")
        if not vocab:
            if explicit:
                parser.error(f"argument --methods: {','.join(frspec_rows)} need(s) an EAGLE head with a draft "
                             f"vocabulary (draft_vocab_size > 0 in {str(eagle_config)!r})")  # fmt: skip
            for m in frspec_rows:
                args.methods.remove(m)
    big = [b for b in args.batch_size if b > args.num_prompts]
    if big:
        parser.error(f"argument --batch-size: {big[0]} is more than --num-prompts {args.num_prompts}")
    try:
        config = read_config(Path(args.zoo) / name)
    except ValueError as err:
        parser.error(f"argument --zoo: {err}")
    context = config.get("text_config", {}).get("max_position_embeddings")
    image_tokens = config.get("image_seq_length", 0)
    if context is not None and args.max_new_tokens + image_tokens >= context:
        parser.error(f"argument --max-new-tokens: {args.max_new_tokens} new tokens and {image_tokens} image tokens "
                     f"do not fit the model's context of {context} tokens")  # fmt: skip
    check_device(parser, args.device)


# the rows a head of your own VLM runs (`--target --eagle-head`): the eagle rows whatever the head's kind; with its
# draft LM (`--draft`): transformers' assisted generation and the draft-model rows (FR-Spec ones with a head that has
# a draft vocabulary)
OWN_HEAD_METHODS = ("eagle", "eagle-heuristic", "eagle-cost", "eagle-batch-cost", "eagle-calibrated",
                    "eagle-batch-calibrated")  # fmt: skip
OWN_DRAFT_METHODS = tuple(m for m in METHODS if m == "hf-assisted" or m.startswith("draft-model"))


def check_own_args(parser, args):
    """`check_args` for your own VLM (`--target`): a VLM folder, a head folder of a head class, the rows it can run
    (plain, hf-plain, and the eagle rows with `--eagle-head`), batch sizes within the prompts, the device."""
    from mmspec.models import read_config

    check_own_vlm(parser, args.target, args.eagle_head, args.draft, flags=("--target", "--eagle-head", "--draft"))
    if args.temperature != 1.0 and not args.do_sample:
        parser.error("argument --temperature: only used with --do-sample (greedy decoding has no temperature)")
    frspec = False
    if args.eagle_head is not None:
        frspec = bool(read_config(args.eagle_head).get("draft_vocab_size", 0))
    drafts = [m for m in OWN_DRAFT_METHODS if args.draft and ("frspec" not in m or frspec)
              and not (args.do_sample and m == "hf-assisted")]  # fmt: skip
    allowed = ["plain", *([] if args.do_sample else ["hf-plain"]), *drafts,
               *(OWN_HEAD_METHODS if args.eagle_head else ())]  # fmt: skip
    if args.methods is None:
        args.methods = allowed
    elif set(args.methods) - set(allowed):
        extra = ",".join(m for m in args.methods if m not in allowed)
        parser.error(f"argument --methods: {extra} cannot run on --target (it runs {','.join(allowed)}: the eagle "
                     "rows need --eagle-head, the draft-model and hf-assisted rows --draft, the FR-Spec ones both "
                     "and a head with a draft vocabulary; hf rows are greedy only)")  # fmt: skip
    big = [b for b in args.batch_size if b > args.num_prompts]
    if big:
        parser.error(f"argument --batch-size: {big[0]} is more than the {args.num_prompts} prompt(s) used")
    resolve_workload_defaults(args)
    check_device(parser, args.device)


def resolve_workload_defaults(args):
    """Fill `--workload` ("file" with `--prompts`), `--prompt` / `--max-new-tokens` left unset with the workload's
    defaults (templated: today's)."""
    workload = args.workload = workload_of(args)
    if workload not in (*WORKLOADS, FILE_WORKLOAD):
        raise ValueError(f"workload={workload!r}: use one of {WORKLOADS}")
    if workload == "templated" and args.prompt is None:
        args.prompt = TEMPLATED_PROMPT
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS[workload]


def readout_inputs(num, seed):
    """The readout workload: (`num` held-out PIL grids, their held-out readout `FreeFormPrompt`s, their layouts)."""
    from mmspec.data import grids
    from mmspec.data.canvases import to_pil

    layouts, canvases, prompts = grids.sample_prompts(num, "held-out", seed)
    return [to_pil(c) for c in canvases], prompts, layouts


def readout_accuracy(tokenizer, answers, prompts, layouts) -> dict:
    """How well answers read their grids (`grids.score`): `digit_accuracy` (cells right / cells, rows / columns / list
    prompts, in whatever form the answer states them), `find_accuracy` (cells classified right by the find answers),
    `follows_form` (rows / columns / list answers in the form asked), `exact` (whole answers right)."""
    from mmspec.data import grids

    scores = [grids.score(lay, p, tokenizer.decode(a, skip_special_tokens=True))
              for a, p, lay in zip(answers, prompts, layouts)]  # fmt: skip
    read = [s for s, p in zip(scores, prompts) if p.kind != "find"]
    find = [s for s, p in zip(scores, prompts) if p.kind == "find"]
    ratio = lambda rows: sum(s["correct"] for s in rows) / sum(s["digits"] for s in rows) if rows else None  # noqa: E731
    return {"digit_accuracy": ratio(read), "find_accuracy": ratio(find),
            "follows_form": sum(s["follows"] for s in read) / len(read) if read else None,
            "exact": sum(s["exact"] for s in scores) / len(scores)}  # fmt: skip


def free_form_inputs(num, seed, min_digits=4):
    """The free-form workload: (`num` held-out PIL canvases, their held-out `FreeFormPrompt`s)."""
    from mmspec.data.canvases import to_pil
    from mmspec.data.vlm_prompts import sample_prompts

    _, canvases, prompts = sample_prompts(num, "held-out", seed, min_digits)
    return [to_pil(c) for c in canvases], prompts


def image_token_fields(runs):
    """A row's `draft_image_tokens` (mean per answer over every call; None without a drafter) and `gate_choice`
    (answers per chosen compressor; None without a gate)."""
    tokens = [n for x in runs for n in (x["draft_image_tokens"] or [])]
    choices = [c for x in runs for c in (x["gate_choice"] or [])]
    return {
        "draft_image_tokens": statistics.mean(tokens) if tokens else None,
        "gate_choice": {c: choices.count(c) for c in sorted(set(choices))} if choices else None,
    }


def depth_fields(runs):
    """`accept_histogram` (verification rounds by accepted drafts 0..K, summed over the calls) and
    `acceptance_by_depth` (d = 1..K: the share of rounds that accepted at least d drafts; their sum is tau without
    the bonus); None for transformers' rows and plain (no drafts)."""
    hists = [x["accept_histogram"] for x in runs if x["accept_histogram"] is not None]
    width = max((len(h) for h in hists), default=0)
    hist = [sum(h[j] for h in hists if j < len(h)) for j in range(width)]
    if width < 2 or not sum(hist):
        return {"accept_histogram": None, "acceptance_by_depth": None}
    total = sum(hist)
    return {"accept_histogram": hist,
            "acceptance_by_depth": [round(sum(hist[d:]) / total, 4) for d in range(1, width)]}  # fmt: skip


class _Counter:
    """Counts forward calls of a module (target / assistant passes of transformers' `generate`)."""

    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.calls += 1


def hf_assisted_knobs(pipe):
    """transformers' assisted-generation settings (read off the draft's generation config; its defaults)."""
    if pipe.draft_model is None:
        return None
    from transformers import GenerationConfig

    config, defaults = pipe.draft_model.generation_config, GenerationConfig._get_default_generation_params()
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {
        name: defaults.get(name) if getattr(config, name, None) is None else getattr(config, name) for name in names
    }


def build_pipeline(args):
    from mmspec.pipelines.vlm import SpeculativeVLMPipeline

    if own_vlm(args):  # your own VLM (`--target`) and the drafters trained for it
        return SpeculativeVLMPipeline.from_folders(args.target, eagle_head=args.eagle_head, draft=args.draft)
    return SpeculativeVLMPipeline.from_zoo(args.zoo, name=zoo_name(args))


def file_inputs(path, num):
    """The `--prompts` workload: (each of the file's first `num` lines' images, a list of PIL per line; their
    conversations)."""
    from mmspec.data.prompt_file import open_images, read_prompt_file

    rows = read_prompt_file(path)[:num]
    return [open_images(r.image_files) for r in rows], [r.messages for r in rows]  # hashed by read_prompt_file


def flat_images(images):
    """A batch's images as the processor takes them: flat, in order (a `--prompts` batch holds a list per prompt);
    None when there are none."""
    if images and isinstance(images[0], list):
        images = [im for row in images for im in row]
    return images or None


def load_vision_heads(args, pipe):
    """The other heads of the rows asked for (`<zoo>/<target folder>-<row>`), in the target's dtype."""
    from mmspec.models import load

    if own_vlm(args):
        return {}  # your head is the eagle row's
    names = [m for m in args.methods if m in VISION_METHODS]
    return {name: load(Path(args.zoo) / f"{zoo_name(args)}-{name}", dtype=pipe.model.dtype) for name in names}


@torch.no_grad()
def measure_verify_costs(pipe, prefix: torch.Tensor, widths: int, repeats: int = COST_REPEATS) -> tuple:
    """`verify_costs` for the "-cost" / "-calibrated" rows: the target's decoder and output head over `m` new tokens
    after the `prefix` [1, L] token ids (a prompt's, placeholders included), for m = 1..`widths`, in one-token
    forwards: `repeats` sweeps over every width in turn (interleaved, so a drift of the host's speed hits every
    width alike), the median per width (the new tokens dropped from the cache after every forward). A calibration
    of this host, made before any timed row; it sets only how much each round drafts, never an answer."""
    from transformers import DynamicCache

    decoder, head = pipe.model.get_decoder(), pipe.model.get_output_embeddings()
    cache = DynamicCache()
    decoder(input_ids=prefix, past_key_values=cache, use_cache=True)
    samples = [[] for _ in range(widths)]
    for _ in range(repeats + 1):  # the first sweep warms every width up and is not kept
        for m in range(1, widths + 1):
            new = prefix[:, -1:].expand(-1, m).contiguous()
            start = time.perf_counter()
            head(decoder(input_ids=new, past_key_values=cache, use_cache=True).last_hidden_state)
            samples[m - 1].append(time.perf_counter() - start)
            cache.crop(-m)
    times = [statistics.median(s[1:]) for s in samples]
    return tuple(round(t / times[0], 3) for t in times)


def answer_generators(first, count, seed, device):
    """One generator per answer, answer `i` of the workload seeded `seed + i` (the same in every method)."""
    return [torch.Generator(device).manual_seed(seed + first + i) for i in range(count)]


def run(args, pipe=None, canvases=None, heads=None):
    """The report (module docstring). `canvases`: PIL images instead of the held-out ones (templated workload).
    `heads`: vision-aware heads by row name (`VISION_METHODS`) to run with `pipe`'s target (default: loaded from
    `--zoo` when the pipeline is, else none; rows without a head are skipped)."""
    resolve_workload_defaults(args)
    workload = args.workload
    if workload != "templated" and canvases is not None:
        raise ValueError(f"canvases: the {workload} workload draws its own held-out canvases (they go with its "
                         "prompts)")  # fmt: skip
    do_sample = bool(getattr(args, "do_sample", False))
    time_phases = bool(getattr(args, "time_phases", False))
    temperature = float(getattr(args, "temperature", 1.0))
    if args.methods is None:  # not through `mmspec bench` (no check_args): every method the pipeline can run
        args.methods = list(ALL_METHODS)
    if not args.batch_size:
        raise ValueError("--batch-size needs at least one batch size")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if heads is None:
        heads = {} if pipe is not None else None
    pipe = (pipe or build_pipeline(args)).to(device)
    pipe.set_progress_bar_config(disable=True)
    packed = getattr(args, "packed_linear", False)
    if packed:  # in place, so transformers' rows (the same modules) run the same kernels
        pipe.enable_packed_linear()
    try:
        heads = load_vision_heads(args, pipe) if heads is None else dict(heads)
        expert = getattr(args, "specvlm_expert", None)
        if expert is not None and "specvlm" in heads:
            heads["specvlm"].vision.force(expert)  # the per-compressor ablation (inference only)
        unknown = sorted(set(heads) - set(VISION_METHODS))
        if unknown:
            raise ValueError(f"heads: unknown row(s) {unknown}; the vision-aware rows are {VISION_METHODS}")
        pipes = {"eagle": pipe}  # one pipeline per head, all on the same target, processor and draft LM
        for name, head in heads.items():
            pipes[name] = type(pipe)(
                pipe.model, pipe.processor, draft_model=pipe.draft_model, eagle_head=head.to(device)
            )
            pipes[name].set_progress_bar_config(disable=True)
        free_form = layouts = None
        if workload == "free-form":
            canvases, free_form = free_form_inputs(args.num_prompts, args.seed, args.min_digits)
            prompts, key = [p.messages for p in free_form], "messages"
        elif workload == "readout":
            canvases, free_form, layouts = readout_inputs(args.num_prompts, args.seed)
            prompts, key = [p.messages for p in free_form], "messages"
        elif workload == FILE_WORKLOAD:
            canvases, prompts = file_inputs(args.prompts, args.num_prompts)
            key = "messages"
        else:
            canvases = canvases or held_out_canvases(args.num_prompts, args.seed, args.min_digits)
            prompts, key = [args.prompt] * len(canvases), "prompt"
        eos = pipe.eos_token_ids()
        counters = {"target": _Counter(pipe.model)}
        if pipe.draft_model is not None:
            counters["draft"] = _Counter(pipe.draft_model)
        common = dict(max_new_tokens=args.max_new_tokens, do_sample=do_sample)
        if do_sample:
            common["temperature"] = temperature
        greedy = dict(acceptance="exact" if do_sample else "greedy")
        ours = {
            "plain": dict(acceptance="none"),
            "draft-model": dict(greedy, drafter="model", num_draft_tokens=args.num_draft_tokens),
            "draft-model-confident": dict(greedy, drafter="model", num_draft_tokens=args.confident_draft_tokens,
                                          draft_confidence=args.draft_confidence),
            "draft-model-tree": dict(greedy, drafter="model", tree_depth=args.model_tree_depth,
                                     tree_top_k=args.model_tree_top_k, tree_nodes=args.model_tree_nodes),
            "draft-model-frspec": dict(greedy, drafter="model", num_draft_tokens=args.num_draft_tokens,
                                       draft_vocab=getattr(pipe.eagle_head, "draft_vocab", None)),
            "eagle": dict(greedy, drafter="eagle", tree_depth=args.tree_depth, tree_top_k=args.tree_top_k,
                          tree_nodes=args.tree_nodes),
        }  # fmt: skip
        for name in VISION_METHODS:  # the vision-aware heads: EAGLE's knobs
            ours[name] = dict(ours["eagle"])
        k_max = getattr(args, "adaptive_max_tokens", 8)
        for name, (drafter, policy, vocab) in ADAPTIVE.items():
            size = dict(num_draft_tokens=k_max) if drafter == "model" else dict(tree_depth=k_max, tree_top_k=1)
            ours[name] = dict(greedy, drafter=drafter, draft_length=policy, **size)
            if vocab:
                ours[name]["draft_vocab"] = getattr(pipe.eagle_head, "draft_vocab", None)
        frspec = pipe.eagle_head is not None and pipe.eagle_head.config.draft_vocab_size > 0
        methods = [m for m in args.methods if not ("frspec" in m and (not frspec or pipe.draft_model is None))
                   and not (m.startswith("draft-model") and pipe.draft_model is None)
                   and not (m == "hf-assisted" and pipe.draft_model is None)
                   and not (m.startswith("eagle") and pipe.eagle_head is None)
                   and not (m in VISION_METHODS and m not in heads) and not (do_sample and m.startswith("hf-"))]  # fmt: skip
        if "plain" not in methods:
            methods.insert(0, "plain")
        tables = {}  # batch size -> the verification table the table-priced rows run with at that batch size
        if getattr(args, "cost_model", "table") == "table" and any(ADAPTIVE.get(m, (None, None))[1] in TABLE_POLICIES
                                                                     for m in methods):  # fmt: skip
            prefix = pipe.encode(flat_images(canvases[:1]), *((prompts[:1], None) if key == "prompt" else (None, prompts[:1])),
                                 device)[0]  # fmt: skip
            for bs in args.batch_size:  # priced in units of a one-token forward of `bs` rows
                tables[bs] = measure_verify_costs(pipe, prefix.expand(bs, -1).contiguous(), k_max + 1)
                logger.info("b%d verification cost by width (one-token forwards): %s", bs, tables[bs])

        def draft_lm_image_tokens(ims, texts):
            """Image tokens transformers' assistant (the draft LM) reads per answer."""
            from mmspec.models.hf.inputs import image_token_mask

            ids, lengths, _ = pipe.encode(ims, *((texts, None) if key == "prompt" else (None, texts)), device)
            valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
            return (image_token_mask(pipe.draft_model, ids) & valid).sum(1).tolist()

        def call(name, ims, texts, first=0):
            """One timed call: (answers as token lists up to EOS, stats dict). `first`: the workload index of the
            batch's first answer (its sampling seed)."""
            for c in counters.values():
                c.calls = 0
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows, ims = len(texts), flat_images(ims)
            if name in ours:
                sampling = dict(generator=answer_generators(first, rows, args.seed, device)) if do_sample else {}
                out = pipes.get(name, pipe)(images=ims, **{key: texts}, output_type="ids", **common, **ours[name],
                                            time_phases=time_phases, **sampling)  # fmt: skip
                dt = time.perf_counter() - t0
                s = out.stats
                answers = [[t for t in row if t >= 0] for row in out.sequences.tolist()]
                info = dict(prefill_s=s.time_prefill_s, decode_s=dt - s.time_prefill_s, tau=s.mean_accepted_length,
                            tau_without_bonus=s.mean_accepted_drafts, step_compression=s.step_compression,
                            target_calls=s.target_forwards, draft_calls=s.draft_forwards,
                            draft_image_tokens=s.extra.get("draft_image_tokens_per_answer"),
                            accept_histogram=list(s.accept_histogram),
                            gate_choice=s.extra.get("gate_choice"), draft_s=s.time_draft_s,
                            verify_s=s.time_verify_s)  # fmt: skip
            else:
                ids, lengths, extra = pipe.encode(ims, *((texts, None) if key == "prompt" else (None, texts)), device)
                if ids.shape[0] != 1:
                    raise ValueError("transformers' methods run at batch 1")
                kw = dict(assistant_model=pipe.draft_model) if name == "hf-assisted" else {}
                gen = pipe.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), eos_token_id=eos,
                                          pad_token_id=pipe.tokenizer.pad_token_id, **extra, **common, **kw)  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                answer = gen[0, ids.shape[1] :].tolist()
                for i, t in enumerate(answer):
                    if eos and t in eos:
                        answer = answer[: i + 1]
                        break
                answers = [answer]
                calls = counters["target"].calls
                info = dict(prefill_s=None, decode_s=None, tau=None, tau_without_bonus=None,
                            step_compression=len(answer) / calls if calls else None, target_calls=calls,
                            draft_calls=counters["draft"].calls if "draft" in counters else 0,
                            draft_image_tokens=draft_lm_image_tokens(ims, texts) if name == "hf-assisted" else None,
                            accept_histogram=None,
                            gate_choice=None, draft_s=None, verify_s=None)  # fmt: skip
            return answers, dict(latency_s=dt, new_tokens=sum(len(a) for a in answers), **info)

        report = {}
        for bs in args.batch_size:
            for name, (_, policy, _) in ADAPTIVE.items():
                if bs in tables and policy in TABLE_POLICIES:
                    ours[name]["verify_costs"] = tables[bs]
            names = [m for m in methods if bs == 1 or not m.startswith("hf-")]
            batches = [(canvases[i : i + bs], prompts[i : i + bs]) for i in range(0, len(canvases), bs)]
            for name in names:  # warm-up
                call(name, *batches[0])
            runs = {name: [] for name in names}
            answers = {name: [] for name in names}
            for i, (ims, texts) in enumerate(tqdm(batches, desc=f"vlm b{bs}", disable=None)):
                for name in names:
                    a, info = call(name, ims, texts, first=i * bs)
                    runs[name].append(info)
                    answers[name] += a
            table = {}
            for name in names:
                r = runs[name]
                med = lambda key, r=r: statistics.median(x[key] for x in r) if r[0][key] is not None else None  # noqa: E731
                decode = sum(x["decode_s"] for x in r) if r[0]["decode_s"] is not None else None
                tokens = sum(x["new_tokens"] for x in r)
                rounds_tau = [x["tau"] for x in r if x["tau"] is not None]
                table[name] = {
                    "latency_s": med("latency_s"),
                    "prefill_s": med("prefill_s"),
                    "decode_s": med("decode_s"),
                    "tokens_per_s": tokens / (decode if decode is not None else sum(x["latency_s"] for x in r)),
                    "tau": statistics.mean(rounds_tau) if rounds_tau else None,
                    "tau_without_bonus": statistics.mean(x["tau_without_bonus"] for x in r) if rounds_tau else None,
                    "step_compression": statistics.mean(x["step_compression"] for x in r if x["step_compression"]),
                    "target_calls": statistics.mean(x["target_calls"] for x in r),
                    "draft_calls": statistics.mean(x["draft_calls"] for x in r),
                    "mean_new_tokens": tokens / len(canvases),
                    "s_per_token": sum(x["latency_s"] for x in r) / max(tokens, 1),  # prefill included
                    "min_new_tokens": min(len(a) for a in answers[name]),
                    "matches_plain": None if do_sample else answers[name] == answers["plain"],
                    **image_token_fields(r),
                    **phase_fields(r),
                    **depth_fields(r),
                    **({} if layouts is None else readout_accuracy(pipe.tokenizer, answers[name], free_form, layouts)),
                }
            base = table["plain"]
            for entry in table.values():
                if do_sample:  # the same law, other draws: answers (and lengths) differ, so compare time per token
                    entry["speedup"] = base["s_per_token"] / entry["s_per_token"]
                    entry["decode_speedup"] = (
                        entry["tokens_per_s"] / base["tokens_per_s"] if entry["decode_s"] else None
                    )
                    continue
                entry["speedup"] = base["latency_s"] / entry["latency_s"]
                entry["decode_speedup"] = base["decode_s"] / entry["decode_s"] if entry["decode_s"] else None
            if "hf-assisted" in table:
                for name in ALL_METHODS[3:]:
                    if name in table:
                        table[name]["speedup_vs_hf_assisted"] = (
                            table["hf-assisted"]["latency_s"] / table[name]["latency_s"]
                        )
            report[str(bs)] = table
            for name, e in table.items():
                logger.info("b%d %-12s %.3fs speedup %.2fx decode %.2fx tau %s matches %s draft image tokens %s gate %s",
                            bs, name, e["latency_s"], e["speedup"], e["decode_speedup"] or float("nan"), e["tau"],
                            e["matches_plain"], e["draft_image_tokens"], e["gate_choice"])  # fmt: skip
        for c in counters.values():
            c.handle.remove()
        return {
            "bench": "vlm",
            "zoo": None if own_vlm(args) else str(args.zoo),
            **(
                {
                    "target": str(args.target),
                    "eagle_head": args.eagle_head and str(args.eagle_head),
                    "draft": args.draft and str(args.draft),
                }
                if own_vlm(args)
                else {}
            ),  # fmt: skip
            "workload": workload,
            **({"prompts_file": str(args.prompts)} if workload == FILE_WORKLOAD else {}),
            "prompt": args.prompt if free_form is None else None,
            **(
                {}
                if free_form is None
                else {
                    "prompts": [
                        {
                            "kind": p.kind,
                            "template": p.template,
                            "turns": sum(m["role"] == "user" for m in p.messages),
                            "text": p.text,
                        }
                        for p in free_form
                    ]
                }
            ),  # fmt: skip
            "example_answer": pipe.tokenizer.decode(answers["plain"][0], skip_special_tokens=True),
            "knobs": {
                "max_new_tokens": args.max_new_tokens,
                "do_sample": do_sample,
                **({"temperature": temperature} if do_sample else {}),
                **({"specvlm_expert": expert} if expert is not None else {}),
                **{
                    name: {k: f"{len(v)} ids" if torch.is_tensor(v) else v for k, v in kw.items()}
                    for name, kw in ours.items()
                },
                "hf-assisted": hf_assisted_knobs(pipe),
                "cost_model": getattr(args, "cost_model", "table"),
                "verify_costs_by_batch_size": {str(bs): table for bs, table in tables.items()} or None,
            },
            "batch_sizes": args.batch_size,
            "num_prompts": len(canvases),
            "seed": args.seed,
            "device": str(device),
            "threads": torch.get_num_threads(),
            "packed_linear": packed,
            "time_phases": time_phases,
            "machine": platform.machine(),
            "torch": torch.__version__,
            "by_batch_size": report,
        }
    finally:
        if packed:  # a pipeline handed in leaves as it came, also when a row raises
            pipe.disable_packed_linear()
