"""The synthetic tasks, generated on the fly: multi-query associative recall and copy.

Both are solved by one lookup over the whole context: find the earlier occurrence of
the current token and read the token just before it. Only attention can do that (a
local first layer brings each token its predecessor, a global second layer finds
the match), and the one lookup serves both tasks.

Every batch is a pure function of ``(seed, step)``: a resumed run sees exactly the
batches the uninterrupted run would have seen, in the same order. The held-out
sequences come from a stream no training step draws from.

Vocabulary (V = 4 + n_keys + n_values)::

    0 PAD   1 SEP   2 RECALL   3 COPY   4 .. 4+n_keys-1 keys   then the values

Associative recall (P pairs, each value written just before its key, then
Q = (T - 2 - 2P) / 2 queries: every key once in a random order, then again in another
order, and so on until the sequence is full)::

    RECALL v1 k1 v2 k2 ... vP kP SEP q1 a1 q2 a2 ... qQ aQ        a_i = value of key q_i

With ``TaskConfig(key_first=True)`` the pairs are written ``k1 v1 ... kP vP``: the
lookup then reads the token just after the match (an induction head), so every token
it lands on (a pair's value, an earlier answer) carries the answer.

Copy, backwards (n distinct symbols from keys and values, 1 <= n <= ``max_copy``;
right-padded): the sequence written again from its last symbol to its first::

    COPY s1 s2 ... sn COPY sn ... s2 s1 COPY PAD ...

The targets (``answers``, True where a token is to be predicted from the tokens before
it) are the a_i, and the copy sn .. s1 with the closing COPY (the stop token).
"""

import dataclasses

import numpy as np

