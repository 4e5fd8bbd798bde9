"""DeepSpeed-Chat's data sets read as its step 3 reads them (``data.deepspeed_chat_formats``,
set by ``--data_path``): which set a path names, each set's prompt, the 9:1 cut before
``--data_split``'s, rows without a prompt, and, where a DeepSpeedExamples tree is named by
OPPO_DSCHAT_ROOT, DeepSpeed-Chat's own ``create_dataset`` choosing the same prompts."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from oppo_ds.datafiles import DataError, read_prompt_rows
from oppo_ds.integrations.dschat_data import FORMATS, LOCAL_JSON, dschat_format

SEED = 1234

# per data set: its splits, and a row maker (i -> record; None prompts where the set allows
# them, every 7th row) with the prompt DeepSpeed-Chat's step 3 builds from it
ROWS = {
    "Dahoas/rm-static": (("train", "test"), lambda i: {"prompt": f"\n\nHuman: q{i}\n\nAssistant:",
                                                       "chosen": " a", "rejected": " b"},
                         lambda i: f"\n\nHuman: q{i}\n\nAssistant:"),
    "Dahoas/full-hh-rlhf": (("train", "test"), lambda i: {"prompt": f"Human: h{i} Assistant:",
                                                          "chosen": "a", "rejected": "b"},
                            lambda i: f"Human: h{i} Assistant:"),
    "Dahoas/synthetic-instruct-gptj-pairwise": (
        ("train",), lambda i: {"prompt": f"write {i}", "chosen": "a", "rejected": "b"},
        lambda i: f" Human: write {i} Assistant:"),
    "yitingxie/rlhf-reward-datasets": (
        ("train", "test"), lambda i: {"prompt": f"Human: y{i} ", "chosen": "Assistant: a",
                                      "rejected": "Assistant: b"},
        lambda i: f"Human: y{i} Assistant:"),
    "openai/webgpt_comparisons": (
        ("train",), lambda i: {"question": {"full_text": f"why {i}?", "dataset": "eli5"},
                               "answer_0": "a [1]", "answer_1": "b", "score_0": 1.0,
                               "score_1": -1.0},
        lambda i: f" Human: why {i}? Assistant:"),
    "stanfordnlp/SHP": (("train", "validation"),
                        lambda i: {"history": f"post {i}", "human_ref_A": "a", "human_ref_B": "b",
                                   "labels": 1},
                        lambda i: f" Human: post {i} Assistant:"),
    "pvduy/sharegpt_alpaca_oa_vicuna_format": (
        ("train", "test"),
        lambda i: {"prompt": "" if i % 7 == 3 else f"USER: s{i} ASSISTANT:", "label": "x"},
        lambda i: None if i % 7 == 3 else f"Human: s{i} Assistant:"),
    "wangrui6/Zhihu-KOL": (("train",), lambda i: {"INSTRUCTION": None if i % 7 == 3 else f"z{i}",
                                                  "RESPONSE": "r"},
                           lambda i: None if i % 7 == 3 else f" Human: z{i} Assistant:"),
    "Cohere/miracl-zh-queries-22-12": (("train", "dev"), lambda i: {"query": f"c{i}"},
                                       lambda i: f" Human: c{i} Assistant:"),
    "Hello-SimpleAI/HC3-Chinese": (("train",), lambda i: {"question": None if i % 7 == 3 else f"h{i}",
                                                          "human_answers": ["x"],
                                                          "chatgpt_answers": ["y"]},
                                   lambda i: None if i % 7 == 3 else f" Human: h{i} Assistant:"),
    "mkqa-Chinese": (("train",), lambda i: {"queries": {"zh_cn": f"m{i}", "ja": f"j{i}"},
                                            "answers": {"zh_cn": [{"text": "t"}], "ja": [{"text": "t"}]}},
                     lambda i: f" Human: m{i} Assistant:"),
    "mkqa-Japanese": (("train",), lambda i: {"queries": {"zh_cn": f"m{i}", "ja": f"j{i}"},
                                             "answers": {"zh_cn": [{"text": "t"}], "ja": [{"text": "t"}]}},
                      lambda i: f" Human: j{i} Assistant:"),
    "Cohere/miracl-ja-queries-22-12": (("train", "dev"), lambda i: {"query": f"k{i}"},
                                       lambda i: f" Human: k{i} Assistant:"),
    "lmqg/qg_jaquad": (("train", "validation"), lambda i: {"question": f"g{i}", "answer": "a"},
                       lambda i: f" Human: g{i} Assistant:"),
    "lmqg/qag_jaquad": (("train", "validation"), lambda i: {"questions": [f"qa{i}", "x"],
                                                            "answers": ["a", "b"]},
                        lambda i: f" Human: qa{i} Assistant:"),
}
N = 37  # rows of each train split: the cuts round


def _save(root, name: str, n: int = N) -> str:
    """A local copy of data set ``name`` as DeepSpeed-Chat loads one (``load_from_disk`` of a
    path containing the name)."""
    import datasets

    splits, make, _ = ROWS[name]
    path = os.path.join(str(root), name)
    datasets.DatasetDict({s: datasets.Dataset.from_list([make(i) for i in range(n if s == "train" else 5)])
                          for s in splits}).save_to_disk(path)
    return path


def _perm_part(n: int, weights, part: int, seed: int) -> list[int]:
    """DeepSpeed-Chat's cut, written out here from its definition (numpy's RandomState shuffle
    of arange(n), part bounds by rounded shares, the first part absorbing the excess)."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * n)))
    excess = bounds[-1] - n
    bounds = [0] + [b - excess for b in bounds[1:]]
    order = np.arange(n, dtype=np.uint32)
    np.random.RandomState(seed=seed).shuffle(order)
    return [int(i) for i in order[bounds[part]:bounds[part + 1]]]


