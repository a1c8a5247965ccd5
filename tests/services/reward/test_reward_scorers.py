"""Rule scorers on hand-written responses, hard cases included. Run in-process here; the
pool tests run them in workers."""

import pytest

from services.reward.scorers import gsm8k, hellaswag
from services.reward.scorers import math as math_scorer
from services.reward.scorers.registry import (
    UnknownDataSource,
    family_of,
    get_scorer,
    known_data_sources,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        ("48/2 = 24, 48+24 = 72\n#### 72", "72", 1.0),
        ("so the total is #### 1,234", "1234", 1.0),  # commas stripped
        ("it drops by 5 degrees\n#### -5", "-5", 1.0),  # negative
        ("#### 0.25", "0.25", 1.0),  # decimal
        ("#### 0.250", "0.25", 0.0),  # strings must match, as verl
        ("first guess #### 12 ... wait, recheck #### 13", "13", 1.0),  # the last #### counts
        ("first guess #### 13 ... wait, recheck #### 12", "13", 0.0),
        ("the answer is 72", "72", 0.0),  # strict: no #### at all
        ("", "72", 0.0),
        ("####", "72", 0.0),
        ("#### seventy-two", "72", 0.0),
        # verl's strict reads "#### " and a number, nothing else: each of these scores 0
        ("#### $18", "18", 0.0),
        ("####18", "18", 0.0),
        ("####\n18", "18", 0.0),
        ("#### 72.", "72", 0.0),  # read as "72."
        # only the last 300 characters are read (verl's _SOLUTION_CLIP_CHARS)
        ("#### 18" + " and some more" * 30, "18", 0.0),
        ("#### 18" + "x" * 293, "18", 1.0),  # 300 characters: still read
        ("#### 18" + "x" * 294, "18", 0.0),  # its first "#" cut off
    ],
)
def test_gsm8k_strict_is_verls(response, gt, expected):
    assert gsm8k.compute_score(response, gt) == expected


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        ("#### $18", "18", 1.0),
        ("####18", "18", 1.0),
        ("####\n18", "18", 1.0),
        ("#### 72.", "72", 1.0),  # a sentence's period
        ("#### $1,234", "1234", 1.0),
        ("#### 18" + " and some more" * 30, "18", 1.0),  # the whole response is read
        ("#### 1,234", " 1,234 ", 1.0),  # the ground truth is cleaned the same way
        ("first #### 12, then #### 13", "13", 1.0),
        ("no marker, 18", "18", 0.0),
    ],
)
def test_gsm8k_lenient_reads_what_strict_refuses(response, gt, expected):
    assert gsm8k.compute_score(response, gt, method="lenient") == expected


def test_gsm8k_format_score_only_when_an_answer_was_extracted():
    assert gsm8k.compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("no number", "72", format_score=0.1) == 0.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("the answer is 1,234.", "1,234."),  # as written: verl cleans nothing here
        ("from 3 we go to -7", "-7"),
        ("costs $4.50 in total", "4.50"),
        ("12 apples, then 15.", "15."),
        ("12 apples. Then .", "12"),  # a lone "." is skipped ...
        ("no digits", None),
        ("7" + "x" * 300, None),  # ... and only the last 300 characters are read
    ],
)
def test_gsm8k_flexible_is_verls(response, expected):
    assert gsm8k.extract_answer(response, "flexible") == expected


def test_gsm8k_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="method must be one of strict, flexible, lenient"):
        gsm8k.extract_answer("#### 1", "loose")


@pytest.mark.parametrize(
    ("response", "gt", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        (
            "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            1.0,
        ),
        ("\\boxed{(3,\\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}\\sqrt{3}", 1.0),  # nested braces
        ("guess \\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box counts
        ("guess \\boxed{4} then \\boxed{3}", "4", 0.0),
        ("\\boxed{x^2+1}", "1+x^2", 1.0),
        ("\\boxed{2}", "3", 0.0),
        ("the answer is 2", "2", 0.0),  # no box: no answer
        ("\\boxed{}", "2", 0.0),
        ("\\boxed{2", "2", 0.0),  # never closed
        ("\\boxed{" + "1" * 2000 + "}", "1", 0.0),  # over the answer-length cap
    ],
)
def test_math(response, gt, expected):
    assert math_scorer.compute_score(response, gt) == expected


ENDINGS = [
    "adds wax to the car.",
    "boards a ski lift.",
    "puts on a coat.",
    "keeps removing the snow.",
]


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("D", 1.0),
        ("(D)", 1.0),
        ("d.", 1.0),
        ("3", 1.0),  # the index
        ("The answer is D.", 1.0),
        ("Answer: (D)", 1.0),
        ("answer: 3", 1.0),
        ("Options (A) and (B) are odd; the best is (D)", 1.0),
        ("A man keeps removing the snow.", 1.0),  # the ending's text
        ("The answer is B.", 0.0),
        ("I do not know", 0.0),
    ],
)
def test_hellaswag(response, expected):
    assert hellaswag.compute_score(response, "3", {"endings": ENDINGS}) == expected


@pytest.mark.parametrize(
    ("response", "choice"),
    [
        # "answer is a ..." is the article, not option A: the ending's text decides.
        ("The answer is a man keeps removing the snow.", 3),
        ("I'd answer a different way: he keeps removing the snow.", 3),
        ("The answer is a skier who boards a ski lift.", 1),
        ("The answer is a", 0),  # a letter ending the line is the option
        ("the answer is a.", 0),
        ("The answer is A because he waxes it", 0),  # capital A is the option
        ("Answer: d", 3),
        ("the answer is c because he wears a coat", 2),
        # "a because ..." reads as the article too (the rule knows no word list): not A,
        # and the ending's text, when there is one, decides
        ("Answer: a because he waxes it", None),
        ("Answer: a because he keeps removing the snow.", 3),
        ("Answer: a, because he waxes it", 0),  # punctuation ends the pick: the option
    ],
)
def test_hellaswag_article_a_is_not_option_a(response, choice):
    assert hellaswag.extract_choice(response, ENDINGS) == choice


@pytest.mark.parametrize(
    ("response", "choice"),
    [
        ("a because he waxes it", None),  # a letter and more words is no bare choice
        ("B then D", None),
        ("2 of them", None),
        (" (c) ", 2),  # a bare choice: punctuation and spaces aside
        ("D.", 3),
    ],
)
def test_hellaswag_bare_choice_is_the_whole_response(response, choice):
    assert hellaswag.extract_choice(response) == choice


def test_hellaswag_reads_verl_choices():
    assert hellaswag.compute_score("he boards a ski lift.", "1", {"choices": ENDINGS}) == 1.0


def test_registry_names_and_unknown():
    for name in ["openai/gsm8k", "gsm8k"]:
        assert family_of(name) == "gsm8k"
    for name in [
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math",
    ]:
        assert family_of(name) == "math"
    for name in ["Rowan/hellaswag", "hellaswag"]:
        assert family_of(name) == "hellaswag"
    assert get_scorer("openai/gsm8k")("#### 3", "3", {}) == 1.0
    with pytest.raises(UnknownDataSource) as e:
        family_of("nope/data")
    assert isinstance(e.value, ValueError)
    assert "'nope/data'" in str(e.value) and ", ".join(known_data_sources()) in str(e.value)
