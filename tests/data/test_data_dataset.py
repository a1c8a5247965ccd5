"""PromptDataset: verl-schema parquet -> rendered, tokenized PromptRecords, and its errors."""

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshrl.data.dataset import PromptDataset
from meshrl.data.errors import DataError
from meshrl.testing.char_tokenizer import build_char_tokenizer

pytestmark = pytest.mark.timeout(60)


def verl_row(content, gt="3", source="openai/gsm8k", index=0, **extra):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": gt},
        "extra_info": {"split": "test", "index": index, **extra},
    }


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def small(tmp_path):
    rows = [verl_row("Q: 1+2=", "3", index=0), verl_row("Q: 12+30=", "42", index=1)]
    return write(tmp_path / "small.parquet", rows)


def test_loads_verl_rows_with_chat_template(small, tok):
    ds = PromptDataset([small], tok)
    assert len(ds) == 2
    rec = ds[1]
    # The char tokenizer's template is "<s>" + contents; it wrote the BOS itself.
    assert rec.prompt_text == "<s>Q: 12+30="
    assert rec.prompt_ids == [tok.bos_token_id] + tok.convert_tokens_to_ids(list("Q: 12+30="))
    assert (rec.index, rec.data_source, rec.ground_truth, rec.ability) == (
        1,
        "openai/gsm8k",
        "42",
        "math",
    )
    assert rec.extra_info == {"split": "test", "index": 1}


def test_string_prompt_becomes_one_user_message(tmp_path, tok):
    row = verl_row("x") | {"prompt": "Q: 5="}
    ds = PromptDataset([write(tmp_path / "s.parquet", [row])], tok)
    assert ds[0].prompt_text == "<s>Q: 5="


def test_template_off_joins_contents(tmp_path, tok):
    row = verl_row("x") | {
        "prompt": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    }
    ds = PromptDataset([write(tmp_path / "m.parquet", [row])], tok, apply_chat_template=False)
    assert ds[0].prompt_text == "1\n\n2"
    assert ds[0].prompt_ids == tok("1\n\n2", add_special_tokens=True)["input_ids"]


def test_several_files_index_across_them(tmp_path, tok):
    a = write(tmp_path / "a.parquet", [verl_row("1")])
    b = write(tmp_path / "b.parquet", [verl_row("2"), verl_row("3")])
    ds = PromptDataset([a, b], tok)
    assert [r.index for r in ds.records] == [0, 1, 2]
    assert ds[2].prompt_text == "<s>3"


def test_max_samples(small, tok):
    assert len(PromptDataset([small], tok, max_samples=1)) == 1


def test_max_samples_zero_says_so(small, tok):
    # It used to fail as "all 0 prompts are longer than max_prompt_length".
    with pytest.raises(DataError, match="data.max_samples=0 keeps no prompts"):
        PromptDataset([small], tok, max_samples=0)


def test_filter_drops_overlong_and_counts(tmp_path, tok, caplog):
    rows = [verl_row("1" * 3), verl_row("1" * 20), verl_row("2" * 4)]
    path = write(tmp_path / "f.parquet", rows)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset([path], tok, max_prompt_length=5)
    assert ds.num_dropped == 1
    assert [r.index for r in ds.records] == [0, 2]  # indices stay the rows' own
    assert "dropped 1 of 3" in caplog.text


def test_all_overlong_is_an_error(small, tok):
    with pytest.raises(DataError, match=r"all 2 prompts .* max_prompt_length=3"):
        PromptDataset([small], tok, max_prompt_length=3)


def test_truncation_error_names_the_row(small, tok):
    with pytest.raises(DataError, match=r"small.parquet row 0: prompt is 8 tokens"):
        PromptDataset([small], tok, max_prompt_length=5, filter_overlong_prompts=False)


def test_truncation_left_and_right(small, tok):
    left = PromptDataset(
        [small], tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="left"
    )
    right = PromptDataset(
        [small], tok, max_prompt_length=4, filter_overlong_prompts=False, truncation="right"
    )
    full = PromptDataset([small], tok)[1].prompt_ids
    assert left[1].prompt_ids == full[-4:]
    assert right[1].prompt_ids == full[:4]


def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset([str(tmp_path / "nope.parquet")], tok)


def test_not_parquet_names_file(tmp_path, tok):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet at all")
    with pytest.raises(DataError, match="bad.parquet is not a readable parquet file"):
        PromptDataset([str(bad)], tok)


def test_empty_file(tmp_path, tok):
    schema = pa.Table.from_pylist([verl_row("1")]).schema
    path = tmp_path / "empty.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(DataError, match="empty.parquet holds no rows"):
        PromptDataset([str(path)], tok)


def test_missing_column_names_file_column_and_present(tmp_path, tok):
    row = verl_row("1")
    del row["reward_model"]
    path = write(tmp_path / "nocol.parquet", [row])
    with pytest.raises(DataError) as e:
        PromptDataset([path], tok)
    msg = str(e.value)
    assert "nocol.parquet" in msg and "'reward_model'" in msg
    assert "columns present: data_source, prompt, ability, extra_info" in msg


