"""The tool-use learning benchmark's warm start: the tool arm imitates the call and the
answer, never the calculator's response (masked as PPO masks it); the tool-free arm
imitates the demo's answer."""

from benchmarks.learning.tool_use import encode, tool_call_text
from meshrl.testing.char_tokenizer import PRINTABLE_CHARS, build_char_tokenizer


def _imitated(tok, ids, labels):
    return tok.decode(
        [i for i, lab in zip(ids, labels, strict=True) if lab != -100], skip_special_tokens=True
    )


def test_the_tool_arm_imitates_the_call_and_the_answer_not_the_response():
    tok = build_char_tokenizer(PRINTABLE_CHARS)
    ids, labels = encode(tok, "tool", 123, 456)
    text = tok.decode(ids)
    assert "<tool_response>\n579\n</tool_response>" in text
    assert _imitated(tok, ids, labels) == tool_call_text(123, 456) + "#### 579"
    assert labels[-1] == tok.eos_token_id


def test_the_tool_free_arm_imitates_the_whole_answer():
    tok = build_char_tokenizer(PRINTABLE_CHARS)
    ids, labels = encode(tok, "no_tool", 123, 456)
    assert _imitated(tok, ids, labels) == "123+456=579 #### 579"
