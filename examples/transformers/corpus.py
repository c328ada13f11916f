"""The example's corpus, generated here (no data from a hub): sentences from a small grammar, tokenised by
character (a vocabulary of the characters the grammar uses), cut into equal sequences."""

import random

import torch

SEQUENCE, SEQUENCES = 32, 480
SUBJECTS = ["the spot node", "a worker", "the operator", "every rank", "the agent", "a joiner", "the group"]
VERBS = ["evicts", "heals", "trains", "checkpoints", "joins", "leaves", "re-forms", "averages"]
OBJECTS = ["the model", "its state", "a step", "the gradients", "the next round", "a checkpoint", "the batch"]
ENDINGS = ["in place.", "from a live peer.", "at once.", "before the notice ends.", "without a restart."]
VOCABULARY = sorted(
    {character for part in (SUBJECTS, VERBS, OBJECTS, ENDINGS) for text in part for character in text} | {" "}
)
"""Every token is one the corpus uses: a token never seen would take only the output layer's gradients,
tiny ones that AdamW scales up to full steps, and the run's model would follow float32's rounding."""


def corpus(seed: int = 0) -> torch.Tensor:
    """SEQUENCES sequences of SEQUENCE tokens (the same on every rank)."""
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < SEQUENCE * SEQUENCES:
        words.append(" ".join(rng.choice(part) for part in (SUBJECTS, VERBS, OBJECTS, ENDINGS)))
    text = " ".join(words)[: SEQUENCE * SEQUENCES]  # (a space is in the grammar's words)
    return torch.tensor([VOCABULARY.index(character) for character in text], dtype=torch.long).view(SEQUENCES, SEQUENCE)
