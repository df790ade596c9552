"""A scripted policy: a generation backend whose "samples" are the calls of a script, in order, so that the
expert's episodes and the fork bench's scripted trajectories run through the same episode driver as the
policy's rollouts (crr.rollout.drive):

    traj = run_episode(task, ScriptedBackend(calls, grammar.tokenize), engine, tokenizer, config)  # crr.rollout

A scripted call is not a sample: it has no log-probabilities, entropy, sampling seed or generation time, so
the backend returns `ScriptedCall`s rather than StepSamples, and the driver plays them with no generation
record (the trajectory's steps read as scripted ones: empty log-probabilities, no sample seed), never as a
policy's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from crr.errors import CRRError


@dataclass(frozen=True)
class ScriptedCall:
    """One call of a script: its JSON text and action ids (None: the tokenizer's encoding of the rendered
    action, what a chat-template SFT sees)."""
    text: str
    action_ids: list[int] | None = None


class ScriptedBackend:
    """The GenerationBackend of one scripted episode: each `generate` returns the script's next call. The
    action ids come from `tokenize` (e.g. `ToolCallGrammar.tokenize`: the tokens the constrained sampler
    emits) where it gives some. A script must end its episode (submit_patch, or as many calls as the turn
    cap H): asked for a call past its end, it raises a CRRError."""

    def __init__(self, calls: list[str], tokenize: Callable[[str], list[int] | None] | None = None):
        self.calls, self.tokenize, self.played = list(calls), tokenize, 0

    def generate(self, conversations: list, temperature: float, seed: int, max_new_tokens: int,
                 exclude: list[str | None] | None = None, exclude_ids: list | None = None,
                 drafts: list | None = None) -> list[ScriptedCall]:
        if len(conversations) != 1 or exclude is not None:
            raise CRRError(f"a scripted backend plays one episode's calls, not a batch of {len(conversations)}"
                           + (" with excluded calls" if exclude is not None else ""))
        if self.played == len(self.calls):
            raise CRRError(f"the script's {len(self.calls)} calls ended before its episode did: end it with "
                           "submit_patch or give it as many calls as the turn cap (max_turns)")
        text = self.calls[self.played]
        self.played += 1
        return [ScriptedCall(text, self.tokenize(text) if self.tokenize else None)]

    def clear_cache(self) -> None:
        """Nothing is cached."""
