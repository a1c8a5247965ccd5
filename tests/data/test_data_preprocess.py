"""Preprocessors on small raw files written here in the upstream formats (and the hub's
parquet exports), then loaded back by PromptDataset."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.data.preprocess import PREPROCESSORS, convert, run
from meshrl.data.preprocess.common import split_of
from meshrl.data.preprocess.hh_rlhf import dialogue_to_chat
from meshrl.testing.char_tokenizer import PRINTABLE_CHARS, build_char_tokenizer
from meshrl_app import cli

pytestmark = pytest.mark.timeout(60)


def jsonl(path, records, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def parquet(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def read(path):
    return pq.read_table(path).to_pylist()


GSM = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "48/2 = <<48/2=24>>24\n#### 72"},
    {"question": "Big one?", "answer": "It is 1,234 * 1 = <<1234*1=1234>>1,234\n#### 1,234"},
    {"question": "Cold?", "answer": "Down by 5.\n#### -5"},
]


def test_gsm8k_jsonl(tmp_path):
    jsonl(tmp_path / "raw/train.jsonl", GSM[:2])
    jsonl(tmp_path / "raw/test.jsonl", GSM[2:])
    assert run("gsm8k", tmp_path / "raw", tmp_path / "out") == {"test": 1, "train": 2}
    rows = read(tmp_path / "out/train.parquet")
    assert rows[0]["prompt"] == [
        {
            "role": "user",
            "content": 'Natalia sold 48 clips. How many? Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert rows[1]["reward_model"]["ground_truth"] == "1234"
    assert rows[1]["extra_info"]["index"] == 1 and rows[1]["extra_info"]["split"] == "train"
    assert read(tmp_path / "out/test.parquet")[0]["reward_model"]["ground_truth"] == "-5"


def test_gsm8k_tool_rows_carry_verls_agent_and_tool_fields(tmp_path):
    jsonl(tmp_path / "raw/train.jsonl", GSM[:1])
    assert run("gsm8k_tool", tmp_path / "raw", tmp_path / "out") == {"train": 1}
    (row,) = read(tmp_path / "out/train.parquet")
    system, user = row["prompt"]
    assert system["role"] == "system" and "<tool_call>" in system["content"]
    assert user["content"].startswith("Natalia sold 48 clips.")
    assert row["agent_name"] == "tool_agent"
    assert row["reward_model"]["ground_truth"] == "72"
    assert row["extra_info"]["need_tools_kwargs"] is True
    assert row["extra_info"]["tools_kwargs"] == {
        "calculator": {"create_kwargs": {"ground_truth": "72"}}
    }
    ds = PromptDataset([str(tmp_path / "out/train.parquet")], build_char_tokenizer(PRINTABLE_CHARS))
    assert ds.records[0].extra_info["tools_kwargs"]["calculator"]["create_kwargs"] == {
        "ground_truth": "72"
    }


def test_gsm8k_hub_parquet(tmp_path):
    parquet(tmp_path / "raw/main/train-00000-of-00001.parquet", GSM)
    assert run("gsm8k", tmp_path / "raw", tmp_path / "out") == {"train": 3}


MATH_TREE = {
    "test/algebra/1.json": {
        "problem": "Solve $x+1=3$.",
        "level": "Level 1",
        "type": "Algebra",
        "solution": "So $x = \\boxed{2}$.",
    },
    "test/algebra/10.json": {
        "problem": "Half?",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "We get \\boxed{1} and then $\\boxed{\\frac{1}{2}}$.",
    },
    "test/geometry/2.json": {
        "problem": "No box.",
        "level": "Level 1",
        "type": "Geometry",
        "solution": "It is 4.",
    },
    "train/algebra/3.json": {
        "problem": "Pair?",
        "level": "Level 5",
        "type": "Algebra",
        "solution": "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
    },
}


def test_math_json_tree(tmp_path):
    for rel, rec in MATH_TREE.items():
        p = tmp_path / "MATH" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(rec, indent=4))
    result = convert("math", tmp_path / "MATH")
    assert result.skipped == {"solution without \\boxed{}": 1}
    assert run("math", tmp_path / "MATH", tmp_path / "out") == {"test": 2, "train": 1}
    test = read(tmp_path / "out/test.parquet")
    # natural order: 1.json before 10.json
    assert [r["reward_model"]["ground_truth"] for r in test] == ["2", "\\frac{1}{2}"]
    assert test[0]["prompt"][0]["content"] == (
        "Solve $x+1=3$. Let's think step by step and output the final answer within \\boxed{}."
    )
    assert test[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert (
        test[0]["extra_info"]["level"] == "Level 1" and test[0]["extra_info"]["type"] == "Algebra"
    )
    # top-level columns too, as verl's math_dataset.py leaves them
    assert (test[0]["level"], test[0]["type"]) == ("Level 1", "Algebra")
    train = read(tmp_path / "out/train.parquet")
    assert train[0]["reward_model"]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_math500_jsonl(tmp_path):
    rec = {
        "problem": "P",
        "solution": "so \\boxed{5}",
        "answer": "5",
        "subject": "Algebra",
        "level": 2,
        "unique_id": "test/algebra/9.json",
    }
    jsonl(tmp_path / "math_splits/test.jsonl", [rec])
    assert run("math", tmp_path / "math_splits", tmp_path / "out") == {"math500": 1}
    row = read(tmp_path / "out/math500.parquet")[0]
    assert row["extra_info"]["level"] == "Level 2"
    assert (row["level"], row["type"]) == ("Level 2", "Algebra")
    assert row["extra_info"]["unique_id"] == "test/algebra/9.json"
    assert row["data_source"] == "HuggingFaceH4/MATH-500"


def test_math_with_math500_beside_it_keeps_the_full_test_set_apart(tmp_path):
    """A folder holding both (raw/math: MATH/test/... and math_splits/test.jsonl) gave one
    test.parquet of 5,500 rows, MATH-500's 500 problems twice in it."""
    for rel, rec in MATH_TREE.items():
        p = tmp_path / "math" / "MATH" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(rec))
    subset = {
        "problem": "Solve $x+1=3$.",
        "solution": "so \\boxed{2}",
        "answer": "2",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/1.json",
    }
    jsonl(tmp_path / "math/math_splits/test.jsonl", [subset])
    written = run("math", tmp_path / "math", tmp_path / "out")
    assert written == {"test": 2, "train": 1, "math500": 1}
    test = read(tmp_path / "out/test.parquet")
    assert {r["data_source"] for r in test} == {"DigitalLearningGmbH/MATH-lighteval"}
    assert [r["extra_info"]["index"] for r in test] == [0, 1]
    (only,) = read(tmp_path / "out/math500.parquet")
    assert only["extra_info"]["index"] == 0 and only["data_source"] == "HuggingFaceH4/MATH-500"


