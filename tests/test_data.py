"""Tests for oppo_ds.datafiles and oppo_ds.data: reading, tokenising, streaming and padding
prompts (CPU, no hub)."""

import gzip
import json
import os
import pathlib
import random
import re

import pytest
import torch

from oppo_ds.data import Prompt, PromptStream, StreamMismatch, encode_prompts, left_pad
from oppo_ds.datafiles import DataError, PromptRow, phase_part, read_prompt_rows

WORDS = "<pad> <bos> <eos> <unk> user assistant system : a b c d e f g h".split()
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{{ m['role'] }} : {{ m['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tokenizer(chat_template=None):
    """A word-level tokenizer over WORDS that prepends <bos>, optionally with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def plain_tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(TEMPLATE)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return str(path)


def as_tuples(rows):
    return [(r.text_or_messages, r.id) for r in rows]


TEXT_RECORDS = [
    {"id": "q1", "prompt": "a b c", "extra": 1},
    {"id": "q2", "prompt": "d e", "extra": 2},
    {"id": "q3", "prompt": "f g h a", "extra": 3},
]


# --------------------------------------------------------------------------------------------
# Reading: formats agree
# --------------------------------------------------------------------------------------------


def test_all_formats_give_the_same_rows(tmp_path):
    import datasets

    expected = [(r["prompt"], r["id"]) for r in TEXT_RECORDS]
    jsonl = write_jsonl(tmp_path / "p.jsonl", TEXT_RECORDS)
    parquet = write_parquet(tmp_path / "p.parquet", TEXT_RECORDS)
    ds = datasets.Dataset.from_list(TEXT_RECORDS)
    ds.save_to_disk(str(tmp_path / "ds"))
    other = datasets.Dataset.from_list([{"id": "z", "prompt": "h h", "extra": 0}])
    datasets.DatasetDict(train=ds, test=other).save_to_disk(str(tmp_path / "dd"))
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "00.jsonl", TEXT_RECORDS[:2])
    write_parquet(shards / "01.parquet", TEXT_RECORDS[2:])
    (shards / "_SUCCESS").write_text("")

    for path in [jsonl, parquet, tmp_path / "ds", str(tmp_path / "dd"), str(shards)]:
        assert as_tuples(read_prompt_rows(path)) == expected, path
        # the other fields, for a reward function (model.reward_function)
        assert [r.fields for r in read_prompt_rows(path)] == [{"extra": 1}, {"extra": 2}, {"extra": 3}]
    assert as_tuples(read_prompt_rows(str(tmp_path / "dd"), split="test")) == [("h h", "z")]

    jrows = read_prompt_rows(jsonl)
    prows = read_prompt_rows(parquet)
    assert [(r.source, r.line, r.where) for r in jrows][1] == (jsonl, 2, f"{jsonl}:2")
    assert [(r.source, r.line, r.where) for r in prows][1] == (parquet, 1, f"{parquet}: row 1")


def test_default_ids_and_prompt_key(tmp_path):
    records = [{"question": "a b"}, {"question": "c d"}]
    jsonl = write_jsonl(tmp_path / "q.jsonl", records)
    parquet = write_parquet(tmp_path / "q.parquet", records)
    by_question = read_prompt_rows(jsonl, prompt_key="question")
    assert [r.id for r in by_question] == ["q.jsonl:1", "q.jsonl:2"]
    assert [r.id for r in read_prompt_rows(parquet, prompt_key="question")] == [
        "q.parquet:0",
        "q.parquet:1",
    ]
    # Integer ids are accepted and become strings.
    ids = write_jsonl(tmp_path / "i.jsonl", [{"id": 7, "prompt": "a"}, {"id": 8, "prompt": "b"}])
    assert [r.id for r in read_prompt_rows(ids)] == ["7", "8"]


def test_chat_messages_agree_across_formats(tmp_path):
    import datasets

    records = [
        {"prompt": [{"role": "user", "content": "a b"}]},
        {
            "prompt": [
                {"role": "system", "content": "c", "name": "s"},
                {"role": "user", "content": "d"},
            ]
        },
    ]
    expected = [r["prompt"] for r in records]
    jsonl = write_jsonl(tmp_path / "m.jsonl", records)
    parquet = write_parquet(tmp_path / "m.parquet", records)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    # Arrow gives the first message a "name": None; it must be dropped so all formats agree.
    for path in [jsonl, parquet, str(tmp_path / "ds")]:
        assert [r.text_or_messages for r in read_prompt_rows(path)] == expected, path


def test_trailing_blank_lines_are_fine(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n\n  \n\n')
    assert [r.text_or_messages for r in read_prompt_rows(str(path))] == ["a", "b"]


# --------------------------------------------------------------------------------------------
# Reading: errors name file and line
# --------------------------------------------------------------------------------------------

GOOD = '{"prompt": "a b"}'


@pytest.mark.parametrize(
    "lines, bad_line, fragment",
    [
        ([GOOD, GOOD, '{"prompt": "a"'], 3, "invalid JSON"),
        ([GOOD, '["a", "b"]'], 2, "expected a JSON object, got array"),
        ([GOOD, '{"text": "a", "id": "x"}'], 2, "no 'prompt' field; the row has keys ['id', 'text"),
        ([GOOD, GOOD, GOOD, '{"prompt": "  \\n "}'], 4, "empty or whitespace only"),
        ([GOOD, '{"prompt": 42}'], 2, "got int"),
        ([GOOD, '{"prompt": null}'], 2, "got null"),
        ([GOOD, '{"prompt": []}'], 2, "empty list of messages"),
        ([GOOD, '{"prompt": ["a"]}'], 2, "message 0 must be an object"),
        ([GOOD, GOOD, '{"prompt": [{"role": "user"}]}'], 3, "'content' must be a string (missing)"),
        ([GOOD, '{"prompt": [{"role": "user", "content": 3}]}'], 2, "'content' must be a str"),
        ([GOOD, '{"prompt": [{"role": "", "content": "a"}]}'], 2, "'role' is empty"),
        ([GOOD, '{"prompt": [{"role": "user", "content": " "}]}'], 2, "all empty"),
        ([GOOD, '{"prompt": "a", "id": [1]}'], 2, "'id' must be a string or an integer"),
        ([GOOD, "", GOOD], 2, "blank line before the end"),
        ([GOOD, '{"prompt": "a", "prompt": "b"}'], 2, "key 'prompt' appears twice in one object"),
        ([GOOD, '{"prompt": [{"role": "user", "content": "a", "content": "b"}]}'], 2,
         "key 'content' appears twice"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, bad_line, fragment):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{bad_line}: "), message
    assert fragment in message


def test_duplicate_ids_name_both_lines(tmp_path):
    path = write_lines(
        tmp_path / "dup.jsonl",
        ['{"id": "x", "prompt": "a"}', '{"id": "y", "prompt": "b"}', '{"id": "x", "prompt": "c"}'],
    )
    with pytest.raises(DataError) as err:
        read_prompt_rows(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: duplicate id 'x'")
    assert f"first at {path}:1" in message


def test_duplicate_ids_across_files_in_a_directory(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "a"}])
    write_parquet(tmp_path / "b.parquet", [{"id": "y", "prompt": "b"}, {"id": "x", "prompt": "c"}])
    with pytest.raises(DataError) as err:
        read_prompt_rows(str(tmp_path))
    assert str(err.value).startswith(f"{tmp_path / 'b.parquet'}: row 1: duplicate id 'x'")
    assert f"first at {tmp_path / 'a.jsonl'}:1" in str(err.value)


def test_parquet_and_hf_errors_name_the_row(tmp_path):
    import datasets

    records = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": " "}]
    parquet = write_parquet(tmp_path / "p.parquet", records)
    with pytest.raises(DataError, match=rf"^{re.escape(parquet)}: row 2: 'prompt' is empty"):
        read_prompt_rows(parquet)
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    hf_dir = re.escape(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=rf"^{hf_dir}: row 2: 'prompt' is empty"):
        read_prompt_rows(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"row 0: no 'text' field; the row has keys \['prompt'\]"):
        read_prompt_rows(parquet, prompt_key="text")


def test_path_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=rf"^{re.escape(missing)}: no such file"):
        read_prompt_rows(missing)
    other = tmp_path / "p.txt"
    other.write_text("prompt\na\n")
    with pytest.raises(DataError, match=r"unsupported file type; expected .jsonl, .json, .csv"):
        read_prompt_rows(str(other))
    with pytest.raises(DataError,
                       match=r"only .jsonl, .json, .csv, .tsv .*\.parquet files.*\['p.txt'\]"):
        read_prompt_rows(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("# a card, no data")
    with pytest.raises(DataError, match=r"no .jsonl, .json, .csv, .tsv .* files in this directory"):
        read_prompt_rows(str(empty))


@pytest.mark.parametrize("name, text", [("e.jsonl", ""), ("e.jsonl", "\n\n"),
                                        ("e.csv", "prompt\n"), ("e.json", "[]")])
def test_a_source_without_rows_names_it(tmp_path, name, text):
    """An empty eval.prompts file stopped the run with "no usable prompt (all over
    generation.max_prompt_len ..., data.overlong: skip)", which was not why."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as err:
        read_prompt_rows(str(path))
    assert str(err.value) == (f"{path}: no prompt rows (the file is empty, or holds only "
                              "blank lines or a header)")
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}: no prompt rows"):
        read_prompt_rows([str(good), str(path)])  # one empty source among others too
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "train.jsonl").write_text("")
    with pytest.raises(DataError) as err:
        read_prompt_rows(str(folder))
    assert str(err.value) == (f"{folder}: no prompt rows (its data files are empty, or hold "
                              "only blank lines or a header)")


