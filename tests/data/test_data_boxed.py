import pytest

from meshrl.data.boxed import last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{2}$.", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        (
            "first \\boxed{1} then \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
        ),
        ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("no box here", None),
        ("\\boxed{unclosed {", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected
