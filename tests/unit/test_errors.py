"""errors.one_line: how another library's message enters our one-line errors."""

from trainer.errors import ONE_LINE_LIMIT, one_line


def test_one_line_keeps_the_first_line_with_its_whitespace_collapsed():
    assert one_line(ValueError("\n  bad   value\tin row 3\nTraceback-like detail\n")) == "bad value in row 3"
    assert one_line(OSError()) == ""


def test_one_line_cuts_a_long_message_and_says_so():
    assert one_line(ValueError("x" * ONE_LINE_LIMIT)) == "x" * ONE_LINE_LIMIT
    cut = one_line(ValueError("y" * (ONE_LINE_LIMIT + 1)))
    assert len(cut) == ONE_LINE_LIMIT and cut.endswith("y...")


def test_describe_names_the_type_and_the_first_line():
    from trainer.errors import describe

    assert describe(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
    assert describe(KeyError()) == "KeyError"  # no message: the type alone, no dangling colon
    assert describe(ValueError("a\nb")) == "ValueError: a"


def test_every_rank_does_turns_a_failure_into_one_line_naming_the_rank():
    import pytest

    from trainer.errors import CheckpointError, LaunchError
    from trainer.runtime import distributed
    from trainer.runtime.distributed import DistEnv

    def fail(error: Exception):
        def action():
            raise error
        return action

    with pytest.raises(LaunchError, match=r"^checkpoint step-3: rank 0: OSError: disk full$"):
        distributed.every_rank_does(DistEnv(), "checkpoint step-3", fail(OSError("disk full")))
    with pytest.raises(CheckpointError, match=r"^as it was$"):  # the trainer's own errors keep their kind and words
        distributed.every_rank_does(DistEnv(), "checkpoint step-3", fail(CheckpointError("as it was")))
    assert distributed.every_rank_does(DistEnv(), "x", lambda: 7) == 7