def write_csv(path, records, delimiter=","):
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(records)
    return str(path)


def test_csv_and_tsv_read_as_datasets_reads_them(tmp_path):
    """Prompt sets often come as CSV (OpenRLHF and TRL read them through ``datasets``): the
    same prompts and fields as ``datasets``' csv loader gives, ids from an ``id`` column, every
    cell text (no number guessing: a reward function gets ``"1"``), an empty cell null."""
    import datasets

    records = [{"id": "q1", "prompt": "a, b c", "extra": "1"},
               {"id": "q2", "prompt": 'd "e"\nf', "extra": ""},
               {"id": "", "prompt": "g h", "extra": "3"}]
    csv_path = write_csv(tmp_path / "p.csv", records)
    tsv_path = write_csv(tmp_path / "p.tsv", records, delimiter="\t")
    for path in (csv_path, tsv_path):
        rows = read_prompt_rows(path)
        name = os.path.basename(path)
        # the second record spans lines 3-4: the third starts on line 5
        assert [(r.text_or_messages, r.id, r.line) for r in rows] == [
            ("a, b c", "q1", 2), ('d "e"\nf', "q2", 3), ("g h", f"{name}:5", 5)]
        assert [r.fields for r in rows] == [{"extra": "1"}, {"extra": None}, {"extra": "3"}]
        theirs = datasets.load_dataset("csv", data_files=path, split="train",
                                       cache_dir=str(tmp_path / "hf-cache"),
                                       delimiter="\t" if path.endswith(".tsv") else ",")
        assert [r.text_or_messages for r in rows] == theirs["prompt"]
        assert [r.id for r in rows][:2] == theirs["id"][:2] and theirs["id"][2] is None
        assert theirs["extra"][1] is None
    gz = tmp_path / "z" / "train.csv.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(("\ufeff" + open(csv_path).read()).encode()))
    write_jsonl(tmp_path / "z" / "test.jsonl", [{"prompt": "held out"}])
    # a directory of shards picks the split by name, csv among them; an Excel BOM is dropped
    assert [r.id for r in read_prompt_rows(str(tmp_path / "z"))] == ["q1", "q2", "train.csv.gz:5"]


@pytest.mark.parametrize("text, error", [
    ("id,prompt\n1,a,b\n", r":2: 3 fields, the header \(line 1\) has 2: \['id', 'prompt'\]"),
    ("\nid,prompt\n1,a\n2\n", r":4: 1 fields, the header \(line 2\) has 2"),
    ("question\nx\n", r":1: the header has no 'prompt' column \(data.prompt_key\); its columns "
                      r"are \['question'\]"),
    ("prompt,prompt\nx,y\n", r":1: the header names 'prompt' twice"),
    ('prompt\nok\n"never closed\n', r":3: malformed row: unexpected end of data"),
    ("prompt\nok\n \n", r":3: 'prompt' is empty or whitespace only"),
    ("prompt,id\nok,\nfine,p.csv:2\n", r":3: duplicate id 'p.csv:2'"),
])
def test_csv_errors_name_the_line(tmp_path, text, error):
    path = tmp_path / "p.csv"
    path.write_text(text)
    with pytest.raises(DataError, match="^" + re.escape(str(path)) + error):
        read_prompt_rows(str(path))


def test_ptx_csv_without_its_column_names_data_ptx_key(tmp_path):
    """The pretraining text is read by data.ptx_key: its missing column named
    data.prompt_key, a key that plays no part in it."""
    path = tmp_path / "ptx.csv"
    path.write_text("body\nsome text\n")
    with pytest.raises(DataError) as err:
        read_prompt_rows(str(path), prompt_key="text", key_name="data.ptx_key")
    assert str(err.value) == (f"{path}:1: the header has no 'text' column (data.ptx_key); its "
                              "columns are ['body']")


def test_csv_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("prompt\nok\ncaf\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: not valid UTF-8 \(invalid"):
        read_prompt_rows(str(path))