def test_the_table_is_deepspeed_chats_list_in_its_order():
    assert [f.name for f in FORMATS] == list(ROWS)
    assert dschat_format("/data/Dahoas/rm-static") is FORMATS[0]
    assert dschat_format("/d/x/lmqg/qag_jaquad/v1").name == "lmqg/qag_jaquad"
    # the first name found wins, as DeepSpeed-Chat's if/elif chain does
    assert dschat_format("/d/Dahoas/full-hh-rlhf/Dahoas/rm-static").name == "Dahoas/rm-static"
    assert dschat_format("/data/train.json") is LOCAL_JSON
    assert dschat_format("/data/prompts.jsonl") is None and dschat_format("/data/x.parquet") is None


@pytest.mark.parametrize("name", list(ROWS))
def test_each_set_gives_deepspeed_chats_step3_prompts(tmp_path, name):
    """Each set's prompts for --data_split 2,4,4 --seed 1234, derived by hand: its train split,
    cut 9:1 first where it has no test split (a subset of a subset: the second cut indexes
    the first's order), rows without a prompt dropped last."""
    path = _save(tmp_path, name)
    rows = read_prompt_rows(path, phase_split=[2, 4, 4], phase_seed=SEED, source_format=dschat_format)
    fmt = dschat_format(path)
    kept = list(range(N))
    if fmt.pre_cut is not None:
        kept = [kept[i] for i in _perm_part(N, (9, 1), 0, SEED)]
    kept = [kept[i] for i in _perm_part(len(kept), (2, 4, 4), 2, SEED)]
    want = [ROWS[name][2](i) for i in sorted(kept)]
    assert [r.text_or_messages for r in rows] == [w for w in want if w is not None]
    assert [r.line for r in rows] == [i for i in sorted(kept) if ROWS[name][2](i) is not None]
    assert len(rows) < len(kept) if None in want else len(rows) == len(kept)


def test_local_json_gets_the_space_deepspeed_chat_adds(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"prompt": "Human: hi Assistant:", "chosen": "a"},
                                {"prompt": None, "chosen": "b"}]))
    rows = read_prompt_rows(str(path), source_format=dschat_format)
    assert [r.text_or_messages for r in rows] == [" Human: hi Assistant:"]
    # read without the formats, a null prompt is the error it always was
    with pytest.raises(DataError, match=r"train\.json: row 1: 'prompt' must be a string"):
        read_prompt_rows(str(path))


