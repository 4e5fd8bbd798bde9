"""DeepSpeed-Chat's data sets as its step 3 reads them, for ``--data_path`` in oppo-train.

DeepSpeed-Chat (``dschat/utils/data/raw_datasets.py``) knows a fixed list of data sets, picked
by the first name the ``--data_path`` value contains, and builds each one's prompts its own
way: ``" Human: " + <field> + " Assistant:"`` from a field other than ``prompt`` for most, the
``prompt`` field as it is for Dahoas/rm-static and Dahoas/full-hh-rlhf, and, for the data sets
without a test split, only the first nine tenths of a seeded cut of ``train`` (the last tenth
is its evaluation data), which ``--data_split`` then cuts again. A row whose prompt field is
null is skipped after both cuts. Its own JSON files (``local/jsonfile``: ``data/train.json``)
get a space in front of their ``prompt``.

Here each is a :class:`oppo_ds.datafiles.SourceFormat`, so ``--data_path`` pointing at a local copy
of one of them (a ``save_to_disk`` directory or a hub snapshot whose path names it, as
DeepSpeed-Chat requires) gives the run DeepSpeed-Chat's step-3 prompts. The list and the order
of matching are DeepSpeed-Chat's; the functions are written from its documented row formats.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ..datafiles import SourceFormat

# the evaluation tenth DeepSpeed-Chat cuts off data sets that have no test split
TRAIN_OF_TRAIN_EVAL = ((9.0, 1.0), 0)


def _human(text: Optional[str]) -> Optional[str]:
    return None if text is None else " Human: " + text + " Assistant:"


def _sharegpt(row: Mapping[str, Any]) -> Optional[str]:
    text = row["prompt"]
    return text.replace("USER", "Human").replace("ASSISTANT", "Assistant") if text else None


# (name as --data_path contains it, prompt of a row, whether train is cut 9:1 first), in
# DeepSpeed-Chat's order of matching: the first name found in the path wins
_TABLE = (
    ("Dahoas/rm-static", lambda r: r["prompt"], False),
    ("Dahoas/full-hh-rlhf", lambda r: r["prompt"], False),
    ("Dahoas/synthetic-instruct-gptj-pairwise", lambda r: _human(r["prompt"]), True),
    ("yitingxie/rlhf-reward-datasets", lambda r: r["prompt"] + "Assistant:", False),
    ("openai/webgpt_comparisons", lambda r: _human(r["question"]["full_text"]), True),
    ("stanfordnlp/SHP", lambda r: _human(r["history"]), False),
    ("pvduy/sharegpt_alpaca_oa_vicuna_format", _sharegpt, False),
    ("wangrui6/Zhihu-KOL", lambda r: _human(r["INSTRUCTION"]), True),
    ("Cohere/miracl-zh-queries-22-12", lambda r: _human(r["query"]), False),
    ("Hello-SimpleAI/HC3-Chinese", lambda r: _human(r["question"]), True),
    ("mkqa-Chinese", lambda r: _human(r["queries"]["zh_cn"]), True),
    ("mkqa-Japanese", lambda r: _human(r["queries"]["ja"]), True),
    ("Cohere/miracl-ja-queries-22-12", lambda r: _human(r["query"]), False),
    ("lmqg/qg_jaquad", lambda r: _human(r["question"]), False),
    ("lmqg/qag_jaquad", lambda r: _human(r["questions"][0]), False),
)

FORMATS = tuple(SourceFormat(name=name, prompt=prompt, pre_cut=TRAIN_OF_TRAIN_EVAL if cut else None)
                for name, prompt, cut in _TABLE)

LOCAL_JSON = SourceFormat(name="local/jsonfile",
                          prompt=lambda r: None if r["prompt"] is None else " " + r["prompt"])


def dschat_format(path: str) -> Optional[SourceFormat]:
    """How DeepSpeed-Chat's step 3 reads ``path`` (a --data_path value): the first of its data
    sets whose name the path contains; its own JSON format for a ``.json`` file (its
    ``local/jsonfile``, ``data/train.json``); None for anything else, read as oppo-ds reads a
    prompt file (DeepSpeed-Chat itself would refuse it)."""
    for fmt in FORMATS:
        if fmt.name in path:
            return fmt
    return LOCAL_JSON if path.endswith(".json") else None