def test_json_arrays_and_json_lines(tmp_path):
    """A .json file is a JSON array (DeepSpeed-Chat's local/jsonfile, many exports) or JSON
    lines under that name; an array's rows are counted from 0."""
    array = tmp_path / "a.json"
    array.write_text("\ufeff" + json.dumps(TEXT_RECORDS, indent=2))
    assert as_tuples(read_prompt_rows(str(array))) == [(r["prompt"], r["id"]) for r in TEXT_RECORDS]
    lines = write_lines(tmp_path / "l.json", [json.dumps(r) for r in TEXT_RECORDS])
    assert as_tuples(read_prompt_rows(lines)) == [(r["prompt"], r["id"]) for r in TEXT_RECORDS]
    array.write_text(json.dumps([{"prompt": "a"}, ["b"]]))
    with pytest.raises(DataError, match=rf"^{re.escape(str(array))}: row 1: expected a JSON object, got array"):
        read_prompt_rows(str(array))
    array.write_text('[{"prompt": "a"}, {"prompt": "b", "id": 1, "id": 2}]')
    with pytest.raises(DataError, match=rf"^{re.escape(str(array))}: row 1: key 'id' appears twice"):
        read_prompt_rows(str(array))
    array.write_text('[{"prompt": "a"},\n {"prompt": }]')
    with pytest.raises(DataError, match=rf"^{re.escape(str(array))}:2: invalid JSON"):
        read_prompt_rows(str(array))


def test_a_hub_snapshot_reads_the_split_its_files_are_named_for(tmp_path, caplog):
    """What `huggingface-cli download --repo-type dataset` leaves: a card, and parquet shards
    under data/ named by split. data.split picks the shards; the others are logged, not read
    (every file was read before, test prompts with the training ones, and the card was an
    error)."""
    snap = tmp_path / "rm-static"
    (snap / "data").mkdir(parents=True)
    (snap / "README.md").write_text("---\nlicense: mit\n---\n")
    (snap / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (snap / "dataset_infos.json").write_text('{"default": {"features": {}}}')  # older datasets
    write_parquet(snap / "data" / "train-00000-of-00002.parquet", TEXT_RECORDS[:2])
    write_parquet(snap / "data" / "train-00001-of-00002.parquet", TEXT_RECORDS[2:])
    write_parquet(snap / "data" / "test-00000-of-00001.parquet", [{"id": "z", "prompt": "h h"}])
    with caplog.at_level("INFO", logger="oppo_ds.datafiles"):
        rows = read_prompt_rows(str(snap))
    assert as_tuples(rows) == [(r["prompt"], r["id"]) for r in TEXT_RECORDS]
    assert "not read: data/test-00000-of-00001.parquet" in caplog.text
    assert as_tuples(read_prompt_rows(str(snap), split="test")) == [("h h", "z")]
    assert as_tuples(read_prompt_rows(str(snap), split="eval")) == [("h h", "z")]
    with pytest.raises(DataError, match=r"no files of split 'validation' \(data.split\); its files "
                                        r"are named for the splits \['test', 'train'\]"):
        read_prompt_rows(str(snap), split="validation")
    # split folders, and plain files beside them
    flat = tmp_path / "flat"
    (flat / "validation").mkdir(parents=True)
    write_jsonl(flat / "validation" / "0.jsonl", [{"prompt": "v"}])
    write_jsonl(flat / "train.jsonl", [{"prompt": "t"}])
    assert [r.text_or_messages for r in read_prompt_rows(str(flat), split="dev")] == ["v"]
    assert [r.text_or_messages for r in read_prompt_rows(str(flat))] == ["t"]


def test_a_split_is_a_word_anywhere_in_a_name(tmp_path, caplog):
    """The split word was only seen at the start of a name: gsm8k_train.jsonl beside
    gsm8k_test.jsonl read both, test set included, silently; gsm8k's main/ and socratic/
    configurations read every question twice; ultrachat's train_sft and train_gen were both
    train, and data.split: train_sft found nothing."""
    flat = tmp_path / "gsm8k_flat"
    flat.mkdir()
    write_jsonl(flat / "gsm8k_train.jsonl", [{"prompt": "t"}])
    write_jsonl(flat / "gsm8k_test.jsonl", [{"prompt": "x"}])
    assert [r.text_or_messages for r in read_prompt_rows(str(flat))] == ["t"]
    assert [r.text_or_messages for r in read_prompt_rows(str(flat), split="test")] == ["x"]
    nested = tmp_path / "nested"
    for split in ("train", "test"):
        (nested / "data" / split).mkdir(parents=True)
        write_parquet(nested / "data" / split / "0.parquet", [{"prompt": split}])
    assert [r.text_or_messages for r in read_prompt_rows(str(nested))] == ["train"]

    gsm8k = tmp_path / "gsm8k"
    for config in ("main", "socratic"):
        (gsm8k / config).mkdir(parents=True)
        for split in ("train", "test"):
            write_parquet(gsm8k / config / f"{split}-00000-of-00001.parquet",
                          [{"prompt": f"{config} {split}"}])
    with pytest.raises(DataError, match=r"split 'train' is in several folders, each a "
                                        r"configuration .*\['main', 'socratic'\]; point "
                                        r"data.prompts at the one to read \("
                                        + re.escape(str(gsm8k))):
        read_prompt_rows(str(gsm8k))
    assert [r.text_or_messages for r in read_prompt_rows(str(gsm8k / "main"))] == ["main train"]
    # folders below the split's are its parts (shards, partitions), not configurations
    parts = tmp_path / "partitioned"
    for part in ("lang=en", "lang=fr"):
        (parts / "train" / part).mkdir(parents=True)
        write_parquet(parts / "train" / part / "0.parquet", [{"prompt": part}])
    assert [r.text_or_messages for r in read_prompt_rows(str(parts))] == ["lang=en", "lang=fr"]

    ultra = tmp_path / "ultrachat_200k"
    (ultra / "data").mkdir(parents=True)
    for split in ("train_sft", "train_gen", "test_sft", "test_gen"):
        write_parquet(ultra / "data" / f"{split}-00000-of-00001-0a1b.parquet", [{"prompt": split}])
    assert [r.text_or_messages for r in read_prompt_rows(str(ultra), split="train_sft")] \
        == ["train_sft"]
    assert [r.text_or_messages for r in read_prompt_rows(str(ultra), split="TEST_GEN")] \
        == ["test_gen"]
    with pytest.raises(DataError, match=r"files named for several train splits, \['train_gen', "
                                        r"'train_sft'\]; set data.split to the one to read"):
        read_prompt_rows(str(ultra))
    # an exact name wins over its qualified kin; shards that only add digits are one split
    (ultra / "data" / "train-00000-of-00001.parquet").write_bytes(
        (ultra / "data" / "train_gen-00000-of-00001-0a1b.parquet").read_bytes())
    assert len(read_prompt_rows(str(ultra))) == 1
    plain = tmp_path / "plain"
    plain.mkdir()
    write_jsonl(plain / "part_1.jsonl", [{"prompt": "a"}])
    write_jsonl(plain / "part_2.jsonl", [{"prompt": "b"}])
    caplog.clear()
    with caplog.at_level("INFO", logger="oppo_ds.datafiles"):
        assert len(read_prompt_rows(str(plain))) == 2
    assert f"{plain}: no file or folder is named for a split" in caplog.text
    assert "all 2 files are read" in caplog.text


def test_missing_split(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(TEXT_RECORDS)
    datasets.DatasetDict(train=ds).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"no split 'validation'; the dataset has \['train'\]"):
        read_prompt_rows(str(tmp_path / "dd"), split="validation")


@pytest.mark.parametrize("suffix, opener", [(".gz", "gzip"), (".bz2", "bz2"), (".xz", "lzma")])
def test_compressed_json_files_read_as_the_plain_ones(tmp_path, suffix, opener):
    """Anthropic/hh-rlhf ships train.jsonl.gz (datasets reads it); .jsonl.gz was refused.
    Errors count the decompressed text's lines."""
    import importlib

    module = importlib.import_module(opener)
    expected = [(r["prompt"], r["id"]) for r in TEXT_RECORDS]
    lines = "".join(json.dumps(r) + "\n" for r in TEXT_RECORDS).encode()
    jsonl = tmp_path / f"p.jsonl{suffix}"
    jsonl.write_bytes(module.compress(lines))
    array = tmp_path / f"a.json{suffix}"
    array.write_bytes(module.compress(json.dumps(TEXT_RECORDS).encode()))
    assert as_tuples(read_prompt_rows(str(jsonl))) == expected
    assert as_tuples(read_prompt_rows(str(array))) == expected
    jsonl.write_bytes(module.compress(lines + b'{"prompt": }\n'))
    with pytest.raises(DataError, match=rf"^{re.escape(str(jsonl))}:{len(TEXT_RECORDS) + 1}: "
                                        "invalid JSON"):
        read_prompt_rows(str(jsonl))


def test_a_compressed_file_that_does_not_decompress_is_named(tmp_path):
    import gzip

    plain = tmp_path / "plain.jsonl.gz"  # not compressed at all
    plain.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(plain))}: cannot decompress after "
                                        r"line 0: BadGzipFile"):
        read_prompt_rows(str(plain))
    whole = gzip.compress(b"".join(b'{"prompt": "a b c d e f g"}\n' for _ in range(2000)))
    cut = tmp_path / "cut.jsonl.gz"  # a download that stopped short
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=rf"^{re.escape(str(cut))}: cannot decompress after line "
                                        r"\d+: EOFError"):
        read_prompt_rows(str(cut))
    array = tmp_path / "a.json.gz"
    array.write_bytes(gzip.compress(b'[{"prompt": "a"}]')[:-6])
    with pytest.raises(DataError, match=rf"^{re.escape(str(array))}: cannot decompress"):
        read_prompt_rows(str(array))