def test_custom_prompt_key(tmp_path, tok):
    row = verl_row("1")
    row["question"] = row.pop("prompt")
    path = write(tmp_path / "q.parquet", [row])
    with pytest.raises(DataError, match="no column 'prompt'"):
        PromptDataset([path], tok)
    assert PromptDataset([path], tok, prompt_key="question")[0].prompt_text == "<s>1"


def test_tokenizer_without_chat_template(small):
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="data.apply_chat_template=false"):
        PromptDataset([small], tok)
    assert len(PromptDataset([small], tok, apply_chat_template=False)) == 2


def test_verl_hellaswag_rows_int_ground_truth_and_choices(tmp_path, tok):
    # verl's HellaSwag rows: style "model", an int ground truth, the endings in reward_model.
    row = verl_row("1") | {
        "data_source": "Rowan/hellaswag",
        "reward_model": {
            "style": "model",
            "eval": "multiple_choice",
            "ground_truth": 2,
            "choices": ["a", "b", "c", "d"],
        },
    }
    ds = PromptDataset([write(tmp_path / "h.parquet", [row])], tok)
    assert ds[0].ground_truth == "2"
    assert ds[0].extra_info["choices"] == ["a", "b", "c", "d"]


def test_malformed_prompt_names_row(tmp_path, tok):
    row = verl_row("1") | {"prompt": [{"text": "no role"}]}
    with pytest.raises(DataError, match=r"p.parquet row 0: prompt must be a list of"):
        PromptDataset([write(tmp_path / "p.parquet", [row])], tok)


def test_a_message_with_null_content_or_role_names_row_and_message(tmp_path, tok):
    # Before: content null read as "" (a prompt of BOS alone, trained on), role null as "None"
    rows = [verl_row("1"), verl_row("2") | {"prompt": [{"role": "user", "content": None}]}]
    with pytest.raises(DataError, match=r"n.parquet row 1: prompt message 0 has no content"):
        PromptDataset([write(tmp_path / "n.parquet", rows)], tok)
    rows = [verl_row("1") | {"prompt": [{"role": None, "content": "Q: 1+2="}]}]
    with pytest.raises(DataError, match=r"r.parquet row 0: prompt message 0 has no role \(null\)"):
        PromptDataset([write(tmp_path / "r.parquet", rows)], tok)


def test_prompt_of_no_tokens_names_row(tmp_path, tok):
    # A base model's tokenizer that adds no BOS turns an empty prompt into no tokens at all;
    # the rollout refuses it, but only when its batch comes up, mid-run.
    rows = [verl_row("x") | {"prompt": "Q: 1+2="}, verl_row("x") | {"prompt": ""}]
    path = write(tmp_path / "e.parquet", rows)
    with pytest.raises(DataError, match=r"e.parquet row 1: the prompt '' is no tokens"):
        PromptDataset([path], tok, apply_chat_template=False)
    assert len(PromptDataset([path], tok)) == 2  # the template writes a BOS: not empty


def test_rule_row_without_ground_truth_is_a_warning_naming_row(tmp_path, tok, caplog):
    # A misspelt key ("answer" for "ground_truth") would score every response 0, silently;
    # not an error: a custom function or a reward model may need no ground truth.
    rows = [verl_row("1"), verl_row("2") | {"reward_model": {"style": "rule", "answer": "2"}}]
    path = write(tmp_path / "gt.parquet", rows)
    with caplog.at_level("WARNING", logger="meshrl.data.rows"):
        assert len(PromptDataset([path], tok)) == 2
    (record,) = caplog.records
    assert "1 rows of style 'rule' have no reward_model.ground_truth" in record.getMessage()
    assert "gt.parquet row 1 (reward_model keys: style, answer)" in record.getMessage()


def test_a_record_keeps_the_rows_prompt_for_a_reward_model(tmp_path, tok):
    """A reward model renders the prompt with its own chat template, so it needs the row's
    messages, not the policy's rendered text."""
    import json

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = PromptDataset(
        [write(tmp_path / "c.parquet", [verl_row("x") | {"prompt": messages}])], tok
    )
    assert json.loads(chat[0].chat) == messages
    text = PromptDataset(
        [write(tmp_path / "t.parquet", [verl_row("x") | {"prompt": "Q: 5="}])], tok
    )
    assert text[0].chat == "Q: 5="


def test_a_missing_relative_file_says_where_it_was_looked_for(tmp_path, tok, monkeypatch):
    """Through the coordinator service a relative path is read from the service's working
    directory, not the user's: the message shows where."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        PromptDataset(["data/train.parquet"], tok)
    assert str(e.value) == (
        f"data file data/train.parquet does not exist (looked for {tmp_path}/data/train.parquet)"
    )
