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
    from trainer.runtime.environment import DistEnv

    def fail(error: Exception):
        def action():
            raise error
        return action

    with pytest.raises(LaunchError, match=r"^checkpoint step-3: rank 0: OSError: disk full$"):
        distributed.every_rank_does(DistEnv(), "checkpoint step-3", fail(OSError("disk full")))
    with pytest.raises(CheckpointError, match=r"^as it was$"):  # the trainer's own errors keep their kind and words
        distributed.every_rank_does(DistEnv(), "checkpoint step-3", fail(CheckpointError("as it was")))
    assert distributed.every_rank_does(DistEnv(), "x", lambda: 7) == 7


def ranks_of_a_node(monkeypatch, gathered_from_rank_0):
    """Rank 0 and rank 1 of a node of 2 ranks, their barrier passed at once and their all_gather
    answering `gathered_from_rank_0` as rank 0's part. Returns the values each rank gave it."""
    from trainer.runtime import distributed
    from trainer.runtime.environment import DistEnv

    given = []
    monkeypatch.setattr(distributed.dist, "barrier", lambda async_op=False: None)
    monkeypatch.setattr(distributed, "all_gather",
                        lambda dist_env, value: given.append(value) or [gathered_from_rank_0 or value, None])
    return [DistEnv(rank=r, local_rank=r, world_size=2, local_world_size=2, master_addr="localhost", master_port=1)
            for r in (0, 1)], given


def test_a_failure_of_local_rank_0_first_is_one_line_on_every_rank_before_the_others_start(monkeypatch):
    """Local rank 0 fills the node's cache first; where it fails, the node's other ranks raise its
    error instead of running the body, in which they may not meet it (they read its cache, or
    redo its work another way, for minutes) and after which they would wait at a collective it
    never joins."""
    import pytest

    from trainer.errors import DataError, LaunchError
    from trainer.runtime import distributed

    (rank_0, _), given = ranks_of_a_node(monkeypatch, None)
    disk_full = r"^tokenizing: rank 0: OSError: \[Errno 28\] No space left on device$"
    with pytest.raises(LaunchError, match=disk_full), distributed.local_rank_zero_first(rank_0, "tokenizing"):
        raise OSError(28, "No space left on device")
    assert given == [("LaunchError", "tokenizing: rank 0: OSError: [Errno 28] No space left on device")]

    (_, rank_1), _ = ranks_of_a_node(monkeypatch, ("DataError", "data.train_split: tokenizing: OSError: disk"))
    ran = []
    with pytest.raises(DataError, match=r"^data.train_split: tokenizing: OSError: disk$"), \
            distributed.local_rank_zero_first(rank_1, "tokenizing"):
        ran.append("body")
    assert ran == []

    (rank_0, rank_1), given = ranks_of_a_node(monkeypatch, None)
    for rank in (rank_0, rank_1):
        with distributed.local_rank_zero_first(rank, "tokenizing"):
            ran.append(rank.rank)
    assert ran == [0, 1] and given == [None, None]