HELLA = {
    "ind": 4,
    "activity_label": "Removing ice from car",
    "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.",
    "ctx_b": "then",
    "ctx": "Then, the man writes ... smiles. then",
    "endings": [
        ", the man adds wax to the windshield and cuts it.",
        ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as the we girls sled.",
        ", the man puts on a christmas coat, knitted with netting.",
        ", the man continues removing the snow on his car.",
    ],
    "source_id": "activitynet~v_-1IBHYS3L-Y",
    "split": "val",
    "split_type": "zeroshot",
    "label": 3,
}


def test_hellaswag_jsonl_and_hub_parquet(tmp_path):
    wiki = HELLA | {
        "activity_label": "Home and Garden",
        "ctx_a": "[header] How to x [title] Do y.",
        "ctx_b": "",
        "label": 0,
    }
    jsonl(tmp_path / "raw/hellaswag_val.jsonl", [HELLA, wiki])
    unlabeled = {k: v for k, v in HELLA.items() if k != "label"}
    jsonl(tmp_path / "raw/hellaswag_test.jsonl", [unlabeled])
    parquet(tmp_path / "raw/data/train-00000-of-00001.parquet", [HELLA | {"label": "1"}])
    result = convert("hellaswag", tmp_path / "raw")
    assert result.skipped == {"no label (unlabeled test split)": 1}
    assert run("hellaswag", tmp_path / "raw", tmp_path / "out") == {"train": 1, "test": 2}
    test = read(tmp_path / "out/test.parquet")
    content = test[0]["prompt"][0]["content"]
    assert content.startswith("Removing ice from car: Then, the man writes over")
    assert "smiles. Then\n\nWhich ending" in content  # ctx_b capitalized
    assert "\nD. , the man continues removing the snow on his car.\n" in content
    assert test[0]["reward_model"] == {"style": "rule", "ground_truth": "3"}
    assert test[0]["data_source"] == "Rowan/hellaswag" and test[0]["ability"] == "nlp"
    assert len(test[0]["extra_info"]["endings"]) == 4
    # WikiHow markup cleaned as verl does
    assert test[1]["prompt"][0]["content"].startswith("Home and Garden: How to x. Do y.")
    assert read(tmp_path / "out/train.parquet")[0]["reward_model"]["ground_truth"] == "1"


HH = [
    {
        "chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: Why did the chicken...",
        "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No.",
    },
    {
        "chosen": "\n\nHuman: A\n\nAssistant: B\n\nHuman: C\n\nAssistant: D",
        "rejected": "\n\nHuman: A\n\nAssistant: X\n\nHuman: C\n\nAssistant: D",
    },
]


def test_hh_rlhf_anthropic_gz(tmp_path):
    jsonl(tmp_path / "raw/helpful-base/test.jsonl.gz", HH, gz=True)
    result = convert("hh_rlhf", tmp_path / "raw")
    assert result.skipped == {"chosen and rejected differ before the final response": 1}
    assert run("hh_rlhf", tmp_path / "raw", tmp_path / "out") == {"test": 1}
    row = read(tmp_path / "out/test.parquet")[0]
    assert row["prompt"] == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke"},
    ]
    assert row["reward_model"] == {"style": "model", "ground_truth": "Why did the chicken..."}
    assert row["extra_info"]["rejected"] == "No."
    assert row["data_source"] == "Dahoas/full-hh-rlhf" and row["ability"] == "alignment"


