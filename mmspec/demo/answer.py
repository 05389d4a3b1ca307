"""A VLM answer as HTML, token by token, each token styled by where it came from (its `DecodeTrace` origin): a
drafted token the target accepted (green), the target's correction where it rejected a draft (red, struck
through: the draft was wrong here), or a token the target emitted on its own (prefill / bonus; plain)."""

import html

from mmspec.decoding.trace import ACCEPTED, BONUS, PREFILL, RESAMPLED


__all__ = ["ANSWER_STYLES", "answer_html", "answer_legend_html"]

ANSWER_STYLES = {
    ACCEPTED: ("accepted", "background:#b8e6c1", "drafted, accepted"),
    RESAMPLED: (
        "rejected",
        "background:#f6b8b0;text-decoration:underline wavy #c0392b",
        "draft rejected: the target's token",
    ),  # fmt: skip
    BONUS: ("target", "", "the target's own token (bonus / plain)"),
    PREFILL: ("target", "", "the target's own token (prefill)"),
}


def answer_html(tokenizer, sequence, trace, row=0):
    """`sequence`: the row's generated ids (`[N]`, -1 after EOS); returns a `<div>` of one `<span>` per token with
    `class="tok tok-<accepted|rejected|target>"` and a tooltip naming the verification round."""
    ids = [int(t) for t in sequence.tolist()]
    origins = trace.origin[row].tolist()
    rounds = trace.round[row].tolist()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    spans = []
    for token, origin, rnd in zip(ids, origins, rounds):
        if token < 0 or token in special:
            continue
        kind, style, label = ANSWER_STYLES.get(origin, ("target", "", "target"))
        text = html.escape(tokenizer.decode([token]))
        spans.append(f'<span class="tok tok-{kind}" style="{style}" title="{label}; round {rnd}">{text}</span>')
    return '<div class="mmspec-answer" style="line-height:1.8;white-space:pre-wrap">' + "".join(spans) + "</div>"


def answer_legend_html():
    seen, parts = set(), []
    for kind, style, label in ANSWER_STYLES.values():
        if kind not in seen:
            seen.add(kind)
            parts.append(f'<span class="tok tok-{kind}" style="{style};padding:0 4px;margin-right:8px">{label}</span>')
    return '<div class="mmspec-legend">' + "".join(parts) + "</div>"
