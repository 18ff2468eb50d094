"""A small decoder-only transformer LM and the synthetic corpus it learns, both deterministic from a seed.

The corpus is generated, never downloaded: English-like sentences from a small probabilistic grammar over a
64-word vocabulary ("the big dogs that chase a cat run quickly ."). The grammar has local structure a bigram
model learns in a few steps (a determiner is followed by an adjective or a noun) and long-range structure that
needs attention (a verb agrees in number with its subject across a relative clause; a verb prefers certain
objects). Every token is drawn from an explicit distribution, so the generator also knows each token's true
probability: :meth:`SyntheticCorpus.entropy_floor` is the loss a perfect model would reach.

Data parallelism needs every rank to see its own slice of the same global batch. Sequence ``i`` of the stream is
generated from its own seed ``(seed, split, i)``, so a rank produces exactly its rows of a step's global batch,
without generating (or agreeing on) the others: :meth:`SyntheticCorpus.batches`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpudist.strategies.tensor import PLAN_STYLES

__all__ = ["VOCAB", "VOCAB_SIZE", "SyntheticCorpus", "TinyLM", "lm_loss"]

# ---------------------------------------------------------------------------------------------------------------------
# Vocabulary: word classes in fixed id ranges (the grammar refers to classes, the seed picks the probabilities).

_NOUNS = ["cat", "dog", "bird", "fox", "horse", "child", "robot", "farmer", "teacher", "wolf", "mouse", "king"]
_NOUNS_PL = [
    "cats",
    "dogs",
    "birds",
    "foxes",
    "horses",
    "children",
    "robots",
    "farmers",
    "teachers",
    "wolves",
    "mice",
    "kings",
]
_VERBS = ["sees", "chases", "likes", "finds", "helps", "follows", "fears", "feeds"]
_VERBS_PL = ["see", "chase", "like", "find", "help", "follow", "fear", "feed"]
_DETS = ["the", "a", "every", "some", "many", "two"]
_DET_NUMBER = [None, "sg", "sg", "pl", "pl", "pl"]  # None: goes with either number
_ADJS = ["big", "small", "old", "young", "red", "quiet", "happy", "clever"]
_ADVS = ["today", "quickly", "again", "slowly"]
_PREPS = ["with", "near"]

VOCAB: list[str] = [".", ",", "and", "that", *_DETS, *_ADJS, *_NOUNS, *_NOUNS_PL, *_VERBS, *_VERBS_PL, *_ADVS, *_PREPS]
VOCAB_SIZE = len(VOCAB)

_ID = {word: i for i, word in enumerate(VOCAB)}
PERIOD, COMMA, AND, THAT = _ID["."], _ID[","], _ID["and"], _ID["that"]
DET0, ADJ0, NOUN0, NOUN_PL0 = _ID[_DETS[0]], _ID[_ADJS[0]], _ID[_NOUNS[0]], _ID[_NOUNS_PL[0]]
VERB0, VERB_PL0, ADV0, PREP0 = _ID[_VERBS[0]], _ID[_VERBS_PL[0]], _ID[_ADVS[0]], _ID[_PREPS[0]]
# Module invariants, not user input: 64 words; plural nouns right after singular ones (see noun_phrase).
assert VOCAB_SIZE == 64 and NOUN0 + len(_NOUNS) == NOUN_PL0


def _preferences(rng: random.Random, n_from: int, n_to: int, k: int, mass: float) -> list[list[float]]:
    """For each of ``n_from`` items, a distribution over ``n_to`` items putting ``mass`` on ``k`` favourites."""
    table = []
    for _ in range(n_from):
        favourites = set(rng.sample(range(n_to), k))
        table.append([mass / k if j in favourites else (1 - mass) / (n_to - k) for j in range(n_to)])
    return table


@dataclass(frozen=True)
class _Grammar:
    """The seed-dependent probabilities of the grammar (its shape is fixed by the code of ``_Sampler``)."""

    noun: list[float]  # subject nouns: Zipf-like over a seed-shuffled order
    adj_noun: list[list[float]]  # adjective -> noun it tends to describe
    noun_verb: list[list[float]]  # subject noun -> verb it tends to do
    verb_object: list[list[float]]  # verb -> object noun
    transitive: list[float]  # verb -> P(it takes an object)

    @classmethod
    def from_seed(cls, seed: int) -> _Grammar:
        rng = random.Random(f"gpudist-grammar/{seed}")
        order = rng.sample(range(len(_NOUNS)), len(_NOUNS))
        zipf = [1 / (order.index(i) + 1) for i in range(len(_NOUNS))]
        return cls(
            noun=[w / sum(zipf) for w in zipf],
            adj_noun=_preferences(rng, len(_ADJS), len(_NOUNS), k=4, mass=0.8),
            noun_verb=_preferences(rng, len(_NOUNS), len(_VERBS), k=3, mass=0.85),
            verb_object=_preferences(rng, len(_VERBS), len(_NOUNS), k=3, mass=0.85),
            transitive=[rng.uniform(0.4, 0.95) for _ in _VERBS],
        )


class _Sampler:
    """Writes sentences token by token and records each token's log-probability under the generator.

    Each decision adds its log-probability to ``pending``; the token it leads to takes the sum. The grammar is
    LL(1) (the alternatives at every point start with disjoint tokens), so that sum is the exact probability of the
    token given the generator's state, and its mean over a sample is the entropy floor of the corpus.
    """

    def __init__(self, grammar: _Grammar, rng: random.Random):
        self.g, self.rng = grammar, rng
        self.tokens: list[int] = []
        self.logps: list[float] = []
        self.pending = 0.0

    def decide(self, p: float) -> bool:
        """A yes/no decision taken with probability ``p`` of yes."""
        yes = self.rng.random() < p
        self.pending += math.log(p if yes else 1 - p)
        return yes

    def emit(self, first_id: int, weights: list[float]) -> int:
        """Draws one word of a class (ids ``first_id + j``, probabilities ``weights``); returns j."""
        j = self.rng.choices(range(len(weights)), weights)[0]
        self.tokens.append(first_id + j)
        self.logps.append(self.pending + math.log(weights[j] / sum(weights)))
        self.pending = 0.0
        return j

    def noun_phrase(self, noun_weights: list[float]) -> tuple[int, bool]:
        """DET ADJ* NOUN, the noun agreeing in number with the determiner; returns (noun index, plural)."""
        number = _DET_NUMBER[self.emit(DET0, [1.0] * len(_DETS))]
        weights = noun_weights
        for _ in range(3):  # at most 3 adjectives; the last one shapes the noun
            if not self.decide(0.35):
                break
            weights = self.g.adj_noun[self.emit(ADJ0, [1.0] * len(_ADJS))]
        # The number is drawn with the noun (singular and plural ids are one contiguous range), not before it:
        # a hidden choice made earlier would be charged to a token that does not reveal it.
        singular = {None: 0.6, "sg": 1.0, "pl": 0.0}[number]
        j = self.emit(NOUN0, [singular * w for w in weights] + [(1 - singular) * w for w in weights])
        return j % len(_NOUNS), j >= len(_NOUNS)

    def verb_phrase(self, subject: int, plural: bool) -> None:
        """VERB (agreeing with the subject) [object NP] [ADV]."""
        verb = self.emit(VERB_PL0 if plural else VERB0, self.g.noun_verb[subject])
        if self.decide(self.g.transitive[verb]):
            self.noun_phrase(self.g.verb_object[verb])
        if self.decide(0.3):
            self.emit(ADV0, [1.0] * len(_ADVS))

    def clause(self) -> None:
        """NP [that VP] VP [PREP NP]: the main verb agrees with the subject across the relative clause."""
        subject, plural = self.noun_phrase(self.g.noun)
        if self.decide(0.3):
            self.emit(THAT, [1.0])
            self.verb_phrase(subject, plural)
        self.verb_phrase(subject, plural)
        if self.decide(0.25):
            self.emit(PREP0, [1.0] * len(_PREPS))
            self.noun_phrase(self.g.noun)

    def sentence(self) -> None:
        """CLAUSE (", and" CLAUSE)? "." """
        self.clause()
        if self.decide(0.2):
            self.emit(COMMA, [1.0])
            self.emit(AND, [1.0])
            self.clause()
        self.emit(PERIOD, [1.0])


class SyntheticCorpus:
    """An endless stream of token sequences of ``seq_len + 1`` tokens (inputs and next-token targets).

    ``split`` names independent streams from the same grammar: "train" for training, "val" for held-out
    evaluation. Sequences start at a sentence boundary, so the generator's state is always visible to a model.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, seed: int = 0, seq_len: int = 64):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.seed, self.seq_len = seed, seq_len
        self.grammar = _Grammar.from_seed(seed)

    def _sample(self, index: int, split: str) -> _Sampler:
        # A string seed goes through SHA-512 in random.seed: stable across runs and PYTHONHASHSEED.
        sampler = _Sampler(self.grammar, random.Random(f"gpudist-corpus/{self.seed}/{split}/{index}"))
        while len(sampler.tokens) < self.seq_len + 1:
            sampler.sentence()
        return sampler

    def sequence(self, index: int, split: str = "train") -> torch.Tensor:
        """Sequence ``index`` of the stream: ``seq_len + 1`` token ids (int64)."""
        return torch.tensor(self._sample(index, split).tokens[: self.seq_len + 1], dtype=torch.int64)

    def batches(
        self, step: int, global_batch: int, rank: int = 0, world_size: int = 1, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step ``step``'s global batch: inputs and targets, each ``(global_batch // world_size,
        seq_len)``. Rank r gets rows ``r * local : (r + 1) * local``, so the ranks' slices, concatenated in rank
        order, are exactly the batch a single process (``world_size=1``) gets for the same step."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: need world_size >= 1 and 0 <= rank < world_size")
        if global_batch < world_size or global_batch % world_size:
            raise ValueError(
                f"global batch {global_batch} does not split evenly over {world_size} ranks; "
                f"use a multiple of {world_size}"
            )
        local = global_batch // world_size
        first = step * global_batch + rank * local
        rows = torch.stack([self.sequence(i, split) for i in range(first, first + local)])
        return rows[:, :-1], rows[:, 1:]

    def entropy_floor(self, n_sequences: int = 256, split: str = "val") -> float:
        """Mean -log p (nats) of target tokens under the generator itself: the loss of a perfect model."""
        logps = [lp for i in range(n_sequences) for lp in self._sample(i, split).logps[1 : self.seq_len + 1]]
        return -sum(logps) / len(logps)

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        return " ".join(VOCAB[int(t)] for t in tokens)


