"""Is a speculative method lossless? Its output against plain decoding's, ties told from bugs.

At temperature 0 DFlash and DDTree must reproduce `ar` token for token. In exact arithmetic they
do; in bf16 they need not, because `ar` runs one-row target forwards while the speculative methods
run multi-row verify forwards, whose sums round differently: where the target's two best logits are
(nearly) tied, argmax can flip, and from there on the texts differ. Such a divergence is harmless;
one where the target clearly preferred the reference's token is a bug.

A divergence is classed a tie when the target's top-1 minus top-2 logit at the reference's step that
produced the first differing token is below `tolerance`. The verdict over a set of responses is
"yes" (no divergence), "ties-only" (every divergence is a tie) or "no".

BF16_TIE_TOLERANCE, a logit margin, is sized on the 6-layer test target in bf16 on a CPU (logits
up to about 8, so a bf16 rounding step of 1/32 there): its one-row and multi-row forwards differ by
up to 0.43 in a logit (0.19 in a typical response), and the first divergences of correct loops all
start at margins of at most 0.125. A bug diverges where the target's margin is whatever it is: on
that target 25% of the steps have a margin below 0.25, so one diverging response in four would pass
for a tie, and a bug that diverges in many responses reads "no". Targets with larger logits round
more coarsely: pass a larger tolerance for them. `near_tie_share` says how much a "ties-only" is
worth on a given target: on one whose logits barely spread (a randomly initialised model) nearly
every step is a near-tie and the verdict cannot tell anything apart.
"""
from dataclasses import dataclass

BF16_TIE_TOLERANCE = 0.25
VERDICTS = ("yes", "ties-only", "no")


@dataclass
class FirstDivergence:
    """The first output position where a method's tokens leave the reference's."""
    position: int                 # index into the output tokens (0 = the prefill's token)
    reference_token: int | None   # None where the reference's output ended first
    token: int | None             # None where the method's output ended first
    margin: float | None          # the target's top-1 minus top-2 logit at the reference's step
    tie: bool                     # margin < tolerance


def first_divergence(output_ids: list[int], reference_ids: list[int], reference_margins: list[float],
                     tolerance: float = BF16_TIE_TOLERANCE) -> FirstDivergence | None:
    """None when `output_ids` equal `reference_ids`; else where and how they first differ.

    `reference_margins` are the reference generation's per-token top-1 minus top-2 logits
    (`Generation.margins` of an `ar` run). An output that stops early or runs on is no tie.
    """
    if output_ids == reference_ids:
        return None
    position = next((i for i, (a, b) in enumerate(zip(output_ids, reference_ids)) if a != b),
                    min(len(output_ids), len(reference_ids)))
    token = output_ids[position] if position < len(output_ids) else None
    reference_token = reference_ids[position] if position < len(reference_ids) else None
    margin = reference_margins[position] if position < len(reference_margins) else None
    tie = token is not None and reference_token is not None and margin < tolerance
    return FirstDivergence(position, reference_token, token, margin, tie)


def lossless_verdict(divergences: list[FirstDivergence | None]) -> str:
    """"yes" when there is no divergence, "ties-only" when every one is a tie, else "no"."""
    found = [d for d in divergences if d is not None]
    if not found:
        return "yes"
    return "ties-only" if all(d.tie for d in found) else "no"


def near_tie_share(reference_margins: list[float], tolerance: float = BF16_TIE_TOLERANCE) -> float | None:
    """The fraction of the reference's steps whose top-1 minus top-2 margin is below `tolerance`:
    about the chance that a bug's first divergence passes for a tie."""
    if not reference_margins:
        return None
    return sum(m < tolerance for m in reference_margins) / len(reference_margins)
