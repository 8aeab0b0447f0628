"""Text out (article §7, §16; the last step of a request): incremental detokenization and stop strings.

What an inference engine must add on top of a tokenizer is here: turning a growing list of token ids into
text one step at a time (a token may be half a UTF-8 character, or change how the previous one prints),
and finding stop strings that span token boundaries without showing a client the start of one.

`OutputProcessor` does both for every running sequence, after the sampler (vLLM's output processor): the
engine and the simple path call `process(seq)` after `seq.append_token`. Its per-sequence state (an
`IncrementalDetokenizer` and a place in a `StopMatcher` each) stays here, in the engine's process, so a
`Sequence` is plain data.

The stop check runs on the engine thread for every sequence at every step, so it must not cost "all stop
strings x all sequences": `StopMatcher` reads each new character once, whatever the stop strings (their
number and length are also capped, in `SamplingParams`).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import TYPE_CHECKING

from minfer.sequence import Sequence

if TYPE_CHECKING:
    from minfer.tokenizer import Tokenizer


class OutputProcessor:
    """Detokenizes each sequence's new tokens into `seq.text` and finishes it on a stop string.

    Call `process(seq)` after every `seq.append_token`, and `free(seq)` when the sequence is retired
    (finished or aborted), which drops its state.
    """

    def __init__(self, tokenizer: "Tokenizer"):
        self.tokenizer = tokenizer
        self._seqs: dict[int, _SeqState] = {}

    def process(self, seq: Sequence) -> None:
        """Update `seq.text` and `seq.num_held_chars` with the newest token; on a stop string cut the text
        (keeping the stop string if `include_stop_str_in_output`) and finish the sequence ("stop", even
        when the token also reached max_tokens). Costs O(the token's characters), not O(stop strings)."""
        if seq.stopped_by_token:
            return  # the stop token itself is never shown
        st = self._seqs.get(seq.seq_id)
        if st is None:
            st = self._seqs[seq.seq_id] = _SeqState(
                IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens),
                stop_matcher(tuple(seq.params.stop)) if seq.params.stop else None)
        new = st.detok.step(seq.output_token_ids[-1:])
        seq.text += new
        if st.matcher is None or not new:
            return
        st.state, hit = st.matcher.advance(st.state, new, len(seq.text) - len(new))
        if hit is not None and len(seq.output_token_ids) >= seq.params.min_tokens:  # vLLM: none before min_tokens
            start, stop = hit
            seq.text = seq.text[:start + (len(stop) if seq.params.include_stop_str_in_output else 0)]
            seq.finish_reason, seq.stop_reason = "stop", stop
            seq.num_held_chars = 0
        else:
            seq.num_held_chars = st.matcher.held(st.state)

    def free(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)

    def __len__(self) -> int:
        """Sequences whose state is held (0 once every request is retired)."""
        return len(self._seqs)


