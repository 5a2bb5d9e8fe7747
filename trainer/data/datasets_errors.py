"""What `datasets` (and pyarrow and the tokenizer beneath it) raise while the data path works on
a split, as one line naming the split and the cause: a user never reads another library's
traceback (a full cache disk, an Arrow file that cannot be written, a fingerprint `datasets`
refuses), and every rank says the same line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from trainer.errors import DataError, TrainerError, describe

log = logging.getLogger(__name__)


def root_cause(e: BaseException) -> BaseException:
    """The root cause says what is wrong (a JSON parse error and its row, a full disk); the
    wrappers raised from it ("An error occurred while generating the dataset") don't."""
    while e.__cause__ is not None:
        e = e.__cause__
    return e


@contextmanager
def as_data_error(split_key: str, doing: str) -> Iterator[None]:
    """A failure in the body, other than our own one-line errors, as `DataError("SPLIT_KEY:
    DOING: Cause: reason")`. The traceback goes to the debug log, for a maintainer: the body
    is ours too (the map's encode), and a bug there should still be findable."""
    try:
        yield
    except TrainerError:
        raise
    except Exception as e:  # datasets raises many types: ValueError, OSError, pyarrow's
        log.debug("%s: %s failed", split_key, doing, exc_info=True)
        raise DataError(f"{split_key}: {doing}: {describe(root_cause(e))}") from None