PAD, SEP, RECALL, COPY = 0, 1, 2, 3
FIRST_KEY = 4
_TRAIN, _EVAL = 0, 1  # stream tags: no training batch is ever drawn from the eval stream


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The tasks' sizes.

    Attributes:
      pairs: P, key-value pairs per recall sequence.
      seq_len: T, the length of every sequence (even, at least 2 + 4P: every key
        is queried at least once).
      n_keys, n_values: how many distinct key and value tokens there are (a copied
        sequence has distinct symbols: at most n_keys + n_values of them).
      copy_fraction: the share of copy sequences in a training batch.
      key_first: write each pair key first (``k v``) instead of value first (``v k``).
        The value-first lookup lands on the earlier copies of the query's key, whose
        tokens carry nothing of the answer, and reads the value from them only on
        average; key first, it lands on the values and earlier answers themselves
        (what page selection needs: examples/recall/README.md, "Page selection").
    """

    pairs: int = 8
    seq_len: int = 64
    n_keys: int = 64
    n_values: int = 64
    copy_fraction: float = 0.25
    key_first: bool = False

    def __post_init__(self):
        # Every message names a field as ``name=value``: the command line shows it as
        # its flag (``--n-keys=64``).
        for name in ("pairs", "seq_len", "n_keys", "n_values"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.pairs > self.n_keys:
            raise ValueError(
                f"pairs={self.pairs} needs as many distinct keys: at most n_keys={self.n_keys}"
            )
        if self.seq_len % 2 or self.seq_len < 2 + 4 * self.pairs:
            raise ValueError(
                f"seq_len={self.seq_len} must be even and >= 2 + 4 * pairs = "
                f"{2 + 4 * self.pairs} (pairs={self.pairs}: every key queried once)"
            )
        if not 0.0 <= self.copy_fraction <= 1.0:
            raise ValueError(f"copy_fraction={self.copy_fraction} must be in [0, 1]")

    @property
    def vocab(self) -> int:
        """V, the vocabulary size."""
        return FIRST_KEY + self.n_keys + self.n_values

    @property
    def queries(self) -> int:
        """Q, the queries of a recall sequence."""
        return (self.seq_len - 2 - 2 * self.pairs) // 2

    @property
    def max_copy(self) -> int:
        """The longest copied sequence: one that fits in T tokens with its three
        markers, and of distinct symbols (at most n_keys + n_values)."""
        return min((self.seq_len - 3) // 2, self.n_keys + self.n_values)


def _permutations(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """``rows`` independent random permutations of ``range(n)``: (rows, n)."""
    return np.argsort(rng.random((rows, n)), axis=1)


def recall(rng: np.random.Generator, task: TaskConfig, rows: int):
    """``rows`` associative-recall sequences: tokens (rows, T) int32 and answers (rows, T)."""
    P = task.pairs
    keys = FIRST_KEY + _permutations(rng, rows, task.n_keys)[:, :P]  # (rows, P), distinct
    values = FIRST_KEY + task.n_keys + rng.integers(task.n_values, size=(rows, P))
    rounds = -(-task.queries // P)
    order = np.concatenate([_permutations(rng, rows, P) for _ in range(rounds)], axis=1)
    order = order[:, : task.queries]  # which pair each query asks for: (rows, Q)
    queries = np.take_along_axis(keys, order, axis=1)
    answers = np.take_along_axis(values, order, axis=1)
    tokens = np.empty((rows, task.seq_len), np.int32)
    tokens[:, 0], tokens[:, 1 + 2 * P] = RECALL, SEP
    first, second = (keys, values) if task.key_first else (values, keys)
    tokens[:, 1 : 1 + 2 * P : 2], tokens[:, 2 : 2 + 2 * P : 2] = first, second
    tokens[:, 2 + 2 * P :: 2], tokens[:, 3 + 2 * P :: 2] = queries, answers
    is_answer = np.zeros(tokens.shape, bool)
    is_answer[:, 3 + 2 * P :: 2] = True
    return tokens, is_answer


def copy(rng: np.random.Generator, task: TaskConfig, rows: int, lengths=None):
    """``rows`` copy sequences of ``lengths`` (rows,) symbols (default: uniform in
    [1, max_copy]): tokens (rows, T) int32, right-padded, and answers (rows, T)."""
    T, symbols = task.seq_len, task.n_keys + task.n_values
    if lengths is None:
        lengths = rng.integers(1, task.max_copy + 1, size=rows)
    lengths = np.asarray(lengths)
    if lengths.shape != (rows,) or lengths.min() < 1 or lengths.max() > task.max_copy:
        raise ValueError(
            f"copy lengths must have shape ({rows},) with values in [1, {task.max_copy}], "
            f"got {lengths.tolist()}"
        )
    source = FIRST_KEY + _permutations(rng, rows, symbols)[:, : task.max_copy]  # distinct
    tokens = np.full((rows, T), PAD, np.int32)
    is_answer = np.zeros((rows, T), bool)
    for row, n in enumerate(lengths):
        symbols = source[row, :n].tolist()
        tokens[row, : 2 * n + 3] = [COPY, *symbols, COPY, *symbols[::-1], COPY]
        is_answer[row, n + 2 : 2 * n + 3] = True
    return tokens, is_answer


def mixed(rng: np.random.Generator, task: TaskConfig, rows: int):
    """A training batch: each row a copy sequence with probability ``copy_fraction``,
    else a recall sequence. tokens (rows, T) int32, answers (rows, T) bool."""
    tokens, is_answer = recall(rng, task, rows)
    copies = rng.random(rows) < task.copy_fraction
    copy_tokens, copy_answers = copy(rng, task, rows)
    tokens[copies], is_answer[copies] = copy_tokens[copies], copy_answers[copies]
    return tokens, is_answer


def train_batch(seed: int, step: int, task: TaskConfig, batch: int):
    """The batch of training step ``step``: a pure function of (seed, step)."""
    return mixed(np.random.default_rng([seed, _TRAIN, step]), task, batch)


def held_out(seed: int, task: TaskConfig, n_recall: int, n_copy: int):
    """The evaluation sequences, from their own stream: ``{"recall": (tokens, answers),
    "copy": (tokens, answers)}``."""
    rng = np.random.default_rng([seed, _EVAL, 0])
    return {"recall": recall(rng, task, n_recall), "copy": copy(rng, task, n_copy)}