def test_a_row_without_the_sets_field_is_named(tmp_path):
    import datasets

    path = str(tmp_path / "openai" / "webgpt_comparisons")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "p"}])}).save_to_disk(path)
    with pytest.raises(DataError, match=r"webgpt_comparisons: row 0: not a row of "
                                        r"openai/webgpt_comparisons as DeepSpeed-Chat reads it "
                                        r"\(KeyError: 'question'\); the row has keys \['prompt'\] "
                                        r"\(data.deepspeed_chat_formats=false reads"):
        read_prompt_rows(path, source_format=dschat_format)


def test_data_path_reads_the_sets_as_deepspeed_chat(tmp_path):
    """--data_path of two sets: the key is set, and steps are counted from the prompts the
    sets give (here 1 epoch of their step-3 prompts at batch 4)."""
    from oppo_ds.cli.train import build_parser, resolve_config
    from oppo_ds.sources import read_rows

    paths = [_save(tmp_path, "Dahoas/synthetic-instruct-gptj-pairwise"), _save(tmp_path, "Dahoas/rm-static")]
    cfg, _ = resolve_config(build_parser().parse_args(
        ["--data_path", *paths, "--seed", str(SEED), "--per_device_generation_batch_size", "4",
         "--per_device_training_batch_size", "4", "--num_train_epochs", "1"]), prepare_files=False)
    assert cfg.data.deepspeed_chat_formats and cfg.data.phase_split == [2.0, 4.0, 4.0]
    rows = read_rows(cfg, cfg.data.prompts)
    assert rows[0].text_or_messages.startswith(" Human: write ")
    assert sum(r.text_or_messages.startswith("\n\nHuman: q") for r in rows) == len(_perm_part(N, (2, 4, 4), 2, SEED))
    assert cfg.steps == len(rows) // 4


def test_deepspeed_chats_own_create_dataset_picks_the_same_prompts(tmp_path, monkeypatch):
    """DeepSpeed-Chat's create_dataset (step 3) from a DeepSpeedExamples tree at 3d83278 named
    by OPPO_DSCHAT_ROOT, on each set's local copy: the prompt texts it tokenizes are ours. Its
    tokenizer is a recorder of those texts (one token each: nothing is filtered by length), the
    one stand-in here."""
    root = os.environ.get("OPPO_DSCHAT_ROOT")
    app = os.path.join(root or "", "applications", "DeepSpeed-Chat")
    if not root or not os.path.isfile(os.path.join(app, "dschat", "utils", "data", "raw_datasets.py")):
        pytest.skip("OPPO_DSCHAT_ROOT does not point at a DeepSpeedExamples tree (CI has no "
                    "network to fetch one; the local check is recorded in docs/deepspeed-chat.md)")
    import torch

    monkeypatch.syspath_prepend(app)
    from dschat.utils.data.data_utils import create_dataset

    class Recorder:
        pad_token_id = 0

        def __init__(self):
            self.texts = []

        def __call__(self, text, return_tensors=None):
            self.texts.append(text)
            return {"input_ids": torch.ones(1, 1, dtype=torch.long),
                    "attention_mask": torch.ones(1, 1, dtype=torch.long)}

    for name in ROWS:
        path = theirs_path = _save(tmp_path / "sets", name)
        if name.startswith("mkqa"):
            # DeepSpeed-Chat loads "mkqa" whatever the path: ./mkqa when there is one (else the
            # hub's); a user of oppo-train names a local copy by a path holding mkqa-Chinese
            workdir = tmp_path / name
            _save(workdir, name)
            os.rename(workdir / name, workdir / "mkqa")
            monkeypatch.chdir(workdir)
            theirs_path = name
        tok = Recorder()
        cache = tmp_path / "cache" / name.replace("/", "_")  # its index files
        cache.mkdir(parents=True)
        train, _ = create_dataset(0, theirs_path, "2,4,4", str(cache), 3, SEED, tok, "<|endoftext|>",
                                  512, True)
        # it tokenizes the train part's prompts first, then the evaluation part's
        theirs = tok.texts[:len(train)]
        ours = [r.text_or_messages for r in read_prompt_rows(
            path, phase_split=[2, 4, 4], phase_seed=SEED, source_format=dschat_format)]
        assert len(theirs) == len(ours) and sorted(theirs) == sorted(ours), name