class _SeqState:
    """What the output processor keeps for one sequence: its detokenizer, its request's stop matcher (None
    without stop strings) and the matcher's state after the text so far."""

    __slots__ = ("detok", "matcher", "state")

    def __init__(self, detok: "IncrementalDetokenizer", matcher: "StopMatcher | None"):
        self.detok, self.matcher, self.state = detok, matcher, 0


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Decoding each new token alone is wrong: byte-level tokens can be half a UTF-8 character (decoded as
    U+FFFD until the rest arrives), and SentencePiece prints a token's leading space depending on what
    came before. So we decode a short window of earlier tokens plus the new ones and emit only the part
    that is new and complete (the approach of vLLM's `detokenize_incrementally`). Cost per step is
    independent of the sequence length.
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little prompt context, for the first token's spacing
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        """Add `new_ids`; return the text they complete (may be "" while a character is incomplete)."""
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # Keep the window short so each step decodes a handful of tokens, not the whole history.
            if self.prefix_offset > 64:
                drop = self.prefix_offset - 8
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            return full[len(prefix):]
        return ""


class StopMatcher:
    """Finds stop strings in a growing text, reading each new character once (an Aho-Corasick automaton).

    The states are the nodes of the trie of the stop strings (node 0 is the root, the empty string). After
    reading a text the state is its longest suffix that is a prefix of some stop string. Reading a character
    follows the trie edge if there is one, else the failure link (the state's next shorter suffix that is a
    trie node) and tries again: amortized O(1) a character. A stop string ends here when the state, or a
    node on its chain of output links (the failure chain's nodes that end a stop string), ends one.

    So `advance` costs O(new characters + stop strings found) and `held` O(1) in practice, whatever the
    number and length of the stop strings; building costs O(their total length) once per request.
    """

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = list(stops)
        self.max_len = max(map(len, self.stops), default=0)
        self.edges: list[dict[str, int]] = [{}]  # node -> {character: child}
        self.depth = [0]  # node -> length of its string
        self.ends = [-1]  # node -> index in `stops` of the (first) stop string it spells, or -1
        for k, stop in enumerate(self.stops):
            self._insert(k, stop)
        self.fail = [0] * len(self.edges)
        self.out = [-1] * len(self.edges)  # node -> nearest node on its failure chain that ends a stop, or -1
        queue = deque(self.edges[0].values())  # breadth first: a failure link points to a shallower node
        while queue:
            node = queue.popleft()
            f = self.fail[node]
            self.out[node] = f if self.ends[f] >= 0 else self.out[f]
            for ch, child in self.edges[node].items():
                self.fail[child] = self._goto(f, ch) if node else 0
                queue.append(child)

    def _insert(self, k: int, stop: str) -> None:
        node = 0
        for ch in stop:
            child = self.edges[node].get(ch)
            if child is None:
                child = self.edges[node][ch] = len(self.edges)
                self.edges.append({})
                self.depth.append(self.depth[node] + 1)
                self.ends.append(-1)
            node = child
        if self.ends[node] < 0:
            self.ends[node] = k

    def _goto(self, state: int, ch: str) -> int:
        while state and ch not in self.edges[state]:
            state = self.fail[state]
        return self.edges[state].get(ch, 0)

    def advance(self, state: int, chars: str, base: int) -> tuple[int, tuple[int, str] | None]:
        """Read `chars`, which start at index `base` of the text, from `state` (0 for an empty text).

        Returns (the new state, the stop string ending inside `chars` that starts earliest, as (its start
        index in the text, the stop string), or None). Of two that start at the same index, the one listed
        first wins.
        """
        best = None  # (start index, index in stops)
        for i, ch in enumerate(chars):
            state = self._goto(state, ch)
            node = state if self.ends[state] >= 0 else self.out[state]
            while node >= 0:
                found = (base + i + 1 - self.depth[node], self.ends[node])
                best = found if best is None or found < best else best
                node = self.out[node]
        return state, None if best is None else (best[0], self.stops[best[1]])

    def held(self, state: int) -> int:
        """How many trailing characters of the text read could start a stop string: the longest suffix in
        the trie that still has an edge to follow (a proper prefix of a stop string)."""
        while state and not self.edges[state]:
            state = self.fail[state]
        return self.depth[state]


@functools.lru_cache(maxsize=8)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The `StopMatcher` of a stop-string tuple, shared by the sequences of a request (and by requests that
    send the same stop strings). At most 8 are kept: one of 64 strings of 256 characters is about 3 MB."""
    return StopMatcher(stops)


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_chars` characters of `text`.

    Only the tail can hold a new match: a stop string of length L that was not there before must end in the
    new characters, so the matcher reads from `len(text) - new_chars - L + 1` on (L: the longest stop
    string). Returns (start index, stop) or None. `OutputProcessor` keeps a matcher's state per sequence
    instead, and reads only the new characters.
    """
    matcher = stop_matcher(tuple(stops))
    old = max(0, len(text) - new_chars)
    context = max(0, old - matcher.max_len + 1)
    state, _ = matcher.advance(0, text[context:old], context)  # a stop ending before the new text is not new
    return matcher.advance(state, text[old:], old)[1]


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (so are not shown yet)."""
    matcher = stop_matcher(tuple(stops))
    state, _ = matcher.advance(0, text[max(0, len(text) - matcher.max_len + 1):], 0)
    return matcher.held(state)