def test_a_file_beside_its_compressed_copy_is_refused(tmp_path):
    import gzip

    write_jsonl(tmp_path / "train.jsonl", TEXT_RECORDS)
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress((tmp_path / "train.jsonl").read_bytes()))
    with pytest.raises(DataError, match=r"holds train.jsonl and its compressed copy "
                                        r"train.jsonl.gz; both would be read"):
        read_prompt_rows(str(tmp_path))


def test_files_sharing_a_name_in_different_folders_get_distinct_ids(tmp_path):
    """hh-rlhf's layout: helpful-base/train.jsonl.gz, harmless-base/train.jsonl.gz, ...: the
    default ids (``train.jsonl.gz:1`` twice) were a duplicate-id error. Files whose names
    collide take the path from their common folder; the others keep their basename. The
    folders are configurations of the data set: the whole snapshot is an error that says to
    list them."""
    import gzip

    snap = tmp_path / "hh-rlhf"
    for folder in ("helpful-base", "harmless-base"):
        (snap / folder).mkdir(parents=True)
        for split in ("train", "test"):
            text = "".join(json.dumps({"prompt": f"{folder} {split} {i}"}) + "\n" for i in range(2))
            (snap / folder / f"{split}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    extra = write_jsonl(tmp_path / "train-extra.jsonl", [{"prompt": "extra"}])
    with pytest.raises(DataError, match=r"split 'train' is in several folders, each a "
                                        r"configuration of the data set .*\['harmless-base', "
                                        r"'helpful-base'\]; point data.prompts at the one"):
        read_prompt_rows(str(snap))
    sources = [str(snap / "harmless-base"), str(snap / "helpful-base"), extra]
    rows = read_prompt_rows(sources)
    assert [(r.id, r.text_or_messages) for r in rows] == [
        ("harmless-base/train.jsonl.gz:1", "harmless-base train 0"),
        ("harmless-base/train.jsonl.gz:2", "harmless-base train 1"),
        ("helpful-base/train.jsonl.gz:1", "helpful-base train 0"),
        ("helpful-base/train.jsonl.gz:2", "helpful-base train 1"),
        ("train-extra.jsonl:1", "extra")]
    # explicit ids that collide are still an error, naming both rows
    ids = write_jsonl(tmp_path / "train-ids.jsonl", [{"id": "x", "prompt": "a"},
                                                     {"id": "x", "prompt": "b"}])
    with pytest.raises(DataError, match=rf"{re.escape(ids)}:2: duplicate id"):
        read_prompt_rows(sources + [ids])


def test_several_sources_read_one_after_another(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write_jsonl(tmp_path / "a" / "train.jsonl", [{"prompt": "a1"}, {"prompt": "a2"}])
    second = write_jsonl(tmp_path / "b" / "train.jsonl", [{"prompt": "b1"}])
    third = write_parquet(tmp_path / "c.parquet", [{"id": "c", "prompt": "c1"}])
    rows = read_prompt_rows([second, first, third])
    assert [(r.id, r.text_or_messages, r.source) for r in rows] == [
        ("b/train.jsonl:1", "b1", second), ("a/train.jsonl:1", "a1", first),
        ("a/train.jsonl:2", "a2", first), ("c.parquet/c", "c1", third)]
    assert as_tuples(read_prompt_rows([third])) == [("c1", "c")]
    with pytest.raises(DataError, match=rf"^{re.escape(first)}: named twice"):
        read_prompt_rows([first, third, first])
    with pytest.raises(DataError, match="no prompt source given"):
        read_prompt_rows([])


def test_written_ids_of_several_sources_are_put_under_their_source(tmp_path):
    """Two sources that each number their rows with an integer id (the documented way to read
    several together) failed: ``src_b.jsonl:1: duplicate id '0'``. Each source's written ids
    now carry its name; one source's stay bare (its checkpoints keep their ids); a duplicate
    within one file is still an error naming both lines."""
    src_a = write_jsonl(tmp_path / "src_a.jsonl", [{"id": i, "prompt": f"a{i}"} for i in range(2)])
    src_b = write_jsonl(tmp_path / "src_b.jsonl", [{"id": i, "prompt": f"b{i}"} for i in range(2)])
    (tmp_path / "en").mkdir()
    (tmp_path / "de").mkdir()
    en = write_jsonl(tmp_path / "en" / "train.jsonl", [{"id": "q", "prompt": "en"}])
    de = write_jsonl(tmp_path / "de" / "train.jsonl", [{"id": "q", "prompt": "de"}])
    assert [r.id for r in read_prompt_rows([src_a, src_b, en, de])] == [
        "src_a.jsonl/0", "src_a.jsonl/1", "src_b.jsonl/0", "src_b.jsonl/1",
        "en/train.jsonl/q", "de/train.jsonl/q"]
    assert [r.id for r in read_prompt_rows(src_a)] == ["0", "1"]
    assert [r.id for r in read_prompt_rows([src_a])] == ["0", "1"]
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": 7, "prompt": "x"},
                                                   {"id": 7, "prompt": "y"}])
    with pytest.raises(DataError, match=rf"^{re.escape(clash)}:2: duplicate id 'clash.jsonl/7' "
                                        rf"\(first at {re.escape(clash)}:1\)"):
        read_prompt_rows([src_a, clash])