def test_hh_rlhf_dahoas_parquet(tmp_path):
    rec = {
        "prompt": "\n\nHuman: Q1\n\nAssistant: A1\n\nHuman: Q2\n\nAssistant:",
        "response": " R",
        "chosen": " R",
        "rejected": " W",
    }
    parquet(tmp_path / "raw/data/train-00000-of-00001.parquet", [rec])
    assert run("full_hh_rlhf", tmp_path / "raw", tmp_path / "out") == {"train": 1}
    row = read(tmp_path / "out/train.parquet")[0]
    assert [m["role"] for m in row["prompt"]] == ["user", "assistant", "user"]
    assert row["reward_model"]["ground_truth"] == "R"


def test_dialogue_merges_consecutive_turns():
    chat = dialogue_to_chat("\n\nHuman: a\n\nHuman: b\n\nAssistant: c")
    assert chat == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]


def test_outputs_load_in_prompt_dataset(tmp_path):
    jsonl(tmp_path / "raw/test.jsonl", GSM)
    run("gsm8k", tmp_path / "raw", tmp_path / "out")
    ds = PromptDataset([str(tmp_path / "out/test.parquet")], build_char_tokenizer())
    assert [r.ground_truth for r in ds.records] == ["72", "1234", "-5"]


def test_split_of_names_and_folders(tmp_path):
    assert split_of(tmp_path / "main/train-00000-of-00001.parquet", tmp_path) == "train"
    assert split_of(tmp_path / "hellaswag_val.jsonl", tmp_path) == "validation"
    assert split_of(tmp_path / "MATH/test/algebra/1.json", tmp_path / "MATH") == "test"
    assert split_of(tmp_path / "MATH/test/algebra/1.json", tmp_path / "MATH/test") == "test"
    assert split_of(tmp_path / "data/dev.jsonl", tmp_path) == "validation"
    # folders above the input root are not read
    assert split_of(tmp_path / "test_x/raw/q.jsonl", tmp_path / "test_x/raw") is None


def test_errors(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'nope'; known: gsm8k"):
        run("nope", tmp_path, tmp_path / "out")
    with pytest.raises(DataError, match="does not exist"):
        run("gsm8k", tmp_path / "missing", tmp_path / "out")
    jsonl(tmp_path / "raw/questions.jsonl", GSM)
    with pytest.raises(DataError, match="cannot tell the split of .*questions.jsonl"):
        run("gsm8k", tmp_path / "raw/questions.jsonl", tmp_path / "out")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/train.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="train.jsonl line 1: not JSON"):
        run("gsm8k", tmp_path / "bad", tmp_path / "out")


def test_a_bad_jsonl_record_is_named_by_its_line_in_the_file(tmp_path):
    """Before: "Invalid control character at: line 1 column 24", json's line within the
    record, for a record cut short on line 501."""
    path = jsonl(tmp_path / "train.jsonl", GSM[:1] * 500)
    with path.open("a") as f:
        f.write('\n{"question": "Natalia s\n')  # an empty line (skipped, counted), then cut
    with pytest.raises(DataError) as e:
        run("gsm8k", path, tmp_path / "out")
    assert str(e.value) == f"{path} line 502: not JSON (Invalid control character at column 24)"


@pytest.mark.parametrize("name", ["train.jsonl", "train.json"])
def test_a_record_that_is_not_an_object_is_refused_naming_the_file(tmp_path, name):
    """Before: AttributeError: 'list' object has no attribute 'get' (a traceback)."""
    path = tmp_path / name
    path.write_text("[1, 2]\n" if name.endswith(".jsonl") else "[[1, 2]]")
    where = f"{path} line 1" if name.endswith(".jsonl") else str(path)
    with pytest.raises(DataError, match=f"^{where}: a record must be a JSON object, got list$"):
        run("gsm8k", path, tmp_path / "out")


def test_a_gz_file_cut_short_is_a_data_error(tmp_path):
    """Before: an EOFError traceback."""
    path = jsonl(tmp_path / "train.jsonl.gz", GSM * 200, gz=True)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match="cannot read raw file .*train.jsonl.gz: Compressed file"):
        run("gsm8k", path, tmp_path / "out")


def test_registry_names():
    assert set(PREPROCESSORS) >= {"gsm8k", "math", "hellaswag", "hh_rlhf"}


def test_meshrl_preprocess_takes_every_name_the_registry_has():
    # the CLI writes the names out (importing the registry would load pyarrow)
    assert set(cli.PREPROCESS_DATASETS) == set(PREPROCESSORS)


@pytest.mark.parametrize("name", ["hh_rlhf", "full_hh_rlhf"])
def test_meshrl_preprocess_hh_rlhf_by_its_documented_name_and_alias(tmp_path, capsys, name):
    """Before: `meshrl preprocess hh_rlhf` was refused (invalid choice), though docs/data.md
    names it, full_hh_rlhf its alias."""
    jsonl(tmp_path / "raw/helpful-base/test.jsonl.gz", HH, gz=True)
    argv = ["preprocess", name, "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == f"test: 1 rows -> {tmp_path / 'out'}/test.parquet\n"
