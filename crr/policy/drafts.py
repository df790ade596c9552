"""Drafts for speculative decoding: the tokens a call is likely to repeat, proposed by n-gram lookup.

A decoding pass of the batched sampler (crr.policy.backend) can feed a row several tokens at once and get
the logits after each; on a CPU, and for a small model on a GPU, a pass of a few tokens costs about what a
pass of one does (the tiny model, 16 rows over a 1,200-token cache in bf16: 9 tokens a row take 1.15x the
seconds of 1). So a row that feeds a guess of its next tokens keeps every guessed token its sampler would
have drawn anyway, and pays one pass for them. The sampler checks a guess against its own draw (the same
Gumbel noise at the same position), so what it samples does not depend on the guess: a guess only saves
passes (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", with a draft
that puts all its mass on one token; the sampler's draw is the target's, so every kept token is exact).

Where the guesses come from is prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`):
the tokens that followed the last occurrence of the row's last n-gram in a source. A counterfactual branch
replays what its trajectory did after the fork in large part (the same later views, edits, tests and submit):
its source is its trajectory's calls from a_t on, so a branch pays for what is new in it. Every episode's
source also holds its own earlier calls (paths, commands and code it repeats). Measured on the committed
multi-tier CRR runs (docs/training.md, "Drafts"): a branch's calls after its proposal need 0.40-0.48 of the
passes, a trajectory's calls 0.70-0.72.

A hand-written index rather than transformers' prompt lookup candidate generator: that one drafts for
`model.generate`, which this sampler does not use (crr.policy.backend.TransformersBackend), and scans the
prompt at every step where this index looks an n-gram up in a dict.
"""

from __future__ import annotations

DEFAULT_DRAFT_TOKENS = 8   # a guess's length: what a pass of 9 tokens a row still feeds at about one's price
MAX_NGRAM = 3              # the longest suffix looked up (then shorter ones)


class Drafts:
    """The guesses for one row: `draft(context)` gives up to `length` tokens that followed the last occurrence in
    `source` of context's longest suffix of at most MAX_NGRAM tokens found there (nothing when none is)."""

    def __init__(self, source: list[int], length: int = DEFAULT_DRAFT_TOKENS):
        self.source, self.longest, self.length = source, length, length
        self.guessed = 0   # the last guess's length
        self.after: dict[tuple[int, ...], int] = {}   # n-gram -> where its last occurrence (with a successor) ends
        for n in range(1, MAX_NGRAM + 1):
            for s in range(len(source) - n):
                self.after[tuple(source[s:s + n])] = s + n

    def draft(self, context: list[int], room: int) -> list[int]:
        """At most min(length, room) tokens to feed after `context`."""
        guess = []
        for n in range(min(MAX_NGRAM, len(context)), 0, -1):
            end = self.after.get(tuple(context[-n:]))
            if end is not None:
                guess = self.source[end:end + min(self.length, room)]
                break
        self.guessed = len(guess)
        return guess

    def taken(self, unread: int) -> None:
        """How the last guess went: the sampler kept all but its last `unread` tokens. The next guess is twice as
        long after one kept whole (up to the longest), as long as what was kept plus one after one that was not:
        a guess off the track costs its columns in every row of the pass, on the track it saves passes."""
        if self.guessed:
            kept = max(0, self.guessed - unread)
            self.length = min(self.longest, 2 * self.guessed) if kept == self.guessed else kept + 1