def test_phase_part_cuts_as_deepspeed_chat_does():
    """DeepSpeed-Chat's --data_split: part bounds from rounded shares, the overshoot taken off
    every end (so the first part absorbs it), then slices of numpy's RandomState(seed)
    permutation of arange(n)."""
    import numpy as np

    # n=10, 2,4,4: bounds 0, 2, 6, 10
    perm = np.arange(10, dtype=np.uint32)
    np.random.RandomState(seed=1234).shuffle(perm)
    parts = [phase_part(10, [2, 4, 4], 1234, part) for part in range(3)]
    assert parts == [perm[0:2].tolist(), perm[2:6].tolist(), perm[6:10].tolist()]
    assert phase_part(10, [2.0, 4.0, 4.0], 1234) == parts[2]  # part 2, PPO's, by default
    # n=5, 1,1,1: round(5/3) = 2 three times is 6, one too many: sizes 1, 2, 2
    assert [len(phase_part(5, [1, 1, 1], 0, part)) for part in range(3)] == [1, 2, 2]
    # n=8, 2,4,4: round(1.6) = 2, round(3.2) = 3 twice: 2, 3, 3
    assert [len(phase_part(8, [2, 4, 4], 0, part)) for part in range(3)] == [2, 3, 3]
    for n, weights in ((1, [1, 1, 1]), (7, [0, 0, 1]), (100, [6, 2, 2]), (33, [1, 0, 9])):
        cut = [phase_part(n, weights, 5, part) for part in range(3)]
        assert sorted(i for part in cut for i in part) == list(range(n)), (n, weights)
    assert phase_part(7, [0, 0, 1], 5) != list(range(7))  # permuted, all of it
    assert phase_part(100, [2, 4, 4], 1) != phase_part(100, [2, 4, 4], 2)


def test_phase_split_reads_the_ppo_part_of_each_source(tmp_path, caplog):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(10)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    with caplog.at_level("INFO", logger="oppo_ds.datafiles"):
        rows = read_prompt_rows([first, second], phase_split=[2, 4, 4], phase_seed=7)
    expected = ([f"a{i}" for i in sorted(phase_part(10, [2, 4, 4], 7))]
                + [f"b{i}" for i in sorted(phase_part(5, [2, 4, 4], 7))])
    assert [r.text_or_messages for r in rows] == expected  # in file order
    assert len(rows) == 4 + 2
    assert f"{first}: 4 of 10 prompts, the PPO part of data.phase_split [2, 4, 4] (seed 7)" \
        in caplog.text
    # every row is checked, inside the part or not
    write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": f"c{i}"}) for i in range(9)]
                + ['{"text": "no prompt"}'])
    with pytest.raises(DataError, match=r"bad.jsonl:10: no 'prompt' field"):
        read_prompt_rows(str(tmp_path / "bad.jsonl"), phase_split=[2, 4, 4])


# --------------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------------


def rows_of(*prompts, source="x.jsonl"):
    return [PromptRow(p, source, i + 1, f"r{i + 1}") for i, p in enumerate(prompts)]


def test_plain_encoding(plain_tok):
    enc = encode_prompts(rows_of("a b c", "h"), plain_tok, max_prompt_len=8)
    ids = {w: i for i, w in enumerate(WORDS)}
    assert [p.input_ids for p in enc.prompts] == [
        [ids["<bos>"], ids["a"], ids["b"], ids["c"]],
        [ids["<bos>"], ids["h"]],
    ]
    where = [(p.id, p.source, p.line) for p in enc.prompts]
    assert where == [("r1", "x.jsonl", 1), ("r2", "x.jsonl", 2)]
    assert (enc.n_truncated, enc.n_skipped) == (0, 0)


def test_overlong_error_names_row_and_lengths(plain_tok):
    rows = rows_of("a", "a b c d e f", source="data.jsonl")  # second: 7 tokens with <bos>
    with pytest.raises(DataError) as err:
        encode_prompts(rows, plain_tok, max_prompt_len=4)
    assert str(err.value) == ("data.jsonl:2: prompt 'r2' is 7 tokens, over "
                              "generation.max_prompt_len=4 (set data.overlong to truncate or "
                              "skip to allow this)")


def test_overlong_truncate_keeps_the_last_tokens(plain_tok):
    rows = rows_of("a", "a b c d e f", "b c d")  # 2, 7, 4 tokens with <bos>
    enc = encode_prompts(rows, plain_tok, max_prompt_len=4, overlong="truncate")
    full = plain_tok("a b c d e f")["input_ids"]
    assert enc.prompts[1].input_ids == full[-4:]
    assert plain_tok.convert_ids_to_tokens(enc.prompts[1].input_ids) == ["c", "d", "e", "f"]
    assert enc.prompts[2].input_ids == plain_tok("b c d")["input_ids"]  # exactly at the limit: kept
    assert (len(enc), enc.n_truncated, enc.n_skipped) == (3, 1, 0)


def test_overlong_skip_drops_and_counts(plain_tok):
    rows = rows_of("a", "a b c d e f", "b c d e", "c")
    enc = encode_prompts(rows, plain_tok, max_prompt_len=4, overlong="skip")
    assert [p.id for p in enc.prompts] == ["r1", "r4"]
    assert (enc.n_truncated, enc.n_skipped) == (0, 2)