# ---------------------------------------------------------------------------------------------------------------------
# Model


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)).

    Tensor parallelism splits it by heads (the "heads" plan style): :meth:`head_parallel` gives the block whose
    attention runs on this rank's heads, and ``head_parallel_plan`` the styles its children must get with it."""

    head_parallel_plan = {"qkv": "colwise_qkv", "proj": "rowwise"}
    """qkv split by heads (each rank its heads' q, k and v rows), the output projection by its input features."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        # No bias: a key bias adds the same q.b to every score of a query, which softmax cancels, so its gradient is
        # zero up to rounding, and Adam would turn that rounding noise into lr-sized, run-dependent updates.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> 3 x (b, heads, t, head_dim)
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def head_parallel(self, tensor_parallel_size: int) -> HeadParallelBlock:
        return HeadParallelBlock(self, tensor_parallel_size)


class HeadParallelBlock(nn.Module):
    """:class:`Block` with its attention on this rank's ``n_heads / tp`` heads, once tensor parallelism converted its
    children (``qkv`` a ``ColumnParallelLinear`` with 3 chunks: each rank's heads' q, k and v rows; ``proj`` a
    ``RowParallelLinear``, which all-reduces; the MLP split fc colwise / out rowwise, or not). Holds the block's own
    children under their names, so parameter names do not change."""

    def __init__(self, block: Block, tensor_parallel_size: int):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)
        self.head_dim = block.qkv.in_features // block.n_heads
        self.n_heads = block.n_heads // tensor_parallel_size  # local heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, 3 local) -> 3 x (b, local heads, t, head_dim); this rank's q, k, v blocks are its heads'
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def extra_repr(self) -> str:
        return f"local_heads={self.n_heads}, head_dim={self.head_dim}"


class TinyLM(nn.Module):
    """Decoder-only transformer: token + learned position embeddings, pre-LN blocks, final LN, a head tied to the
    token embedding. ``forward(tokens (b, t)) -> logits (b, t, vocab)``. Initialised from ``seed`` alone (GPT-2's
    scheme), independent of torch's global RNG, so every process builds the same model."""

    def __init__(
        self,
        vocab: int = VOCAB_SIZE,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        seq_len: int = 64,
        seed: int = 0,
    ):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix reads and writes tokens
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:  # LayerNorm gains
                nn.init.ones_(p)
            else:
                # Residual-branch outputs shrink with depth so the residual stream's variance stays ~constant.
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.seq_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence (nats)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Embed(nn.Module):
    """TinyLM's input: token plus position embeddings (the first block of :func:`as_sequential`)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding, seq_len: int):
        super().__init__()
        self.tok, self.pos, self.seq_len = tok, pos, seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.seq_len}")
        return self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))


class _Head(nn.Module):
    """TinyLM's output: final LayerNorm and the (tied) head (the last block of :func:`as_sequential`)."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def as_sequential(model: TinyLM) -> nn.Sequential:
    """The same TinyLM (same parameter objects) as blocks in order, for pipeline parallelism: embeddings, each
    transformer block, final LN + head. The head stays tied to the token embedding, across stages too."""
    return nn.Sequential(_Embed(model.tok, model.pos, model.seq_len), *model.blocks, _Head(model.ln_f, model.head))


def tinylm_plan(model: nn.Module) -> dict[str, str]:
    """The ready plan for ``TinyLM`` (above): each block's attention split by heads (qkv colwise by head,
    proj rowwise) and its MLP (fc colwise, out rowwise); the token embedding split by vocabulary and the head, tied
    to it, a vocabulary-parallel output. Position embeddings and LayerNorms stay replicated. Needs tp to divide
    the vocabulary and every block's number of heads."""
    missing = [name for name in ("tok", "blocks", "head") if not hasattr(model, name)]
    if missing:
        raise ValueError(
            f"tinylm_plan expects this file's TinyLM (tok, blocks, head); {type(model).__name__} "
            f"has no {missing}; write a plan dict for it (styles: {', '.join(PLAN_STYLES)})"
        )
    plan = {"tok": "vocab"}
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}": "heads",
            f"blocks.{i}.qkv": "colwise_qkv",
            f"blocks.{i}.proj": "rowwise",
            f"blocks.{i}.fc": "colwise",
            f"blocks.{i}.out": "rowwise",
        }
    return plan | {"head": "vocab_output"}
