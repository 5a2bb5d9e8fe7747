"""errors.one_line: how another library's message enters our one-line errors."""

from trainer.errors import ONE_LINE_LIMIT, one_line


def test_one_line_keeps_the_first_line_with_its_whitespace_collapsed():
    assert one_line(ValueError("\n  bad   value\tin row 3\nTraceback-like detail\n")) == "bad value in row 3"
    assert one_line(OSError()) == ""


def test_one_line_cuts_a_long_message_and_says_so():
    assert one_line(ValueError("x" * ONE_LINE_LIMIT)) == "x" * ONE_LINE_LIMIT
    cut = one_line(ValueError("y" * (ONE_LINE_LIMIT + 1)))
    assert len(cut) == ONE_LINE_LIMIT and cut.endswith("y...")