def test_a_prompt_ending_with_an_assistant_message_is_continued(chat_tok):
    """As TRL's apply_chat_template does: the response carries on the assistant's given start
    (no end-of-turn after it, no second assistant header), rather than answering it in a new
    turn."""
    conversation = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c d"}]
    enc = encode_prompts(rows_of("e", conversation), chat_tok, max_prompt_len=32)
    assert chat_tok.convert_ids_to_tokens(enc.prompts[1].input_ids) == [
        "<bos>", "user", ":", "a", "b", "assistant", ":", "c", "d"]
    assert chat_tok.convert_ids_to_tokens(enc.prompts[0].input_ids)[-2:] == ["assistant", ":"]
    assert enc.n_continued == 1
    # a continued prompt skipped as too long is not counted as continued
    skipped = encode_prompts(rows_of("e", conversation), chat_tok, max_prompt_len=6,
                             overlong="skip")
    assert (len(skipped.prompts), skipped.n_skipped, skipped.n_continued) == (1, 1, 0)


def test_bad_option_values(plain_tok):
    rows = rows_of("a")
    with pytest.raises(ValueError, match="error, truncate, skip"):
        encode_prompts(rows, plain_tok, 4, overlong="cut")
    with pytest.raises(ValueError, match="auto, on, off"):
        encode_prompts(rows, plain_tok, 4, chat_template="yes")
    with pytest.raises(ValueError, match="max_prompt_len"):
        encode_prompts(rows, plain_tok, 0)


def test_chat_template_auto_on_off(chat_tok):
    rows = rows_of("a b", [{"role": "system", "content": "c"}, {"role": "user", "content": "d e"}])
    as_user = [{"role": "user", "content": "a b"}]
    expected = [
        chat_tok.apply_chat_template(as_user, add_generation_prompt=True, return_dict=False),
        # transformers 5 returns a BatchEncoding unless return_dict=False.
        chat_tok.apply_chat_template(rows[1].text_or_messages, add_generation_prompt=True)[
            "input_ids"
        ],
    ]
    # Spelled out, so the test does not only compare the function with itself.
    tokens = chat_tok.convert_ids_to_tokens(expected[0])
    assert tokens == ["<bos>", "user", ":", "a", "b", "assistant", ":"]
    for mode in ("auto", "on"):
        enc = encode_prompts(rows, chat_tok, max_prompt_len=32, chat_template=mode)
        assert [p.input_ids for p in enc.prompts] == expected, mode

    off = encode_prompts(rows[:1], chat_tok, max_prompt_len=32, chat_template="off")
    assert off.prompts[0].input_ids == chat_tok("a b", add_special_tokens=True)["input_ids"]
    with pytest.raises(DataError, match=r"^x.jsonl:2: prompt is a list of chat messages"):
        encode_prompts(rows, chat_tok, max_prompt_len=32, chat_template="off")


def test_no_template_available(plain_tok):
    rows = rows_of("a b", [{"role": "user", "content": "c"}])
    auto = encode_prompts(rows[:1], plain_tok, max_prompt_len=32)  # auto falls back to plain
    assert auto.prompts[0].input_ids == plain_tok("a b")["input_ids"]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(rows[:1], plain_tok, max_prompt_len=32, chat_template="on")
    with pytest.raises(DataError, match=r"^x.jsonl:2: prompt is a list of chat messages"):
        encode_prompts(rows, plain_tok, max_prompt_len=32)


def test_input_template_wraps_text_prompts(plain_tok, chat_tok):
    """data.input_template (OpenRLHF's --input_template): a string prompt goes into the
    template at its {} before tokenising; braces elsewhere are text. Chat messages still need
    a chat template, and a tokenizer whose template is in use refuses it."""
    rows = rows_of("a b", [{"role": "user", "content": "c"}])
    enc = encode_prompts(rows[:1], plain_tok, max_prompt_len=32, input_template="user : {} assistant :")
    tokens = plain_tok.convert_ids_to_tokens(enc.prompts[0].input_ids)
    assert tokens == ["<bos>", "user", ":", "a", "b", "assistant", ":"]
    braces = encode_prompts(rows[:1], plain_tok, max_prompt_len=32, input_template="c {} {d}")
    assert braces.prompts[0].input_ids == plain_tok("c a b {d}")["input_ids"]
    with pytest.raises(DataError, match=r"^x.jsonl:2: prompt is a list of chat messages"):
        encode_prompts(rows, plain_tok, max_prompt_len=32, input_template="user : {}")
    for bad in ("user :", "{} {}"):
        with pytest.raises(ValueError, match="must hold {} once"):
            encode_prompts(rows[:1], plain_tok, max_prompt_len=32, input_template=bad)
    with pytest.raises(ValueError, match="the tokenizer's is in use"):
        encode_prompts(rows[:1], chat_tok, max_prompt_len=32, input_template="user : {}")
    off = encode_prompts(rows[:1], chat_tok, max_prompt_len=32, chat_template="off",
                         input_template="user : {} assistant :")
    assert off.prompts[0].input_ids == enc.prompts[0].input_ids


def test_text_that_starts_with_the_bos_text_gets_no_second_bos(plain_tok, chat_tok):
    """A prompt file rendered by a chat template beforehand (Llama 3's and Gemma's put the BOS
    text in it), or an input_template opening with it, was tokenised with a second BOS in
    front (OpenRLHF tokenises such prompts without special tokens; a chat template's tokens
    get none either): one BOS, as the chat template path gives."""
    rendered = rows_of("<bos>user : a b assistant :")
    one = ["<bos>", "user", ":", "a", "b", "assistant", ":"]
    enc = encode_prompts(rendered, plain_tok, max_prompt_len=32)
    assert plain_tok.convert_ids_to_tokens(enc.prompts[0].input_ids) == one
    templated = encode_prompts(rows_of("a b"), plain_tok, max_prompt_len=32,
                               input_template="<bos>user : {} assistant :")
    assert plain_tok.convert_ids_to_tokens(templated.prompts[0].input_ids) == one
    chat = encode_prompts(rows_of([{"role": "user", "content": "a b"}]), chat_tok,
                          max_prompt_len=32)
    assert chat.prompts[0].input_ids == enc.prompts[0].input_ids
    # text without it still gets the tokenizer's BOS
    plain = encode_prompts(rows_of("user : a b assistant :"), plain_tok, max_prompt_len=32)
    assert plain.prompts[0].input_ids == enc.prompts[0].input_ids


def test_a_prompt_rendered_already_is_refused_under_a_chat_template(chat_tok):
    """A prompt file rendered by a chat template beforehand got the tokenizer's template on
    top, a second BOS in front (the second-BOS check ran only without a template). With a
    template in use, a string prompt starting with the BOS text, or holding a special token
    the template writes out, is an error naming the row and data.chat_template: off."""
    with pytest.raises(DataError, match=r"^x.jsonl:1: prompt 'r1' starts with the BOS "
                                        r"text '<bos>': it looks rendered by a chat template "
                                        r"already.*set data.chat_template: off"):
        encode_prompts(rows_of("<bos>user : a b assistant :"), chat_tok, max_prompt_len=32)
    off = encode_prompts(rows_of("<bos>user : a b assistant :"), chat_tok, max_prompt_len=32,
                         chat_template="off")
    assert chat_tok.convert_ids_to_tokens(off.prompts[0].input_ids) == \
        ["<bos>", "user", ":", "a", "b", "assistant", ":"]
    # a template that writes a special token out (Qwen's <|im_start|>, here <eos>)
    eos_tok = make_tokenizer(TEMPLATE.replace("{{ m['content'] }} ", "{{ m['content'] }} <eos> "))
    with pytest.raises(DataError, match=r"^x.jsonl:1: prompt 'r1' holds '<eos>', a "
                                        r"special token of the chat template"):
        encode_prompts(rows_of("user : a b <eos> assistant :"), eos_tok, max_prompt_len=32)
    # plain text, messages holding it, and a tokenizer's special token the template does not
    # write, are prompts as before
    fine = encode_prompts(rows_of("a b", [{"role": "user", "content": "<bos>a"}], "c <eos>"),
                          chat_tok, max_prompt_len=32)
    assert len(fine) == 3


def test_deepspeed_chat_formats_imply_no_chat_template(chat_tok):
    """data.deepspeed_chat_formats: true set in YAML applied the tokenizer's chat template
    around prompts that carry DeepSpeed-Chat's own format; only oppo-train's --data_path
    switched it off. Its auto is off now wherever it is set; on applies the template."""
    from types import SimpleNamespace

    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.sources import check_prompt_format, encode_rows

    rows = rows_of(" Human: a b Assistant:")
    dschat = load_config(None, ["data.deepspeed_chat_formats=true"])
    enc = encode_rows(dschat, rows, chat_tok, "x.jsonl", log=False)
    assert enc.prompts[0].input_ids == chat_tok(" Human: a b Assistant:")["input_ids"]
    on = load_config(None, ["data.deepspeed_chat_formats=true", "data.chat_template=on"])
    templated = encode_rows(on, rows, chat_tok, "x.jsonl", log=False)
    assert templated.prompts[0].input_ids == chat_tok.apply_chat_template(
        [{"role": "user", "content": rows[0].text_or_messages}], add_generation_prompt=True,
        return_dict=False)
    src = SimpleNamespace(tokenizer="/models/tok")
    check_prompt_format(load_config(None, ["data.deepspeed_chat_formats=true",
                                           "data.input_template='user : {}'"]), src, chat_tok)
    with pytest.raises(ConfigError, match=r"^data\.input_template"):
        check_prompt_format(load_config(None, ["data.input_template='user : {}'"]), src, chat_tok)


def test_a_run_refuses_prompt_settings_its_tokenizer_cannot_follow(plain_tok, chat_tok):
    """Checked before any prompt is encoded, as a ConfigError naming the key (oppo-train: one
    line, exit 2), not a traceback from the encoder."""
    from types import SimpleNamespace

    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.sources import check_prompt_format

    src = SimpleNamespace(tokenizer="/models/tok")
    with pytest.raises(ConfigError, match=r"^data\.chat_template: on, but /models/tok has no chat"):
        check_prompt_format(load_config(None, ["data.chat_template=on"]), src, plain_tok)
    with_template = load_config(None, ["data.input_template='user : {}'"])
    with pytest.raises(ConfigError, match=r"^data\.input_template: 'user : {}' is for tokenizers"):
        check_prompt_format(with_template, src, chat_tok)
    check_prompt_format(with_template, src, plain_tok)
    check_prompt_format(load_config(None, ["data.input_template='user : {}'", "data.chat_template=off"]),
                        src, chat_tok)
    check_prompt_format(load_config(None, ["data.chat_template=on"]), src, chat_tok)
    with pytest.raises(ConfigError, match=r"^data\.input_template: must hold {} once"):
        load_config(None, ["data.input_template=user"])


def test_template_errors_name_the_row(chat_tok):
    rows = rows_of("a", [{"role": "tool", "content": "b"}])
    with pytest.raises(DataError, match=r"^x.jsonl:2: chat template failed.*unknown role tool"):
        encode_prompts(rows, chat_tok, max_prompt_len=32)


def test_read_then_encode_error_points_at_the_file(tmp_path, plain_tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "a b c d e f g h"}])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}:2: prompt 'p.jsonl:2' is 9 tokens"):
        encode_prompts(read_prompt_rows(path), plain_tok, max_prompt_len=8)


# --------------------------------------------------------------------------------------------
# PromptStream
# --------------------------------------------------------------------------------------------


def make_prompts(n):
    return [Prompt(f"p{i}", [i], "mem", i) for i in range(n)]


def ids(prompts):
    return [p.id for p in prompts]


