"""What the decode tests share: the tokenizer, ragged prompts, a small tree, the ids of
generations, and the check that greedy decoding with a drafter is autoregressive decoding
(tests/ is on the path)."""

from mtp.decode import generate
from mtp.decode.tree import Tree
from mtp.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()
PROMPTS = ["def add(", "print('h", "for i", "zzz", "for i in range(10):\n    print(i)\nfor"]
SMALL_TREE = Tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def ids_of(generations) -> list[list[int]]:
    """Each generation's new token ids."""
    return [g.token_ids for g in generations]


def check_greedy(model, drafter, prompts: list[str], max_new_tokens: int, alone: int) -> list:
    """Greedy decoding with `drafter` gives autoregressive decoding's tokens and finish
    reasons, `prompts` together and the first `alone` one by one; the batch's generations."""
    reference = generate(model, TOKENIZER, prompts, max_new_tokens=max_new_tokens)
    together = generate(model, TOKENIZER, prompts, max_new_tokens=max_new_tokens,
                        drafter=drafter)
    assert ids_of(together) == ids_of(reference)
    assert [g.finish_reason for g in together] == [g.finish_reason for g in reference]
    singles = [generate(model, TOKENIZER, [p], max_new_tokens=max_new_tokens, drafter=drafter)[0]
               for p in prompts[:alone]]
    assert ids_of(singles) == ids_of(reference[:alone])
    return together