@pytest.mark.parametrize("n", [10, 11])
def test_ranks_are_disjoint_and_cover_the_epoch(n):
    prompts = make_prompts(n)
    streams = [PromptStream(prompts, batch_size=2, seed=3, rank=r, world_size=2) for r in range(2)]
    assert all(s.prompts_per_epoch == n // 2 for s in streams)
    seen_over_epochs = set()
    for epoch in range(6):
        shares = [set(ids(s.take(n // 2))) for s in streams]
        assert all(len(share) == n // 2 for share in shares)  # no repeats within a rank's epoch
        assert not shares[0] & shares[1]
        union = shares[0] | shares[1]
        if n % 2 == 0:
            assert union == set(ids(prompts))
        else:
            assert len(union) == n - 1  # one prompt left out this epoch...
        seen_over_epochs |= union
        assert all(s.epoch == epoch + 1 for s in streams)
    assert seen_over_epochs == set(ids(prompts))  # ...but a different one each epoch


def test_unshuffled_order_is_round_robin():
    prompts = make_prompts(7)
    r0 = PromptStream(prompts, batch_size=3, seed=0, rank=0, world_size=2, shuffle=False)
    r1 = PromptStream(prompts, batch_size=3, seed=0, rank=1, world_size=2, shuffle=False)
    assert ids(r0.take(3)) == ["p0", "p2", "p4"]
    assert ids(r1.take(3)) == ["p1", "p3", "p5"]
    assert ids(r0.take(2)) == ["p0", "p2"]  # p6 is the remainder, dropped; next epoch


def test_deterministic_for_a_seed_and_independent_of_global_rng():
    prompts = make_prompts(20)
    a = PromptStream(prompts, batch_size=4, seed=7)
    b = PromptStream(prompts, batch_size=4, seed=7)
    c = PromptStream(prompts, batch_size=4, seed=8)
    got_a = []
    for i in range(12):
        torch.manual_seed(i)
        random.seed(i)
        got_a += ids(a.next_batch())
    got_b = [p for _ in range(12) for p in ids(b.next_batch())]
    got_c = [p for _ in range(12) for p in ids(c.next_batch())]
    assert got_a == got_b
    assert got_a != got_c
    assert got_a[:20] != ids(prompts)  # shuffled
    assert got_a[:20] != got_a[20:40]  # a new permutation each epoch


def test_state_dict_round_trip_continues_identically():
    prompts = make_prompts(13)
    original = PromptStream(prompts, batch_size=4, seed=1, rank=1, world_size=3)
    original.take(5)
    original.next_batch()  # 9 taken: mid-epoch 2 (4 per rank per epoch)
    state = json.loads(json.dumps(original.state_dict()))
    assert (state["epoch"], state["position"]) == (2, 1)

    restored = PromptStream(prompts, batch_size=4, seed=1, rank=1, world_size=3)
    restored.take(3)  # a stream already in use must forget its place, too
    restored.load_state_dict(state)
    assert (original.epoch, original.prompts_seen) == (2, 9)
    assert (restored.epoch, restored.prompts_seen) == (2, 9)
    sizes = [3, 0, 7, 1, 4, 11, 2, 5, 4, 13]  # 50 prompts, in variable top-ups
    assert sum(sizes) == 50
    assert [ids(original.take(k)) for k in sizes] == [ids(restored.take(k)) for k in sizes]
    assert original.prompts_seen == restored.prompts_seen == 59


def test_load_state_dict_rejects_a_different_stream():
    state = PromptStream(make_prompts(10), batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        PromptStream(make_prompts(10), batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_prompts: saved 10, now 12"):
        PromptStream(make_prompts(12), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        stream = PromptStream(make_prompts(10), batch_size=2, seed=1)
        stream.load_state_dict({"epoch": 0, "position": 10})
    # as many prompts, one of them other tokens (or another id): other prompts, refused
    for changed in (Prompt("p3", [3, 3], "mem", 3), Prompt("q3", [3], "mem", 3)):
        other = make_prompts(10)
        other[3] = changed
        with pytest.raises(StreamMismatch) as err:
            PromptStream(other, batch_size=2, seed=1).load_state_dict(state)
        assert list(err.value.changed) == ["prompts"]
    moved = [Prompt(p.id, p.input_ids, "elsewhere", p.line) for p in make_prompts(10)]
    PromptStream(moved, batch_size=2, seed=1).load_state_dict(state)  # the same prompts
    older = {k: v for k, v in state.items() if k != "prompts"}  # saved before the fingerprint
    PromptStream(make_prompts(10), batch_size=2, seed=1).load_state_dict(older)


def test_batches_straddle_the_epoch_boundary():
    prompts = make_prompts(5)
    stream = PromptStream(prompts, batch_size=3, seed=5)
    epoch0 = ids(PromptStream(prompts, batch_size=5, seed=5).next_batch())
    reference = PromptStream(prompts, batch_size=5, seed=5)
    reference.load_state_dict({"epoch": 1, "position": 0})
    epoch1 = ids(reference.next_batch())

    first = ids(stream.next_batch())
    assert (stream.epoch, stream.prompts_seen) == (0, 3)
    second = ids(stream.next_batch())
    assert (stream.epoch, stream.prompts_seen) == (1, 6)
    assert first + second[:2] == epoch0
    assert second[2:] == epoch1[:1]
    assert sorted(epoch0) == sorted(epoch1) == ids(prompts)


def test_stream_argument_checks():
    with pytest.raises(ValueError, match="rank"):
        PromptStream(make_prompts(4), batch_size=1, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="3 prompts cannot be shared among world_size=4"):
        PromptStream(make_prompts(3), batch_size=1, seed=0, world_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream(make_prompts(3), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="n >= 0"):
        PromptStream(make_prompts(3), batch_size=1, seed=0).take(-1)


# --------------------------------------------------------------------------------------------
# left_pad
# --------------------------------------------------------------------------------------------


def _ranks_compare_prompts(rank, world, out, root):
    """One rank of test_ranks_that_read_different_prompts_stop: the trainer's own reading of
    data.prompts, from this rank's copy of the file (rank 1's differs in one row)."""
    from types import SimpleNamespace

    from oppo_ds import workload as wl
    from oppo_ds.config import load_config
    from oppo_ds.data import check_same_on_every_rank
    from oppo_ds.trainer import PPOTrainer

    same = [Prompt(f"p{i}", [1, 8 + i], "x.jsonl", i + 1) for i in range(3)]
    check_same_on_every_rank(same, "x.jsonl")  # the same prompts pass
    path = os.path.join(root, f"rank{rank}.jsonl")
    texts = ["a b", "c d", "e f" if rank == 0 else "e g"]
    write_jsonl(pathlib.Path(path), [{"prompt": t} for t in texts])
    cfg = load_config(None, [f"data.prompts={path}"])
    trainer = SimpleNamespace(cfg=cfg, tokenizer=wl.build_tokenizer(), is_main=rank == 0,
                              reward_fn=None, world_size=world)
    try:
        PPOTrainer._load_prompts(trainer, SimpleNamespace(prompts=path, oracle=False))
        out.put(("ok", rank, None))
    except DataError as err:
        out.put(("ok", rank, str(err)))


def test_ranks_that_read_different_prompts_stop(tmp_path):
    """Every data-parallel rank reads and encodes the prompt files itself, and each epoch's
    order deals one list out among the ranks: nodes with different local copies trained
    some prompts twice and skipped others, silently (the fingerprint was compared only at a
    resume). Two gloo ranks whose copies differ in one row now both stop, naming each rank's
    prompts."""
    from _builders import spawn_gloo

    found = sorted(m[1:] for m in spawn_gloo(_ranks_compare_prompts, 2, str(tmp_path),
                                             join_s=240, group_timeout_s=60) if m[0] == "ok")
    assert [rank for rank, _ in found] == [0, 1]
    for rank, message in found:
        assert message is not None, f"rank {rank} did not stop"
        assert re.search(r"the ranks read different prompts: rank 0: 3 prompts \(fingerprint "
                         r"[0-9a-f]{15}\); rank 1: 3 prompts \(fingerprint [0-9a-f]{15}\)\. "
                         r"Every rank reads the files itself", message), message
        assert "give every node the same files" in message


def test_left_pad():
    input_ids, attention_mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)
    assert input_ids.dtype == attention_mask.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_left_pad_edge_cases():
    input_ids, attention_mask = left_pad([[3, 4]], pad_id=99)
    assert input_ids.tolist() == [[3, 4]] and attention_mask.tolist() == [[1, 1]]
    input_ids, attention_mask = left_pad([[1], []], pad_id=99)
    assert input_ids.tolist() == [[1], [99]] and attention_mask.tolist() == [[1], [0]]
    input_ids, attention_mask = left_pad([], pad_id=0)
    assert input_ids.shape == attention_mask.shape == (0, 0)
